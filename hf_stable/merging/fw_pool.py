"""FW-Merging's candidate pool: checkpoints streamed one tensor at a time, and the count of resident tensors.

Used by `hf_stable.merging.fw` (the Frank–Wolfe loop) and `hf_stable.merging.fw_objectives` (the experts of the
KL objective), so neither imports the other for it.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from hf_stable.merging.io.header import ModelCheckpoint
from hf_stable.merging.io.reader import SafetensorsReader


class ResidentTracker:
    """Counts candidate tensors (fp32 working copies) alive at the same time, through weak references.

    `track(t)` registers a tensor; it stops counting when Python frees it, so a leaked reference shows up in
    `peak_tensors` / `peak_bytes`. `bytes_read` counts the stored bytes read from the pool (disk or memory).
    """

    def __init__(self) -> None:
        self.current_bytes = 0
        self.current_tensors = 0
        self.peak_bytes = 0
        self.peak_tensors = 0
        self.bytes_read = 0
        self.reads = 0

    def _release(self, nbytes: int) -> None:
        self.current_bytes -= nbytes
        self.current_tensors -= 1

    def track(self, tensor: torch.Tensor, stored_nbytes: int) -> torch.Tensor:
        nbytes = tensor.numel() * tensor.element_size()
        self.current_bytes += nbytes
        self.current_tensors += 1
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        self.peak_tensors = max(self.peak_tensors, self.current_tensors)
        self.bytes_read += stored_nbytes
        self.reads += 1
        weakref.finalize(tensor, self._release, nbytes)
        return tensor


class CandidateSource:
    """One pool member: a safetensors checkpoint (folder, index + shards, or one file) streamed one tensor at a time,
    or an in-memory state dict (tests, callbacks).

    Reads go through `hf_stable.merging.io.reader.SafetensorsReader`. Every read returns a fresh fp32 tensor on
    `device`, registered with the tracker.
    """

    def __init__(self, spec: Any, tracker: ResidentTracker, *, label: str, device: torch.device | str = "cpu"):
        self.label, self.tracker, self.device = label, tracker, torch.device(device)
        self._state: Mapping[str, torch.Tensor] | None = None
        self._reader = None
        if isinstance(spec, Mapping):
            self._state = spec
            self.shapes = {n: tuple(t.shape) for n, t in spec.items() if torch.is_tensor(t)}
            self._order = list(self.shapes)
            return
        if not isinstance(spec, (str, os.PathLike)):
            raise TypeError(f"pool entry {label}: expected a path (str/PathLike) or a state dict, got {type(spec)}")
        self.checkpoint = ModelCheckpoint.open(spec)
        infos = self.checkpoint.tensors
        self.shapes = {n: tuple(info.shape) for n, info in infos.items()}
        # on-disk order: by shard file, then byte offset (sequential reads)
        self._order = sorted(infos, key=lambda n: (str(infos[n].file), infos[n].offset))
        self._reader = SafetensorsReader(self.checkpoint)

    def order(self, names: Sequence[str]) -> list[str]:
        wanted = set(names)
        return [n for n in self._order if n in wanted]

    def read(self, name: str) -> torch.Tensor:
        """The tensor `name` as a fresh fp32 tensor of the stored shape (tracked)."""
        if self._state is not None:
            raw = self._state[name].detach()
            out = raw.to(device=self.device, dtype=torch.float32, copy=True)
            return self.tracker.track(out, raw.numel() * raw.element_size())
        info = self.checkpoint.tensors[name]
        raw = self._reader.read_tensor(name)
        out = raw.to(device=self.device, dtype=torch.float32, copy=True).reshape(info.shape)
        del raw
        return self.tracker.track(out, info.nbytes)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
