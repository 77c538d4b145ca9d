"""Streaming safetensors writer: headers first, then `pwrite` of row tiles at their final offsets.

After planning, every output tensor's name, dtype and shape is known, so each shard's header (and therefore every
tensor's byte offset) can be computed before any weight exists. The writer writes the headers at open, sizes the
files, and each computed tile goes straight to its place: output buffering is one tile, not one shard (mergekit and
`save_file` hold a whole shard in memory first).

File layout (the safetensors format, https://github.com/huggingface/safetensors#format): u64 little-endian header
length `H`, `H` bytes of JSON padded with spaces so that the data region starts at a multiple of 8 (the
safetensors library pads to 8 too, which keeps every tensor's start aligned when its predecessors' sizes are), then
the tensors back to back in spec order, with no gaps (safetensors refuses files whose data region has holes).

Sharding follows transformers' `save_pretrained`: names kept in the given order, a new shard starts when the next
tensor would push the current one past `max_shard_size` (a tensor larger than that gets a shard of its own);
one shard is `model.safetensors`, several are `model-0000i-of-0000n.safetensors` plus
`model.safetensors.index.json` with `metadata.total_size` (sum of tensor bytes) and `weight_map`.
"""

from __future__ import annotations

import json
import math
import operator
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from .dtypes import DTYPE_ITEMSIZE
from .header import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME
from .reader import MAX_REQUEST_BYTES, TORCH_DTYPES


@dataclass(frozen=True)
class OutputSpec:
    """One output tensor: name, safetensors dtype string (e.g. `"BF16"`) and shape (`()` for 0-d)."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"OutputSpec.name must be a non-empty string, got {self.name!r}")
        if self.dtype not in DTYPE_ITEMSIZE or self.dtype not in TORCH_DTYPES:
            raise ValueError(
                f"OutputSpec {self.name!r}: dtype {self.dtype!r} is not supported (supported: {sorted(TORCH_DTYPES)})"
            )
        shape = tuple(self.shape)
        if not all(type(d) is int and d >= 0 for d in shape):
            raise ValueError(f"OutputSpec {self.name!r}: shape must be non-negative integers, got {self.shape!r}")
        object.__setattr__(self, "shape", shape)

    @property
    def itemsize(self) -> int:
        return DTYPE_ITEMSIZE[self.dtype]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def n_rows(self) -> int:
        """Size of dim 0; a 0-d tensor has one row (as `TensorInfo.n_rows`)."""
        return self.shape[0] if self.shape else 1

    @property
    def row_nbytes(self) -> int:
        return math.prod(self.shape[1:]) * self.itemsize


@dataclass
class _Slot:
    """Where one output tensor lives: shard index, file, absolute byte offset; rows written so far."""

    spec: OutputSpec
    shard: int
    offset: int
    written: list[tuple[int, int]]  # disjoint row ranges, unsorted


def shard_specs(specs: list[OutputSpec], max_shard_size: int) -> list[list[OutputSpec]]:
    """Split `specs` (order kept) into shards of at most `max_shard_size` tensor bytes each, greedily, as
    `huggingface_hub.split_torch_state_dict_into_shards` (used by transformers) does; a tensor bigger than the
    limit is alone in its shard."""
    shards: list[list[OutputSpec]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + spec.nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards


def shard_file_names(n_shards: int) -> list[str]:
    """transformers' names: `model.safetensors`, or `model-00001-of-0000n.safetensors` ... for `n_shards > 1`."""
    if n_shards == 1:
        return [SAFE_WEIGHTS_NAME]
    return [f"model-{i:05d}-of-{n_shards:05d}.safetensors" for i in range(1, n_shards + 1)]


def build_header(specs: list[OutputSpec], metadata: dict[str, str] | None) -> bytes:
    """Header bytes of one shard: u64 length + JSON padded with spaces to make `8 + H` a multiple of 8."""
    header: dict = {}
    if metadata is not None:
        header["__metadata__"] = metadata
    begin = 0
    for spec in specs:
        header[spec.name] = {
            "dtype": spec.dtype,
            "shape": list(spec.shape),
            "data_offsets": [begin, begin + spec.nbytes],
        }
        begin += spec.nbytes
    body = json.dumps(header, separators=(",", ":")).encode("utf-8")
    body += b" " * (-(8 + len(body)) % 8)
    return struct.pack("<Q", len(body)) + body


_START_WRITEBACK = hasattr(os, "posix_fadvise")
# Once this many bytes of a shard are written and not yet flushed, a background thread flushes them (`fdatasync`)
# while the merge goes on, so `finalize`'s fsync waits for the tail only. Measured on a virtual disk: a 58 MiB
# output took 70-120 ms to fsync at the end; after an early flush of its first 44 MiB, the last 16 MiB took 23 ms.
EARLY_SYNC_BYTES = 32 << 20


def _pwrite_all(fd: int, view: memoryview, offset: int, path: str) -> None:
    """Write all of `view` at `offset`, in requests of at most `MAX_REQUEST_BYTES`, resuming short writes."""
    done, total = 0, len(view)
    while done < total:
        n = os.pwrite(fd, view[done : min(total, done + MAX_REQUEST_BYTES)], offset + done)
        if n <= 0:  # pragma: no cover - pwrite raises OSError (e.g. ENOSPC) rather than returning 0
            raise OSError(f"{path}: pwrite wrote nothing at byte {offset + done}")
        done += n


class StreamingSafetensorsWriter:
    """Write a (possibly sharded) safetensors checkpoint tile by tile.

    Args:
        folder: output folder (created if missing). Existing files with the shard/index names are overwritten.
        specs: every output tensor, in the order they are to be stored (the reference model's order).
        max_shard_size: maximum tensor bytes per shard (int; use `compat.parse_size` for "5GB").
        metadata: the safetensors `__metadata__` of every shard; transformers requires `{"format": "pt"}`.

    Attributes:
        files: shard paths, in order. `weight_map`: `{name: shard file name}`. `total_size`: sum of tensor bytes.
        bytes_written: tensor bytes written by `write_rows` so far (headers not counted).

    Usage:
        w = StreamingSafetensorsWriter(out, [OutputSpec("w", "BF16", (4, 8))], max_shard_size=5 * 10**9)
        w.write_rows("w", 0, tile_0_2)  # (2, 8) bf16, rows 0..1
        w.write_rows("w", 2, tile_2_4)
        w.finalize()  # raises if any range is missing

    Thread-safety: `write_rows` may be called from several threads (distinct ranges); bookkeeping takes a lock,
    `pwrite` does not need one.
    """

    def __init__(
        self,
        folder: str | os.PathLike,
        specs: list[OutputSpec],
        max_shard_size: int,
        metadata: dict[str, str] | None = None,
    ):
        if metadata is None:
            metadata = {"format": "pt"}
        if not (
            isinstance(metadata, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
        ):
            raise ValueError(f"metadata must map strings to strings (safetensors __metadata__), got {metadata!r}")
        if isinstance(max_shard_size, bool) or not isinstance(max_shard_size, int) or max_shard_size <= 0:
            raise ValueError(f"max_shard_size must be a positive number of bytes (int), got {max_shard_size!r}")
        specs = list(specs)
        if not specs:
            raise ValueError("StreamingSafetensorsWriter needs at least one OutputSpec")
        seen: set[str] = set()
        for spec in specs:
            if not isinstance(spec, OutputSpec):
                raise TypeError(f"specs must be OutputSpec objects, got {type(spec).__name__}")
            if spec.name in seen:
                raise ValueError(f"output tensor {spec.name!r} appears twice in specs")
            seen.add(spec.name)

        self.folder = Path(folder)
        self.metadata = metadata
        self.max_shard_size = max_shard_size
        self.bytes_written = 0
        self._lock = threading.Lock()
        self._finalized = False
        self._aborted = False
        self._unsynced: dict[int, int] = {}  # shard -> bytes written since its last flush was started
        self._syncer: threading.Thread | None = None
        self._sync_error: BaseException | None = None

        shards = shard_specs(specs, max_shard_size)
        names = shard_file_names(len(shards))
        self.files = [str(self.folder / n) for n in names]
        self.weight_map = {spec.name: names[i] for i, shard in enumerate(shards) for spec in shard}
        self.total_size = sum(s.nbytes for s in specs)
        self._slots: dict[str, _Slot] = {}
        headers = []
        for i, shard in enumerate(shards):
            header = build_header(shard, metadata)
            headers.append(header)
            offset = len(header)
            for spec in shard:
                self._slots[spec.name] = _Slot(spec, i, offset, [])
                offset += spec.nbytes

        self.folder.mkdir(parents=True, exist_ok=True)
        self._fds: list[int] = []
        self._created: list[str] = []  # abort() deletes only files this writer opened
        try:
            for path, header, shard in zip(self.files, headers, shards, strict=True):
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)
                self._fds.append(fd)
                self._created.append(path)
                size = len(header) + sum(s.nbytes for s in shard)
                self._reserve(fd, size, path)
                _pwrite_all(fd, memoryview(header), 0, path)
        except BaseException:
            self.abort()
            raise

    @staticmethod
    def _reserve(fd: int, size: int, path: str) -> None:
        """Size the file up front. `posix_fallocate` reserves the blocks, so a full disk fails now rather than hours
        into a merge; filesystems without it (EOPNOTSUPP/EINVAL) get a sparse file via `ftruncate`."""
        if size and hasattr(os, "posix_fallocate"):
            try:
                os.posix_fallocate(fd, 0, size)
                return
            except OSError as err:
                import errno

                if err.errno == errno.ENOSPC:
                    raise OSError(err.errno, f"{path}: not enough disk space for {size} bytes") from None
                if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                    raise
        os.ftruncate(fd, size)

    # -- writes -------------------------------------------------------------------------------------------------

    def spec(self, name: str) -> OutputSpec:
        try:
            return self._slots[name].spec
        except KeyError:
            raise KeyError(f"tensor {name!r} is not an output of this writer") from None

    def write_rows(self, name: str, row_start: int, tensor: torch.Tensor) -> None:
        """Write `tensor` as rows `[row_start, row_start + tensor.shape[0])` of output `name`.

        Args:
            name: output tensor name.
            row_start: first row of the tile (0 for a 0-d tensor).
            tensor: CPU, contiguous, dtype `TORCH_DTYPES[spec.dtype]` (the caller converts: the writer never casts,
                so rounding is decided in one place), shape `(rows, *spec.shape[1:])`; a 0-d output takes shape `()`
                or `(1,)`.

        Raises `ValueError` naming the tensor on a dtype/shape/device/contiguity mismatch, a range out of bounds, or
        a range that overlaps rows already written (nothing is written then).
        """
        if self._finalized or self._aborted:
            raise ValueError(f"writer for {str(self.folder)!r} is {'finalized' if self._finalized else 'aborted'}")
        slot = self._slots.get(name)
        if slot is None:
            raise KeyError(f"tensor {name!r} is not an output of this writer")
        spec = slot.spec
        row_start = operator.index(row_start)
        want_dtype = TORCH_DTYPES[spec.dtype]
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensor {name!r}: expected a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dtype != want_dtype:
            raise ValueError(
                f"tensor {name!r}: tile dtype {tensor.dtype} but the output dtype is {spec.dtype} ({want_dtype})"
            )
        if tensor.device.type != "cpu":
            raise ValueError(f"tensor {name!r}: tile is on {tensor.device}; move it to the CPU before writing")
        if not tensor.is_contiguous():
            raise ValueError(f"tensor {name!r}: tile is not contiguous (call .contiguous())")
        if spec.shape == ():
            if tuple(tensor.shape) not in ((), (1,)):
                raise ValueError(
                    f"tensor {name!r}: 0-d output takes a tile of shape () or (1,), got {tuple(tensor.shape)}"
                )
            rows = 1
        else:
            if tensor.dim() != len(spec.shape) or tuple(tensor.shape[1:]) != spec.shape[1:]:
                raise ValueError(
                    f"tensor {name!r}: tile shape {tuple(tensor.shape)} does not match (rows, *{spec.shape[1:]}) of "
                    f"output shape {spec.shape}"
                )
            rows = tensor.shape[0]
        row_stop = row_start + rows
        if not 0 <= row_start <= row_stop <= spec.n_rows:
            raise ValueError(f"tensor {name!r}: rows [{row_start}, {row_stop}) are not within [0, {spec.n_rows}]")
        with self._lock:
            if rows and spec.row_nbytes:
                for a, b in slot.written:
                    if a < row_stop and row_start < b:
                        raise ValueError(
                            f"tensor {name!r}: rows [{row_start}, {row_stop}) overlap rows [{a}, {b}) already written"
                        )
                slot.written.append((row_start, row_stop))
        nbytes = rows * spec.row_nbytes
        if nbytes:
            data = memoryview(tensor.reshape(-1).view(torch.uint8).numpy()).cast("B")
            path = self.files[slot.shard]
            at = slot.offset + row_start * spec.row_nbytes
            _pwrite_all(self._fds[slot.shard], data, at, path)
            if _START_WRITEBACK:
                # Linux starts writing the range back now (dirty pages are written, not dropped), so `finalize`'s
                # fsync waits for the tail of the output, not for all of it
                os.posix_fadvise(self._fds[slot.shard], at, nbytes, os.POSIX_FADV_DONTNEED)
            with self._lock:
                self.bytes_written += nbytes
                self._unsynced[slot.shard] = self._unsynced.get(slot.shard, 0) + nbytes
                if self._unsynced[slot.shard] >= EARLY_SYNC_BYTES and not self._syncing():
                    self._unsynced[slot.shard] = 0
                    self._syncer = threading.Thread(target=self._early_sync, args=(self._fds[slot.shard],),
                                                    name="hf_stable-merge-sync", daemon=True)  # fmt: skip
                    self._syncer.start()

    def _syncing(self) -> bool:
        return self._syncer is not None and self._syncer.is_alive()

    def _early_sync(self, fd: int) -> None:
        try:
            getattr(os, "fdatasync", os.fsync)(fd)  # macOS has no fdatasync
        except BaseException as err:  # reported by finalize: this flush may have consumed the file's write error
            self._sync_error = err

    def _join_syncer(self) -> None:
        """Wait for a background flush (the descriptors it uses stay open until it is done)."""
        syncer = self._syncer
        if syncer is not None:
            syncer.join()
        self._syncer = None

    def missing(self) -> dict[str, list[tuple[int, int]]]:
        """`{name: [missing row ranges]}` for every output not completely written yet (empty tensors never are)."""
        out = {}
        with self._lock:
            for name, slot in self._slots.items():
                if not slot.spec.nbytes:
                    continue
                gaps, pos = [], 0
                for a, b in sorted(slot.written):
                    if a > pos:
                        gaps.append((pos, a))
                    pos = max(pos, b)
                if pos < slot.spec.n_rows:
                    gaps.append((pos, slot.spec.n_rows))
                if gaps:
                    out[name] = gaps
        return out

    def finalize(self) -> list[str]:
        """Check that every byte of every tensor was written (exactly once: overlaps were refused on write), fsync
        and close the shards, and write `model.safetensors.index.json` when there are several.

        Returns the written paths (shards, then the index if any). Raises `ValueError` naming the incomplete tensors
        and their missing row ranges; the files stay open, so the caller may write the rest or `abort()`.
        """
        if self._aborted:
            raise ValueError(f"writer for {str(self.folder)!r} was aborted")
        if self._finalized:
            raise ValueError(f"writer for {str(self.folder)!r} is already finalized")
        missing = self.missing()
        if missing:
            shown = [f"{n!r} rows {ranges}" for n, ranges in list(missing.items())[:10]]
            more = f" ... ({len(missing)} tensors in all)" if len(missing) > 10 else ""
            raise ValueError(f"{self.folder}: output incomplete, never written: {'; '.join(shown)}{more}")
        self._join_syncer()
        if self._sync_error is not None:
            raise OSError(f"{self.folder}: flushing the output failed: {self._sync_error}") from self._sync_error
        for fd in self._fds:
            os.fsync(fd)  # the data is durable before the index (and the engine's rename) says the folder is done
        self._close_fds()
        paths = list(self.files)
        if len(self.files) > 1:
            index = {"metadata": {"total_size": self.total_size}, "weight_map": self.weight_map}
            index_path = self.folder / SAFE_WEIGHTS_INDEX_NAME
            with open(index_path, "w", encoding="utf-8") as f:
                f.write(json.dumps(index, indent=2) + "\n")
                f.flush()
                os.fsync(f.fileno())
            paths.append(str(index_path))
        self._finalized = True
        return paths

    def _close_fds(self) -> None:
        self._join_syncer()
        fds, self._fds = self._fds, []
        for fd in fds:
            os.close(fd)

    def abort(self) -> None:
        """Close the files and delete the (incomplete) shards this writer created. Idempotent; no-op once finalized."""
        if self._finalized or self._aborted:
            return
        self._aborted = True
        self._close_fds()
        for path in self._created:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def __enter__(self) -> StreamingSafetensorsWriter:
        return self

    def __exit__(self, *exc) -> None:
        # Leaving the block without finalize() (error or not) means the output is not complete: remove it.
        self.abort()
