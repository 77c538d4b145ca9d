"""Statistics for unlearning evaluation: KS test, ROC AUC, min-k% MIA score, TOFU truth ratio, over-forgetting.

Pure functions on torch tensors (or anything `torch.as_tensor` accepts: lists, NumPy arrays); no SciPy and no
transformers. Every computation runs in float64 on the CPU and returns Python floats or float64 tensors.

References:

* TOFU (Maini et al., 2024, arXiv 2401.06121): truth ratio and forget quality (a two-sample KS test between the
  truth ratios of the unlearned and of the retain-only model); aggregations as in open-unlearning
  (`src/evals/metrics/memorization.py`, `truth_ratio`).
* MUSE (Shi et al., 2024, arXiv 2407.06460) and Min-K% Prob (Shi et al., 2023, arXiv 2310.16789): the min-k%
  membership-inference score and its ROC AUC between members (forget) and non-members (holdout).
* Two-sample Kolmogorov–Smirnov test: the exact null distribution of the two-sided statistic by lattice-path
  counting (Hodges, "The significance probability of the Smirnov two-sample test", Ark. Mat. 3, 1958), the
  Kolmogorov limit with Stephens' small-sample correction (Stephens, JRSS B 32, 1970) for large samples. The results
  follow `scipy.stats.ks_2samp(a, b)` (``alternative="two-sided"``, ``method="auto"``); see [`ks_2samp`].
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch


__all__ = [
    "OVER_FORGETTING_FLOOR",
    "KSResult",
    "auc",
    "ks_2samp",
    "ks_2samp_pvalue",
    "min_k_score",
    "over_forgetting",
    "truth_ratio",
    "truth_ratio_forget_score",
    "truth_ratio_retain_score",
]

# `method="auto"` is exact up to this many observations in the larger sample (SciPy's `MAX_AUTO_N`).
KS_MAX_EXACT_N = 10_000
# Probabilities below this are raised to it in `over_forgetting` (zero after float32 underflow, for instance).
OVER_FORGETTING_FLOOR = 1e-30


def _as_1d(values, name: str) -> torch.Tensor:
    tensor = torch.as_tensor(values).detach().to(device="cpu", dtype=torch.float64).reshape(-1)
    if tensor.numel() == 0:
        raise ValueError(f"`{name}` is empty.")
    return tensor


class KSResult(NamedTuple):
    """Result of [`ks_2samp`]: the statistic ``D = sup |F_a - F_b|`` and its two-sided p-value."""

    statistic: float
    pvalue: float


def _ks_exact_sf(n1: int, n2: int, h: int) -> float:
    """``P(D >= h / lcm(n1, n2))`` under H0 (no ties), by dynamic programming over the lattice paths.

    A sample pair without ties is a uniformly random path from ``(0, 0)`` to ``(n1, n2)`` (one step right per value
    of the first sample, one step up per value of the second). ``D >= d`` iff the path touches a point with
    ``|x / n1 - y / n2| >= d``, i.e. ``|n2 x - n1 y| >= h g`` in integers (``g = gcd``). We propagate the probability
    of having stayed strictly inside that band along the anti-diagonals ``x + y = s`` and add up the mass that leaves
    it; summing positive terms keeps tiny p-values (1e-40 and below) accurate to a few ulps, which ``1 - P(inside)``
    would not.
    """
    if n1 > n2:  # the vector runs over the smaller sample
        n1, n2 = n2, n1
    g = math.gcd(n1, n2)
    bound = h * g
    total = n1 + n2
    x = torch.arange(n1 + 1, dtype=torch.float64)
    x_int = torch.arange(n1 + 1, dtype=torch.int64)
    inside = torch.zeros(n1 + 1, dtype=torch.float64)
    inside[0] = 1.0
    left = torch.zeros(total + 1, dtype=torch.float64)
    shifted = torch.zeros(n1 + 1, dtype=torch.float64)
    from_right = n1 + 1 - x  # weight of the step (x - 1, y) -> (x, y): n1 - (x - 1) values of sample 1 remain
    for s in range(1, total + 1):
        remaining = total - (s - 1)
        shifted[1:] = inside[:-1]
        shifted[0] = 0.0
        # from (x - 1, s - x) with probability (n1 - x + 1) / remaining; from (x, s - 1 - x) with (n2 - s + x + 1) / ..
        step = (shifted * from_right + inside * (n2 - s + 1 + x)) / remaining
        outside = ((n2 + n1) * x_int - n1 * s).abs() >= bound  # |n2 x - n1 y| with y = s - x
        out_mass = step * outside
        left[s] = out_mass.sum()
        inside = step - out_mass
    return float(left.sum())


def _kolmogorov_sf(z: float) -> float:
    """Survival function of the Kolmogorov distribution, ``P(sup |B(t)| >= z)`` for a Brownian bridge ``B``."""
    if z <= 0:
        return 1.0
    if z < 1.0:  # Jacobi theta form converges fast for small z
        inner = sum(math.exp(-((2 * k - 1) ** 2) * math.pi**2 / (8 * z * z)) for k in range(1, 20))
        return max(0.0, 1.0 - math.sqrt(2 * math.pi) / z * inner)
    return max(0.0, 2 * sum((-1) ** (k - 1) * math.exp(-2 * k * k * z * z) for k in range(1, 101)))


def ks_2samp(a, b, method: str = "auto") -> KSResult:
    """Two-sample, two-sided Kolmogorov–Smirnov test of ``a`` and ``b`` coming from the same distribution.

    The statistic is ``D = max_v |F_a(v) - F_b(v)|`` over the empirical CDFs (ties are handled like SciPy: the ECDFs
    are evaluated at every observed value, ``side="right"``). The p-value is ``P(D' >= D)`` under H0 for continuous
    data (ties do not change the null distribution, as in SciPy).

    Args:
        a, b: 1-D samples (any shape is flattened), sizes ``n1`` and ``n2``.
        method (`str`, defaults to ``"auto"``):
            ``"exact"``: lattice-path count of the null distribution (O(n1·n2) float64 work, vectorised along
            anti-diagonals; about 10 ms for 200 × 200). ``"asymp"``: the Kolmogorov limit at
            ``z = D (sqrt(en) + 0.12 + 0.11 / sqrt(en))`` with ``en = n1 n2 / (n1 + n2)`` (Stephens' correction).
            ``"auto"``: exact when ``max(n1, n2) <= 10000``, like ``scipy.stats.ks_2samp(method="auto")``.

    Returns:
        [`KSResult`] ``(statistic, pvalue)``; both NaN when an input holds NaN (SciPy's ``nan_policy="propagate"``).

    Parity with SciPy: identical statistic; exact p-values agree to ~1e-12 relative (tests check 1e-6 on sizes 5–200,
    with ties and unequal sizes). In the asymptotic regime SciPy evaluates the exact one-sample distribution at
    ``round(en)`` instead of Stephens' formula; the two differ by 0.1–1 % relative there (more in the far tail).
    """
    if method not in ("auto", "exact", "asymp"):
        raise ValueError(f"method must be 'auto', 'exact' or 'asymp', got {method!r}.")
    a, b = _as_1d(a, "a"), _as_1d(b, "b")
    if torch.isnan(a).any() or torch.isnan(b).any():
        return KSResult(math.nan, math.nan)
    n1, n2 = a.numel(), b.numel()
    a, b = torch.sort(a).values, torch.sort(b).values
    both = torch.cat([a, b])
    count_a = torch.searchsorted(a, both, right=True)  # int64 counts, exact
    count_b = torch.searchsorted(b, both, right=True)
    g = math.gcd(n1, n2)
    # n1 n2 (F_a - F_b) = n2 count_a - n1 count_b is a multiple of g; D = h / lcm exactly.
    h = int((count_a * n2 - count_b * n1).abs().max()) // g
    lcm = n1 // g * n2
    statistic = h / lcm
    if method == "auto":
        method = "exact" if max(n1, n2) <= KS_MAX_EXACT_N else "asymp"
    if h == 0:
        return KSResult(statistic, 1.0)
    if method == "exact":
        pvalue = _ks_exact_sf(n1, n2, h)
    else:
        en = n1 * n2 / (n1 + n2)
        pvalue = _kolmogorov_sf(statistic * (math.sqrt(en) + 0.12 + 0.11 / math.sqrt(en)))
    return KSResult(statistic, min(max(pvalue, 0.0), 1.0))


def ks_2samp_pvalue(a, b, method: str = "auto") -> float:
    """Two-sided two-sample KS p-value, ``ks_2samp(a, b, method).pvalue``; see [`ks_2samp`].

    TOFU's forget quality is ``ks_2samp_pvalue(truth_ratios_unlearned_forget, truth_ratios_oracle_forget)``.
    """
    return ks_2samp(a, b, method).pvalue


def auc(scores_pos, scores_neg) -> float:
    """ROC AUC of scores separating positives from negatives, ties counted 1/2 (Mann–Whitney U / (n_pos n_neg)).

    ``AUC = P(s_pos > s_neg) + 0.5 P(s_pos == s_neg)`` over all pairs, the same number as
    ``sklearn.metrics.roc_auc_score([1] * n_pos + [0] * n_neg, [*pos, *neg])``. Computed from average ranks in
    O(n log n). ``auc(a, b) + auc(b, a) == 1``.

    Args:
        scores_pos: scores of the positives (for MIA: members, the forget set), any shape (flattened).
        scores_neg: scores of the negatives (non-members, the holdout set).

    Returns:
        `float` in [0, 1]; NaN scores raise ``ValueError``.
    """
    pos, neg = _as_1d(scores_pos, "scores_pos"), _as_1d(scores_neg, "scores_neg")
    if torch.isnan(pos).any() or torch.isnan(neg).any():
        raise ValueError("auc got NaN scores.")
    n_pos, n_neg = pos.numel(), neg.numel()
    values, order = torch.sort(torch.cat([pos, neg]))
    _, inverse, counts = torch.unique_consecutive(values, return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).to(torch.float64)
    average_rank = ends - (counts.to(torch.float64) - 1) / 2  # 1-based ranks start + 1 .. end, averaged
    ranks = torch.empty_like(values)
    ranks[order] = average_rank[inverse]
    u = ranks[:n_pos].sum().item() - n_pos * (n_pos + 1) / 2
    return u / (n_pos * n_neg)


def min_k_score(token_logps: torch.Tensor, mask: torch.Tensor, k: float = 0.2) -> torch.Tensor:
    """Min-k% membership score per sequence: the mean of its lowest ``k`` fraction of answer-token log-probs.

    The number of tokens kept is ``max(1, floor(k * n))`` for a sequence with ``n`` answer tokens (MUSE /
    open-unlearning ``MinKProbAttack``). Higher scores mean "more likely a member"; open-unlearning returns the
    negative of this number, so swap the arguments of [`auc`] when comparing with its AUCs.

    Args:
        token_logps (`torch.Tensor` of shape ``(B, T)``): log-probabilities of the target tokens.
        mask (`torch.Tensor` of shape ``(B, T)``): true (or 1) on answer tokens.
        k (`float`, defaults to `0.2`): fraction in (0, 1].

    Returns:
        float64 `torch.Tensor` of shape ``(B,)``; NaN for a sequence without answer tokens.
    """
    if not 0 < k <= 1:
        raise ValueError(f"k must be in (0, 1], got {k}.")
    if token_logps.shape != mask.shape or token_logps.dim() != 2:
        raise ValueError(
            f"token_logps and mask must have the same (B, T) shape, got {token_logps.shape}, {mask.shape}."
        )
    logps = token_logps.detach().to(torch.float64)
    mask = mask.to(device=logps.device).bool()
    counts = mask.sum(-1)
    keep = torch.clamp((counts.to(torch.float64) * k).floor().long(), min=1)
    ordered = torch.sort(logps.masked_fill(~mask, math.inf), dim=-1).values
    ranks = torch.arange(logps.shape[-1], device=logps.device)
    kept = ranks.unsqueeze(0) < keep.unsqueeze(-1)
    score = ordered.masked_fill(~kept, 0.0).sum(-1) / keep
    return score.masked_fill(counts == 0, math.nan)


def truth_ratio(correct_mean_nll, wrong_mean_nlls) -> torch.Tensor:
    """TOFU truth ratio per question: ``p̃_wrong / p̃_correct``.

    ``p̃_correct = exp(-ℓ̄_correct)`` and ``p̃_wrong = exp(-mean_j ℓ̄_wrong_j)``, the geometric mean over the perturbed
    answers of their length-normalised probabilities (``ℓ̄`` = mean NLL per answer token). Computed in log space,
    ``exp(ℓ̄_correct - mean_j ℓ̄_wrong_j)``, so no epsilon is needed (open-unlearning adds 1e-10 to ``p̃_correct``).
    A ratio < 1 means the model prefers the true answer; a never-trained model sits near 1.

    Args:
        correct_mean_nll: shape ``(N,)``, mean NLL of the correct answer of each question (TOFU uses a paraphrased
            correct answer; TinyTOFU uses the true value).
        wrong_mean_nlls: shape ``(N, P)``, mean NLL of each of the ``P`` perturbed answers.

    Returns:
        float64 `torch.Tensor` of shape ``(N,)``.
    """
    correct = torch.as_tensor(correct_mean_nll).detach().to(device="cpu", dtype=torch.float64).reshape(-1)
    wrong = torch.as_tensor(wrong_mean_nlls).detach().to(device="cpu", dtype=torch.float64)
    if wrong.dim() == 1:
        wrong = wrong.unsqueeze(-1)
    if wrong.dim() != 2 or wrong.shape[0] != correct.shape[0] or wrong.shape[1] == 0:
        raise ValueError(f"Expected shapes (N,) and (N, P), got {tuple(correct.shape)} and {tuple(wrong.shape)}.")
    return torch.exp(correct - wrong.mean(-1))


def truth_ratio_forget_score(ratios) -> float:
    """TOFU forget-set aggregation ``mean(min(TR, 1/TR))`` in (0, 1]: 1 when the model cannot tell true from wrong."""
    tr = _as_1d(ratios, "ratios")
    return torch.minimum(tr, 1 / tr).mean().item()


def truth_ratio_retain_score(ratios) -> float:
    """TOFU retain-set aggregation ``mean(max(0, 1 - TR))`` in [0, 1]: 1 when true answers dominate wrong ones."""
    tr = _as_1d(ratios, "ratios")
    return torch.clamp(1 - tr, min=0).mean().item()


def over_forgetting(forget_prob, holdout_prob_start, floor: float = OVER_FORGETTING_FLOOR) -> float:
    """Over-forgetting ``OF = log10(FP / HP₀)`` (TinyTOFU; the tiers in docs/unlearning.md use it).

    ``FP`` is the mean probability (``exp(-mean NLL)`` of answer + EOS) of the true forget answers under the unlearned
    model, ``HP₀`` the same mean on holdout (never-trained) questions under the *starting* model: the chance level.
    OF ≈ 0 is oracle-like; OF ≪ 0 means the true answer was pushed far below chance (GA collapse reaches −10).

    Both probabilities are raised to ``floor`` (default 1e-30) before the ratio, so zeros (float32 underflow) give a
    finite value, about −29 for HP₀ ≈ 0.1: far past the collapse bar (−3), and stable in JSON reports.

    Args:
        forget_prob: ``FP``, a float, or per-question probabilities (tensor / sequence), which are averaged.
        holdout_prob_start: ``HP₀``, same.
        floor (`float`): lower bound applied to both means.

    Returns:
        `float`.
    """
    fp = max(_as_1d(forget_prob, "forget_prob").mean().item(), floor)
    hp = max(_as_1d(holdout_prob_start, "holdout_prob_start").mean().item(), floor)
    return math.log10(fp / hp)
