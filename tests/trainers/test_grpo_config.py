"""Invalid GRPO-variant configurations fail at construction, naming the fields (composition rules: docs/grpo.md)."""

import pytest

from hf_stable import StableGRPOConfig, StableGRPOTrainer
from hf_stable.testing import arithmetic_dataset, arithmetic_reward, build_tiny_model


def _config(tmp_path, **kwargs):
    return StableGRPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to="none",
        per_device_train_batch_size=4,
        num_generations=4,
        **kwargs,
    )


@pytest.mark.parametrize(
    ("kwargs", "fields"),
    [
        ({"advantage_estimator": "ppo"}, ["advantage_estimator", "'sgrpo'"]),
        ({"loss_mode": "dpo"}, ["loss_mode", "'drpo'"]),
        ({"reward_weighting": "pareto"}, ["reward_weighting", "'ctwa'"]),
        ({"robust_reward": "median"}, ["robust_reward"]),
        ({"loss_mode": "drpo", "beta": 0.04}, ["loss_mode", "beta"]),
        ({"loss_mode": "drpo", "top_entropy_quantile": 0.2}, ["loss_mode", "top_entropy_quantile"]),
        ({"loss_mode": "onpolicy_sft", "advantage_estimator": "sgrpo"}, ["loss_mode", "advantage_estimator"]),
        ({"loss_mode": "drpo", "delta_l_alpha": 1.0, "loss_type": "dr_grpo"}, ["delta_l_alpha"]),
        ({"delta_l_alpha": 1.0}, ["delta_l_alpha", "loss_type", "dr_grpo"]),
        ({"delta_l_alpha": 1.0, "loss_type": "grpo"}, ["delta_l_alpha", "'grpo'"]),
        ({"delta_l_alpha": -1.0, "loss_type": "dr_grpo"}, ["delta_l_alpha"]),
        ({"advantage_estimator": "sgrpo", "sgrpo_noise_p": 0.5}, ["sgrpo_noise_p"]),
        ({"advantage_estimator": "sgrpo", "sgrpo_noise_p": -0.1}, ["sgrpo_noise_p"]),
        ({"advantage_estimator": "maxrl", "maxrl_truncation": 0}, ["maxrl_truncation"]),
        ({"advantage_estimator": "maxrl", "maxrl_baseline": "median"}, ["maxrl_baseline"]),
        ({"advantage_estimator": "oblr", "oblr_norm_proxy": "exact"}, ["oblr_norm_proxy"]),
        ({"oblr_adaptive_lr": True}, ["oblr_adaptive_lr", "gradient_accumulation_steps"]),
        ({"oblr_lr_min_ratio": 0.0}, ["oblr_lr_min_ratio"]),
        (
            {"advantage_estimator": "dvao", "multi_objective_aggregation": "normalize_then_sum"},
            ["multi_objective_aggregation"],
        ),
        ({"loss_mode": "drpo", "drpo_tau": 0.0}, ["drpo_tau"]),
        ({"drpo_kl_type": "js"}, ["drpo_kl_type"]),
        ({"brme_lambda": 1.5}, ["brme_lambda"]),
        ({"drw_eval_every": 0}, ["drw_eval_every"]),
        ({"stable_rank_model": "teacher"}, ["stable_rank_model"]),
    ],
)
def test_bad_config_raises_naming_the_fields(tmp_path, kwargs, fields):
    with pytest.raises(ValueError) as error:
        _config(tmp_path, **kwargs)
    for field in fields:
        assert field in str(error.value), f"{field!r} not in: {error.value}"


def test_default_config_replaces_nothing(tmp_path):
    assert not _config(tmp_path).replaces_advantages
    assert _config(tmp_path, advantage_estimator="maxrl").replaces_advantages


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"reward_weighting": "lagrangian"}, "lagrange_thresholds"),
        ({"reward_weighting": "lagrangian", "lagrange_thresholds": [0.5, 0.5]}, "lagrange_thresholds"),
        ({"reward_weighting": "ctwa", "ctwa_cov_targets": [0.1, 0.2]}, "ctwa_cov_targets"),
        ({"reward_weighting": "hypervolume", "drw_maximize": [True, False]}, "drw_maximize"),
        ({"robust_reward": "brme"}, "brme_heads"),
        ({"correctness_reward_index": 3}, "correctness_reward_index"),
    ],
)
def test_trainer_checks_against_the_reward_functions(tmp_path, kwargs, field):
    """Per-reward lists must match the reward functions (one here), checked when the trainer is built."""
    model, tokenizer = build_tiny_model()
    with pytest.raises(ValueError, match=field):
        StableGRPOTrainer(
            model=model,
            reward_funcs=[arithmetic_reward],
            args=_config(tmp_path, **kwargs),
            train_dataset=arithmetic_dataset(8),
            processing_class=tokenizer,
        )


def test_plain_grpo_config_is_accepted(tmp_path):
    from trl import GRPOConfig

    model, tokenizer = build_tiny_model()
    args = GRPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to="none",
        learning_rate=0.123,
        per_device_train_batch_size=4,
        num_generations=4,
    )
    trainer = StableGRPOTrainer(
        model=model,
        reward_funcs=arithmetic_reward,
        args=args,
        train_dataset=arithmetic_dataset(8),
        processing_class=tokenizer,
    )
    assert isinstance(trainer.args, StableGRPOConfig) and trainer.args.learning_rate == 0.123
