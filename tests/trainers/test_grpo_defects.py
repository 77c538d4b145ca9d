"""Regression tests for the GRPO defects found in review (issue 11 §2), each failing on the code before its fix."""

import pytest
import torch
from grpo_helpers import G, grpo_run

from hf_stable import StableGRPOConfig
from hf_stable.losses.advantages import ADVANTAGE_ESTIMATORS, scalar_rewards, success_indicator


SUCCESS_COUNTERS = {
    "sgrpo": {"advantage_estimator": "sgrpo"},
    "maxrl": {"advantage_estimator": "maxrl"},
    "drpo": {"loss_mode": "drpo"},
    "onpolicy_sft": {"loss_mode": "onpolicy_sft"},
}


# ---------------------------------------------------------------------------------------------------------------------
# success counting


@pytest.mark.parametrize("name", sorted(SUCCESS_COUNTERS))
def test_success_counting_needs_the_correctness_index_with_several_rewards(tmp_path, name):
    """Two reward functions (correctness and a length penalty) and no index: refused, naming the field, instead of
    binarising the sum of both at 0.5."""
    with pytest.raises(ValueError, match="`correctness_reward_index` is required with 2 reward functions"):
        grpo_run(tmp_path, **SUCCESS_COUNTERS[name])


def test_explicit_sum_keeps_the_weighted_sum(tmp_path):
    """`correctness_reward_index="sum"` counts successes on the weighted sum of every reward (the old behaviour)."""
    _, trainer = grpo_run(tmp_path, advantage_estimator="maxrl", correctness_reward_index="sum")
    rewards = torch.stack([torch.tensor(list(v)) for v in trainer._logs["rewards"].values()], dim=1)
    used = torch.tensor(list(trainer._logs["advantages"]))
    success = (scalar_rewards(rewards, trainer.reward_weights) > 0.5).float().reshape(-1, G)
    k = success.sum(1, keepdim=True)  # MaxRL with T = G: (r - r̄)/r̄, 0 without a success
    expected = torch.where(k > 0, (success - k / G) / (k / G).clamp(min=1e-12), torch.zeros_like(success))
    torch.testing.assert_close(used, expected.reshape(-1), rtol=1e-6, atol=1e-6)
    assert used.abs().max() > 0


def test_single_reward_counts_on_its_own_value_not_its_weight():
    rewards = torch.tensor([[1.0], [0.0], [1.0], [float("nan")]])
    got = success_indicator(rewards, torch.tensor([0.4]), None, 0.5)
    torch.testing.assert_close(got, torch.tensor([1.0, 0.0, 1.0, float("nan")]), equal_nan=True)
    with pytest.raises(ValueError, match="correctness_reward_index"):
        success_indicator(torch.ones(4, 2), torch.ones(2), None, 0.5)


def test_correctness_index_from_yaml_or_cli_is_an_integer(tmp_path):
    config = StableGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", correctness_reward_index="1")
    assert config.correctness_reward_index == 1
    with pytest.raises(ValueError, match="correctness_reward_index"):
        StableGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", correctness_reward_index="all")
    assert ADVANTAGE_ESTIMATORS.get("sgrpo").params_from(config)["correctness_index"] == 1


# ---------------------------------------------------------------------------------------------------------------------
# CTWA defaults: correlation targets


def long_reward(completions, **kwargs):
    """Conflicts with correctness: the rollout's correct answers are its shortest completions."""
    return [0.1 * len(c) for c in completions]


def long_reward_x10(completions, **kwargs):
    return [1.0 * len(c) for c in completions]


def test_ctwa_defaults_move_the_weights_on_a_conflict(tmp_path):
    from hf_stable.testing import arithmetic_reward

    rewards = (arithmetic_reward, long_reward)
    _, trainer = grpo_run(tmp_path, reward_funcs=rewards, reward_weighting="ctwa", max_steps=3)
    weights = trainer._controller.weights
    assert not torch.allclose(weights, torch.ones(2)), weights
    deficits = [v for log in trainer.state.log_history for k, v in log.items() if "ctwa/deficit_" in k]
    assert max(deficits) > 0


def test_ctwa_defaults_are_scale_free(tmp_path):
    """A reward ×10 with its weight ÷10 trains identically; the default (correlation) targets then move the weights
    identically too, up to the ÷10 (raw covariance targets did not: the covariance scales with the reward)."""
    from hf_stable.testing import arithmetic_reward

    config = {"reward_weighting": "ctwa", "max_steps": 3}
    _, a = grpo_run(tmp_path / "a", reward_funcs=(arithmetic_reward, long_reward), **config)
    _, b = grpo_run(
        tmp_path / "b", reward_funcs=(arithmetic_reward, long_reward_x10), reward_weights=[1.0, 0.1], **config
    )
    moved = a._controller.weights
    assert not torch.allclose(moved, torch.ones(2))
    torch.testing.assert_close(b._controller.weights, moved * torch.tensor([1.0, 0.1]), rtol=1e-4, atol=1e-6)


def test_ctwa_covariance_without_targets_is_refused(tmp_path):
    with pytest.raises(ValueError, match="`ctwa_cov_targets` is required with ctwa_use_corr=False"):
        grpo_run(tmp_path, reward_weighting="ctwa", ctwa_use_corr=False)


# ---------------------------------------------------------------------------------------------------------------------
# memory of the gradient statistics: a small default subset


def test_gradient_statistics_default_to_the_last_block():
    from hf_stable.callbacks.snr_lr import tracked_parameters
    from hf_stable.testing import build_tiny_model

    model, _ = build_tiny_model(seed=0)
    names = [n for n, _ in tracked_parameters(model.named_parameters(), None, "oblr_snr_params")]
    assert names and all(n.startswith("model.layers.1.") for n in names)
    assert len(names) == sum(n.startswith("model.layers.1.") for n, _ in model.named_parameters())
    with pytest.raises(ValueError, match="`drw_target_params`='nothing'"):
        tracked_parameters(model.named_parameters(), "nothing", "drw_target_params")


def test_snr_tracker_holds_one_flat_copy_between_micro_batches():
    """Between micro-batches only the running sum (n floats) is held; the pre-micro-batch copy is released."""
    from hf_stable.callbacks.snr_lr import MicroBatchSNR

    layer = torch.nn.Linear(3, 2)
    tracker = MicroBatchSNR(layer.named_parameters())
    n = sum(p.numel() for p in layer.parameters())
    for step in range(2):
        tracker.before_backward()
        layer(torch.randn(4, 3)).pow(2).sum().backward()
        tracker.after_backward(usable=True)
        held = [t for t in (tracker._before, tracker._sum) if t is not None]
        assert [t.numel() for t in held] == [n], step
    assert tracker._count == 2


def test_gradient_weighting_compares_the_last_block_by_default(tmp_path):
    config = {"reward_weighting": "gradient", "learning_rate": 1e-6, "max_steps": 2}
    _, default = grpo_run(tmp_path / "a", **config)
    _, explicit = grpo_run(tmp_path / "b", drw_target_params=r"^model\.layers\.1\.", **config)
    _, everything = grpo_run(tmp_path / "c", drw_target_params=".", **config)
    torch.testing.assert_close(default._controller.weights, explicit._controller.weights, rtol=0, atol=0)
    assert not torch.equal(default._controller.weights, everything._controller.weights)


# ---------------------------------------------------------------------------------------------------------------------
# extra forward passes: vision-language inputs and gradient checkpointing


def test_extra_forwards_pass_vlm_inputs_and_disable_checkpointing(tmp_path, monkeypatch):
    """DRPO's old log-probs forward gets the image inputs TRL's forwards get, and runs with gradient checkpointing
    off (TRL's handling of its own no-grad forwards)."""
    from trl import GRPOTrainer

    seen = []
    real = GRPOTrainer._get_per_token_logps_and_entropies

    def spy(self, model, *args, **kwargs):
        unwrapped = self.accelerator.unwrap_model(model)
        seen.append((kwargs.get("image_sizes"), unwrapped.is_gradient_checkpointing))
        return real(self, model, *args, **{k: v for k, v in kwargs.items() if k != "image_sizes"})

    _, trainer = grpo_run(
        tmp_path, loss_mode="drpo", correctness_reward_index=0, gradient_checkpointing=True, max_steps=1
    )
    monkeypatch.setattr(GRPOTrainer, "_get_per_token_logps_and_entropies", spy)
    out = {
        "prompt_ids": torch.tensor([[5, 6]]),
        "prompt_mask": torch.ones(1, 2, dtype=torch.long),
        "completion_ids": torch.tensor([[7, 8, 9]]),
        "completion_mask": torch.ones(1, 3, dtype=torch.long),
        "image_sizes": "sentinel",
    }
    trainer.model.train()
    assert trainer.accelerator.unwrap_model(trainer.model).is_gradient_checkpointing
    trainer._policy_logps(out)
    assert seen == [("sentinel", False)]
    assert trainer.accelerator.unwrap_model(trainer.model).is_gradient_checkpointing  # restored


# ---------------------------------------------------------------------------------------------------------------------
# drw_every_n_steps counts optimizer steps


def test_gradient_weighting_every_n_steps_counts_optimizer_steps(tmp_path):
    """Generations at steps 0, 2, 4 (`steps_per_generation=2`) with n = 3: updates at steps 0 and 4, not only 0."""
    config = {"reward_weighting": "gradient", "learning_rate": 1e-6, "steps_per_generation": 2}
    _, trainer = grpo_run(tmp_path, max_steps=6, drw_every_n_steps=3, **config)
    updates = [log for log in trainer.state.log_history if "stable/grpo/drw/score_0" in log]
    assert len(updates) == 2
    assert trainer._controller.last_step == 4


# ---------------------------------------------------------------------------------------------------------------------
# stable_rank_reward knobs


def test_stable_rank_reward_takes_its_settings_from_the_config(tmp_path):
    """`stable_rank_normalize`, `stable_rank_hidden` and `stable_rank_weight` reach the appended reward, which
    tokenises prompts with TRL's `_tokenize_prompts` once bound."""
    _, trainer = grpo_run(
        tmp_path,
        stable_rank_reward=True,
        stable_rank_normalize="by_T",
        stable_rank_hidden="after_norm",
        stable_rank_weight=0.25,
    )
    reward = trainer.reward_funcs[-1]
    assert (reward.normalize, reward.hidden) == ("by_T", "after_norm")
    assert trainer.reward_weights[-1].item() == 0.25
    prompts = ["1+2=", "12+3="]
    assert reward._prompt_ids(prompts) == [list(ids) for ids in trainer._tokenize_prompts(prompts)[0]]
    by_t = [v for log in trainer.state.log_history for k, v in log.items() if k == "rewards/stable_rank/mean"]
    assert by_t and 0 < by_t[0] <= 1  # SR / min(T, d) ≤ 1


def test_stable_rank_defaults_read_before_the_final_norm(tmp_path):
    from hf_stable.testing import build_tiny_model

    _, trainer = grpo_run(tmp_path, stable_rank_reward=True)
    reward = trainer.reward_funcs[-1]
    assert (reward.normalize, reward.hidden) == ("none", "before_norm")
    model, tok = build_tiny_model(seed=0)
    ids = tok("1+2=3+4*5=23", add_special_tokens=False)["input_ids"]
    captured = []
    hook = model.model.norm.register_forward_hook(lambda module, inputs, output: captured.append(inputs[0]))
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]))
    hook.remove()
    reward.model = model
    from hf_stable.rewards import stable_rank

    got = reward(prompts=["1+2="], completions=[None], completion_ids=[ids[4:]])[0]
    assert got == pytest.approx(stable_rank(captured[0][0, 4:]).item(), rel=1e-5)


# ---------------------------------------------------------------------------------------------------------------------
# hypervolume validation: through the trainer's reward transform, out of the training logs


def _counting_reward(completions, log_metric=None, **kwargs):
    log_metric("batch_size", float(len(completions)))
    return [1.0] * len(completions)


def _zero_reward(completions, **kwargs):
    return [0.0] * len(completions)


def test_hypervolume_validation_uses_brme_and_does_not_leak_metrics(tmp_path):
    """The validation rewards go through the BRME fold (`0.5·mean + 0.5·min` of 1 and 0 = 0.25, the folded column
    NaN), and a reward function's `log_metric` during validation (4 prompts) never reaches the training logs
    (8 completions per generation)."""
    _, trainer = grpo_run(
        tmp_path,
        reward_funcs=(_counting_reward, _zero_reward),
        reward_weighting="hypervolume",
        drw_val_size=4,
        robust_reward="brme",
        max_steps=2,
    )
    reference = trainer._controller.reference
    assert reference[0].item() == pytest.approx(0.25) and torch.isnan(reference[1])
    logged = [log["batch_size"] for log in trainer.state.log_history if "batch_size" in log]
    assert logged == [2 * G, 2 * G]
    brme = [k for log in trainer.state.log_history for k in log if k.startswith("stable/grpo/brme/")]
    assert len(brme) == 2  # one per training generation, none from the validations
