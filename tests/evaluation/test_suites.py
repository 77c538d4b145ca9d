"""The TOFU and MUSE suites on local folders of the exact schemas: open-unlearning's metric names, and every aggregate
recomputed from the logged per-example values with NumPy / SciPy / rouge_score."""

import math
import re

import numpy as np
import pytest
from conftest import write_muse, write_tofu

from hf_stable.evaluation.suites import (
    MUSE_METRICS,
    TOFU_METRICS,
    UTILITY_PARTS,
    EvalOptions,
    evaluate_muse,
    evaluate_tofu,
    retain_truth_ratios,
    summarize,
)
from hf_stable.testing import build_tiny_model


@pytest.fixture(scope="module")
def tofu_logs(tmp_path_factory):
    folder = write_tofu(tmp_path_factory.mktemp("tofu"))
    model, tok = build_tiny_model(seed=1)
    reference, _ = build_tiny_model(seed=2)
    options = EvalOptions(chat=True, max_new_tokens=8, progress=False)
    logs = evaluate_tofu(
        model, tok, data_dir=str(folder), metrics=TOFU_METRICS, options=options, reference_model=reference
    )
    return logs, (model, tok, folder, options)


def _scores(entry, key="score"):
    values = entry["value_by_index"]
    return np.array([values[k][key] for k in sorted(values, key=int)], dtype=np.float64)


def test_tofu_metric_names_are_open_unlearnings(tofu_logs):
    logs, _ = tofu_logs
    summary = summarize(logs, TOFU_METRICS)
    assert list(summary) == [*TOFU_METRICS, *UTILITY_PARTS]
    assert summary["forget_quality"] is None  # no retain model given: open-unlearning also reports None
    for name in ("forget_Q_A_Prob", "forget_truth_ratio", "model_utility", "extraction_strength", "mia_min_k"):
        assert isinstance(summary[name], float) and math.isfinite(summary[name]), name
    assert set(logs["mia_loss"]) == {"forget", "holdout", "auc", "agg_value"}


def test_tofu_aggregates_recomputed(tofu_logs):
    stats = pytest.importorskip("scipy.stats")
    logs, _ = tofu_logs
    para = _scores(logs["forget_Q_A_PARA_Prob"], "avg_loss")
    pert = np.array([v["avg_loss"] for _, v in sorted(logs["forget_Q_A_PERT_Prob"]["value_by_index"].items())])
    tr = np.exp(-pert.mean(-1)) / np.exp(-para)
    assert _scores(logs["forget_truth_ratio"]) == pytest.approx(tr, rel=1e-5)
    assert logs["forget_truth_ratio"]["agg_value"] == pytest.approx(np.mean(np.minimum(tr, 1 / tr)), rel=1e-5)
    assert logs["retain_Truth_Ratio"]["agg_value"] == pytest.approx(np.mean(np.maximum(0, 1 - _scores(
        logs["retain_Truth_Ratio"]))), rel=1e-6)  # fmt: skip
    parts = [logs[p]["agg_value"] for p in UTILITY_PARTS]
    assert logs["model_utility"]["agg_value"] == pytest.approx(float(stats.hmean(parts)), rel=1e-9)
    prob = _scores(logs["forget_Q_A_Prob"], "prob")
    assert prob == pytest.approx(np.exp(-_scores(logs["forget_Q_A_Prob"], "avg_loss")), rel=1e-6)
    assert logs["forget_Q_A_Prob"]["agg_value"] == pytest.approx(prob.mean(), rel=1e-6)
    f, h = _scores(logs["mia_min_k"]["forget"]), _scores(logs["mia_min_k"]["holdout"])
    pairs = [(b > a) + 0.5 * (b == a) for a in f for b in h]  # holdout rows are the positives
    assert logs["mia_min_k"]["agg_value"] == pytest.approx(np.mean(pairs))
    assert logs["privleak"]["agg_value"] == pytest.approx(((1 - np.mean(pairs)) - 0.5) / 0.5 * 100)


def test_tofu_rouge_equals_rouge_score(tofu_logs):
    scorer = pytest.importorskip("rouge_score.rouge_scorer").RougeScorer(["rougeL"], use_stemmer=True)
    logs, _ = tofu_logs
    rows = logs["forget_Q_A_ROUGE"]["value_by_index"].values()
    expected = [scorer.score(r["ground_truth"], r["generation"])["rougeL"].recall for r in rows]
    assert logs["forget_Q_A_ROUGE"]["agg_value"] == pytest.approx(np.mean(expected))


def test_tofu_forget_quality_and_privleak_against_a_retain_model(tofu_logs):
    """The model as its own retain model: identical truth ratios (KS p = 1) and AUCs (privleak 0); the retain logs in
    TOFU's definition also serve a run that aggregates with the paper's ``prob_mean`` (converted exactly)."""
    stats = pytest.importorskip("scipy.stats")
    logs, (model, tok, folder, options) = tofu_logs
    again = evaluate_tofu(model, tok, data_dir=str(folder), metrics=["forget_quality", "privleak"], options=options,
                          retain_logs=logs)  # fmt: skip
    assert again["forget_quality"]["agg_value"] == 1.0 and again["privleak"]["agg_value"] == 0.0
    other, _ = build_tiny_model(seed=4)
    prob_options = EvalOptions(chat=True, truth_ratio_aggregator="prob_mean", progress=False)
    mixed = evaluate_tofu(other, tok, data_dir=str(folder), metrics=["forget_quality", "forget_truth_ratio"],
                          options=prob_options, retain_logs=logs)  # fmt: skip
    ours = 1 / _scores(mixed["forget_truth_ratio"]) - 1  # back to p_false / p_true
    expected = stats.ks_2samp(ours, _scores(logs["forget_truth_ratio"])).pvalue
    assert mixed["forget_quality"]["agg_value"] == pytest.approx(float(expected), rel=1e-6)
    assert 0 < mixed["forget_truth_ratio"]["agg_value"] < 1
    assert retain_truth_ratios({}, "prob_mean") is None


def test_unknown_metric_is_refused(tofu_logs):
    _, (model, tok, folder, options) = tofu_logs
    with pytest.raises(ValueError, match=r"Unknown TOFU metric.*bogus.*Allowed values: forget_truth_ratio"):
        evaluate_tofu(model, tok, data_dir=str(folder), metrics=["bogus"], options=options)
    with pytest.raises(ValueError, match=re.escape("mia_reference` needs a reference model")):
        evaluate_tofu(model, tok, data_dir=str(folder), metrics=["mia_reference"], options=options)


def test_muse_suite(tmp_path):
    scorer = pytest.importorskip("rouge_score.rouge_scorer").RougeScorer(["rougeL"], use_stemmer=True)
    folder = write_muse(tmp_path / "muse")
    model, tok = build_tiny_model(seed=1)
    metrics = [m for m in MUSE_METRICS if m != "mia_reference"]
    logs = evaluate_muse(model, tok, data_dir=str(folder), metrics=metrics,
                         options=EvalOptions(max_new_tokens=4, max_length=32, progress=False))  # fmt: skip
    summary = summarize(logs, metrics)
    assert list(summary) == metrics and all(summary[m] is not None for m in metrics)
    for name in ("forget_knowmem_ROUGE", "forget_verbmem_ROUGE"):
        rows = logs[name]["value_by_index"].values()
        expected = [scorer.score(r["ground_truth"], r["generation"])["rougeL"].fmeasure for r in rows]
        assert logs[name]["agg_value"] == pytest.approx(np.mean(expected))
    assert logs["privleak"]["agg_value"] == pytest.approx((0.5 - logs["mia_min_k"]["agg_value"]) / 0.5 * 100)


def test_model_utility_is_the_harmonic_mean_of_nine_nonzero_parts(tmp_path, monkeypatch):
    """A random tiny model generates no words, so its ROUGE parts are 0 and the mean is trivially 0. Here generation
    returns the first word of each reference answer (ROUGE-L recall 1/5): the composition is checked on nine non-zero
    values against SciPy."""
    stats = pytest.importorskip("scipy.stats")
    import hf_stable.evaluation.suites as suites

    def first_words(model, tokenizer, examples, **kwargs):
        return [tokenizer.decode([t for t in e["labels"] if t != -100], skip_special_tokens=True).split()[0]
                for e in examples]  # fmt: skip

    monkeypatch.setattr(suites, "generate_answers", first_words)
    folder = write_tofu(tmp_path / "tofu")
    model, tok = build_tiny_model(seed=1)
    logs = evaluate_tofu(model, tok, data_dir=str(folder), metrics=["model_utility"],
                         options=EvalOptions(chat=True, progress=False))  # fmt: skip
    parts = [logs[p]["agg_value"] for p in UTILITY_PARTS]
    assert all(v > 0 for v in parts), parts
    assert logs["retain_Q_A_ROUGE"]["agg_value"] == pytest.approx(0.2)  # 1 of the 5 tokens of "retain fact i is d"
    assert logs["model_utility"]["agg_value"] == pytest.approx(float(stats.hmean(parts)), rel=1e-9)
