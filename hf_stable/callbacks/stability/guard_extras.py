"""The held-out probe and the DeepSpeed snapshots of `StabilityGuardCallback` (its plumbing, split off)."""

from __future__ import annotations

import json
import math
import os

import torch

from ...stability.guard import Decision
from .._checkpoint_files import CheckpointFiles
from ._common import _PROBE_SETS, _prompt_completion_batch, _world_size, logger


SNAPSHOT_DIR = "stable_guard"  # inside a checkpoint: <checkpoint>/stable_guard/<name>/{index.json, <slot>/}


def save_snapshots(store, folder: str) -> None:
    """The store's snapshots (safetensors + optimizer state) under ``folder``, with ``index.json`` written last: a
    folder without it is incomplete and ignored on resume."""
    index = store.export_to(folder)
    with open(os.path.join(folder, "index.json"), "w", encoding="utf-8") as f:
        json.dump(index, f)


def saved_index(folder: str) -> dict | None:
    """``{"confirmed": [steps], "candidate": step or None}`` of the snapshots saved in ``folder``; None if none."""
    path = os.path.join(folder, "index.json")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


class _GuardCheckpoint(CheckpointFiles):
    """The snapshots travel with each checkpoint: written into the staged folder of the hf_stable trainers' atomic save
    (``on_save`` under another trainer; see `CheckpointFiles`)."""

    def _write_checkpoint_files(self, folder: str, args, state) -> None:
        if self._backend == "deepspeed" or not self.policy.uses_snapshots or not state.is_world_process_zero:
            return
        save_snapshots(self.store, os.path.join(folder, SNAPSHOT_DIR, self.name))


def report(decision: Decision, state) -> None:
    """Log an anomalous decision (main process)."""
    if not state.is_world_process_zero:
        return
    z = {"loss": decision.loss_z, "grad": decision.grad_z}.get(decision.kind)
    what = f"{decision.kind} spike (z={z:.1f})" if z is not None and math.isfinite(z) else decision.kind
    if decision.kind == "nonfinite":
        what = "non-finite loss or gradient norm"
    if decision.kind == "probe":
        what = "held-out probe loss jumped"
    done = {
        "skip": "skipped the update",
        "rollback": f"rolled back to the snapshot of step {decision.restore_step} and skipped the update",
        "stop": f"rollback budget spent: restored step {decision.restore_step}, saving and stopping",
        "raise": f"rollback budget spent: restored step {decision.restore_step}, raising",
        "log": "update applied (logged only)",
    }[decision.action]
    reason = f" ({decision.reason})" if decision.reason else ""
    logger.warning(f"StabilityGuardCallback step {decision.step}: {what}; {done}{reason}.")


class _GuardProbe:
    """Every ``probe_every`` steps, the mean next-token loss of the probe set through the local-level filter."""

    def _probe_inputs(self, processing_class) -> dict:
        probe = _PROBE_SETS[("guard", self.name)]
        if isinstance(probe, dict):
            batch = {k: probe[k] for k in ("input_ids", "attention_mask", "labels") if k in probe}
        elif probe and all(isinstance(r, dict) and {"prompt", "completion"} <= set(r) for r in probe):
            batch = _prompt_completion_batch(probe, processing_class)
        else:
            if processing_class is None:
                raise ValueError(
                    "StabilityGuardCallback: a probe given as strings needs the trainer's "
                    "`processing_class`; pass token tensors instead."
                )
            batch = dict(processing_class(list(probe), return_tensors="pt", padding=True))
        batch.setdefault("attention_mask", torch.ones_like(batch["input_ids"]))
        if "labels" not in batch:
            batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        return {k: batch[k] for k in ("input_ids", "attention_mask", "labels")}

    def _probe_loss(self, model) -> float:
        """Mean next-token loss over the probe's supervised tokens (every rank runs the same forward)."""
        was_training = model.training
        model.eval()
        device = next(model.parameters()).device
        total = torch.zeros((), dtype=torch.float64, device=device)
        count = torch.zeros((), dtype=torch.float64, device=device)
        try:
            with torch.no_grad():
                n = self._probe_batch["input_ids"].shape[0]
                size = self.config.probe_batch_size
                for start in range(0, n, size):
                    part = {k: v[start : start + size].to(device) for k, v in self._probe_batch.items()}
                    logits = model(input_ids=part["input_ids"], attention_mask=part["attention_mask"]).logits
                    labels = part["labels"][:, 1:]
                    losses = torch.nn.functional.cross_entropy(
                        logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                        labels.reshape(-1),
                        ignore_index=-100,
                        reduction="sum",
                    )
                    total += losses.double()
                    count += (labels != -100).sum().double()
        finally:
            model.train(was_training)
        return float(total / count.clamp_min(1.0))

    def _probe(self, state, control, model, optimizer, lr_scheduler) -> None:
        loss = self._probe_loss(model)
        destabilising, nis = self.probe_filter.update(loss)
        self.probe_history.append((state.global_step, loss, nis))
        if not destabilising:
            return
        decision = self.policy.probe_anomaly(state.global_step, reason=f"probe loss {loss:.4g}, NIS {nis:.3g}")
        trainer = self._trainer(state)
        self._snapshot_ops(decision, model, optimizer, lr_scheduler, trainer)
        self.decisions.append(decision)
        report(decision, state)
        if decision.restore_step is not None:  # the update already happened: restore, nothing to drop
            self._restore(decision, model, optimizer, lr_scheduler, trainer)
        self._finish_exhausted(decision, control)



class _GuardDeepSpeed:
    """DeepSpeed: the engine's own collective checkpoints (untested here: no DeepSpeed in CI)."""

    def _ds_engine(self, trainer):
        if trainer is None or not hasattr(trainer.model_wrapped, "save_checkpoint"):
            raise RuntimeError(
                "StabilityGuardCallback: rollback under DeepSpeed needs the trainer; add the callback "
                "with `StabilityGuardCallback.attach(trainer)`."
            )
        return trainer.model_wrapped

    def _ds_ops(self, decision: Decision, trainer) -> None:
        """The snapshot operations with one engine checkpoint (tag ``step<s>``) per snapshot; the slots hold steps."""
        import shutil

        store, stale = self.store, []
        for op in decision.ops:
            if op == "discard" and store.candidate is not None:
                stale.append(store.candidate)
                store.candidate = None
            elif op == "drop_newest" and store.confirmed:
                stale.append(store.confirmed.pop())
            elif op == "confirm" and store.candidate is not None:
                store.confirmed.append(store.candidate)
                store.candidate = None
                while len(store.confirmed) > store.history:
                    stale.append(store.confirmed.pop(0))
            elif op == "candidate":  # collective: every rank writes its shards
                self._ds_engine(trainer).save_checkpoint(store.folder, tag=f"step{decision.step}", save_latest=False)
                store.candidate = decision.step
        if stale:
            torch.distributed.barrier() if _world_size() > 1 else None
            if store.writer:
                for step in stale:
                    shutil.rmtree(os.path.join(store.folder, f"step{step}"), ignore_errors=True)

    def _ds_load(self, trainer, step: int) -> None:
        engine = self._ds_engine(trainer)
        engine.load_checkpoint(
            self.store.folder,
            tag=f"step{step}",
            load_optimizer_states=True,
            load_lr_scheduler_states=self.config.scheduler_policy == "restore",
        )

