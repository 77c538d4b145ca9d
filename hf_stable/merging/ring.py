"""The engine's buffer ring: a few chunk slots allocated once, filled by one I/O thread ahead of the compute.

Each slot holds the raw bytes of one chunk of every source (`RING_SLOTS` × `chunk × Σ itemsize`) and its output
bytes. The I/O thread walks the jobs in order: it takes a free slot, writes the output the slot still holds from
its previous job (`pwrite`), reads the next job's inputs into it (`pread`) and hands it to the compute thread. The
compute thread combines a ready slot into its output buffer and gives it back. So while chunk k is combined,
chunk k+1 is read and chunk k−1 written, and the ring is the memory bound: nothing is allocated per chunk.

A job of a tensor kept in the raw cache reads into the cache instead (first pass only; later passes read nothing).
The cache holds one tensor at a time: the I/O thread waits for the compute thread to finish the previous cached
tensor before filling it again.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch


_POLL_S = 0.05
_DONE = object()


@dataclass
class Slot:
    """One ring slot: raw input bytes, output bytes, and the job it holds."""

    raw: torch.Tensor  # uint8
    out: torch.Tensor  # uint8
    job: Any = None
    views: list[torch.Tensor] = field(default_factory=list)
    pending: tuple[str, int, torch.Tensor] | None = None  # (tensor name, first row, tile) still to be written


class IOThread:
    """Reads jobs' inputs into ring slots ahead of the consumer and writes their outputs when slots come back.

    Args:
        jobs: the jobs, in order.
        slots: the ring.
        read: `read(job, slot) -> views` fills the slot (or the cache) and returns the sources' typed views.
        write: `write(name, row_start, tile)`.
        cache_lock: taken before the first read of a cached tensor (`job.fills_cache`), released by the consumer.
    """

    def __init__(
        self,
        jobs: Iterable[Any],
        slots: list[Slot],
        read: Callable[[Any, Slot], list[torch.Tensor]],
        write: Callable[[str, int, torch.Tensor], None],
        cache_lock: threading.Semaphore,
    ):
        self._jobs = jobs
        self._read, self._write = read, write
        self._free: queue.Queue = queue.Queue()
        for slot in slots:
            self._free.put(slot)
        self._ready: queue.Queue = queue.Queue()
        self._slots = slots
        self._cache_lock = cache_lock
        self._stop = threading.Event()
        self.read_s = self.write_s = 0.0
        self.read_bytes = 0
        self._thread = threading.Thread(target=self._run, name="hf_stable-merge-io", daemon=True)
        self._thread.start()

    def _get_free(self) -> Slot | None:
        while not self._stop.is_set():
            try:
                return self._free.get(timeout=_POLL_S)
            except queue.Empty:
                continue
        return None

    def _flush(self, slot: Slot) -> None:
        if slot.pending is not None:
            name, row, tile = slot.pending
            slot.pending = None
            t0 = time.perf_counter()
            self._write(name, row, tile)
            self.write_s += time.perf_counter() - t0

    def _run(self) -> None:
        try:
            for job in self._jobs:
                slot = self._get_free()
                if slot is None:
                    return
                self._flush(slot)
                if getattr(job, "fills_cache", False):
                    while not self._cache_lock.acquire(timeout=_POLL_S):
                        if self._stop.is_set():
                            return
                t0 = time.perf_counter()
                slot.views = self._read(job, slot)
                self.read_s += time.perf_counter() - t0
                self.read_bytes += getattr(job, "read_bytes", 0)
                slot.job = job
                self._ready.put(slot)
        except BaseException as err:  # handed to the consumer
            self._ready.put(err)
            return
        self._ready.put(_DONE)

    def __iter__(self):
        while True:
            item = self._ready.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def give_back(self, slot: Slot) -> None:
        """The consumer is done with `slot` (its `pending` output, if any, is written before the slot is reused)."""
        self._free.put(slot)

    def finish(self) -> None:
        """After the last job: join the thread and write what the slots still hold."""
        self._thread.join()
        for slot in self._slots:
            self._flush(slot)

    def close(self) -> None:
        """Stop the thread (on error); pending outputs are dropped."""
        self._stop.set()
        self._thread.join()
        for slot in self._slots:
            slot.pending = None
