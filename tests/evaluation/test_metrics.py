"""open-unlearning's metrics (pure math) against float64 brute force, hand-worked cases and SciPy."""

import math
import random
import zlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_stable.evaluation import metrics as M


def _batch(seed=0, B=3, L=7, V=11):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, L, V, generator=g) * 3
    labels = torch.randint(0, V, (B, L), generator=g)
    labels[0, :3] = -100  # prompt
    labels[1, :5] = -100
    labels[1, 6:] = -100  # one answer token
    labels[2, :] = -100  # no answer at all
    return logits, labels


def test_answer_token_stats_against_float64_loops():
    logits, labels = _batch()
    stats = M.answer_token_stats(logits, labels, min_k_plus_plus=True)
    for b in range(logits.shape[0]):
        for t in range(logits.shape[1] - 1):
            target = int(labels[b, t + 1])
            if target == -100:
                assert not stats["mask"][b, t] and stats["logp"][b, t] == 0 and not stats["correct"][b, t]
                continue
            row = logits[b, t].double()
            logp = row - torch.logsumexp(row, 0)
            p = logp.exp()
            mu = float((p * logp).sum())
            sigma = math.sqrt(max(float((p * logp * logp).sum()) - mu * mu, 1e-6))
            assert stats["mask"][b, t]
            assert float(stats["logp"][b, t]) == pytest.approx(float(logp[target]), abs=1e-5)
            assert bool(stats["correct"][b, t]) == (int(row.argmax()) == target)
            assert float(stats["z"][b, t]) == pytest.approx((float(logp[target]) - mu) / sigma, abs=1e-4)


def test_tokenwise_mask_drops_the_last_answer_token():
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 0, 1, 0], [0, 0, 0, 0, 0], [1, 0, 1, 0, 1]], dtype=torch.bool)
    expected = [[0, 1, 1, 0, 0], [0, 0, 0, 0, 0], [0, 0, 0, 0, 0], [1, 0, 1, 0, 0]]
    assert M.tokenwise_mask(mask).int().tolist() == expected


def test_mean_nll_probability_and_empty_rows():
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, 0.0, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)
    nll = M.mean_nll(logp, mask)
    assert nll[:2].tolist() == [2.0, 0.5] and math.isnan(nll[2])
    assert M.probability(nll[:2]).tolist() == pytest.approx([math.exp(-2), math.exp(-0.5)])
    assert M.nanmean(nll) == pytest.approx(1.25) and math.isnan(M.nanmean([math.nan]))


def _es_open_unlearning_loop(preds, labels):
    """The loop of open-unlearning's extraction_strength, written out on Python lists."""
    n = len(labels)
    if n == 0:
        return 0.0
    for k in range(n):
        if preds[k:] == labels[k:]:
            break
    return 1 - k / n


def _es_definition(preds, labels):
    n = len(labels)
    if n == 0:
        return 0.0
    k = min(k for k in range(n + 1) if preds[k:] == labels[k:])
    return 1 - k / n


rows = st.lists(st.lists(st.tuples(st.booleans(), st.booleans()), max_size=9), min_size=1, max_size=6)


@settings(max_examples=200, deadline=None)
@given(rows)
def test_extraction_strength_and_exact_memorization_brute_force(data):
    """Rows of (in_mask, correct) pairs, scattered positions: ES equals open-unlearning's loop (and the definition with
    ``strict``), EM the fraction right; both in [0, 1]."""
    width = max(len(r) for r in data) or 1
    mask = torch.zeros(len(data), width, dtype=torch.bool)
    correct = torch.zeros_like(mask)
    for i, r in enumerate(data):
        for j, (m, c) in enumerate(r):
            mask[i, j], correct[i, j] = m, c
    es, strict, em = (
        M.extraction_strength(correct, mask),
        M.extraction_strength(correct, mask, strict=True),
        M.exact_memorization(correct, mask),
    )
    for i, r in enumerate(data):
        hits = [c for m, c in r if m]
        preds = [1 if c else 0 for c in hits]
        ones = [1] * len(hits)
        assert float(es[i]) == pytest.approx(_es_open_unlearning_loop(preds, ones), abs=1e-6)
        assert float(strict[i]) == pytest.approx(_es_definition(preds, ones), abs=1e-6)
        assert 0 <= float(strict[i]) <= float(es[i]) <= 1
        if hits:
            assert float(em[i]) == pytest.approx(sum(hits) / len(hits))
        else:
            assert math.isnan(em[i])


def test_extraction_strength_hand_worked():
    # answers of 4 tokens: all right -> 1; last wrong -> 1/4 (open-unlearning) or 0 (strict); first wrong -> 3/4
    correct = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [0, 1, 1, 1]], dtype=torch.bool)
    mask = torch.ones_like(correct)
    assert M.extraction_strength(correct, mask).tolist() == [1.0, 0.25, 0.75]
    assert M.extraction_strength(correct, mask, strict=True).tolist() == [1.0, 0.0, 0.75]


def test_min_k_scores_brute_force():
    rng = random.Random(3)
    for _ in range(50):
        n = rng.randint(1, 12)
        values = [rng.uniform(-9, 0) for _ in range(n)]
        k = rng.choice([0.1, 0.2, 0.4, 0.5, 1.0])
        keep = max(1, int(n * k))
        expected = -float(np.mean(sorted(values)[:keep]))
        logp = torch.tensor([[*values, 0.0]])
        mask = torch.tensor([[True] * n + [False]])
        assert float(M.min_k_scores(logp, mask, k)[0]) == pytest.approx(expected, rel=1e-6)
    assert math.isnan(M.min_k_scores(torch.zeros(1, 3), torch.zeros(1, 3, dtype=torch.bool), 0.4)[0])


def test_probability_with_options_float64_and_underflow():
    correct = torch.tensor([0.5, 2.0, 200.0])
    wrong = torch.tensor([[1.0, 3.0], [0.1, 0.2], [300.0, 400.0]])
    got = M.probability_with_options(correct, wrong)
    for i in range(2):
        pc = math.exp(-float(correct[i]))
        pw = sum(math.exp(-float(w)) for w in wrong[i])
        assert float(got[i]) == pytest.approx(pc / (pc + pw), rel=1e-6)
    # exp(-200) underflows fp32 but the ratio is ~1: the correct answer is e^100 times likelier
    assert float(got[2]) == pytest.approx(1.0) and torch.isfinite(got).all()


def test_truth_ratio_scores_both_definitions():
    correct = torch.tensor([1.0, 2.0, 0.5])
    wrong = torch.tensor([[2.0, 4.0], [1.0, 1.0], [0.5, 0.5]])
    pc = np.exp(-correct.numpy().astype(np.float64))
    pw = np.exp(-wrong.numpy().astype(np.float64).mean(-1))
    tofu = M.truth_ratio_scores(correct, wrong, "closer_to_1_better")
    paper = M.truth_ratio_scores(correct, wrong, "prob_mean")
    assert tofu.tolist() == pytest.approx((pw / pc).tolist(), rel=1e-6)
    assert paper.tolist() == pytest.approx((pc / (pc + pw)).tolist(), rel=1e-6)
    assert M.truth_ratio_scores(correct, wrong, "true_better").tolist() == tofu.tolist()
    tr = (pw / pc).tolist()
    assert M.truth_ratio_aggregate(tofu, "closer_to_1_better") == pytest.approx(
        np.mean(np.minimum(tr, 1 / np.array(tr)))
    )
    assert M.truth_ratio_aggregate(tofu, "true_better") == pytest.approx(np.mean(np.maximum(0, 1 - np.array(tr))))
    assert M.truth_ratio_aggregate(paper, "prob_mean") == pytest.approx(float(np.mean(pc / (pc + pw))))
    with pytest.raises(ValueError, match="`aggregator`='bogus' is not valid"):
        M.truth_ratio_scores(correct, wrong, "bogus")


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.floats(0, 30), st.lists(st.floats(0, 30), min_size=1, max_size=4)), min_size=1, max_size=8)
)
def test_truth_ratio_properties(rows):
    p = max(len(w) for _, w in rows)
    correct = torch.tensor([c for c, _ in rows])
    wrong = torch.tensor([[*w, *[sum(w) / len(w)] * (p - len(w))] for _, w in rows])  # padding by the row mean
    tr = M.truth_ratio_scores(correct, wrong, "closer_to_1_better").double()
    prob = M.truth_ratio_scores(correct, wrong, "prob_mean").double()
    assert ((prob >= 0) & (prob <= 1)).all()
    finite = torch.isfinite(tr) & (tr > 0)
    assert torch.allclose(prob[finite], 1 / (1 + tr[finite]), rtol=1e-5, atol=1e-7)
    assert 0 <= M.truth_ratio_aggregate(tr[finite], "closer_to_1_better") <= 1 or not finite.any()


def test_forget_quality_matches_scipy_and_ignores_the_definition():
    stats = pytest.importorskip("scipy.stats")
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(40, generator=g).exp(), (torch.randn(35, generator=g) + 0.4).exp()
    assert M.forget_quality(a, b) == pytest.approx(float(stats.ks_2samp(a.numpy(), b.numpy()).pvalue), rel=1e-9)
    # the paper definition is a strictly decreasing function of TOFU's: the same p-value
    assert M.forget_quality(1 / (1 + a), 1 / (1 + b)) == pytest.approx(M.forget_quality(a, b), rel=1e-12)


def test_harmonic_mean_matches_scipy():
    stats = pytest.importorskip("scipy.stats")
    rng = random.Random(1)
    for _ in range(20):
        values = [rng.uniform(0.01, 1) for _ in range(9)]
        assert M.harmonic_mean(values) == pytest.approx(float(stats.hmean(values)), rel=1e-12)
    assert M.harmonic_mean([0.5, 0.0, 0.9]) == 0.0 == float(stats.hmean([0.5, 0.0, 0.9]))
    assert math.isnan(M.harmonic_mean([0.5, math.nan]))
    with pytest.raises(ValueError, match=">= 0"):
        M.harmonic_mean([0.5, -1.0])


def test_privleak_hand_worked():
    # AUC 0.7 vs a retain model at 0.5: AUC' 0.3 vs 0.5 -> -40 %
    assert M.privleak(0.7, 0.5) == pytest.approx(-40.0)
    assert M.privleak(0.5) == 0.0 and M.privleak(0.4, 0.4) == 0.0
    assert math.isnan(M.privleak(0.6, 1.0))


def test_zlib_scores():
    texts = ["", "aaaa aaaa aaaa aaaa", "The quick brown fox."]
    loss = torch.tensor([1.0, 2.0, 3.0])
    expected = [float(v) / len(zlib.compress(t.encode("utf-8"))) for v, t in zip(loss, texts, strict=True)]
    assert M.zlib_scores(loss, texts).tolist() == pytest.approx(expected)
    with pytest.raises(ValueError, match="Expected 3 texts"):
        M.zlib_scores(loss, texts[:2])


def test_mia_auc_uses_open_unlearnings_labels():
    """Holdout rows are the positives of the loss-like scores: forget rows with lower loss give AUC 1."""
    forget, holdout = torch.tensor([0.1, 0.2, math.nan]), torch.tensor([0.5, 0.15, 0.9])
    pairs = [(h > f) + 0.5 * (h == f) for f in (0.1, 0.2) for h in (0.5, 0.15, 0.9)]
    assert M.mia_auc(forget, holdout) == pytest.approx(float(sum(pairs)) / len(pairs))
    assert M.mia_auc(torch.tensor([0.1, 0.2]), torch.tensor([0.5, 0.6])) == 1.0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.booleans(), min_size=1, max_size=8), min_size=1, max_size=5))
def test_tokenwise_mask_keeps_all_but_the_last(rows):
    width = max(len(r) for r in rows)
    mask = torch.tensor([r + [False] * (width - len(r)) for r in rows])
    kept = M.tokenwise_mask(mask)
    assert (kept <= mask).all()
    assert kept.sum(-1).tolist() == [max(int(m.sum()) - 1, 0) for m in mask]


@settings(max_examples=200, deadline=None)
@given(st.floats(0, 120), st.lists(st.floats(0, 120), min_size=1, max_size=5))
def test_probability_with_options_is_a_probability(correct, wrong):
    p = float(M.probability_with_options(torch.tensor([correct]), torch.tensor([wrong]))[0])
    assert 0 <= p <= 1
    if correct <= min(wrong):  # the correct answer is at least as likely as every wrong one
        assert p >= 1 / (1 + len(wrong)) - 1e-6
