"""`StableSFTConfig`: every `trl.SFTConfig` field plus the SFT objectives, whose fields are generated from the method
declarations (`hf_stable.registry.declare_fields`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from trl import SFTConfig

from ..losses.sft import SFT_OBJECTIVES, SFT_SAMPLE_REWEIGHTING, SFT_SEQUENCE_OBJECTIVES, parse_auto_rule
from ..registry import declare_fields
from ..stability.config import StabilityConfigMixin
from ._base import TokenFreeConfigMixin


# The families an SFT config selects from, in the order their rules are checked (and the card lists them).
SFT_REGISTRIES = (SFT_OBJECTIVES, SFT_SEQUENCE_OBJECTIVES, SFT_SAMPLE_REWEIGHTING)


@dataclass
@declare_fields(*SFT_REGISTRIES)
class StableSFTConfig(TokenFreeConfigMixin, StabilityConfigMixin, SFTConfig):
    r"""
    Configuration for [`StableSFTTrainer`]: every [`~trl.SFTConfig`] field, plus the objectives below. With every new
    field at its default the trainer is TRL's `SFTTrainer`. Each objective's own fields are listed after the
    selectors, grouped by family.

    Parameters:
        > Selectors

        sft_objective (`str`, *optional*, defaults to `"nll"`):
            Per-token objective (Li et al., "Beyond Log Likelihood", arXiv 2510.00526): `"nll"` (`-log p`),
            `"prob_power"` (`(1-p^α)/α`), `"threshold"` (a thresholded variant, see `threshold_kind`) or `"auto"`
            (probe the base model's token probabilities on the training data and pick `prob_power` with α=1 in the
            model-strong regime, `nll` otherwise; hf_stable's rule, experimental).
        sequence_objective (`str`, *optional*):
            `"redi"` (REDI, arXiv 2505.24850): `-c⁺·ℓ̄(y⁺) + α·ℓ̄(y⁻)` with `ℓ̄` the length-normalised
            log-likelihood. The dataset has `prompt`/`chosen`/`rejected` columns (pairs) or
            `prompt`/`completion`/`redi_sign` (±1) columns.
        sample_reweighting (`str`, *optional*):
            `"feasible"` (Feasible Learning, arXiv 2501.14912): each sample i gets a multiplier λ_i, the loss is
            `mean_i λ_i ℓ_i` with ℓ_i the sample's length-normalised per-token loss, and λ_i follows projected dual
            ascent on `ℓ_i ≤ ε`.
    """

    sft_objective: str = field(
        default="nll", metadata={"help": "Per-token objective: 'nll', 'prob_power', 'threshold' or 'auto'."}
    )
    sequence_objective: str | None = field(
        default=None, metadata={"help": "Sequence objective: None or 'redi' (reinforcement distillation)."}
    )
    sample_reweighting: str | None = field(
        default=None, metadata={"help": "Per-sample reweighting: None or 'feasible' (Feasible Learning)."}
    )

    def __post_init__(self):
        super().__post_init__()
        self.auto_rule = parse_auto_rule(self.auto_rule)
        for registry in SFT_REGISTRIES:
            registry.validate(self)
        if self.sft_objective == "threshold" and (self.threshold is None) == (self.threshold_quantile is None):
            raise ValueError("sft_objective='threshold' needs exactly one of `threshold` or `threshold_quantile`.")
        if self.sft_objective != "threshold" and (self.threshold is not None or self.threshold_quantile is not None):
            raise ValueError(
                "`threshold`/`threshold_quantile` only apply to sft_objective='threshold', got "
                f"{self.sft_objective!r}."
            )
        if self.threshold_normalization is None:
            self.threshold_normalization = (
                "active" if self.sft_objective == "threshold" and not self.per_sample else "supervised"
            )

    @property
    def owns_loss(self) -> bool:
        """Whether hf_stable computes the loss (otherwise TRL's own `compute_loss` runs unchanged)."""
        return not (
            self.sft_objective == "nll" and self.sequence_objective is None and self.sample_reweighting is None
        )

    @property
    def per_sample(self) -> bool:
        return self.sequence_objective is not None or self.sample_reweighting is not None

    @property
    def needs_probe(self) -> bool:
        return self.sft_objective == "auto" or self.threshold_quantile is not None

    @property
    def feasibility_epsilon(self) -> float:
        return -math.log(self.fl_target_prob) if self.fl_target_prob is not None else self.fl_epsilon
