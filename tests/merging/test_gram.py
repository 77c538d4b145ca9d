"""Fisher–Rao / Karcher solvers (coefficient space vs direct), NRE, SLERP coefficients and Gram helpers."""

import math
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_stable.merging.gram import (
    NORM_MODES,
    accumulate_gram,
    angles_from_gram,
    gram,
    gram_of_chunks,
    karcher_coefficients,
    karcher_direct,
    slerp_coefficients,
)


D64 = torch.float64


def _cluster(n, d, spread, seed, norms=None):
    """n vectors around a common direction, angular spread ~ `spread` radians, random norms."""
    g = torch.Generator().manual_seed(seed)
    center = torch.randn(d, generator=g, dtype=D64)
    center /= center.norm()
    noise = torch.randn(n, d, generator=g, dtype=D64)
    noise -= (noise @ center)[:, None] * center[None, :]
    noise /= noise.norm(dim=1, keepdim=True)
    ang = spread * (0.3 + torch.rand(n, generator=g, dtype=D64))
    x = torch.cos(ang)[:, None] * center + torch.sin(ang)[:, None] * noise
    r = norms if norms is not None else 0.5 + 2 * torch.rand(n, generator=g, dtype=D64)
    return x * torch.as_tensor(r, dtype=D64)[:, None]


def _log_map_residual(u, x, alpha):
    """||Σ α_i Log_u(x̂_i)||: zero at the weighted Karcher mean (first-order condition), computed directly."""
    u = u / u.norm()
    xh = x / x.norm(dim=1, keepdim=True)
    c = xh @ u
    v = xh - c[:, None] * u
    s = v.norm(dim=1)
    theta = torch.atan2(s, c)
    return float(((alpha * theta / s)[:, None] * v).sum(0).norm())


def _slerp_unit(a, b, t):
    """Shoemake SLERP of unit vectors a → b at t, written independently (angle by atan2 of the chord)."""
    a, b = a / a.norm(), b / b.norm()
    om = torch.atan2((b - (a @ b) * a).norm(), a @ b)
    return (torch.sin((1 - t) * om) * a + torch.sin(t * om) * b) / torch.sin(om)


@pytest.mark.parametrize("n,spread", [(2, 0.3), (3, 0.6), (6, 0.9), (8, 1.2)])
def test_coefficient_space_equals_direct(n, spread):
    x = _cluster(n, 300, spread, seed=n)
    w = torch.rand(n, dtype=D64, generator=torch.Generator().manual_seed(7)) + 0.1
    c, info = karcher_coefficients(gram(x), w, return_info=True, tol=1e-12, max_iter=200)
    assert not info["fallback"]
    direct = karcher_direct(x, w, tol=1e-12, max_iter=200)
    assert torch.allclose(c @ x, direct, atol=1e-10 * direct.norm(), rtol=0)
    alpha = w / w.sum()
    assert _log_map_residual(direct, x, alpha) < 1e-10
    # Norm restoration: the weighted mean of the input norms.
    assert math.isclose(float(direct.norm()), float((alpha * x.norm(dim=1)).sum()), rel_tol=1e-12)


def test_two_inputs_is_slerp_times_weighted_mean_norm():
    x = _cluster(2, 50, 1.0, seed=3, norms=[1.0, 3.0])
    for a2 in (0.1, 0.5, 0.8):
        alpha = torch.tensor([1 - a2, a2], dtype=D64)
        expected = _slerp_unit(x[0], x[1], a2) * float((alpha * x.norm(dim=1)).sum())
        assert torch.allclose(karcher_direct(x, alpha, tol=1e-14), expected, atol=1e-12)
        c = karcher_coefficients(gram(x), alpha, tol=1e-14)
        assert torch.allclose(c @ x, expected, atol=1e-12)


def test_weights_are_honoured():
    x = _cluster(4, 100, 0.8, seed=11)
    eq = karcher_coefficients(gram(x), torch.ones(4, dtype=D64)) @ x
    uneq = karcher_coefficients(gram(x), torch.tensor([4.0, 1.0, 1.0, 1.0], dtype=D64)) @ x
    assert (eq - uneq).norm() > 1e-3 * eq.norm()
    # Scaling the weights changes nothing (they are normalised).
    same = karcher_coefficients(gram(x), torch.full((4,), 3.0, dtype=D64)) @ x
    assert torch.allclose(eq, same, atol=1e-12)


def test_small_angles_resolved_with_atan2():
    theta = 1e-6
    e1 = torch.zeros(8, dtype=D64)
    e1[0] = 1
    e2 = torch.zeros(8, dtype=D64)
    e2[1] = 1
    x = torch.stack([2.0 * e1, 2.0 * (math.cos(theta) * e1 + math.sin(theta) * e2)])
    alpha = torch.tensor([0.25, 0.75], dtype=D64)
    expected = 2.0 * (math.cos(0.75 * theta) * e1 + math.sin(0.75 * theta) * e2)
    got = karcher_direct(x, alpha, tol=0.0, max_iter=5)
    assert torch.isfinite(got).all()
    # The angle of the merge from x_1 is 0.75 θ to 1e-9 relative (arccos of the fp32 dot product would be 0).
    ang = math.atan2(float(got[1]), float(got[0]))
    assert math.isclose(ang, 0.75 * theta, rel_tol=1e-9)
    assert torch.allclose(got, expected, atol=1e-15)
    assert torch.acos(torch.tensor(math.cos(theta), dtype=torch.float32)) == 0  # why atan2 is needed
    c = karcher_coefficients(gram(x), alpha, tol=0.0, max_iter=5)
    assert torch.allclose(c @ x, expected, atol=1e-12)


def test_fallback_to_nre_beyond_half_pi():
    # u_0 ∝ (0.5, 0.1 + 0.025, 0): the third input is more than π/2 away from it.
    x = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [-1.0, 0.05, 0.0]], dtype=D64)
    w = torch.tensor([1.0, 0.1, 0.5], dtype=D64)
    with pytest.warns(UserWarning, match="falling back"):
        c, info = karcher_coefficients(gram(x), w, return_info=True)
    assert info["fallback"]
    assert torch.allclose(c, karcher_coefficients(gram(x), w, solver="nre"))


def test_drop_zero_norm_and_single_input():
    x = _cluster(3, 40, 0.5, seed=5)
    x0 = torch.cat([x, torch.zeros(1, 40, dtype=D64)])
    w = torch.tensor([1.0, 2.0, 3.0, 5.0], dtype=D64)
    c = karcher_coefficients(gram(x0), w)
    assert c[3] == 0
    assert torch.allclose(c[:3], karcher_coefficients(gram(x), w[:3]), atol=1e-14)
    assert torch.equal(karcher_coefficients(gram(x[:1]), w[:1]), torch.ones(1, dtype=D64))
    assert torch.equal(karcher_direct(x[:1]), x[0])
    assert torch.equal(karcher_coefficients(torch.zeros(2, 2, dtype=D64), None), torch.zeros(2, dtype=D64))


@pytest.mark.parametrize("mode", NORM_MODES)
def test_norm_modes(mode):
    x = _cluster(4, 60, 0.4, seed=2, norms=[1.0, 2.0, 4.0, 8.0])
    w = torch.tensor([1.0, 1.0, 1.0, 5.0], dtype=D64)
    a = w / w.sum()
    r = torch.tensor([1.0, 2.0, 4.0, 8.0], dtype=D64)
    expected = {
        "weighted_mean": float((a * r).sum()),
        "mean": 3.75,
        "median": 3.0,
        "max": 8.0,
        "geometric": float(torch.exp((a * r.log()).sum())),
        "none": 1.0,
    }[mode]
    for solver in ("karcher", "nre", "nre_unit"):
        out = karcher_coefficients(gram(x), w, norm=mode, solver=solver) @ x
        assert math.isclose(float(out.norm()), expected, rel_tol=1e-12)


def test_nre_variants_directions():
    x = _cluster(5, 80, 0.7, seed=9)
    w = torch.arange(1.0, 6.0, dtype=D64)
    a = w / w.sum()
    s = float((a * x.norm(dim=1)).sum())
    raw = (a[:, None] * x).sum(0)
    unit = (a[:, None] * x / x.norm(dim=1, keepdim=True)).sum(0)
    assert torch.allclose(karcher_coefficients(gram(x), w, solver="nre") @ x, s * raw / raw.norm(), atol=1e-12)
    assert torch.allclose(karcher_coefficients(gram(x), w, solver="nre_unit") @ x, s * unit / unit.norm(), atol=1e-12)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(2, 6),
    seed=st.integers(0, 10_000),
    spread=st.floats(0.01, 1.2),
    scale=st.floats(1e-3, 1e3),
    data=st.data(),
)
def test_karcher_properties(n, seed, spread, scale, data):
    x = _cluster(n, 30, spread, seed)
    w = torch.tensor(data.draw(st.lists(st.floats(0.05, 10.0), min_size=n, max_size=n)), dtype=D64)
    g = gram(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        c = karcher_coefficients(g, w, norm="none", tol=1e-12, max_iter=200)
        # on the unit sphere
        assert math.isclose(float((c @ x).norm()), 1.0, rel_tol=1e-9)
        out = karcher_coefficients(g, w, tol=1e-12, max_iter=200) @ x
        # permutation equivariance
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
        outp = karcher_coefficients(gram(x[perm]), w[perm], tol=1e-12, max_iter=200) @ x[perm]
        assert torch.allclose(out, outp, atol=1e-8 * out.norm())
        # homogeneity: scaling every input scales the merge
        outs = karcher_coefficients(g * scale**2, w, tol=1e-12, max_iter=200) @ (x * scale)
        assert torch.allclose(outs, out * scale, atol=1e-8 * scale * out.norm())
        # NRE variants restore the weighted mean norm exactly
        s = float((w / w.sum() * x.norm(dim=1)).sum())
        for solver in ("nre", "nre_unit"):
            assert math.isclose(float((karcher_coefficients(g, w, solver=solver) @ x).norm()), s, rel_tol=1e-9)
        # within the convex cone of the inputs' max angle: the merge is no farther from any input than the
        # farthest pair
        ang = angles_from_gram(torch.cat([x, out[None]]) @ torch.cat([x, out[None]]).T)
        assert float(ang[-1, :-1].max()) <= float(ang[:-1, :-1].max()) + 1e-9


def test_gram_accumulation_over_chunks():
    x = torch.randn(3, 100, dtype=torch.float32)
    full = gram(x)
    acc = None
    for a, b in [(0, 7), (7, 50), (50, 100)]:
        acc = accumulate_gram(acc, x[:, a:b])
    assert acc.dtype == D64
    assert torch.allclose(acc, full, atol=1e-10)
    assert torch.allclose(gram_of_chunks([x[:, :30], x[:, 30:]]), full, atol=1e-10)


def test_slerp_coefficients_mergekit_conventions():
    a = torch.tensor([1.0, 0.0, 0.0], dtype=D64)
    b = torch.tensor([0.0, 2.0, 0.0], dtype=D64)
    x = torch.stack([a, b])
    c = slerp_coefficients(gram(x), 0.3)
    # Shoemake on normalised copies, coefficients applied to the raw vectors (angle π/2)
    om = math.pi / 2
    assert torch.allclose(c, torch.tensor([math.sin(0.7 * om), math.sin(0.3 * om)], dtype=D64), atol=1e-15)
    # near-colinear → lerp of the raw inputs
    near = torch.stack([a, 3 * (a + 0.01 * b)])
    assert torch.equal(slerp_coefficients(gram(near), 0.3), torch.tensor([0.7, 0.3], dtype=D64))
    with pytest.raises(ValueError, match="exactly 2"):
        slerp_coefficients(torch.eye(3, dtype=D64), 0.5)


def test_gram_in_column_chunks_equals_the_direct_product(monkeypatch):
    """The fp64 Gram is accumulated over column chunks (bounded fp64 copy); it must equal x xᵀ in fp64."""
    import hf_stable.merging.gram as gram_module

    x = torch.randn(5, 1003, generator=torch.Generator().manual_seed(0))
    direct = x.double() @ x.double().T
    monkeypatch.setattr(gram_module, "GRAM_CHUNK", 100)
    assert torch.allclose(gram_module.gram(x), direct, rtol=1e-13, atol=0)
    assert torch.allclose(gram_module.gram_of_chunks([x[:, :500], x[:, 500:]]), direct, rtol=1e-13, atol=0)
