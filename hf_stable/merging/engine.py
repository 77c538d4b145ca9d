"""The streaming merge engine: `merge(config, out_dir)`.

One pass through the package: the recipe (`config`) → the compatibility checks and the plan (`compat`, `plan`,
headers only) → the ring (`ring`: one I/O thread reads chunk k+1 while this thread combines chunk k, and writes
chunk k−1) → the streaming writer (`io.writer`) into `OUT.tmp/` → config and tokenizer files, the recipe
`hf_stable_merge.yaml` and the model card `README.md` (`card`) → an atomic rename to `OUT`.

Arithmetic: inputs are read in their stored dtype and converted to fp32 in cache-sized pieces (`plan.PIECE_ELEMS`);
Gram matrices, norms and sums accumulate in fp64; each output element is rounded once to the output dtype. Every
per-element operation is the same whatever the chunk and piece sizes, so the output does not depend on the memory
budget (bitwise for every method whose coefficients need no Gram; Gram methods accumulate in fixed fp64 blocks,
bitwise too unless a tiny budget shrinks the block).

Failure semantics: recipe, compatibility, pickle and budget errors are raised while planning, before any folder is
created. Non-finite values are found once, on what the combine produces (a NaN or inf in any input propagates to
it, even at weight 0) or on the Gram's diagonal; only then are the inputs re-scanned, to name the model and tensor.
On any error, a full disk or Ctrl-C, `OUT.tmp` is removed and `OUT` is left as it was. A killed process leaves at
most `OUT.tmp` (removed by the next run); `OUT` only ever appears complete (atomic `rename`).
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ._copy import check_tokenizer_source, copy_side_files
from .card import CARD_FILE, RECIPE_FILE, merge_model_card, write_merge_card
from .compat import check_equal_nonfloat, parse_size
from .config import MergeConfig, load_recipe_dict
from .gram import GramAccumulator
from .io.dtypes import torch_dtype
from .io.reader import SafetensorsReader
from .io.writer import OutputSpec, StreamingSafetensorsWriter
from .methods.base import ElementwiseMethod, round_
from .plan import RING_SLOTS, MergePlan, TensorPlan, build_plan
from .quantile import RadixSelect
from .ring import IOThread, Slot


DEFAULT_MEMORY_BUDGET = "2GB"
RECIPE_NAME = RECIPE_FILE
# Test hook: seconds to sleep after each combined chunk, so a test can kill or interrupt a merge mid-write.
_TEST_SLEEP_ENV = "HF_STABLE_MERGE_TEST_SLEEP"


@dataclass
class MergeResult:
    """What `merge` did.

    Attributes:
        output_dir: the merged model folder (`None` for a dry run).
        per_tensor_stats: with `diagnose=True`, `{name: {"gram": (N, N) float64 (weights space), "cross": (N,)
            float64 = <x_i, out>, "out_sq": float = ||out||², "weights": list | None}}` for merged tensors.
        timings: seconds: `plan`, `read`/`write` (the I/O thread's time in pread/pwrite), `compute` (this thread),
            `finalize`, `total`.
        bytes_read, bytes_written: tensor bytes read from the inputs / written to the output.
        peak_tracked_bytes: bytes of the engine's preallocated buffers (ring, scratch, Gram staging, raw cache):
            what `memory_budget` bounds.
        plan: the `MergePlan` (also the whole result of a dry run).
        config: the recipe that was run.
    """

    output_dir: str | None
    per_tensor_stats: dict[str, dict[str, Any]]
    timings: dict[str, float]
    bytes_read: int
    bytes_written: int
    peak_tracked_bytes: int
    plan: MergePlan | None
    config: MergeConfig | None = None


def _load_recipe(config: MergeConfig | dict | str | os.PathLike) -> MergeConfig | dict:
    """A `MergeConfig`; data-driven recipes (`fw_merging`, their own schema) stay plain dicts."""
    if isinstance(config, MergeConfig):
        return config
    if isinstance(config, (str, os.PathLike)):
        config = load_recipe_dict(config)
    if isinstance(config, dict):
        from .methods import get_merge_method

        if get_merge_method(config.get("merge_method") or "linear").data_driven:
            return config
        return MergeConfig.from_dict(config)
    raise TypeError(f"config must be a MergeConfig, a dict or a YAML path/string, got {type(config).__name__}")


def check_output_folder(out: Path, overwrite: bool) -> None:
    """Refuse an output that exists (unless `overwrite`) and any output that is a regular file."""
    if out.exists() or out.is_symlink():
        if not out.is_dir():
            raise FileExistsError(
                f"{out} exists and is not a folder; refusing to replace a file (even with overwrite)"
            )
        if not overwrite:
            raise FileExistsError(f"{out} already exists; pass overwrite=True (CLI: --overwrite) to replace it")


def merge(
    config: MergeConfig | dict | str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    memory_budget: int | str | None = None,
    dry_run: bool = False,
    diagnose: bool = False,
    progress: bool = True,
    allow_pickle: bool | None = None,
    overwrite: bool = False,
    hub_model_id: str | None = None,
    before_publish: Callable[[Path, MergeResult], Mapping[str, Any] | None] | None = None,
) -> MergeResult:
    """Merge the recipe's models into `out_dir` (a transformers-loadable folder with its model card).

    Args:
        config: a `MergeConfig`, a recipe dict, or a YAML path/string (mergekit `models:`/`slices:` superset).
        out_dir: output folder; written as `out_dir.tmp` and renamed when complete (weights, config and tokenizer
            files, `hf_stable_merge.yaml`, `README.md`).
        memory_budget: ceiling on the engine's buffers, bytes or a size string ("2GB", "512MiB"); default the
            recipe's `memory_budget`, else 2GB. The buffers do not grow with it past what a merge needs.
        dry_run: plan only: returns the plan (tensors, chunks, passes, bytes) and writes nothing.
        diagnose: accumulate per-tensor statistics (`MergeResult.per_tensor_stats`) for collapse diagnostics.
        progress: show a tqdm bar (bytes read; throughput against the measured read bandwidth).
        allow_pickle: accept `pytorch_model.bin` inputs (default: the recipe's `allow_pickle`).
        overwrite: replace an existing output folder (never a regular file).
        hub_model_id: the repository the card's loading snippet names.
        before_publish: `fn(tmp_folder, result) -> diagnostics summary | None`, run on the complete folder before the
            card is written and the folder renamed (the CLI's diagnostics).

    Raises:
        ValueError: bad recipe, incompatible models, pickle inputs without `allow_pickle`, budget too small,
            non-finite input values (naming model and tensor).
        FileExistsError: `out_dir` exists and `overwrite=False`, or it is a file.
        OSError: the disk is full (nothing is published).
    """
    t_start = time.perf_counter()
    config = _load_recipe(config)
    out = Path(out_dir)
    if isinstance(config, dict) or config.is_data_driven:
        return _merge_data_driven(config, out, memory_budget=memory_budget, dry_run=dry_run, diagnose=diagnose,
                                  progress=progress, allow_pickle=allow_pickle, overwrite=overwrite,
                                  hub_model_id=hub_model_id, before_publish=before_publish)  # fmt: skip
    budget = parse_size(
        memory_budget if memory_budget is not None else (config.memory_budget or DEFAULT_MEMORY_BUDGET)
    )
    allow_pickle = config.allow_pickle if allow_pickle is None else bool(allow_pickle)
    if not dry_run:
        check_output_folder(out, overwrite)

    plan = build_plan(config, budget, allow_pickle=allow_pickle, diagnose=diagnose)
    input_dirs = {Path(ck.folder).resolve() for ck in plan.checkpoints.values()}
    if out.resolve() in input_dirs:  # overwrite=True would delete an input
        raise ValueError(f"output folder {out} is one of the input models; choose another out_dir")
    check_tokenizer_source(config, plan)

    readers = {label: SafetensorsReader(ck, drop_cache=config.drop_cache) for label, ck in plan.checkpoints.items()}
    try:
        if not plan.config_overrides:  # whole models: a copied (non-float) tensor must be the same in all of them
            check_equal_nonfloat(readers, [t.name for t in plan.tensors if t.action == "copy"])
        timings = {"plan": time.perf_counter() - t_start}
        if dry_run:
            timings["total"] = time.perf_counter() - t_start
            return MergeResult(None, {}, timings, 0, 0, 0, plan, config)
        with _steady_allocator():
            result = _Execution(config, plan, readers, out, overwrite, diagnose, progress, timings).run(
                hub_model_id, before_publish
            )
    finally:
        for r in readers.values():
            r.close()
    result.timings["total"] = time.perf_counter() - t_start
    return result


def _merge_data_driven(config: MergeConfig | dict, out: Path, *, hub_model_id, before_publish, **kwargs) -> Any:
    """`merge_method: fw_merging` (data-driven) runs in `hf_stable.merging.fw.fw_merge_from_config`.

    The engine-only options (dry run, per-tensor diagnostics, memory budget, pickle inputs) do not apply to it:
    setting one raises `ValueError` naming it rather than being silently ignored.
    """
    from .fw import fw_merge_from_config

    method = config.get("merge_method") if isinstance(config, dict) else config.merge_method
    engine_only = dict(memory_budget=None, dry_run=False, diagnose=False, allow_pickle=None)
    for key, default in engine_only.items():
        value = kwargs.pop(key, default)
        if value != default:
            raise ValueError(
                f"merge_method {method!r}: {key}={value!r} applies to the streaming engine only; FW-Merging "
                "materialises the model to take gradients (see docs/merging.md, fw_merging)"
            )
    check_output_folder(out, kwargs.get("overwrite", False))
    recipe = config.to_dict() if isinstance(config, MergeConfig) else config

    def write_card(folder: Path, history: Any) -> None:
        result = {"output_dir": str(out), "history": history}
        summary = before_publish(folder, result) if before_publish is not None else None
        write_merge_card(folder, merge_model_card(recipe, result, summary, hub_model_id=hub_model_id))

    return fw_merge_from_config(recipe, out, write_card=write_card, **kwargs)


# --------------------------------------------------------------------------------------------------------- execution


@dataclass
class _Job:
    tensor: TensorPlan
    phase: str  # "gram", "kth_high", "kth_low", "sums", "combine", "copy"
    chunk: int
    rows: tuple[int, int]
    last: bool  # last chunk of its phase
    final: bool  # last job of its tensor
    fills_cache: bool = False
    read_bytes: int = 0


@dataclass
class _State:
    gram: GramAccumulator | None = None
    coefficients: torch.Tensor | None = None
    selectors: list[RadixSelect | None] | None = None
    thresholds: torch.Tensor | None = None
    sums: Any = None
    ties: list | None = None
    stats: dict[str, Any] | None = None
    checked: bool = False


def _jobs(plan: MergePlan):
    for tp in plan.tensors:
        if tp.action == "copy":
            for i, rows in enumerate(tp.chunks):
                yield _Job(tp, "copy", i, rows, i == len(tp.chunks) - 1, i == len(tp.chunks) - 1)
            continue
        phases = [*tp.passes, "combine"]
        for p, phase in enumerate(phases):
            for i, rows in enumerate(tp.chunks):
                last = i == len(tp.chunks) - 1
                yield _Job(tp, phase, i, rows, last, last and p == len(phases) - 1, tp.cached and p == 0 and i == 0)


class _Execution:
    """One merge run: allocates the buffers, drives the ring, combines chunks, finalises the folder."""

    def __init__(self, config, plan: MergePlan, readers, out: Path, overwrite, diagnose, progress, timings):
        self.config, self.plan, self.readers = config, plan, readers
        self.out, self.overwrite, self.diagnose, self.timings = out, overwrite, diagnose, timings
        self.bar = _progress_bar(plan.bytes_to_read, progress)
        self.sleep = float(os.environ.get(_TEST_SLEEP_ENV, "0") or 0)
        self.states: dict[str, _State] = {}
        self.stats: dict[str, dict[str, Any]] = {}
        self.compute_s = 0.0
        self._t0 = time.perf_counter()
        self._last_postfix = 0.0
        p, n = plan.piece_elems, max(plan.max_inputs, 1)
        self.acc = torch.empty(p, dtype=torch.float32)
        self.scr = torch.empty(p, dtype=torch.float32)
        self.basef = torch.empty(p, dtype=torch.float32)
        self.vbuf = torch.empty(n, p, dtype=torch.float32)
        self.cache = torch.empty(plan.cache_bytes, dtype=torch.uint8)
        self.cache_lock = threading.Semaphore(1)
        self.cache_offsets: dict[str, list[int]] = {}
        u8 = torch.uint8
        self.slots = [
            Slot(torch.empty(plan.slot_in_bytes, dtype=u8), torch.empty(plan.slot_out_bytes, dtype=u8))
            for _ in range(RING_SLOTS)
        ]

    # -- I/O (runs in the I/O thread) -------------------------------------------------------------------------

    def _read(self, job: _Job, slot: Slot) -> list[torch.Tensor]:
        tp = job.tensor
        a, b = job.rows
        infos = [self.plan.checkpoints[s.label].tensors[s.name] for s in tp.sources]
        if tp.cached:
            if job.fills_cache:
                offsets, off = [], 0
                for info in infos:
                    offsets.append(off)
                    off += info.nbytes
                self.cache_offsets[tp.name] = offsets
            offsets = self.cache_offsets[tp.name]
            views = []
            for s, info, off in zip(tp.sources, infos, offsets, strict=True):
                buf = self.cache[off + a * info.row_nbytes : off + b * info.row_nbytes]
                if job.phase == tp.passes[0]:
                    views.append(self.readers[s.label].read_rows(s.name, a, b, out=buf))
                    job.read_bytes += buf.numel()
                else:
                    views.append(buf.view(torch_dtype(info.dtype)).reshape((b - a, *info.shape[1:])))
            return views
        views, off = [], 0
        for s, info in zip(tp.sources, infos, strict=True):
            nbytes = (b - a) * info.row_nbytes
            views.append(self.readers[s.label].read_rows(s.name, a, b, out=slot.raw[off : off + nbytes]))
            off += nbytes
            job.read_bytes += nbytes
        return views

    # -- the run ------------------------------------------------------------------------------------------------

    def run(self, hub_model_id, before_publish) -> MergeResult:
        plan, out = self.plan, self.out
        tmp = out.with_name(out.name + ".tmp")
        if tmp.exists():  # left by a killed run: never trusted
            shutil.rmtree(tmp)
        specs = [OutputSpec(t.name, t.out_dtype, t.shape) for t in plan.tensors]
        writer = io = None
        ok = False
        try:
            tmp.mkdir(parents=True)
            writer = StreamingSafetensorsWriter(tmp, specs, plan.max_shard_size, metadata={"format": "pt"})
            io = IOThread(_jobs(plan), self.slots, self._read, writer.write_rows, self.cache_lock)
            for slot in io:
                t0 = time.perf_counter()
                self._process(slot.job, slot)
                self.compute_s += time.perf_counter() - t0
                self._progress(slot.job.read_bytes, io)
                io.give_back(slot)
                if self.sleep and slot.job.phase == "combine":
                    time.sleep(self.sleep)
            io.finish()
            t0 = time.perf_counter()
            writer.finalize()
            copy_side_files(self.config, plan, tmp)
            (tmp / RECIPE_FILE).write_text(self.config.to_yaml(redact=True), encoding="utf-8")
            self.timings.update(read=round(io.read_s, 6), write=round(io.write_s, 6), compute=round(self.compute_s, 6))
            result = MergeResult(str(out), self.stats, self.timings, io.read_bytes, writer.bytes_written,
                                 plan.allocated_bytes, plan, self.config)  # fmt: skip
            summary = before_publish(tmp, result) if before_publish is not None else None
            write_merge_card(tmp, merge_model_card(self.config, result, summary, hub_model_id=hub_model_id))
            _publish(tmp, out, self.overwrite)
            self.timings["finalize"] = time.perf_counter() - t0
            ok = True
        finally:
            if io is not None and not ok:
                io.close()
            if self.bar is not None:
                self.bar.close()
            if not ok:
                if writer is not None:
                    writer.abort()
                shutil.rmtree(tmp, ignore_errors=True)
        return result

    # -- compute (this thread) ----------------------------------------------------------------------------------

    def _process(self, job: _Job, slot: Slot) -> None:
        tp = job.tensor
        a, b = job.rows
        if job.phase == "copy":
            slot.pending = (tp.name, a, slot.views[0].contiguous())
            return
        state = self.states.setdefault(tp.name, _State())
        xs = [v.reshape(-1) for v in slot.views]
        if tp.compute_dtype in _ROUNDED:  # mergekit casts every input to the recipe's dtype when it loads it
            cdt = torch_dtype(tp.compute_dtype)
            xs = [x if x.dtype == cdt else x.to(cdt) for x in xs]
        n = xs[0].numel()
        offset = a * tp.row_numel
        if job.phase == "gram":
            self._gram_chunk(tp, state, xs, n, (a, b))
        elif job.phase == "combine":
            out = slot.out[: n * _itemsize(tp.out_dtype)].view(torch_dtype(tp.out_dtype))
            if tp.kind == "gram":
                self._combine_gram(tp, state, xs, n, out, (a, b))
            else:
                self._combine_elementwise(tp, state, xs, n, out, offset, (a, b))
            slot.pending = (tp.name, a, out.reshape((b - a, *tp.shape[1:])) if tp.shape else out.reshape(()))
        else:
            self._stats_chunk(tp, state, job.phase, xs, n, offset, (a, b))
        if job.last:
            self._end_phase(tp, state, job.phase)
        if job.final:
            if state.stats is not None:
                self.stats[tp.name] = {**state.stats, "weights": tp.weights}
            self.states.pop(tp.name, None)
            if tp.cached:
                self.cache_lock.release()

    def _weights(self, tp: TensorPlan, dtype) -> torch.Tensor:
        w = tp.weights if tp.weights is not None else [1.0] * tp.n_inputs
        return torch.tensor(w, dtype=dtype)

    def _pieces(self, tp: TensorPlan, n: int):
        step = self.plan.piece_elems
        if tp.kind != "gram":  # N inputs and their temporaries are live at once: a quarter of the piece
            step = max(1, step // 4)
            if tp.row_local:
                step = max(tp.row_len, step // tp.row_len * tp.row_len)
        for s in range(0, n, step):
            yield s, min(n, s + step) - s

    def _load(self, tp: TensorPlan, xs, s: int, m: int) -> torch.Tensor:
        """`(N, m)` float32 inputs of a piece in the tensor's space (task vectors: `x_i − base`, in fp32)."""
        v = self.vbuf[: tp.n_inputs, :m]
        tv = tp.space == "task_vector"
        cdt = _cdt(tp)
        if tv:
            self.basef[:m].copy_(xs[-1][s : s + m])
        for i in range(tp.n_inputs):
            v[i].copy_(xs[i][s : s + m])
            if tv:
                round_(v[i].sub_(self.basef[:m]), cdt)  # mergekit subtracts in its dtype
        return v

    def _gram_chunk(self, tp, state: _State, xs, n: int, rows) -> None:
        if state.gram is None:
            state.gram = GramAccumulator(tp.n_inputs, self.plan.gram_block)
        g = state.gram
        tv = tp.space == "task_vector"
        s = 0
        while s < n:
            m = min(n - s, g.room(), self.plan.piece_elems)
            if tv:
                self.basef[:m].copy_(xs[-1][s : s + m])
            for i in range(tp.n_inputs):
                if tv:
                    self.scr[:m].copy_(xs[i][s : s + m]).sub_(self.basef[:m])
                    g.add(i, g.fill, self.scr[:m])
                else:
                    g.add(i, g.fill, xs[i][s : s + m])
            g.advance(m)
            s += m

    def _stats_chunk(self, tp, state: _State, phase: str, xs, n: int, offset: int, rows) -> None:
        method, w32 = tp.method, self._weights(tp, torch.float32)
        if phase == "kth_high" and state.selectors is None:
            state.selectors = [None if r is None else RadixSelect(r) for r in tp.ranks]
        if phase == "sums" and state.sums is None:
            state.sums = method.new_sums(tp.n_inputs)
        for s, m in self._pieces(tp, n):
            v = self._load(tp, xs, s, m)
            if not state.checked:
                self._check_inputs(tp, v, rows)
            base = self.basef[:m] if tp.space == "task_vector" else None
            if phase in ("kth_high", "kth_low"):
                scores = method.score(v, base=base, row_len=tp.row_len, cdt=_cdt(tp))
                for i, sel in enumerate(state.selectors):
                    if sel is not None:
                        (sel.add_high if phase == "kth_high" else sel.add_low)(scores[i])
            else:
                method.accumulate(state.sums, v, w32, tp.params, thresholds=state.thresholds, tensor_name=tp.name,
                                  offset=offset + s, seed=self.config.seed, base=base, row_len=tp.row_len,
                                  shape=tp.shape, cdt=_cdt(tp), ties=state.ties)  # fmt: skip

    def _end_phase(self, tp, state: _State, phase: str) -> None:
        if phase in ("gram", "kth_high", "kth_low", "sums"):
            state.checked = True
        if phase == "gram":
            gram = state.gram.result()
            if not bool(torch.isfinite(torch.diagonal(gram)).all()):
                self._find_culprit(tp, None)
            state.coefficients = self._solve(tp, gram)
        elif phase == "kth_high":
            for sel in state.selectors:
                if sel is not None:
                    sel.finish_high()
        elif phase == "kth_low":
            rows = []
            for sel in state.selectors:
                rows.append(sel.result() if sel is not None else None)
            k = max(len(r) for r in rows if r is not None)
            thr = torch.tensor([r if r is not None else [float("nan")] * k for r in rows], dtype=torch.float32)
            state.thresholds = thr[:, 0] if k == 1 else thr
            if _cdt(tp) is not None:
                state.ties = self._ties(tp, thr)

    def _whole(self, tp: TensorPlan, source, cdt) -> torch.Tensor:
        """One input tensor whole, flat, rounded to `cdt`, in float32."""
        parts = [self.readers[source.label].read_rows(source.name, a, b).reshape(-1) for a, b in tp.chunks]
        return torch.cat(parts).to(cdt).float()

    def _ties(self, tp: TensorPlan, thr: torch.Tensor):
        """Per model, mergekit's choice among entries tied at the selection thresholds (`mergekit_selection`), or
        None. In 16-bit arithmetic |τ| often ties at the threshold and mergekit keeps exactly the entries its sort
        puts first; this reads each task vector whole once more to find them (only where the rule is ambiguous)."""
        cdt, method = _cdt(tp), tp.method
        if type(method).mergekit_selection is ElementwiseMethod.mergekit_selection:
            return None
        base = self._whole(tp, tp.sources[-1], cdt) if tp.space == "task_vector" else None
        out = []
        for i in range(tp.n_inputs):
            if bool(torch.isnan(thr[i]).all()):
                out.append(None)
                continue
            x = self._whole(tp, tp.sources[i], cdt)
            w = (round_(x.sub_(base), cdt) if base is not None else x).abs_()
            kept = method.mergekit_selection(w, i, tp.params, thr)
            if kept is None:
                out.append(None)
                continue
            bounds = thr[i][torch.isfinite(thr[i])]
            out.append((bounds, torch.sort(kept[torch.isin(w[kept], bounds)]).values))
        return None if all(t is None for t in out) else out

    def _solve(self, tp: TensorPlan, gram: torch.Tensor | None) -> torch.Tensor:
        c = tp.method.coefficients(gram, self._weights(tp, torch.float64), tp.params)
        return torch.as_tensor(c, dtype=torch.float64)

    def _combine_gram(self, tp, state: _State, xs, n: int, out: torch.Tensor, rows) -> None:
        cdt = _cdt(tp)
        if cdt is not None and getattr(tp.method, "rounded", False):
            self._combine_rounded(tp, state, xs, n, out, rows, cdt)
            return
        if state.coefficients is None:  # no Gram needed: coefficients from the weights alone
            state.coefficients = self._solve(tp, None)
        c = state.coefficients.to(torch.float32).tolist()
        tv = tp.space == "task_vector"
        acc, scr, basef = self.acc, self.scr, self.basef
        for s, m in self._pieces(tp, n):
            a = acc[:m]
            if tv:
                basef[:m].copy_(xs[-1][s : s + m])
            # Separate multiply and add, in input order, base last: the roundings of `apply_coefficients`.
            a.copy_(xs[0][s : s + m])
            if tv:
                a.sub_(basef[:m])
            a.mul_(c[0])
            for i in range(1, tp.n_inputs):
                t = scr[:m].copy_(xs[i][s : s + m])
                if tv:
                    t.sub_(basef[:m])
                a.add_(t.mul_(c[i]))
            if tv:
                a.add_(basef[:m])
            self._check_output(tp, a, rows)
            if self.diagnose:
                self._accumulate_stats(tp, state, xs, s, m, a)
            out[s : s + m].copy_(a)

    def _combine_rounded(self, tp, state: _State, xs, n: int, out: torch.Tensor, rows, cdt) -> None:
        """A gram method in a 16-bit compute dtype: mergekit's own order of operations (`rounded_combine`)."""
        w32 = self._weights(tp, torch.float32)
        for s, m in self._pieces(tp, n):
            v = self._load(tp, xs, s, m)
            merged = tp.method.rounded_combine(v, w32, tp.params, cdt)
            if tp.space == "task_vector":
                merged = round_(merged + self.basef[:m], cdt)
            self._check_output(tp, merged, rows)
            if self.diagnose:
                self._accumulate_stats(tp, state, xs, s, m, merged)
            out[s : s + m].copy_(merged)

    def _combine_elementwise(self, tp, state: _State, xs, n: int, out: torch.Tensor, offset: int, rows) -> None:
        cdt = _cdt(tp)
        w32 = self._weights(tp, torch.float32)
        for s, m in self._pieces(tp, n):
            v = self._load(tp, xs, s, m)
            if not state.checked:
                self._check_inputs(tp, v, rows)
            base = self.basef[:m] if tp.space == "task_vector" else None
            merged = tp.method.combine(v, w32, tp.params, thresholds=state.thresholds, tensor_name=tp.name,
                                       offset=offset + s, seed=self.config.seed, sums=state.sums, base=base,
                                       row_len=tp.row_len, shape=tp.shape, cdt=cdt, ties=state.ties)  # fmt: skip
            if base is not None:  # a float32 result stays float32 (mergekit's promotion)
                merged = round_(merged + base, None if getattr(tp.method, "float32_result", False) else cdt)
            self._check_output(tp, merged, rows)
            if self.diagnose:
                self._accumulate_stats(tp, state, xs, s, m, merged)
            out[s : s + m].copy_(merged)

    # -- checks and statistics ----------------------------------------------------------------------------------

    @staticmethod
    def _finite(x: torch.Tensor) -> bool:
        """One reduction: `aminmax` propagates NaN and shows ±inf."""
        if x.numel() == 0:
            return True
        lo, hi = torch.aminmax(x)
        return math.isfinite(float(lo)) and math.isfinite(float(hi))

    def _check_inputs(self, tp, v: torch.Tensor, rows) -> None:
        if not self._finite(v) or (tp.space == "task_vector" and not self._finite(self.basef[: v.shape[-1]])):
            self._find_culprit(tp, rows)

    def _check_output(self, tp, merged: torch.Tensor, rows) -> None:
        if not self._finite(merged):
            self._find_culprit(tp, rows)

    def _find_culprit(self, tp: TensorPlan, rows: tuple[int, int] | None) -> None:
        """Re-read the inputs (one chunk, or the whole tensor) to name the model and tensor holding a NaN/inf."""
        for a, b in [rows] if rows is not None else tp.chunks:
            for s in tp.sources:
                x = self.readers[s.label].read_rows(s.name, a, b)
                if x.is_floating_point():
                    bad = int((~torch.isfinite(x.float())).sum())
                    if bad:
                        raise ValueError(
                            f"model {s.label!r}: tensor {s.name!r} has {bad} non-finite value(s) (NaN/inf) in rows "
                            f"[{a}, {b}); refusing to merge (no output written)"
                        )
        raise ValueError(
            f"tensor {tp.name!r}: the merge produced non-finite values from finite inputs (float32 overflow); "
            "refusing to write it"
        )

    def _accumulate_stats(self, tp, state: _State, xs, s: int, m: int, merged: torch.Tensor) -> None:
        """Weights-space Gram of the inputs, `<x_i, out>` and `||out||²` in fp64 (data-free diagnostics)."""
        n = tp.n_inputs
        xd = torch.stack([x[s : s + m].double() for x in xs[:n]])
        od = merged.double()
        if state.stats is None:
            state.stats = {
                "gram": torch.zeros(n, n, dtype=torch.float64),
                "cross": torch.zeros(n, dtype=torch.float64),
                "out_sq": 0.0,
            }
        st = state.stats
        st["gram"] += xd @ xd.T
        st["cross"] += xd @ od
        st["out_sq"] += float(od @ od)

    def _progress(self, nbytes: int, io: IOThread) -> None:
        if self.bar is None:
            return
        self.bar.update(nbytes)
        now = time.perf_counter()
        if now - self._last_postfix > 0.5 and io.read_s > 0:
            self._last_postfix = now
            rate = io.read_bytes / max(now - self._t0, 1e-9) / 1e9
            read_bw = io.read_bytes / io.read_s / 1e9
            self.bar.set_postfix_str(f"{rate:.2f} GB/s = {100 * rate / read_bw:.0f}% of the read bandwidth")


@contextlib.contextmanager
def _steady_allocator():
    """Keep freed piece-sized temporaries in the heap for the duration of a merge (glibc only).

    glibc returns blocks of 128 KiB and more to the OS when they are freed, so every temporary of a combine piece
    would come back as fresh pages: a page fault per 4 KiB (measured: ~250k faults and a third of the time of a TIES
    merge of a 31M-parameter model). Afterwards the heap is trimmed and glibc's documented static thresholds are set
    back.
    """
    libc = None
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL("libc.so.6")
            libc.mallopt, libc.malloc_trim  # noqa: B018 - both exist only in glibc
    if libc is None:
        yield
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 64 << 20)
    libc.mallopt(m_trim_threshold, 256 << 20)
    try:
        yield
    finally:
        libc.mallopt(m_mmap_threshold, 128 << 10)
        libc.mallopt(m_trim_threshold, 128 << 10)
        libc.malloc_trim(0)


# Compute dtypes whose arithmetic is rounded to them (`plan.compute_dtype_of`); float32 is the engine's own.
_ROUNDED = ("F16", "BF16")


def _cdt(tp: TensorPlan):
    """The torch dtype a tensor's arithmetic is rounded to, or None for the engine's float32."""
    return torch_dtype(tp.compute_dtype) if tp.compute_dtype in _ROUNDED else None


def _itemsize(dtype: str) -> int:
    from .io.dtypes import DTYPE_ITEMSIZE

    return DTYPE_ITEMSIZE[dtype]


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _publish(tmp: Path, out: Path, overwrite: bool) -> None:
    """Atomic finish: `OUT.tmp` → `OUT`; an existing `OUT` (overwrite) goes to `OUT.old` first, deleted after.

    If the final rename fails, the old `OUT` is put back, so a failure never leaves the user without either.
    """
    old = out.with_name(out.name + ".old")
    moved = False
    if out.exists() or out.is_symlink():
        if not overwrite:  # appeared while we were merging
            raise FileExistsError(f"{out} appeared during the merge; the merge was discarded")
        if not out.is_dir():
            raise FileExistsError(f"{out} is not a folder; refusing to replace a file")
        _remove(old)
        os.replace(out, old)
        moved = True
    try:
        os.replace(tmp, out)
    except BaseException:
        if moved:
            os.replace(old, out)
        raise
    if moved:
        _remove(old)
    _fsync_dir(out.parent)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def _progress_bar(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="merge", dynamic_ncols=True)


__all__ = ["CARD_FILE", "RECIPE_NAME", "MergeResult", "check_output_folder", "merge"]
