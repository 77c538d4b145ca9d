"""Training-state snapshots for rollback: trainable weights, optimizer state, scheduler and GradScaler state.

A snapshot is the consistent triple taken *before* optimizer step ``s``: the weights ``w_s`` that just produced a
healthy loss and gradient, the optimizer state after step ``s − 1`` and the scheduler after ``s − 1`` steps. Restoring
it and skipping the current update puts the run back exactly there (data keeps moving forward).

* Capture: every tensor is ``detach().to("cpu", copy=True)`` (the optimizer's state dict holds live references).
* Restore: ``p.copy_(saved)`` under ``no_grad`` (never rebind ``p.data``: optimizer state is keyed by the parameter
  object) and ``optimizer.load_state_dict`` (it casts to each parameter's device and dtype). With
  ``restore_hyperparameters=False`` the optimizer's current param-group hyper-parameters (``lr``, ...) are kept, so a
  schedule that reads the current ``lr`` (e.g. ``ExponentialLR``) is not rewound.
* Memory (see [`expected_snapshot_nbytes`]): for AdamW with fp32 state, ``Σ_p numel(p)·(b_p + 8) + 4·n_p`` bytes: the
  weight in its own dtype, ``exp_avg`` and ``exp_avg_sq`` in fp32 and a 4-byte ``step`` per tensor (12 bytes per
  fp32 parameter). The store keeps a candidate and ``history`` confirmed snapshots.
* Disk storage: weights as safetensors, optimizer/scheduler/scaler state with ``torch.save`` and read back with
  ``torch.load(weights_only=True)``; each snapshot is written to a temporary folder, then renamed.

Pure torch (plus safetensors); no transformers import.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch


__all__ = [
    "Snapshot",
    "SnapshotStore",
    "expected_snapshot_nbytes",
    "restore_snapshot",
    "snapshot_nbytes",
    "take_snapshot",
    "to_cpu",
]


def to_cpu(obj: Any) -> Any:
    """Deep copy of a (nested dict/list/tuple of) tensors with every tensor detached and copied to CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [to_cpu(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(to_cpu(v) for v in obj)
    return obj


def _tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


@dataclass
class Snapshot:
    """State at the start of optimizer step ``step`` (1-based)."""

    step: int
    params: dict[str, torch.Tensor]
    optimizer: dict | None
    scheduler: dict | None = None
    scaler: dict | None = None
    meta: dict = field(default_factory=dict)


def take_snapshot(
    step: int,
    named_params: Iterable[tuple[str, torch.Tensor]],
    optimizer=None,
    lr_scheduler=None,
    scaler=None,
    meta: dict | None = None,
) -> Snapshot:
    """Copy ``named_params`` (the caller chooses the scope: trainable only, or all parameters and buffers), the
    optimizer's state dict, the scheduler's and the GradScaler's to CPU."""
    params = {name: p.detach().to("cpu", copy=True) for name, p in named_params}
    return Snapshot(
        step=int(step),
        params=params,
        optimizer=None if optimizer is None else to_cpu(optimizer.state_dict()),
        scheduler=None if lr_scheduler is None else to_cpu(lr_scheduler.state_dict()),
        scaler=None if scaler is None or not _scaler_enabled(scaler) else to_cpu(scaler.state_dict()),
        meta=dict(meta or {}),
    )


def _scaler_enabled(scaler) -> bool:
    return bool(getattr(scaler, "is_enabled", lambda: True)())


def restore_snapshot(
    snapshot: Snapshot,
    named_params: Iterable[tuple[str, torch.Tensor]],
    optimizer=None,
    lr_scheduler=None,
    scaler=None,
    *,
    restore_scheduler: bool = False,
    restore_hyperparameters: bool = False,
) -> None:
    """Write ``snapshot`` back in place. Every parameter named in the snapshot must be in ``named_params``."""
    live = dict(named_params)
    missing = sorted(set(snapshot.params) - set(live))
    if missing:
        raise KeyError(f"snapshot holds parameters the model no longer has: {missing[:5]}")
    with torch.no_grad():
        for name, saved in snapshot.params.items():
            live[name].copy_(saved)
    if optimizer is not None and snapshot.optimizer is not None:
        current = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
        optimizer.load_state_dict(snapshot.optimizer)
        if not restore_hyperparameters:
            for group, hyper in zip(optimizer.param_groups, current, strict=True):
                group.update(hyper)
    if restore_scheduler and lr_scheduler is not None and snapshot.scheduler is not None:
        lr_scheduler.load_state_dict(snapshot.scheduler)
    if scaler is not None and snapshot.scaler is not None:
        scaler.load_state_dict(snapshot.scaler)


def snapshot_nbytes(snapshot: Snapshot) -> int:
    """Bytes held by the tensors of ``snapshot`` (weights + optimizer + scheduler + scaler)."""
    return sum(_tensor_bytes(x) for x in (snapshot.params, snapshot.optimizer, snapshot.scheduler, snapshot.scaler))


def expected_snapshot_nbytes(params: Iterable[torch.Tensor], optimizer=None) -> int:
    """The documented formula: ``Σ_p numel(p)·b_p`` for the weights plus, per parameter the optimizer tracks, the bytes
    of its state tensors (AdamW: ``exp_avg``, ``exp_avg_sq`` in the parameter's dtype and a 0-d fp32 ``step``, i.e.
    ``numel·2·b_p + 4``; for fp32 weights 12 bytes per parameter + 4 per tensor). Read from the optimizer's state
    dict, so it holds for any optimizer whose state is per-parameter tensors."""
    total = sum(p.numel() * p.element_size() for p in params)
    if optimizer is not None:
        total += _tensor_bytes(optimizer.state_dict()["state"])
    return total


class SnapshotStore:
    """Two kinds of slots: one *candidate* (not yet trusted) and up to ``history`` *confirmed* snapshots, newest last.

    ``storage="cpu"`` keeps them in RAM; ``"disk"`` writes each under ``folder/<slot>/`` and keeps only metadata in
    RAM. With ``writer=False`` (non-main ranks under DDP with disk storage) ``put`` writes nothing and the caller
    must synchronise (barrier) before anyone reads.
    """

    def __init__(self, storage: str = "cpu", folder: str | None = None, history: int = 1, writer: bool = True):
        if storage not in ("cpu", "disk"):
            raise ValueError(f"`snapshot_storage`={storage!r} is not valid. Allowed values: 'cpu', 'disk'.")
        if storage == "disk" and not folder:
            raise ValueError("`snapshot_storage='disk'` needs a folder.")
        self.storage = storage
        self.folder = folder
        self.history = int(history)
        self.writer = writer
        self.candidate: Snapshot | int | None = None  # a Snapshot in RAM, or its step on disk
        self.confirmed: list[Snapshot | int] = []

    # -- slots --------------------------------------------------------------------------------------------------
    @staticmethod
    def _step(item: Snapshot | int) -> int:
        return item.step if isinstance(item, Snapshot) else int(item)

    @property
    def candidate_step(self) -> int | None:
        return None if self.candidate is None else self._step(self.candidate)

    @property
    def confirmed_steps(self) -> list[int]:
        return [self._step(s) for s in self.confirmed]

    def put_candidate(self, snapshot: Snapshot) -> None:
        self.discard_candidate()
        self.candidate = self._write(snapshot, "candidate") if self.storage == "disk" else snapshot

    def discard_candidate(self) -> None:
        if self.candidate is not None and self.storage == "disk" and self.writer:
            shutil.rmtree(self._dir("candidate"), ignore_errors=True)
        self.candidate = None

    def confirm_candidate(self) -> None:
        """Promote the candidate to newest confirmed; the oldest confirmed beyond ``history`` is dropped."""
        if self.candidate is None:
            return
        if self.storage == "disk":
            step = self._step(self.candidate)
            if self.writer:
                _replace_dir(self._dir("candidate"), self._dir(f"confirmed-{step}"))
            self.confirmed.append(step)
        else:
            self.confirmed.append(self.candidate)
        self.candidate = None
        while len(self.confirmed) > self.history:
            self._drop(self.confirmed.pop(0))

    def drop_newest_confirmed(self) -> None:
        if self.confirmed:
            self._drop(self.confirmed.pop())

    def newest_confirmed(self) -> Snapshot | None:
        return self._load(self.confirmed[-1]) if self.confirmed else None

    def clear(self) -> None:
        self.discard_candidate()
        while self.confirmed:
            self._drop(self.confirmed.pop())

    def nbytes(self) -> int:
        """RAM held by the snapshots (0 for disk storage)."""
        items = [*self.confirmed, self.candidate]
        return sum(snapshot_nbytes(s) for s in items if isinstance(s, Snapshot))

    def adopt_disk_snapshots(self, max_step: int) -> list[int]:
        """After a resume: reuse the confirmed snapshots on disk whose step is ≤ ``max_step`` (newest ``history``)."""
        if self.storage != "disk" or not os.path.isdir(self.folder):
            return []
        steps = []
        for name in os.listdir(self.folder):
            if name.startswith("confirmed-") and os.path.isfile(os.path.join(self.folder, name, "meta.json")):
                step = int(name.split("-", 1)[1])
                if step <= max_step:
                    steps.append(step)
        self.confirmed = sorted(steps)[-self.history :] if self.history else []
        return list(self.confirmed)

    # -- checkpoints --------------------------------------------------------------------------------------------
    def export_to(self, folder: str) -> dict:
        """Write every held snapshot under ``folder/<slot>/`` (the disk format) and return ``{"candidate": step or
        None, "confirmed": [steps]}``: what a resumed run needs to continue exactly as if never stopped."""
        slots = [("candidate", self.candidate)] + [(f"confirmed-{self._step(s)}", s) for s in self.confirmed]
        for slot, item in slots:
            if item is not None:
                _write_snapshot(self._load_any(item, slot), os.path.join(folder, slot))
        return {"candidate": self.candidate_step, "confirmed": self.confirmed_steps}

    def import_from(self, folder: str, index: dict) -> None:
        """Replace the held snapshots by those ``export_to`` wrote to ``folder`` (``index`` is what it returned)."""
        self.clear()
        for step in index.get("confirmed", []):
            snapshot = _read_snapshot(os.path.join(folder, f"confirmed-{step}"))
            if self.storage == "disk":
                self._write(snapshot, f"confirmed-{step}")
                self.confirmed.append(step)
            else:
                self.confirmed.append(snapshot)
        if index.get("candidate") is not None:
            self.put_candidate(_read_snapshot(os.path.join(folder, "candidate")))

    def _load_any(self, item: Snapshot | int, slot: str) -> Snapshot:
        if isinstance(item, Snapshot):
            return item
        return _read_snapshot(self._dir(slot))

    # -- disk ---------------------------------------------------------------------------------------------------
    def _dir(self, slot: str) -> str:
        return os.path.join(self.folder, slot)

    def _drop(self, item: Snapshot | int) -> None:
        if self.storage == "disk" and self.writer:
            shutil.rmtree(self._dir(f"confirmed-{self._step(item)}"), ignore_errors=True)

    def _write(self, snapshot: Snapshot, slot: str) -> int:
        if self.writer:
            os.makedirs(self.folder, exist_ok=True)
            _write_snapshot(snapshot, self._dir(slot))
        return snapshot.step

    def _load(self, item: Snapshot | int) -> Snapshot:
        return self._load_any(item, f"confirmed-{self._step(item)}")


def _write_snapshot(snapshot: Snapshot, folder: str) -> None:
    """Weights as safetensors, optimizer/scheduler/scaler state with ``torch.save``, step and meta as JSON; written
    to a temporary folder, then renamed to ``folder``."""
    from safetensors.torch import save_file

    tmp = os.path.join(os.path.dirname(folder), f".{os.path.basename(folder)}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    save_file({k: v.contiguous() for k, v in snapshot.params.items()}, os.path.join(tmp, "params.safetensors"))
    torch.save(
        {"optimizer": snapshot.optimizer, "scheduler": snapshot.scheduler, "scaler": snapshot.scaler},
        os.path.join(tmp, "state.pt"),
    )
    with open(os.path.join(tmp, "meta.json"), "w", encoding="utf-8") as f:
        json.dump({"step": snapshot.step, **snapshot.meta}, f)
    _replace_dir(tmp, folder)


def _read_snapshot(folder: str) -> Snapshot:
    from safetensors.torch import load_file

    with open(os.path.join(folder, "meta.json"), encoding="utf-8") as f:
        meta = json.load(f)
    state = torch.load(os.path.join(folder, "state.pt"), map_location="cpu", weights_only=True)
    return Snapshot(
        step=int(meta.pop("step")),
        params=load_file(os.path.join(folder, "params.safetensors")),
        optimizer=state["optimizer"],
        scheduler=state["scheduler"],
        scaler=state["scaler"],
        meta=meta,
    )


def _replace_dir(src: str, dst: str) -> None:
    """Atomically put folder ``src`` at ``dst`` (an old ``dst`` is moved aside first, then removed)."""
    old = dst + ".old"
    if os.path.exists(dst):
        shutil.rmtree(old, ignore_errors=True)
        os.replace(dst, old)
    os.replace(src, dst)
    shutil.rmtree(old, ignore_errors=True)
