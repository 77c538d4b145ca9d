"""Pure SFT objectives: the probability family, its thresholded variants, REDI and Feasible Learning.

Everything here is a torch-only function of tensors (no transformers/trl imports), so it is unit-tested without a
model. Conventions:

* ``log_probs`` `(B, T)`: log-probability of each supervised next token, as TRL's fused LM head returns it
  (`FusedCausalLMOutput.log_probs`). Any dtype; every transform runs in fp32.
* ``mask`` `(B, T)`: which positions are supervised targets (`label_mask`). Positions outside it never contribute,
  whatever value ``log_probs`` holds there.
* Per-token objectives return ``(per_token_loss, active)``, both `(B, T)`: the loss is zero (and keeps the graph) where
  ``active`` is False, so a batch without an active token yields a finite zero that still backpropagates.

Reductions across micro-batches and processes are the trainer's job (see `hf_stable.trainers.sft`). The per-token
objectives are here; REDI and Feasible Learning are in `sft_sequence`, the `auto` probe in `sft_probe`, and every
public name of the three is importable from this module.
"""

from __future__ import annotations

import json
import math

import torch

from .._validation import choice, integer, number
from ..papers import PAPERS
from ..registry import Field, Registry, Requires
from .sft_probe import DEFAULT_AUTO_RULE, PROBE_QUANTILES, choose_objective, probe_statistics, quantile
from .sft_sequence import (
    SFT_SAMPLE_REWEIGHTING,
    SFT_SEQUENCE_OBJECTIVES,
    FeasibleLearning,
    feasible_dual_update,
    redi_loss,
    redi_terms,
    sequence_mean,
    sequence_sums,
)


SFT_OBJECTIVES = Registry("sft_objective", "per-token SFT objectives of the probability family")
SFT_THRESHOLDS = Registry(
    "sft_threshold",
    "thresholded per-token objectives (mask from the detached probability)",
    selector="threshold_kind",
)


_BEYOND_LL = PAPERS["beyond_ll"]
# TRL's `loss_type="dft"` rewrites the NLL; combined with another objective it would be applied twice.
_NOT_DFT = Requires(
    "loss_type",
    lambda value: value != "dft",
    "DFT is sft_objective='prob_power' with objective_alpha=1; keep loss_type='nll'",
    fix="nll",
)

# Below this α, (1 - p^α)/α is -log p to within fp32 rounding.
_ALPHA_IS_ZERO = 1e-12

# Added inside the unlikelihood log so that p -> 1 stays finite (the reference code's constant).
UNLIKELIHOOD_EPS = 1e-3


def _prepare(log_probs: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if log_probs.shape != mask.shape:
        raise ValueError(f"log_probs {tuple(log_probs.shape)} and mask {tuple(mask.shape)} must have the same shape.")
    mask = mask.bool()
    # Unsupervised positions may hold anything (-inf, NaN); filling them cuts them out of the backward pass too.
    return log_probs.float().masked_fill(~mask, 0.0), mask


def _masked(loss: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    # `where`, not multiplication: an inactive position may hold -inf/NaN transforms, and 0 * inf is NaN.
    return torch.where(active, loss, torch.zeros((), dtype=loss.dtype, device=loss.device))


@SFT_OBJECTIVES.register(
    "nll",
    paper="Negative log-likelihood (standard SFT, TRL loss_type='nll')",
    url="https://huggingface.co/docs/trl/sft_trainer",
)
def nll_loss(log_probs: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token `-log p`.

    Args:
        log_probs (`torch.Tensor` of shape `(B, T)`): log-probability of each target token.
        mask (`torch.Tensor` of shape `(B, T)`): supervised positions.

    Returns:
        `(per_token_loss, active)`, both `(B, T)`; ``active`` equals ``mask``.
    """
    log_probs, mask = _prepare(log_probs, mask)
    return _masked(-log_probs, mask), mask


@SFT_OBJECTIVES.register(
    "prob_power",
    paper=_BEYOND_LL,
    description="the probability family `(1 - p^α)/α`",
    fields=[
        Field(
            "objective_alpha",
            1.0,
            'α ≥ 0 of `prob_power`: 0 is NLL, 1 is "-p" (gradient-identical to TRL\'s `loss_type="dft"`), 10 is '
            '"-p^10".',
            check=number(low=0),
            param="alpha",
        )
    ],
    requires=[_NOT_DFT],
)
def prob_power_loss(
    log_probs: torch.Tensor, mask: torch.Tensor, alpha: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token `(1 - p^α) / α`, the probability family of Li et al. (arXiv 2510.00526).

    α = 0 is NLL (`-log p`), α = 1 is `1 - p` (the paper's "-p", gradient-identical to DFT), α = 10 is "-p^10".
    Its logit gradient is NLL's scaled by `p^α`, so large α ignores tokens the model does not already believe.
    Computed as `-expm1(α log p) / α` in fp32: the naive form cancels catastrophically for small α.

    Args:
        log_probs (`torch.Tensor` of shape `(B, T)`): log-probability of each target token.
        mask (`torch.Tensor` of shape `(B, T)`): supervised positions.
        alpha (`float`, defaults to `1.0`): the power α ≥ 0.

    Returns:
        `(per_token_loss, active)`, both `(B, T)`; ``active`` equals ``mask``.
    """
    if not alpha >= 0 or math.isinf(alpha):
        raise ValueError(f"alpha must be a finite number >= 0, got {alpha}.")
    log_probs, mask = _prepare(log_probs, mask)
    if alpha < _ALPHA_IS_ZERO:  # the α -> 0 limit; α log p would underflow and give 0/0
        return _masked(-log_probs, mask), mask
    x = alpha * log_probs
    # Value from expm1 (exact for small α); gradient -p^α from exp: autograd's expm1 backward, grad·(expm1(x) + 1),
    # cancels in fp32 and zeroes weights below ~3e-8.
    weight = torch.exp(x)
    loss = (-torch.expm1(x) / alpha).detach() - (weight - weight.detach()) / alpha
    return _masked(loss, mask), mask


def _threshold_objective(kind: str, keep_high: bool, per_token):
    def objective(log_probs: torch.Tensor, mask: torch.Tensor, threshold: float) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"threshold must be a probability in [0, 1], got {threshold}.")
        log_probs, mask = _prepare(log_probs, mask)
        p = log_probs.detach().exp()  # the mask carries no gradient
        active = mask & ((p >= threshold) if keep_high else (p <= threshold))
        return _masked(per_token(log_probs), active), active

    objective.__name__ = f"{kind}_loss"
    objective.__doc__ = (
        f"Thresholded objective ``{kind}`` of Li et al. (arXiv 2510.00526): the per-token loss is kept where the "
        f"detached probability is {'>=' if keep_high else '<='} ``threshold`` and zero elsewhere.\n\n"
        "Args:\n    log_probs (`torch.Tensor` of shape `(B, T)`)\n    mask (`torch.Tensor` of shape `(B, T)`)\n"
        "    threshold (`float` in [0, 1])\n\nReturns:\n    `(per_token_loss, active)`, both `(B, T)`."
    )
    return objective


def _one_minus_p(log_probs):
    return -torch.expm1(log_probs)


def _neg_log_p(log_probs):
    return -log_probs


def _log_one_minus_p(log_probs):
    # log(1 - p + eps) with 1 - p from expm1: exact near p = 1, finite at p = 1. Minimising it still raises p.
    return torch.log(-torch.expm1(log_probs) + UNLIKELIHOOD_EPS)


_THRESHOLD_KINDS = {
    "top_p": (True, _one_minus_p, "OnlyTopP: (1-p) on tokens with p >= q"),
    "bottom_p": (False, _one_minus_p, "OnlyBottomP: (1-p) on tokens with p <= q"),
    "top_logp": (True, _neg_log_p, "OnlyTopLogP: -log p on tokens with p >= q"),
    "bottom_logp": (False, _neg_log_p, "OnlyBottomLogP: -log p on tokens with p <= q"),
    "unlikelihood_top": (True, _log_one_minus_p, "UnlikehoodTop: log(1-p+1e-3) on tokens with p >= q"),
    "unlikelihood_bottom": (False, _log_one_minus_p, "UnlikehoodBottom: log(1-p+1e-3) on tokens with p <= q"),
}
for _kind, (_high, _fn, _desc) in _THRESHOLD_KINDS.items():
    SFT_THRESHOLDS.register(_kind, paper=_BEYOND_LL, description=_desc)(_threshold_objective(_kind, _high, _fn))


def _check_auto_rule(name: str, value) -> None:
    if value is None:
        return
    if not isinstance(value, dict):
        raise TypeError(f"`{name}` must be a mapping (or its JSON string), got {value!r}.")
    unknown = set(value) - set(DEFAULT_AUTO_RULE)
    if unknown:
        raise ValueError(f"`{name}` keys must be among {sorted(DEFAULT_AUTO_RULE)}, got {sorted(unknown)}.")
    for key, number_value in value.items():
        number(low=0, high=1)(f"{name}.{key}", number_value)


def parse_auto_rule(value):
    """`auto_rule` as given on the command line or in YAML (a JSON string) or in Python (a mapping)."""
    return json.loads(value) if isinstance(value, str) else value


# Read by `auto` and by `threshold` with a `threshold_quantile`: both probe the base model before training.
PROBE_FIELD = Field(
    "auto_probe_batches",
    32,
    "Training batches (per process) the base-model probe reads for `auto` and `threshold_quantile`.",
    check=integer(low=1),
)


@SFT_OBJECTIVES.register(
    "threshold",
    paper=_BEYOND_LL,
    description="a thresholded variant of the family",
    fields=[
        Field(
            "threshold_kind",
            "top_p",
            'Which thresholded objective: a name of the `sft_threshold` family (`"top_p"`, `"bottom_p"`, '
            '`"top_logp"`, `"bottom_logp"`, `"unlikelihood_top"` or `"unlikelihood_bottom"`).',
            check=choice(*SFT_THRESHOLDS.names()),
            param="kind",
        ),
        Field(
            "threshold",
            None,
            "Absolute probability threshold in [0, 1] of the thresholded objective.",
            check=number(low=0, high=1, allow_none=True),
            param="threshold",
            type=float | None,
        ),
        Field(
            "threshold_quantile",
            None,
            "Instead of `threshold`: this quantile (in [0, 1]) of the base model's supervised-token probabilities, "
            "measured by the probe before training and then frozen (how the paper set its thresholds).",
            check=number(low=0, high=1, allow_none=True),
            type=float | None,
        ),
        Field(
            "threshold_normalization",
            None,
            '`"active"` divides by the number of tokens kept by the threshold, `"supervised"` by all supervised '
            'tokens; both are exact over gradient accumulation and processes. Default: `"active"` (the paper\'s).',
            check=choice(None, "supervised", "active"),
            type=str | None,
        ),
        PROBE_FIELD,
    ],
    requires=[_NOT_DFT],
    example={"threshold": 0.5},
)
def threshold_loss(
    log_probs: torch.Tensor, mask: torch.Tensor, kind: str = "top_p", *, threshold: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch to the thresholded objective ``kind`` (a name of the ``sft_threshold`` registry)."""
    return SFT_THRESHOLDS.get(kind)(log_probs, mask, threshold=threshold)


def token_weight(log_probs: torch.Tensor, alpha: float) -> torch.Tensor:
    """Logit-gradient weight `p^α` of the probability family relative to NLL (`(B, T)` -> `(B, T)`, fp32)."""
    return torch.exp(alpha * log_probs.float())


SFT_OBJECTIVES.declare(
    "auto",
    paper=_BEYOND_LL,
    description="probe the base model's token probabilities and pick `prob_power` (α=1) or `nll` "
    "(hf_stable's rule, experimental; see `choose_objective`)",
    fields=[
        PROBE_FIELD,
        Field(
            "auto_rule",
            None,
            "Thresholds of the `auto` rule, keys `strong_median` (0.9), `strong_p20` (0.0: off), `weak_median` (0.3).",
            check=_check_auto_rule,
            type=dict | str | None,
        ),
    ],
    requires=[_NOT_DFT],
)


__all__ = [
    "DEFAULT_AUTO_RULE",
    "PROBE_FIELD",
    "PROBE_QUANTILES",
    "SFT_OBJECTIVES",
    "SFT_SAMPLE_REWEIGHTING",
    "SFT_SEQUENCE_OBJECTIVES",
    "SFT_THRESHOLDS",
    "UNLIKELIHOOD_EPS",
    "FeasibleLearning",
    "choose_objective",
    "feasible_dual_update",
    "nll_loss",
    "parse_auto_rule",
    "prob_power_loss",
    "probe_statistics",
    "quantile",
    "redi_loss",
    "redi_terms",
    "sequence_mean",
    "sequence_sums",
    "threshold_loss",
    "token_weight",
]
