"""The memory-bounded streaming merge engine: `merge(config, out_dir)` (spec `merging.md` §8).

Flow: plan from headers (`merge_plan.build_plan`: compatibility, per-tensor parameters, tiles, passes) → check
non-float tensors are identical → stream tiles through reader thread → compute (this thread) → writer thread
(`pipeline`) into `OUT.tmp/` → copy config/tokenizer files, write `hf_stable_merge.yaml` → rename to `OUT`.

Precision (§2): inputs are read in their stored dtype, converted to fp32 per tile; Gram matrices, norms and
diagnostic dot products accumulate in fp64; outputs are cast once to the output dtype.

Failure semantics: recipe, compatibility, pickle and budget errors are raised while planning, before any folder is
created. A non-finite input value is found while reading (every float tile is checked): the partial `OUT.tmp` is
removed and `OUT` is left as it was. A killed process leaves at most `OUT.tmp` (removed by the next run); `OUT`
only ever appears complete (atomic `rename`).
"""

from __future__ import annotations

import math
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import plan as planner
from ._copy import copy_side_files
from .config import DATA_DRIVEN_METHODS, MergeConfig, load_recipe_dict
from .gram import accumulate_gram
from .gram import gram as tile_gram
from .io.reader import SafetensorsReader, torch_dtype
from .io.writer import OutputSpec, StreamingSafetensorsWriter
from .merge_plan import MergePlan, TensorPlan, build_plan, compute_work, quantile_chunk_work
from .pipeline import BackgroundWriter, MemoryTracker, Prefetcher, StageClock


DEFAULT_MEMORY_BUDGET = "2GB"
RECIPE_NAME = "hf_stable_merge.yaml"
# Test hook: seconds to sleep after each computed tile, so a test can kill a merge mid-write.
_TEST_SLEEP_ENV = "HF_STABLE_MERGE_TEST_SLEEP"


@dataclass
class MergeResult:
    """What `merge` did.

    Attributes:
        output_dir: the merged model folder (`None` for a dry run).
        per_tensor_stats: with `diagnose=True`, `{name: {"gram": (N, N) float64 (weights space), "cross": (N,)
            float64 = <x_i, out>, "out_sq": float = ||out||², "weights": list | None}}` for merged tensors.
        timings: seconds: `plan`, `read`/`compute`/`write` (busy time of each stage), `finalize`, `total`.
        bytes_read, bytes_written: tensor bytes through the readers / the writer.
        peak_tracked_bytes: high-water mark of tracked resident tile memory (≤ the budget; see `pipeline`).
        plan: the `MergePlan` (also the whole result of a dry run).
        config: the recipe that was run.
    """

    output_dir: str | None
    per_tensor_stats: dict[str, dict[str, Any]]
    timings: dict[str, float]
    bytes_read: int
    bytes_written: int
    peak_tracked_bytes: int
    plan: MergePlan
    config: MergeConfig | None = None


def _load_recipe(config: MergeConfig | dict | str | os.PathLike) -> MergeConfig | dict:
    """A `MergeConfig`; data-driven recipes (`fw_merging`, their own schema) stay plain dicts."""
    if isinstance(config, MergeConfig):
        return config
    if isinstance(config, (str, os.PathLike)):
        config = load_recipe_dict(config)
    if isinstance(config, dict):
        if config.get("merge_method") in DATA_DRIVEN_METHODS:
            return config
        return MergeConfig.from_dict(config)
    raise TypeError(f"config must be a MergeConfig, a dict or a YAML path/string, got {type(config).__name__}")


def merge(
    config: MergeConfig | dict | str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    memory_budget: int | str | None = None,
    dry_run: bool = False,
    diagnose: bool = False,
    progress: bool = True,
    allow_pickle: bool | None = None,
    read_threads: int | None = None,
    overwrite: bool = False,
) -> MergeResult:
    """Merge the recipe's models into `out_dir` (a transformers-loadable folder), within `memory_budget`.

    Args:
        config: a `MergeConfig`, a recipe dict, or a YAML path/string (mergekit `models:` superset).
        out_dir: output folder; written as `out_dir.tmp` and renamed when complete.
        memory_budget: bytes or a size string ("2GB", "512MiB") bounding tracked tile memory; default the
            recipe's `memory_budget`, else 2GB.
        dry_run: plan only: returns the plan (tensors, tiles, passes, bytes) and writes nothing.
        diagnose: accumulate per-tensor statistics (`MergeResult.per_tensor_stats`) for collapse diagnostics.
        progress: show a tqdm bar (bytes read; postfix read/compute/write MB/s).
        allow_pickle: accept `pytorch_model.bin` inputs (default: the recipe's `allow_pickle`).
        read_threads: threads reading the N inputs of a tile in parallel (default: the recipe's, else min(8, N)).
        overwrite: replace an existing `out_dir` (renamed to `out_dir.old` and deleted once the new one is in place).

    Raises:
        ValueError: bad recipe, incompatible models, pickle inputs without `allow_pickle`, budget too small,
            non-finite input values (naming model and tensor).
        FileExistsError: `out_dir` exists and `overwrite=False`.
    """
    t_start = time.perf_counter()
    config = _load_recipe(config)
    if isinstance(config, dict) or config.is_data_driven:
        return _dispatch_data_driven(
            config,
            out_dir,
            memory_budget=memory_budget,
            dry_run=dry_run,
            diagnose=diagnose,
            progress=progress,
            allow_pickle=allow_pickle,
            read_threads=read_threads,
            overwrite=overwrite,
        )
    budget = planner.parse_size(
        memory_budget if memory_budget is not None else (config.memory_budget or DEFAULT_MEMORY_BUDGET)
    )
    allow_pickle = config.allow_pickle if allow_pickle is None else bool(allow_pickle)
    out = Path(out_dir)
    if not dry_run and out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists; pass overwrite=True (CLI: --overwrite) to replace it")

    plan = build_plan(config, budget, allow_pickle=allow_pickle, diagnose=diagnose)
    input_dirs = {Path(ck.folder).resolve() for ck in plan.checkpoints.values()}
    if out.resolve() in input_dirs:  # overwrite=True would delete an input
        raise ValueError(f"output folder {out} is one of the input models; choose another out_dir")

    readers = {label: SafetensorsReader(ck, drop_cache=config.drop_cache) for label, ck in plan.checkpoints.items()}
    try:
        copies = [t.name for t in plan.tensors if t.action == "copy"]
        planner.check_equal_nonfloat(readers, copies)
        timings = {"plan": time.perf_counter() - t_start}
        if dry_run:
            timings["total"] = time.perf_counter() - t_start
            return MergeResult(None, {}, timings, 0, 0, 0, plan, config)
        n_threads = read_threads or config.read_threads or min(8, max(1, len(plan.inputs)))
        result = _execute(config, plan, readers, out, overwrite, diagnose, progress, n_threads, timings)
    finally:
        for r in readers.values():
            r.close()
    result.timings["total"] = time.perf_counter() - t_start
    return result


def _dispatch_data_driven(config: MergeConfig | dict, out_dir, **kwargs) -> Any:
    """`merge_method: fw_merging` (data-driven, spec §5) runs in `hf_stable.merging.fw.fw_merge_from_config`.

    The engine-only options (dry run, per-tensor diagnostics, memory budget, pickle inputs, read threads) do not
    apply to it: setting one raises `ValueError` naming it rather than being silently ignored.
    """
    from .fw import fw_merge_from_config

    method = config.get("merge_method") if isinstance(config, dict) else config.merge_method
    engine_only = dict(memory_budget=None, dry_run=False, diagnose=False, allow_pickle=None, read_threads=None)
    for key, default in engine_only.items():
        value = kwargs.pop(key, default)
        if value != default:
            raise ValueError(
                f"merge_method {method!r}: {key}={value!r} applies to the streaming engine only; FW-Merging "
                "materialises the model to take gradients (see docs/merging.md, fw_merging)"
            )
    recipe = config.to_dict() if isinstance(config, MergeConfig) else config
    return fw_merge_from_config(recipe, out_dir, **kwargs)


# --------------------------------------------------------------------------------------------------------- execution


@dataclass
class _Job:
    tensor: TensorPlan
    phase: str  # "gram" (pass 1 of a two-pass Gram), "combine", "copy"
    tile: int
    rows: tuple[int, int]


@dataclass
class _TensorState:
    gram: torch.Tensor | None = None
    coefficients: torch.Tensor | None = None
    thresholds: torch.Tensor | None = None
    stats: dict[str, Any] | None = None


def _jobs(plan: MergePlan):
    for tp in plan.tensors:
        if tp.action == "copy":
            for i, rows in enumerate(tp.tiles):
                yield _Job(tp, "copy", i, rows)
            continue
        if tp.two_pass:
            for i, rows in enumerate(tp.tiles):
                yield _Job(tp, "gram", i, rows)
        for i, rows in enumerate(tp.tiles):
            yield _Job(tp, "combine", i, rows)


def _execute(config, plan, readers, out: Path, overwrite, diagnose, progress, n_threads, timings) -> MergeResult:
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():  # left by a killed run: never trusted
        shutil.rmtree(tmp)
    tracker, clock = MemoryTracker(), StageClock()
    specs = [OutputSpec(t.name, t.out_dtype, t.shape) for t in plan.tensors]
    pool = ThreadPoolExecutor(n_threads, thread_name_prefix="hf_stable-merge-read") if n_threads > 1 else None
    bar = _progress_bar(plan.bytes_to_read, progress)
    runner = _Compute(config, plan, readers, tracker, clock, diagnose, bar)
    prefetch = writer_thread = writer = None
    ok = False
    try:
        tmp.mkdir(parents=True)
        writer = StreamingSafetensorsWriter(tmp, specs, plan.max_shard_size, metadata={"format": "pt"})
        writer_thread = BackgroundWriter(writer.write_rows, tracker, clock)

        def fetch(job: _Job):
            reads = [(readers[s], job.tensor.name, *job.rows) for s in job.tensor.sources]
            if pool is not None and len(reads) > 1:
                return list(pool.map(lambda a: a[0].read_rows(*a[1:]), reads))
            return [r.read_rows(name, a, b) for r, name, a, b in reads]

        def cost(job: _Job) -> int:
            a, b = job.rows
            return sum((b - a) * plan.checkpoints[s].tensors[job.tensor.name].row_nbytes for s in job.tensor.sources)

        prefetch = Prefetcher(_jobs(plan), fetch, cost, tracker, clock)
        for job, raw, nbytes in prefetch:
            runner.step(job, raw, nbytes, writer_thread)
        writer_thread.close()
        writer_thread = None
        t0 = time.perf_counter()
        writer.finalize()
        copy_side_files(config, plan, tmp)
        (tmp / RECIPE_NAME).write_text(config.to_yaml(), encoding="utf-8")
        _publish(tmp, out, overwrite)
        timings["finalize"] = time.perf_counter() - t0
        ok = True
    finally:
        if prefetch is not None:
            prefetch.close()
        if writer_thread is not None:
            try:
                writer_thread.close()
            except BaseException:  # the original error is the one to report
                pass
        if pool is not None:
            pool.shutdown(wait=True)
        if bar is not None:
            bar.close()
        if not ok:
            if writer is not None:
                writer.abort()
            shutil.rmtree(tmp, ignore_errors=True)
    timings.update({k: round(v, 6) for k, v in clock.seconds.items()})
    bytes_read = sum(r.bytes_read for r in readers.values())
    return MergeResult(str(out), runner.stats, timings, bytes_read, writer.bytes_written, tracker.peak, plan, config)


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


class _Compute:
    """The compute stage: per tile set, check finiteness, build v_i, accumulate/solve/combine, queue the output."""

    def __init__(self, config, plan: MergePlan, readers, tracker, clock, diagnose, bar):
        self.config = config
        self.plan = plan
        self.readers = readers
        self.tracker = tracker
        self.clock = clock
        self.diagnose = diagnose
        self.bar = bar
        self.states: dict[str, _TensorState] = {}
        self.stats: dict[str, dict[str, Any]] = {}
        self.n = len(plan.inputs)
        self.sleep = float(os.environ.get(_TEST_SLEEP_ENV, "0") or 0)
        self._last_postfix = 0.0

    # -- helpers ------------------------------------------------------------------------------------------------

    @staticmethod
    def _all_finite(x: torch.Tensor) -> bool:
        """One reduction pass: `aminmax` propagates NaN and shows ±inf (5× cheaper than `isfinite().all()`)."""
        if x.numel() == 0:
            return True
        lo, hi = torch.aminmax(x)
        return math.isfinite(float(lo)) and math.isfinite(float(hi))

    def _check_finite(self, x: torch.Tensor, label: str, name: str, rows: tuple[int, int]) -> None:
        if not self._all_finite(x):
            bad = int((~torch.isfinite(x)).sum())
            raise ValueError(
                f"model {label!r}: tensor {name!r} has {bad} non-finite value(s) (NaN/inf) in rows "
                f"[{rows[0]}, {rows[1]}); refusing to merge (no output written)"
            )

    def _vectors(self, tp: TensorPlan, raw: list[torch.Tensor], rows) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`(v, base)`: v `(N, n)` float32 in the tensor's space, base `(n,)` float32 or None.

        The sources are converted straight into one preallocated fp32 buffer (no separate cast + stack copies);
        task vectors are formed in place (`x_i − base`, the same float32 operation as the reference).
        """
        n = raw[0].numel()
        buf = torch.empty(len(raw), n, dtype=torch.float32)
        for i, x in enumerate(raw):
            buf[i].copy_(x.reshape(-1))
        if not self._all_finite(buf):
            for label, row in zip(tp.sources, buf, strict=True):
                self._check_finite(row, label, tp.name, rows)
        if tp.space == "task_vector":
            base = buf[-1]
            v = buf[:-1]
            v.sub_(base)
            return v, base
        return buf, None

    def _weights(self, tp: TensorPlan, dtype) -> torch.Tensor:
        w = tp.weights if tp.weights is not None else [1.0] * self.n
        return torch.tensor(w, dtype=dtype)

    def _work_bytes(self, tp: TensorPlan, rows) -> int:
        e = (rows[1] - rows[0]) * tp.row_numel
        isz = max(self.plan.checkpoints[s].tensors[tp.name].itemsize for s in tp.sources)
        return e * compute_work(
            tp.kind, self.n, len(tp.sources), gram=tp.needs_gram, diagnose=self.diagnose, itemsize=isz, stream=False
        )

    # -- one tile set -------------------------------------------------------------------------------------------

    def step(self, job: _Job, raw: list[torch.Tensor], nbytes: int, writer: BackgroundWriter) -> None:
        t0 = time.perf_counter()
        tp = job.tensor
        try:
            if job.phase == "copy":
                out_t = raw[0].contiguous()
                out_bytes = out_t.numel() * out_t.element_size()
                self.tracker.acquire(out_bytes)
                self.clock.add("compute", time.perf_counter() - t0, nbytes)
                writer.submit(tp.name, job.rows[0], out_t, out_bytes)
                return
            work = self._work_bytes(tp, job.rows)
            self.tracker.acquire(work)
            try:
                out_t = self._merge_tile(job, raw)
            finally:
                self.tracker.release(work)
            if out_t is not None:
                out_bytes = out_t.numel() * out_t.element_size()
                self.tracker.acquire(out_bytes)
                self.clock.add("compute", time.perf_counter() - t0, nbytes)
                writer.submit(tp.name, job.rows[0], out_t, out_bytes)
                if self.sleep:
                    time.sleep(self.sleep)
            else:
                self.clock.add("compute", time.perf_counter() - t0, nbytes)
        finally:
            self.tracker.release(nbytes)
            self._progress(nbytes)

    def _merge_tile(self, job: _Job, raw: list[torch.Tensor]) -> torch.Tensor | None:
        tp = job.tensor
        state = self.states.setdefault(tp.name, _TensorState())
        v, base = self._vectors(tp, raw, job.rows)
        last = job.tile == len(tp.tiles) - 1

        if job.phase == "gram":  # pass 1 of the two-pass Gram: accumulate, solve after the last tile
            state.gram = accumulate_gram(state.gram, v)
            if last:
                state.coefficients = self._solve(tp, state.gram)
            return None

        if tp.kind == "gram":
            if state.coefficients is None:  # one-pass: the whole tensor is this tile (or no Gram needed)
                state.coefficients = self._solve(tp, tile_gram(v) if tp.needs_gram else None)
            from .methods.base import apply_coefficients

            merged = apply_coefficients(v, state.coefficients, base, inplace=not self.diagnose)
        else:
            if job.tile == 0 and tp.thresholds is not None:
                state.thresholds = self._thresholds(tp, v)
            combined = tp.method.combine(
                v,
                self._weights(tp, torch.float32),
                tp.params,
                thresholds=state.thresholds,
                tensor_name=tp.name,
                offset=job.rows[0] * tp.row_numel,
                seed=self.config.seed,
            )
            merged = combined + base if base is not None else combined

        if self.diagnose:
            self._accumulate_stats(tp, raw, v, base, merged, state)
        if last:
            if state.stats is not None:
                self.stats[tp.name] = {**state.stats, "weights": tp.weights}
            self.states.pop(tp.name, None)
        rows = job.rows[1] - job.rows[0]
        return merged.to(torch_dtype(tp.out_dtype)).reshape((rows, *tp.shape[1:])).contiguous()

    def _solve(self, tp: TensorPlan, gram: torch.Tensor | None) -> torch.Tensor:
        c = tp.method.coefficients(gram, self._weights(tp, torch.float64), tp.params)
        return torch.as_tensor(c, dtype=torch.float64)

    def _accumulate_stats(self, tp, raw, v, base, merged, state: _TensorState) -> None:
        """Weights-space Gram of the inputs, `<x_i, out>` and `||out||²` in fp64 (spec §3.5, data-free)."""
        xd = torch.stack([r.reshape(-1).double() for r in raw[: self.n]])  # the inputs as stored, weights space
        od = merged.double()
        if state.stats is None:
            state.stats = {
                "gram": torch.zeros(self.n, self.n, dtype=torch.float64),
                "cross": torch.zeros(self.n, dtype=torch.float64),
                "out_sq": 0.0,
            }
        st = state.stats
        st["gram"] += xd @ xd.T
        st["cross"] += xd @ od
        st["out_sq"] += float(od @ od)

    def _thresholds(self, tp: TensorPlan, v: torch.Tensor) -> torch.Tensor:
        """k-th largest |v_i| over the WHOLE tensor for each model (k = int(density_i · numel))."""
        from .methods.base import keep_count
        from .quantile import kth_largest_abs

        numel = tp.numel
        out = []
        for i, d in enumerate(tp.densities):
            k = keep_count(d, numel)
            if d >= 1:
                out.append(0.0)
            elif tp.thresholds == "topk":
                out.append(_kth_largest_abs_in_memory(v[i], k))
            else:
                out.append(kth_largest_abs(self._chunks(tp, i), k))
        return torch.tensor(out, dtype=torch.float32)

    def _chunks(self, tp: TensorPlan, i: int):
        """Streams v_i tile by tile (model i minus the base) for the exact two-pass quantile; charges the tracker."""
        label = self.plan.inputs[i]
        base = tp.sources[-1] if tp.space == "task_vector" else None

        def gen():
            for rows in tp.tiles:
                isz = max(self.plan.checkpoints[s].tensors[tp.name].itemsize for s in tp.sources)
                e = (rows[1] - rows[0]) * tp.row_numel
                charge = e * quantile_chunk_work(isz)
                self.tracker.acquire(charge)
                try:
                    # No finiteness check here: the combine pass checks every tile of every source anyway.
                    x = torch.empty(e, dtype=torch.float32)
                    x.copy_(self.readers[label].read_rows(tp.name, *rows).reshape(-1))
                    if base is not None:
                        x.sub_(self.readers[base].read_rows(tp.name, *rows).reshape(-1))
                    yield x
                finally:
                    self.tracker.release(charge)

        return gen

    def _progress(self, nbytes: int) -> None:
        if self.bar is None:
            return
        self.bar.update(nbytes)
        now = time.perf_counter()
        if now - self._last_postfix > 0.5:
            self._last_postfix = now
            r = self.clock.rates_mb_s()
            self.bar.set_postfix_str(
                f"read {r['read']:.0f} MB/s, compute {r['compute']:.0f} MB/s, write {r['write']:.0f} MB/s"
            )


def _kth_largest_abs_in_memory(x: torch.Tensor, k: int) -> float:
    """Exact k-th largest |x| of a resident tensor (`inf` for k ≤ 0, i.e. keep nothing).

    Same value as `quantile.kth_largest_abs_tensor` (`torch.topk(|x|, k).values[-1]`: both select an element of
    |x|), but `kthvalue` is a selection, not a partial sort: ~3× faster for the k ≈ numel/2 of TIES/DARE.
    """
    if k <= 0:
        return float("inf")
    a = x.reshape(-1).abs()
    return float(a.kthvalue(a.numel() - k + 1).values)
