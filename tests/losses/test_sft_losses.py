"""Unit tests of the pure SFT objectives in `hf_stable.losses.sft` and of the method registry.

Every expected value is computed independently of the implementation: by hand, in float64 (numpy or torch), by
autograd of an independently written formula, or by central finite differences. The implementation runs its
transforms in fp32 (its documented contract), so tolerances against float64 references are fp32-sized.

Papers: the probability family and thresholds (arXiv 2510.00526), REDI (arXiv 2505.24850), Feasible Learning
(arXiv 2501.14912); the `auto` rule is hf_stable's (docs/sft.md).
"""

from __future__ import annotations

import inspect
import io
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_stable.losses.sft import (
    DEFAULT_AUTO_RULE,
    PROBE_QUANTILES,
    SFT_OBJECTIVES,
    SFT_SAMPLE_REWEIGHTING,
    SFT_SEQUENCE_OBJECTIVES,
    SFT_THRESHOLDS,
    UNLIKELIHOOD_EPS,
    choose_objective,
    feasible_dual_update,
    nll_loss,
    prob_power_loss,
    probe_statistics,
    quantile,
    redi_loss,
    redi_terms,
    sequence_mean,
    sequence_sums,
    threshold_loss,
    token_weight,
)
from hf_stable.registry import Registry, get_registry, list_methods


THRESHOLD_KINDS = ["top_p", "bottom_p", "top_logp", "bottom_logp", "unlikelihood_top", "unlikelihood_bottom"]
TOP_KINDS = {"top_p", "top_logp", "unlikelihood_top"}

# fp32 relative precision the implementation can be held to against a float64 reference.
FP32_RTOL = 2e-6

HYPOTHESIS = settings(max_examples=100, deadline=None)


def _row(values, dtype=torch.float32) -> torch.Tensor:
    return torch.tensor([values], dtype=dtype)


def _all_true(shape) -> torch.Tensor:
    return torch.ones(shape, dtype=torch.bool)


def _f64(x: torch.Tensor) -> np.ndarray:
    return x.detach().double().numpy()


# Independent float64 formulas of the per-token losses ℓ(log p) and of their derivatives dℓ/d(log p).
def _ref_loss(kind: str, lp: np.ndarray) -> np.ndarray:
    p = np.exp(lp)
    if kind.endswith("_p"):
        return 1.0 - p
    if kind.endswith("_logp"):
        return -lp
    return np.log(1.0 - p + 1e-3)


def _ref_dloss_dlogp(kind: str, lp: np.ndarray) -> np.ndarray:
    p = np.exp(lp)
    if kind.endswith("_p"):  # d(1 - e^x)/dx
        return -p
    if kind.endswith("_logp"):  # d(-x)/dx
        return -np.ones_like(lp)
    return -p / (1.0 - p + 1e-3)  # d log(1 - e^x + eps)/dx


# =====================================================================================================================
# 1. prob_power_loss values


P_TABLE = [1e-4, 0.01, 0.05, 0.3, 0.5, 0.9, 0.999, 1.0]


def test_prob_power_alpha_zero_is_exactly_nll():
    """α = 0 is `-log p` bit for bit, and identical to `nll_loss`."""
    lp = torch.log(torch.tensor([P_TABLE]))
    mask = _all_true(lp.shape)
    loss, active = prob_power_loss(lp, mask, alpha=0.0)
    assert torch.equal(loss, -lp)
    assert torch.equal(active, mask)
    nll, nll_active = nll_loss(lp, mask)
    assert torch.equal(nll, -lp)
    assert torch.equal(nll_active, mask)


def test_prob_power_alpha_one_is_one_minus_p():
    """α = 1 is `1 - p` (the paper's "-p"), against float64 `1 - exp(log p)`."""
    lp = torch.log(torch.tensor([P_TABLE]))
    loss, _ = prob_power_loss(lp, _all_true(lp.shape), alpha=1.0)
    expected = 1.0 - np.exp(_f64(lp))
    np.testing.assert_allclose(_f64(loss), expected, rtol=FP32_RTOL, atol=1e-12)


@pytest.mark.parametrize("alpha", [0.1, 0.5, 2.0, 3.7, 10.0, 20.0])
def test_prob_power_general_alpha_matches_float64_formula(alpha):
    """General α: `(1 - p^α)/α` computed in float64 from the same (fp32) log-probs."""
    rng = np.random.default_rng(0)
    p = np.concatenate([rng.uniform(1e-6, 1.0, size=40), P_TABLE])
    lp = torch.tensor(np.log(p), dtype=torch.float32).reshape(4, -1)
    loss, _ = prob_power_loss(lp, _all_true(lp.shape), alpha=alpha)
    p64 = np.exp(_f64(lp))
    expected = (1.0 - p64**alpha) / alpha
    np.testing.assert_allclose(_f64(loss), expected, rtol=FP32_RTOL, atol=1e-12)
    assert loss.dtype == torch.float32


def test_prob_power_small_alpha_is_stable_where_naive_formula_cancels():
    """α = 1e-6: the expm1 form stays within ~1e-6 of `-log p`; the naive fp32 `(1 - p^α)/α` is orders of magnitude
    worse (catastrophic cancellation of `1 - p^α`), as §2.1.5 warns."""
    alpha = 1e-6
    lp = torch.log(torch.tensor([[0.01, 0.1, 0.3, 0.5, 0.7, 0.9, 0.99]]))
    lp64 = _f64(lp)
    exact = -np.expm1(alpha * lp64) / alpha  # float64 reference
    ours, _ = prob_power_loss(lp, _all_true(lp.shape), alpha=alpha)
    naive = (1.0 - torch.exp(lp).pow(alpha)) / alpha  # the naive formula, evaluated in fp32
    err_ours = np.max(np.abs(_f64(ours) - exact) / exact)
    err_naive = np.max(np.abs(_f64(naive) - exact) / exact)
    # ours matches -log p up to the true O(α) term (relative α|log p|/2 ≤ 2.3e-6 at p = 0.01)
    np.testing.assert_allclose(_f64(ours), -lp64, rtol=5e-6)
    assert err_ours < 1e-6
    assert err_naive > 1e-3, "the naive formula should visibly cancel in fp32 at α = 1e-6"
    assert err_naive > 100 * err_ours


def test_prob_power_runs_in_fp32_for_low_precision_inputs():
    """bf16 log-probs are upcast: the result is fp32 and equals the fp32 computation on the same (bf16) values."""
    lp = torch.log(torch.tensor([[0.2, 0.6, 0.95]])).bfloat16()
    loss, _ = prob_power_loss(lp, _all_true(lp.shape), alpha=2.0)
    assert loss.dtype == torch.float32
    p64 = np.exp(lp.double().numpy())
    np.testing.assert_allclose(_f64(loss), (1 - p64**2) / 2, rtol=FP32_RTOL)


# =====================================================================================================================
# 2. Logit gradient: NLL's gradient scaled by p^α


ALPHAS = [0.0, 0.5, 1.0, 2.0, 10.0]


def _logits_and_targets(n=6, vocab=7, seed=1):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, vocab, generator=g, dtype=torch.float64) * 1.5
    y = torch.randint(0, vocab, (n,), generator=g)
    return z, y


def _expected_logit_grad(z: torch.Tensor, y: torch.Tensor, alpha: float) -> torch.Tensor:
    """`p^α (softmax(z) - onehot(y))` in float64 (the logit gradient of the family, arXiv 2510.00526)."""
    s = torch.softmax(z, -1)
    p = s.gather(-1, y[:, None])
    return p**alpha * (s - torch.nn.functional.one_hot(y, z.shape[-1]).double())


def _impl_loss_of_logits(z: torch.Tensor, y: torch.Tensor, alpha: float) -> torch.Tensor:
    lp = torch.log_softmax(z, -1).gather(-1, y[:, None]).T  # (1, n)
    loss, _ = prob_power_loss(lp, _all_true(lp.shape), alpha=alpha)
    return loss[0]  # (n,)


def _ref_loss_of_logits(z: torch.Tensor, y: torch.Tensor, alpha: float) -> torch.Tensor:
    """Independent float64 formula: `-log p` for α = 0, `(1 - p^α)/α` otherwise."""
    p = torch.softmax(z, -1).gather(-1, y[:, None])
    return (-torch.log(p))[:, 0] if alpha == 0 else ((1 - p**alpha) / alpha)[:, 0]


def _central_differences(f, z: torch.Tensor, eps: float) -> torch.Tensor:
    """d f_i / d z_ij for a row-separable f returning per-row losses (n,): only row i's loss enters each quotient,
    so the fp32 rounding of the other rows does not pollute it."""
    grad = torch.zeros_like(z)
    for i, j in np.ndindex(*z.shape):
        zp, zm = z.clone(), z.clone()
        zp[i, j] += eps
        zm[i, j] -= eps
        grad[i, j] = (f(zp)[i] - f(zm)[i]) / (2 * eps)
    return grad


@pytest.mark.parametrize("alpha", ALPHAS)
def test_logit_gradient_by_autograd(alpha):
    """Autograd through `prob_power_loss(log_softmax(z)[y])` gives `p^α (softmax - e_y)` to fp32 relative
    precision (p ranges over 0.05–0.29 here, so p^10 spans ~1e-13–4e-6)."""
    z, y = _logits_and_targets()
    z.requires_grad_(True)
    _impl_loss_of_logits(z, y, alpha).sum().backward()
    expected = _expected_logit_grad(z.detach(), y, alpha)
    torch.testing.assert_close(z.grad, expected, rtol=1e-5, atol=1e-12)


@pytest.mark.parametrize("alpha", ALPHAS)
def test_logit_gradient_formula_by_finite_differences(alpha):
    """Central differences (float64, eps = 1e-6) of the float64 loss formula confirm the weight `p^α` derivation."""
    z, y = _logits_and_targets()
    fd = _central_differences(lambda zz: _ref_loss_of_logits(zz, y, alpha), z, eps=1e-6)
    torch.testing.assert_close(fd, _expected_logit_grad(z, y, alpha), rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("alpha", ALPHAS)
def test_logit_gradient_of_implementation_by_finite_differences(alpha):
    """Central differences through the implementation itself. It computes in fp32 (documented), so eps = 1e-6 would
    only measure fp32 rounding; eps = 1e-2 keeps truncation (~eps²/6) and rounding (~|ℓ|·6e-8/eps) near 1e-5."""
    z, y = _logits_and_targets()
    fd = _central_differences(lambda zz: _impl_loss_of_logits(zz, y, alpha), z, eps=1e-2)
    torch.testing.assert_close(fd, _expected_logit_grad(z, y, alpha), rtol=0, atol=1e-4)


@pytest.mark.parametrize(("p", "alpha"), [(0.1, 10.0), (0.29, 10.0), (0.01, 4.0)])
def test_log_prob_gradient_equals_token_weight_for_small_weights(p, alpha):
    """d ℓ / d log p = -p^α = -token_weight, to fp32 relative precision, even where p^α is far below 1.

    Regression: autograd's expm1 backward, grad·(expm1(x) + 1), cancels in fp32 and flushed weights below ~3e-8 to 0.
    """
    lp = torch.tensor([[math.log(p)]], requires_grad=True)
    prob_power_loss(lp, _all_true((1, 1)), alpha=alpha)[0].sum().backward()
    exact = -(math.exp(lp.item()) ** alpha)
    assert lp.grad.item() != 0.0
    assert lp.grad.item() == pytest.approx(exact, rel=1e-5)


@pytest.mark.parametrize("alpha", ALPHAS)
def test_token_weight_is_p_to_the_alpha(alpha):
    """`token_weight(log p, α) = p^α`, fp32 result."""
    p = np.array([[1e-3, 0.01, 0.2, 0.5, 0.9, 0.99, 1.0]])
    w = token_weight(torch.tensor(np.log(p)), alpha)
    assert w.dtype == torch.float32
    np.testing.assert_allclose(_f64(w), p**alpha, rtol=5e-6, atol=1e-30)


def test_alpha_one_is_gradient_identical_to_dft():
    """Spec §2.1.1: trl's DFT loss `-sg(p) log p` has the same logit gradient as α = 1."""
    z, y = _logits_and_targets(seed=3)
    z1 = z.clone().requires_grad_(True)
    _impl_loss_of_logits(z1, y, 1.0).sum().backward()
    z2 = z.clone().requires_grad_(True)
    lp = torch.log_softmax(z2, -1).gather(-1, y[:, None])
    (-(lp.detach().exp() * lp)).sum().backward()
    torch.testing.assert_close(z1.grad, z2.grad, rtol=1e-5, atol=1e-12)


# =====================================================================================================================
# 3. Masks: unsupervised positions never contribute


def _objectives():
    """(id, callable(log_probs, mask) -> (loss, active), uses expm1 of log_probs)."""
    out = [("nll", lambda lp, m: nll_loss(lp, m), False)]
    for alpha in (0.0, 0.5, 1.0, 10.0):
        out.append((f"prob_power-{alpha}", lambda lp, m, a=alpha: prob_power_loss(lp, m, alpha=a), alpha > 0))
    for kind in THRESHOLD_KINDS:
        uses_expm1 = not kind.endswith("_logp")
        out.append((kind, lambda lp, m, k=kind: threshold_loss(lp, m, kind=k, threshold=0.5), uses_expm1))
    return out


OBJECTIVES = _objectives()


def _masked_batch(fill: float):
    """(2, 5) log-probs that are `fill` everywhere except three supervised positions."""
    lp = torch.full((2, 5), fill)
    mask = torch.zeros(2, 5, dtype=torch.bool)
    for (i, j), p in {(0, 1): 0.7, (0, 3): 0.2, (1, 0): 0.95}.items():
        lp[i, j] = math.log(p)
        mask[i, j] = True
    return lp, mask


@pytest.mark.parametrize("fill", [-math.inf, math.nan], ids=["-inf", "nan"])
@pytest.mark.parametrize(("name", "fn"), [o[:2] for o in OBJECTIVES], ids=[o[0] for o in OBJECTIVES])
def test_unsupervised_positions_contribute_exactly_zero_loss(name, fn, fill):
    """Loss is exactly 0 and `active` is False outside the mask, whatever log_probs holds there (-inf, NaN); the
    supervised positions are unaffected by the garbage next to them."""
    lp, mask = _masked_batch(fill)
    loss, active = fn(lp, mask)
    assert torch.isfinite(loss).all(), f"{name}: non-finite loss with {fill} at unsupervised positions"
    assert (loss[~mask] == 0).all()
    assert not active[~mask].any()
    clean_lp = torch.where(mask, lp, torch.zeros(()))
    clean_loss, clean_active = fn(clean_lp, mask)
    assert torch.equal(loss, clean_loss)
    assert torch.equal(active, clean_active)


def _grad_params():
    params = []
    for name, fn, _ in OBJECTIVES:
        params.append(pytest.param(name, fn, -math.inf, id=f"{name}--inf"))
        params.append(pytest.param(name, fn, math.nan, id=f"{name}-nan"))
    return params


@pytest.mark.parametrize(("name", "fn", "fill"), _grad_params())
def test_unsupervised_positions_get_exactly_zero_gradient(name, fn, fill):
    """The gradient w.r.t. log_probs is finite everywhere and exactly 0 at unsupervised positions (regression: a NaN
    there used to leak through expm1's backward)."""
    lp, mask = _masked_batch(fill)
    lp.requires_grad_(True)
    loss, _ = fn(lp, mask)
    loss.sum().backward()
    grad = lp.grad
    assert torch.isfinite(grad[mask]).all()
    assert torch.isfinite(grad).all(), name
    assert (grad[~mask] == 0).all()


# =====================================================================================================================
# 4. Thresholded objectives


HAND_P = [0.05, 0.3, 0.5, 0.9, 1.0]


def _hand_table():
    """Log-probs of HAND_P in fp32 and a threshold equal to the fp32 probability of the p = 0.5 token (a tie)."""
    lp = torch.tensor([[math.log(p) for p in HAND_P]], dtype=torch.float32)
    tie = lp.exp()[0, 2].item()  # exactly the probability the function derives for that token
    assert abs(tie - 0.5) < 1e-7
    return lp, tie


@pytest.mark.parametrize("kind", THRESHOLD_KINDS)
def test_threshold_active_tokens_include_ties(kind):
    """Threshold 0.5 on p = [0.05, 0.3, 0.5, 0.9, 1.0]: top kinds keep p >= 0.5, bottom kinds keep p <= 0.5 (the tie
    is kept by both)."""
    lp, tie = _hand_table()
    _, active = threshold_loss(lp, _all_true(lp.shape), kind=kind, threshold=tie)
    expected = [False, False, True, True, True] if kind in TOP_KINDS else [True, True, True, False, False]
    assert active[0].tolist() == expected


@pytest.mark.parametrize("kind", THRESHOLD_KINDS)
def test_threshold_active_is_anded_with_mask(kind):
    """A token that passes the threshold but is not supervised is inactive (the §2.1.5 pitfall)."""
    lp, tie = _hand_table()
    mask = torch.tensor([[True, False, False, True, True]])
    loss, active = threshold_loss(lp, mask, kind=kind, threshold=tie)
    expected = [False, False, False, True, True] if kind in TOP_KINDS else [True, False, False, False, False]
    assert active[0].tolist() == expected
    assert (loss[~active] == 0).all()


def test_threshold_per_token_values_by_hand():
    """Per-token values at p = [0.05, 0.3, 0.5, 0.9, 1.0] with the threshold at 0.5, written out by hand."""
    lp, tie = _hand_table()
    mask = _all_true(lp.shape)
    one_minus_p = [0.95, 0.7, 0.5, 0.1, 0.0]
    neg_log_p = [-math.log(p) for p in HAND_P]
    unlikely = [math.log(1 - p + 1e-3) for p in HAND_P]
    top, bottom = [0, 0, 1, 1, 1], [1, 1, 1, 0, 0]
    cases = {
        "top_p": [v * a for v, a in zip(one_minus_p, top, strict=True)],
        "bottom_p": [v * a for v, a in zip(one_minus_p, bottom, strict=True)],
        "top_logp": [v * a for v, a in zip(neg_log_p, top, strict=True)],
        "bottom_logp": [v * a for v, a in zip(neg_log_p, bottom, strict=True)],
        "unlikelihood_top": [v * a for v, a in zip(unlikely, top, strict=True)],
        "unlikelihood_bottom": [v * a for v, a in zip(unlikely, bottom, strict=True)],
    }
    assert set(cases) == set(SFT_THRESHOLDS.names())
    for kind, expected in cases.items():
        loss, _ = threshold_loss(lp, mask, kind=kind, threshold=tie)
        np.testing.assert_allclose(_f64(loss)[0], expected, rtol=1e-6, atol=1e-7, err_msg=kind)


@pytest.mark.parametrize("kind", THRESHOLD_KINDS)
def test_threshold_mask_carries_no_gradient(kind):
    """d loss / d log p equals the per-token formula's derivative times the active indicator, in float64."""
    rng = np.random.default_rng(7)
    p = np.concatenate([rng.uniform(0.01, 0.99, size=18), [0.51, 1.0]])  # exact ties: see the hand table
    lp = torch.tensor(np.log(p), dtype=torch.float32).reshape(2, 10).requires_grad_(True)
    mask = torch.tensor(rng.uniform(size=(2, 10)) < 0.8)
    loss, active = threshold_loss(lp, mask, kind=kind, threshold=0.5)
    loss.sum().backward()
    lp64 = _f64(lp)
    p64 = np.exp(lp64)
    expected_active = _f64(mask).astype(bool) & ((p64 >= 0.5) if kind in TOP_KINDS else (p64 <= 0.5))
    assert active.numpy().tolist() == expected_active.tolist()
    expected_grad = _ref_dloss_dlogp(kind, lp64) * expected_active
    np.testing.assert_allclose(_f64(lp.grad), expected_grad, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(_f64(loss), _ref_loss(kind, lp64) * expected_active, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["unlikelihood_top", "unlikelihood_bottom"])
def test_unlikelihood_is_finite_at_p_equal_one(kind):
    """At p = 1 (log p = 0) unlikelihood is `log(1e-3)` with gradient `-1/1e-3`: finite, no NaN."""
    assert UNLIKELIHOOD_EPS == 1e-3
    lp = torch.zeros(1, 3, requires_grad=True)
    loss, active = threshold_loss(lp, _all_true(lp.shape), kind=kind, threshold=1.0)
    assert active.all()  # p = 1 satisfies both p >= 1 and p <= 1
    np.testing.assert_allclose(_f64(loss), math.log(1e-3), rtol=1e-6)
    loss.sum().backward()
    np.testing.assert_allclose(_f64(lp.grad), -1.0 / 1e-3, rtol=1e-5)


def test_threshold_extremes_keep_everything_supervised():
    """threshold 0 keeps every supervised token for top kinds, threshold 1 for bottom kinds."""
    lp, _ = _hand_table()
    mask = torch.tensor([[True, True, False, True, True]])
    for kind in THRESHOLD_KINDS:
        _, active = threshold_loss(lp, mask, kind=kind, threshold=0.0 if kind in TOP_KINDS else 1.0)
        assert torch.equal(active, mask), kind


def test_threshold_registry_entries_match_dispatch():
    """Calling a `sft_threshold` method directly equals `threshold_loss(kind=...)`."""
    lp, _ = _hand_table()
    mask = _all_true(lp.shape)
    for kind in THRESHOLD_KINDS:
        direct = SFT_THRESHOLDS.get(kind)(lp, mask, threshold=0.4)
        via = threshold_loss(lp, mask, kind=kind, threshold=0.4)
        assert torch.equal(direct[0], via[0]) and torch.equal(direct[1], via[1])


# =====================================================================================================================
# 5. Batches without an active token


@pytest.mark.parametrize(
    ("kind", "threshold", "probs"),
    [
        ("top_p", 1.0, [[0.1, 0.5, 0.9], [0.2, 0.3, 0.8]]),
        ("top_logp", 1.0, [[0.1, 0.5, 0.9], [0.2, 0.3, 0.8]]),
        ("unlikelihood_top", 1.0, [[0.1, 0.5, 0.9], [0.2, 0.3, 0.8]]),
        ("bottom_p", 0.0, [[0.1, 0.5, 0.9], [0.2, 0.3, 0.8]]),
        ("bottom_logp", 0.0, [[0.1, 0.5, 0.9], [0.2, 0.3, 0.8]]),
        ("unlikelihood_bottom", 0.0, [[0.1, 0.5, 0.9], [0.2, 0.3, 0.8]]),
    ],
)
def test_no_active_token_gives_finite_zero_that_backpropagates(kind, threshold, probs):
    """No token passes the threshold: the summed loss is a finite 0 still attached to the graph, and backward gives
    zero gradients."""
    lp = torch.log(torch.tensor(probs)).requires_grad_(True)
    loss, active = threshold_loss(lp, _all_true(lp.shape), kind=kind, threshold=threshold)
    assert not active.any()
    total = loss.sum()
    assert total.requires_grad
    assert torch.isfinite(total) and total.item() == 0.0
    total.backward()
    assert lp.grad is not None and torch.equal(lp.grad, torch.zeros_like(lp))


@pytest.mark.parametrize(("name", "fn"), [o[:2] for o in OBJECTIVES], ids=[o[0] for o in OBJECTIVES])
def test_fully_unsupervised_batch_is_a_differentiable_zero(name, fn):
    """An all-False mask gives a zero loss that keeps the graph, for every objective."""
    lp = torch.log(torch.tensor([[0.3, 0.6]])).requires_grad_(True)
    loss, active = fn(lp, torch.zeros(1, 2, dtype=torch.bool))
    assert not active.any()
    total = loss.sum()
    assert total.requires_grad and total.item() == 0.0
    total.backward()
    assert torch.equal(lp.grad, torch.zeros_like(lp))


# =====================================================================================================================
# 6. Argument validation


@pytest.mark.parametrize("threshold", [-0.1, 1.0001, 2.0, math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("kind", THRESHOLD_KINDS)
def test_threshold_outside_unit_interval_raises(kind, threshold):
    """A threshold that is not a probability in [0, 1] (NaN included) is rejected."""
    lp = torch.log(torch.tensor([[0.5]]))
    with pytest.raises(ValueError, match="threshold"):
        threshold_loss(lp, _all_true(lp.shape), kind=kind, threshold=threshold)


@pytest.mark.parametrize("alpha", [-1.0, -1e-9, math.nan, math.inf, -math.inf])
def test_invalid_alpha_raises(alpha):
    """α must be finite and >= 0."""
    lp = torch.log(torch.tensor([[0.5]]))
    with pytest.raises(ValueError, match="alpha"):
        prob_power_loss(lp, _all_true(lp.shape), alpha=alpha)


@pytest.mark.parametrize(
    "fn",
    [
        lambda lp, m: nll_loss(lp, m),
        lambda lp, m: prob_power_loss(lp, m, alpha=1.0),
        lambda lp, m: threshold_loss(lp, m, kind="top_p", threshold=0.5),
        lambda lp, m: threshold_loss(lp, m, kind="bottom_logp", threshold=0.5),
    ],
    ids=["nll", "prob_power", "top_p", "bottom_logp"],
)
def test_shape_mismatch_raises(fn):
    """log_probs and mask must have the same shape (no silent broadcasting)."""
    lp = torch.zeros(2, 3)
    for shape in [(2, 4), (1, 3), (6,)]:
        mask = torch.ones(shape, dtype=torch.bool)
        with pytest.raises(ValueError, match="same shape"):
            fn(lp, mask)


def test_unknown_threshold_kind_lists_valid_names():
    """`threshold_loss(kind="nope")` fails with the list of valid kinds."""
    lp = torch.zeros(1, 2)
    with pytest.raises(ValueError) as excinfo:
        threshold_loss(lp, _all_true(lp.shape), kind="nope", threshold=0.5)
    message = str(excinfo.value)
    assert "nope" in message
    for kind in THRESHOLD_KINDS:
        assert kind in message


# =====================================================================================================================
# 7. Per-sequence reductions


LENGTHS = [4, 2, 0, 3]  # supervised tokens per sequence (sequence 2 has a prompt but no completion)
PROMPTS = [2, 1, 3, 1]


def _padded_and_packed(seed=0):
    """The same sequences as a right-padded (B, T) batch and as one packed row with `seq_idx`."""
    rng = np.random.default_rng(seed)
    seqs = [rng.normal(size=p + n) for p, n in zip(PROMPTS, LENGTHS, strict=True)]
    masks = [np.r_[np.zeros(p, bool), np.ones(n, bool)] for p, n in zip(PROMPTS, LENGTHS, strict=True)]
    T = max(len(s) for s in seqs) + 1  # at least one padding position per row
    padded_v = np.full((len(seqs), T), 123.0)  # padding holds junk
    padded_m = np.zeros((len(seqs), T), bool)
    for i, (s, m) in enumerate(zip(seqs, masks, strict=True)):
        padded_v[i, : len(s)] = s
        padded_m[i, : len(m)] = m
    packed_v = np.concatenate(seqs)[None]
    packed_m = np.concatenate(masks)[None]
    seq_idx = np.concatenate([np.full(len(s), i) for i, s in enumerate(seqs)])[None]
    expected_sums = np.array([s[m].sum() for s, m in zip(seqs, masks, strict=True)])
    expected_counts = np.array([m.sum() for m in masks], dtype=float)
    return (
        (torch.tensor(padded_v), torch.tensor(padded_m)),
        (torch.tensor(packed_v), torch.tensor(packed_m), torch.tensor(seq_idx)),
        expected_sums,
        expected_counts,
    )


def test_sequence_sums_padded_equals_packed_equals_brute_force():
    """Per-sequence sums and counts agree between padded rows, a packed row with `seq_idx`, and float64 numpy."""
    (pv, pm), (kv, km, idx), sums, counts = _padded_and_packed()
    s_pad, c_pad = sequence_sums(pv, pm)
    s_pack, c_pack = sequence_sums(kv, km, seq_idx=idx, num_sequences=len(LENGTHS))
    assert s_pad.dtype == torch.float32 and s_pack.dtype == torch.float32
    np.testing.assert_allclose(_f64(s_pad), sums, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(_f64(s_pack), sums, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(_f64(c_pad), counts)
    np.testing.assert_array_equal(_f64(c_pack), counts)


def test_sequence_mean_padded_equals_packed_and_zero_length_is_zero():
    """Length-normalised means agree between layouts; a sequence with no supervised token has mean 0, not NaN."""
    (pv, pm), (kv, km, idx), sums, counts = _padded_and_packed(seed=1)
    expected = np.where(counts > 0, sums / np.maximum(counts, 1), 0.0)
    m_pad = sequence_mean(pv, pm)
    m_pack = sequence_mean(kv, km, seq_idx=idx, num_sequences=len(LENGTHS))
    np.testing.assert_allclose(_f64(m_pad), expected, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(_f64(m_pack), expected, rtol=1e-6, atol=1e-6)
    assert m_pad[2].item() == 0.0 and m_pack[2].item() == 0.0
    assert torch.isfinite(m_pad).all() and torch.isfinite(m_pack).all()


def test_sequence_sums_default_num_sequences_and_trailing_empty_sequences():
    """Without `num_sequences` S = max(seq_idx) + 1; with it, sequences absent from the batch get sum = count = 0."""
    values = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    mask = torch.tensor([[True, True, False, True]])
    seq_idx = torch.tensor([[0, 0, 1, 1]])
    sums, counts = sequence_sums(values, mask, seq_idx=seq_idx)
    assert sums.tolist() == [3.0, 4.0] and counts.tolist() == [2.0, 1.0]
    sums, counts = sequence_sums(values, mask, seq_idx=seq_idx, num_sequences=4)
    assert sums.tolist() == [3.0, 4.0, 0.0, 0.0] and counts.tolist() == [2.0, 1.0, 0.0, 0.0]
    assert sequence_mean(values, mask, seq_idx=seq_idx, num_sequences=4).tolist() == [1.5, 4.0, 0.0, 0.0]


def test_sequence_mean_gradient_is_one_over_length():
    """d mean_i / d v_t = m_t / |y_i|: packed and padded layouts backpropagate the same per-token weights."""
    (pv, pm), (kv, km, idx), _, counts = _padded_and_packed(seed=2)
    pv.requires_grad_(True)
    kv.requires_grad_(True)
    sequence_mean(pv, pm).sum().backward()
    sequence_mean(kv, km, seq_idx=idx, num_sequences=len(LENGTHS)).sum().backward()
    expected_pad = pm.double() / torch.tensor(np.maximum(counts, 1))[:, None]
    torch.testing.assert_close(pv.grad, expected_pad)
    expected_pack = km.double() / torch.tensor(np.maximum(counts, 1))[idx]
    torch.testing.assert_close(kv.grad, expected_pack)


def test_sequence_sums_ignore_non_finite_values_at_unsupervised_positions():
    """Values outside the mask (here -inf log-probs of padding) must not leak into the per-sequence sums."""
    values = torch.tensor([[-0.5, -1.5, -math.inf], [-2.0, -math.inf, -math.inf]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    sums, counts = sequence_sums(values, mask)
    assert torch.isfinite(sums).all()
    assert sums.tolist() == [-2.0, -2.0] and counts.tolist() == [2.0, 1.0]


# =====================================================================================================================
# 8. REDI


def _redi_batch():
    """Two pairs (pos, neg, pos, neg) of per-token log-probs with different lengths, padded to T = 4."""
    tokens = [
        [-0.1, -0.3, -0.2],  # pair 0, positive, |y| = 3
        [-1.0, -2.0],  # pair 0, negative, |y| = 2
        [-0.5, -0.25, -0.75, -0.5],  # pair 1, positive, |y| = 4
        [-3.0],  # pair 1, negative, |y| = 1
    ]
    lp = torch.full((4, 4), -7.0)  # padding holds junk
    mask = torch.zeros(4, 4, dtype=torch.bool)
    for i, t in enumerate(tokens):
        lp[i, : len(t)] = torch.tensor(t)
        mask[i, : len(t)] = True
    sign = torch.tensor([1, -1, 1, -1])
    return tokens, lp, mask, sign


def test_redi_pair_loss_by_hand():
    """ℓ̄ = mean token log-prob per sequence; loss = Σ_pairs (-1·ℓ̄⁺ + 0.8·ℓ̄⁻) / 2 pairs."""
    tokens, lp, mask, sign = _redi_batch()
    ell = [sum(t) / len(t) for t in tokens]  # [-0.2, -1.5, -0.5, -3.0]
    assert ell == pytest.approx([-0.2, -1.5, -0.5, -3.0])
    pair0 = -1 * ell[0] + 0.8 * ell[1]  # 0.2 - 1.2 = -1.0
    pair1 = -1 * ell[2] + 0.8 * ell[3]  # 0.5 - 2.4 = -1.9
    expected = (pair0 + pair1) / 2  # -1.45
    assert expected == pytest.approx(-1.45)
    seq_mean = sequence_mean(lp, mask)
    np.testing.assert_allclose(_f64(seq_mean), ell, rtol=1e-6)
    loss = redi_loss(seq_mean, sign, reduction="pair")
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    terms = redi_terms(seq_mean, sign)
    np.testing.assert_allclose(_f64(terms), [0.2, 0.8 * -1.5, 0.5, 0.8 * -3.0], rtol=1e-6)


def test_redi_sequence_reduction_is_half_for_balanced_pairs():
    """With one positive per negative, averaging over sequences is exactly half of averaging over pairs."""
    _, lp, mask, sign = _redi_batch()
    seq_mean = sequence_mean(lp, mask)
    pair = redi_loss(seq_mean, sign, reduction="pair")
    seq = redi_loss(seq_mean, sign, reduction="sequence")
    assert seq.item() == pytest.approx(pair.item() / 2, rel=1e-7)


def test_redi_without_negative_weight_is_length_normalised_sft_on_positives():
    """neg_weight = 0: the loss is the mean over positives of the length-normalised NLL, and the token gradient is
    `-1/(|y| · #pairs)` on positives, 0 on negatives."""
    tokens, lp, mask, sign = _redi_batch()
    lp.requires_grad_(True)
    loss = redi_loss(sequence_mean(lp, mask), sign, neg_weight=0.0)
    positives = [t for t, s in zip(tokens, sign.tolist(), strict=True) if s > 0]
    expected = np.mean([-sum(t) / len(t) for t in positives])
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    loss.backward()
    lengths = mask.sum(-1, keepdim=True).double()
    expected_grad = torch.where(sign[:, None] > 0, -1.0 / (lengths * 2), torch.zeros(()).double()) * mask
    torch.testing.assert_close(lp.grad.double(), expected_grad)


def test_redi_weights_scale_their_terms():
    """pos_weight and neg_weight multiply their own terms only (values in float64 by hand)."""
    ell = torch.tensor([-0.4, -2.0])
    sign = torch.tensor([1, -1])
    loss = redi_loss(ell, sign, pos_weight=3.0, neg_weight=0.25)
    assert loss.item() == pytest.approx((3.0 * 0.4 + 0.25 * -2.0) / 1, rel=1e-6)


@pytest.mark.parametrize("gamma", [0.5, 1.0, 2.0])
def test_redi_neg_gamma_weighting_value_and_gradient(gamma):
    """With γ the negative term is `α ℓ̄ exp(γ ℓ̄)`, not detached: value and autograd gradient match an independent
    float64 formula, and the gradient differs from that of a detached weight."""
    ell64 = torch.tensor([-0.2, -1.5, -0.5, -3.0], dtype=torch.float64)
    sign = torch.tensor([1, -1, 1, -1])
    ell = ell64.clone().requires_grad_(True)
    loss = redi_loss(ell, sign, neg_gamma=gamma)

    ref_ell = ell64.clone().requires_grad_(True)
    neg = 0.8 * ref_ell * torch.exp(gamma * ref_ell)
    ref = torch.where(sign > 0, -ref_ell, torch.where(sign < 0, neg, torch.zeros((), dtype=torch.float64))).sum() / 2
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)

    loss.backward()
    ref.backward()
    torch.testing.assert_close(ell.grad, ref_ell.grad, rtol=1e-5, atol=1e-7)
    # closed form: d/dℓ [0.8 ℓ e^{γℓ}] = 0.8 e^{γℓ} (1 + γℓ); positives: -1; each divided by 2 pairs
    closed = torch.where(sign > 0, -torch.ones(4).double(), 0.8 * torch.exp(gamma * ell64) * (1 + gamma * ell64)) / 2
    torch.testing.assert_close(ell.grad, closed, rtol=1e-5, atol=1e-7)
    detached_grad = torch.where(sign > 0, -torch.ones(4).double(), 0.8 * torch.exp(gamma * ell64)) / 2
    assert not torch.allclose(ell.grad[sign < 0], detached_grad[sign < 0], rtol=1e-3)


def test_redi_ignores_sign_zero_rows():
    """Rows with sign 0 change neither the value, nor the normaliser, nor receive gradient."""
    ell = torch.tensor([-0.2, -1.5, -0.5, -3.0])
    sign = torch.tensor([1, -1, 1, -1])
    base = redi_loss(ell, sign)
    ell_extra = torch.tensor([-0.2, -9.0, -1.5, -0.5, -4.0, -3.0], requires_grad=True)
    sign_extra = torch.tensor([1, 0, -1, 1, 0, -1])
    for reduction in ("pair", "sequence"):
        assert redi_loss(ell_extra, sign_extra, reduction=reduction).item() == pytest.approx(
            redi_loss(ell, sign, reduction=reduction).item(), rel=1e-7
        )
    redi_loss(ell_extra, sign_extra).backward()
    assert ell_extra.grad[1].item() == 0.0 and ell_extra.grad[4].item() == 0.0
    assert redi_terms(ell_extra, sign_extra)[[1, 4]].tolist() == [0.0, 0.0]
    assert base.item() == pytest.approx(-1.45, rel=1e-6)


def test_redi_all_ignored_is_finite_zero_and_bad_reduction_raises():
    """Only sign-0 rows: finite zero with a graph. An unknown reduction is rejected."""
    ell = torch.tensor([-1.0, -2.0], requires_grad=True)
    loss = redi_loss(ell, torch.tensor([0, 0]))
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()
    assert torch.equal(ell.grad, torch.zeros(2))
    with pytest.raises(ValueError, match="reduction"):
        redi_loss(ell, torch.tensor([1, -1]), reduction="mean")


# =====================================================================================================================
# 9. Feasible Learning dual update


def test_feasible_hard_fl_by_hand():
    """rho=None: λ ← max(0, λ + η(ℓ - ε)). λ=[1, 0.5, 0, 0.01], ℓ=[0.2, 0, 3, 0], ε=0.1, η=0.5."""
    lam = torch.tensor([1.0, 0.5, 0.0, 0.01])
    losses = torch.tensor([0.2, 0.0, 3.0, 0.0])
    new = feasible_dual_update(lam, losses, epsilon=0.1, dual_lr=0.5, rho=None)
    # 1 + 0.5·0.1 = 1.05; 0.5 + 0.5·(-0.1) = 0.45; 0 + 0.5·2.9 = 1.45; 0.01 - 0.05 < 0 -> projected to 0
    np.testing.assert_allclose(_f64(new), [1.05, 0.45, 1.45, 0.0], rtol=1e-6)
    assert new[3].item() == 0.0
    assert new.dtype == torch.float32


def test_feasible_resilient_by_hand():
    """rho=2: λ ← max(0, λ + η(ℓ - ε - λ/ρ)). λ=[1, 4, 0.1], ℓ=[0.2, 0.1, 0], ε=0.1, η=0.5."""
    lam = torch.tensor([1.0, 4.0, 0.1])
    losses = torch.tensor([0.2, 0.1, 0.0])
    new = feasible_dual_update(lam, losses, epsilon=0.1, dual_lr=0.5, rho=2.0)
    # 1 + 0.5(0.1 - 0.5) = 0.8; 4 + 0.5(0 - 2) = 3; 0.1 + 0.5(-0.1 - 0.05) = 0.025
    np.testing.assert_allclose(_f64(new), [0.8, 3.0, 0.025], rtol=1e-6)
    # an unattainable ε: hard FL grows λ without bound, RFL converges to the fixed point λ* = ρ(ℓ - ε)
    lam_hard, lam_rfl = torch.ones(1), torch.ones(1)
    for _ in range(200):
        lam_hard = feasible_dual_update(lam_hard, torch.tensor([1.1]), epsilon=0.1, dual_lr=0.5, rho=None)
        lam_rfl = feasible_dual_update(lam_rfl, torch.tensor([1.1]), epsilon=0.1, dual_lr=0.5, rho=2.0)
    assert lam_hard.item() == pytest.approx(1 + 200 * 0.5, rel=1e-5)
    assert lam_rfl.item() == pytest.approx(2.0 * 1.0, rel=1e-5)


def test_feasible_update_uses_detached_losses():
    """The step reads ℓ as data: no autograd path from the new multipliers back to the losses."""
    losses = torch.tensor([0.3, 2.0], requires_grad=True)
    new = feasible_dual_update(torch.ones(2), losses * 1.0, epsilon=0.1)
    assert not new.requires_grad and new.grad_fn is None
    # and the value is still the resilient default (η=1, ρ=2): 1 + (ℓ - 0.1 - 0.5)
    np.testing.assert_allclose(_f64(new), [0.7, 2.4], rtol=1e-6)


# =====================================================================================================================
# 10. Quantiles and the probe


@pytest.mark.parametrize("n", [1, 2, 3, 10, 101, 1000])
def test_quantile_matches_numpy_linear(n):
    """`quantile` equals `numpy.quantile(method="linear")` for q in [0, 1], including the end points."""
    rng = np.random.default_rng(n)
    data = rng.normal(size=n) * 3
    t = torch.tensor(data, dtype=torch.float64)
    for q in [0.0, 0.05, 0.1, 0.25, 1 / 3, 0.5, 0.77, 0.9, 0.999, 1.0]:
        assert quantile(t, q) == pytest.approx(float(np.quantile(data, q, method="linear")), rel=1e-12, abs=1e-12)


def test_quantile_single_element_ties_and_shape():
    """One element is every quantile; ties and 2-D input behave like numpy on the flattened data."""
    assert quantile(torch.tensor([0.37]), 0.0) == pytest.approx(0.37)
    assert quantile(torch.tensor([0.37]), 0.63) == pytest.approx(0.37)
    assert quantile(torch.tensor([0.37]), 1.0) == pytest.approx(0.37)
    data = np.array([[0.2, 0.2, 0.9], [0.1, 0.2, 0.5]])
    for q in (0.1, 0.5, 0.8):
        assert quantile(torch.tensor(data), q) == pytest.approx(float(np.quantile(data, q)))


def test_quantile_rejects_empty_and_out_of_range():
    """An empty tensor and q outside [0, 1] (or NaN) raise ValueError."""
    with pytest.raises(ValueError):
        quantile(torch.tensor([]), 0.5)
    for q in (-0.01, 1.01, math.nan):
        with pytest.raises(ValueError):
            quantile(torch.tensor([1.0, 2.0]), q)


def test_probe_statistics_match_numpy():
    """Mean, P05…P90, median, frac(p > 0.5) and the count equal numpy's on the same data."""
    rng = np.random.default_rng(3)
    probs = np.concatenate([rng.beta(0.5, 0.5, size=997), [0.5, 0.5, 1.0]]).astype(np.float32)
    stats = probe_statistics(torch.tensor(probs))
    data = probs.astype(np.float64)
    assert stats["num_tokens"] == 1000
    assert stats["mean"] == pytest.approx(data.mean(), rel=1e-12)
    expected_keys = {"p05", "p10", "p20", "p30", "p40", "p50", "p60", "p70", "p80", "p90"}
    assert {f"p{round(q * 100):02d}" for q in PROBE_QUANTILES} == expected_keys
    for key in expected_keys:
        q = int(key[1:]) / 100
        assert stats[key] == pytest.approx(float(np.quantile(data, q)), rel=1e-12), key
    assert stats["median"] == pytest.approx(float(np.median(data)), rel=1e-12)
    assert stats["frac_p_gt_0.5"] == pytest.approx(float((data > 0.5).mean()), rel=1e-12)  # strict >


def test_probe_statistics_on_2d_input_and_empty_raises():
    """A (B, T) tensor is flattened; an empty probe is an error (no supervised tokens)."""
    probs = torch.tensor([[0.1, 0.9], [0.6, 0.4]])
    stats = probe_statistics(probs)
    assert stats["num_tokens"] == 4 and stats["frac_p_gt_0.5"] == 0.5
    assert stats["median"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="supervised"):
        probe_statistics(torch.tensor([]))


# =====================================================================================================================
# 11. The `auto` rule


def test_choose_objective_regimes():
    """Defaults: median ≥ 0.9 → prob_power α=1 (a P20 ≥ 0.3 guard is off by default after experiment E-A1,
    docs/sft.md); median ≤ 0.3 → nll; else nll (intermediate). Boundaries are inclusive."""
    assert DEFAULT_AUTO_RULE == {"strong_median": 0.9, "strong_p20": 0.0, "weak_median": 0.3}
    strong = choose_objective({"median": 0.99, "p20": 0.6})
    assert (strong["sft_objective"], strong["objective_alpha"]) == ("prob_power", 1.0)
    assert strong["regime"] == "model-strong"
    weak = choose_objective({"median": 0.1, "p20": 0.01})
    assert (weak["sft_objective"], weak["objective_alpha"], weak["regime"]) == ("nll", 0.0, "model-weak")
    mid = choose_objective({"median": 0.6, "p20": 0.2})
    assert (mid["sft_objective"], mid["objective_alpha"], mid["regime"]) == ("nll", 0.0, "intermediate")
    # a fat low tail (noisy labels) no longer blocks model-strong by default; the guard still works when set
    assert choose_objective({"median": 0.95, "p20": 1e-5})["regime"] == "model-strong"
    assert choose_objective({"median": 0.95, "p20": 0.1}, rule={"strong_p20": 0.3})["regime"] == "intermediate"
    # inclusive boundaries
    assert choose_objective({"median": 0.9, "p20": 0.3}, rule={"strong_p20": 0.3})["regime"] == "model-strong"
    assert choose_objective({"median": 0.3, "p20": 0.0})["regime"] == "model-weak"
    for choice in (strong, weak, mid):
        assert isinstance(choice["reason"], str) and choice["regime"] in choice["reason"]


def test_choose_objective_never_picks_alpha_above_one():
    """α > 1 is never chosen automatically, whatever the statistics."""
    for median in np.linspace(0, 1, 21):
        for p20 in np.linspace(0, float(median), 5):
            assert choose_objective({"median": float(median), "p20": float(p20)})["objective_alpha"] <= 1.0


def test_choose_objective_custom_rule_overrides_defaults():
    """A partial rule dict overrides only the thresholds it names."""
    stats = {"median": 0.6, "p20": 0.35}
    assert choose_objective(stats)["regime"] == "intermediate"
    assert choose_objective(stats, rule={"strong_median": 0.5})["regime"] == "model-strong"
    assert choose_objective(stats, rule={"strong_median": 0.5, "strong_p20": 0.4})["regime"] == "intermediate"
    assert choose_objective(stats, rule={"weak_median": 0.7})["regime"] == "model-weak"


def test_choose_objective_on_probe_output():
    """End to end: a model-strong probability sample (like the paper's math table) picks prob_power."""
    rng = np.random.default_rng(5)
    strong = torch.tensor(np.clip(1 - rng.exponential(0.01, size=500), 0, 1))
    weak = torch.tensor(rng.uniform(0, 0.4, size=500))
    assert choose_objective(probe_statistics(strong))["sft_objective"] == "prob_power"
    assert choose_objective(probe_statistics(weak))["regime"] == "model-weak"


# =====================================================================================================================
# 12. Properties (hypothesis)


_probs = st.floats(min_value=1e-12, max_value=1.0, allow_nan=False)
_alphas = st.one_of(st.just(0.0), st.floats(min_value=0.0, max_value=20.0, allow_nan=False))


def _pp(p: float, alpha: float) -> float:
    lp = torch.tensor([[math.log(p)]])
    return prob_power_loss(lp, _all_true((1, 1)), alpha=alpha)[0].item()


@HYPOTHESIS
@given(p=_probs, alpha=_alphas)
def test_property_prob_power_between_zero_and_nll(p, alpha):
    """0 ≤ (1 - p^α)/α ≤ -log p (since 1 - e^{-x} ≤ x)."""
    loss = _pp(p, alpha)
    nll = -math.log(p)
    assert math.isfinite(loss)
    assert loss >= 0.0
    assert loss <= nll * (1 + 1e-6) + 1e-7


@HYPOTHESIS
@given(p1=_probs, p2=_probs, alpha=_alphas)
def test_property_prob_power_non_increasing_in_p(p1, p2, alpha):
    """p1 ≤ p2 ⟹ ℓ(p1) ≥ ℓ(p2) (up to fp32 rounding)."""
    lo, hi = sorted((p1, p2))
    assert _pp(lo, alpha) >= _pp(hi, alpha) * (1 - 1e-6) - 1e-7


@HYPOTHESIS
@given(p=_probs, a1=_alphas, a2=_alphas)
def test_property_prob_power_non_increasing_in_alpha(p, a1, a2):
    """α1 ≤ α2 ⟹ ℓ_α1(p) ≥ ℓ_α2(p) at fixed p (up to fp32 rounding)."""
    lo, hi = sorted((a1, a2))
    assert _pp(p, lo) >= _pp(p, hi) * (1 - 1e-6) - 1e-7


@HYPOTHESIS
@given(
    lam=st.lists(st.floats(0.0, 1e4), min_size=1, max_size=8),
    data=st.data(),
    epsilon=st.floats(0.0, 10.0),
    dual_lr=st.floats(0.0, 10.0),
    rho=st.one_of(st.none(), st.floats(1e-3, 1e3)),
)
def test_property_feasible_update_nonnegative_finite_and_exact(lam, data, epsilon, dual_lr, rho):
    """The projected dual step is always ≥ 0, finite, and equals the float64 formula."""
    losses = data.draw(st.lists(st.floats(-1e3, 1e4), min_size=len(lam), max_size=len(lam)))
    new = feasible_dual_update(torch.tensor(lam), torch.tensor(losses), epsilon, dual_lr, rho)
    assert torch.isfinite(new).all()
    assert (new >= 0).all()
    lam32 = np.array(lam, dtype=np.float32).astype(np.float64)
    l32 = np.array(losses, dtype=np.float32).astype(np.float64)
    step = l32 - epsilon - (0.0 if rho is None else lam32 / rho)
    expected = np.maximum(lam32 + dual_lr * step, 0.0)
    np.testing.assert_allclose(_f64(new), expected, rtol=1e-5, atol=1e-2)


@pytest.mark.parametrize("alpha", [5e-324, 1e-300, 1e-46])
def test_prob_power_subnormal_alpha_is_nll(alpha):
    """A positive α too small for fp32 must still give (about) -log p, never NaN."""
    loss = _pp(0.3, alpha)
    assert math.isfinite(loss)
    assert loss == pytest.approx(-math.log(0.3), rel=1e-6)


# =====================================================================================================================
# 13. Registry


ALL_SFT_REGISTRIES = [SFT_OBJECTIVES, SFT_THRESHOLDS, SFT_SEQUENCE_OBJECTIVES, SFT_SAMPLE_REWEIGHTING]


def test_registry_names():
    """The objective families expose the names configs validate against."""
    assert {"nll", "prob_power", "threshold"} <= set(SFT_OBJECTIVES.names())
    assert set(SFT_THRESHOLDS.names()) == set(THRESHOLD_KINDS)
    assert "redi" in SFT_SEQUENCE_OBJECTIVES
    assert "feasible" in SFT_SAMPLE_REWEIGHTING
    assert get_registry("sft_objective") is SFT_OBJECTIVES
    assert get_registry("sft_threshold") is SFT_THRESHOLDS


@pytest.mark.parametrize("registry", ALL_SFT_REGISTRIES, ids=lambda r: r.family)
def test_every_method_cites_a_paper_with_https_url(registry):
    """Each registered method names its source and an https link (arXiv for papers; TRL docs for nll)."""
    assert len(registry) > 0
    for method in registry:
        assert method.paper_text.strip(), method.name
        assert method.url.startswith("https://"), method.name
        if method.name != "nll":
            assert "arxiv.org/abs/" in method.url, method.name
        assert method.family == registry.family
        assert callable(method.fn) or method.name == "auto"  # `auto` is declared only: the trainer resolves it


def test_declared_defaults_are_the_papers():
    """Declared defaults: REDI's c⁺ = 1, α = 0.8 (arXiv 2505.24850), Feasible Learning's LLM-fork ε, η, ρ and λ₀
    (arXiv 2501.14912), prob_power's α = 1 ("-p"). That they agree with the callables' own defaults is checked for
    every family in tests/test_registry.py."""
    assert SFT_SEQUENCE_OBJECTIVES.get("redi").defaults == {"pos_weight": 1.0, "neg_weight": 0.8, "neg_gamma": None}
    feas = SFT_SAMPLE_REWEIGHTING.get("feasible").defaults
    assert feas == {"epsilon": 1e-3, "target_prob": None, "dual_lr": 1.0, "rho": 2.0, "init": 1.0}
    assert SFT_OBJECTIVES.get("prob_power").defaults == {"alpha": 1.0}
    assert inspect.signature(prob_power_loss).parameters["alpha"].default == 1.0


def test_registry_unknown_name_and_duplicate_registration():
    """Unknown names fail listing the valid ones; re-registering a name is refused."""
    with pytest.raises(ValueError) as excinfo:
        SFT_OBJECTIVES.get("nlll")
    for name in SFT_OBJECTIVES.names():
        assert name in str(excinfo.value)
    with pytest.raises(ValueError):
        SFT_OBJECTIVES.get(None)
    reg = Registry("test_family_sft_losses")
    reg.register("a", paper="p", url="https://example.org")(lambda: 1)
    assert reg.get("a")() == 1
    with pytest.raises(ValueError, match="already registered"):
        reg.register("a", paper="p", url="https://example.org")(lambda: 2)
    with pytest.raises(ValueError, match="Valid families"):
        get_registry("no_such_family")


def test_list_methods_prints_papers_and_urls():
    """`list_methods` lists every method of a family with its url."""
    out = io.StringIO()
    listing = list_methods("sft_threshold", file=out)
    assert listing == {"sft_threshold": SFT_THRESHOLDS.names()}
    text = out.getvalue()
    for method in SFT_THRESHOLDS:
        assert method.name in text and method.url in text
