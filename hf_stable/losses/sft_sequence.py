"""Sequence- and sample-level SFT objectives: per-sequence reductions, REDI (a signed, length-normalised sequence
objective) and Feasible Learning (per-sample multipliers learned by dual ascent). Torch-only functions of tensors, as
in `sft`, whose per-token conventions they share; the trainer gathers the sequences and samples across processes.
"""

from __future__ import annotations

import math
import warnings

import torch

from .._validation import choice, number
from ..papers import PAPERS
from ..registry import Field, Registry, Requires
from .sft_probe import quantile


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
