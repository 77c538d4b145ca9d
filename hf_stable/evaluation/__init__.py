"""Unlearning evaluation: statistics (KS test, AUC, min-k%, truth ratio, over-forgetting), open-unlearning's TOFU and
MUSE metric suites with their loaders, and ROUGE equal to the `rouge_score` package."""

from .benchmarks import load_muse, load_tofu, unlearning_datasets
from .metrics import (
    TRUTH_RATIO_AGGREGATORS,
    exact_memorization,
    extraction_strength,
    forget_quality,
    harmonic_mean,
    mia_auc,
    min_k_scores,
    privleak,
    probability,
    probability_with_options,
    truth_ratio_aggregate,
    truth_ratio_scores,
    zlib_scores,
)
from .rouge import rouge_l, rouge_n
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
from .suites import MUSE_METRICS, TOFU_METRICS, EvalOptions, evaluate_muse, evaluate_tofu


__all__ = [
    "MUSE_METRICS",
    "OVER_FORGETTING_FLOOR",
    "TOFU_METRICS",
    "TRUTH_RATIO_AGGREGATORS",
    "EvalOptions",
    "KSResult",
    "auc",
    "evaluate_muse",
    "evaluate_tofu",
    "exact_memorization",
    "extraction_strength",
    "forget_quality",
    "harmonic_mean",
    "ks_2samp",
    "ks_2samp_pvalue",
    "load_muse",
    "load_tofu",
    "mia_auc",
    "min_k_score",
    "min_k_scores",
    "over_forgetting",
    "privleak",
    "probability",
    "probability_with_options",
    "rouge_l",
    "rouge_n",
    "truth_ratio",
    "truth_ratio_aggregate",
    "truth_ratio_forget_score",
    "truth_ratio_retain_score",
    "truth_ratio_scores",
    "unlearning_datasets",
    "zlib_scores",
]
