import numpy as np
import pytest
import scipy.spatial.distance
import scipy.stats
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_stable.stability.drift import linear_cka, pairwise_distances, rankdata, rdm_stability, spearman
from hf_stable.stability.matrix import (
    msign_correction,
    newton_schulz_msign,
    power_iteration,
    spectral_norm,
    stable_rank,
    svd_msign,
)
from hf_stable.stability.reg import REG, racs


def _with_spectrum(m, n, singular_values, seed=0):
    g = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(m, m, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    s = torch.zeros(m, n, dtype=torch.float64)
    k = len(singular_values)
    s[range(k), range(k)] = torch.tensor(singular_values, dtype=torch.float64)
    return u @ s @ v.T


@given(st.integers(2, 12), st.integers(2, 12), st.integers(0, 10_000))
@settings(max_examples=60, deadline=None)
def test_stable_rank_matches_numpy_svd(m, n, seed):
    w = torch.randn(m, n, generator=torch.Generator().manual_seed(seed))
    s = np.linalg.svd(w.double().numpy(), compute_uv=False)
    assert float(stable_rank(w)) == pytest.approx((s**2).sum() / s[0] ** 2, rel=1e-4)
    assert 1.0 - 1e-5 <= float(stable_rank(w)) <= min(m, n) + 1e-5


def test_stable_rank_of_a_zero_matrix_is_zero():
    assert float(stable_rank(torch.zeros(3, 4))) == 0.0


def test_power_iteration_converges_with_a_gap_of_1_01_within_50_iterations():
    w = _with_spectrum(40, 30, [10.0, 10.0 / 1.01, 5.0, 1.0])
    sigma, v = power_iteration(w, iters=50, generator=torch.Generator().manual_seed(0))
    # with sigma1/sigma2 = 1.01 the vector still mixes the top two directions after 50 rounds (0.98^50 = 0.36 of the
    # initial mix), but the estimate ||Wv|| is already within half the gap of sigma1
    assert 10.0 / 1.01 + 0.05 < float(sigma) <= 10.0 + 1e-9
    sigma_more, v = power_iteration(w, v=v, iters=450)  # warm start: continuing converges
    assert float(sigma_more) == pytest.approx(10.0, rel=1e-6)


def test_spectral_norm_power_path_agrees_with_exact_on_a_large_matrix():
    w = _with_spectrum(600, 520, [8.0, 4.0, 2.0]).float()
    sigma, v = spectral_norm(w, iters=30)
    assert v is not None and float(sigma) == pytest.approx(8.0, rel=1e-4)
    sigma_wide, _ = spectral_norm(w.T, iters=30)
    assert float(sigma_wide) == pytest.approx(8.0, rel=1e-4)


@pytest.mark.parametrize("shape", [(16, 16), (24, 10), (10, 24)])
def test_msign_svd_is_exact_and_newton_schulz_is_within_muon_bounds(shape):
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    u, _, vh = np.linalg.svd(w.numpy(), full_matrices=False)
    assert torch.allclose(svd_msign(w), torch.from_numpy(u @ vh), atol=1e-10)
    s_ns = torch.linalg.svdvals(newton_schulz_msign(w))
    assert float(s_ns.min()) >= 0.6 and float(s_ns.max()) <= 1.25
    # same singular vectors: the NS result is U f(Σ) Vᵀ, so Uᵀ·NS·V is diagonal
    core = torch.from_numpy(u).T @ newton_schulz_msign(w).double() @ torch.from_numpy(vh).T
    assert float((core - torch.diag(torch.diagonal(core))).abs().max()) < 1e-5


@pytest.mark.parametrize("method", ["svd", "newton_schulz"])
def test_msign_correction_keeps_the_frobenius_norm(method):
    w = _with_spectrum(12, 8, [20.0, 1.0, 0.5, 0.3, 0.2, 0.1, 0.05, 0.01])
    corrected = msign_correction(w, alpha=1.0, method=method)
    assert float(corrected.norm()) == pytest.approx(float(w.norm()), rel=1e-9)
    if method == "svd":
        assert float(stable_rank(corrected)) == pytest.approx(8.0, rel=1e-9)
    half = msign_correction(w, alpha=0.5, method="svd")
    assert 1.0 < float(stable_rank(half)) < 8.0


def test_pairwise_distances_match_scipy():
    x = torch.randn(9, 5, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    for metric in ("cosine", "euclidean"):
        expected = scipy.spatial.distance.pdist(x.numpy(), metric=metric)
        assert np.allclose(pairwise_distances(x, metric).numpy(), expected, atol=1e-12)


@given(st.lists(st.integers(-3, 3), min_size=2, max_size=30))
@settings(max_examples=100, deadline=None)
def test_rankdata_with_ties_matches_scipy(values):
    assert np.allclose(rankdata(torch.tensor(values)).numpy(), scipy.stats.rankdata(values))


def test_spearman_matches_scipy():
    g = torch.Generator().manual_seed(3)
    a = torch.randn(40, generator=g)
    b = a + 0.5 * torch.randn(40, generator=g)
    b[::5] = b[0]  # ties
    assert float(spearman(a, b)) == pytest.approx(scipy.stats.spearmanr(a.numpy(), b.numpy()).statistic, rel=1e-9)


def test_rdm_stability_is_one_on_itself_and_invariant_to_rotation_and_scale():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(16, 6, generator=g, dtype=torch.float64)
    q, _ = torch.linalg.qr(torch.randn(6, 6, generator=g, dtype=torch.float64))
    assert float(rdm_stability(x, x)) == pytest.approx(1.0)
    assert float(rdm_stability(x, 3.0 * x @ q)) == pytest.approx(1.0)
    assert float(rdm_stability(x, torch.randn(16, 6, generator=g, dtype=torch.float64))) < 0.5


def test_linear_cka_is_one_under_orthogonal_transform_and_matches_a_hand_formula():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(20, 7, generator=g, dtype=torch.float64)
    q, _ = torch.linalg.qr(torch.randn(7, 7, generator=g, dtype=torch.float64))
    assert float(linear_cka(x, x @ q)) == pytest.approx(1.0)
    y = torch.randn(20, 4, generator=g, dtype=torch.float64)
    xc, yc = (x - x.mean(0)).numpy(), (y - y.mean(0)).numpy()
    hand = np.linalg.norm(yc.T @ xc) ** 2 / (np.linalg.norm(xc.T @ xc) * np.linalg.norm(yc.T @ yc))
    assert float(linear_cka(x, y)) == pytest.approx(hand, rel=1e-10)
    assert float(linear_cka(torch.ones(5, 3), x[:5])) == 0.0


def test_racs_balances_rows_and_columns_and_reg_matches_rms_target():
    n = torch.rand(12, 7, generator=torch.Generator().manual_seed(6)) + 0.1
    u = racs(n, iters=20)
    rows, cols = u.pow(2).mean(1).sqrt(), u.pow(2).mean(0).sqrt()
    assert float(rows.max() / rows.min()) == pytest.approx(1.0, abs=1e-3)
    assert float(cols.max() / cols.min()) == pytest.approx(1.0, abs=1e-3)
    w = torch.nn.Parameter(torch.zeros(12, 7))
    opt = REG([w], lr=1.0, weight_decay=0.0, rms_target=0.2, racs_iters=3)
    w.grad = n.clone()
    opt.step()
    assert float(w.detach().pow(2).mean().sqrt()) == pytest.approx(0.2, rel=1e-5)


def test_reg_non_matrix_parameters_follow_torch_adamw_exactly():
    torch.manual_seed(7)
    bias_a = torch.nn.Parameter(torch.randn(5))
    bias_b = torch.nn.Parameter(bias_a.detach().clone())
    ours = REG([bias_a], lr=1e-2, weight_decay=0.1, adamw_betas=(0.9, 0.95), adamw_eps=1e-8)
    ref = torch.optim.AdamW([bias_b], lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    for k in range(4):
        g = torch.randn(5, generator=torch.Generator().manual_seed(k))
        bias_a.grad, bias_b.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    assert torch.allclose(bias_a, bias_b, atol=1e-7)


def test_reg_refuses_bad_hyperparameters_by_name():
    with pytest.raises(ValueError, match="`momentum`"):
        REG([torch.nn.Parameter(torch.zeros(2, 2))], momentum=1.5)
