"""Unit tests of the reward-weight controllers and reward transforms in `hf_stable.losses.reward_weighting`.

Expected values are independent of the implementation: hand-worked areas and volumes, hypervolume by exact
inclusion-exclusion over subsets of points, explicit double loops, numpy covariances and correlations, and the
papers' update rules written out by hand: hypervolume and gradient weights (arXiv 2509.11452), CTWA (arXiv
2602.06869), BRME (arXiv 2409.15360), the Lagrangian (arXiv 2310.04373).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_stable.losses.reward_control import REWARD_TRANSFORMS, REWARD_WEIGHTINGS, BRMEFold
from hf_stable.losses.reward_weighting import (
    brme_reward,
    ctwa_covariance,
    ctwa_update,
    gradient_weight_update,
    hypervolume,
    hypervolume_contribution,
    hypervolume_step,
    influence_scores,
    lagrangian_update,
)


HYPOTHESIS = settings(max_examples=60, deadline=None)


def _np(x: torch.Tensor) -> np.ndarray:
    return x.detach().double().numpy()


def _t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def test_registries():
    assert set(REWARD_WEIGHTINGS.names()) == {
        "static",
        "hypervolume",
        "gradient",
        "ctwa",
        "lagrangian",
        "lagrangian_search",
        "pama",
    }
    assert "brme" in REWARD_TRANSFORMS
    w = torch.tensor([0.2, 0.8])
    assert torch.equal(REWARD_WEIGHTINGS.get("static")(w).weights, w)


def test_brme_fold_puts_the_robust_reward_in_the_first_head_column():
    """The folded column is `λ·mean + (1-λ)·min` of the heads (worked by hand); the other heads become NaN and a
    reward outside the ensemble is untouched."""
    rewards = torch.tensor([[1.0, 3.0, 7.0], [2.0, 0.0, -1.0]])
    folded, metrics = BRMEFold(3, lam=0.25, heads=[0, 1])(rewards)
    assert folded[:, 0].tolist() == [0.25 * 2.0 + 0.75 * 1.0, 0.25 * 1.0 + 0.75 * 0.0]
    assert torch.isnan(folded[:, 1]).all() and folded[:, 2].tolist() == [7.0, -1.0]
    assert metrics["brme/head_min_mean"] == 0.5 and rewards[0, 1] == 3.0  # the input is not modified
    with pytest.raises(ValueError, match="brme_heads"):
        BRMEFold(3, heads=[0])


# =====================================================================================================================
# Hypervolume (arXiv 2509.11452)


def _hv_inclusion_exclusion(points: np.ndarray, ref: np.ndarray) -> float:
    """Exact dominated volume (maximisation) by inclusion-exclusion:
    Σ_{S≠∅} (-1)^{|S|+1} Π_k (min_{p∈S} p_k - ref_k)⁺."""
    pts = [p for p in points if np.all(p > ref)]
    total = 0.0
    for size in range(1, len(pts) + 1):
        for subset in itertools.combinations(pts, size):
            corner = np.min(np.stack(subset), axis=0)
            total += (-1) ** (size + 1) * float(np.prod(np.clip(corner - ref, 0, None)))
    return total


def test_hypervolume_2d_staircase():
    pts = _t([[1, 3], [2, 2], [3, 1]])
    assert hypervolume(pts, _t([0, 0])) == pytest.approx(6.0)  # 3 + 2 + 1 columns of the staircase
    assert hypervolume(pts[:1], _t([0, 0])) == pytest.approx(3.0)
    assert hypervolume(_t([[2, 2]]), _t([0.5, 1])) == pytest.approx(1.5)


def test_hypervolume_3d_single_point_and_union():
    assert hypervolume(_t([[2, 3, 4]]), _t([0, 0, 0])) == pytest.approx(24.0)
    assert hypervolume(_t([[2, 3, 4]]), _t([1, 1, 1])) == pytest.approx(1 * 2 * 3)
    # two boxes [0,2]x[0,1]x[0,1] and [0,1]x[0,2]x[0,1]: 2 + 2 - 1
    assert hypervolume(_t([[2, 1, 1], [1, 2, 1]]), _t([0, 0, 0])) == pytest.approx(3.0)
    # unit cube corners of a 3-D staircase: 1x1x3, 1x3x1, 3x1x1 overlap in the unit cube
    assert hypervolume(_t([[1, 1, 3], [1, 3, 1], [3, 1, 1]]), _t([0, 0, 0])) == pytest.approx(
        3 + 3 + 3 - 1 - 1 - 1 + 1
    )


def test_hypervolume_dominated_and_out_of_reference_points_add_nothing():
    front = _t([[1, 3], [2, 2], [3, 1]])
    ref = _t([0, 0])
    with_dominated = torch.cat([front, _t([[1, 1], [2, 1.5], [0.5, 0.5]])])
    assert hypervolume(with_dominated, ref) == pytest.approx(6.0)
    # a point that does not dominate the reference (one coordinate below it) is ignored, not counted negative
    assert hypervolume(torch.cat([front, _t([[5, -1], [-2, 7]])]), ref) == pytest.approx(6.0)
    assert hypervolume(_t([[5, -1]]), ref) == 0.0
    assert hypervolume(torch.zeros(0, 2, dtype=torch.float64), ref) == 0.0


@HYPOTHESIS
@given(
    k=st.integers(1, 4),
    pts=st.lists(st.lists(st.integers(-2, 6), min_size=4, max_size=4), min_size=1, max_size=7),
)
def test_hypervolume_matches_inclusion_exclusion(k, pts):
    points = np.array(pts, dtype=np.float64)[:, :k] + 0.5 * np.arange(len(pts))[:, None] % 1.5
    ref = np.zeros(k)
    assert hypervolume(torch.tensor(points), torch.tensor(ref)) == pytest.approx(
        _hv_inclusion_exclusion(points, ref), rel=1e-9, abs=1e-9
    )


def test_hypervolume_contribution_and_step():
    front = _t([[1, 3], [3, 1]])
    ref = _t([0, 0])
    # (2, 2) adds the unit square [1,2]x[1,2]
    assert hypervolume_contribution(front, _t([2, 2]), ref) == pytest.approx(1.0)
    # dominated point: 0
    assert hypervolume_contribution(front, _t([1, 1]), ref) == 0.0
    # empty front: the point's own box
    assert hypervolume_contribution(torch.zeros(0, 2, dtype=torch.float64), _t([2, 5]), ref) == pytest.approx(10.0)

    m, new_front, hvc = hypervolume_step(front, _t([2, 2]), ref)
    assert hvc == pytest.approx(1.0)
    assert m == pytest.approx(0.5 + 1.5 * math.tanh(1.0))
    assert new_front.shape == (3, 2) and torch.equal(new_front[-1], _t([2, 2]))
    m0, same_front, hvc0 = hypervolume_step(front, _t([0.5, 0.5]), ref)
    assert hvc0 == 0.0 and m0 == 0.5 and torch.equal(same_front, front)
    m_big, _, hvc_big = hypervolume_step(front, _t([4, 4]), ref)
    assert hvc_big == pytest.approx(16 - 5)  # [0,4]² minus the front's area 3 + 3 - 1
    assert 1.99 < m_big < 2.0
    # tanh saturates to 1.0 in float64 for HVC ≳ 19: the multiplier then reaches its supremum 2.0
    m_huge, _, _ = hypervolume_step(front, _t([50, 50]), ref)
    assert m_huge == pytest.approx(2.0) and m_huge <= 2.0


@HYPOTHESIS
@given(
    front=st.lists(st.tuples(st.floats(-1, 5), st.floats(-1, 5), st.floats(-1, 5)), min_size=0, max_size=5),
    point=st.tuples(st.floats(-1, 5), st.floats(-1, 5), st.floats(-1, 5)),
)
def test_hypervolume_contribution_nonnegative_and_multiplier_range(front, point):
    f = torch.tensor(front, dtype=torch.float64).reshape(-1, 3)
    p, ref = torch.tensor(point, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
    hvc = hypervolume_contribution(f, p, ref)
    assert hvc >= 0.0
    expected = _hv_inclusion_exclusion(np.vstack([f.numpy(), p.numpy()[None]]), ref.numpy()) - (
        _hv_inclusion_exclusion(f.numpy(), ref.numpy()) if len(front) else 0.0
    )
    assert hvc == pytest.approx(max(expected, 0.0), abs=1e-9)
    m, _, hvc_step = hypervolume_step(f, p, ref)
    assert hvc_step == hvc
    assert m == pytest.approx(0.5 + 1.5 * math.tanh(hvc), abs=1e-12)
    assert 0.5 <= m <= 2.0
    if hvc < 10:
        assert m < 2.0


# =====================================================================================================================
# Gradient-based weights (arXiv 2509.11452)


def test_influence_scores_against_double_loop():
    gen = torch.Generator().manual_seed(0)
    grads = torch.randn(4, 50, generator=gen)
    g = grads.double().numpy()
    expected = [sum(float(np.dot(g[k], g[j])) for j in range(4)) for k in range(4)]
    np.testing.assert_allclose(_np(influence_scores(grads)), expected, rtol=1e-6)


def test_gradient_weight_update_stays_on_simplex_and_follows_scores():
    w = torch.tensor([0.5, 0.3, 0.2])
    s = torch.tensor([1e-6, -2e-6, 0.0])
    lr, mu = 1e-6 * 10, 1e-5
    new = gradient_weight_update(w, s, lr, regularization=mu)
    assert (new > 0).all() and new.sum().item() == pytest.approx(1.0, abs=1e-6)
    # closed form w' ∝ w exp(η s / μ)
    raw = _np(w) * np.exp(lr * _np(s) / mu)
    np.testing.assert_allclose(_np(new), raw / raw.sum(), rtol=1e-6)
    # weight moves toward the larger score, away from the smaller
    ratio = _np(new) / _np(w)
    assert ratio[0] > ratio[2] > ratio[1]
    assert new[0] > w[0] and new[1] < w[1]
    # equal scores: unchanged
    np.testing.assert_allclose(_np(gradient_weight_update(w, torch.full((3,), 7.0), 1.0)), _np(w), rtol=1e-6)
    # huge steps stay finite and on the simplex
    extreme = gradient_weight_update(w, torch.tensor([1e3, -1e3, 0.0]), 1.0)
    assert torch.isfinite(extreme).all() and extreme.sum().item() == pytest.approx(1.0, abs=1e-6)
    assert extreme[0].item() == pytest.approx(1.0, abs=1e-6)


# =====================================================================================================================
# CTWA (arXiv 2602.06869)


def _ctwa_reference(rewards: np.ndarray, w: np.ndarray, g: int, use_corr: bool) -> np.ndarray:
    """Per group and objective over the scored entries (≥ 2): population covariance (or correlation, skipping groups
    without spread) of r_k with W; averaged over the groups that count."""
    n, k = rewards.shape
    out = np.zeros(k)
    for j in range(k):
        vals = []
        for start in range(0, n, g):
            r, ww = rewards[start : start + g, j], w[start : start + g]
            ok = ~np.isnan(r)
            if ok.sum() < 2:
                continue
            if use_corr:
                if np.std(r[ok]) <= 1e-6 or np.std(ww[ok]) <= 1e-6:
                    continue
                vals.append(np.corrcoef(r[ok], ww[ok])[0, 1])
            else:
                vals.append(np.cov(r[ok], ww[ok], bias=True)[0, 1])
        out[j] = np.mean(vals) if vals else 0.0
    return out


@pytest.mark.parametrize("use_corr", [False, True])
def test_ctwa_covariance_against_numpy(use_corr):
    rng = np.random.default_rng(0)
    g, b = 6, 5
    w = rng.normal(size=b * g)
    rewards = np.stack([w + rng.normal(size=b * g), -w + 0.1 * rng.normal(size=b * g), rng.normal(size=b * g)], 1)
    rewards[rng.random(rewards.shape) < 0.2] = np.nan
    rewards[:5, 2] = np.nan  # group 0 has a single scored entry for objective 2
    rewards[g : 2 * g, 1] = 3.0  # no spread of objective 1 in group 1
    c, metrics = ctwa_covariance(torch.tensor(rewards, dtype=torch.float32), torch.tensor(w), g, use_corr=use_corr)
    np.testing.assert_allclose(_np(c), _ctwa_reference(rewards, w, g, use_corr), rtol=1e-4, atol=1e-6)
    assert c[0] > 0 and c[1] < 0
    assert metrics["groups_used"] > 0


def test_ctwa_update_raises_log_weight_exactly_below_target():
    log_w = torch.tensor([0.1, -0.2, 0.0, 0.3])
    cov = torch.tensor([0.05, 0.2, -0.1, 0.1])
    targets = torch.tensor([0.1, 0.1, 0.1, 0.1])
    # first step: the EMA starts at c
    new, ema, deficit = ctwa_update(log_w, None, cov, targets, lambda_lr=0.5)
    np.testing.assert_allclose(_np(ema), _np(cov))
    np.testing.assert_allclose(_np(deficit), [0.05, 0.0, 0.2, 0.0], atol=1e-7)
    np.testing.assert_allclose(_np(new), [0.1 + 0.025, -0.2, 0.0 + 0.1, 0.3], atol=1e-7)
    assert ((new > log_w) == (ema < targets)).all()
    # later step: EMA (1-τ) c̄ + τ c by hand
    prev = torch.tensor([0.2, 0.0, 0.12, 0.1])
    new2, ema2, _ = ctwa_update(log_w, prev, cov, targets, lambda_lr=0.5, ema_tau=0.25)
    expected_ema = 0.75 * _np(prev) + 0.25 * _np(cov)  # 0.1625, 0.05, 0.065, 0.1
    np.testing.assert_allclose(_np(ema2), expected_ema, atol=1e-7)
    np.testing.assert_allclose(_np(new2), _np(log_w) + 0.5 * np.clip(0.1 - expected_ema, 0, None), atol=1e-7)
    assert ((new2 > log_w) == (ema2 < targets)).all()


def test_ctwa_update_gate_and_cap():
    log_w = torch.zeros(3)
    cov = torch.tensor([-1.0, -1.0, -1.0])
    targets = torch.full((3,), 0.1)
    means = torch.tensor([0.99, 0.5, 0.96])
    caps = torch.tensor([0.95, 0.95, 0.95])
    new, _, deficit = ctwa_update(
        log_w, None, cov, targets, lambda_lr=1.0, objective_means=means, objective_targets=caps
    )
    np.testing.assert_allclose(_np(deficit), [0.0, 1.1, 0.0], atol=1e-7)  # gated where the mean reached its cap
    np.testing.assert_allclose(_np(new), [0.0, 1.1, 0.0], atol=1e-7)
    capped, _, _ = ctwa_update(log_w, None, cov, targets, lambda_lr=1.0, max_log_weight=0.5)
    np.testing.assert_allclose(_np(capped), [0.5, 0.5, 0.5])


# =====================================================================================================================
# Lagrangian (arXiv 2310.04373) and BRME (arXiv 2409.15360)


def test_lagrangian_projected_dual_ascent():
    mu = torch.tensor([0.0, 0.3, 0.02, 0.4])
    means = torch.tensor([0.9, 0.2, 0.1, 5.0])
    thresholds = torch.tensor([0.5, 0.5, 0.5, math.nan])
    new = lagrangian_update(mu, means, thresholds, lr=0.1)
    # μ ← max(0, μ + η(E[r] - θ)): 0 + 0.04, 0.3 - 0.03, max(0, 0.02 - 0.04); NaN threshold: unconstrained, μ = 0
    np.testing.assert_allclose(_np(new), [0.04, 0.27, 0.0, 0.0], atol=1e-7)
    assert (new >= 0).all()
    # below threshold long enough: projected at exactly 0
    m = torch.tensor([0.02])
    for _ in range(5):
        m = lagrangian_update(m, torch.tensor([0.0]), torch.tensor([1.0]), lr=0.01)
    assert m.item() == 0.0


def test_brme_reward_mean_min_mixture_with_nan_heads():
    heads = torch.tensor(
        [[1.0, 3.0, 2.0], [math.nan, 4.0, 0.0], [math.nan, math.nan, math.nan], [-1.0, math.nan, math.nan]]
    )
    out = brme_reward(heads, lam=0.25)
    expected = [0.25 * 2.0 + 0.75 * 1.0, 0.25 * 2.0 + 0.75 * 0.0, np.nan, -1.0]
    np.testing.assert_allclose(_np(out), expected, atol=1e-7)
    np.testing.assert_allclose(_np(brme_reward(heads, lam=1.0))[:2], [2.0, 2.0])
    np.testing.assert_allclose(_np(brme_reward(heads, lam=0.0))[:2], [1.0, 0.0])
    for lam in (-0.1, 1.5):
        with pytest.raises(ValueError, match="lam"):
            brme_reward(heads, lam=lam)


def test_lagrangian_keeps_multiplier_when_no_sample_was_scored():
    mu = lagrangian_update(torch.tensor([0.7, 0.2]), torch.tensor([float("nan"), 1.0]), torch.tensor([0.5, 0.5]), 0.1)
    torch.testing.assert_close(mu, torch.tensor([0.7, 0.25]))
