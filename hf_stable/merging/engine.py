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
import os
import shutil
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._copy import check_tokenizer_source, copy_side_files
from .card import CARD_FILE, RECIPE_FILE, merge_model_card, write_merge_card
from .compat import check_equal_nonfloat, parse_size
from .config import MergeConfig, load_recipe_dict
from .execution import Execution, jobs
from .io.reader import SafetensorsReader
from .io.writer import OutputSpec, StreamingSafetensorsWriter
from .plan import MergePlan, build_plan
from .ring import IOThread
from .vocab import build_vocabulary


DEFAULT_MEMORY_BUDGET = "2GB"
RECIPE_NAME = RECIPE_FILE


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

    vocabulary = build_vocabulary(config)  # a tokenizer_source: the output vocabulary (tokenizers and configs only)
    if vocabulary is not None:
        vocabulary.allow_pickle = allow_pickle
    plan = build_plan(config, budget, allow_pickle=allow_pickle, diagnose=diagnose, vocabulary=vocabulary)
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
            ex = Execution(config, plan, readers, out, overwrite, diagnose, progress, timings)
            result = _run(ex, hub_model_id, before_publish, vocabulary)
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


def _run(ex: Execution, hub_model_id, before_publish, vocabulary=None) -> MergeResult:
    """Drive `ex` through the ring into `OUT.tmp`, add the side files, recipe and card, then publish `OUT`."""
    plan, out = ex.plan, ex.out
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():  # left by a killed run: never trusted
        shutil.rmtree(tmp)
    specs = [OutputSpec(t.name, t.out_dtype, t.shape) for t in plan.tensors]
    writer = io = None
    ok = False
    try:
        tmp.mkdir(parents=True)
        writer = StreamingSafetensorsWriter(tmp, specs, plan.max_shard_size, metadata={"format": "pt"})
        io = IOThread(jobs(plan), ex.slots, ex.read, writer.write_rows, ex.cache_lock)
        for slot in io:
            t0 = time.perf_counter()
            ex.process(slot.job, slot)
            ex.compute_s += time.perf_counter() - t0
            ex.report_progress(slot.job.read_bytes, io)
            io.give_back(slot)
            if ex.sleep and slot.job.phase == "combine":
                time.sleep(ex.sleep)
        io.finish()
        t0 = time.perf_counter()
        writer.finalize()
        copy_side_files(ex.config, plan, tmp, vocabulary)
        (tmp / RECIPE_FILE).write_text(ex.config.to_yaml(redact=True), encoding="utf-8")
        ex.timings.update(read=round(io.read_s, 6), write=round(io.write_s, 6), compute=round(ex.compute_s, 6))
        result = MergeResult(str(out), ex.stats, ex.timings, io.read_bytes, writer.bytes_written,
                             plan.allocated_bytes, plan, ex.config)  # fmt: skip
        summary = before_publish(tmp, result) if before_publish is not None else None
        write_merge_card(tmp, merge_model_card(ex.config, result, summary, hub_model_id=hub_model_id))
        _publish(tmp, out, ex.overwrite)
        ex.timings["finalize"] = time.perf_counter() - t0
        ok = True
    finally:
        if io is not None and not ok:
            io.close()
        if ex.bar is not None:
            ex.bar.close()
        if not ok:
            if writer is not None:
                writer.abort()
            shutil.rmtree(tmp, ignore_errors=True)
    return result


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


__all__ = ["CARD_FILE", "RECIPE_NAME", "MergeResult", "check_output_folder", "merge"]
