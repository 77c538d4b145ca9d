"""Evaluation statistics for unlearning (KS test, AUC, min-k%, truth ratio, over-forgetting); torch-only."""

from .stats import (
    OVER_FORGETTING_FLOOR,
    KSResult,
    auc,
    ks_2samp,
    ks_2samp_pvalue,
    min_k_score,
    over_forgetting,
    truth_ratio,
    truth_ratio_forget_score,
    truth_ratio_retain_score,
)


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
