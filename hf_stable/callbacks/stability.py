"""Stability callbacks for any transformers/TRL trainer: spike guard, component-wise clipping, no-gradient detection,
degenerate-GRPO warnings, and a fault injector to check them on your own setup.

```python
from trl import SFTTrainer
from hf_stable.callbacks import StabilityGuardCallback
trainer = SFTTrainer(model=model, args=args, train_dataset=ds)
StabilityGuardCallback.attach(trainer)        # plain Trainer, SFTTrainer, GRPOTrainer, DPOTrainer, ...
trainer.train()
```

``attach`` installs the step signals (loss and pre-clip gradient norm of each optimizer step,
`hf_stable.stability.signals`) and the metrics hook, then adds the callback. hf_stable trainers carry the signals as a
mixin. The decision logic is `hf_stable.stability.guard.GuardPolicy`; this module is the plumbing: all-reduce, skip,
snapshot, restore, cooldown, logging, state.

Where each callback acts in the transformers loop (per optimizer step): micro-batches → global clip (``max_grad_norm``)
→ ``on_pre_optimizer_step`` (guard decides, skips or rolls back; component clipping) → ``optimizer.step()`` →
``on_optimizer_step`` (learning rates put back) → scheduler → ``on_step_end``.

Docs: ``docs/stability.md`` (algorithm, metrics, DeepSpeed/FSDP limits, measured results).
"""

from __future__ import annotations

import logging
import math
import os
import re
import weakref
from collections.abc import Sequence

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from .._validation import check_bool, check_choice, check_int, check_number
from ..stability import clip as clip_math
from ..stability.degenerate import DegenerateRunMonitor
from ..stability.guard import ACTIONS, ON_EXHAUSTED, Decision, GuardPolicy
from ..stability.nograd import NoGradientError, diagnose_no_gradient
from ..stability.signals import get_signals, install_metrics_hook, install_signals, signals_installed
from ..stability.snapshot import SnapshotStore, restore_snapshot, take_snapshot
from ..stability.stats import GRAD_RULE, LOSS_RULE, LocalLevelFilter, SpikeRule
from ..stability.update import drop_update, force_scaler_skip, optimizer_params, scale_lr


__all__ = [
    "ComponentClipCallback",
    "FaultInjectionCallback",
    "GRPODegenerateRunCallback",
    "NoGradientCallback",
    "NoGradientError",
    "StabilityGuardCallback",
    "TrainingDivergedError",
    "add_stability_callbacks",
]

logger = logging.getLogger(__name__)
# (kind, name) -> probe set: a callback transformers re-instantiates from its JSON args finds its probes here
_PROBE_SETS: dict[tuple[str, str], object] = {}


class TrainingDivergedError(RuntimeError):
    """Raised by `StabilityGuardCallback(on_exhausted="raise")` once ``max_rollbacks`` is spent (on every rank)."""


# -- shared plumbing ---------------------------------------------------------------------------------------------
def _prompt_completion_batch(rows, processing_class) -> dict:
    """Right-padded ``input_ids``/``attention_mask`` of prompt + completion, ``labels`` on the completion only (the
    tokens an SFT run on prompt/completion data is trained on)."""
    if processing_class is None:
        raise ValueError("a prompt/completion probe needs the trainer's `processing_class` to tokenize it.")
    seqs, starts = [], []
    for row in rows:
        prompt = processing_class(row["prompt"], add_special_tokens=False)["input_ids"]
        full = processing_class(row["prompt"] + row["completion"], add_special_tokens=False)["input_ids"]
        seqs.append(full)
        starts.append(len(prompt))
    width = max(len(s) for s in seqs)
    pad = processing_class.pad_token_id if processing_class.pad_token_id is not None else 0
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    for i, (seq, start) in enumerate(zip(seqs, starts, strict=True)):
        ids[i, : len(seq)] = torch.tensor(seq)
        mask[i, : len(seq)] = 1
        labels[i, start : len(seq)] = torch.tensor(seq[start:])
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _world_size() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _backend(args, model=None, optimizer=None) -> str:
    """ "deepspeed", "fsdp" or "plain" (one process or DDP)."""
    if getattr(args, "deepspeed_plugin", None) is not None or os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true":
        return "deepspeed"
    if type(optimizer).__name__ == "DeepSpeedOptimizerWrapper":
        return "deepspeed"
    if getattr(args, "fsdp", None) or os.environ.get("ACCELERATE_USE_FSDP") == "true":
        return "fsdp"
    if model is not None:
        from .. import distributed

        if distributed.is_fsdp2(model):
            return "fsdp"
    return "plain"


class _Attachable:
    """``Callback.attach(trainer, **kwargs)``: build the callback, install what it needs on ``trainer``, add it."""

    needs_signals = False

    @classmethod
    def attach(cls, trainer, **kwargs):
        callback = cls(**kwargs)
        if cls.needs_signals:
            install_signals(trainer)
        install_metrics_hook(trainer)
        callback._trainer_ref = weakref.ref(trainer)
        trainer.add_callback(callback)
        return callback


class _SelfRestoring(ExportableState):
    """JSON state that survives a resume without ``restore_callback_states_from_checkpoint=True``.

    ``state()`` stores the constructor arguments and one attribute, ``restored_payload``. If transformers restores
    callback state it builds a new instance and sets that attribute, which queues the payload; otherwise the callback
    reads its own entry from ``TrainerState.stateful_callbacks`` (loaded from the checkpoint's ``trainer_state.json``)
    in ``on_train_begin`` of a resumed run. Instances of one class are matched by their ``name`` argument.
    """

    name: str
    _pending_payload: dict | None = None
    _restored: bool = False

    def _init_args(self) -> dict:
        raise NotImplementedError

    def _export(self) -> dict:
        raise NotImplementedError

    def _import(self, payload: dict) -> None:
        raise NotImplementedError

    def state(self) -> dict:
        return {"args": self._init_args(), "attributes": {"restored_payload": self._export()}}

    @property
    def restored_payload(self):
        return self._pending_payload

    @restored_payload.setter
    def restored_payload(self, payload):
        self._pending_payload = payload

    def _self_restore(self, state) -> bool:
        """Apply a queued or stored payload once; returns True when something was restored."""
        if self._restored:
            return False
        payload = self._pending_payload
        if payload is None and state.global_step > 0:
            entries = (state.stateful_callbacks or {}).get(type(self).__name__)
            entries = entries if isinstance(entries, list) else [entries] if entries else []
            mine = [e for e in entries if isinstance(e, dict) and e.get("args", {}).get("name") == self.name]
            if mine:  # the last one is the newest (transformers appends when a class has several instances)
                payload = mine[-1].get("attributes", {}).get("restored_payload")
        self._pending_payload = None
        if payload is None:
            return False
        self._import(payload)
        self._restored = True
        return True


def _warn_once(obj, key: str, message: str, state=None) -> None:
    warned = obj.__dict__.setdefault("_warned", set())
    if key in warned:
        return
    warned.add(key)
    if state is None or state.is_world_process_zero:
        logger.warning(message)


def _finite_metrics(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if v is not None and math.isfinite(v)}


# -- the spike guard ---------------------------------------------------------------------------------------------
class StabilityGuardCallback(_Attachable, _SelfRestoring, TrainerCallback):
    """Detect loss and gradient-norm spikes, then skip the poisoned update or roll back to a confirmed snapshot.

    Detection (per optimizer step, on all-reduced values): the step is anomalous if its loss or pre-clip global grad
    norm is non-finite, or spikes by the robust median/MAD rule (``loss_z``/``loss_ratio`` on the loss,
    ``grad_z``/``grad_ratio`` on the log grad norm; ``None`` disables a signal) over the last ``window`` accepted
    steps, once ``min_history`` are accepted. Action (`hf_stable.stability.guard`): ``"skip_then_rollback"`` (skip up
    to ``skips_before_rollback`` consecutive anomalies, then roll back), ``"skip"``, ``"rollback"`` or ``"log"``.

    A skip sets ``p.grad = None`` on every parameter (never zeroing: zeroed grads still move AdamW through its momentum
    and weight decay); under fp16 the GradScaler is made to skip the step and its scale is put back. The scheduler
    still steps, so the schedule stays aligned with ``global_step``. A rollback restores the newest confirmed snapshot
    (weights in scope, optimizer state, and with ``scheduler_policy="restore"`` the scheduler), drops the current
    update and scales the LR by ``f + (1 − f)·k/K`` for the next ``K = lr_cooldown_steps`` updates.

    Snapshots: a candidate every ``snapshot_every`` healthy steps, taken before the update, confirmed after
    ``confirm_steps`` more healthy steps, discarded on an anomaly. Memory: ``(snapshot_history + 1) ×`` (weights in
    ``snapshot_scope`` + optimizer state), i.e. 24 bytes per fp32 AdamW parameter with the defaults; ``"disk"`` storage
    writes them under ``output_dir/stable_guard/<name>/`` instead.

    After ``max_rollbacks`` rollbacks the next one restores the snapshot and ``on_exhausted`` decides: ``"stop"``
    (save the restored, good weights and stop), ``"raise"`` (`TrainingDivergedError`) or ``"continue"`` (only log).

    ``guard_clip_norm``: with ``TrainingArguments(max_grad_norm=0)``, the guard sees the true pre-clip norm even
    without the step signals and clips globally itself after deciding.

    Distributed: one all-reduce of ``[loss, n_micro, non-finite flag, grad norm, state fingerprint, fingerprint²]`` per
    step and one host sync; every decision is a function of reduced values and of a state that only absorbs reduced
    values, so all ranks take the same branch; the fingerprint's variance across ranks must be 0, else every rank
    raises. DeepSpeed: the engine steps inside ``backward``, so decisions move to ``on_step_end``, ``skip`` degrades to
    ``log`` and ``skip_then_rollback`` to ``rollback`` (warned once); rollbacks use the engine's own checkpoints and
    need ``snapshot_storage="disk"``. FSDP: skip and log work; rollback is refused.

    Held-out probe (optional; reconstructed from an abstract, our design): every ``probe_every`` steps, in
    ``on_step_end``, the mean next-token loss of ``probe_dataset`` (strings, tokenized with the trainer's
    ``processing_class``, or ``input_ids``/``attention_mask``/``labels`` tensors) goes through a scalar local-level
    Kalman filter (`hf_stable.stability.stats.LocalLevelFilter`); a rise whose normalised innovation squared exceeds
    ``probe_nis_threshold`` (10.83, the χ²(1) 0.999 quantile) is destabilising and the guard rolls back (the update has
    already happened, so there is nothing to skip).

    Metrics (``stable/guard/``): ``anomalies``, ``skips``, ``rollbacks``, ``last_rollback_step``, ``snapshot_step``,
    ``loss_z``, ``grad_z``, ``lr_multiplier``, and with a probe ``probe_loss``, ``probe_nis``.
    """

    needs_signals = True

    def __init__(
        self,
        loss_z: float | None = 6.0,
        loss_ratio: float = 1.25,
        grad_z: float | None = 6.0,
        grad_ratio: float = 5.0,
        window: int = 128,
        min_history: int = 20,
        action: str = "skip_then_rollback",
        skips_before_rollback: int = 1,
        snapshot_every: int = 50,
        confirm_steps: int = 2,
        snapshot_history: int = 1,
        snapshot_storage: str = "cpu",
        snapshot_scope: str = "trainable",
        scheduler_policy: str = "keep",
        lr_cooldown_factor: float = 0.25,
        lr_cooldown_steps: int = 50,
        max_rollbacks: int = 5,
        on_exhausted: str = "stop",
        guard_clip_norm: float | None = None,
        probe_dataset=None,
        probe_every: int = 0,
        probe_nis_threshold: float = 10.83,
        probe_batch_size: int = 16,
        name: str = "guard",
    ):
        check_number("loss_z", loss_z, low=0, low_open=True, allow_none=True)
        check_number("grad_z", grad_z, low=0, low_open=True, allow_none=True)
        check_number("loss_ratio", loss_ratio, low=1)
        check_number("grad_ratio", grad_ratio, low=1)
        check_int("window", window, low=2)
        check_int("min_history", min_history, low=2, high=window)
        check_choice("action", action, ACTIONS)
        check_int("skips_before_rollback", skips_before_rollback, low=0)
        check_int("snapshot_every", snapshot_every, low=1)
        check_int("confirm_steps", confirm_steps, low=0)
        check_int("snapshot_history", snapshot_history, low=1)
        check_choice("snapshot_storage", snapshot_storage, ("cpu", "disk"))
        check_choice("snapshot_scope", snapshot_scope, ("trainable", "all"))
        check_choice("scheduler_policy", scheduler_policy, ("keep", "restore"))
        check_number("lr_cooldown_factor", lr_cooldown_factor, low=0, high=1, low_open=True)
        check_int("lr_cooldown_steps", lr_cooldown_steps, low=0)
        check_int("max_rollbacks", max_rollbacks, low=0)
        check_choice("on_exhausted", on_exhausted, ON_EXHAUSTED)
        check_number("guard_clip_norm", guard_clip_norm, low=0, low_open=True, allow_none=True)
        if loss_z is None and grad_z is None:
            raise ValueError(
                "`loss_z` and `grad_z` are both None: the guard would detect only non-finite steps. "
                "Set at least one of them (defaults 6.0)."
            )
        if not isinstance(name, str) or not name:
            raise ValueError(f"`name` must be a non-empty string, got {name!r}.")
        check_int("probe_every", probe_every, low=0)
        check_number("probe_nis_threshold", probe_nis_threshold, low=0, low_open=True)
        check_int("probe_batch_size", probe_batch_size, low=1)
        has_probe = probe_dataset is not None or ("guard", name) in _PROBE_SETS
        if probe_every > 0 and not has_probe:
            raise ValueError("`probe_every` > 0 needs `probe_dataset` (held-out sequences for the probe loss).")
        if probe_dataset is not None and probe_every == 0:
            raise ValueError("`probe_dataset` is set but `probe_every`=0: the probe would never run.")
        if probe_dataset is not None:
            _PROBE_SETS[("guard", name)] = probe_dataset
        self._args = dict(
            loss_z=loss_z,
            loss_ratio=loss_ratio,
            grad_z=grad_z,
            grad_ratio=grad_ratio,
            window=window,
            min_history=min_history,
            action=action,
            skips_before_rollback=skips_before_rollback,
            snapshot_every=snapshot_every,
            confirm_steps=confirm_steps,
            snapshot_history=snapshot_history,
            snapshot_storage=snapshot_storage,
            snapshot_scope=snapshot_scope,
            scheduler_policy=scheduler_policy,
            lr_cooldown_factor=lr_cooldown_factor,
            lr_cooldown_steps=lr_cooldown_steps,
            max_rollbacks=max_rollbacks,
            on_exhausted=on_exhausted,
            guard_clip_norm=guard_clip_norm,
            probe_every=probe_every,
            probe_nis_threshold=probe_nis_threshold,
            probe_batch_size=probe_batch_size,
            name=name,
        )
        self.probe_every, self.probe_batch_size = probe_every, probe_batch_size
        self.probe_filter = LocalLevelFilter(threshold=probe_nis_threshold)
        self.probe_history: list[tuple[int, float, float]] = []  # (step, probe loss, NIS)
        self._probe_batch: dict | None = None
        self.name = name
        self.snapshot_storage, self.snapshot_scope = snapshot_storage, snapshot_scope
        self.scheduler_policy, self.guard_clip_norm = scheduler_policy, guard_clip_norm
        loss_rule = (
            None if loss_z is None else SpikeRule(loss_z, loss_ratio, False, LOSS_RULE.floor_rel, LOSS_RULE.floor_abs)
        )
        grad_rule = (
            None if grad_z is None else SpikeRule(grad_z, grad_ratio, True, GRAD_RULE.floor_rel, GRAD_RULE.floor_abs)
        )
        self.policy = GuardPolicy(
            loss_rule=loss_rule,
            grad_rule=grad_rule,
            window=window,
            min_history=min_history,
            action=action,
            skips_before_rollback=skips_before_rollback,
            snapshot_every=snapshot_every,
            confirm_steps=confirm_steps,
            snapshot_history=snapshot_history,
            lr_cooldown_factor=lr_cooldown_factor,
            lr_cooldown_steps=lr_cooldown_steps,
            max_rollbacks=max_rollbacks,
            on_exhausted=on_exhausted,
        )
        self.store: SnapshotStore | None = None
        self.last_decision: Decision | None = None
        self.decisions: list[Decision] = []  # anomalous decisions of this process, newest last
        self._backend = "plain"
        self._lr_multiplier: float | None = None
        self._scale_before: float | None = None
        self._exhausted_stop = False
        self._trainer_ref = None

    # -- state ------------------------------------------------------------------------------------------------
    def _init_args(self) -> dict:
        return dict(self._args)

    def _export(self) -> dict:
        return {**self.policy.state(), "probe": self.probe_filter.state()}

    def _import(self, payload: dict) -> None:
        self.probe_filter.load_state(payload.get("probe", {}))
        available = []
        if self.store is not None and self.store.storage == "disk":
            available = [s for s in self.store.confirmed_steps if s in payload.get("confirmed_steps", [])]
        self.policy.load_state(payload, confirmed_available=available)

    # -- metrics ----------------------------------------------------------------------------------------------
    def pop_pending_metrics(self) -> dict:
        p = self.policy
        if p.accepted + p.anomalies == 0:
            return {}
        return _finite_metrics(
            {
                "stable/guard/anomalies": float(p.anomalies),
                "stable/guard/skips": float(p.skips),
                "stable/guard/rollbacks": float(p.rollbacks),
                "stable/guard/last_rollback_step": float(-1 if p.last_rollback_step is None else p.last_rollback_step),
                "stable/guard/snapshot_step": float(p.confirmed_steps[-1] if p.confirmed_steps else -1),
                "stable/guard/loss_z": p.loss_z,
                "stable/guard/grad_z": p.grad_z,
                "stable/guard/lr_multiplier": p.lr_multiplier,
                "stable/guard/probe_loss": self.probe_history[-1][1] if self.probe_history else None,
                "stable/guard/probe_nis": self.probe_history[-1][2] if self.probe_history else None,
            }
        )

    # -- events -----------------------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self._backend = _backend(args, model, optimizer)
        if self._backend == "deepspeed":
            before = self.policy.action
            self.policy.degrade_for_post_step()
            _warn_once(
                self,
                "deepspeed",
                (
                    "StabilityGuardCallback under DeepSpeed: the engine applies the update inside backward, before "
                    f"any callback runs, so no update can be skipped; action {before!r} acts as "
                    f"{self.policy.action!r} (decisions are taken in on_step_end, after the update)."
                ),
                state,
            )
            if self.policy.uses_snapshots and self.snapshot_storage != "disk":
                raise ValueError(
                    "StabilityGuardCallback: rollbacks under DeepSpeed use the engine's collective "
                    "checkpoints, which need `snapshot_storage='disk'`."
                )
        if self._backend == "fsdp" and self.policy.uses_snapshots:
            raise ValueError(
                f"StabilityGuardCallback: action={self.policy.action!r} needs snapshots, which are not implemented "
                "for FSDP (sharded parameters and optimizer state). Use action='skip' or 'log' under FSDP."
            )
        if self.guard_clip_norm is not None and args.max_grad_norm and args.max_grad_norm > 0:
            raise ValueError(
                f"`guard_clip_norm`={self.guard_clip_norm} needs `max_grad_norm=0` in the TrainingArguments (got "
                f"{args.max_grad_norm}): the trainer's own clip would run first and hide the pre-clip norm."
            )
        folder = os.path.join(args.output_dir, "stable_guard", self.name)
        writer = state.is_world_process_zero if self.snapshot_storage == "disk" else True
        self.store = SnapshotStore(
            self.snapshot_storage, folder=folder, history=self.policy.snapshot_history, writer=writer
        )
        if state.global_step > 0 and self.snapshot_storage == "disk":
            self.store.adopt_disk_snapshots(state.global_step)
        self._self_restore(state)
        trainer = self._trainer()
        if trainer is not None and not signals_installed(trainer):
            install_signals(trainer)
        if self.probe_every:
            self._probe_batch = self._probe_inputs(kwargs.get("processing_class"))

    def _trainer(self, state=None):
        trainer = None if self._trainer_ref is None else self._trainer_ref()
        if trainer is None and state is not None:
            signals = get_signals(state)
            trainer = None if signals is None else signals.trainer
        return trainer

    def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
        if self._backend == "deepspeed" and optimizer is not None and self.policy.cooldown_left > 0:
            # the engine steps inside backward: the multiplier must be in place before the micro-batches
            self._apply_lr(optimizer, self.policy.peek_cooldown())

    def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        if self._backend == "deepspeed":
            return
        decision = self._decide(state, model, optimizer, signals_step=state.global_step)
        self._execute(decision, args, state, control, model, optimizer, lr_scheduler)

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        if self._lr_multiplier is not None and optimizer is not None:
            scale_lr(optimizer, 1.0 / self._lr_multiplier)
            self._lr_multiplier = None
        if self._scale_before is not None and optimizer is not None:
            optimizer.scaler.update(new_scale=self._scale_before)
            # our skip, not an overflow: keep the scheduler stepping, as in bf16/fp32 (accelerate private flag)
            optimizer._is_overflow = False
            self._scale_before = None

    def on_step_end(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        if self._backend == "deepspeed":
            if self._lr_multiplier is not None:
                self.on_optimizer_step(args, state, control, optimizer=optimizer)
            decision = self._decide(state, model, optimizer, signals_step=state.global_step - 1)
            self._execute(decision, args, state, control, model, optimizer, lr_scheduler)
        if self.probe_every and state.global_step % self.probe_every == 0 and not self._exhausted_stop:
            self._probe(state, control, model, optimizer, lr_scheduler)
        if self._exhausted_stop:
            control.should_training_stop = True
            control.should_save = True

    # -- held-out probe (reconstructed innovation detector; our design) ----------------------------------------
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
                for start in range(0, n, self.probe_batch_size):
                    part = {
                        k: v[start : start + self.probe_batch_size].to(device) for k, v in self._probe_batch.items()
                    }
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
        self._report(decision, state)
        if decision.restore_step is not None:  # the update already happened: restore, nothing to drop
            self._restore(decision, model, optimizer, lr_scheduler, trainer)
        self._finish_exhausted(decision, control)

    # -- decision ---------------------------------------------------------------------------------------------
    def _decide(self, state, model, optimizer, signals_step: int) -> Decision:
        signals = get_signals(state)
        fresh = signals is not None and signals.step == signals_step
        loss = signals.loss_sum if fresh and signals.n_micro else None
        grad = signals.grad_norm if fresh else None
        if loss is None:
            _warn_once(
                self,
                "no_loss",
                (
                    "StabilityGuardCallback: no step loss was recorded (the step signals are not installed), so "
                    "loss-spike detection is off. Use `StabilityGuardCallback.attach(trainer)` instead of "
                    "`callbacks=[...]`."
                ),
                state,
            )
        if grad is None:
            _warn_once(
                self,
                "no_grad_norm",
                (
                    "StabilityGuardCallback: no pre-clip gradient norm was recorded; computing it from the gradients, "
                    "which are already clipped when max_grad_norm > 0. Use `attach(trainer)`, or set max_grad_norm=0 "
                    "and guard_clip_norm=1.0."
                ),
                state,
            )
            grads = [p.grad for p in optimizer_params(optimizer) if p.grad is not None] if optimizer else []
            grad = torch.nn.utils.get_total_norm(grads) if grads else None
        device = next((t.device for t in (loss, grad) if isinstance(t, torch.Tensor)), torch.device("cpu"))
        dtype = torch.float32 if device.type == "mps" else torch.float64
        fp = self.policy.fingerprint()

        def as_tensor(x):
            return torch.as_tensor(0.0 if x is None else x, dtype=dtype, device=device).detach().reshape(())

        loss_t, grad_t = as_tensor(loss), as_tensor(grad)
        nonfinite = (~torch.isfinite(loss_t) | ~torch.isfinite(grad_t)).to(dtype)
        packed = torch.stack(
            [loss_t, as_tensor(signals.n_micro if fresh else 0), nonfinite, grad_t, as_tensor(fp), as_tensor(fp * fp)]
        )
        world = _world_size()
        if world > 1:
            torch.distributed.all_reduce(packed)
        loss_sum, _, flags, grad_sum, fp_sum, fp_sq = packed.tolist()  # the one host sync of the step
        mean_fp = fp_sum / world
        if fp_sq / world - mean_fp * mean_fp > 1e-9 * max(1.0, mean_fp * mean_fp):
            raise RuntimeError(
                "StabilityGuardCallback: the guard state differs across ranks (its fingerprint does "
                "not agree); stopping every rank rather than letting them take different branches."
            )
        step = signals_step + 1
        decision = self.policy.decide(
            step,
            None if loss is None else loss_sum / world,
            None if grad is None else grad_sum / world,
            nonfinite=flags > 0,
        )
        self.last_decision = decision
        return decision

    # -- execution --------------------------------------------------------------------------------------------
    def _scope(self, model):
        if self.snapshot_scope == "all":
            return [*model.named_parameters(), *(("buffer:" + n, b) for n, b in model.named_buffers())]
        return [(n, p) for n, p in model.named_parameters() if p.requires_grad]

    def _apply_lr(self, optimizer, multiplier: float) -> None:
        if multiplier != 1.0:
            scale_lr(optimizer, multiplier)
            self._lr_multiplier = multiplier

    def _drop(self, optimizer) -> None:
        scaler = getattr(optimizer, "scaler", None)
        if scaler is not None and scaler.is_enabled():
            self._scale_before = force_scaler_skip(scaler, optimizer)
        else:
            drop_update(optimizer)

    def _snapshot_ops(self, decision: Decision, model, optimizer, lr_scheduler, trainer) -> None:
        if self._backend == "deepspeed":
            self._ds_ops(decision, trainer)
            return
        for op in decision.ops:
            if op == "discard":
                self.store.discard_candidate()
            elif op == "drop_newest":
                self.store.drop_newest_confirmed()
            elif op == "confirm":
                self.store.confirm_candidate()
            elif op == "candidate":
                self.store.put_candidate(
                    take_snapshot(
                        decision.step,
                        self._scope(model),
                        optimizer,
                        lr_scheduler,
                        scaler=getattr(optimizer, "scaler", None),
                    )
                )
        if decision.ops and self.snapshot_storage == "disk" and _world_size() > 1:
            torch.distributed.barrier()  # the writer has finished before anyone reads

    def _execute(self, decision: Decision, args, state, control, model, optimizer, lr_scheduler) -> None:
        trainer = self._trainer(state)
        self._snapshot_ops(decision, model, optimizer, lr_scheduler, trainer)
        if decision.anomalous:
            self.decisions.append(decision)
            self._report(decision, state)
        if decision.action in ("accept", "log"):
            if self.guard_clip_norm is not None and optimizer is not None:
                grads = [p.grad for p in optimizer_params(optimizer) if p.grad is not None]
                total = torch.nn.utils.get_total_norm(grads)
                torch.nn.utils.clip_grads_with_norm_(optimizer_params(optimizer), self.guard_clip_norm, total)
            if self._backend != "deepspeed":
                self._apply_lr(optimizer, decision.lr_multiplier)
            return
        if decision.restore_step is not None:
            self._restore(decision, model, optimizer, lr_scheduler, trainer)
        if self._backend != "deepspeed":
            self._drop(optimizer)
        self._finish_exhausted(decision, control)

    def _finish_exhausted(self, decision: Decision, control) -> None:
        if decision.action == "stop":
            self._exhausted_stop = True
            control.should_training_stop = True
            control.should_save = True
        elif decision.action == "raise":
            raise TrainingDivergedError(
                f"StabilityGuardCallback: {self.policy.rollbacks - 1} rollbacks did not stop the anomalies "
                f"(max_rollbacks={self.policy.max_rollbacks}); the weights of step {decision.restore_step} were "
                "restored."
            )

    def _restore(self, decision: Decision, model, optimizer, lr_scheduler, trainer) -> None:
        if self._backend == "deepspeed":
            self._ds_load(trainer, decision.restore_step)
            return
        snapshot = self.store.newest_confirmed()
        if snapshot is None or snapshot.step != decision.restore_step:
            raise RuntimeError(f"StabilityGuardCallback: snapshot of step {decision.restore_step} is missing.")
        restore_snapshot(
            snapshot,
            self._scope(model),
            optimizer,
            lr_scheduler,
            getattr(optimizer, "scaler", None),
            restore_scheduler=self.scheduler_policy == "restore",
            restore_hyperparameters=self.scheduler_policy == "restore",
        )

    def _report(self, decision: Decision, state) -> None:
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

    # -- DeepSpeed: the engine's own collective checkpoints (untested here: no DeepSpeed in CI) -----------------
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
            load_lr_scheduler_states=self.scheduler_policy == "restore",
        )


# -- component-wise clipping -------------------------------------------------------------------------------------
class ComponentClipCallback(_Attachable, _SelfRestoring, TrainerCallback):
    """Clip each group of gradients to its own norm bound (arXiv 2210.10325), or adaptively against the EMA of its own
    past norms (AdaGC, arXiv 2502.11034), in ``on_pre_optimizer_step``.

    Args:
        max_norm: the bound ``c`` of ``mode="fixed"`` (no paper-wide default; the authors swept 0.01–5).
        groups: ``"param"`` (each tensor; the authors' choice), ``"module"``, ``"layer"`` or a list of regexes.
        overrides: ``{regex: max_norm}`` matched against group names (first match wins), fixed mode.
        then_global_max_norm: clip globally *after* the component clip (the authors' order); needs the trainer's
            ``max_grad_norm=0``, otherwise its global clip runs first.
        mode: ``"fixed"`` or ``"adaptive"`` (AdaGC: ``h = min(1, λ_rel·γ/‖g‖)``, ``γ ← β·γ + (1 − β)·h‖g‖``, and a
            global clip at ``adaptive_lambda_abs`` during the first ``adaptive_warmup_steps``; the trainer's global
            clip should then be off, ``max_grad_norm=0``).

    Metrics: ``stable/clip/frac_groups_clipped``, ``stable/clip/max_group_norm``, ``stable/clip/median_group_norm``
    (last step before the log, pre-clip). DeepSpeed is refused (gradients are partitioned inside the engine; use its
    ``gradient_clipping``), and so is FSDP (sharded gradients).
    """

    def __init__(
        self,
        max_norm: float = 0.1,
        groups: str | Sequence[str] = "param",
        overrides: dict | None = None,
        then_global_max_norm: float | None = None,
        mode: str = "fixed",
        adaptive_warmup_steps: int = 100,
        adaptive_lambda_abs: float = 1.0,
        adaptive_lambda_rel: float = 1.05,
        adaptive_beta: float = 0.98,
        name: str = "clip",
    ):
        check_number("max_norm", max_norm, low=0, low_open=True)
        if isinstance(groups, str):
            check_choice("groups", groups, ("param", "module", "layer"))
        else:
            groups = list(groups)
            if not groups or not all(isinstance(g, str) for g in groups):
                raise ValueError(
                    f"`groups` must be 'param', 'module', 'layer' or a non-empty list of regexes, got {groups!r}."
                )
            for pattern in groups:
                re.compile(pattern)
        for pattern, value in (overrides or {}).items():
            re.compile(pattern)
            check_number(f"overrides[{pattern!r}]", value, low=0, low_open=True)
        check_number("then_global_max_norm", then_global_max_norm, low=0, low_open=True, allow_none=True)
        check_choice("mode", mode, ("fixed", "adaptive"))
        check_int("adaptive_warmup_steps", adaptive_warmup_steps, low=0)
        check_number("adaptive_lambda_abs", adaptive_lambda_abs, low=0, low_open=True)
        check_number("adaptive_lambda_rel", adaptive_lambda_rel, low=0, low_open=True)
        check_number("adaptive_beta", adaptive_beta, low=0, high=1, high_open=True)
        if mode == "adaptive" and overrides:
            raise ValueError("`overrides` sets fixed bounds and has no effect with mode='adaptive'.")
        self._args = dict(
            max_norm=max_norm,
            groups=groups,
            overrides=overrides,
            then_global_max_norm=then_global_max_norm,
            mode=mode,
            adaptive_warmup_steps=adaptive_warmup_steps,
            adaptive_lambda_abs=adaptive_lambda_abs,
            adaptive_lambda_rel=adaptive_lambda_rel,
            adaptive_beta=adaptive_beta,
            name=name,
        )
        self.name = name
        self.max_norm, self.groups, self.overrides = max_norm, groups, dict(overrides or {})
        self.then_global_max_norm, self.mode = then_global_max_norm, mode
        self._grouped: dict[str, list] | None = None
        self._bounds: torch.Tensor | None = None
        self._gamma: torch.Tensor | None = None
        self._gamma_payload: list | None = None
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None
        self.steps = 0
        self._trainer_ref = None

    def _init_args(self) -> dict:
        return dict(self._args)

    def _export(self) -> dict:
        gamma = None if self._gamma is None else [None if math.isinf(g) else g for g in self._gamma.tolist()]
        return {"steps": self.steps, "gamma": gamma}

    def _import(self, payload: dict) -> None:
        self.steps = int(payload.get("steps", 0))
        self._gamma_payload = payload.get("gamma")

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        backend = _backend(args, model, optimizer)
        if backend != "plain":
            raise ValueError(
                f"ComponentClipCallback does not support {backend}: the gradients are "
                + (
                    "partitioned inside the DeepSpeed engine, which has already stepped when callbacks run; use "
                    "DeepSpeed's `gradient_clipping`."
                    if backend == "deepspeed"
                    else "sharded; use `max_grad_norm`."
                )
            )
        if self.then_global_max_norm is not None and args.max_grad_norm and args.max_grad_norm > 0:
            raise ValueError(
                f"`then_global_max_norm`={self.then_global_max_norm} reproduces the authors' order (component clip, "
                f"then global) and needs `max_grad_norm=0` in the TrainingArguments (got {args.max_grad_norm}); "
                "otherwise the trainer clips globally first and again afterwards."
            )
        if self.mode == "adaptive" and args.max_grad_norm and args.max_grad_norm > 0:
            _warn_once(
                self,
                "adaptive_global",
                (
                    f"ComponentClipCallback(mode='adaptive') with max_grad_norm={args.max_grad_norm}: the trainer's "
                    "global clip runs before AdaGC (the paper replaces it). Set max_grad_norm=0 to follow the paper."
                ),
                state,
            )
        self._self_restore(state)

    def _setup(self, model) -> None:
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self._grouped = clip_math.group_parameters(named, self.groups)
        bounds = []
        for group_name in self._grouped:
            bound = next((v for pat, v in self.overrides.items() if re.search(pat, group_name)), self.max_norm)
            bounds.append(bound)
        self._bounds = torch.tensor(bounds, dtype=torch.float32)
        self._gamma = torch.full((len(self._grouped),), math.inf)
        if self._gamma_payload is not None and len(self._gamma_payload) == len(self._grouped):
            self._gamma = torch.tensor([math.inf if g is None else g for g in self._gamma_payload])
        self._gamma_payload = None

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if self._grouped is None:
            self._setup(model)
        grouped = [[p.grad for _, p in members if p.grad is not None] for members in self._grouped.values()]
        if not any(grouped):  # the guard dropped this update
            return
        self.steps += 1
        norms = clip_math.group_norms(grouped)
        if self.mode == "fixed":
            coefs = clip_math.clip_coefficients(norms, self._bounds.to(norms.device))
        else:
            gamma = self._gamma.to(norms.device)
            coefs, gamma = clip_math.adagc_coefficients(
                norms,
                gamma,
                self.steps,
                warmup_steps=self._args["adaptive_warmup_steps"],
                lambda_abs=self._args["adaptive_lambda_abs"],
                lambda_rel=self._args["adaptive_lambda_rel"],
                beta=self._args["adaptive_beta"],
            )
            self._gamma = gamma.cpu()
        clip_math.apply_coefficients(grouped, coefs)
        if self.then_global_max_norm is not None:
            torch.nn.utils.clip_grad_norm_(
                [p for members in self._grouped.values() for _, p in members], self.then_global_max_norm
            )
        self._last = (norms.detach(), coefs.detach())

    def pop_pending_metrics(self) -> dict:
        if self._last is None:
            return {}
        norms, coefs = self._last
        self._last = None
        return {
            "stable/clip/frac_groups_clipped": float((coefs < 1.0).float().mean()),
            "stable/clip/max_group_norm": float(norms.max()),
            "stable/clip/median_group_norm": float(norms.median()),
        }


# -- no-gradient detection ---------------------------------------------------------------------------------------
class NoGradientCallback(_Attachable, TrainerCallback):
    """Raise `NoGradientError` when training cannot change the model.

    * ``on_train_begin``: no parameter has ``requires_grad`` (a frozen model) — before the first forward.
    * first ``on_pre_optimizer_step`` (after the first backward, before the first update): every parameter the
      optimizer holds still has ``grad is None``; the message names the cause (e.g. a deep-copied model whose
      ``forward`` TRL patched: the closure still calls the original model).

    Gradients that exist but are exactly zero are fine (equal rewards in every GRPO group give a zero gradient).
    Cost: one pass over the parameters at the first step. Under DeepSpeed the gradients are not in ``p.grad``: the
    gradient check is skipped (warned once); the frozen-model check still runs.
    """

    def __init__(self):
        self._checked = False
        self._deepspeed = False

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self._checked = False
        self._deepspeed = _backend(args, model, optimizer) == "deepspeed"
        if model is not None and not any(p.requires_grad for p in model.parameters()):
            raise NoGradientError(
                f"no trainable parameter: every parameter of {type(model).__name__} has requires_grad=False (a frozen "
                "model), so training would change nothing. Unfreeze the parameters to train, or pass a `peft_config`."
            )
        if self._deepspeed:
            _warn_once(
                self,
                "deepspeed",
                "NoGradientCallback: gradients live inside the DeepSpeed engine, not in "
                "`p.grad`; the no-gradient check after the first backward is skipped.",
                state,
            )

    def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kwargs):
        if self._checked or self._deepspeed or optimizer is None:
            return
        self._checked = True
        params = optimizer_params(optimizer)
        if params and all(p.grad is None for p in params):
            raise NoGradientError(
                f"after the first backward no trainable parameter of {type(model).__name__} has a gradient "
                f"({len(params)} tensors in the optimizer, all `.grad is None`): {diagnose_no_gradient(model)}"
            )


# -- degenerate GRPO runs ----------------------------------------------------------------------------------------
class GRPODegenerateRunCallback(_Attachable, _SelfRestoring, TrainerCallback):
    """Warn, from TRL's logged GRPO metrics, when a run cannot learn, saying what it means and which knob to turn.

    Conditions (each must hold for ``patience`` consecutive logs; then it is reported once per ``patience`` logs):
    ``completions/clipped_ratio ≥ clipped_ratio_min``, ``frac_reward_zero_std ≥ zero_std_min``, constant rewards
    (``reward_std`` and every ``rewards/<fn>/std`` are 0), ``entropy < entropy_min``, ``kl > kl_max``, ``loss == 0``
    with ``grad_norm == 0``; a non-finite ``grad_norm`` on first sight. ``loss == 0`` with ``grad_norm > 0`` under an
    on-policy ``grpo``/``dr_grpo`` run without KL is explained once at INFO (it is expected). Defaults follow
    Axolotl's training-stability guide (see ``docs/stability.md``). Warnings on the main process only; it only logs.
    """

    def __init__(
        self,
        patience: int = 3,
        zero_std_min: float = 0.99,
        clipped_ratio_min: float = 0.99,
        entropy_min: float = 0.01,
        kl_max: float = 2.0,
        name: str = "degenerate",
    ):
        check_int("patience", patience, low=1)
        check_number("zero_std_min", zero_std_min, low=0, high=1)
        check_number("clipped_ratio_min", clipped_ratio_min, low=0, high=1)
        check_number("entropy_min", entropy_min, low=0)
        check_number("kl_max", kl_max, low=0)
        self._args = dict(
            patience=patience,
            zero_std_min=zero_std_min,
            clipped_ratio_min=clipped_ratio_min,
            entropy_min=entropy_min,
            kl_max=kl_max,
            name=name,
        )
        self.name = name
        self.monitor = DegenerateRunMonitor(
            patience=patience,
            zero_std_min=zero_std_min,
            clipped_ratio_min=clipped_ratio_min,
            entropy_min=entropy_min,
            kl_max=kl_max,
        )
        self.findings: list = []
        self._trainer_ref = None

    def _init_args(self) -> dict:
        return dict(self._args)

    def _export(self) -> dict:
        return self.monitor.state()

    def _import(self, payload: dict) -> None:
        self.monitor.load_state(payload)

    def on_train_begin(self, args, state, control, **kwargs):
        self._self_restore(state)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or not state.is_world_process_zero:
            return
        cfg = {
            k: getattr(args, k, None)
            for k in (
                "loss_type",
                "num_iterations",
                "beta",
                "num_generations",
                "max_completion_length",
                "mask_truncated_completions",
                "steps_per_generation",
                "gradient_accumulation_steps",
                "loss_mode",
            )
        }
        for finding in self.monitor.observe(logs, cfg):
            self.findings.append((state.global_step, finding))
            emit = logger.info if finding.level == "info" else logger.warning
            emit(f"step {state.global_step}: {finding.message}")


# -- fault injection ---------------------------------------------------------------------------------------------
class FaultInjectionCallback(_Attachable, TrainerCallback):
    """Inject a fault at chosen optimizer steps, to check a guard on your own setup (and in our tests/experiments).

    Kinds: ``"corrupt_batch"`` (``input_ids`` and the supervised ``labels`` of every micro-batch of the step replaced
    by uniform random tokens), ``"nan_loss"`` (the loss multiplied by NaN), ``"loss_scale"`` (the loss multiplied by
    ``factor``), ``"lr_scale"`` (every param group's LR multiplied by ``factor`` for that update only). ``ranks``:
    process indices that inject (default all). Use ``FaultInjectionCallback.attach(trainer, ...)`` (it wraps the
    trainer's ``compute_loss``).
    """

    KINDS = ("corrupt_batch", "nan_loss", "loss_scale", "lr_scale")

    def __init__(
        self, kind: str, steps: Sequence[int], factor: float = 100.0, ranks: Sequence[int] | None = None, seed: int = 0
    ):
        check_choice("kind", kind, self.KINDS)
        check_number("factor", factor)
        self.kind, self.steps, self.factor = kind, {int(s) for s in steps}, float(factor)
        self.ranks = None if ranks is None else {int(r) for r in ranks}
        self.seed = int(seed)
        self.injected: list[int] = []
        self._scaled = False
        self._trainer_ref = None

    @classmethod
    def attach(cls, trainer, **kwargs):
        callback = super().attach(trainer, **kwargs)
        compute_loss = trainer.compute_loss

        def _compute_loss(model, inputs, *args, **kw):
            step = trainer.state.global_step + 1
            if not callback._active(step, trainer.args.process_index) or callback.kind == "lr_scale":
                return compute_loss(model, inputs, *args, **kw)
            if callback.kind == "corrupt_batch":
                inputs = callback._corrupt(inputs, step, trainer.model)  # `model` may be DDP-wrapped
            out = compute_loss(model, inputs, *args, **kw)
            scale = {"nan_loss": math.nan, "loss_scale": callback.factor}.get(callback.kind, 1.0)
            if step not in callback.injected:
                callback.injected.append(step)
            if isinstance(out, tuple):
                return (out[0] * scale, *out[1:])
            return out * scale

        trainer.compute_loss = _compute_loss
        return callback

    def _active(self, step: int, rank: int) -> bool:
        return step in self.steps and (self.ranks is None or rank in self.ranks)

    def _corrupt(self, inputs: dict, step: int, model) -> dict:
        ids = inputs["input_ids"]
        vocab = model.config.get_text_config().vocab_size
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        random_ids = torch.randint(0, vocab, ids.shape, generator=g).to(ids.device)
        inputs = dict(inputs)
        inputs["input_ids"] = random_ids
        if "labels" in inputs:
            inputs["labels"] = torch.where(inputs["labels"] == -100, inputs["labels"], random_ids)
        return inputs

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        step = state.global_step + 1
        if self.kind == "lr_scale" and self._active(step, args.process_index) and optimizer is not None:
            scale_lr(optimizer, self.factor)
            self._scaled = True
            self.injected.append(step)

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        if self._scaled:
            scale_lr(optimizer, 1.0 / self.factor)
            self._scaled = False


# -- one line per hf_stable trainer ------------------------------------------------------------------------------
def add_stability_callbacks(trainer, args, guard_defaults: dict | None = None) -> None:
    """Add the callbacks an hf_stable config asks for (phase-2 integration point; read with ``getattr`` so configs
    without the fields behave like TRL's):

    * ``stability_guard`` (bool, default False) + ``stability_guard_kwargs`` (dict) → `StabilityGuardCallback`,
      built from ``{**guard_defaults, **stability_guard_kwargs}``: a trainer's own defaults (e.g. ``{"loss_z": None}``
      for GRPO, whose loss sits around 0 and carries no spike information), which the user's kwargs override;
    * ``component_clip_max_norm`` (float or None) + ``component_clip_groups`` (default "param") →
      `ComponentClipCallback`;
    * ``no_gradient_check`` (bool, default True) → `NoGradientCallback`;
    * ``degenerate_run_warnings`` (bool, default True; GRPO configs only) → `GRPODegenerateRunCallback`, with the
      ``degenerate_*`` thresholds of the config.

    The fields are declared once in `hf_stable.stability.config` and validated there.
    """
    if getattr(args, "no_gradient_check", False):
        NoGradientCallback.attach(trainer)
    if getattr(args, "stability_guard", False):
        kwargs = getattr(args, "stability_guard_kwargs", None) or {}
        if not isinstance(kwargs, dict):
            raise TypeError(f"`stability_guard_kwargs` must be a dict, got {kwargs!r}.")
        StabilityGuardCallback.attach(trainer, **{**(guard_defaults or {}), **kwargs})
    elif getattr(args, "stability_guard_kwargs", None):
        raise ValueError("`stability_guard_kwargs` is set but `stability_guard` is False: they would be ignored.")
    max_norm = getattr(args, "component_clip_max_norm", None)
    if max_norm is not None:
        ComponentClipCallback.attach(
            trainer, max_norm=max_norm, groups=getattr(args, "component_clip_groups", "param")
        )
    if getattr(args, "degenerate_run_warnings", False):
        check_bool("degenerate_run_warnings", args.degenerate_run_warnings)
        degenerate_kwargs = getattr(args, "degenerate_kwargs", None)
        GRPODegenerateRunCallback.attach(trainer, **(degenerate_kwargs() if degenerate_kwargs else {}))
