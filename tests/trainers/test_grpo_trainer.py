"""StableGRPOTrainer on the tiny model: TRL parity, every variant end to end, advantages against the pure functions,
gradient accumulation, resume with learned state. The two-process check is tests/distributed/test_grpo_ddp.py."""

import math
import os

import pytest
import torch
from grpo_helpers import G, grpo_run, grpo_trainer
from sft_helpers import assert_same_update
from trl import GRPOConfig, GRPOTrainer

from hf_stable.losses.advantages import ADVANTAGE_ESTIMATORS


FEATURES = {
    "sgrpo": {
        "advantage_estimator": "sgrpo",
        "sgrpo_noise_p": 0.1,
        "loss_type": "dr_grpo",
        "correctness_reward_index": 0,
    },
    "maxrl": {"advantage_estimator": "maxrl", "correctness_reward_index": 0},
    "dvao": {"advantage_estimator": "dvao"},
    "oblr": {"advantage_estimator": "oblr"},
    "delta_l": {"delta_l_alpha": 1.0, "loss_type": "dr_grpo"},
    "drpo": {"loss_mode": "drpo", "correctness_reward_index": 0},
    "onpolicy_sft": {"loss_mode": "onpolicy_sft", "correctness_reward_index": 0},
    "ctwa": {"reward_weighting": "ctwa"},
    "lagrangian": {"reward_weighting": "lagrangian", "lagrange_thresholds": [None, -0.2]},
    "gradient": {"reward_weighting": "gradient", "learning_rate": 1e-6},
    "hypervolume": {"reward_weighting": "hypervolume", "drw_val_size": 4},
    "brme": {"robust_reward": "brme"},
    "stable_rank": {"stable_rank_reward": True, "stable_rank_weight": 0.1},
    "oblr_lr": {"oblr_adaptive_lr": True, "gradient_accumulation_steps": 2},
}


def test_default_config_is_trl_grpo(tmp_path):
    """Every hf_stable field at its default: three steps of real sampling give TRL's parameters bit for bit."""
    config = {"max_steps": 3, "learning_rate": 1e-2, "optim": "adamw_torch", "max_grad_norm": 1.0}
    ours, _ = grpo_run(tmp_path / "a", rollout=False, **config)
    trl, _ = grpo_run(tmp_path / "b", rollout=False, trainer_cls=GRPOTrainer, config_cls=GRPOConfig, **config)
    assert ours.abs().max() > 0 and torch.equal(ours, trl)


@pytest.mark.parametrize("name", sorted(FEATURES))
def test_every_variant_trains(tmp_path, name):
    config = dict(FEATURES[name])
    grad_accum = config.pop("gradient_accumulation_steps", 1)
    delta, trainer = grpo_run(
        tmp_path, grad_accum=grad_accum, batch_size=2 * G // grad_accum, **{"max_steps": 2, **config}
    )
    logs = trainer.state.log_history
    assert math.isfinite(logs[-1]["train_loss"])
    assert torch.isfinite(delta).all() and delta.abs().max() > 0, "no parameter moved"
    assert any(k.startswith("stable/grpo/") for k in logs[0]) or name in ("stable_rank",)


@pytest.mark.parametrize("estimator", ["sgrpo", "maxrl", "dvao"])
def test_trainer_uses_the_pure_estimator_on_gathered_rewards(tmp_path, estimator):
    """The advantages the step used (logged per completion) equal the pure function applied to the logged rewards."""
    _, trainer = grpo_run(tmp_path, **FEATURES[estimator])
    rewards = torch.stack([torch.tensor(list(v)) for v in trainer._logs["rewards"].values()], dim=1)
    used = torch.tensor(list(trainer._logs["advantages"]))
    method = ADVANTAGE_ESTIMATORS.get(estimator)
    params = method.params_from(trainer.args)
    expected, _ = method(rewards, torch.ones(len(rewards)), G, trainer.reward_weights, **params)
    torch.testing.assert_close(used, expected, rtol=1e-6, atol=1e-7)
    assert used.abs().max() > 0


def test_drpo_never_pushes_a_correct_answer_down(tmp_path):
    _, trainer = grpo_run(tmp_path, **{**FEATURES["drpo"], "max_steps": 3})
    correct = torch.tensor(list(trainer._logs["rewards"]["arithmetic_reward"])) > 0.5
    used = torch.tensor(list(trainer._logs["advantages"]))
    assert (used[correct] >= 0).all() and (used[~correct] <= 0).all() and used.abs().max() > 0


def test_onpolicy_sft_with_nothing_kept_is_a_finite_zero_step(tmp_path):
    delta, trainer = grpo_run(
        tmp_path, reward_funcs=[lambda completions, **kw: [0.0] * len(completions)], loss_mode="onpolicy_sft"
    )
    assert trainer.state.log_history[-1]["train_loss"] == 0.0
    assert delta.abs().max() == 0


@pytest.mark.parametrize("name", ["default", "sgrpo", "delta_l", "drpo", "onpolicy_sft", "ctwa"])
def test_gradient_accumulation_leaves_update_unchanged(tmp_path, name):
    config = FEATURES.get(name, {})
    full, _ = grpo_run(tmp_path / "a", batch_size=2 * G, **config)
    accumulated, _ = grpo_run(tmp_path / "b", batch_size=G, grad_accum=2, **config)
    assert_same_update(accumulated, full, rtol=1e-5)


def test_resume_restores_ctwa_weights_and_oblr_snr(tmp_path):
    config = {
        "reward_weighting": "ctwa",
        "ctwa_lambda_lr": 0.5,
        "ctwa_cov_targets": [1.0, 1.0],  # above both correlations of this aligned task: the weights move
        "oblr_adaptive_lr": True,
        "max_steps": 4,
        "learning_rate": 1e-2,
        "optim": "adamw_torch",
        "save_strategy": "steps",
        "save_steps": 2,
    }
    _, full = grpo_run(tmp_path / "full", batch_size=G, grad_accum=2, **config)
    checkpoint = tmp_path / "full" / "checkpoint-2"
    assert (checkpoint / "hf_stable_state.safetensors").is_file()

    resumed = grpo_trainer(tmp_path / "full", batch_size=G, grad_accum=2, **config)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 4
    for a, b in zip(full.model.parameters(), resumed.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    torch.testing.assert_close(resumed._controller.log_weights, full._controller.log_weights)
    assert not torch.allclose(full._controller.log_weights, torch.zeros(2))  # CTWA moved the weights
    assert resumed._snr.snr_ema == pytest.approx(full._snr.snr_ema) and full._snr.snr_ema is not None


def test_state_is_written_next_to_each_checkpoint(tmp_path):
    grpo_run(tmp_path, **{**FEATURES["lagrangian"], "max_steps": 2, "save_strategy": "steps", "save_steps": 1})
    for step in (1, 2):
        assert os.path.isfile(tmp_path / f"checkpoint-{step}" / "hf_stable_state.json")
