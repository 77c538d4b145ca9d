"""Merging at the end of training: `MergeOnTrainEndCallback` merges the trained model with a
base and/or a pool of saved checkpoints with any `MERGE_METHODS` method, and `PushMergedToHubCallback` pushes a merged
folder to the Hub.

Small models are merged in memory (`hf_stable.merging.reference.merge_state_dicts`, whole tensors resident); larger
ones go through the streaming engine (`hf_stable.merging.engine.merge`) on saved folders, within `memory_budget`.
Only the main process reads and writes; the final weights are gathered with `hf_stable.distributed` (collective).
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Sequence

import torch
from transformers import TrainerCallback

from .. import distributed as dist


logger = logging.getLogger(__name__)

MERGE_MODES = ("auto", "memory", "engine")
INITIAL_SUBDIR = "merge-initial"  # where base="initial" keeps the weights at the start of training


def save_model_folder(
    model,
    out: str,
    *,
    state_dict: dict[str, torch.Tensor] | None = None,
    processing_class=None,
    card: str | None = None,
) -> str:
    """`model.save_pretrained(out, state_dict=...)` (safetensors) + tokenizer + `README.md`, written into a temporary
    folder and renamed into place, so `out` is either the old folder or the complete new one."""
    out = os.path.abspath(out)
    tmp, old = f"{out}.tmp", f"{out}.old"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, state_dict=state_dict)
    if processing_class is not None and hasattr(processing_class, "save_pretrained"):
        processing_class.save_pretrained(tmp)
    if card is not None:
        with open(os.path.join(tmp, "README.md"), "w", encoding="utf-8") as f:
            f.write(card)
    if os.path.exists(out):
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)
    return out


def _load_folder_state(folder: str) -> dict[str, torch.Tensor]:
    """All tensors of a safetensors model folder (single file or sharded)."""
    from safetensors.torch import load_file

    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"{folder} holds no .safetensors weights to merge.")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(load_file(os.path.join(folder, name)))
    return state


def _drop_tied_duplicates(model, full: dict, others: list[dict]) -> dict:
    """`state_dict()` lists tied weights under every name, `save_pretrained` keeps one: drop the names the saved
    inputs lack when they are tied (same storage as a kept name); other mismatches are left to the merge."""
    missing = {n for n in full if any(n not in o for o in others)}
    if not missing:
        return full
    live = dict(model.state_dict(keep_vars=True))
    kept_ptrs = {live[n].data_ptr() for n in full if n not in missing and n in live}
    tied = {n for n in missing if n in live and live[n].data_ptr() in kept_ptrs}
    return {n: t for n, t in full.items() if n not in tied}


def _budget_bytes(memory_budget) -> int:
    from ..merging.compat import parse_size

    return parse_size(memory_budget)


class MergeOnTrainEndCallback(TrainerCallback):
    """At the end of training, merge the trained model with a pool of checkpoints and/or a base, and write the
    result to `output_dir/<output_subdir>`.

    The merge inputs are, in order, `[trained model, *pool]`; `base` is the base of task-vector methods.

    Args:
        method: a `hf_stable.merging.methods.MERGE_METHODS` name (`"linear"`, `"ties"`, `"fisher_rao"`, ...).
        base: `None`, a model folder, or `"initial"`: the weights at the start of training (saved at train begin to
            `output_dir/merge-initial/`, so a resumed run finds them).
        pool: other model folders (safetensors) to merge with the trained model.
        weights: one weight per input (`[trained, *pool]`); default equal.
        params: method parameters (e.g. `{"density": 0.5}` for TIES).
        output_subdir: folder under `output_dir`.
        memory_budget: the engine's budget; `mode="auto"` merges in memory when all inputs in fp32 fit in it.
        mode: `"auto"`, `"memory"` (reference implementation, whole tensors) or `"engine"` (streaming, on folders).
        seed: seed of random methods (DARE).
    """

    def __init__(
        self,
        method: str = "linear",
        base: str | None = None,
        pool: Sequence[str] = (),
        weights: Sequence[float] | None = None,
        params: dict | None = None,
        output_subdir: str = "merged",
        memory_budget: str | int = "2GB",
        mode: str = "auto",
        seed: int = 0,
    ):
        if isinstance(pool, (str, os.PathLike)):
            pool = [pool]
        if not isinstance(method, str) or not method:
            raise ValueError(f"MergeOnTrainEndCallback `method` must be a MERGE_METHODS name, got {method!r}.")
        if mode not in MERGE_MODES:
            raise ValueError(f"MergeOnTrainEndCallback `mode` must be one of {MERGE_MODES}, got {mode!r}.")
        if not pool and base is None:
            raise ValueError("MergeOnTrainEndCallback needs a `pool` of checkpoints and/or a `base` to merge with.")
        if weights is not None and len(weights) != len(pool) + 1:
            raise ValueError(
                f"MergeOnTrainEndCallback `weights` needs one weight per input (the trained model + {len(pool)} pool "
                f"models = {len(pool) + 1}), got {len(weights)}."
            )
        for path in pool:
            if not os.path.isdir(path):
                raise ValueError(f"MergeOnTrainEndCallback `pool` entry {path!r} is not a folder.")
        if base not in (None, "initial") and not os.path.isdir(base):
            raise ValueError(f"MergeOnTrainEndCallback `base` must be None, 'initial' or a folder, got {base!r}.")
        self.method, self.base, self.pool = method, base, [os.fspath(p) for p in pool]
        self.weights = None if weights is None else [float(w) for w in weights]
        self.params, self.output_subdir = dict(params or {}), output_subdir
        self.memory_budget, self.mode, self.seed = memory_budget, mode, seed
        self.output_dir: str | None = None  # set after the merge is written

    def on_train_begin(self, args, state, control, model=None, processing_class=None, **kwargs):
        if self.base != "initial":
            return
        folder = os.path.join(args.output_dir, INITIAL_SUBDIR)
        if state.global_step > 0:
            if dist.is_main_process() and not os.path.isdir(folder):
                raise ValueError(f"Resumed run: base='initial' needs the start-of-training weights in {folder}.")
            return
        full = dist.gather_full_state_dict(model)
        if full is not None:
            save_model_folder(dist.unwrap_model(model), folder, state_dict=full, processing_class=processing_class)
        dist.barrier()

    def _base_folder(self, args) -> str | None:
        return os.path.join(args.output_dir, INITIAL_SUBDIR) if self.base == "initial" else self.base

    def on_train_end(self, args, state, control, model=None, processing_class=None, **kwargs):
        full = dist.gather_full_state_dict(model)  # collective
        if full is not None:
            out = os.path.join(args.output_dir, self.output_subdir)
            bare = dist.unwrap_model(model)
            n_inputs = len(self.pool) + 1 + (self.base is not None)
            need = n_inputs * sum(t.numel() * 4 for t in full.values() if t.is_floating_point())
            use_memory = self.mode == "memory" or (self.mode == "auto" and need <= _budget_bytes(self.memory_budget))
            if use_memory:
                self._merge_in_memory(args, bare, full, out, processing_class)
            else:
                self._merge_with_engine(args, bare, full, out, processing_class)
            self.output_dir = out
            logger.info(f"Merged ({self.method}) model written to {out}.")
        dist.barrier()

    def _merge_in_memory(self, args, bare, full, out, processing_class) -> None:
        from ..merging.reference import merge_state_dicts

        others = [_load_folder_state(p) for p in self.pool]
        base_folder = self._base_folder(args)
        base = _load_folder_state(base_folder) if base_folder is not None else None
        full = _drop_tied_duplicates(bare, full, [*others, *([base] if base is not None else [])])
        states = [full, *others]
        merged = merge_state_dicts(
            self.method, states, base=base, weights=self.weights, params=self.params, seed=self.seed
        )
        dtypes = {n: t.dtype for n, t in full.items()}
        merged = {n: t.to(dtypes.get(n, t.dtype)) for n, t in merged.items()}
        save_model_folder(bare, out, state_dict=merged, processing_class=processing_class, card=self._card(args, out))

    def _merge_with_engine(self, args, bare, full, out, processing_class) -> None:
        from ..merging.config import MergeConfig
        from ..merging.engine import merge

        final = os.path.join(args.output_dir, "merge-final-weights")
        save_model_folder(bare, final, state_dict=full, processing_class=processing_class)
        try:
            recipe = MergeConfig.from_dict(self._recipe(args, final))
            merge(recipe, out, memory_budget=self.memory_budget, progress=False, overwrite=True)
        finally:
            shutil.rmtree(final, ignore_errors=True)

    def _recipe(self, args, trained: str) -> dict:
        """The merge as a recipe (the card's and the engine's): the trained model first, then the pool."""
        models = []
        for i, path in enumerate([trained, *self.pool]):
            entry = {"model": path}
            if self.weights is not None:
                entry["parameters"] = {"weight": self.weights[i]}
            models.append(entry)
        recipe = {"merge_method": self.method, "models": models, "parameters": dict(self.params), "seed": self.seed}
        base_folder = self._base_folder(args)
        if base_folder is not None:
            recipe["base_model"] = base_folder
        return recipe

    def _card(self, args, out: str) -> str:
        """The same card builder as `hf-stable merge` (local paths named by folder, Hub ids in `base_model`)."""
        from ..merging.card import merge_model_card

        return merge_model_card(self._recipe(args, args.output_dir), {"output_dir": out})


class PushMergedToHubCallback(TrainerCallback):
    """At the end of training, push `output_dir/<subdir>` (e.g. `wsm-merged`, `merged`) to `repo_id` with
    `hf_stable.merging.hub.push_merged`, on the main process only. Put it after the callback that writes the folder.

    Args:
        repo_id: the Hub repository.
        subdir: the merged folder under `output_dir`.
        private, revision, commit_message: passed to `push_merged`.
        token: a Hub token (default: the logged-in one); never written anywhere.
        api: an `HfApi` instance (tests pass their own).
    """

    def __init__(
        self,
        repo_id: str,
        subdir: str = "merged",
        *,
        private: bool = False,
        revision: str | None = None,
        commit_message: str | None = None,
        token: str | None = None,
        api=None,
    ):
        if not isinstance(repo_id, str) or not repo_id:
            raise ValueError(f"PushMergedToHubCallback `repo_id` must be a Hub repository id, got {repo_id!r}.")
        self.repo_id, self.subdir, self.private, self.revision = repo_id, subdir, private, revision
        self.commit_message, self._token, self.api = commit_message, token, api
        self.result = None

    def __repr__(self) -> str:  # keeps the token out of logs
        return f"PushMergedToHubCallback(repo_id={self.repo_id!r}, subdir={self.subdir!r})"

    def on_train_end(self, args, state, control, **kwargs):
        if dist.is_main_process():
            folder = os.path.join(args.output_dir, self.subdir)
            if not os.path.isdir(folder):
                raise ValueError(f"PushMergedToHubCallback: {folder} does not exist; nothing to push.")
            from ..merging.hub import push_merged

            extra = {"commit_message": self.commit_message} if self.commit_message else {}
            self.result = push_merged(
                folder,
                self.repo_id,
                private=self.private,
                revision=self.revision,
                token=self._token,
                api=self.api,
                **extra,
            )
        dist.barrier()
