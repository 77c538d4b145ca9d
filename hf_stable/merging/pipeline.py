"""The merge engine's three-stage pipeline: reader thread → compute (caller's thread) → writer thread (spec §8.4).

Bounded queues (depth `QUEUE_DEPTH` = 2) between the stages give double buffering: while the caller computes
tile t, the reader fetches tiles t+1 and t+2 and the writer stores tile t−1. `pread`/`pwrite` release the GIL, so
I/O overlaps with torch compute even on CPU.

Memory accounting (the memory budget bounds everything in flight, `MemoryTracker`):

* every tile set the reader fetches is charged when its read starts and released when compute is done with it;
  at most `QUEUE_DEPTH + 2` sets are alive (one being read, `QUEUE_DEPTH` queued, one being computed on);
* compute charges its fp32/fp64 working set (an upper estimate per method kind, see `engine.bytes_per_element`)
  while it holds it;
* every output tile is charged from its creation until the writer has `pwrite`-n it; at most `QUEUE_DEPTH + 2`
  output tiles are alive (one being made, `QUEUE_DEPTH` queued, one being written).

The planner sizes tiles so that the sum of these worst cases fits the budget; `peak` records the high-water mark
of what was actually charged (`MergeResult.peak_tracked_bytes`). Interpreter, torch and library overheads
(tens of MB) are not in it.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any


QUEUE_DEPTH = 2
_POLL_S = 0.05
_DONE = object()


class MemoryTracker:
    """Thread-safe counter of tracked resident bytes with a high-water mark."""

    def __init__(self):
        self._lock = threading.Lock()
        self.current = 0
        self.peak = 0

    def acquire(self, nbytes: int) -> None:
        with self._lock:
            self.current += int(nbytes)
            self.peak = max(self.peak, self.current)

    def release(self, nbytes: int) -> None:
        with self._lock:
            self.current -= int(nbytes)


@dataclass
class StageClock:
    """Busy seconds and bytes handled per stage, for the progress bar and `MergeResult.timings`."""

    seconds: dict[str, float] = field(default_factory=lambda: {"read": 0.0, "compute": 0.0, "write": 0.0})
    nbytes: dict[str, int] = field(default_factory=lambda: {"read": 0, "compute": 0, "write": 0})
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, stage: str, seconds: float, nbytes: int) -> None:
        with self._lock:
            self.seconds[stage] += seconds
            self.nbytes[stage] += nbytes

    def rates_mb_s(self) -> dict[str, float]:
        with self._lock:
            return {k: (self.nbytes[k] / self.seconds[k] / 1e6 if self.seconds[k] > 0 else 0.0) for k in self.seconds}


class PipelineError(RuntimeError):
    """Wraps nothing: the original exception of a stage is re-raised in the caller's thread."""


def _put(q: queue.Queue, item: Any, stop: threading.Event) -> bool:
    """Blocking put that gives up when `stop` is set (the other side failed); returns whether it was put."""
    while not stop.is_set():
        try:
            q.put(item, timeout=_POLL_S)
            return True
        except queue.Full:
            continue
    return False


class Prefetcher:
    """Runs `fetch(job) -> (item, nbytes)` for each job in a background thread, `QUEUE_DEPTH` ahead of the consumer.

    `cost(job)` (bytes) is charged to the tracker before the fetch starts; the consumer releases it with
    `tracker.release` when done with the item. Exceptions in `fetch` are re-raised by `__iter__` in the consumer.
    """

    def __init__(
        self,
        jobs: Iterable[Any],
        fetch: Callable[[Any], Any],
        cost: Callable[[Any], int],
        tracker: MemoryTracker,
        clock: StageClock,
    ):
        self._jobs = jobs
        self._fetch = fetch
        self._cost = cost
        self._tracker = tracker
        self._clock = clock
        self._queue: queue.Queue = queue.Queue(maxsize=QUEUE_DEPTH)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hf_stable-merge-reader", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for job in self._jobs:
                if self._stop.is_set():
                    return
                nbytes = self._cost(job)
                self._tracker.acquire(nbytes)
                t0 = time.perf_counter()
                item = self._fetch(job)
                self._clock.add("read", time.perf_counter() - t0, nbytes)
                if not _put(self._queue, (job, item, nbytes), self._stop):
                    self._tracker.release(nbytes)
                    return
        except BaseException as err:  # handed to the consumer thread
            _put(self._queue, err, self._stop)
            return
        _put(self._queue, _DONE, self._stop)

    def __iter__(self):
        while True:
            item = self._queue.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def close(self) -> None:
        """Stop the thread and drop (and release) whatever is still queued."""
        self._stop.set()
        self._thread.join()
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, tuple):
                self._tracker.release(item[2])


class BackgroundWriter:
    """Calls `write(name, row_start, tensor)` in a background thread; `submit` blocks when `QUEUE_DEPTH` are queued.

    The tile's bytes (charged by the caller before `submit`) are released once written. The first write error is
    re-raised by the next `submit` or by `close`.
    """

    def __init__(self, write: Callable[[str, int, Any], None], tracker: MemoryTracker, clock: StageClock):
        self._write = write
        self._tracker = tracker
        self._clock = clock
        self._queue: queue.Queue = queue.Queue(maxsize=QUEUE_DEPTH)
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="hf_stable-merge-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _DONE:
                return
            name, row_start, tensor, nbytes = item
            try:
                if self._error is None:
                    t0 = time.perf_counter()
                    self._write(name, row_start, tensor)
                    self._clock.add("write", time.perf_counter() - t0, nbytes)
            except BaseException as err:  # handed to the producer thread
                self._error = err
                self._stop.set()
            finally:
                self._tracker.release(nbytes)

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def submit(self, name: str, row_start: int, tensor: Any, nbytes: int) -> None:
        self._raise()
        if not _put(self._queue, (name, row_start, tensor, nbytes), self._stop):
            self._tracker.release(nbytes)
            self._raise()

    def close(self) -> None:
        """Wait until everything queued is written, then re-raise a write error if any."""
        self._queue.put(_DONE)
        self._thread.join()
        self._raise()
