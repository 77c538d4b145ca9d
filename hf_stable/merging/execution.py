"""One streaming merge run's buffers and arithmetic: the chunk jobs of a plan, their reads (in the ring's I/O thread)
and, in the calling thread, the Gram, selection and sums passes, the combine, the non-finite checks and the
diagnostics statistics. `engine.merge` builds an `Execution` and drives it through the ring (`engine._run`).

The arithmetic contract (fp32 pieces, fp64 Gram and sums, one rounding to the output dtype, results independent of
the chunk and piece sizes) is described in `engine`'s module docstring.
"""

from __future__ import annotations

import math
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .gram import GramAccumulator
from .io.dtypes import torch_dtype
from .methods.base import ElementwiseMethod, round_
from .plan import RING_SLOTS, MergePlan, TensorPlan
from .quantile import RadixSelect
from .ring import IOThread, Slot


# Test hook: seconds to sleep after each combined chunk, so a test can kill or interrupt a merge mid-write.
_TEST_SLEEP_ENV = "HF_STABLE_MERGE_TEST_SLEEP"


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


def jobs(plan: MergePlan):
    """The plan's jobs in ring order: per tensor, each pass over its chunks, then the combine (or the copy)."""
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


class Execution:
    """One merge run: allocates the buffers, reads and combines the chunks (`engine._run` drives the ring and
    finalises the folder)."""

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

    def read(self, job: _Job, slot: Slot) -> list[torch.Tensor]:
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

    def process(self, job: _Job, slot: Slot) -> None:
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
        if tp.direct:  # no passes: the whole tensor (or whole rows) at the combine
            if job.phase == "combine":
                out = slot.out[: n * _itemsize(tp.out_dtype)].view(torch_dtype(tp.out_dtype))
                self._combine_direct(tp, state, xs, n, out, (a, b))
                slot.pending = (tp.name, a, out.reshape((b - a, *tp.shape[1:])) if tp.shape else out.reshape(()))
        elif job.phase == "gram":
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
        if job.last and not tp.direct:
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
            if tv:  # one pass: the stored value widens exactly, so this is copy-then-subtract's float32 result
                round_(_sub_into(xs[i][s : s + m], self.basef[:m], v[i]), cdt)  # mergekit subtracts in its dtype
            else:
                v[i].copy_(xs[i][s : s + m])
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
                    g.add(i, g.fill, _sub_into(xs[i][s : s + m], self.basef[:m], self.scr[:m]))
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
        if cdt is None and tp.mergekit_order and getattr(tp.method, "rounded_float32", False):
            cdt = torch.float32  # a float32 recipe: mergekit's order too, where it rounds differently
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
            if tv:  # one pass each: the stored values widen exactly, as a copy then a subtraction
                _sub_into(xs[0][s : s + m], basef[:m], a)
            else:
                a.copy_(xs[0][s : s + m])
            a.mul_(c[0])
            for i in range(1, tp.n_inputs):
                t = _sub_into(xs[i][s : s + m], basef[:m], scr[:m]) if tv else scr[:m].copy_(xs[i][s : s + m])
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

    def _combine_direct(self, tp, state: _State, xs, n: int, out: torch.Tensor, rows) -> None:
        """mergekit's own arithmetic (`mergekit_merge`) on the tensor's one chunk, or, for a per-row form, on each
        chunk's whole rows (mergekit's per-row reductions see the same rows)."""
        shape = tp.shape if len(tp.chunks) == 1 else (rows[1] - rows[0], *tp.shape[1:])
        part = self._direct(tp, xs, shape)
        if self.diagnose:
            self._accumulate_stats(tp, state, xs, 0, n, part.float())
        out.copy_(part)

    def _direct(self, tp, inputs, shape) -> torch.Tensor:
        """`(numel,)` the method's `mergekit_merge` of `inputs` (flat, stored dtype; the base last for task vectors)
        in the compute dtype, checked for non-finite inputs and outputs."""
        cdt = torch_dtype(tp.compute_dtype)
        ts = [x.to(cdt).reshape(shape) for x in inputs]
        if not all(self._finite(t) for t in ts):
            self._find_culprit(tp, None)
        if tp.space == "task_vector":
            base = ts.pop()
        else:  # an endpoint method's base end (slerp's t = 0, one more input of karcher), when the recipe has one
            base = ts.pop(0) if self.plan.base is not None and tp.method.base_is_input(tp.params) else None
        merged = tp.method.mergekit_merge(ts, base, tp.weights, tp.params).reshape(-1)
        self._check_output(tp, merged, None)
        return merged

    def _combine_elementwise(self, tp, state: _State, xs, n: int, out: torch.Tensor, offset: int, rows) -> None:
        cdt = _cdt(tp)
        if hasattr(tp.method, "combine_rows") and tp.row_len == n and tp.space == "task_vector":
            self._combine_rows(tp, state, xs, n, out, rows, cdt)
            return
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

    def _combine_rows(self, tp, state: _State, xs, n: int, out: torch.Tensor, rows, cdt) -> None:
        """A whole-tensor method (sce) fed its task vectors row by row from the stored inputs: no `(N, n)` float32
        copy of a tensor (the same values `_load` gives), the base added and the result written block by block."""
        for x in xs:
            if not self._finite(x if x.dtype in _WIDENS else x.float()):
                self._find_culprit(tp, rows)
        # an operand that widens exactly is used as stored (in place, float32 arithmetic either way)
        base = xs[-1] if xs[-1].dtype in _WIDENS else xs[-1].float()

        def row(i: int, a: int, b: int) -> torch.Tensor:  # float32(x) − float32(base), as `_load` gives it
            return round_(xs[i][a:b].to(torch.float32, copy=True).sub_(base[a:b]), cdt)

        for s, merged in tp.method.combine_rows(row, tp.n_inputs, n, tp.params, cdt=cdt):
            m = merged.numel()
            merged = round_(merged.add_(base[s : s + m]), cdt)  # `merged + base` of `_combine_elementwise`
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

    def report_progress(self, nbytes: int, io: IOThread) -> None:
        if self.bar is None:
            return
        self.bar.update(nbytes)
        now = time.perf_counter()
        if now - self._last_postfix > 0.5 and io.read_s > 0:
            self._last_postfix = now
            rate = io.read_bytes / max(now - self._t0, 1e-9) / 1e9
            read_bw = io.read_bytes / io.read_s / 1e9
            self.bar.set_postfix_str(f"{rate:.2f} GB/s = {100 * rate / read_bw:.0f}% of the read bandwidth")


# Compute dtypes whose arithmetic is rounded to them (`plan.compute_dtype_of`); float32 is the engine's own.
_ROUNDED = ("F16", "BF16")


# Stored dtypes that float32 arithmetic widens exactly (the others are copied to float32 first: float64 would make
# `torch.sub` compute in float64, and float8 has no type promotion)
_WIDENS = (torch.float32, torch.bfloat16, torch.float16)


def _sub_into(x: torch.Tensor, base: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`out = float32(x) − base` (`base`, `out`: float32, x's shape): the bits of `out.copy_(x).sub_(base)`, in one
    pass where x widens exactly."""
    if x.dtype in _WIDENS:
        return torch.sub(x, base, out=out)
    return out.copy_(x).sub_(base)


def _cdt(tp: TensorPlan):
    """The torch dtype a tensor's arithmetic is rounded to, or None for the engine's float32."""
    return torch_dtype(tp.compute_dtype) if tp.compute_dtype in _ROUNDED else None


def _itemsize(dtype: str) -> int:
    from .io.dtypes import DTYPE_ITEMSIZE

    return DTYPE_ITEMSIZE[dtype]


def _progress_bar(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="merge", dynamic_ncols=True)
