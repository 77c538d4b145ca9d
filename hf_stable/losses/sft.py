"""Pure SFT objectives: the probability family, its thresholded variants, REDI and Feasible Learning.

Everything here is a torch-only function of tensors (no transformers/trl imports), so it is unit-tested without a
model. Conventions:

* ``log_probs`` `(B, T)`: log-probability of each supervised next token, as TRL's fused LM head returns it
  (`FusedCausalLMOutput.log_probs`). Any dtype; every transform runs in fp32.
* ``mask`` `(B, T)`: which positions are supervised targets (`label_mask`). Positions outside it never contribute,
  whatever value ``log_probs`` holds there.
* Per-token objectives return ``(per_token_loss, active)``, both `(B, T)`: the loss is zero (and keeps the graph) where
  ``active`` is False, so a batch without an active token yields a finite zero that still backpropagates.

Reductions across micro-batches and processes are the trainer's job (see `hf_stable.trainers.sft`).
"""

from __future__ import annotations

import json
import math
import warnings

import torch

from .._validation import choice, integer, number
from ..papers import PAPERS
from ..registry import Field, Registry, Requires


SFT_OBJECTIVES = Registry("sft_objective", "per-token SFT objectives of the probability family")
SFT_THRESHOLDS = Registry(
    "sft_threshold",
    "thresholded per-token objectives (mask from the detached probability)",
    selector="threshold_kind",
)
SFT_SEQUENCE_OBJECTIVES = Registry(
    "sft_sequence_objective",
    "signed, length-normalised sequence objectives",
    selector="sequence_objective",
    builtin=(None,),
)
SFT_SAMPLE_REWEIGHTING = Registry(
    "sft_sample_reweighting",
    "per-sample loss weights learned while training",
    selector="sample_reweighting",
    builtin=(None,),
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


# ---------------------------------------------------------------------------------------------------------------------
# Per-sequence reductions


def sequence_sums(
    values: torch.Tensor,
    mask: torch.Tensor,
    seq_idx: torch.Tensor | None = None,
    num_sequences: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence sums of ``values`` over ``mask`` and per-sequence counts of ``mask``.

    Args:
        values (`torch.Tensor` of shape `(B, T)`): per-token values.
        mask (`torch.Tensor` of shape `(B, T)`): positions to include.
        seq_idx (`torch.Tensor` of shape `(B, T)`, *optional*): sequence index of each position, for padding-free
            batches where several sequences share a row (TRL's collator `seq_idx`, shifted like the labels). Without
            it, each row is one sequence.
        num_sequences (`int`, *optional*): number of sequences S when ``seq_idx`` is given (default: max + 1).

    Returns:
        `(sums, counts)`, both of shape `(S,)` (S = B without ``seq_idx``); ``sums`` is fp32.
    """
    mask = mask.bool()
    values = torch.where(mask, values.float(), 0.0)  # not values * mask: -inf * 0 is NaN
    weights = mask.to(values.dtype)
    if seq_idx is None:
        return values.sum(-1), weights.sum(-1)
    seq_idx = seq_idx.long().reshape(-1)
    n = int(seq_idx.max().item()) + 1 if num_sequences is None else num_sequences
    sums = values.new_zeros(n).index_add(0, seq_idx, values.reshape(-1))
    counts = values.new_zeros(n).index_add(0, seq_idx, weights.reshape(-1))
    return sums, counts


def sequence_mean(values, mask, seq_idx=None, num_sequences=None) -> torch.Tensor:
    """Length-normalised per-sequence mean `Σ_t v_t m_t / max(Σ_t m_t, 1)`, shape `(S,)`."""
    sums, counts = sequence_sums(values, mask, seq_idx, num_sequences)
    return sums / counts.clamp(min=1)


# ---------------------------------------------------------------------------------------------------------------------
# REDI


# Per-sample objectives read whole examples (their own columns) and average each over its supervised tokens.
_PER_SAMPLE = (
    Requires(
        "packing",
        lambda value: not value,
        "packing drops per-example columns (TRL keeps only input_ids/labels when packing); set packing=False "
        "(padding_free=True still works)",
        fix=False,
    ),
    Requires(
        "threshold_normalization",
        lambda value: value != "active",
        "per-sample objectives average each sample over its supervised tokens; leave it unset",
        fix=None,
    ),
)


@SFT_SEQUENCE_OBJECTIVES.register(
    "redi",
    paper=PAPERS["redi"],
    description="REDI `-c⁺·ℓ̄(y⁺) + α·ℓ̄(y⁻)` over length-normalised log-likelihoods",
    fields=[
        Field("redi_pos_weight", 1.0, "c⁺, weight of positive sequences.", check=number(low=0), param="pos_weight"),
        Field(
            "redi_neg_weight",
            0.8,
            "α, weight of negative sequences; the paper keeps it below `redi_pos_weight` for stability.",
            check=number(low=0),
            param="neg_weight",
        ),
        Field(
            "redi_neg_weighting_gamma",
            None,
            "If set, negative terms are multiplied by `exp(γ·ℓ̄(y⁻))`, damping the push on already unlikely negatives.",
            check=number(allow_none=True),
            param="neg_gamma",
            type=float | None,
        ),
        Field(
            "redi_reduction",
            None,
            '`"pair"` (divide by the number of pairs, as the reference) or `"sequence"`. Default: `"pair"` for '
            'paired data and `"sequence"` for a `redi_sign` column.',
            check=choice(None, "pair", "sequence"),
            type=str | None,
        ),
    ],
    requires=[
        Requires(
            "sft_objective",
            lambda value: value == "nll",
            "REDI is defined on log-likelihoods; set sft_objective='nll'",
            fix="nll",
        ),
        Requires("sample_reweighting", lambda value: value is None, "choose one per-sample objective", fix=None),
        *_PER_SAMPLE,
    ],
)
def redi_terms(
    seq_logp_mean: torch.Tensor,
    sign: torch.Tensor,
    pos_weight: float = 1.0,
    neg_weight: float = 0.8,
    neg_gamma: float | None = None,
) -> torch.Tensor:
    """Per-sequence REDI terms: `-c⁺ ℓ̄(y)` for positives and `α ℓ̄(y)` for negatives (arXiv 2505.24850).

    `ℓ̄(y) = (1/|y|) Σ_t log π(y_t | x, y_<t)` is the length-normalised log-likelihood. With ``neg_gamma`` the negative
    term is multiplied by `exp(γ ℓ̄(y⁻))` (not detached), damping the push once a negative is already unlikely — the
    reference's optional `use_neg_weighting`. No reference model, no sigmoid.

    Args:
        seq_logp_mean (`torch.Tensor` of shape `(S,)`): ℓ̄ of each sequence.
        sign (`torch.Tensor` of shape `(S,)`): +1 positive, -1 negative, 0 ignored.
        pos_weight (`float`, defaults to `1.0`): c⁺.
        neg_weight (`float`, defaults to `0.8`): α; keep α < c⁺ (the paper's stability condition).
        neg_gamma (`float`, *optional*): γ of the negative weighting.

    Returns:
        `torch.Tensor` of shape `(S,)`, fp32; sum it and divide by the number of pairs (or sequences).
    """
    ell = seq_logp_mean.float()
    sign = sign.to(ell.device)
    neg = neg_weight * ell
    if neg_gamma is not None:
        neg = neg * torch.exp(neg_gamma * ell)
    zero = torch.zeros((), dtype=ell.dtype, device=ell.device)
    return torch.where(sign > 0, -pos_weight * ell, torch.where(sign < 0, neg, zero))


def redi_loss(
    seq_logp_mean: torch.Tensor,
    sign: torch.Tensor,
    pos_weight: float = 1.0,
    neg_weight: float = 0.8,
    neg_gamma: float | None = None,
    reduction: str = "pair",
) -> torch.Tensor:
    """REDI loss of one batch: summed [`redi_terms`] over the number of pairs (``"pair"``, a pair being a positive and
    a negative sequence, as the reference averages) or of sequences (``"sequence"``). Scalar, fp32. (The trainer
    divides the same terms by step-wide counts instead; this is the one-batch reference.)"""
    if reduction not in ("pair", "sequence"):
        raise ValueError(f"reduction must be 'pair' or 'sequence', got {reduction!r}.")
    terms = redi_terms(seq_logp_mean, sign, pos_weight, neg_weight, neg_gamma)
    n = (sign != 0).sum().float()
    if reduction == "pair":
        n = n / 2
    return terms.sum() / n.clamp(min=1)


# ---------------------------------------------------------------------------------------------------------------------
# Feasible Learning


def feasible_dual_update(
    multipliers: torch.Tensor,
    losses: torch.Tensor,
    epsilon: float,
    dual_lr: float = 1.0,
    rho: float | None = 2.0,
) -> torch.Tensor:
    """Projected dual ascent on per-sample multipliers (Feasible Learning, arXiv 2501.14912).

    `λ_i ← max(0, λ_i + η (ℓ_i − ε − λ_i/ρ))`; the `λ_i/ρ` decay is Resilient FL's minimal-norm slack
    (`s_i = λ_i/ρ`), and ``rho=None`` drops it (hard FL). The primal loss of the same step uses the old `λ_i`.

    Args:
        multipliers (`torch.Tensor` of shape `(N,)`): current `λ_i` of the samples in the batch.
        losses (`torch.Tensor` of shape `(N,)`): their per-sample losses `ℓ_i` (detached here).
        epsilon (`float`): the per-sample loss bound ε.
        dual_lr (`float`, defaults to `1.0`): η.
        rho (`float`, *optional*, defaults to `2.0`): ρ of Resilient FL; `None` for hard FL.

    Returns:
        `torch.Tensor` of shape `(N,)`, fp32: the new multipliers.
    """
    lam = multipliers.float()
    step = losses.detach().float().to(lam.device) - epsilon
    if rho is not None:
        step = step - lam / rho
    return (lam + dual_lr * step).clamp(min=0)


@SFT_SAMPLE_REWEIGHTING.register(
    "feasible",
    paper=PAPERS["feasible_learning"],
    description="per-sample multipliers λ_i by projected dual ascent on `ℓ_i ≤ ε`",
    fields=[
        Field("fl_epsilon", 1e-3, "ε, the per-sample loss bound.", check=number(low=0), param="epsilon"),
        Field(
            "fl_target_prob",
            None,
            "Instead of `fl_epsilon`: a per-token probability p* in (0, 1], giving ε = -log p*.",
            check=number(low=0, high=1, low_open=True, allow_none=True),
            param="target_prob",
            type=float | None,
        ),
        Field("fl_dual_lr", 1.0, "Dual step size η.", check=number(low=0, low_open=True), param="dual_lr"),
        Field(
            "fl_resilient_rho",
            2.0,
            "ρ of Resilient FL (slack penalty); `None` for hard feasibility.",
            check=number(low=0, low_open=True, allow_none=True),
            param="rho",
            type=float | None,
        ),
        Field("fl_init", 1.0, "Initial multiplier of every sample.", check=number(low=0), param="init"),
    ],
    requires=list(_PER_SAMPLE),
)
class FeasibleLearning:
    """The multiplier table of Feasible Learning (arXiv 2501.14912): one `λ_i` per training sample, read by the
    primal loss `mean_i λ_i ℓ_i` and moved once per optimizer step by [`feasible_dual_update`].

    Args:
        num_samples (`int`): training samples (the table's size).
        epsilon (`float`): the per-sample loss bound ε, unless ``target_prob`` p* gives ε = -log p*.
        dual_lr, rho: as in [`feasible_dual_update`].
        init (`float`): every λ_i at the start.
    """

    def __init__(self, num_samples, epsilon=1e-3, target_prob=None, dual_lr=1.0, rho=2.0, init=1.0):
        self.epsilon = -math.log(target_prob) if target_prob is not None else epsilon
        self.dual_lr, self.rho = dual_lr, rho
        self.multipliers = torch.full((num_samples,), float(init))
        self._warned_all_feasible = False

    def weights(self, index: torch.Tensor) -> torch.Tensor:
        """`λ_i` of the samples ``index`` `(M,)`."""
        return self.multipliers[index]

    def update(self, index: torch.Tensor, losses: torch.Tensor) -> dict[str, float]:
        """One dual step on the samples of an optimizer step (every process's, gathered): ``index`` `(M,)`,
        ``losses`` `(M,)`. A sample seen twice in one step (a dataset smaller than the batch) is updated in order.
        Returns the metrics of the table."""
        if index.unique().numel() == index.numel():
            self.multipliers[index] = feasible_dual_update(
                self.multipliers[index], losses, self.epsilon, self.dual_lr, self.rho
            )
        else:
            for i, value in zip(index.tolist(), losses.tolist(), strict=True):
                self.multipliers[i] = feasible_dual_update(
                    self.multipliers[i : i + 1], torch.tensor([value]), self.epsilon, self.dual_lr, self.rho
                )[0]
        table = self.multipliers
        if not self._warned_all_feasible and bool((table[index] == 0).all()):
            self._warned_all_feasible = True
            warnings.warn(
                "Feasible Learning: every sample of this step satisfies its constraint (λ = 0), so these samples no "
                "longer contribute to the gradient. This is by design; lower `fl_epsilon` to keep learning.",
                stacklevel=3,
            )
        return {
            "fl_lambda_mean": table.mean().item(),
            "fl_lambda_max": table.max().item(),
            "fl_lambda_p90": quantile(table, 0.9),
            "fl_frac_satisfied": (losses <= self.epsilon).float().mean().item(),
            "fl_worst_decile_loss": quantile(losses, 0.9),
        }

    def load(self, table: torch.Tensor) -> None:
        """Restore a checkpointed table (of the same training set)."""
        if table.shape != self.multipliers.shape:
            raise ValueError(
                f"The checkpoint's Feasible Learning table has {table.numel()} entries but the training set has "
                f"{self.multipliers.numel()} samples; resume with the same dataset."
            )
        self.multipliers = table.float().clone()


# ---------------------------------------------------------------------------------------------------------------------
# Base-model probability probe (the `auto` objective)

PROBE_QUANTILES = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)

# Decision thresholds of `sft_objective="auto"` (hf_stable's rule; the paper gives none). A P20 >= 0.3 guard
# is off by default: experiment E-A1 showed that noisy labels, where -p helps most, are exactly what pulls P20 down
# (median 0.96, P20 1e-5 on its model-strong set, where -p beat NLL on every seed).
DEFAULT_AUTO_RULE = {"strong_median": 0.9, "strong_p20": 0.0, "weak_median": 0.3}


def quantile(values: torch.Tensor, q: float) -> float:
    """The ``q`` quantile of ``values`` (`(N,)`), interpolating linearly between order statistics like numpy's
    default; unlike `torch.quantile` it has no input-size limit."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be in [0, 1], got {q}.")
    ordered = values.detach().double().flatten().sort().values
    if ordered.numel() == 0:
        raise ValueError("quantile of an empty tensor.")
    pos = q * (ordered.numel() - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, ordered.numel() - 1)
    return (ordered[lo] + (pos - lo) * (ordered[hi] - ordered[lo])).item()


def probe_statistics(probs: torch.Tensor) -> dict[str, float]:
    """Summary of supervised-token probabilities: mean, percentiles ``p05`` … ``p90``, ``frac_p_gt_0.5`` and
    ``num_tokens``.

    Args:
        probs (`torch.Tensor` of shape `(N,)`): probabilities of the supervised tokens under the base model.
    """
    probs = probs.detach().double().flatten()
    if probs.numel() == 0:
        raise ValueError("The probe saw no supervised token; check that the dataset has completion tokens.")
    stats = {"num_tokens": int(probs.numel()), "mean": probs.mean().item()}
    for q in PROBE_QUANTILES:
        stats[f"p{round(q * 100):02d}"] = quantile(probs, q)
    stats["median"] = stats["p50"]
    stats["frac_p_gt_0.5"] = (probs > 0.5).double().mean().item()
    return stats


def choose_objective(stats: dict[str, float], rule: dict[str, float] | None = None) -> dict[str, object]:
    """hf_stable's `auto` rule on [`probe_statistics`] output.

    Model-strong (median p ≥ ``strong_median`` and P20 ≥ ``strong_p20``, off by default) → `prob_power`, α = 1 (−p);
    model-weak
    (median ≤ ``weak_median``) → `nll`; otherwise `nll` flagged as the intermediate regime. α > 1 is never chosen: its
    downside on a weak prior is the largest (the update vanishes).

    Returns:
        `dict` with ``sft_objective``, ``objective_alpha``, ``regime`` and ``reason``.
    """
    r = {**DEFAULT_AUTO_RULE, **(rule or {})}
    median, p20 = stats["median"], stats["p20"]
    if median >= r["strong_median"] and p20 >= r["strong_p20"]:
        choice, alpha, regime = "prob_power", 1.0, "model-strong"
    elif median <= r["weak_median"]:
        choice, alpha, regime = "nll", 0.0, "model-weak"
    else:
        choice, alpha, regime = "nll", 0.0, "intermediate"
    reason = f"median p = {median:.3f}, P20 = {p20:.3f} with rule {r}: {regime}"
    return {"sft_objective": choice, "objective_alpha": alpha, "regime": regime, "reason": reason}
