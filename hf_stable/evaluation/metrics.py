"""open-unlearning's unlearning metrics as pure torch functions (TOFU and MUSE), with its names and semantics.

Every function takes per-token or per-example tensors (shapes in the docstrings) and returns fp32 (per example) or
Python floats (aggregates). Read from locuslab/open-unlearning (commit d3d7cf9, Dec 2025), nothing copied:

* `src/evals/metrics/utils.py`: ``evaluate_probability`` (mean NLL over *all* answer tokens, EOS included),
  ``tokenwise_logprobs`` / ``tokenwise_vocab_logprobs`` (every answer token *but the last*, i.e. without the EOS
  prediction: the positions exact memorisation, extraction strength, Min-K, Min-K++ and GradNorm use);
* `src/evals/metrics/memorization.py`: ``probability``, ``probability_w_options``, ``truth_ratio`` (aggregators
  ``closer_to_1_better``, ``true_better``, ``prob_mean``), ``exact_memorization``, ``extraction_strength``;
* `src/evals/metrics/privacy.py`: ``ks_test`` (forget quality), ``privleak``; `utility.py`: ``hm_aggregate``;
* `src/evals/metrics/mia/*.py`: LOSS, ZLib, Reference, GradNorm, Min-K, Min-K++ and ``mia_auc``. Attack scores
  are signed like a loss (higher: less likely a member) and the AUC labels the *holdout* rows 1, so an AUC of 1
  means the forget rows look far more familiar than the holdout rows.

Where open-unlearning adds ``1e-10`` to a denominator we compute the ratio in log space or return NaN for the
undefined case; the numbers agree wherever open-unlearning's are finite and meaningful (tests check it).

Papers: TOFU (Maini et al., arXiv 2401.06121), MUSE (Shi et al., arXiv 2407.06460), Min-K% (Shi et al., arXiv
2310.16789), Min-K%++ (Zhang et al., arXiv 2404.02936), ZLib (Carlini et al., USENIX Security 2021, arXiv
2012.07805), GradNorm (Wang et al., arXiv 2402.17012), extraction strength (Carlini et al. 2021; used for unlearning by
Wang et al., ICLR 2025), open-unlearning (Dorna et al., arXiv 2506.12618).
"""

from __future__ import annotations

import math
import zlib

import torch

from .stats import auc, ks_2samp_pvalue, min_k_score


__all__ = [
    "TRUTH_RATIO_AGGREGATORS",
    "answer_token_stats",
    "exact_memorization",
    "extraction_strength",
    "forget_quality",
    "harmonic_mean",
    "mean_nll",
    "mia_auc",
    "min_k_plus_plus_scores",
    "min_k_scores",
    "nanmean",
    "privleak",
    "probability",
    "probability_with_options",
    "tokenwise_mask",
    "truth_ratio_aggregate",
    "truth_ratio_scores",
    "zlib_scores",
]

TRUTH_RATIO_AGGREGATORS = ("closer_to_1_better", "true_better", "prob_mean")


def answer_token_stats(logits: torch.Tensor, labels: torch.Tensor, min_k_plus_plus: bool = False) -> dict:
    """Shifted per-token statistics of a right- or left-padded batch.

    Args:
        logits (`torch.Tensor` of shape ``(B, L, V)``): the model's logits.
        labels (`torch.Tensor` of shape ``(B, L)``): token ids, ``-100`` where no loss is taken (prompt, padding).
        min_k_plus_plus (`bool`): also return ``z``, the Min-K%++ standardised log-probability.

    Returns:
        dict of ``(B, L-1)`` tensors (logits at ``t`` score label ``t+1``): ``logp`` (fp32 target log-probability,
        0 off the answer), ``mask`` (bool, answer tokens), ``correct`` (bool, greedy argmax equals the target) and,
        when asked, ``z = (logp - mu) / sigma`` with ``mu = E_p[log p]``, ``sigma^2 = E_p[(log p)^2] - mu^2`` over the
        vocabulary (clamped at 1e-6 as open-unlearning's ``MinKPlusPlusAttack``).
    """
    targets = labels[:, 1:]
    mask = targets != -100
    logprobs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    index = targets.clamp(min=0).unsqueeze(-1)
    logp = logprobs.gather(-1, index).squeeze(-1).masked_fill(~mask, 0.0)
    out = {"logp": logp, "mask": mask, "correct": (logprobs.argmax(-1) == targets) & mask}
    if min_k_plus_plus:
        probs = logprobs.exp()
        mu = (probs * logprobs).sum(-1)
        var = ((probs * logprobs.square()).sum(-1) - mu.square()).clamp(min=1e-6)
        out["z"] = ((logp - mu) / var.sqrt()).masked_fill(~mask, 0.0)
    return out


def tokenwise_mask(mask: torch.Tensor) -> torch.Tensor:
    """``mask`` without its last true position per row, `(B, T) -> (B, T)` bool.

    open-unlearning's token-wise metrics drop the last answer token (its data appends EOS to every answer, so this is
    the EOS prediction); a row with one answer token keeps none.
    """
    mask = mask.bool()
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    last = torch.where(mask, positions, torch.full_like(positions, -1)).amax(-1, keepdim=True)
    return mask & (positions != last)


def _count(mask: torch.Tensor) -> torch.Tensor:
    return mask.sum(-1).float()


def mean_nll(logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean negative log-likelihood over the masked tokens, `(B, T), (B, T) -> (B,)` fp32; NaN for an empty row
    (open-unlearning's ``avg_loss``)."""
    n = _count(mask)
    total = -(logp.float() * mask).sum(-1)
    return torch.where(n > 0, total / n.clamp(min=1), torch.full_like(total, math.nan))


def probability(avg_loss: torch.Tensor) -> torch.Tensor:
    """Length-normalised answer probability ``exp(-avg_loss)``, any shape (open-unlearning's ``probability``)."""
    return torch.exp(-avg_loss.float())


def probability_with_options(correct_loss: torch.Tensor, wrong_losses: torch.Tensor) -> torch.Tensor:
    """``p_c / (p_c + sum_j p_w_j)`` with ``p = exp(-avg_loss)``: TOFU's normalised probability on real authors and
    world facts (``probability_w_options``). Shapes ``(N,), (N, P) -> (N,)``; computed in log space, so it stays in
    [0, 1] when every probability underflows."""
    c = -correct_loss.float().reshape(-1, 1)
    everything = torch.cat([c, -wrong_losses.float().reshape(c.shape[0], -1)], dim=-1)
    return torch.exp(c.squeeze(-1) - torch.logsumexp(everything, dim=-1))


def truth_ratio_scores(correct_loss: torch.Tensor, wrong_losses: torch.Tensor, aggregator: str) -> torch.Tensor:
    """Per-question truth ratio, `(N,), (N, P) -> (N,)` fp32, in the definition that goes with ``aggregator``.

    ``p_c = exp(-avg_loss_correct)`` and ``p_w = exp(-mean_j avg_loss_wrong_j)`` (the geometric mean of the perturbed
    answers' normalised probabilities). For ``closer_to_1_better`` and ``true_better`` the score is TOFU's
    ``p_w / p_c``; for ``prob_mean`` it is ``p_c / (p_c + p_w)``, the definition of the open-unlearning paper that its
    code only gained in PR #163 (issue #160): in (0, 1), 1 when the true answer dominates, 1/2 when the model cannot
    tell. Both are computed from the log-ratio, without open-unlearning's ``+1e-10``.
    """
    _check_aggregator(aggregator)
    log_ratio = correct_loss.float().reshape(-1) - wrong_losses.float().reshape(correct_loss.numel(), -1).mean(-1)
    if aggregator == "prob_mean":
        return torch.sigmoid(-log_ratio)
    return torch.exp(log_ratio)


def _check_aggregator(aggregator: str) -> None:
    from .._validation import check_choice

    check_choice("aggregator", aggregator, TRUTH_RATIO_AGGREGATORS)


def nanmean(values) -> float:
    """Mean of the finite-or-infinite, non-NaN values (open-unlearning skips rows it scored ``None``); NaN if none."""
    v = torch.as_tensor(values, dtype=torch.float64).reshape(-1)
    v = v[~torch.isnan(v)]
    return v.mean().item() if v.numel() else math.nan


def truth_ratio_aggregate(scores: torch.Tensor, aggregator: str) -> float:
    """open-unlearning's truth-ratio aggregators over the per-question scores of [`truth_ratio_scores`]:
    ``closer_to_1_better`` ``mean(min(TR, 1/TR))`` (forget set: 1 when true and false are equally likely),
    ``true_better`` ``mean(max(0, 1 - TR))`` (retain, real authors, world facts), ``prob_mean`` ``mean(TR)``."""
    _check_aggregator(aggregator)
    tr = torch.as_tensor(scores, dtype=torch.float64).reshape(-1)
    if aggregator == "closer_to_1_better":
        return nanmean(torch.minimum(tr, 1 / tr))
    if aggregator == "true_better":
        return nanmean(torch.clamp(1 - tr, min=0))
    return nanmean(tr)


def forget_quality(forget_truth_ratios, retain_model_truth_ratios) -> float:
    """TOFU forget quality: the two-sided two-sample KS p-value between the unlearned model's per-question forget
    truth ratios and the retain model's (``ks_test``). Any strictly monotone definition of the ratio gives the same
    p-value, so both definitions of [`truth_ratio_scores`] work as long as the two sides use the same one."""
    return ks_2samp_pvalue(forget_truth_ratios, retain_model_truth_ratios)


def harmonic_mean(values) -> float:
    """TOFU model utility: the harmonic mean of its nine statistics (``hm_aggregate``, ``scipy.stats.hmean``).
    0 if any value is 0; values must be >= 0; NaN propagates."""
    v = torch.as_tensor(values, dtype=torch.float64).reshape(-1)
    if v.numel() == 0:
        raise ValueError("`values` is empty.")
    if torch.isnan(v).any():
        return math.nan
    if (v < 0).any():
        raise ValueError(f"The harmonic mean needs values >= 0, got {v.tolist()}.")
    if (v == 0).any():
        return 0.0
    return (v.numel() / (1 / v).sum()).item()


def privleak(forget_auc: float, retain_model_auc: float = 0.5) -> float:
    """MUSE's PrivLeak in percent: ``(AUC'_model - AUC'_retain) / AUC'_retain * 100`` with ``AUC' = 1 - AUC`` of the
    Min-K% attack (open-unlearning's ``privleak``; ``retain_model_auc`` defaults to its ``ref_value`` 0.5). 0 is
    ideal, strongly negative means under-unlearning, strongly positive over-unlearning. NaN when the retain model's
    AUC is 1 (the ratio is undefined; open-unlearning divides by 1e-10)."""
    reference = 1 - retain_model_auc
    if reference == 0:
        return math.nan
    return ((1 - forget_auc) - reference) / reference * 100


def exact_memorization(correct: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Fraction of tokens whose teacher-forced greedy prediction is right, `(B, T), (B, T) -> (B,)` fp32; NaN for a
    row without tokens. Pass ``tokenwise_mask(mask)`` for open-unlearning's ``exact_memorization``."""
    n = _count(mask)
    hits = (correct.bool() & mask.bool()).sum(-1).float()
    return torch.where(n > 0, hits / n.clamp(min=1), torch.full_like(hits, math.nan))


def extraction_strength(correct: torch.Tensor, mask: torch.Tensor, strict: bool = False) -> torch.Tensor:
    """Extraction strength ``1 - k*/n`` per row, `(B, T), (B, T) -> (B,)` fp32, ``n`` the number of masked tokens and
    ``k*`` the shortest prefix after which teacher-forced greedy decoding reproduces the rest exactly.

    With ``strict=False`` (open-unlearning's ``extraction_strength`` loop) ``k*`` runs over ``0 .. n-1`` and stops at
    ``n - 1`` when not even the last token is right, so such a row scores ``1/n``; ``strict=True`` lets ``k* = n``
    (the empty suffix) and scores it 0, the definition of Carlini et al. A row without tokens scores 0 (as
    open-unlearning). Pass ``tokenwise_mask(mask)`` for open-unlearning's positions.
    """
    mask = mask.bool()
    wrong = mask & ~correct.bool()
    # k* = the number of masked tokens up to and including the last wrong one
    before = torch.cumsum(mask.long(), dim=-1)
    k = torch.where(wrong, before, torch.zeros_like(before)).amax(-1)
    n = mask.sum(-1)
    if not strict:
        k = torch.minimum(k, (n - 1).clamp(min=0))
    return torch.where(n > 0, 1 - k.float() / n.clamp(min=1).float(), torch.zeros_like(k, dtype=torch.float32))


def min_k_scores(values: torch.Tensor, mask: torch.Tensor, k: float) -> torch.Tensor:
    """Min-K% / Min-K%++ attack score ``-mean(lowest max(1, floor(k n)) values)``, `(B, T), (B, T) -> (B,)` fp32;
    NaN for a row without tokens (open-unlearning scores it 0). ``values`` are token log-probabilities (Min-K) or the
    ``z`` of [`answer_token_stats`] (Min-K++); pass ``tokenwise_mask(mask)`` and k = 0.4 for open-unlearning's
    configuration."""
    return (-min_k_score(values, mask, k=k)).float()


def min_k_plus_plus_scores(z: torch.Tensor, mask: torch.Tensor, k: float) -> torch.Tensor:
    """Min-K%++ score: [`min_k_scores`] of the standardised log-probabilities ``z``, `(B, T) -> (B,)`."""
    return min_k_scores(z, mask, k)


def zlib_scores(avg_loss: torch.Tensor, texts: list[str]) -> torch.Tensor:
    """ZLib attack: ``avg_loss / len(zlib.compress(text.encode("utf-8")))`` per row, `(B,) -> (B,)` fp32 (the
    compressed length of even an empty text is 8 bytes, so no division by zero)."""
    if len(texts) != avg_loss.numel():
        raise ValueError(f"Expected {avg_loss.numel()} texts, got {len(texts)}.")
    sizes = torch.tensor([len(zlib.compress(t.encode("utf-8"))) for t in texts], dtype=torch.float32)
    return avg_loss.float().reshape(-1).cpu() / sizes


def mia_auc(forget_scores, holdout_scores) -> float:
    """open-unlearning's ``mia_auc``: ROC AUC with the holdout rows as positives and the loss-like attack scores as
    the classifier (``roc_auc_score([0]*n_forget + [1]*n_holdout, scores)``): 1 when every forget row looks more
    familiar than every holdout row, 0.5 when the attack cannot tell. Rows scored NaN (no tokens) are left out."""
    f = torch.as_tensor(forget_scores, dtype=torch.float64).reshape(-1)
    h = torch.as_tensor(holdout_scores, dtype=torch.float64).reshape(-1)
    return auc(h[~torch.isnan(h)], f[~torch.isnan(f)])
