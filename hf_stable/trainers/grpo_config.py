"""`StableGRPOConfig`: every `trl.GRPOConfig` field plus the GRPO variants, whose fields are generated from the
method declarations (`hf_stable.registry.declare_fields`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import GRPOConfig

from ..callbacks.snr_lr import LR_SCALING
from ..losses.advantages import ADVANTAGE_ESTIMATORS
from ..losses.aggregation import LOSS_AGGREGATIONS
from ..losses.jacobian import GRADIENT_AGGREGATIONS
from ..losses.length_mask import LENGTH_MASKS
from ..losses.policy import LOSS_MODES
from ..losses.reward_control import REWARD_TRANSFORMS, REWARD_WEIGHTINGS
from ..losses.stable_reinforce import ADVANTAGE_FILTERS
from ..registry import declare_fields
from ..rewards.stable_rank import INTRINSIC_REWARDS
from ..stability.config import GRPOStabilityConfigMixin
from ._base import TokenFreeConfigMixin


# The families a GRPO config selects from, in the order their rules are checked (and the card lists them).
GRPO_REGISTRIES = (
    ADVANTAGE_ESTIMATORS,
    LOSS_AGGREGATIONS,
    LOSS_MODES,
    REWARD_WEIGHTINGS,
    REWARD_TRANSFORMS,
    INTRINSIC_REWARDS,
    LR_SCALING,
    ADVANTAGE_FILTERS,
    LENGTH_MASKS,
    GRADIENT_AGGREGATIONS,
)


@dataclass
@declare_fields(*GRPO_REGISTRIES)
class StableGRPOConfig(TokenFreeConfigMixin, GRPOStabilityConfigMixin, GRPOConfig):
    r"""
    Configuration for [`StableGRPOTrainer`]: every [`~trl.GRPOConfig`] field plus the GRPO variants below. With every
    new field at its default the trainer is TRL's `GRPOTrainer`. Composition rules: one advantage estimator, one loss
    mode, one reward-weight controller; ΔL and the hypervolume multiplier stack on any estimator. Each method's own
    fields are listed after the selectors, grouped by family.

    Parameters:
        > Selectors

        advantage_estimator (`str`, *optional*, defaults to `"grpo"`):
            `"grpo"` (TRL's advantages), `"sgrpo"` (noise-aware shrinkage, arXiv 2508.05928), `"maxrl"` (maximum
            likelihood RL, arXiv 2602.02710), `"dvao"` (variance-adaptive multi-reward, arXiv 2605.25604) or `"oblr"`
            (gradient-norm-weighted baseline, arXiv 2511.23310).
        delta_l_alpha (`float`, *optional*):
            ΔL normalisation (arXiv 2509.07558): per-sample weights `L_i^-α / mean L^-α` on the advantages; needs
            `loss_type="dr_grpo"`. 1 is minimum-variance, 0.75 the paper's math setting. `None`: off.
        loss_mode (`str`, *optional*, defaults to `"ppo"`):
            `"ppo"` (TRL's surrogate for `loss_type`), `"drpo"` (decoupled reward policy optimisation, arXiv
            2510.04474) or `"onpolicy_sft"` (SFT on the model's own correct, complete samples, arXiv 2602.13407).
            Both new modes need `beta=0` and no Liger kernel, and replace the advantage estimator. `"ess"`: the
            ESS-adaptive policy loss (P3O, arXiv 1905.01756; `hf_stable.losses.ess`), with `loss_type="dapo"`.
            `"stable_reinforce"`: PPO-clip on the pre-clipped ratio (StableReinforce, arXiv 2505.02835), with TRL's
            PPO options.
        reward_weighting (`str`, *optional*, defaults to `"static"`):
            `"static"`, `"hypervolume"`, `"gradient"` (both arXiv 2509.11452), `"ctwa"` (arXiv 2602.06869),
            `"lagrangian"`, `"lagrangian_search"` (both arXiv 2310.04373) or `"pama"` (arXiv 2508.07768).
        robust_reward (`str`, *optional*):
            `"brme"`: the reward functions in `brme_heads` become one robust reward `λ·mean + (1-λ)·min` (arXiv
            2409.15360), in the first head's column.
        stable_rank_reward (`bool`, *optional*, defaults to `False`):
            Append SR-GRPO's stable-rank reward (arXiv 2512.02807) as an extra reward function.
        oblr_adaptive_lr (`bool`, *optional*, defaults to `False`):
            Scale each step's learning rate by `SNR/(1+SNR)` estimated from the micro-batch gradients (OBLR-PO, arXiv
            2511.23310; needs `gradient_accumulation_steps >= 2`). Independent of the estimator.
        advantage_filter_sigma (`float`, *optional*):
            StableReinforce's advantage filter (arXiv 2505.02835): the batch's final advantages are standardised
            (token-weighted) and those beyond this many standard deviations set to 0; 3 is the paper's. `None`: off.
        length_mask_rewards (`list[int]`, *optional*):
            Length-conditional reward masking (BalCapRL, arXiv 2605.07394): these reward columns are withheld
            (`length_mask_fill`) from completions whose length ratio to `length_mask_reference` leaves
            [`length_mask_min_ratio`, `length_mask_max_ratio`]. `None`: off.
        gradient_aggregation (`str`, *optional*, defaults to `"sum"`):
            `"sum"` (TRL's scalarised loss), `"upgrad"` (Jacobian descent, arXiv 2406.16232) or `"aligned_mtl"`
            (arXiv 2305.19000): one policy gradient per reward function, aggregated so that no reward's is opposed.
            Memory: K × (trainable parameters) × 4 bytes, refused above `jacobian_max_bytes`.
    """

    advantage_estimator: str = field(
        default="grpo", metadata={"help": "Advantage estimator: 'grpo', 'sgrpo', 'maxrl', 'dvao' or 'oblr'."}
    )
    delta_l_alpha: float | None = field(
        default=None, metadata={"help": "ΔL normalisation exponent (needs loss_type='dr_grpo'); None: off."}
    )
    loss_mode: str = field(
        default="ppo",
        metadata={"help": "Loss mode: 'ppo', 'drpo', 'onpolicy_sft', 'ess' or 'stable_reinforce'."},
    )
    reward_weighting: str = field(
        default="static",
        metadata={
            "help": "Reward-weight controller: 'static', 'hypervolume', 'gradient', 'ctwa', 'lagrangian', "
            "'lagrangian_search' or 'pama'."
        },
    )
    robust_reward: str | None = field(default=None, metadata={"help": "Reward transform: None or 'brme'."})
    stable_rank_reward: bool = field(default=False, metadata={"help": "Append the SR-GRPO stable-rank reward."})
    oblr_adaptive_lr: bool = field(default=False, metadata={"help": "Scale the LR by SNR/(1+SNR) (OBLR-PO)."})
    advantage_filter_sigma: float | None = field(
        default=None, metadata={"help": "Standardise the advantages and zero those beyond k sigma; None: off."}
    )
    length_mask_rewards: list[int] | None = field(
        default=None, metadata={"help": "Reward columns withheld outside the length band (BalCapRL); None: off."}
    )

    gradient_aggregation: str = field(
        default="sum", metadata={"help": "Per-reward gradient aggregator: 'sum', 'upgrad' or 'aligned_mtl'."}
    )

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.correctness_reward_index, str) and self.correctness_reward_index.isdigit():
            self.correctness_reward_index = int(self.correctness_reward_index)  # from YAML or the command line
        if isinstance(self.length_mask_reference, str) and self.length_mask_reference.replace(".", "", 1).isdigit():
            self.length_mask_reference = float(self.length_mask_reference)  # a number of tokens, from the CLI
        for registry in GRPO_REGISTRIES:
            registry.validate(self)

    def success_counters(self) -> list:
        """The active methods that count successes on `correctness_reward_index`."""
        active = [registry.active(self) for registry in GRPO_REGISTRIES]
        return [m for m in active if m is not None and any(f.name == "correctness_reward_index" for f in m.fields)]

    @property
    def replaces_advantages(self) -> bool:
        """Whether the trainer touches TRL's advantages (default config: no, the update is TRL's)."""
        replacing = (ADVANTAGE_ESTIMATORS, LOSS_AGGREGATIONS, LOSS_MODES, ADVANTAGE_FILTERS)
        changed = any(r.active(self) is not None for r in replacing)
        return changed or REWARD_WEIGHTINGS.get(self.reward_weighting).fn.adaptive
