"""Read row ranges of safetensors tensors with `pread`, without mmap.

Why not `safetensors.safe_open` (mmap)? Pages touched through an mmap count towards the process RSS (as
`RssFile`) and stay mapped until the file is closed, so a merge of N large checkpoints looks like it holds all of
them. `pread` copies exactly the requested bytes into a buffer we own, releases the GIL while the kernel works (so
several reader threads overlap their I/O), and leaves page-cache policy to `posix_fadvise`.

A read of rows `[a, b)` of a tensor is one contiguous byte range, `offset + a·row_nbytes ... offset + b·row_nbytes`,
because safetensors stores tensors C-contiguous. The bytes land in an uninitialised `torch.uint8` buffer (no
zero-fill pass, unlike `bytearray`) that is reinterpreted in place with `Tensor.view(dtype)`: zero-copy for every
dtype, bf16 and fp8 included (numpy has no bf16, so `np.frombuffer` would not do).

The reader is thread-safe: `pread` has no shared file position, and the fd cache and counters take a lock. The
engine owns the I/O thread; this class only reads.
"""

from __future__ import annotations

import operator
import os
import threading

import torch

from .dtypes import torch_dtype, torch_dtypes
from .header import ModelCheckpoint, TensorInfo


# Used by the writer to check tile dtypes.
TORCH_DTYPES: dict[str, torch.dtype] = torch_dtypes()

# Largest single pread/pwrite request. Linux caps one read(2) at 0x7ffff000 bytes anyway; 64 MiB is the top of the
# 8–64 MB range: large enough to run at device speed, small enough that a short read is cheap to resume.
MAX_REQUEST_BYTES = 64 * 2**20

_HAS_PREADV = hasattr(os, "preadv")
_HAS_FADVISE = hasattr(os, "posix_fadvise")


def pread_into(fd: int, view: memoryview, offset: int, path: str = "<fd>") -> None:
    """Fill `view` (writable, byte-format) with the file bytes at `[offset, offset + len(view))`.

    Loops over requests of at most `MAX_REQUEST_BYTES` and resumes short reads; hitting end-of-file first raises
    `OSError` naming the file (a truncated checkpoint must not produce a half-zero tensor).
    """
    done, total = 0, len(view)
    while done < total:
        chunk = view[done : min(total, done + MAX_REQUEST_BYTES)]
        if _HAS_PREADV:
            n = os.preadv(fd, [chunk], offset + done)
        else:  # pragma: no cover - platforms without preadv (e.g. old macOS): one copy through bytes
            data = os.pread(fd, len(chunk), offset + done)
            n = len(data)
            chunk[:n] = data
        if n == 0:
            raise OSError(f"{path}: unexpected end of file at byte {offset + done} (wanted {total - done} more bytes)")
        done += n


class SafetensorsReader:
    """Row-range reader over one `ModelCheckpoint`.

    Args:
        checkpoint: the checkpoint to read, from `ModelCheckpoint.open`.
        drop_cache: after each read, `posix_fadvise(DONTNEED)` the range just read so a merge of many large inputs
            does not flush the rest of the page cache. Off by default: re-reads (2-pass methods) are faster
            from the cache.

    Attributes:
        bytes_read: total tensor bytes returned so far (file-backed and in-memory), for throughput reporting.

    Usage:
        with SafetensorsReader(ModelCheckpoint.open(path)) as r:
            tile = r.read_rows("model.embed_tokens.weight", 0, 128)  # (128, hidden), stored dtype
    """

    def __init__(self, checkpoint: ModelCheckpoint, *, drop_cache: bool = False):
        self.checkpoint = checkpoint
        self.drop_cache = drop_cache
        self.bytes_read = 0
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        self._closed = False

    # -- file descriptors -------------------------------------------------------------------------------------

    def _fd(self, path: str) -> int:
        """Cached read-only descriptor for `path`; opened once per file (shards are read many times)."""
        fd = self._fds.get(path)
        if fd is not None:
            return fd
        with self._lock:
            if self._closed:
                raise ValueError(f"reader for {self.checkpoint.path!r} is closed")
            fd = self._fds.get(path)
            if fd is None:
                fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                if _HAS_FADVISE:
                    # Chunks are requested in file order: let the kernel read ahead.
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                self._fds[path] = fd
        return fd

    def close(self) -> None:
        """Close every cached descriptor. Idempotent; later reads of file-backed tensors raise."""
        with self._lock:
            self._closed = True
            fds, self._fds = list(self._fds.values()), {}
        for fd in fds:
            os.close(fd)

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):  # best effort: do not leak descriptors when a caller forgets close()
        try:
            self.close()
        except Exception:
            pass

    # -- reads --------------------------------------------------------------------------------------------------

    def info(self, name: str) -> TensorInfo:
        """The `TensorInfo` of `name`; `KeyError` naming the checkpoint when absent."""
        try:
            return self.checkpoint.tensors[name]
        except KeyError:
            raise KeyError(f"tensor {name!r} is not in checkpoint {self.checkpoint.path!r}") from None

    def read_rows(self, name: str, row_start: int, row_stop: int, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows `[row_start, row_stop)` of tensor `name`, in its stored dtype.

        Args:
            name: tensor name.
            row_start, row_stop: row range along dim 0, `0 ≤ row_start ≤ row_stop ≤ n_rows`. A 0-d tensor has one
                row: read it with `(0, 1)`.
            out: optional contiguous CPU `torch.uint8` buffer of at least the tile's byte size (e.g. a reused or
                pinned buffer); the result is a view of its first bytes. Default: a fresh buffer per call.

        Returns:
            Tensor of shape `(row_stop − row_start, *shape[1:])` (shape `(1,)` for a 0-d tensor), dtype
            `TORCH_DTYPES[info.dtype]`; its bytes equal `safe_open(...).get_slice(name)[row_start:row_stop]`.
        """
        info = self.info(name)
        n_rows = info.n_rows
        row_start, row_stop = operator.index(row_start), operator.index(row_stop)  # numpy/torch ints welcome
        if not 0 <= row_start <= row_stop <= n_rows:
            raise ValueError(
                f"tensor {name!r} of shape {list(info.shape)}: row range [{row_start}, {row_stop}) is not within "
                f"[0, {n_rows}]"
            )
        dtype = torch_dtype(info.dtype)
        rows = row_stop - row_start
        nbytes = rows * info.row_nbytes
        start = info.offset + row_start * info.row_nbytes  # C-contiguous: a row range is one byte range
        if out is not None:
            if out.dtype != torch.uint8 or out.device.type != "cpu" or not out.is_contiguous() or out.numel() < nbytes:
                raise ValueError(
                    f"out must be a contiguous CPU torch.uint8 tensor of at least {nbytes} bytes, got "
                    f"{out.dtype} {tuple(out.shape)} on {out.device}"
                )
            buf = out.reshape(-1)[:nbytes]
        else:
            buf = torch.empty(nbytes, dtype=torch.uint8)  # uninitialised: pread overwrites every byte
        if nbytes:
            if info.buffer is not None:
                self._copy_from_memory(info, buf, start, nbytes)
            else:
                fd = self._fd(info.file)
                pread_into(fd, memoryview(buf.numpy()).cast("B"), start, info.file)
                if self.drop_cache and _HAS_FADVISE:
                    os.posix_fadvise(fd, start, nbytes, os.POSIX_FADV_DONTNEED)
        with self._lock:
            self.bytes_read += nbytes
        return buf.view(dtype).reshape((rows, *info.shape[1:]))

    def read_tensor(self, name: str) -> torch.Tensor:
        """The whole tensor `name`, shape `info.shape` (0-d stays 0-d), stored dtype."""
        info = self.info(name)
        return self.read_rows(name, 0, info.n_rows).reshape(info.shape)

    @staticmethod
    def _copy_from_memory(info: TensorInfo, buf: torch.Tensor, start: int, nbytes: int) -> None:
        """In-memory source (pickle loaded with `allow_pickle=True`): `info.buffer` holds the packed bytes and
        `info.offset` is relative to it. Copied, so callers may modify the result as they can a file read."""
        src = info.buffer
        if not isinstance(src, torch.Tensor):
            src = torch.frombuffer(memoryview(src).cast("B"), dtype=torch.uint8)
        buf.copy_(src.reshape(-1)[start : start + nbytes])
