"""`StabilityGuardCallback`: the spike guard's plumbing around `hf_stable.stability.guard.GuardPolicy`."""

from __future__ import annotations

import dataclasses
import os

import torch
from transformers import TrainerCallback

from ...stability.callback_configs import GuardConfig
from ...stability.guard import Decision, GuardPolicy
from ...stability.signals import get_signals, install_signals, signals_installed
from ...stability.snapshot import SnapshotStore, restore_snapshot, take_snapshot
from ...stability.stats import GRAD_RULE, LOSS_RULE, LocalLevelFilter
from ...stability.update import drop_update, force_scaler_skip, optimizer_params, scale_lr
from ._common import (
    _PROBE_SETS,
    TrainingDivergedError,
    _Attachable,
    _backend,
    _finite_metrics,
    _SelfRestoring,
    _warn_once,
    _world_size,
    resume_dir,
)
from .guard_extras import SNAPSHOT_DIR, _GuardCheckpoint, _GuardDeepSpeed, _GuardProbe, report, saved_index


class StabilityGuardCallback(
    _GuardProbe, _GuardDeepSpeed, _GuardCheckpoint, _Attachable, _SelfRestoring, TrainerCallback
):
    """Detect loss and gradient-norm spikes, then skip the poisoned update or roll back to a confirmed snapshot.

    Detection (per optimizer step, on all-reduced values): the step is anomalous if its loss or pre-clip global grad
    norm is non-finite, or spikes by the robust median/MAD rule (``loss_z``/``loss_ratio`` on the loss,
    ``grad_z``/``grad_ratio`` on the log grad norm; ``None`` disables a signal) over the last ``window`` accepted
    steps, once ``min_history`` are accepted. Action (`hf_stable.stability.guard`): ``"skip_then_rollback"`` (skip up
    to ``skips_before_rollback`` consecutive anomalies, then roll back), ``"skip"``, ``"rollback"`` or ``"log"``.
    A step whose gradient norm is exactly 0 (GRPO groups with equal rewards) is idle: never scored, never in a window.

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

    def __init__(self, config: GuardConfig | None = None, *, probe_dataset=None, **options):
        """``StabilityGuardCallback(GuardConfig(...))`` or ``StabilityGuardCallback(action="skip", ...)``: the options
        of `hf_stable.stability.callback_configs.GuardConfig` (given both ways, the keywords replace the config's);
        ``probe_dataset``: held-out sequences of the probe."""
        config = GuardConfig(**options) if config is None else dataclasses.replace(config, **options)
        has_probe = probe_dataset is not None or ("guard", config.name) in _PROBE_SETS
        if config.probe_every > 0 and not has_probe:
            raise ValueError("`probe_every` > 0 needs `probe_dataset` (held-out sequences for the probe loss).")
        if probe_dataset is not None and config.probe_every == 0:
            raise ValueError("`probe_dataset` is set but `probe_every`=0: the probe would never run.")
        if probe_dataset is not None:
            _PROBE_SETS[("guard", config.name)] = probe_dataset
        self.config = config
        self.name = config.name
        self.probe_filter = LocalLevelFilter(threshold=config.probe_nis_threshold)
        self.probe_history: list[tuple[int, float, float]] = []  # (step, probe loss, NIS)
        self._probe_batch: dict | None = None
        loss_rule = None if config.loss_z is None else dataclasses.replace(
            LOSS_RULE, z_threshold=config.loss_z, ratio=config.loss_ratio
        )
        grad_rule = None if config.grad_z is None else dataclasses.replace(
            GRAD_RULE, z_threshold=config.grad_z, ratio=config.grad_ratio
        )
        self.policy = GuardPolicy(loss_rule=loss_rule, grad_rule=grad_rule, **config.kwargs_for(GuardPolicy))
        self.store: SnapshotStore | None = None
        self.last_decision: Decision | None = None
        self.decisions: list[Decision] = []  # anomalous decisions of this process, newest last
        self._backend = "plain"
        self._lr_multiplier: float | None = None
        self._scale_before: float | None = None
        self._exhausted_stop = False
        self._resume_folder: str | None = None
        self._trainer_ref = None

    # -- state ------------------------------------------------------------------------------------------------
    def _init_args(self) -> dict:
        return dataclasses.asdict(self.config)

    def _export(self) -> dict:
        return {**self.policy.state(), "probe": self.probe_filter.state()}

    def _import(self, payload: dict) -> None:
        self.probe_filter.load_state(payload.get("probe", {}))
        index = {"confirmed": payload.get("confirmed_steps", []), "candidate": payload.get("candidate_step")}
        if self._resume_folder is not None and saved_index(self._resume_folder) == index:
            self.store.import_from(self._resume_folder, index)  # exactly the snapshots held at the save
            self.policy.load_state(payload, index["confirmed"], candidate_available=index["candidate"] is not None)
            return
        available = []
        if self.store is not None and self.store.storage == "disk":
            available = [s for s in self.store.confirmed_steps if s in index["confirmed"]]
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
            if self.policy.uses_snapshots and self.config.snapshot_storage != "disk":
                raise ValueError(
                    "StabilityGuardCallback: rollbacks under DeepSpeed use the engine's collective "
                    "checkpoints, which need `snapshot_storage='disk'`."
                )
        if self._backend == "fsdp" and self.policy.uses_snapshots:
            raise ValueError(
                f"StabilityGuardCallback: action={self.policy.action!r} needs snapshots, which are not implemented "
                "for FSDP (sharded parameters and optimizer state). Use action='skip' or 'log' under FSDP."
            )
        clip_norm = self.config.guard_clip_norm
        if clip_norm is not None and args.max_grad_norm and args.max_grad_norm > 0:
            raise ValueError(
                f"`guard_clip_norm`={clip_norm} needs `max_grad_norm=0` in the TrainingArguments (got "
                f"{args.max_grad_norm}): the trainer's own clip would run first and hide the pre-clip norm."
            )
        folder = os.path.join(args.output_dir, "stable_guard", self.name)
        writer = state.is_world_process_zero if self.config.snapshot_storage == "disk" else True
        self.store = SnapshotStore(
            self.config.snapshot_storage, folder=folder, history=self.policy.snapshot_history, writer=writer
        )
        if state.global_step > 0 and self.config.snapshot_storage == "disk":
            self.store.adopt_disk_snapshots(state.global_step)
        resumed_from = resume_dir(args, state, self._trainer(state)) if state.global_step > 0 else None
        self._resume_folder = None if resumed_from is None else os.path.join(resumed_from, SNAPSHOT_DIR, self.name)
        self._self_restore(state)
        trainer = self._trainer()
        if trainer is not None and not signals_installed(trainer):
            install_signals(trainer)
        if self.config.probe_every:
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
        if self.config.probe_every and state.global_step % self.config.probe_every == 0 and not self._exhausted_stop:
            self._probe(state, control, model, optimizer, lr_scheduler)
        if self._exhausted_stop:
            control.should_training_stop = True
            control.should_save = True

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
        if self.config.snapshot_scope == "all":
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
        if decision.ops and self.config.snapshot_storage == "disk" and _world_size() > 1:
            torch.distributed.barrier()  # the writer has finished before anyone reads

    def _execute(self, decision: Decision, args, state, control, model, optimizer, lr_scheduler) -> None:
        trainer = self._trainer(state)
        self._snapshot_ops(decision, model, optimizer, lr_scheduler, trainer)
        if decision.anomalous:
            self.decisions.append(decision)
            report(decision, state)
        if decision.action in ("accept", "log"):
            if self.config.guard_clip_norm is not None and optimizer is not None:
                grads = [p.grad for p in optimizer_params(optimizer) if p.grad is not None]
                total = torch.nn.utils.get_total_norm(grads)
                torch.nn.utils.clip_grads_with_norm_(optimizer_params(optimizer), self.config.guard_clip_norm, total)
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
            restore_scheduler=self.config.scheduler_policy == "restore",
            restore_hyperparameters=self.config.scheduler_policy == "restore",
        )


