"""The guard's LR cooldown and the SNR learning-rate callback (OBLR-PO) scale the same update: both go through
`hf_stable.stability.update.scale_lr` (multiply, then divide), so in either callback order the update uses
`lr · snr_factor · cooldown` and the learning rate is back at the schedule's value after every step."""

import types

import pytest
import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from hf_stable.callbacks import FaultInjectionCallback, StabilityGuardCallback
from hf_stable.callbacks.snr_lr import SNRLearningRateCallback
from hf_stable.testing import build_tiny_model


LR = 1e-3
SNR_FACTOR = 0.5


class _LrProbe(TrainerCallback):
    """Added last: sees the learning rate the update uses, and the one the two callbacks leave after it (before the
    scheduler, which with transformers' LambdaLR schedules would hide a leak by writing its own value; a
    ReduceLROnPlateau, or the next callback reading the rate, would not)."""

    def __init__(self, guard):
        self.guard, self.rows = guard, []

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        self.rows.append([state.global_step + 1, optimizer.param_groups[0]["lr"], self.guard.last_decision])

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        self.rows[-1].append(optimizer.param_groups[0]["lr"])


def _run(tmp_path, guard_first):
    model, _ = build_tiny_model(seed=0)
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": ids, "labels": ids} for ids in torch.randint(10, 60, (256, 12), generator=g)]
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=24, per_device_train_batch_size=8, learning_rate=LR,
        lr_scheduler_type="constant", use_cpu=True, report_to="none", save_strategy="no", disable_tqdm=True,
        logging_steps=1,
    )  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=rows)
    snr = SNRLearningRateCallback(types.SimpleNamespace(factor=SNR_FACTOR))
    guard_kwargs = dict(action="rollback", window=8, min_history=4, snapshot_every=2, confirm_steps=1,
                        lr_cooldown_factor=0.25, lr_cooldown_steps=6)  # fmt: skip
    if not guard_first:
        trainer.add_callback(snr)
    guard = StabilityGuardCallback.attach(trainer, **guard_kwargs)
    if guard_first:
        trainer.add_callback(snr)
    FaultInjectionCallback.attach(trainer, kind="loss_scale", steps=[12], factor=1e4)
    probe = _LrProbe(guard)
    trainer.add_callback(probe)
    trainer.train()
    return guard, probe.rows


@pytest.mark.parametrize("guard_first", [False, True])
def test_cooldown_and_snr_factor_compose(tmp_path, guard_first):
    guard, rows = _run(tmp_path, guard_first)
    assert guard.policy.rollbacks == 1
    cooled = [step for step, _, decision, _ in rows if decision.lr_multiplier < 1.0]
    assert len(cooled) >= 3  # the cooldown is active for several steps after the rollback
    for step, used, decision, after in rows:
        if decision.action == "rollback":
            continue  # the update is dropped: its learning rate does not matter
        assert used == pytest.approx(LR * SNR_FACTOR * decision.lr_multiplier, rel=1e-12), step
        assert after == pytest.approx(LR, rel=1e-12), step  # both factors undone: nothing leaks
