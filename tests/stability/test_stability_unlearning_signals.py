"""The step signals of `UnlearningTrainer`: its multi-gradient schemes (StableUN, SGA's auto rate) bypass
`Trainer.training_step`, so they record the step loss themselves; the guard then sees the loss the trainer logs."""

import pytest
from unlearn_helpers import GLOBAL_BATCH, METHODS, unlearn_update

from hf_stable.callbacks import StabilityGuardCallback


@pytest.mark.parametrize("method", ["stableun", "graddiff"])
def test_the_guard_sees_every_step_loss(tmp_path, method):
    config = {**METHODS[method], "max_steps": 3, "learning_rate": 1e-3}
    _, trainer = unlearn_update(tmp_path, GLOBAL_BATCH // 2, 2, stability_guard=True, **config)
    (guard,) = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, StabilityGuardCallback)]
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 3
    assert guard.policy.loss_window.values() == pytest.approx(logged, rel=1e-4)
