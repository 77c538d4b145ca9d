"""`WSMCallback`: Warmup-Stable and Merge during training (arXiv 2507.17634; docs/merging.md, "WSM").

Train at a constant learning rate after warm-up; every `s` optimiser steps the callback snapshots the trainable
weights. It keeps the fp32 window base `B`, the latest snapshot `prev` and a ring of the last `k` deltas
`Δ_i = θ^(i) − θ^(i−1)` (in `delta_dtype`). When a new delta arrives with the ring full, the window slides in O(1)
models: `B ← B + Δ_oldest`. The merge `θ_wsm = B + Σ_i w_i Δ_i` (w from `hf_stable.merging.wsm.wsm_weights`) emulates
a learning-rate decay over the window without running one.

Snapshot grid: steps `t ≥ warm-up` with `(t − window_start) % s == 0`, anchored so the last grid step is
`max_steps`. With `merge_at=("end",)` the grid starts `D = k·s` steps before the end (nothing is copied earlier);
with `"eval"` or `"save"` it starts right after warm-up, and merges made before the window has `k` deltas use the
`m < k` deltas there are (the same decay shape over the shorter window).

State survives: `checkpoint-N/wsm_state/` holds the window (one safetensors file per member + `wsm_state.json`),
written inside the hf_stable trainers' atomic save (`_checkpoint_files`; in `on_save` under other trainers), and a
resumed run (`state.global_step > 0` at `on_train_begin`) reads it back, so resume == uninterrupted.

Distributed: under one process or DDP the replicas are identical, so only the main process keeps the window and
writes; merged evaluation broadcasts the merged tensors to the other ranks. Under FSDP2 / ZeRO-3 every rank keeps the
window of its own shard (the merge is elementwise-linear, so shard-local) and the merged model is consolidated with
`hf_stable.distributed.gather_full_state_dict` (FSDP2/ZeRO-3 paths untested here). Collectives and barriers run on
every rank.

Not implemented: asynchronous device-to-host copies on a side CUDA stream (copies are synchronous),
`source="master"` (the model's parameters are snapshotted), `delta_reference="reconstructed"`, the LoRA modes other
than `"factors"` (adapter factors are averaged like any other trainable tensor), Hub pushes of `wsm-step-N` branches.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable, Sequence
from contextlib import contextmanager

import torch
from safetensors.torch import load_file, save_file
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .. import distributed as dist
from ..merging.wsm import QUADRATURES, wsm_weights
from ._checkpoint_files import CheckpointFiles


logger = logging.getLogger(__name__)

STATE_DIR = "wsm_state"
STATE_JSON = "wsm_state.json"
STATE_VERSION = 1
MERGE_EVENTS = ("end", "eval", "save")
STORAGES = ("cpu", "disk", "auto")
DELTA_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CONSTANT_SCHEDULERS = ("constant", "constant_with_warmup")
AUTO_RAM_FRACTION = 0.5  # storage="auto" keeps the window in RAM when it needs at most this share of available RAM


class _WindowStore:
    """Where the window members live: a dict in RAM (`folder=None`) or one safetensors file each in `folder`."""

    def __init__(self, folder: str | None):
        self.folder = folder
        self._ram: dict[str, dict[str, torch.Tensor]] = {}
        if folder is not None:
            os.makedirs(folder, exist_ok=True)

    def _path(self, key: str) -> str:
        return os.path.join(self.folder, f"{key}.safetensors")

    def put(self, key: str, tensors: dict[str, torch.Tensor]) -> None:
        if self.folder is None:
            self._ram[key] = tensors
            return
        tmp = self._path(key) + ".tmp"
        save_file({n: t.contiguous() for n, t in tensors.items()}, tmp)
        os.replace(tmp, self._path(key))

    def get(self, key: str) -> dict[str, torch.Tensor]:
        return self._ram[key] if self.folder is None else load_file(self._path(key))

    def pop(self, key: str) -> None:
        if self.folder is None:
            self._ram.pop(key, None)
        elif os.path.exists(self._path(key)):
            os.remove(self._path(key))

    def clear(self) -> None:
        self._ram.clear()
        if self.folder is not None and os.path.isdir(self.folder):
            for name in os.listdir(self.folder):
                if name.endswith(".safetensors"):
                    os.remove(os.path.join(self.folder, name))


def _available_ram() -> int | None:
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:  # pragma: no cover - psutil ships with accelerate
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None


class WSMCallback(CheckpointFiles, TrainerCallback):
    """Warmup-Stable and Merge: checkpoint merging that emulates a learning-rate decay (arXiv 2507.17634).

    Args:
        schedule: the decay to emulate: `"1-sqrt"` (default), `"linear"`, `"cosine"`, `"inv_sqrt:a"`, `"exp:b"`,
            `"wsd:r:shape"`, `"ema:a"`, `"uniform"` or a callable `f(τ)` on [0, 1], non-increasing.
        window_steps: merge duration `D` in optimiser steps; default `window_fraction × max_steps`.
        window_fraction: `D / max_steps` when `window_steps` is not given.
        interval_steps: snapshot interval `s`; default `D // num_intervals`. With both `window_steps` and
            `interval_steps`, `k = window_steps // interval_steps`.
        num_intervals: `k`, the number of deltas (k + 1 checkpoints).
        quadrature, floor: how `w` samples the curve (`"mid"`, `"left"`, `"interval_mean"`) and its floor.
        storage: `"cpu"` (RAM), `"disk"` (one safetensors file per member under `output_dir/wsm_window/`, the merge
            streams them one at a time) or `"auto"` (RAM if the window needs at most half the available RAM).
        delta_dtype: `"float32"` (default), `"bfloat16"` or `"float16"` for the k deltas; the base is always fp32.
        merge_at: any of `"end"` (→ `output_dir/<output_subdir>`), `"eval"` (merged evaluation logged as
            `<eval_prefix>_*`; needs `trainer`), `"save"` (→ `checkpoint-N/<output_subdir>`).
        eval_prefix: metric prefix of the merged evaluation.
        output_subdir: folder name of the merged model.
        trainer: the `Trainer`, needed for `merge_at` "eval" (set it after building the trainer:
            `callback.trainer = trainer`); also gives the accelerator and the tokenizer to save.
        push_to_hub, hub_repo_id, hub_private: push `output_dir/<output_subdir>` at train end with
            `hf_stable.merging.hub.push_merged` (main process only).
    """

    # where the window lives in a checkpoint and on disk; a subclass with its own window (MaPCallback) renames them so
    # that both callbacks can run in one trainer
    state_dir, state_json, window_dir = STATE_DIR, STATE_JSON, "wsm_window"

    def __init__(
        self,
        schedule: str | Callable[[float], float] = "1-sqrt",
        window_steps: int | None = None,
        window_fraction: float = 0.1,
        interval_steps: int | None = None,
        num_intervals: int = 8,
        quadrature: str = "mid",
        floor: float = 0.0,
        storage: str = "auto",
        delta_dtype: str = "float32",
        merge_at: Sequence[str] = ("end",),
        eval_prefix: str = "eval_wsm",
        output_subdir: str = "wsm-merged",
        trainer=None,
        push_to_hub: bool = False,
        hub_repo_id: str | None = None,
        hub_private: bool = False,
    ):
        wsm_weights(schedule, max(int(num_intervals), 1), quadrature=quadrature, floor=floor)  # validates early
        if isinstance(merge_at, str):
            merge_at = (merge_at,)
        bad = [m for m in merge_at if m not in MERGE_EVENTS]
        if bad:
            raise ValueError(f"WSMCallback `merge_at` entries must be in {MERGE_EVENTS}, got {bad}.")
        if storage not in STORAGES:
            raise ValueError(f"WSMCallback `storage` must be one of {STORAGES}, got {storage!r}.")
        if delta_dtype not in DELTA_DTYPES:
            raise ValueError(f"WSMCallback `delta_dtype` must be one of {tuple(DELTA_DTYPES)}, got {delta_dtype!r}.")
        if quadrature not in QUADRATURES:
            raise ValueError(f"WSMCallback `quadrature` must be one of {QUADRATURES}, got {quadrature!r}.")
        for field_name, value in (("window_steps", window_steps), ("interval_steps", interval_steps)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"WSMCallback `{field_name}` must be a positive integer or None, got {value!r}.")
        if not isinstance(num_intervals, int) or num_intervals < 1:
            raise ValueError(f"WSMCallback `num_intervals` must be a positive integer, got {num_intervals!r}.")
        if window_steps is None and not 0.0 < window_fraction <= 1.0:
            raise ValueError(f"WSMCallback `window_fraction` must be in (0, 1], got {window_fraction}.")
        if push_to_hub and not hub_repo_id:
            raise ValueError("WSMCallback `push_to_hub=True` needs `hub_repo_id`.")
        if push_to_hub and "end" not in merge_at:
            raise ValueError(
                "WSMCallback `push_to_hub=True` pushes the end-of-training merge: add 'end' to `merge_at`."
            )
        self.schedule, self.quadrature, self.floor = schedule, quadrature, float(floor)
        self.window_steps, self.window_fraction = window_steps, window_fraction
        self.interval_steps, self.num_intervals = interval_steps, num_intervals
        self.storage, self.delta_dtype = storage, delta_dtype
        self.merge_at, self.eval_prefix, self.output_subdir = tuple(merge_at), eval_prefix, output_subdir
        self.trainer = trainer
        self.push_to_hub, self.hub_repo_id, self.hub_private = push_to_hub, hub_repo_id, hub_private
        self.resume_from: str | None = None  # a checkpoint folder to restore from (else found from the state)
        self._reset()

    def _reset(self):
        self.k = self.s = self.D = self.window_start = None
        self.steps: list[int] = []  # steps of the window members: base first, then one per delta (all ranks)
        self.mode = "replicated"
        self._store: _WindowStore | None = None
        self._prev: dict[str, torch.Tensor] | None = None
        self._in_merged_eval = False
        self._storage_used: str | None = None

    # ---- setup -------------------------------------------------------------------------------------------------
    def _accelerator(self):
        return getattr(self.trainer, "accelerator", None) if self.trainer is not None else None

    @property
    def holds_window(self) -> bool:
        """Whether this process keeps window tensors: the main process when replicated, every rank when sharded."""
        return self.mode == "sharded" or dist.is_main_process()

    def _trainable(self, model) -> list[tuple[str, torch.Tensor]]:
        bare = dist.unwrap_model(model, self._accelerator())
        return [(n, p) for n, p in bare.named_parameters() if p.requires_grad]

    def _plan(self, args, state):
        """D, s, k, window start from max_steps."""
        max_steps = state.max_steps
        warmup = args.get_warmup_steps(max_steps)
        k = self.num_intervals
        if self.interval_steps is not None:
            s = self.interval_steps
            if self.window_steps is not None:
                k = max(1, self.window_steps // s)
        else:
            D = self.window_steps if self.window_steps is not None else round(self.window_fraction * max_steps)
            s = max(1, D // k)
        D = k * s
        lower = warmup if any(m in self.merge_at for m in ("eval", "save")) else max(warmup, max_steps - D)
        if max_steps - D < warmup:
            logger.warning(
                f"WSM window of {D} steps (k={k} × s={s}) starts before the end of warm-up ({warmup} steps) within "
                f"max_steps={max_steps}: the final merge uses only the {max(0, (max_steps - warmup) // s)} intervals "
                "after warm-up. Lower `window_steps`/`interval_steps` or train longer."
            )
        self.k, self.s, self.D = k, s, D
        self.window_start = lower + ((max_steps - lower) % s)  # the grid ends exactly at max_steps

    def _check_scheduler(self, args):
        name = getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)
        if name not in CONSTANT_SCHEDULERS:
            logger.warning(
                f"WSMCallback expects a constant learning rate after warm-up, but lr_scheduler_type={name!r}. WSM "
                "emulates the decay by merging, and merging on top of a real decay brings no gain (WSM, arXiv "
                "2507.17634): use lr_scheduler_type='constant_with_warmup'."
            )

    def _choose_storage(self, args, n_params: int):
        itemsize = DELTA_DTYPES[self.delta_dtype].itemsize
        need = (2 * 4 + self.k * itemsize) * n_params  # window base + prev (fp32) + k deltas
        storage = self.storage
        if storage == "auto":
            available = _available_ram()
            storage = "cpu" if available is None or need <= AUTO_RAM_FRACTION * available else "disk"
            logger.info(f"WSM window needs ~{need / 2**20:.1f} MiB; storage='{storage}'.")
        self._storage_used = storage
        folder = None
        if storage == "disk" and self.holds_window:
            suffix = f"-rank{dist.process_index()}" if self.mode == "sharded" else ""
            folder = os.path.join(args.output_dir, f"{self.window_dir}{suffix}")
        self._store = _WindowStore(folder)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._reset()
        self._check_scheduler(args)
        if "eval" in self.merge_at and self.trainer is None:
            raise ValueError("WSMCallback merge_at='eval' needs the trainer: set `callback.trainer = trainer`.")
        bare = dist.unwrap_model(model, self._accelerator())
        self.mode = "sharded" if dist.is_fsdp2(bare) or dist.is_zero3_partitioned(bare) else "replicated"
        self._plan(args, state)
        params = self._trainable(model)
        self._choose_storage(args, sum(dist.local_shard(p).numel() for _, p in params))
        if self._store.folder is not None:
            self._store.clear()
        if state.global_step > 0:
            self._restore(args, state, model)
        elif self.window_start == 0:
            self._snapshot(0, model)

    # ---- the window --------------------------------------------------------------------------------------------
    def _capture(self, model) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            return {
                n: dist.local_shard(p).detach().to(device="cpu", dtype=torch.float32, copy=True)
                for n, p in self._trainable(model)
            }

    def _snapshot(self, step: int, model) -> None:
        if self.holds_window:
            theta = self._capture(model)
            if not self.steps:
                self._store.put("base", {n: t.clone() for n, t in theta.items()})
            else:
                dtype = DELTA_DTYPES[self.delta_dtype]
                self._store.put(f"delta-{step}", {n: (t - self._prev[n]).to(dtype) for n, t in theta.items()})
            self._prev = theta
        self.steps.append(step)
        if len(self.steps) > self.k + 1:  # slide: B ← B + Δ_oldest, drop Δ_oldest
            oldest = self.steps[1]
            if self.holds_window:
                base, delta = self._store.get("base"), self._store.get(f"delta-{oldest}")
                for n, b in base.items():
                    b.add_(delta[n].to(torch.float32))
                self._store.put("base", base)
                self._store.pop(f"delta-{oldest}")
            self.steps = [oldest, *self.steps[2:]]

    def on_step_end(self, args, state, control, model=None, **kwargs):
        step = state.global_step
        if self.s is None or step < self.window_start or (step - self.window_start) % self.s:
            return
        if self.steps and self.steps[-1] == step:
            return
        self._snapshot(step, model)

    def merged_state(self) -> tuple[dict[str, torch.Tensor] | None, list[float]]:
        """`(B + Σ w_i Δ_i as name → fp32 tensor, w)` over the current window (`None` on ranks holding no window).

        With m < k deltas in the window, w is the schedule over m intervals. Raises when the window has no delta.
        """
        m = len(self.steps) - 1
        if m < 1:
            raise ValueError(f"The WSM window has {max(m, 0)} deltas; nothing to merge yet.")
        w, _ = wsm_weights(self.schedule, m, quadrature=self.quadrature, floor=self.floor)
        if not self.holds_window:
            return None, w
        merged = {n: t.clone() for n, t in self._store.get("base").items()}
        for wi, step in zip(w, self.steps[1:], strict=True):
            delta = self._store.get(f"delta-{step}")  # one delta resident at a time (disk storage)
            for n, acc in merged.items():
                acc.add_(delta[n].to(torch.float32), alpha=wi)
        return merged, w

    @contextmanager
    def swapped_in(self, model, merged: dict[str, torch.Tensor] | None, *, broadcast: bool):
        """Within the block the model holds the merged weights; afterwards the original tensors are restored
        bit-exactly. `broadcast=True` (replicated mode, several ranks): the main process's merged tensors are sent to
        every rank (collective). `broadcast=False`: only ranks that have `merged` swap."""
        params = self._trainable(model)
        share = broadcast and self.mode == "replicated" and dist.num_processes() > 1
        originals: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for n, p in params:
                local = dist.local_shard(p)
                if share:
                    buf = merged[n].to(local.device, local.dtype) if merged is not None else torch.empty_like(local)
                    dist.broadcast_(buf, src=0)
                elif merged is None:
                    continue
                else:
                    buf = merged[n]
                originals[n] = local.detach().to("cpu", copy=True)
                local.copy_(buf)
        try:
            yield
        finally:
            with torch.no_grad():
                for n, p in params:
                    if n in originals:
                        dist.local_shard(p).copy_(originals[n])

    # ---- events ------------------------------------------------------------------------------------------------
    def on_evaluate(self, args, state, control, model=None, metrics=None, **kwargs):
        if "eval" not in self.merge_at or self._in_merged_eval or len(self.steps) < 2:
            return
        merged, _ = self.merged_state()
        self._in_merged_eval = True
        try:
            with self.swapped_in(model if model is not None else self.trainer.model, merged, broadcast=True):
                extra = self.trainer.evaluate(metric_key_prefix=self.eval_prefix)
        finally:
            self._in_merged_eval = False
        if metrics is not None:
            metrics.update(extra)

    def _write_checkpoint_files(self, folder, args, state) -> None:
        if self.holds_window and (args.should_save or self.mode == "sharded"):
            self.save_state(folder, state.global_step)

    def on_save(self, args, state, control, model=None, **kwargs):
        super().on_save(args, state, control)  # the window, unless the trainer's atomic save already wrote it
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        if "save" in self.merge_at and len(self.steps) >= 2:
            self._write_merged(args, state, model, os.path.join(folder, self.output_subdir), **kwargs)
        dist.barrier()

    def on_train_end(self, args, state, control, model=None, **kwargs):
        if "end" in self.merge_at:
            if self.k is not None and len(self.steps) - 1 < self.k:
                logger.warning(
                    f"WSM window has {max(len(self.steps) - 1, 0)} of {self.k} deltas at the end of training; "
                    "merging those."
                )
            if len(self.steps) >= 2:
                out = os.path.join(args.output_dir, self.output_subdir)
                self._write_merged(args, state, model, out, **kwargs)
                if self.push_to_hub and dist.is_main_process():
                    from ..merging.hub import push_merged

                    push_merged(out, self.hub_repo_id, private=self.hub_private)
                dist.barrier()
        if self._store is not None and self._store.folder is not None:
            shutil.rmtree(self._store.folder, ignore_errors=True)

    def _write_merged(self, args, state, model, out: str, processing_class=None, **kwargs) -> None:
        from .merge import save_model_folder

        merged, w = self.merged_state()
        accelerator = self._accelerator()
        with self.swapped_in(model, merged, broadcast=False):
            full = dist.gather_full_state_dict(model, accelerator)  # collective under FSDP2 / ZeRO-3
            if full is not None:
                bare = dist.unwrap_model(model, accelerator)
                save_model_folder(bare, out, state_dict=full, processing_class=processing_class, card=self._card(w))
        dist.barrier()

    def _card(self, w: list[float]) -> str:
        m = len(w)
        _, c = wsm_weights(self.schedule, m, quadrature=self.quadrature, floor=self.floor)
        schedule = self.schedule if isinstance(self.schedule, str) else "custom callable"
        return (
            "---\nlibrary_name: transformers\ntags:\n- hf_stable\n- merge\n- wsm\n---\n\n"
            "# WSM-merged checkpoint\n\n"
            "Weights merged with **WSM (Warmup-Stable and Merge, arXiv 2507.17634)** by hf_stable's `WSMCallback`: "
            "training ran at a constant learning rate and the last checkpoints were averaged so that the merge "
            "emulates a learning-rate decay, `θ = θ^(0) + Σ_i w_i Δ_i`.\n\n"
            f"* schedule: `{schedule}` (quadrature `{self.quadrature}`, floor {self.floor})\n"
            f"* k = {m} intervals of s = {self.s} steps (window of {m * self.s} steps), checkpoints at steps "
            f"{self.steps}\n"
            f"* interval multipliers w: {[round(x, 4) for x in w]}\n"
            f"* checkpoint weights c (oldest first): {[round(x, 4) for x in c]}\n"
        )

    # ---- state -------------------------------------------------------------------------------------------------
    def _file_prefix(self) -> str:
        return f"rank{dist.process_index()}-" if self.mode == "sharded" else ""

    def save_state(self, checkpoint_folder: str, global_step: int) -> None:
        """Writes the window into `checkpoint_folder/wsm_state/` (atomic: temp folder + rename)."""
        final = os.path.join(checkpoint_folder, self.state_dir)
        tmp = f"{final}.tmp-{dist.process_index()}"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        prefix = self._file_prefix()
        members = []
        if self.steps:
            members = [("base", self._store.get("base")), ("prev", self._prev)]
            members += [(f"delta-{t}", self._store.get(f"delta-{t}")) for t in self.steps[1:]]
        for key, tensors in members:
            save_file({n: t.contiguous() for n, t in tensors.items()}, os.path.join(tmp, f"{prefix}{key}.safetensors"))
        meta = {
            "version": STATE_VERSION,
            "global_step": global_step,
            "steps": self.steps,
            "k": self.k,
            "s": self.s,
            "window_start": self.window_start,
            "delta_dtype": self.delta_dtype,
            "schedule": self.schedule if isinstance(self.schedule, str) else "callable",
        }
        with open(os.path.join(tmp, f"{prefix}{self.state_json}"), "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=2)
        os.makedirs(final, exist_ok=True)  # sharded: several ranks add their files to one folder
        for name in os.listdir(tmp):
            os.replace(os.path.join(tmp, name), os.path.join(final, name))
        shutil.rmtree(tmp, ignore_errors=True)

    def _candidates(self, args, state) -> list[str]:
        found = [self.resume_from, getattr(args, "resume_from_checkpoint", None)]
        found.append(os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"))
        return [os.fspath(c) for c in found if isinstance(c, (str, os.PathLike))]

    def _restore(self, args, state, model) -> None:
        """Reads the window of the checkpoint the trainer resumed from (its global step must match)."""
        meta = None
        if self.holds_window:
            prefix = self._file_prefix()
            for folder in self._candidates(args, state):
                path = os.path.join(folder, self.state_dir, f"{prefix}{self.state_json}")
                if os.path.isfile(path):
                    with open(path, encoding="utf-8") as f:
                        candidate = json.load(f)
                    if candidate.get("global_step") == state.global_step:
                        meta, source = candidate, os.path.join(folder, self.state_dir)
                        break
            if meta is not None:
                if (meta["k"], meta["s"], meta["window_start"]) != (self.k, self.s, self.window_start):
                    raise ValueError(
                        f"The WSM state in {source} was saved with k={meta['k']}, s={meta['s']}, window_start="
                        f"{meta['window_start']}, but this run plans k={self.k}, s={self.s}, window_start="
                        f"{self.window_start}: resume with the same WSMCallback settings and max_steps."
                    )
                if meta["steps"]:
                    self._store.put("base", load_file(os.path.join(source, f"{prefix}base.safetensors")))
                    self._prev = load_file(os.path.join(source, f"{prefix}prev.safetensors"))
                    for t in meta["steps"][1:]:
                        self._store.put(
                            f"delta-{t}", load_file(os.path.join(source, f"{prefix}delta-{t}.safetensors"))
                        )
                self.steps = list(meta["steps"])
            elif self.window_start <= state.global_step:
                logger.warning(
                    f"Resuming at step {state.global_step} without a WSM state ({self.state_dir}/ in the checkpoint): "
                    "the WSM window restarts now and the merge will cover fewer intervals."
                )
        if self.mode == "replicated":
            self.steps = dist.broadcast_object(self.steps, src=0)  # the other ranks track the members' steps
        if not self.steps and self.window_start <= state.global_step:
            # no saved window: start one at the current step if it is on the grid
            if (state.global_step - self.window_start) % self.s == 0:
                self._snapshot(state.global_step, model)
