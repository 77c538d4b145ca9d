"""The Jacobian-descent aggregators (`hf_stable.losses.jacobian`) against independent computations: UPGrad's
dual-cone projections by brute-force enumeration of the active sets in float64, Aligned-MTL by the SVD of the
Jacobian, and the per-reward advantage parts against TRL's advantage of the weighted reward sum."""

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_stable.losses.jacobian import (
    GRADIENT_AGGREGATIONS,
    aggregate,
    aligned_mtl_weights,
    gram,
    jacobian_bytes,
    reward_advantage_parts,
    upgrad_weights,
)


def _brute_projection(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """`argmin vᵀ G v s.t. v ≥ u` by trying every active set: with the set S held at `v_S = u_S`, the free block solves
    `G_FF v_F = -G_FS u_S`; the optimum is the feasible candidate of least objective (G positive definite)."""
    k = len(u)
    best, best_value = None, math.inf
    for size in range(k + 1):
        for active in itertools.combinations(range(k), size):
            free = [i for i in range(k) if i not in active]
            v = u.clone()
            if free:
                act = list(active)
                rhs = -(g[free][:, act] @ u[act]) if act else torch.zeros(len(free), dtype=g.dtype)
                v[free] = torch.linalg.solve(g[free][:, free], rhs)
            if (v >= u - 1e-10).all():
                value = float(v @ g @ v)
                if value < best_value:
                    best, best_value = v, value
    return best


def _brute_upgrad(jacobian: torch.Tensor, w: torch.Tensor, reg_eps: float = 1e-4) -> torch.Tensor:
    j = jacobian.double()
    g = j @ j.T
    g = g / g.trace() + reg_eps * torch.eye(len(w), dtype=torch.float64)
    alpha = sum(_brute_projection(g, w.double()[i] * torch.eye(len(w), dtype=torch.float64)[i]) for i in range(len(w)))
    return alpha @ j


def _jacobians(min_k=1, max_k=4, max_d=6, low=-3.0):
    @st.composite
    def build(draw):
        k = draw(st.integers(min_k, max_k))
        d = draw(st.integers(1, max_d))
        values = draw(st.lists(st.floats(low, 3.0, width=32), min_size=k * d, max_size=k * d))
        weights = draw(st.lists(st.floats(0.125, 2.0, width=32), min_size=k, max_size=k))
        return torch.tensor(values).reshape(k, d), torch.tensor(weights)

    return build()


def _nonzero(jacobian):
    return float((jacobian.double() ** 2).sum()) > 1e-6


# ---------------------------------------------------------------------------------------------------------------------
# UPGrad


@settings(max_examples=150, deadline=None)
@given(_jacobians(min_k=2))
def test_upgrad_matches_brute_force_projections(case):
    jacobian, w = case
    if not _nonzero(jacobian):
        return
    expected = _brute_upgrad(jacobian, w)
    got = upgrad_weights(gram(jacobian), w) @ jacobian.double()
    assert torch.allclose(got, expected, rtol=1e-7, atol=1e-7 * float(expected.abs().max() + 1)), (got, expected)


def test_upgrad_known_pair():
    """g1 = (1, 0), g2 = (-1, 1): g1 projects onto the boundary of g2's half-plane, (1/2, 1/2) = 1·g1 + 1/2·g2; g2
    onto that of g1's, (0, 1) = g1 + g2; their sum is (1/2, 3/2) = 2·g1 + 3/2·g2 (up to the 1e-4 regularisation)."""
    update = aggregate(torch.tensor([[1.0, 0.0], [-1.0, 1.0]]), torch.ones(2), "upgrad")
    assert torch.allclose(update, torch.tensor([0.5, 1.5]), atol=1e-3)
    exact = upgrad_weights(gram(torch.tensor([[1.0, 0.0], [-1.0, 1.0]])), torch.ones(2), reg_eps=0.0)
    assert torch.allclose(exact, torch.tensor([2.0, 1.5], dtype=torch.float64), atol=1e-12)


@settings(max_examples=150, deadline=None)
@given(_jacobians(min_k=2))
def test_upgrad_conflicts_with_no_row(case):
    """`J · update ≥ 0` for every row, up to the regularisation: KKT gives `(G/tr + εI) v ≥ 0`, so `G α ≥ -ε tr α`."""
    jacobian, w = case
    j = jacobian.double()
    alpha = upgrad_weights(gram(jacobian), w)
    products = j @ (alpha @ j)
    slack = 1e-4 * float(j.pow(2).sum()) * alpha.abs() + 1e-9 * (1 + float(j.pow(2).sum()))
    assert (products >= -slack).all(), products


@settings(max_examples=50, deadline=None)
@given(_jacobians(min_k=2))
def test_upgrad_without_regularisation_conflicts_with_no_row(case):
    jacobian, w = case
    j = jacobian.double()
    if torch.linalg.matrix_rank(j) < j.shape[0]:
        return  # a singular Gram matrix needs the regularisation
    alpha = upgrad_weights(gram(jacobian), w, reg_eps=0.0)
    assert (j @ (alpha @ j) >= -1e-8 * (1 + float(j.pow(2).sum()))).all()


@settings(max_examples=100, deadline=None)
@given(_jacobians(min_k=2, low=0.0))
def test_upgrad_without_conflict_is_the_weighted_sum(case):
    """Non-negative entries: every pair of rows has a non-negative inner product, nothing is projected."""
    jacobian, w = case
    if not _nonzero(jacobian):
        return
    got = aggregate(jacobian, w, "upgrad")
    assert torch.allclose(got, w @ jacobian, rtol=1e-5, atol=1e-6)


@settings(max_examples=100, deadline=None)
@given(_jacobians(min_k=2), st.floats(0.1, 10.0))
def test_upgrad_is_linear_under_scaling_of_a_row(case, c):
    """The dual cone is the same for positively rescaled rows, so `A(diag(c) J, w) = A(J, c ∘ w)` (the paper's
    "linear under scaling"). Exact without the regularisation (which is relative to the trace, changed by the
    rescaling), so on well-conditioned Jacobians."""
    jacobian, w = case
    j = jacobian.double()
    s = torch.linalg.svdvals(j)
    if len(s) < len(w) or s.min() < 1e-3 * s.max():
        return
    scale = torch.ones(len(w), dtype=torch.float64)
    scale[0] = c
    scaled = upgrad_weights(gram(jacobian * scale[:, None].float()), w, reg_eps=0.0) @ (j * scale[:, None])
    weighted = upgrad_weights(gram(jacobian), w * scale.float(), reg_eps=0.0) @ j
    assert torch.allclose(scaled, weighted, rtol=1e-6, atol=1e-6 * float(weighted.abs().max() + 1))


@settings(max_examples=50, deadline=None)
@given(_jacobians(min_k=1, max_k=1))
def test_one_reward_returns_its_weighted_gradient(case):
    jacobian, w = case
    for method in ("upgrad", "aligned_mtl"):
        assert torch.allclose(aggregate(jacobian, w, method), w[0] * jacobian[0], rtol=1e-5, atol=1e-6), method


@pytest.mark.parametrize("method", ["upgrad", "aligned_mtl"])
def test_degenerate_jacobians_give_finite_updates(method):
    zero = aggregate(torch.zeros(3, 5), torch.ones(3), method)
    assert torch.equal(zero, torch.zeros(5))
    g = torch.tensor([1.0, -2.0, 0.5])
    parallel = aggregate(torch.stack([g, 2 * g, g]), torch.ones(3), method)
    assert torch.isfinite(parallel).all()
    # parallel rows do not conflict: both aggregators move along g
    assert float(parallel @ g) > 0 and torch.allclose(parallel / parallel.norm(), g / g.norm(), atol=1e-5)
    with_zero_row = aggregate(torch.stack([g, torch.zeros(3)]), torch.ones(2), method)
    assert torch.isfinite(with_zero_row).all() and float(with_zero_row @ g) > 0
    opposed = aggregate(torch.stack([g, -g]), torch.ones(2), method)
    assert torch.isfinite(opposed).all()
    if method == "upgrad":  # the dual cone of {g, -g} is g's orthogonal complement
        assert abs(float(opposed @ g)) < 1e-3 * float(g @ g)


# ---------------------------------------------------------------------------------------------------------------------
# Aligned-MTL


def _svd_aligned(jacobian: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`σ_min V_r U_rᵀ w` from the SVD `J = U S Vᵀ` truncated to the numerically non-zero singular values."""
    j = jacobian.double()
    u, s, vh = torch.linalg.svd(j, full_matrices=False)
    keep = s**2 > (s.max() ** 2) * len(w) * torch.finfo(torch.float32).eps
    if not keep.any():
        return w.double() @ j
    u, s, vh = u[:, keep], s[keep], vh[keep]
    return s.min() * (vh.T @ (u.T @ w.double()))


@settings(max_examples=150, deadline=None)
@given(_jacobians(min_k=2))
def test_aligned_mtl_matches_the_svd_formula(case):
    jacobian, w = case
    j = jacobian.double()
    s = torch.linalg.svdvals(j)
    # a singular value at the truncation threshold is kept by one computation and not the other
    threshold = (s.max() ** 2) * len(w) * torch.finfo(torch.float32).eps
    if ((s**2 - threshold).abs() < 1e-3 * threshold + 1e-12).any():
        return
    got = aligned_mtl_weights(gram(jacobian), w) @ j
    expected = _svd_aligned(jacobian, w)
    assert torch.allclose(got, expected, rtol=1e-6, atol=1e-6 * float(expected.abs().max() + 1)), (got, expected)


def test_aligned_mtl_of_orthogonal_equal_norm_gradients_is_their_weighted_sum():
    q, _ = torch.linalg.qr(torch.randn(6, 3, generator=torch.Generator().manual_seed(0)))
    jacobian = 2.5 * q.T  # three orthogonal rows of norm 2.5
    w = torch.tensor([1.0, 0.5, 2.0])
    assert torch.allclose(aggregate(jacobian, w, "aligned_mtl"), w @ jacobian, atol=1e-5)


def test_aligned_mtl_equalises_the_singular_values():
    """Rows of norms 1 and 10 along orthogonal axes: every direction gets the smallest singular value, 1."""
    jacobian = torch.tensor([[1.0, 0.0], [0.0, 10.0]])
    assert torch.allclose(aggregate(jacobian, torch.ones(2), "aligned_mtl"), torch.tensor([1.0, 1.0]), atol=1e-6)


# ---------------------------------------------------------------------------------------------------------------------
# Gram matrix, sizes and the per-reward advantages


def test_gram_in_chunks_is_the_full_product():
    jacobian = torch.randn(3, 1001, generator=torch.Generator().manual_seed(1))
    assert torch.allclose(gram(jacobian, chunk=64), jacobian.double() @ jacobian.double().T, rtol=1e-12)
    assert aggregate(jacobian, torch.tensor([1.0, 2.0, 0.0]), "sum").allclose(jacobian[0] + 2 * jacobian[1])


def test_jacobian_bytes():
    assert jacobian_bytes(2, 134_515_008) == 1_076_120_064  # SmolLM2-135M fully fine-tuned, two rewards


def _trl_advantages(rewards, weights, g, scale):
    """TRL 1.16's `sum_then_normalize` advantage, written out from `GRPOTrainer._generate_and_score_completions`."""
    r = rewards.double()
    unscorable = torch.isnan(r).all(1)
    total = (torch.nan_to_num(r) * weights.double()).sum(1)
    total[unscorable] = math.nan
    grouped = total.view(-1, g)
    mean = torch.nanmean(grouped, 1).repeat_interleave(g)

    def std(x):
        m = torch.nanmean(x)
        n = (~torch.isnan(x)).sum()
        return torch.sqrt(torch.nanmean((x - m) ** 2) * n / (n - 1))

    if scale == "group":
        s = torch.stack([std(row) for row in grouped]).repeat_interleave(g)
    else:
        s = std(total).expand_as(total)
    out = total - mean
    if scale != "none":
        out = out / (s + 1e-4)
    return torch.nan_to_num(out)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_reward_parts_sum_to_trls_advantage(scale):
    gen = torch.Generator().manual_seed(3)
    rewards = torch.randn(12, 3, generator=gen)
    rewards[1, 2] = math.nan  # a reward function that returned None
    rewards[5] = math.nan  # unscorable
    weights = torch.tensor([1.0, 0.5, 2.0])
    parts = reward_advantage_parts(rewards, weights, 4, scale)
    assert parts.shape == (12, 3) and parts.dtype == torch.float32
    assert torch.allclose(parts.double() @ weights.double(), _trl_advantages(rewards, weights, 4, scale), atol=1e-5)
    assert torch.equal(parts[5], torch.zeros(3))
    # each column is its reward centred within the group (NaN counted 0), over the group's common scale
    col = torch.nan_to_num(rewards[:4, 2])
    centred = col - col.mean()
    assert torch.allclose(parts[:4, 2] / parts[:4, 2].norm(), centred / centred.norm(), atol=1e-5)


def test_reward_parts_of_a_group_whose_weighted_sum_has_no_spread_are_zero():
    rewards = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 0.0]])
    parts = reward_advantage_parts(rewards, torch.ones(2), 2, "group")
    assert torch.equal(parts[:4], torch.zeros(4, 2))  # r1 + r2 = 1 in both groups: no signal, not 10⁴ × ±0.5
    assert (parts[4:] != 0).any()


def test_the_family_is_declared_with_its_papers():
    assert GRADIENT_AGGREGATIONS.choices() == ["sum", "upgrad", "aligned_mtl"]
    assert GRADIENT_AGGREGATIONS.get("upgrad").paper.arxiv == "2406.16232"
    assert GRADIENT_AGGREGATIONS.get("aligned_mtl").paper.arxiv == "2305.19000"
    with pytest.raises(ValueError, match="gradient_aggregation"):
        aggregate(torch.zeros(2, 2), torch.ones(2), "mgda")
