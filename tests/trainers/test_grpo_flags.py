"""The flag-effect matrix of `StableGRPOConfig`: every field that `trl.GRPOConfig` does not define, with a method that
reads it active, either changes the parameter update of a short run or is refused at construction with a message
naming it.

The field list is generated from the dataclass, so a new field without a case here fails
`test_every_grpo_field_is_covered`. A case's base is the reader's activation (`Registry.activation`, from the
declarations) plus `BASES` (runs long enough for the field to act: a controller's weights apply from the next
generation, a trust region only acts off-policy); its alternative value is in `ALTERNATIVES`.
"""

import dataclasses

import pytest
from flag_helpers import added_fields, assert_changes_or_refused, assert_covered, reader_activation
from grpo_helpers import G, grpo_run, length_reward
from trl import GRPOConfig

from hf_stable import StableGRPOConfig
from hf_stable.stability.config import GRPOStabilityConfigMixin
from hf_stable.testing import arithmetic_reward
from hf_stable.trainers.grpo_config import GRPO_REGISTRIES


FIELDS = added_fields(StableGRPOConfig, GRPOConfig)

ALTERNATIVES = {
    # selectors
    "advantage_estimator": "maxrl",
    "loss_mode": "drpo",
    "reward_weighting": "ctwa",
    "robust_reward": "brme",
    "stable_rank_reward": True,
    "oblr_adaptive_lr": True,
    "delta_l_alpha": 1.0,
    "advantage_filter_sigma": 3.0,
    "gradient_aggregation": "upgrad",
    "jacobian_max_bytes": 1000,  # a Jacobian above 1000 bytes is refused by name
    # shared by the success-counting methods
    "correctness_reward_index": 1,
    "success_threshold": -1.0,
    # estimators
    "sgrpo_noise_p": 0.3,
    "maxrl_truncation": 1,
    "maxrl_baseline": "none",
    "maxrl_adv_clip": 0.5,
    "dvao_sigma_power": 2.0,
    "oblr_norm_proxy": "uniform",
    "oblr_loo": False,
    "oblr_scale": "group",
    # ΔL
    "delta_l_scope": "group",
    "delta_l_max_weight": 1.0,
    # loss modes
    "drpo_lambda": 1.0,
    "drpo_tau": 0.1,
    "drpo_delta": 10.0,
    "drpo_beta": 1.0,
    "drpo_kl_type": "k3",
    "drpo_neg_weighting": "uniform",
    "osft_require_eos": False,
    "osft_norm": "constant",
    "ess_level": "sequence",
    "sr_ratio_bound": 1.05,
    # controllers and transforms
    "ctwa_cov_targets": [0.9, 0.0],
    "ctwa_lambda_lr": 0.5,
    "ctwa_ema_tau": 0.9,
    "ctwa_use_corr": False,
    "ctwa_obj_targets": [-10.0, -10.0],
    "ctwa_max_log_weight": -1.0,
    "lagrange_thresholds": [None, -10.0],
    "lagrange_lr": 1.0,
    "drw_regularization": 1e-3,
    "drw_target_params": r"layers\.1\.mlp",
    "drw_every_n_steps": 2,
    "drw_maximize": [False, True],
    "drw_eval_every": 2,
    "drw_val_size": 2,
    "brme_lambda": 0.0,
    "brme_heads": [1, 0],
    "stable_rank_weight": 5.0,
    "stable_rank_model": "policy",
    "stable_rank_normalize": "by_T",
    "stable_rank_hidden": "after_norm",
    "oblr_lr_min_ratio": 0.9,
    "oblr_snr_ema": 0.0,
    "oblr_snr_params": r"embed_tokens",
    # length-conditional reward masking (the base masks the correctness reward beyond 4 tokens)
    "length_mask_rewards": [1],
    "length_mask_reference": 2,
    "length_mask_min_ratio": 0.9,
    "length_mask_max_ratio": 2.0,
    "length_mask_fill": -1.0,
    # PAMA
    "pama_positive_part": False,
    "pama_scale": "group",
    "pama_ema": 0.5,
}
# Fields that change neither the update nor a refusal: one reason each.
ALLOWLIST: dict[str, str] = {
    f.name: "a stability field: its effect is tested in tests/stability/test_stability_config_flags.py"
    for f in dataclasses.fields(GRPOStabilityConfigMixin)
}

_TWO_STEPS = {"max_steps": 2}
_THREE_STEPS = {"max_steps": 3}
_OFF_POLICY = {"max_steps": 2, "steps_per_generation": 2}  # the second step reuses the generation: π_old ≠ π
BASES = {
    # selectors: the base is TRL's default; the alternative turns the method on
    "advantage_estimator": {"correctness_reward_index": 0},
    "loss_mode": {"correctness_reward_index": 0},
    "reward_weighting": {"_rewards": "conflict", **_THREE_STEPS},
    "delta_l_alpha": {"loss_type": "dr_grpo"},
    "oblr_adaptive_lr": {"gradient_accumulation_steps": 2},
    "gradient_aggregation": {"_rewards": "conflict"},  # the rewards' gradients conflict: UPGrad projects
    "correctness_reward_index": {"correctness_reward_index": 0},
    "drpo_delta": _OFF_POLICY,
    "drpo_beta": _OFF_POLICY,
    "drpo_kl_type": _OFF_POLICY,
    "ess_level": _OFF_POLICY,
    "sr_ratio_bound": _OFF_POLICY,
    "brme_heads": {"reward_weights": [1.0, 0.5]},
    # mean length reward ≈ -0.2 is above -0.5: the multiplier rises from the first generation
    "lagrange_thresholds": {"lagrange_thresholds": [None, -0.5], **_TWO_STEPS},
    "lagrange_lr": {"lagrange_thresholds": [None, -0.5], **_TWO_STEPS},
    # correct = at most 2 characters: the correct answers of a group differ in length, so λ matters
    "drpo_lambda": {"correctness_reward_index": 1, "success_threshold": -0.25},
    "drw_regularization": {"learning_rate": 1e-6, **_TWO_STEPS},
    "drw_target_params": {"learning_rate": 1e-6, **_TWO_STEPS},
    "drw_every_n_steps": {"learning_rate": 1e-6, **_THREE_STEPS},
    "drw_maximize": {"_rewards": "rising", **_THREE_STEPS},
    "drw_eval_every": _THREE_STEPS,
    "drw_val_size": {"_rewards": "rising", **_THREE_STEPS},
    "stable_rank_model": _TWO_STEPS,
    # the embeddings' SNR is non-zero from the second step on this task
    "oblr_snr_ema": {
        "max_steps": 3,
        "gradient_accumulation_steps": 2,
        "oblr_lr_min_ratio": 1e-6,
        "oblr_snr_params": "embed",
    },
    "oblr_lr_min_ratio": {"gradient_accumulation_steps": 2},
    "length_mask_rewards": {"length_mask_reference": 2},
    # the completions beyond 4 tokens are wrong (reward 0): a fill of -1 makes withholding their reward visible
    "length_mask_max_ratio": {"length_mask_fill": -1.0},
    "oblr_snr_params": {"gradient_accumulation_steps": 2, "oblr_lr_min_ratio": 1e-6, **_TWO_STEPS},
}
# every case of a controller's field runs long enough for its weights to act
# (on a conflict: correct answers are the rollout's shortest, a reward for length under-serves one objective)
for _name in ("ctwa_cov_targets", "ctwa_lambda_lr", "ctwa_ema_tau", "ctwa_obj_targets"):
    BASES[_name] = {"_rewards": "conflict", **_THREE_STEPS}
BASES["ctwa_max_log_weight"] = {"_rewards": "conflict", **_TWO_STEPS}
BASES["ctwa_ema_tau"] = {"_rewards": "conflict", "max_steps": 4}  # the first two correlations coincide here
BASES["ctwa_use_corr"] = {"ctwa_cov_targets": [0.3, 0.3], **_THREE_STEPS}  # covariances need explicit targets
# PAMA's weights act from the second generation, its EMA from the third
for _name in ("pama_positive_part", "pama_scale", "pama_ema"):
    BASES[_name] = {"_rewards": "conflict", **_THREE_STEPS}


class _HeldOut:
    """The threshold search's held-out reward (weight 0): on a validation set of more than 8 prompts it rises with
    every call, on fewer it falls, so `lagrange_search_val_size` decides which vertex scores best."""

    __name__ = "held_out"

    def __init__(self):
        self.calls = 0

    def __call__(self, completions, **kwargs):
        self.calls += 1
        return [float((len(completions) - 8) * self.calls)] * len(completions)


# the length reward's mean (about -0.2) exceeds each threshold tried: the multiplier moves with the thresholds, which
# apply from the generation after the validation that proposed them (steps 1, 2: the initial simplex -0.5, -0.3)
_SEARCH = {
    "reward_funcs": (arithmetic_reward, length_reward, _HeldOut()),
    "reward_weights": [1.0, 1.0, 0.0],
    "lagrange_thresholds": [None, -0.5, None],
    "lagrange_lr": 1.0,
    "lagrange_search_objective": 2,
    "lagrange_search_step": [None, 0.2, None],
}
ALTERNATIVES.update(
    {
        "lagrange_search_objective": 0,  # a trained reward: refused
        "lagrange_search_step": [None, 0.4, None],
        "lagrange_search_period": 2,
        "lagrange_search_eval_every": 2,
        "lagrange_search_high": [None, -0.4, None],  # the second vertex -0.3 is reflected to -0.5
        "lagrange_search_val_size": 2,  # the first vertex scores best: the reflection goes down, not up
        "lagrange_search_low": [None, -0.6, None],  # clips that reflection, -0.7
        "lagrange_search_xtol": 1.0,  # stops after the initial simplex, holding its best vertex
    }
)
for _name in ("lagrange_search_objective", "lagrange_search_step", "lagrange_search_period"):
    BASES[_name] = {**_SEARCH, **_THREE_STEPS}
BASES["lagrange_search_eval_every"] = BASES["lagrange_search_high"] = {**_SEARCH, **_THREE_STEPS}
BASES["lagrange_search_val_size"] = BASES["lagrange_search_xtol"] = {**_SEARCH, "max_steps": 4}
BASES["lagrange_search_low"] = {**_SEARCH, "lagrange_search_val_size": 2, "max_steps": 4}


def long_reward(completions, **kwargs):
    return [0.1 * len(c) for c in completions]


class _Rising:
    """A reward that rises with every call and with the batch size: greedy validation means then improve on every
    objective, so the hypervolume contribution (0 unless a point dominates the reference on every objective) acts."""

    def __init__(self, name, scale):
        self.__name__, self.scale, self.calls = name, scale, 0

    def __call__(self, completions, **kwargs):
        self.calls += 1
        return [self.scale * (self.calls + 0.1 * len(completions) + 0.01 * len(c)) for c in completions]


def _case(field: str) -> tuple[dict, object]:
    base = {"correctness_reward_index": 0, **reader_activation(GRPO_REGISTRIES, field), **BASES.get(field, {})}
    return base, ALTERNATIVES[field]


def test_every_grpo_field_is_covered():
    """A field without a case (or an allowlist entry with its reason) fails here."""
    assert_covered(FIELDS, ALTERNATIVES, ALLOWLIST, "StableGRPOConfig")


def _update(tmp_path, config):
    config = dict(config)
    rewards = config.pop("_rewards", None)
    if rewards == "rising":
        config["reward_funcs"] = (_Rising("rising_a", 1.0), _Rising("rising_b", 0.5))
    elif rewards == "conflict":
        config["reward_funcs"] = (arithmetic_reward, long_reward)
    grad_accum = config.pop("gradient_accumulation_steps", 1)
    delta, _ = grpo_run(tmp_path, batch_size=2 * G // grad_accum, grad_accum=grad_accum, **config)
    return delta


@pytest.mark.slow
@pytest.mark.parametrize("field", [f for f in FIELDS if f not in ALLOWLIST])
def test_changing_a_grpo_field_changes_the_update_or_is_refused(tmp_path, field):
    base, value = _case(field)
    default = getattr(StableGRPOConfig, field, None)
    assert_changes_or_refused(lambda name, config: _update(tmp_path / name, config), field, base, value, default)
