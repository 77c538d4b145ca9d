"""The Martingale Majority Certificate (`hf_stable.evaluation.mmc`): the mixture e-value against Gauss-Legendre
quadrature of its integral, the per-answer e-values against a from-scratch recount, the martingale property by exact
enumeration, validity (wrong certificates ≤ α) by simulation with a control rule that the same check catches, and
argument validation."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_stable.evaluation.mmc import (
    MMC_PAPER,
    MMCState,
    certify_majority,
    certify_stream,
    first_seen_weight,
    log_pair_evalue,
    log_pair_evalues,
    min_samples_to_certify,
    mmc_log_evalues,
)


NODES, WEIGHTS = np.polynomial.legendre.leggauss(200)  # exact for polynomials of degree < 400


def mixture_by_quadrature(k: int, l: int) -> float:  # noqa: E741
    """2^(k+l) ∫_{1/2}^{1} θ^k (1 − θ)^l · 2 dθ, Gauss-Legendre on [1/2, 1] in float64."""
    theta = 0.75 + 0.25 * NODES
    return float(0.25 * np.sum(WEIGHTS * (2 * theta) ** k * (2 * (1 - theta)) ** l * 2))


def log_evalues_by_recount(seq) -> dict:
    """Each answer's log[w(s) M(k, l)] recounted from scratch: s its first 1-based index, the window the samples after
    it, k its window count, l the largest window count of another answer."""
    out = {}
    for a in dict.fromkeys(seq):
        s = seq.index(a) + 1
        window = seq[s:]
        k = window.count(a)
        l = max([window.count(b) for b in set(seq) if b != a], default=0)  # noqa: E741
        out[a] = math.log(1 / (s * (s + 1))) + math.log(mixture_by_quadrature(k, l))
    return out


@pytest.mark.parametrize("k,l", [(0, 0), (1, 0), (0, 1), (3, 2), (10, 4), (2, 9), (40, 30), (0, 60), (120, 0)])
def test_pair_evalue_equals_quadrature(k, l):  # noqa: E741
    assert math.exp(log_pair_evalue(k, l)) == pytest.approx(mixture_by_quadrature(k, l), rel=1e-10)


def test_pair_evalue_hand_values():
    # M(0,0) = 1; M(1,0) = 4∫θ = 3/2; M(0,1) = 4∫(1-θ) = 1/2; M(2,0) = 8∫θ² = 7/3
    for (k, l), value in {(0, 0): 1.0, (1, 0): 1.5, (0, 1): 0.5, (2, 0): 7 / 3}.items():  # noqa: E741
        assert math.exp(log_pair_evalue(k, l)) == pytest.approx(value, rel=1e-12)
    t = log_pair_evalues(np.array([[0, 1], [2, 0]]), np.array([[0, 0], [0, 1]]))
    assert t.dtype.is_floating_point and str(t.dtype) == "torch.float64" and tuple(t.shape) == (2, 2)
    assert t.exp().reshape(-1).tolist() == pytest.approx([1.0, 1.5, 7 / 3, 0.5], rel=1e-12)


@pytest.mark.parametrize("theta0", [0.5, 0.4, 0.1])
def test_pair_mixture_is_a_supermartingale_by_enumeration(theta0):
    """E[M(K, N − K)] over K ~ Binomial(N, θ0) is exactly 1 at θ0 = 1/2 (a martingale from M(0,0) = 1), < 1 below."""
    for n in range(0, 41, 5):
        mean = sum(
            math.comb(n, k) * theta0**k * (1 - theta0) ** (n - k) * math.exp(log_pair_evalue(k, n - k))
            for k in range(n + 1)
        )
        if theta0 == 0.5 or n == 0:
            assert mean == pytest.approx(1.0, rel=1e-10)
        else:
            assert mean < 1.0


def test_evalues_of_a_sequence_by_hand():
    seq = list("abaacaba")  # a: s=1, window "baacaba" k=4 l=2; b: s=2, "aacaba" k=1 l=4; c: s=5, "aba" k=0 l=2
    got = mmc_log_evalues(seq)
    want = {
        "a": math.log(0.5 * mixture_by_quadrature(4, 2)),
        "b": math.log(mixture_by_quadrature(1, 4) / 6),
        "c": math.log(mixture_by_quadrature(0, 2) / 30),
    }
    assert got.keys() == want.keys()
    for a in want:
        assert got[a] == pytest.approx(want[a], rel=1e-10)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=0, max_size=40))
def test_incremental_state_equals_recount(seq):
    state = MMCState()
    for i, x in enumerate(seq):
        log_e = state.update(x)
        assert log_e == pytest.approx(log_evalues_by_recount(seq[: i + 1])[x], rel=1e-9, abs=1e-9)
    got = state.log_evalues()
    want = log_evalues_by_recount(seq)
    assert got.keys() == want.keys()
    for a in want:
        assert math.isfinite(got[a]) and got[a] == pytest.approx(want[a], rel=1e-9, abs=1e-9)
    assert sum(state.counts.values()) == len(seq)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=60), st.sampled_from([0.5, 0.2, 0.05, 0.01]))
def test_never_certifies_before_enough_samples(seq, alpha):
    """No sequence certifies before min_samples_to_certify(α) draws, which is the least n with (2^n − 1)/(2n) ≥ 1/α;
    the e-value is nonnegative and the p-value in [0, 1]."""
    n_min = min_samples_to_certify(alpha)
    assert n_min == next(n for n in range(1, 200) if (2**n - 1) / (2 * n) >= 1 / alpha)
    cert = certify_stream(iter(seq), alpha=alpha, max_samples=len(seq))
    assert cert.e_value >= 0.0 and 0.0 <= cert.p_value <= 1.0
    if cert.certified:
        assert cert.num_samples >= n_min and cert.e_value >= 1 / alpha and cert.p_value <= alpha
    else:
        assert cert.answer is None and cert.num_samples == len(seq)


def test_one_answer_only_certifies_at_the_minimum():
    for alpha in (0.5, 0.05, 1e-3):
        cert = certify_majority(lambda: "42", alpha=alpha, max_samples=100)
        assert cert.certified and cert.answer == "42" and cert.num_samples == min_samples_to_certify(alpha)
        assert cert.counts == {"42": cert.num_samples}
    assert min_samples_to_certify(0.05) == 9  # (2^9 − 1)/18 = 28.4 ≥ 20 > (2^8 − 1)/16 = 15.9
    cert = certify_majority(lambda: "42", alpha=1e-300, max_samples=50)
    assert not cert.certified and cert.answer is None and cert.majority == "42" and cert.num_samples == 50
    assert cert.p_value > 1e-300
    assert not certify_majority(lambda: "42", alpha=0.05, max_samples=1).certified


def _simulate(rule, probs, reps, budget, seed):
    """Share of `reps` runs in which `rule(draw, budget)` certifies something other than the unique mode of `probs`
    (every certificate is wrong when the top is tied), and the mean draws used."""
    rng = random.Random(seed)
    top = max(probs)
    modes = [i for i, p in enumerate(probs) if p == top]
    labels = list(range(len(probs)))
    wrong, used = 0, 0
    for _ in range(reps):
        certified, answer, n = rule(lambda: rng.choices(labels, weights=probs)[0], budget)
        wrong += certified and (len(modes) > 1 or answer != modes[0])
        used += n
    return wrong / reps, used / reps


def mmc_rule(alpha):
    def rule(draw, budget):
        c = certify_majority(draw, alpha=alpha, max_samples=budget)
        return c.certified, c.answer, c.num_samples

    return rule


def peeking_rule(stop):
    """A rule that certifies the leader at the first n where `stop(n, top count, runner-up count)` holds."""

    def rule(draw, budget):
        counts = {}
        for n in range(1, budget + 1):
            x = draw()
            counts[x] = counts.get(x, 0) + 1
            ranked = [*sorted(counts.values(), reverse=True), 0]
            if stop(n, ranked[0], ranked[1]):
                return True, max(counts, key=counts.get), n
        return False, None, budget

    return rule


# invalid: certify as soon as the leader is ahead of every other answer by 1 (at once, after one draw)
lead_by_one_rule = peeking_rule(lambda n, top, second: top - second >= 1)
# invalid under optional stopping: a one-sided z-test of leader vs runner-up at level 0.05, checked at every n ≥ 10
naive_z_rule = peeking_rule(lambda n, top, second: n >= 10 and (top - second) / math.sqrt(top + second) >= 1.645)


ALPHA = 0.05
REPS = 400
SLACK = 3 * math.sqrt(ALPHA * (1 - ALPHA) / REPS)  # 3 binomial standard deviations of the rate at α: 0.033
CASES = {
    "clear mode": (0.6, 0.3, 0.1),
    "near tie": (0.40, 0.38, 0.22),
    "many answers": (0.2,) + (0.04,) * 20,
    "tie": (0.45, 0.45, 0.10),
}


@pytest.mark.parametrize("case", list(CASES))
def test_wrong_certificates_at_most_alpha(case):
    rate, _ = _simulate(mmc_rule(ALPHA), CASES[case], REPS, budget=300, seed=list(CASES).index(case))
    assert rate <= ALPHA + SLACK


@pytest.mark.parametrize("case", ["near tie", "many answers", "tie"])
def test_the_check_catches_invalid_rules(case):
    """The same simulation and bound reject the lead-by-one rule on every case, and the z-test peeking at every n on
    the tie: the validity test above can fail."""
    rate, _ = _simulate(lead_by_one_rule, CASES[case], REPS, budget=300, seed=1)
    assert rate > ALPHA + SLACK
    if case == "tie":
        rate, _ = _simulate(naive_z_rule, CASES[case], REPS, budget=300, seed=2)
        assert rate > ALPHA + SLACK


def test_certifies_an_easy_mode_quickly():
    """Power (so validity is not vacuous): a 0.9 mode is certified in every run, with the mode, in under 20 draws on
    average; a 0.6/0.3/0.1 mode in every run within 1000 draws."""
    rng = random.Random(3)
    runs = [certify_majority(lambda: rng.choices("ab", weights=(0.9, 0.1))[0], 0.05, 300) for _ in range(200)]
    assert all(c.certified and c.answer == "a" for c in runs)
    assert sum(c.num_samples for c in runs) / len(runs) < 20
    runs = [certify_majority(lambda: rng.choices("abc", weights=(0.6, 0.3, 0.1))[0], 0.05, 1000) for _ in range(100)]
    assert all(c.certified and c.answer == "a" for c in runs)


@pytest.mark.parametrize("alpha", [0, 1, 1.5, -0.1, float("nan"), True, "0.05", None])
def test_bad_alpha(alpha):
    with pytest.raises(ValueError, match="`alpha` must be a number in \\(0, 1\\)"):
        certify_majority(lambda: 1, alpha=alpha)


@pytest.mark.parametrize("budget", [0, -3, 2.0, True])
def test_bad_budget(budget):
    with pytest.raises(ValueError, match="`max_samples` must be an integer >= 1"):
        certify_majority(lambda: 1, max_samples=budget)


def test_bad_inputs():
    with pytest.raises(TypeError, match="`sample_answer` must be callable"):
        certify_majority([1, 2, 3])
    with pytest.raises(TypeError, match="answers must be hashable"):
        certify_majority(lambda: [1])
    with pytest.raises(ValueError, match="`wins` must be an integer >= 0"):
        log_pair_evalue(-1, 0)
    with pytest.raises(ValueError, match="`losses` must be an integer >= 0"):
        log_pair_evalue(0, 1.0)
    with pytest.raises(ValueError, match="`index` must be an integer >= 1"):
        first_seen_weight(0)
    assert sum(first_seen_weight(s) for s in range(1, 10_001)) == pytest.approx(1 - 1 / 10_001)


def test_model_helper_reuses_map_eval_sampling():
    """`certify_model_answer` feeds the answers of `sample_completions` (batch i under seed + i) in order."""
    from hf_stable.evaluation.map_eval import sample_completions
    from hf_stable.evaluation.mmc import certify_model_answer
    from hf_stable.testing import build_tiny_model

    model, tokenizer = build_tiny_model(seed=0)
    cert = certify_model_answer(model, tokenizer, "12+34=", alpha=0.05, max_samples=12, batch_size=8,
                                max_new_tokens=3, seed=7)
    texts = [t for i in range(2) for t in sample_completions(model, tokenizer, ["12+34="], num_samples=8,
                                                             max_new_tokens=3, seed=7 + i, batch_size=1)[0]]
    want = certify_stream((t.strip() for t in texts), alpha=0.05, max_samples=12)
    assert cert == want and cert.num_samples <= 12
    with pytest.raises(ValueError, match="`temperature` must be > 0"):
        certify_model_answer(model, tokenizer, "1+1=", temperature=0)
    with pytest.raises(ValueError, match="`batch_size` must be an integer >= 1"):
        certify_model_answer(model, tokenizer, "1+1=", batch_size=0)


def test_registered_with_its_paper():
    import io

    from hf_stable.registry import get_registry, list_methods

    method = get_registry("evaluation").get("mmc")
    assert method.fn is certify_majority and method.paper is MMC_PAPER and MMC_PAPER.arxiv == "2510.17472"
    out = io.StringIO()
    assert "mmc" in list_methods("evaluation", file=out)["evaluation"]
    assert "https://arxiv.org/abs/2510.17472" in out.getvalue()
