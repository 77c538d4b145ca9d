"""Unlearning evaluation statistics: KS parity with SciPy, AUC, min-k%, truth ratio, over-forgetting."""

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_stable.evaluation import (
    OVER_FORGETTING_FLOOR,
    auc,
    ks_2samp,
    ks_2samp_pvalue,
    min_k_score,
    over_forgetting,
    truth_ratio,
    truth_ratio_forget_score,
    truth_ratio_retain_score,
)


def _samples(rng: random.Random, n: int, kind: str, shift: float) -> list[float]:
    if kind == "normal":
        return [rng.gauss(shift, 1.0) for _ in range(n)]
    if kind == "ties":  # few distinct values: many ties within and across samples
        return [float(rng.randint(0, 6)) + round(shift) for _ in range(n)]
    return [math.exp(rng.gauss(shift, 2.0)) for _ in range(n)]  # skewed, like truth ratios


def _parity_cases():
    rng = random.Random(1234)
    cases = [(5, 5), (5, 7), (7, 5), (20, 20), (80, 80), (80, 40), (13, 200), (200, 200), (150, 199), (1, 4)]
    cases += [(rng.randint(5, 200), rng.randint(5, 200)) for _ in range(14)]
    out = []
    for i, (n1, n2) in enumerate(cases):
        kind = ("normal", "ties", "lognormal")[i % 3]
        shift = (0.0, 0.3, 1.0, 3.0)[i % 4]
        out.append((n1, n2, kind, shift, i))
    return out


@pytest.mark.parametrize(("n1", "n2", "kind", "shift", "seed"), _parity_cases())
def test_ks_matches_scipy(n1, n2, kind, shift, seed):
    stats = pytest.importorskip("scipy.stats")
    rng = random.Random(seed)
    a, b = _samples(rng, n1, kind, 0.0), _samples(rng, n2, kind, shift)
    expected = stats.ks_2samp(a, b)
    got = ks_2samp(a, b)
    assert got.statistic == pytest.approx(float(expected.statistic), rel=1e-12, abs=1e-15)
    assert got.pvalue == pytest.approx(float(expected.pvalue), rel=1e-6, abs=1e-300)
    assert ks_2samp_pvalue(b, a) == pytest.approx(got.pvalue, rel=1e-12)


def test_ks_tiny_pvalues_match_scipy():
    """Completely separated samples: p = 2 / C(2n, n) for equal sizes, e.g. 2e-119 at 200 vs 200."""
    stats = pytest.importorskip("scipy.stats")
    for n1, n2 in [(80, 80), (200, 200), (200, 150), (5, 200)]:
        a, b = list(range(n1)), [1000.0 + i for i in range(n2)]
        assert ks_2samp_pvalue(a, b) == pytest.approx(float(stats.ks_2samp(a, b).pvalue), rel=1e-6)
    assert ks_2samp_pvalue(list(range(80)), [100.0 + i for i in range(80)]) == pytest.approx(
        2 / math.comb(160, 80), rel=1e-10
    )


def test_ks_large_samples_use_the_asymptotic_formula():
    stats = pytest.importorskip("scipy.stats")
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(10_001, generator=gen, dtype=torch.float64)
    b = torch.randn(12_000, generator=gen, dtype=torch.float64) + 0.02
    expected = stats.ks_2samp(a.numpy(), b.numpy())
    got = ks_2samp(a, b)
    assert got.statistic == pytest.approx(float(expected.statistic), rel=1e-9)
    assert got.pvalue == pytest.approx(float(expected.pvalue), rel=2e-2)  # Stephens vs SciPy's kstwo(round(en))


def test_ks_hand_cases():
    assert ks_2samp([1.0, 2.0], [1.0, 2.0]) == (0.0, 1.0)
    # n1 = 1, n2 = 2, D = 1: the single value of a is below both of b in 1 of 3 orders and above in 1 of 3.
    assert ks_2samp([0.0], [1.0, 2.0]) == pytest.approx((1.0, 2 / 3))
    # 3 vs 3 separated: P(D = 1) = 2 / C(6, 3)
    assert ks_2samp([1, 2, 3], [4, 5, 6]).pvalue == pytest.approx(0.1)
    assert math.isnan(ks_2samp_pvalue([1.0, float("nan")], [1.0, 2.0]))
    with pytest.raises(ValueError):
        ks_2samp([], [1.0])
    with pytest.raises(ValueError):
        ks_2samp([1.0], [2.0], method="permutation")


def test_ks_exact_and_asymp_agree_for_moderate_sizes():
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(400, generator=gen), torch.randn(300, generator=gen) + 0.15
    exact, asymp = ks_2samp(a, b, method="exact"), ks_2samp(a, b, method="asymp")
    assert exact.statistic == asymp.statistic
    assert asymp.pvalue == pytest.approx(exact.pvalue, rel=0.05)


finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False)
small_ints = st.integers(min_value=-3, max_value=3).map(float)  # forces ties
values = st.lists(st.one_of(finite, small_ints), min_size=1, max_size=25)


@settings(max_examples=60, deadline=None)
@given(values, values)
def test_ks_property_pvalue_in_unit_interval_and_symmetric(a, b):
    ab, ba = ks_2samp(a, b), ks_2samp(b, a)
    assert 0.0 <= ab.pvalue <= 1.0
    assert 0.0 <= ab.statistic <= 1.0
    assert ab.statistic == ba.statistic
    assert ab.pvalue == pytest.approx(ba.pvalue, rel=1e-12, abs=1e-300)


@settings(max_examples=60, deadline=None)
@given(values)
def test_ks_property_identical_samples(a):
    assert ks_2samp(a, list(reversed(a))) == (0.0, 1.0)


def test_auc_hand_cases():
    assert auc([3.0, 4.0], [1.0, 2.0]) == 1.0
    assert auc([1.0, 2.0], [3.0, 4.0]) == 0.0
    assert auc([1.0], [1.0]) == 0.5
    # pairs (pos, neg): (2,1)=1, (2,2)=.5, (2,3)=0, (3,1)=1, (3,2)=1, (3,3)=.5 -> 4 / 6
    assert auc([2.0, 3.0], [1.0, 2.0, 3.0]) == pytest.approx(4 / 6)
    assert auc(torch.tensor([0.9, 0.8, 0.4]), torch.tensor([0.5, 0.1])) == pytest.approx(5 / 6)
    with pytest.raises(ValueError):
        auc([float("nan")], [1.0])
    with pytest.raises(ValueError):
        auc([], [1.0])


def test_auc_equals_pairwise_definition():
    rng = random.Random(0)
    for _ in range(20):
        pos = [float(rng.randint(0, 9)) for _ in range(rng.randint(1, 30))]
        neg = [float(rng.randint(0, 9)) for _ in range(rng.randint(1, 30))]
        pairs = [(p > n) + 0.5 * (p == n) for p in pos for n in neg]
        assert auc(pos, neg) == pytest.approx(sum(pairs) / len(pairs), abs=1e-12)


@settings(max_examples=60, deadline=None)
@given(values, values)
def test_auc_property_complement(a, b):
    assert 0.0 <= auc(a, b) <= 1.0
    assert auc(a, b) + auc(b, a) == pytest.approx(1.0, abs=1e-12)


def test_min_k_score_hand_example():
    logps = torch.tensor(
        [
            [-0.1, -2.0, -0.5, -3.0, -0.2, 0.0, 0.0, 0.0, 0.0, 0.0],  # 5 answer tokens: k=0.2 keeps 1 -> -3.0
            [-1.0, -4.0, -2.0, -0.5, -3.0, -0.1, -0.2, -0.3, -0.4, -5.0],  # 10 tokens: keeps 2 -> (-5 - 4) / 2
            [-0.7, 9.0, 9.0, 9.0, 9.0, 9.0, 9.0, 9.0, 9.0, 9.0],  # 1 token: at least one kept
            [0.0] * 10,  # no answer tokens
        ]
    )
    mask = torch.zeros_like(logps, dtype=torch.bool)
    mask[0, :5] = True
    mask[1, :] = True
    mask[2, 0] = True
    score = min_k_score(logps, mask, k=0.2)
    assert score[:3].tolist() == pytest.approx([-3.0, -4.5, -0.7])
    assert math.isnan(score[3].item())
    assert min_k_score(logps, mask, k=1.0)[0].item() == pytest.approx((-0.1 - 2.0 - 0.5 - 3.0 - 0.2) / 5)
    # the mask, not the position, decides: non-contiguous answer tokens
    assert min_k_score(torch.tensor([[-9.0, -1.0, -2.0]]), torch.tensor([[0, 1, 1]]), k=0.5).item() == -2.0
    with pytest.raises(ValueError):
        min_k_score(logps, mask, k=0.0)


def test_truth_ratio_closed_forms():
    correct = torch.tensor([1.0, 2.0, 0.5])
    wrong = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 2.0, 3.0, 4.0], [0.1, 0.2, 0.3, 0.4]])
    tr = truth_ratio(correct, wrong)
    # p_wrong / p_correct = exp(-mean wrong nll) / exp(-correct nll)
    expected = [1.0, math.exp(2.0 - 2.5), math.exp(0.5 - 0.25)]
    assert tr.tolist() == pytest.approx(expected)
    geometric = torch.exp(-wrong).prod(-1) ** (1 / 4)  # geometric mean of the perturbed probabilities
    assert tr.tolist() == pytest.approx((geometric / torch.exp(-correct)).tolist())
    assert truth_ratio_forget_score(tr) == pytest.approx(sum(min(t, 1 / t) for t in expected) / 3)
    assert truth_ratio_retain_score(tr) == pytest.approx(sum(max(0.0, 1 - t) for t in expected) / 3)
    assert truth_ratio_forget_score([2.0, 0.5]) == pytest.approx(0.5)
    assert truth_ratio_retain_score([2.0, 0.25]) == pytest.approx(0.375)
    # huge margins stay finite thanks to log space
    assert truth_ratio(torch.tensor([0.0]), torch.tensor([[800.0]])).item() == 0.0
    with pytest.raises(ValueError):
        truth_ratio(torch.tensor([1.0, 2.0]), torch.tensor([[1.0, 2.0]]))


def test_over_forgetting():
    assert over_forgetting(0.1, 0.1) == pytest.approx(0.0)
    assert over_forgetting(1e-11, 0.1) == pytest.approx(-10.0)
    assert over_forgetting([0.2, 0.4], torch.tensor([0.01, 0.05])) == pytest.approx(math.log10(0.3 / 0.03))
    floored = over_forgetting(0.0, 0.1)
    assert math.isfinite(floored)
    assert floored == pytest.approx(math.log10(OVER_FORGETTING_FLOOR / 0.1))
    assert over_forgetting(0.0, 0.0) == 0.0


def test_evaluation_package_does_not_import_scipy():
    import subprocess
    import sys

    code = "import sys, hf_stable.evaluation; assert 'scipy' not in sys.modules, 'scipy imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
