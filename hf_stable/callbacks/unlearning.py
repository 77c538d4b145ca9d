"""Callbacks of `UnlearningTrainer`: partner redraws per epoch, per-epoch dual ascent (PDU), the collapse guard,
periodic unlearning evaluation and the end-of-training relearning probe. `unlearning_callbacks(trainer)` returns
those the trainer's config switches on; each reads the trainer it belongs to.
"""

from __future__ import annotations

import copy
import logging
import os

import torch
from transformers import TrainerCallback

from ..stability.nograd import own_forward


logger = logging.getLogger(__name__)
PROBE_ROWS = 64  # rows the guard scores at each check: enough for a stable mean, cheap on any model
HEALTHY_FILE = "collapse_guard_healthy.safetensors"  # in checkpoint-N when N falls between two checks


def unlearning_callbacks(trainer) -> list[TrainerCallback]:
    args = trainer.args
    callbacks: list[TrainerCallback] = [EpochSetterCallback(trainer.train_dataset)]
    if args.unlearn_method == "pdu" and args.pdu_dual_update == "epoch":
        callbacks.append(DualAscentCallback(trainer))
    if args.collapse_guard and (trainer._retain_rows or trainer._holdout_rows):
        callbacks.append(CollapseGuardCallback(trainer))
    if args.unlearn_eval_steps:
        callbacks.append(UnlearningEvalCallback(trainer, args.unlearn_eval_steps))
    if args.relearn_probe_steps:
        callbacks.append(RelearnProbeCallback(trainer))
    return callbacks


class EpochSetterCallback(TrainerCallback):
    """Redraws the forget/retain partners each epoch (deterministically, the same on every process)."""

    def __init__(self, dataset):
        self.dataset = dataset

    def on_epoch_begin(self, args, state, control, **kwargs):
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(int(state.epoch or 0))


def _mean_nll(trainer, rows) -> torch.Tensor:
    from ..evaluation.unlearning import score_rows

    model = trainer.accelerator.unwrap_model(trainer.model)
    return score_rows(model, trainer.processing_class, rows)["mean_nll"]


class DualAscentCallback(TrainerCallback):
    """PDU with ``pdu_dual_update="epoch"``: λ follows the mean retain loss over a full pass at each epoch's end."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        # transformers saves a checkpoint at an epoch's last step before `on_epoch_end`, and a run resumed from it
        # starts with the next epoch: the update it missed is made now, from the same (checkpointed) weights
        done = self.trainer._dual_epochs  # None: a checkpoint from before this count was kept
        if state.global_step > 0 and done is not None and done < int(state.epoch or 0):
            self.on_epoch_end(args, state, control)

    def on_epoch_end(self, args, state, control, **kwargs):
        retain = _mean_nll(self.trainer, self.trainer._retain_rows).mean().item()
        self.trainer.dual_update_from(retain)
        self.trainer._dual_epochs = int(state.epoch or 0)


class CollapseGuardCallback(TrainerCallback):
    """Stops unlearning when it collapses: the retain NLL exceeds max(``collapse_retain_factor`` × its value at the
    start, ``collapse_retain_floor``), or the forget answer probability falls below ``collapse_forget_floor`` × the
    holdout probability at the start (answers pushed far below chance — gradient ascent's signature). With
    ``collapse_restore_best`` the trainable weights of the last healthy check are restored. The starting statistics
    are checkpointed, so a resumed run compares against the same start. The healthy weights are the checkpoint's own
    when it falls on a check; between checks they are saved with it (``checkpoint-N/`` + ``HEALTHY_FILE``).
    """

    def __init__(self, trainer):
        self.trainer = trainer
        self.healthy: dict[str, torch.Tensor] | None = None
        self.tripped = False

    def _measure(self) -> dict[str, float]:
        t = self.trainer
        out = {}
        if t._retain_rows:
            out["retain_nll"] = _mean_nll(t, t._retain_rows[:PROBE_ROWS]).mean().item()
        out["forget_prob"] = (-_mean_nll(t, t._forget_rows[:PROBE_ROWS])).exp().mean().item()
        return out

    def on_train_begin(self, args, state, control, **kwargs):
        t = self.trainer
        if "start_forget_prob" in t._guard_state:  # resumed: keep the start of the original run
            self.tripped = "tripped_at" in t._guard_state
            if state.global_step % args.collapse_check_steps == 0:
                self._snapshot()  # the checkpoint's weights are those of its step's (healthy) check
            elif args.collapse_restore_best:
                self.healthy = self._saved_healthy(args, state)
                if self.healthy is None:
                    logger.warning(
                        f"Resumed at step {state.global_step}, between collapse checks, without {HEALTHY_FILE}: until "
                        "the next healthy check a collapse restores the weights of the resumed step."
                    )
                    self._snapshot()
            return
        start = self._measure()
        t._guard_state.update({f"start_{k}": v for k, v in start.items()})
        if t._holdout_rows:
            t._guard_state["holdout_prob"] = (-_mean_nll(t, t._holdout_rows[:PROBE_ROWS])).exp().mean().item()
        self._snapshot()

    @staticmethod
    def _saved_healthy(args, state) -> dict[str, torch.Tensor] | None:
        from safetensors.torch import load_file

        from ._checkpoint_files import resumed_file

        path = resumed_file(args, state, HEALTHY_FILE)
        return load_file(path) if path is not None else None

    _written_step: int | None = None

    def write_checkpoint_state(self, folder, args, state) -> None:
        """Called by the trainer's atomic save with the staged folder (see `_checkpoint_files`)."""
        from ._checkpoint_files import save_tensors

        self._written_step = state.global_step
        on_check = state.global_step % args.collapse_check_steps == 0  # then the checkpoint's weights are healthy
        if self.healthy is not None and not on_check and args.should_save:
            save_tensors(os.path.join(folder, HEALTHY_FILE), self.healthy)

    def on_save(self, args, state, control, **kwargs):
        if self._written_step != state.global_step:  # a trainer without the atomic-save hook
            self.write_checkpoint_state(os.path.join(args.output_dir, f"checkpoint-{state.global_step}"), args, state)

    def _snapshot(self):
        if self.trainer.args.collapse_restore_best:
            model = self.trainer.accelerator.unwrap_model(self.trainer.model)
            self.healthy = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}

    def on_step_end(self, args, state, control, **kwargs):
        if self.tripped or state.global_step % args.collapse_check_steps:
            return
        t = self.trainer
        now = self._measure()
        g = t._guard_state
        reasons = []
        limit = max(args.collapse_retain_factor * g.get("start_retain_nll", 0.0), args.collapse_retain_floor)
        if "retain_nll" in now and now["retain_nll"] > limit:
            reasons.append(
                f"retain NLL {now['retain_nll']:.3g} > max({args.collapse_retain_factor} × start "
                f"{g['start_retain_nll']:.3g}, {args.collapse_retain_floor})"
            )
        if "holdout_prob" in g and now["forget_prob"] < args.collapse_forget_floor * g["holdout_prob"]:
            reasons.append(
                f"forget probability {now['forget_prob']:.3g} < {args.collapse_forget_floor} × holdout "
                f"probability at the start {g['holdout_prob']:.3g}"
            )
        t._metrics["guard_retain_nll"].append(now.get("retain_nll", float("nan")))
        t._metrics["guard_forget_prob"].append(now["forget_prob"])
        if not reasons:
            self._snapshot()
            return
        self.tripped = True
        g["tripped_at"] = state.global_step
        t._metrics["collapsed"].append(1.0)
        logger.warning(f"Unlearning collapsed at step {state.global_step}: {'; '.join(reasons)}. Stopping.")
        if self.healthy is not None:
            model = t.accelerator.unwrap_model(t.model)
            with torch.no_grad():
                for n, p in model.named_parameters():
                    if n in self.healthy:
                        p.copy_(self.healthy[n])
            logger.warning("Restored the trainable weights of the last healthy check.")
        control.should_training_stop = True


class UnlearningEvalCallback(TrainerCallback):
    """Runs `trainer.evaluate_unlearning()` every ``every`` steps and logs it under ``stable/unlearning/eval/...``."""

    def __init__(self, trainer, every: int):
        self.trainer, self.every = trainer, every

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.every:
            return
        report = self.trainer.evaluate_unlearning(print_table=False)
        for key, value in report.items():
            self.trainer._metrics[f"eval/{key}"].append(float(value))


class RelearnProbeCallback(TrainerCallback):
    """After training: fine-tune a copy on ``relearn_probe_fraction`` of the forget set for ``relearn_probe_steps``
    and measure accuracy / probability on the rest (``trainer.relearn_report``, logged under
    ``stable/unlearning/relearn_*``)."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_train_end(self, args, state, control, **kwargs):
        from ..evaluation.unlearning import relearn_attack

        t = self.trainer
        rows = list(t.forget_dataset)
        split = max(1, min(len(rows) - 1, round(args.relearn_probe_fraction * len(rows))))
        if len(rows) < 2:
            logger.warning("The relearning probe needs at least 2 forget rows; skipped.")
            return
        generator = torch.Generator().manual_seed(args.seed)
        order = torch.randperm(len(rows), generator=generator).tolist()
        learn, test = [rows[i] for i in order[:split]], [rows[i] for i in order[split:]]
        model = t.accelerator.unwrap_model(t.model)
        if any("forward" in m.__dict__ for m in model.modules()):
            # the probe trains a deep copy; a patched forward (TRL's fused LM head) would keep calling `model`
            model = own_forward(copy.deepcopy(model))
        t.relearn_report = relearn_attack(
            model,
            t.processing_class,
            learn,
            test,
            steps=args.relearn_probe_steps,
            lr=args.relearn_probe_lr,
            max_length=args.max_length,
            seed=args.seed,
        )
        if t.is_world_process_zero():
            logger.info(f"Relearning probe: {t.relearn_report}")
        t.log({f"stable/unlearning/relearn_{k}": v for k, v in t.relearn_report.items()})
