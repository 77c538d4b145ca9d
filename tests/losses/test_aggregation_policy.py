"""Unit tests of the loss aggregation (`hf_stable.losses.aggregation`: ΔL, TRL's per-sample weights) and of the policy
losses (`hf_stable.losses.policy`: DRPO, on-policy SFT).

Expected values are independent of the implementation: hand-worked tables, float64 closed forms (the variance of a
linear aggregator), a seeded Monte-Carlo, gradients derived by hand, and literal re-statements of the papers'
formulas: ΔL (arXiv 2509.07558), DRPO (arXiv 2510.04474), on-policy SFT (arXiv 2602.13407); TRL's aggregation is
`trl/trainer/grpo_trainer.py: _compute_loss`.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_stable.losses.advantages import grpo_advantages
from hf_stable.losses.aggregation import LOSS_AGGREGATIONS, delta_l_weights, trl_sample_weights
from hf_stable.losses.policy import (
    LOSS_MODES,
    DRPOMode,
    OnPolicySFTMode,
    drpo_coefficients,
    drpo_loss,
    onpolicy_sft_keep,
    onpolicy_sft_loss,
    sequence_logp,
)


HYPOTHESIS = settings(max_examples=80, deadline=None)


def _np(x: torch.Tensor) -> np.ndarray:
    return x.detach().double().numpy()


def test_registries():
    assert "delta_l" in LOSS_AGGREGATIONS
    assert set(LOSS_MODES.names()) == {"drpo", "onpolicy_sft", "ess", "stable_reinforce"}
    assert LOSS_MODES.get("drpo").fn is DRPOMode and LOSS_MODES.get("onpolicy_sft").fn is OnPolicySFTMode
    assert LOSS_MODES.choices() == ["ppo", "drpo", "onpolicy_sft", "ess", "stable_reinforce"]


# =====================================================================================================================
# 3. ΔL (arXiv 2509.07558)


def test_delta_l_alpha_zero_is_constant_dr_grpo_weights():
    lengths = torch.tensor([3, 100, 17, 1, 64, 8])
    w, metrics = delta_l_weights(lengths, alpha=0.0)
    assert torch.equal(w, torch.ones(6))
    assert metrics["mean_length"] == pytest.approx(lengths.double().mean().item())
    # Dr. GRPO's per-sample weight is a constant: ΔL(α=0) × dr_grpo is dr_grpo
    dr = trl_sample_weights(lengths, "dr_grpo", 128)
    torch.testing.assert_close(w * dr, dr)


@pytest.mark.parametrize("alpha", [0.25, 0.5, 0.75, 1.0, 2.0])
def test_delta_l_weights_proportional_to_inverse_power_with_unit_mean(alpha):
    lengths = np.array([3, 100, 17, 1, 64, 8, 250, 33], dtype=np.float64)
    w, _ = delta_l_weights(torch.tensor(lengths, dtype=torch.long), alpha=alpha)
    raw = lengths**-alpha
    expected = raw / raw.mean()
    np.testing.assert_allclose(_np(w), expected, rtol=2e-6)
    assert _np(w).mean() == pytest.approx(1.0, rel=1e-6)


def test_delta_l_empty_completions_get_zero_and_leave_the_mean():
    lengths = np.array([0, 10, 0, 40, 5], dtype=np.float64)
    w, metrics = delta_l_weights(torch.tensor(lengths), alpha=1.0)
    valid = lengths > 0
    raw = np.where(valid, 1.0 / np.where(valid, lengths, 1.0), 0.0)
    expected = raw / raw[valid].mean()
    np.testing.assert_allclose(_np(w), expected, rtol=2e-6)
    assert _np(w)[valid].mean() == pytest.approx(1.0, rel=1e-6)
    assert metrics["mean_length"] == pytest.approx(55 / 3)
    w0, m0 = delta_l_weights(torch.zeros(4), alpha=1.0)
    assert torch.equal(w0, torch.zeros(4)) and m0["max_weight"] == 0.0


def test_delta_l_group_scope_normalises_each_group():
    lengths = np.array([2, 4, 8, 16, 100, 100, 0, 50, 0, 0, 0, 0], dtype=np.float64)
    w, _ = delta_l_weights(torch.tensor(lengths), alpha=1.0, num_generations=4, scope="group")
    expected = []
    for grp in lengths.reshape(3, 4):
        valid = grp > 0
        raw = np.where(valid, 1.0 / np.where(valid, grp, 1.0), 0.0)
        expected.append(raw / raw[valid].mean() if valid.any() else raw)
    np.testing.assert_allclose(_np(w), np.concatenate(expected), rtol=2e-6)
    for grp_w, grp_l in zip(_np(w).reshape(3, 4)[:2], lengths.reshape(3, 4)[:2], strict=True):
        assert grp_w[grp_l > 0].mean() == pytest.approx(1.0, rel=1e-6)
    # the batch scope gives different numbers on the same lengths
    wb, _ = delta_l_weights(torch.tensor(lengths), alpha=1.0)
    assert not torch.allclose(w, wb)


def test_delta_l_cap_and_argument_checks():
    w, metrics = delta_l_weights(torch.tensor([1, 100, 100, 100]), alpha=1.0, max_weight=2.0)
    assert w.max().item() == 2.0 and metrics["max_weight"] == 2.0
    with pytest.raises(ValueError, match="alpha"):
        delta_l_weights(torch.ones(4), alpha=-0.5)
    with pytest.raises(ValueError, match="scope"):
        delta_l_weights(torch.ones(4), alpha=1.0, scope="token")
    with pytest.raises(ValueError, match="num_generations"):
        delta_l_weights(torch.ones(5), alpha=1.0, num_generations=2, scope="group")


def _aggregator_variance(x: np.ndarray, lengths: np.ndarray) -> float:
    """Var(Σ x_i g_i) for independent g_i with Var(g_i) = L_i σ², σ = 1."""
    return float(np.sum(x**2 * lengths))


def test_delta_l_alpha_one_minimises_aggregator_variance():
    """Among unbiased linear aggregators (Σ x_i = 1) with Var(g_i) ∝ L_i, the ΔL weights x_i = ω_i / N have variance
    Σ x_i² L_i, smallest at α = 1 where it attains the Lagrange optimum 1 / Σ_i (1/L_i) (arXiv 2509.07558)."""
    lengths = np.array([12, 40, 7, 300, 95, 64, 21, 150], dtype=np.float64)
    n = len(lengths)
    variances = {}
    for alpha in [0.0, 0.5, 1.0, 2.0]:
        w, _ = delta_l_weights(torch.tensor(lengths), alpha=alpha)
        x = _np(w) / n
        assert x.sum() == pytest.approx(1.0, rel=1e-6)  # unbiased
        variances[alpha] = _aggregator_variance(x, lengths)
    optimum = 1.0 / np.sum(1.0 / lengths)
    assert variances[1.0] == pytest.approx(optimum, rel=1e-5)
    assert min(variances, key=variances.get) == 1.0
    assert variances[1.0] < variances[0.5] < variances[0.0]
    assert variances[1.0] < variances[2.0]
    # random unbiased aggregators never beat α = 1
    rng = np.random.default_rng(0)
    for _ in range(200):
        x = rng.dirichlet(np.ones(n)) if rng.random() < 0.5 else rng.normal(size=n)
        x = x / x.sum()
        assert _aggregator_variance(x, lengths) >= variances[1.0] * (1 - 1e-6)


def test_delta_l_monte_carlo_variance_and_unbiasedness():
    """Monte-Carlo: g_i = μ + sqrt(L_i) ε_i. Every x with Σ x = 1 has mean μ; the empirical variance matches the closed
    form and is smallest at α = 1."""
    lengths = np.array([5, 20, 80, 320], dtype=np.float64)
    rng = np.random.default_rng(1)
    mu, trials = 0.7, 200_000
    g = mu + np.sqrt(lengths) * rng.standard_normal((trials, len(lengths)))
    empirical = {}
    for alpha in [0.0, 0.5, 1.0, 2.0]:
        w, _ = delta_l_weights(torch.tensor(lengths), alpha=alpha)
        x = _np(w) / len(lengths)
        agg = g @ x
        assert agg.mean() == pytest.approx(mu, abs=5 * math.sqrt(_aggregator_variance(x, lengths) / trials))
        empirical[alpha] = agg.var()
        assert empirical[alpha] == pytest.approx(_aggregator_variance(x, lengths), rel=0.02)
    assert min(empirical, key=empirical.get) == 1.0


def _ppo_clip_token_loss(ratio: torch.Tensor, adv: torch.Tensor, eps_low=0.2, eps_high=0.28) -> torch.Tensor:
    """`-min(ρ A, clip(ρ, 1-ε, 1+ε_high) A)` per token."""
    return -torch.minimum(ratio * adv, ratio.clamp(1 - eps_low, 1 + eps_high) * adv)


def test_ppo_clip_loss_is_positively_homogeneous_in_the_advantage():
    gen = torch.Generator().manual_seed(0)
    ratio = torch.exp(torch.randn(64, 9, generator=gen, dtype=torch.float64) * 0.4)
    adv = torch.randn(64, 1, generator=gen, dtype=torch.float64).expand(64, 9)
    base = _ppo_clip_token_loss(ratio, adv)
    for omega in [1e-3, 0.37, 1.0, 2.5, 40.0]:
        torch.testing.assert_close(_ppo_clip_token_loss(ratio, omega * adv), omega * base, rtol=1e-12, atol=1e-14)
    # not for ω < 0: the clip acts on the other side (why ΔL weights must be ≥ 0)
    assert not torch.allclose(_ppo_clip_token_loss(ratio, -adv), -base)


def test_delta_l_times_advantage_under_dr_grpo_is_the_paper_aggregator():
    """Σ_i (1/(N L_max)) Σ_t ℓ_it(ω_i A_i) = (1/L_max) Σ_i (L_i^-α / Σ_j L_j^-α) Σ_t ℓ_it(A_i)
    (the identity in the aggregation module's docstring)."""
    gen = torch.Generator().manual_seed(1)
    lengths = torch.tensor([3, 9, 1, 14, 6])
    l_max, alpha = 16, 0.75
    mask = (torch.arange(l_max)[None] < lengths[:, None]).double()
    ratio = torch.exp(torch.randn(5, l_max, generator=gen, dtype=torch.float64) * 0.3)
    adv = torch.randn(5, 1, generator=gen, dtype=torch.float64)
    omega, _ = delta_l_weights(lengths, alpha=alpha)
    per_sample = trl_sample_weights(lengths, "dr_grpo", l_max).double()
    lhs = (per_sample * (_ppo_clip_token_loss(ratio, omega.double()[:, None] * adv) * mask).sum(1)).sum()
    x = lengths.double() ** -alpha
    rhs = ((x / x.sum()) * (_ppo_clip_token_loss(ratio, adv) * mask).sum(1)).sum() / l_max
    assert lhs.item() == pytest.approx(rhs.item(), rel=1e-6)


def test_trl_sample_weights_by_hand():
    lengths = torch.tensor([2, 5, 0, 13])
    np.testing.assert_allclose(_np(trl_sample_weights(lengths, "grpo", 20)), [1 / 8, 1 / 20, 1 / 4, 1 / 52])
    np.testing.assert_allclose(_np(trl_sample_weights(lengths, "dapo", 20)), [1 / 20] * 4)
    np.testing.assert_allclose(_np(trl_sample_weights(lengths, "dr_grpo", 20)), [1 / 80] * 4)
    with pytest.raises(ValueError, match="loss_type"):
        trl_sample_weights(lengths, "bnpo", 20)


# =====================================================================================================================
# 7. DRPO (arXiv 2510.04474)


@st.composite
def _drpo_groups(draw):
    g = draw(st.integers(1, 8))
    b = draw(st.integers(1, 4))
    max_length = draw(st.integers(1, 64))
    correct = draw(st.lists(st.sampled_from([0.0, 1.0, 1.0, math.nan]), min_size=b * g, max_size=b * g))
    lengths = draw(st.lists(st.integers(0, max_length), min_size=b * g, max_size=b * g))
    lam = draw(st.sampled_from([0.05, 0.1, 1.0, 10.0]))
    old = draw(st.one_of(st.none(), st.lists(st.floats(-5, 0, width=32), min_size=b * g, max_size=b * g)))
    return (
        torch.tensor(correct),
        torch.tensor(lengths),
        g,
        max_length,
        lam,
        None if old is None else torch.tensor(old),
    )


@HYPOTHESIS
@given(_drpo_groups())
def test_drpo_coefficient_signs_and_sums(case):
    correct, lengths, g, max_length, lam, old = case
    coef, metrics = drpo_coefficients(correct, lengths, g, max_length, lam=lam, seq_logp_old=old)
    assert coef.shape == correct.shape and torch.isfinite(coef).all()
    c, L, a = correct.view(-1, g), lengths.view(-1, g), coef.view(-1, g)
    pos = (c == 1) & (L > 0)
    neg = (c == 0) & (L > 0)
    valid = pos.any(1) & neg.any(1)
    assert (coef[correct == 1] >= 0).all()  # a correct sample is never pushed down
    assert (coef[correct == 0] <= 0).all()
    for gi in range(c.shape[0]):
        if valid[gi]:
            assert (a[gi][pos[gi]] > 0).all()
            assert (a[gi][neg[gi]] < 0).all()
            assert a[gi][pos[gi]].sum().item() == pytest.approx(1.0, abs=1e-5)
            assert a[gi][neg[gi]].sum().item() == pytest.approx(-1.0, abs=1e-5)
            assert (a[gi][~(pos[gi] | neg[gi])] == 0).all()  # empty or unscored
        else:
            assert (a[gi] == 0).all()
    assert metrics["frac_valid_groups"] == pytest.approx(valid.float().mean().item())


def test_drpo_coefficients_by_hand():
    """Spec §4 example: λ = 0.1, L_max = 8192, correct answers of 2000 and 4000 tokens -> 0.92 / 0.08 (the preference
    for shorter answers); two negatives share -1 uniformly (no s_old) or by softmax(s_old/τ)."""
    correct = torch.tensor([1.0, 1.0, 0.0, 0.0])
    lengths = torch.tensor([2000, 4000, 100, 8000])
    coef, _ = drpo_coefficients(correct, lengths, 4, 8192, lam=0.1)
    e1, e2 = math.exp((1 - 2000 / 8192) / 0.1), math.exp((1 - 4000 / 8192) / 0.1)
    np.testing.assert_allclose(_np(coef), [e1 / (e1 + e2), e2 / (e1 + e2), -0.5, -0.5], rtol=1e-5)
    assert coef[0].item() == pytest.approx(0.92, abs=0.005)
    old = torch.tensor([-0.1, -0.2, -0.5, -2.5])
    coef_old, _ = drpo_coefficients(correct, lengths, 4, 8192, lam=0.1, tau=2.0, seq_logp_old=old)
    n1, n2 = math.exp(-0.5 / 2.0), math.exp(-2.5 / 2.0)
    np.testing.assert_allclose(_np(coef_old)[2:], [-n1 / (n1 + n2), -n2 / (n1 + n2)], rtol=1e-5)
    np.testing.assert_allclose(_np(coef_old)[:2], _np(coef)[:2], rtol=1e-6)  # s_old only touches the negatives
    with pytest.raises(ValueError, match="lam"):
        drpo_coefficients(correct, lengths, 4, 8192, lam=0.0)


def test_drpo_never_penalises_correct_samples_where_length_penalised_grpo_does():
    """Spec §4 property check: with reward r·(1 - 0.5·L/L_max), GRPO gives some correct samples a negative advantage
    (found deterministically below); DRPO's coefficient is > 0 for every correct, non-empty sample of a valid group."""
    gen = torch.Generator().manual_seed(0)
    g, b, l_max = 8, 64, 512
    correct = torch.bernoulli(torch.full((b * g,), 0.6), generator=gen)
    lengths = torch.randint(1, l_max + 1, (b * g,), generator=gen)
    penalised = correct * (1 - 0.5 * lengths.float() / l_max)
    grpo, _ = grpo_advantages(penalised[:, None], lengths, g, torch.ones(1))
    negative_correct = (correct == 1) & (grpo < 0)
    assert negative_correct.sum() >= 1
    coef, _ = drpo_coefficients(correct, lengths, g, l_max)
    valid = ((correct.view(-1, g) == 1).any(1) & (correct.view(-1, g) == 0).any(1)).repeat_interleave(g)
    assert (coef[(correct == 1) & valid] > 0).all()
    assert (coef[negative_correct & valid] > 0).all()
    assert (coef[correct == 1] >= 0).all()


def test_sequence_logp_is_masked_length_mean():
    lp = torch.tensor([[-1.0, -2.0, -3.0, -100.0], [-0.5, -100.0, -100.0, -100.0], [-9.0, -9.0, -9.0, -9.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    np.testing.assert_allclose(_np(sequence_logp(lp, mask)), [-2.0, -0.5, 0.0])


def _random_batch(seed: int, b: int = 5, t: int = 7):
    gen = torch.Generator().manual_seed(seed)
    lp = -torch.rand(b, t, generator=gen, dtype=torch.float64) * 3
    lengths = torch.tensor([7, 3, 1, 5, 0])[:b]
    mask = (torch.arange(t)[None] < lengths[:, None]).double()
    adv = torch.randn(b, generator=gen, dtype=torch.float64) * 4
    return lp, mask, adv, lengths


def test_drpo_loss_on_policy_gradient_by_hand():
    """On-policy (no old logps): loss = -(1/B) Σ_i a_i s_i, so ∂loss/∂lp_it = -a_i m_it / (B L_i); KL term is 0."""
    lp, mask, adv, lengths = _random_batch(0)
    lp.requires_grad_(True)
    loss, parts = drpo_loss(lp, mask, adv)
    loss.backward()
    b = lp.shape[0]
    expected_grad = -adv[:, None] * mask / (b * lengths.clamp(min=1).double()[:, None])
    np.testing.assert_allclose(_np(lp.grad), _np(expected_grad), rtol=1e-5, atol=1e-7)
    s = (lp.detach() * mask).sum(1) / lengths.clamp(min=1)
    assert loss.item() == pytest.approx(-(adv * s).mean().item(), rel=1e-5)
    assert parts["kl"].item() == 0.0 and parts["penalty"].item() == 0.0
    assert parts["policy_loss"].item() == pytest.approx(loss.item())


def test_drpo_loss_kl_hinge_only_above_delta():
    """With old logps: KL = Σ m (old - lp) / Σ m. Below δ the hinge is 0 (gradient = policy part only); above δ the
    penalty is β(KL - δ)·KL with a detached coefficient, adding -β(KL - δ) m_it / Σ m to the gradient."""
    lp, mask, adv, lengths = _random_batch(1)
    lp = lp.float().double()  # fp32-representable, so the implementation's fp32 difference old - lp is exact
    b, n_tok, beta, delta = lp.shape[0], mask.sum(), 1e3, 1e-4
    policy_grad = -adv[:, None] * mask / (b * lengths.clamp(min=1).double()[:, None])
    # KL ≈ 5e-5 < δ (no penalty), then KL ≈ 0.3 > δ
    for shift, above in [(5e-5, False), (0.3, True)]:
        cur = lp.clone().requires_grad_(True)
        old = (lp + shift).float().double()
        loss, parts = drpo_loss(cur, mask, adv, old_per_token_logps=old, delta=delta, beta=beta)
        loss.backward()
        kl = ((old - lp) * mask).sum().item() / n_tok.item()  # float64 masked token mean
        assert kl == pytest.approx(shift, rel=1e-2)
        assert parts["kl"].item() == pytest.approx(kl, rel=1e-5)
        if above:
            coef = beta * (kl - delta)
            assert parts["penalty"].item() == pytest.approx(coef * kl, rel=1e-5)
            expected = policy_grad - coef * mask / n_tok
        else:
            assert parts["penalty"].item() == 0.0
            expected = policy_grad
        np.testing.assert_allclose(_np(cur.grad), _np(expected), rtol=1e-5, atol=1e-7)


def test_drpo_loss_k3_and_bad_kl_type():
    lp, mask, adv, _ = _random_batch(2)
    old = lp + 0.2 * torch.sin(torch.arange(lp.numel(), dtype=torch.float64)).view_as(lp)
    _, parts = drpo_loss(lp, mask, adv, old_per_token_logps=old, kl_type="k3")
    d = (old - lp).numpy()
    m = mask.numpy() > 0
    k3 = (np.exp(d) - d - 1)[m].sum() / m.sum()
    assert parts["kl"].item() == pytest.approx(k3, rel=1e-5)
    with pytest.raises(ValueError, match="kl_type"):
        drpo_loss(lp, mask, adv, old_per_token_logps=old, kl_type="js")


# =====================================================================================================================
# 8. On-policy SFT (arXiv 2602.13407)


def test_onpolicy_sft_loss_is_nll_over_kept_tokens():
    gen = torch.Generator().manual_seed(0)
    lp = (-torch.rand(4, 6, generator=gen) * 4).requires_grad_(True)
    mask = torch.tensor(
        [[1, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1], [1, 0, 0, 0, 0, 0]], dtype=torch.float32
    )
    values = lp.detach().double().numpy()
    nll = -sum(values[i, j] for i in range(4) for j in range(6) if mask[i, j] > 0)
    for normalizer in [torch.tensor(10.0), 10, 3.0]:
        loss, parts = onpolicy_sft_loss(lp, mask, normalizer)
        assert loss.item() == pytest.approx(nll / float(normalizer), rel=1e-6)
        assert parts["kept_tokens"].item() == 10
    loss, _ = onpolicy_sft_loss(lp, mask, 10)
    loss.backward()
    np.testing.assert_allclose(_np(lp.grad), -_np(mask) / 10, rtol=1e-6)  # dropped tokens get 0


def test_onpolicy_sft_nothing_kept_is_a_finite_zero_with_zero_gradient():
    lp = (-torch.rand(3, 5) * 2).requires_grad_(True)
    loss, parts = onpolicy_sft_loss(lp, torch.zeros(3, 5), torch.tensor(0.0))
    assert loss.requires_grad and torch.isfinite(loss) and loss.item() == 0.0
    loss.backward()
    assert lp.grad is not None and torch.equal(lp.grad, torch.zeros(3, 5))
    assert parts["kept_tokens"].item() == 0


def test_onpolicy_sft_keep():
    correct = torch.tensor([1.0, 1.0, 0.0, math.nan, 1.0])
    eos = torch.tensor([True, False, True, True, True])
    assert onpolicy_sft_keep(correct, eos).tolist() == [True, False, False, False, True]
    assert onpolicy_sft_keep(correct, eos, require_eos=False).tolist() == [True, True, False, False, True]
    assert onpolicy_sft_keep(correct, torch.tensor([1, 0, 1, 1, 1])).tolist() == [True, False, False, False, True]
