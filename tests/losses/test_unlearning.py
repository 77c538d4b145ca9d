"""Unit tests of the unlearning losses in `hf_stable.losses.unlearning`.

Every expected value is computed independently of the implementation: by hand, from the papers' formulas in float64
numpy (own shift loop, own log-softmax), against PyTorch's own `cross_entropy` / `kl_div`, by analytic gradients
compared with autograd, by central finite differences of the float64 references, or by brute-force minimisation.
The losses compute in fp32 (their documented contract), so tolerances against float64 references are fp32-sized.

Definitions: `docs/unlearning.md` (methods, shift rule) and the papers cited in `hf_stable.losses.unlearning`.
"""

from __future__ import annotations

import inspect
import math
from fractions import Fraction

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_stable.losses.unlearning import (
    FORGET_LOSSES,
    RETAIN_LOSSES,
    Contribution,
    auto_retain_eps,
    dmm_loss,
    dual_update,
    flatten_loss,
    ga_loss,
    mean_nll,
    npo_loss,
    project_conflicting,
    retain_kl,
    retain_nll,
    retain_none,
    sam_direction,
    sequence_logps,
    sga_auto_rate,
    sga_loss,
    sga_weights,
    simnpo_loss,
    token_logps,
)
from hf_stable.papers import PAPERS
from hf_stable.registry import get_registry


HYPOTHESIS = settings(max_examples=40, deadline=None)

# fp32 outputs against float64 references
ATOL = 2e-5
RTOL = 2e-5


# =====================================================================================================================
# float64 references, written without the implementation


def _np(x: torch.Tensor) -> np.ndarray:
    return x.detach().double().numpy()


def np_log_softmax(z: np.ndarray) -> np.ndarray:
    z = np.asarray(z, dtype=np.float64)
    m = z.max(-1, keepdims=True)
    return z - m - np.log(np.exp(z - m).sum(-1, keepdims=True))


def np_label_logps(logits: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The shift rule as a loop: logits at position `t-1` score label `t`; a label at position 0 is never scored."""
    b_size, length, _ = logits.shape
    out = np.zeros((b_size, length - 1))
    mask = np.zeros((b_size, length - 1), dtype=bool)
    for b in range(b_size):
        for t in range(1, length):
            if labels[b, t] != -100:
                out[b, t - 1] = np_log_softmax(logits[b, t - 1])[labels[b, t]]
                mask[b, t - 1] = True
    return out, mask


def np_seq(logits, labels):
    """`(S, n, ℓ̄)` per sequence: summed answer log-probability, answer length, mean NLL (0 without answers)."""
    lp, mask = np_label_logps(logits, labels)
    total = (lp * mask).sum(-1)
    n = mask.sum(-1)
    return total, n, np.where(n > 0, -total / np.maximum(n, 1), 0.0)


def np_npo(logits, labels, ref, beta):
    total, n, _ = np_seq(logits, labels)
    return np.where(n > 0, (2 / beta) * np.logaddexp(0.0, beta * (total - ref)), 0.0)


def np_simnpo(logits, labels, beta, margin):
    _, n, nll = np_seq(logits, labels)
    return np.where(n > 0, (2 / beta) * np.logaddexp(0.0, margin - beta * nll), 0.0)


def np_flatten(shifted_logits, mask):
    z = np.asarray(shifted_logits, dtype=np.float64)
    gap = z.max(-1) - z.mean(-1)
    return np.where(mask, gap**2, 0.0)


def np_kl(logp, logq):
    """`KL(p ‖ q)` over the last axis with `0 log 0 = 0`."""
    p = np.exp(logp)
    with np.errstate(invalid="ignore"):
        terms = np.where(p > 0, p * (logp - logq), 0.0)
    return terms.sum(-1)


def central_fd(fn, x: np.ndarray, h: float = 1e-6) -> np.ndarray:
    """Central finite-difference gradient of the scalar `fn(x)` in float64."""
    grad = np.zeros_like(x)
    it = np.nditer(x, flags=["multi_index"])
    for _ in it:
        i = it.multi_index
        up, down = x.copy(), x.copy()
        up[i] += h
        down[i] -= h
        grad[i] = (fn(up) - fn(down)) / (2 * h)
    return grad


# =====================================================================================================================
# batches


def _labels(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long)


def _batch(seed: int = 0, vocab: int = 7, scale: float = 2.0):
    """Three sequences of length 7: prompt + answer + padding, all-answer, and one without answer tokens."""
    g = torch.Generator().manual_seed(seed)
    labels = _labels(
        [
            [-100, -100, 3, 1, 6, -100, -100],  # prompt, 3 answer tokens, padding
            [-100, 0, 2, 2, 5, 4, 1],  # 6 answer tokens
            [-100, -100, -100, -100, -100, -100, -100],  # no answer tokens
        ]
    )
    logits = scale * torch.randn(labels.shape[0], labels.shape[1], vocab, generator=g)
    return logits, labels


def _all_contributions(logits: torch.Tensor, labels: torch.Tensor, seed: int = 1) -> dict[str, Contribution]:
    """Every registered loss evaluated on ``logits (B, L, V)`` / ``labels (B, L)`` with fixed extra inputs."""
    g = torch.Generator().manual_seed(seed)
    b_size, length, vocab = logits.shape
    logps, mask = token_logps(logits, labels)
    shifted = logits[:, :-1]
    ref_seq = -3.0 * torch.rand(b_size, generator=g)
    normal_lp = -torch.rand(b_size, 2, 4, generator=g)
    normal_mask = torch.rand(b_size, 2, 4, generator=g) > 0.3
    target = torch.log_softmax(torch.randn(b_size, length - 1, vocab, generator=g).double(), -1)
    ref_logits = torch.randn(b_size, length - 1, vocab, generator=g)
    return {
        "ga_token": ga_loss(logps, mask),
        "ga_sequence": ga_loss(logps, mask, reduction="sequence"),
        "npo": npo_loss(logps, mask, ref_seq_logps=ref_seq, beta=0.1),
        "simnpo": simnpo_loss(logps, mask, beta=2.5, margin=0.5),
        "flatten": flatten_loss(shifted, mask),
        "sga": sga_loss(logps, mask, normal_lp, normal_mask, rate=-1.0),
        "dmm": dmm_loss(shifted, mask, target, temperature=1.5),
        "retain_nll": retain_nll(logps, mask),
        "retain_kl": retain_kl(shifted, mask, ref_logits),
        "retain_none": retain_none(logps, mask),
    }


GRAD_LOSSES = [
    "ga_token",
    "ga_sequence",
    "npo",
    "simnpo",
    "flatten",
    "sga",
    "dmm",
    "retain_nll",
    "retain_kl",
]


# =====================================================================================================================
# 1. token_logps, sequence_logps, mean_nll: the shift rule


def test_token_logps_hand_built_shift():
    """Logits at `t` score label `t+1`; the label at position 0 is never scored (no logit predicts it)."""
    logits = torch.zeros(1, 4, 3)
    logits[0, 1] = torch.log(torch.tensor([1.0, 2.0, 5.0]))  # probabilities 1/8, 2/8, 5/8
    labels = _labels([[1, -100, 2, -100]])  # the answer token 2 sits at position 2, scored by row 1
    logps, mask = token_logps(logits, labels)
    assert logps.shape == mask.shape == (1, 3)
    assert mask.tolist() == [[False, True, False]]
    assert logps[0, 1].item() == pytest.approx(math.log(5 / 8), abs=1e-7)
    assert logps[0, 0].item() == 0.0 and logps[0, 2].item() == 0.0
    assert logps.dtype == torch.float32 and mask.dtype == torch.bool


def test_token_logps_matches_loop_reference_and_cross_entropy():
    logits, labels = _batch(seed=3)
    logps, mask = token_logps(logits, labels)
    expected, expected_mask = np_label_logps(_np(logits), labels.numpy())
    assert np.array_equal(mask.numpy(), expected_mask)
    np.testing.assert_allclose(_np(logps), expected, rtol=RTOL, atol=ATOL)
    # PyTorch's own HF-style loss (ignore_index=-100 gives 0 on prompt and padding)
    ce = F.cross_entropy(logits[:, :-1].transpose(1, 2), labels[:, 1:], ignore_index=-100, reduction="none")
    torch.testing.assert_close(-logps, ce, rtol=1e-6, atol=1e-6)


def test_sequence_logps_and_mean_nll_hand_numbers():
    logps = torch.tensor([[-1.0, -2.0, -7.0], [-5.0, -5.0, -5.0], [-0.5, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False], [False, False, False], [True, False, False]])
    total, lengths = sequence_logps(logps, mask)
    assert total.tolist() == [-3.0, 0.0, -0.5]
    assert lengths.tolist() == [2, 0, 1]
    assert mean_nll(logps, mask).tolist() == [1.5, 0.0, 0.5]  # no division by zero for the empty row


# =====================================================================================================================
# 2. Mask / shift: every loss depends on exactly the logit row that predicts the only answer token (the causal shift)


def _single_answer_batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = 2.0 * torch.randn(1, 6, 5, generator=g)
    labels = _labels([[-100, -100, -100, 3, -100, -100]])  # one answer token at position 3: predicted by row 2
    return logits, labels


@pytest.mark.parametrize("name", GRAD_LOSSES)
def test_each_loss_depends_on_exactly_the_predicting_row(name):
    logits, labels = _single_answer_batch()
    logits.requires_grad_(True)
    value = _all_contributions(logits, labels)[name].values.sum()
    (grad,) = torch.autograd.grad(value, logits)
    assert grad[0, 2].abs().sum() > 1e-4, "the row that predicts the answer token must drive the loss"
    others = torch.cat([grad[0, :2], grad[0, 3:]])
    assert torch.equal(others, torch.zeros_like(others)), "prompt / padding rows must get exactly zero gradient"

    # the forward value is unchanged by arbitrary changes of every other row
    perturbed = logits.detach().clone()
    perturbed[0, [0, 1, 3, 4, 5]] = 50.0 * torch.randn(5, 5)
    again = _all_contributions(perturbed, labels)[name].values.sum()
    assert again.item() == value.item()


@pytest.mark.parametrize("name", [*GRAD_LOSSES, "retain_none"])
def test_sequence_without_answer_contributes_zero_and_no_nan(name):
    logits, labels = _batch(seed=5, scale=1e3)  # large logits on every row, including the empty one
    logits.requires_grad_(True)
    contribution = _all_contributions(logits, labels)[name]
    values = contribution.values
    assert torch.isfinite(values).all()
    assert torch.equal(values[2], torch.zeros_like(values[2])), "row 2 has no answer tokens"
    if values.requires_grad:
        (grad,) = torch.autograd.grad(values.sum(), logits)
        assert torch.isfinite(grad).all()
        assert torch.equal(grad[2], torch.zeros_like(grad[2]))


@pytest.mark.parametrize("name", [*GRAD_LOSSES, "retain_none"])
def test_rows_are_independent_so_step_wide_normalisation_is_exact(name):
    """A sequence's contribution does not depend on the other sequences of the micro-batch: the trainer's division of
    the summed contributions by the step-wide unit count then equals the full-batch mean for any split."""
    logits, labels = _batch(seed=11)
    full = _all_contributions(logits, labels)[name].values
    # the fixed extra inputs are drawn per row from the same generator, so evaluate rows in the full-batch context
    for row in range(labels.shape[0]):
        keep = torch.zeros(labels.shape[0], dtype=torch.bool)
        keep[row] = True
        masked_labels = torch.where(keep[:, None], labels, torch.full_like(labels, -100))
        alone = _all_contributions(logits, masked_labels)[name].values
        torch.testing.assert_close(alone[row], full[row], rtol=0, atol=0)


def test_ga_token_matches_hf_loss_and_retain_nll_is_its_negative():
    logits, labels = _batch(seed=2)
    logps, mask = token_logps(logits, labels)
    ga = ga_loss(logps, mask)
    nll = retain_nll(logps, mask)
    assert ga.unit == nll.unit == "token"
    hf = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100)
    assert (ga.values.sum() / mask.sum()).item() == pytest.approx(-hf.item(), rel=1e-6)
    assert (nll.values.sum() / mask.sum()).item() == pytest.approx(hf.item(), rel=1e-6)
    torch.testing.assert_close(nll.values, -ga.values, rtol=0, atol=0)


def test_ga_sequence_reduction_is_mean_log_prob_per_sequence():
    logits, labels = _batch(seed=2)
    ga = ga_loss(*token_logps(logits, labels), reduction="sequence")
    _, _, nll = np_seq(_np(logits), labels.numpy())
    assert ga.unit == "sequence" and ga.values.shape == (3,)
    np.testing.assert_allclose(_np(ga.values), -nll, rtol=RTOL, atol=ATOL)
    with pytest.raises(ValueError, match="reduction"):
        ga_loss(*token_logps(logits, labels), reduction="batch")


# =====================================================================================================================
# 3. NPO (Zhang et al., arXiv 2404.05868)


@pytest.mark.parametrize("beta", [0.02, 0.1, 1.0, 4.0])
def test_npo_at_reference_is_two_over_beta_log_two(beta):
    logits, labels = _batch(seed=4)
    logps, mask = token_logps(logits, labels)
    own, _ = sequence_logps(logps, mask)
    out = npo_loss(logps, mask, ref_seq_logps=own.detach(), beta=beta)
    assert out.unit == "sequence"
    expected = 2 / beta * math.log(2)
    np.testing.assert_allclose(_np(out.values), [expected, expected, 0.0], rtol=1e-6)
    np.testing.assert_allclose(_np(out.stats["npo_weight"]), 1.0, rtol=1e-6)
    np.testing.assert_allclose(_np(out.stats["log_ratio"]), 0.0, atol=1e-6)


def test_npo_hand_worked_value():
    """Uniform logits over V = 4, two answer tokens: S = 2 log(1/4); with S_ref = −1 and β = 0.5,
    Δ = −2 log 4 + 1 and the loss is 4 log(1 + e^{Δ/2})."""
    labels = _labels([[-100, 2, 3]])
    logps, mask = token_logps(torch.zeros(1, 3, 4), labels)
    out = npo_loss(logps, mask, ref_seq_logps=torch.tensor([-1.0]), beta=0.5)
    delta = -2 * math.log(4) + 1
    assert out.values.item() == pytest.approx(4 * math.log1p(math.exp(delta / 2)), rel=1e-6)
    assert out.stats["log_ratio"].item() == pytest.approx(delta, rel=1e-6)
    assert out.stats["npo_weight"].item() == pytest.approx(2 / (1 + math.exp(-delta / 2)), rel=1e-6)


@pytest.mark.parametrize("beta", [0.1, 1.0])
def test_npo_value_and_gradient_are_weighted_sequence_gradient(beta):
    """∇_z L = 2σ(βΔ)·∇S with the analytic `∇_z log softmax(z)_y = e_y − softmax(z)` at every answer row."""
    logits, labels = _batch(seed=6)
    ref = torch.tensor([-4.0, -20.0, -1.0], dtype=torch.float64)
    logits.requires_grad_(True)
    logps, mask = token_logps(logits, labels)
    out = npo_loss(logps, mask, ref_seq_logps=ref, beta=beta)
    np.testing.assert_allclose(_np(out.values), np_npo(_np(logits), labels.numpy(), _np(ref), beta), rtol=RTOL)
    (grad,) = torch.autograd.grad(out.values.sum(), logits)

    z = _np(logits)
    total, _, _ = np_seq(z, labels.numpy())
    weight = 2 / (1 + np.exp(-beta * (total - _np(ref))))
    np.testing.assert_allclose(_np(out.stats["npo_weight"])[:2], weight[:2], rtol=RTOL)
    analytic = np.zeros_like(z)
    for b in range(z.shape[0]):
        for t in range(1, z.shape[1]):
            if labels[b, t] != -100:
                analytic[b, t - 1] = weight[b] * (
                    np.eye(z.shape[2])[labels[b, t]] - np.exp(np_log_softmax(z[b, t - 1]))
                )
    np.testing.assert_allclose(_np(grad), analytic, atol=1e-5)


def test_npo_small_beta_becomes_ga_on_summed_log_prob():
    """β → 0: weight 2σ(βΔ) → 1, so ∇L_NPO → ∇S (GA on the summed NLL), and L − (2/β) log 2 → Δ."""
    logits, labels = _batch(seed=7)
    ref = torch.tensor([-3.0, -9.0, 0.0])
    logits.requires_grad_(True)
    logps, mask = token_logps(logits, labels)
    beta = 1e-4
    out = npo_loss(logps, mask, ref_seq_logps=ref, beta=beta)
    (g_npo,) = torch.autograd.grad(out.values.sum(), logits, retain_graph=True)
    (g_ga,) = torch.autograd.grad(ga_loss(logps, mask).values.sum(), logits)
    np.testing.assert_allclose(_np(out.stats["npo_weight"]), 1.0, atol=1e-3)
    np.testing.assert_allclose(_np(g_npo), _np(g_ga), atol=1e-3)
    # the value in float64 (fp32 cannot resolve Δ next to 2 log 2 / β = 1.4e4)
    total, _, _ = np_seq(_np(logits), labels.numpy())
    value64 = np_npo(_np(logits), labels.numpy(), _np(ref), beta)[:2] - 2 / beta * math.log(2)
    np.testing.assert_allclose(value64, (total - _np(ref))[:2], rtol=1e-3)


# =====================================================================================================================
# 4. SimNPO (Fan et al., arXiv 2410.07163)


def test_simnpo_hand_worked_value():
    """Uniform logits over V = 5: ℓ̄ = log 5, and with m = 0 the loss is (2/β) log(1 + 5^{−β})."""
    labels = _labels([[-100, 1, 2, 3]])
    logps, mask = token_logps(torch.zeros(1, 4, 5), labels)
    beta = 2.5
    out = simnpo_loss(logps, mask, beta=beta, margin=0.0)
    assert out.unit == "sequence"
    assert out.values.item() == pytest.approx(2 / beta * math.log1p(5**-beta), rel=1e-6)
    assert out.stats["mean_nll"].item() == pytest.approx(math.log(5), rel=1e-6)


@pytest.mark.parametrize(("beta", "margin"), [(2.5, 0.0), (4.5, 1.0), (0.7, -0.5)])
def test_simnpo_gradient_weight_is_two_sigma(beta, margin):
    """∇_z L = 2σ(m − βℓ̄)·(−∇ℓ̄) = 2σ(m − βℓ̄)/n · Σ_t (e_y − softmax(z_t)); compared with autograd."""
    logits, labels = _batch(seed=8)
    logits.requires_grad_(True)
    out = simnpo_loss(*token_logps(logits, labels), beta=beta, margin=margin)
    np.testing.assert_allclose(_np(out.values), np_simnpo(_np(logits), labels.numpy(), beta, margin), rtol=RTOL)
    (grad,) = torch.autograd.grad(out.values.sum(), logits)

    z = _np(logits)
    _, n, nll = np_seq(z, labels.numpy())
    weight = 2 / (1 + np.exp(-(margin - beta * nll)))
    np.testing.assert_allclose(_np(out.stats["simnpo_weight"])[:2], weight[:2], rtol=RTOL)
    np.testing.assert_allclose(_np(out.stats["mean_nll"]), nll, rtol=RTOL, atol=ATOL)
    analytic = np.zeros_like(z)
    for b in range(z.shape[0]):
        for t in range(1, z.shape[1]):
            if labels[b, t] != -100:
                step = np.eye(z.shape[2])[labels[b, t]] - np.exp(np_log_softmax(z[b, t - 1]))
                analytic[b, t - 1] = weight[b] / n[b] * step
    np.testing.assert_allclose(_np(grad), analytic, atol=1e-6)


@pytest.mark.parametrize(("beta", "delta"), [(2.5, 0.0), (4.5, 0.3), (0.7, 1.2)])
def test_simnpo_margin_maps_to_open_unlearning_delta(beta, delta):
    """open-unlearning / Unlearn-Simple write `−(2/β) logsigmoid(β(ℓ̄ − δ))`: our margin is `m = β·δ`."""
    logits, labels = _batch(seed=9)
    out = simnpo_loss(*token_logps(logits, labels), beta=beta, margin=beta * delta)
    # open-unlearning's formula, with ℓ̄ from the float64 reference
    _, _, nll = np_seq(_np(logits), labels.numpy())
    theirs = -F.logsigmoid(beta * (torch.from_numpy(nll) - delta)) * 2 / beta
    np.testing.assert_allclose(_np(out.values)[:2], theirs.numpy()[:2], rtol=RTOL)
    if delta:  # the trap: passing δ itself as the margin is a different loss
        wrong = simnpo_loss(*token_logps(logits, labels), beta=beta, margin=delta)
        assert not torch.allclose(wrong.values[:2], out.values[:2])


# =====================================================================================================================
# 5. Logit-margin flattening (PDU, Entesari et al., arXiv 2506.05314)


def test_flatten_hand_worked_and_zero_on_constant_logits():
    logits = torch.tensor([[[1.0, 2.0, 3.0, 6.0, -2.0], [4.0, 4.0, 4.0, 4.0, 4.0], [0.0, 9.0, 0.0, 0.0, 0.0]]])
    mask = torch.tensor([[True, True, False]])
    out = flatten_loss(logits, mask)
    assert out.unit == "token"
    # row 0: max 6, mean 2 -> 16; row 1: constant -> 0; row 2 masked
    assert out.values.tolist() == [[16.0, 0.0, 0.0]]
    assert out.stats["logit_margin"].tolist() == [4.0, 0.0]  # the gap at each of the 2 answer positions

    constant = torch.full((2, 3, 6), -3.5, requires_grad=True)
    out = flatten_loss(constant, torch.ones(2, 3, dtype=torch.bool))
    assert torch.equal(out.values, torch.zeros(2, 3))
    (grad,) = torch.autograd.grad(out.values.sum(), constant)
    assert torch.equal(grad, torch.zeros_like(grad))


def test_flatten_gradient_is_analytic_and_zero_off_mask():
    """∇_z (max − mean)² = 2(max − mean)(e_argmax − 1/V) at answer positions, 0 elsewhere."""
    g = torch.Generator().manual_seed(10)
    logits = torch.randn(3, 4, 6, generator=g, requires_grad=True)
    mask = torch.tensor([[True, False, True, True], [False, False, False, False], [True, True, True, False]])
    out = flatten_loss(logits, mask)
    np.testing.assert_allclose(_np(out.values), np_flatten(_np(logits), mask.numpy()), rtol=RTOL, atol=ATOL)
    (grad,) = torch.autograd.grad(out.values.sum(), logits)
    z = _np(logits)
    vocab = z.shape[-1]
    gap = z.max(-1) - z.mean(-1)
    analytic = 2 * gap[..., None] * (np.eye(vocab)[z.argmax(-1)] - 1 / vocab)
    analytic = np.where(mask.numpy()[..., None], analytic, 0.0)
    np.testing.assert_allclose(_np(grad), analytic, atol=1e-5)
    # finite differences of the float64 reference agree too (the loss is smooth away from argmax ties)
    fd = central_fd(lambda x: np_flatten(x, mask.numpy()).sum(), z)
    np.testing.assert_allclose(_np(grad), fd, atol=1e-4)


def test_flatten_stats_are_per_answer_token_margins():
    g = torch.Generator().manual_seed(12)
    logits = torch.randn(2, 3, 4, generator=g)
    mask = torch.tensor([[True, False, True], [False, False, False]])
    out = flatten_loss(logits, mask)
    z = _np(logits)
    gap = z.max(-1) - z.mean(-1)
    assert out.stats["logit_margin"].shape == (2,) and not out.stats["logit_margin"].requires_grad
    np.testing.assert_allclose(_np(out.stats["logit_margin"]), [gap[0, 0], gap[0, 2]], rtol=RTOL, atol=ATOL)


# =====================================================================================================================
# 6. SGA (arXiv 2510.22376, our reconstruction)


@pytest.mark.parametrize("k", [1, 2, 4, 7])
def test_sga_weights(k):
    assert sga_weights(0.0, k) == (1.0, 0.0)
    for rate in [Fraction(-2), Fraction(-1), Fraction(-1, 2), Fraction(1, 3), Fraction(1)]:
        w_f, w_n = sga_weights(float(rate), k)
        assert w_f == pytest.approx(float(1 - rate * (k - 1) / k), abs=1e-15)
        assert w_n == pytest.approx(float(rate / k), abs=1e-15)
        assert w_f + (k - 1) * w_n == pytest.approx(1.0, abs=1e-15)  # a smoothed label still sums to 1
    with pytest.raises(ValueError, match="k >= 1"):
        sga_weights(-1.0, 0)


def _sga_inputs(seed: int = 13):
    logits, labels = _batch(seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    normal_logits = 2 * torch.randn(3 * 3, 5, 7, generator=g)
    normal_labels = torch.randint(0, 7, (9, 5), generator=g)
    normal_labels[:, :2] = -100
    normal_labels[4] = -100  # one normal example without answer tokens
    normal_lp, normal_mask = token_logps(normal_logits, normal_labels)
    return logits, labels, normal_logits, normal_labels, normal_lp.view(3, 3, 4), normal_mask.view(3, 3, 4)


def test_sga_rate_zero_is_ga_with_sequence_reduction():
    logits, labels, _, _, normal_lp, normal_mask = _sga_inputs()
    logps, mask = token_logps(logits, labels)
    out = sga_loss(logps, mask, normal_lp, normal_mask, rate=0.0)
    assert out.unit == "sequence"
    torch.testing.assert_close(out.values, ga_loss(logps, mask, reduction="sequence").values, rtol=0, atol=0)


@pytest.mark.parametrize("rate", [-2.0, -1.0, 0.5])
def test_sga_loss_matches_formula(rate):
    logits, labels, normal_logits, normal_labels, normal_lp, normal_mask = _sga_inputs()
    out = sga_loss(*token_logps(logits, labels), normal_lp, normal_mask, rate=rate)
    k = 4
    w_f, w_n = 1 - rate * (k - 1) / k, rate / k
    _, n_f, nll_f = np_seq(_np(logits), labels.numpy())
    _, _, nll_n = np_seq(_np(normal_logits), normal_labels.numpy())
    expected = np.where(n_f > 0, -w_f * nll_f - w_n * nll_n.reshape(3, 3).sum(1), 0.0)
    np.testing.assert_allclose(_np(out.values), expected, rtol=RTOL, atol=ATOL)


def test_sga_gradient_is_the_update_direction_used_by_auto_rate():
    """∇_θ L_SGA(r) = −(g_f + r v), v = ((K−1)/K)(ḡ_n − g_f), g = ∇ℓ̄: the direction whose norm `sga_auto_rate`
    minimises. θ is a bias added to every logit of a forget group (1 forget + 3 normal examples)."""
    g = torch.Generator().manual_seed(14)
    vocab, k, rate = 6, 4, -0.7
    base = torch.randn(k, 5, vocab, generator=g)
    labels = torch.randint(0, vocab, (k, 5), generator=g)
    labels[:, 0] = -100
    theta = torch.zeros(vocab, requires_grad=True)

    def nll(i: int) -> torch.Tensor:  # float64, independent of the implementation
        lp = torch.log_softmax((base[i] + theta).double(), -1)[:-1]
        return -lp.gather(-1, labels[i, 1:, None]).mean()

    grads = [torch.autograd.grad(nll(i), theta)[0].double() for i in range(k)]
    g_f, g_n = grads[0], torch.stack(grads[1:]).mean(0)
    v = (k - 1) / k * (g_n - g_f)

    lp, mask = token_logps(base + theta, labels)
    out = sga_loss(lp[:1], mask[:1], lp[1:].unsqueeze(0), mask[1:].unsqueeze(0), rate=rate)
    (grad,) = torch.autograd.grad(out.values.sum(), theta)
    np.testing.assert_allclose(_np(grad), _np(-(g_f + rate * v)), atol=1e-6)


def test_sga_without_normal_examples_is_ga():
    logits, labels = _batch(seed=15)
    logps, mask = token_logps(logits, labels)
    out = sga_loss(logps, mask, torch.zeros(3, 0, 4), torch.zeros(3, 0, 4, dtype=torch.bool), rate=-1.0)
    torch.testing.assert_close(out.values, ga_loss(logps, mask, reduction="sequence").values, rtol=0, atol=0)


@given(seed=st.integers(0, 2**31 - 1), k=st.integers(2, 6))
@HYPOTHESIS
def test_sga_auto_rate_is_brute_force_minimiser(seed, k):
    rng = np.random.default_rng(seed)
    g_f, g_n = rng.normal(size=12), rng.normal(size=12)
    v = (k - 1) / k * (g_n - g_f)
    grid = np.linspace(-50, 50, 200_001)  # step 5e-4
    norms = np.linalg.norm(g_f[None] + grid[:, None] * v[None], axis=1)
    best = grid[norms.argmin()]
    rate = sga_auto_rate(torch.from_numpy(g_f).float(), torch.from_numpy(g_n).float(), k, -50.0, 50.0)
    assert abs(rate - best) <= 1e-3
    # clipped: the norm is convex in r, so the constrained minimiser is the projection onto [low, high]
    low, high = best + 0.5, best + 2.0
    assert sga_auto_rate(torch.from_numpy(g_f), torch.from_numpy(g_n), k, low, high) == pytest.approx(low)
    low, high = best - 3.0, best - 1.0
    assert sga_auto_rate(torch.from_numpy(g_f), torch.from_numpy(g_n), k, low, high) == pytest.approx(high)


def test_sga_auto_rate_hand_worked_and_degenerate():
    # g_f = (1, 0), ḡ_n = (−1, 0), K = 2: v = (−1, 0), r* = −⟨g_f, v⟩/‖v‖² = 1
    g_f, g_n = torch.tensor([1.0, 0.0]), torch.tensor([-1.0, 0.0])
    assert sga_auto_rate(g_f, g_n, 2, -5.0, 5.0) == pytest.approx(1.0)
    assert sga_auto_rate(g_f, g_n, 2, -2.0, 0.0) == 0.0  # the default clip [-2, 0]: a positive optimum becomes GA
    # v = 0 (identical gradients, or K = 1): every rate gives the same norm; fall back to r = 0, clipped
    same = torch.tensor([0.3, -0.2])
    assert sga_auto_rate(same, same, 4, -2.0, 0.0) == 0.0
    assert sga_auto_rate(g_f, g_n, 1, 0.5, 1.0) == 0.5


# =====================================================================================================================
# 7. DMM / oracle matching (Georgiev et al., arXiv 2410.23232)


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_dmm_equals_independent_kl(temperature):
    g = torch.Generator().manual_seed(16)
    logits = 3 * torch.randn(2, 4, 6, generator=g)
    target = torch.log_softmax(torch.randn(2, 4, 6, generator=g).double(), -1)
    mask = torch.tensor([[True, True, False, True], [False, True, True, True]])
    out = dmm_loss(logits, mask, target, temperature=temperature)
    assert out.unit == "token" and out.values.dtype == torch.float32
    expected = np.where(mask.numpy(), np_kl(_np(target), np_log_softmax(_np(logits) / temperature)), 0.0)
    np.testing.assert_allclose(_np(out.values), expected, rtol=1e-5, atol=1e-6)
    # PyTorch's kl_div agrees as a second reference
    torch_kl = F.kl_div(torch.log_softmax(logits / temperature, -1), target.float(), log_target=True, reduction="none")
    torch.testing.assert_close(out.values, torch.where(mask, torch_kl.sum(-1), 0.0), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_dmm_is_zero_when_target_is_the_model(temperature):
    g = torch.Generator().manual_seed(17)
    logits = torch.randn(2, 3, 5, generator=g, requires_grad=True)
    target = torch.log_softmax(logits.detach() / temperature, -1)
    out = dmm_loss(logits, torch.ones(2, 3, dtype=torch.bool), target, temperature=temperature)
    np.testing.assert_allclose(_np(out.values), 0.0, atol=1e-6)
    (grad,) = torch.autograd.grad(out.values.sum(), logits)
    np.testing.assert_allclose(_np(grad), 0.0, atol=1e-6)


def test_dmm_target_with_zero_probability_tokens_is_finite():
    """Top-k targets put `−inf` log-probability on dropped tokens: `0 log 0 = 0`, not NaN (was NaN before the fix)."""
    logits = torch.tensor([[[0.5, -1.0, 2.0, 0.0]]], requires_grad=True)
    target = torch.tensor([[[math.log(0.25), -math.inf, math.log(0.75), -math.inf]]])
    out = dmm_loss(logits, torch.ones(1, 1, dtype=torch.bool), target)
    logq = np_log_softmax(_np(logits))[0, 0]
    expected = 0.25 * (math.log(0.25) - logq[0]) + 0.75 * (math.log(0.75) - logq[2])
    assert out.values.item() == pytest.approx(expected, rel=1e-6)
    (grad,) = torch.autograd.grad(out.values.sum(), logits)
    # ∇_z KL(p ‖ softmax(z)) = softmax(z) − p
    np.testing.assert_allclose(_np(grad)[0, 0], np.exp(logq) - np.array([0.25, 0, 0.75, 0]), atol=1e-6)


# =====================================================================================================================
# 8. Retain losses


def test_retain_kl_zero_when_reference_is_the_model():
    g = torch.Generator().manual_seed(18)
    logits = 4 * torch.randn(2, 5, 6, generator=g, requires_grad=True)
    out = retain_kl(logits, torch.ones(2, 5, dtype=torch.bool), logits.detach().clone())
    assert out.unit == "token"
    np.testing.assert_allclose(_np(out.values), 0.0, atol=1e-6)
    (grad,) = torch.autograd.grad(out.values.sum(), logits)
    np.testing.assert_allclose(_np(grad), 0.0, atol=1e-6)


def test_retain_kl_matches_float64_kl_and_excludes_masked_positions():
    g = torch.Generator().manual_seed(19)
    logits = 2 * torch.randn(2, 4, 5, generator=g, requires_grad=True)
    ref = 2 * torch.randn(2, 4, 5, generator=g)
    mask = torch.tensor([[True, False, True, True], [False, False, True, False]])
    out = retain_kl(logits, mask, ref)
    direction = np_kl(np_log_softmax(_np(ref)), np_log_softmax(_np(logits)))  # KL(π_ref ‖ π_θ), not reversed
    np.testing.assert_allclose(_np(out.values), np.where(mask.numpy(), direction, 0.0), rtol=1e-5, atol=1e-6)
    # masked positions: wild reference values change nothing and get no gradient
    wild = ref.clone()
    wild[~mask] = 1e4 * torch.randn(int((~mask).sum()), 5, generator=g)
    again = retain_kl(logits, mask, wild)
    torch.testing.assert_close(again.values, out.values, rtol=0, atol=0)
    (grad,) = torch.autograd.grad(again.values.sum(), logits)
    assert torch.equal(grad[~mask], torch.zeros_like(grad[~mask]))
    # finite differences of the float64 reference
    fd = central_fd(
        lambda x: np.where(mask.numpy(), np_kl(np_log_softmax(_np(ref)), np_log_softmax(x)), 0).sum(), _np(logits)
    )
    np.testing.assert_allclose(_np(grad), fd, atol=1e-5)


def test_retain_kl_reference_with_minus_inf_logits_is_finite():
    """A reference with `−inf` logits (masked / padded vocabulary rows) has `p = 0` there: finite KL, not NaN."""
    ref = torch.tensor([[[1.0, -math.inf, 0.0], [0.0, 0.0, -math.inf]]])
    logits = ref.clone().requires_grad_(True)  # the model masks the same rows
    out = retain_kl(logits, torch.ones(1, 2, dtype=torch.bool), ref)
    assert torch.equal(out.values, torch.zeros(1, 2))
    (grad,) = torch.autograd.grad(out.values.sum(), logits)
    assert torch.isfinite(grad).all()
    other = torch.tensor([[[0.0, 0.0, 0.0], [1.0, -1.0, 0.0]]])
    out = retain_kl(other, torch.ones(1, 2, dtype=torch.bool), ref)
    expected = np_kl(np_log_softmax(_np(ref)), np_log_softmax(_np(other)))
    np.testing.assert_allclose(_np(out.values), expected, rtol=1e-6)


def test_retain_none_is_zero_per_sequence():
    out = retain_none(torch.randn(4, 3), torch.ones(4, 3, dtype=torch.bool))
    assert out.unit == "sequence"
    assert torch.equal(out.values, torch.zeros(4)) and out.values.dtype == torch.float32


# =====================================================================================================================
# 9. Finite differences of every smooth loss against its float64 reference


FD_CASES = {
    "npo": (
        lambda z, lab: npo_loss(*token_logps(z, lab), ref_seq_logps=torch.tensor([-5.0, -9.0]), beta=0.3),
        lambda z, lab: np_npo(z, lab, np.array([-5.0, -9.0]), 0.3),
    ),
    "simnpo": (
        lambda z, lab: simnpo_loss(*token_logps(z, lab), beta=2.5, margin=0.4),
        lambda z, lab: np_simnpo(z, lab, 2.5, 0.4),
    ),
    "ga_sequence": (
        lambda z, lab: ga_loss(*token_logps(z, lab), reduction="sequence"),
        lambda z, lab: -np_seq(z, lab)[2],
    ),
}


@pytest.mark.parametrize("name", list(FD_CASES))
def test_gradients_match_finite_differences_of_float64_reference(name):
    g = torch.Generator().manual_seed(20)
    logits = torch.randn(2, 4, 3, generator=g, requires_grad=True)
    labels = _labels([[-100, 2, 0, -100], [-100, -100, 1, 1]])
    ours, reference = FD_CASES[name]
    (grad,) = torch.autograd.grad(ours(logits, labels).values.sum(), logits)
    fd = central_fd(lambda x: reference(x, labels.numpy()).sum(), _np(logits))
    np.testing.assert_allclose(_np(grad), fd, atol=2e-6)


# =====================================================================================================================
# 10. Primal-dual (PDU) and multi-gradient (StableUN, SGA-auto) pieces


def test_dual_update_hand_numbers_and_auto_eps():
    assert dual_update(100.0, 0.5, 0.3, 5.0) == pytest.approx(101.0)  # violated constraint: λ rises
    assert dual_update(100.0, 0.1, 0.3, 5.0) == pytest.approx(99.0)
    assert dual_update(0.5, 0.0, 0.3, 5.0) == 0.0  # projected onto λ ≥ 0
    assert auto_retain_eps(1.0) == pytest.approx(1.15)
    assert auto_retain_eps(0.0) == pytest.approx(0.05)


@given(
    lam=st.floats(0, 1e3),
    loss=st.floats(0, 50),
    eps=st.floats(0, 50),
    lr=st.floats(0, 100),
)
@HYPOTHESIS
def test_dual_update_is_never_negative_and_matches_formula(lam, loss, eps, lr):
    new = dual_update(lam, loss, eps, lr)
    assert new >= 0.0
    assert new == pytest.approx(max(0.0, lam + lr * (loss - eps)), rel=1e-12, abs=1e-12)


def test_project_conflicting_hand_worked():
    # ⟨g_f, g_r⟩ = −1, ‖g_r‖² = 2: g_f' = (1, 0) + ½(−1, 1) = (½, ½)
    out, cos = project_conflicting(torch.tensor([1.0, 0.0]), torch.tensor([-1.0, 1.0]))
    assert out.tolist() == [0.5, 0.5]
    assert cos == pytest.approx(-1 / math.sqrt(2))


@given(seed=st.integers(0, 2**31 - 1), size=st.integers(1, 20))
@HYPOTHESIS
def test_project_conflicting_properties(seed, size):
    rng = np.random.default_rng(seed)
    g_f, g_r = rng.normal(size=size), rng.normal(size=size)
    out, cos = project_conflicting(torch.from_numpy(g_f), torch.from_numpy(g_r))
    dot = g_f @ g_r
    assert cos == pytest.approx(dot / (np.linalg.norm(g_f) * np.linalg.norm(g_r)), rel=1e-9, abs=1e-12)
    if dot < 0:
        assert abs(_np(out) @ g_r) <= 1e-9 * np.linalg.norm(g_f) * np.linalg.norm(g_r)  # orthogonal to g_r
        np.testing.assert_allclose(_np(out), g_f - dot / (g_r @ g_r) * g_r, rtol=1e-12, atol=1e-12)
    else:
        assert np.array_equal(_np(out), g_f)
    # an agreeing pair is left exactly as it is, also in fp32
    agree = torch.from_numpy(np.abs(g_f)).float()
    out32, _ = project_conflicting(agree, torch.from_numpy(np.abs(g_r)).float())
    assert out32.dtype == torch.float32 and torch.equal(out32, agree)


def test_project_conflicting_zero_vectors_and_orthogonal_pair():
    g = torch.tensor([1.0, -2.0, 3.0])
    zero = torch.zeros(3)
    out, cos = project_conflicting(g, zero)
    assert torch.equal(out, g) and cos == 0.0
    out, cos = project_conflicting(zero, g)
    assert torch.equal(out, zero) and cos == 0.0
    out, cos = project_conflicting(zero, zero)
    assert torch.equal(out, zero) and cos == 0.0
    out, cos = project_conflicting(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0]))  # dot = 0: not conflicting
    assert out.tolist() == [1.0, 0.0] and cos == 0.0


def test_sam_direction():
    out = sam_direction(torch.tensor([3.0, 4.0]), rho=0.05)
    np.testing.assert_allclose(_np(out), [0.03, 0.04], rtol=1e-6)
    g = torch.randn(50, generator=torch.Generator().manual_seed(21))
    for rho in [0.01, 0.05, 1.0]:
        out = sam_direction(g, rho)
        assert out.dtype == g.dtype
        assert out.double().norm().item() == pytest.approx(rho, rel=1e-6)
        assert F.cosine_similarity(out.double(), g.double(), dim=0).item() == pytest.approx(1.0, abs=1e-6)
    assert torch.equal(sam_direction(torch.zeros(5), 0.05), torch.zeros(5))
    assert torch.equal(sam_direction(torch.tensor([1.0, math.nan]), 0.05), torch.zeros(2))
    assert torch.equal(sam_direction(torch.tensor([1.0, math.inf]), 0.05), torch.zeros(2))


# =====================================================================================================================
# 11. Registries


def test_registries_names_papers_and_declared_fields():
    """Each loss is declared once: its paper, the config fields it reads (their defaults are the function's own) and
    the extra inputs it needs (parameters without a default)."""
    # the built-in losses, in declaration order; a loss declared after them (docs/extending.md) follows them
    assert FORGET_LOSSES.names()[:6] == ["ga", "npo", "simnpo", "flatten", "sga", "dmm"]
    assert RETAIN_LOSSES.names()[:3] == ["nll", "kl", "none"]
    assert get_registry("unlearning_forget_loss") is FORGET_LOSSES
    assert get_registry("unlearning_retain_loss") is RETAIN_LOSSES
    for key, name in [("ga_unlearning", "ga"), ("npo", "npo"), ("simnpo", "simnpo"), ("pdu", "flatten")]:
        method = FORGET_LOSSES.get(name)
        assert method.paper is PAPERS[key] and method.url == PAPERS[key].url
    for method in [*FORGET_LOSSES, *RETAIN_LOSSES]:
        params = inspect.signature(method.fn).parameters
        for declared in method.fields:
            if declared.param is not None:
                expected = float(declared.default) if declared.name == "sga_rate" else declared.default  # "-1.0"
                assert params[declared.param].default == expected, (method.name, declared.name)
        required = {n for n, p in params.items() if p.default is p.empty and p.kind is p.POSITIONAL_OR_KEYWORD}
        needs = set(method.extra["needs"])
        inputs = {"normal_logps", "normal_mask"} if needs == {"normal"} else needs
        assert required - {"logps", "mask", "logits"} == inputs, method.name
    simnpo = FORGET_LOSSES.get("simnpo")
    assert {f.name: f.default for f in simnpo.fields} == {"simnpo_beta": 2.5, "simnpo_margin": 0.0}
    assert FORGET_LOSSES.get("npo").params_from(type("A", (), {"npo_beta": 0.3, "precompute_ref_logps": True})) == {
        "beta": 0.3
    }


# =====================================================================================================================
# 12. Properties over random shapes, masks and dtypes


@st.composite
def _random_batches(draw):
    b_size = draw(st.integers(1, 3))
    length = draw(st.integers(2, 6))
    vocab = draw(st.integers(2, 6))
    seed = draw(st.integers(0, 2**31 - 1))
    scale = draw(st.sampled_from([0.1, 3.0, 30.0, 1e3]))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    p_answer = draw(st.sampled_from([0.0, 0.3, 1.0]))
    empty_row = draw(st.booleans())
    g = torch.Generator().manual_seed(seed)
    logits = (scale * torch.randn(b_size, length, vocab, generator=g)).to(dtype)
    labels = torch.randint(0, vocab, (b_size, length), generator=g)
    labels[torch.rand(b_size, length, generator=g) >= p_answer] = -100
    if empty_row:
        labels[0] = -100
    return logits, labels


@given(batch=_random_batches())
@HYPOTHESIS
def test_every_contribution_is_finite_fp32_and_masked(batch):
    logits, labels = batch
    logits = logits.detach().requires_grad_(True)
    _, mask = token_logps(logits, labels)
    has_answer = mask.any(-1)
    contributions = _all_contributions(logits, labels)
    total = 0.0
    for name, c in contributions.items():
        assert c.values.dtype == torch.float32, name
        assert torch.isfinite(c.values).all(), name
        if c.unit == "token":
            assert c.values.shape == mask.shape
            assert torch.equal(c.values[~mask], torch.zeros_like(c.values[~mask])), name
        else:
            assert c.unit == "sequence" and c.values.shape == (labels.shape[0],)
            assert torch.equal(c.values[~has_answer], torch.zeros_like(c.values[~has_answer])), name
        for key, stat in c.stats.items():
            assert stat.dtype == torch.float32 and torch.isfinite(stat).all(), (name, key)
            assert not stat.requires_grad, (name, key)
            # per sequence, or per answer token (flatten's margin): 1-D either way, so the trainer can average it
            assert stat.shape in {(labels.shape[0],), (int(mask.sum()),)}, (name, key)
        if c.values.requires_grad:
            total = total + c.values.sum()
    (grad,) = torch.autograd.grad(total, logits)
    assert grad.dtype == logits.dtype and torch.isfinite(grad).all()


@given(batch=_random_batches())
@HYPOTHESIS
def test_bf16_logits_give_the_fp32_statistics_of_their_upcast(batch):
    """Losses upcast before any reduction: bf16 logits give exactly what their fp32 upcast gives."""
    logits, labels = batch
    low = _all_contributions(logits.bfloat16(), labels)
    high = _all_contributions(logits.bfloat16().float(), labels)
    for name in low:
        assert low[name].values.dtype == torch.float32
        assert torch.equal(low[name].values, high[name].values), name
        for key in low[name].stats:
            assert torch.equal(low[name].stats[key], high[name].stats[key]), (name, key)
