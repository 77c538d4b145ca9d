"""TFB — training-free Bayesianisation of LoRA (`hf_stable.adapters.tfb`).

Shi et al., "Training-Free Bayesianization for Low-Rank Adapters of Large Language Models", arXiv 2412.05723.

Expected values are computed independently of the implementation: products and projections in float64, Monte-Carlo
tolerances from the sample count (5 standard errors of the estimator, with a fixed seed), noise structure recovered by
least squares from a single linear layer, and the search criterion recomputed by a separate implementation of the flip
rate / relative NLL (driving the installed sampler's hooks with the same seeded generator).
"""

from __future__ import annotations

import itertools
import json
import math
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from peft import LoraConfig, get_peft_model

from hf_stable.adapters import (
    StableLoraConfig,
    TfbSampler,
    check_adapter,
    load_adapter,
    predict_bayes,
    save_tfb,
    tfb_bayesianize,
    tfb_reparameterize,
)
from hf_stable.adapters.tfb import D_EPS, NOISE_KINDS, tfb_weight_noise
from hf_stable.testing import build_tiny_model


TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]
HYPOTHESIS = settings(max_examples=30, deadline=None)


# ---------------------------------------------------------------------------------------------------------------------
# helpers


class _OneLinear(torch.nn.Module):
    def __init__(self, n: int, m: int):
        super().__init__()
        self.lin = torch.nn.Linear(n, m, bias=False)

    def forward(self, x):
        return self.lin(x)


def _peft(module, seed: int, **config):
    """`get_peft_model` with a seeded random (non-zero) B; the global RNG is left as it was."""
    config = {"init_lora_weights": False, **config}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return get_peft_model(module, LoraConfig(**config))


def _linear_lora(n=3, m=6, r=2, alpha=4, seed=0, dtype=torch.float64):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 100)
        base = _OneLinear(n, m)
    model = _peft(base, seed, r=r, lora_alpha=alpha, target_modules=["lin"]).to(dtype)
    return model.eval(), model.base_model.model.lin


def _tiny_lora(seed=0, r=4, alpha=8, dtype=torch.float32, targets=TARGETS):
    model, _ = build_tiny_model(seed=0)
    model = _peft(model, seed, r=r, lora_alpha=alpha, target_modules=targets).to(dtype)
    return model.eval()


def _lora_modules(model):
    return {n: m for n, m in model.named_modules() if hasattr(m, "lora_A") and "default" in m.lora_A}


def _products(model):
    """`{layer: B A}` in float64."""
    return {
        n: m.lora_B["default"].weight.double() @ m.lora_A["default"].weight.double()
        for n, m in _lora_modules(model).items()
    }


def _anchor_batches(seed=1, n_batches=2, batch=3, length=10, vocab=93):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_batches):
        ids = torch.randint(7, vocab, (batch, length), generator=g)
        labels = ids.clone()
        labels[:, :2] = -100  # a "prompt"
        mask = torch.ones_like(ids)
        mask[0, -2:] = 0  # right padding
        labels[0, -2:] = -100
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


def _logits(model, batch):
    with torch.no_grad():
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


def _column_space_residual(b_prime: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`(I − P) w` with P the orthogonal projector on the column space of `b_prime` (float64)."""
    q, _ = torch.linalg.qr(b_prime.double())
    return w.double() - q @ (q.T @ w.double())


def independent_criterion(model, batches, sigma, metric, n_samples, seed, quirks=False):
    """The anchor criterion recomputed outside the implementation: the deterministic argmax `y*` at every labelled
    next-token position, the mean of `n_samples` sampled softmaxes, then the flip rate or `|ΔNLL| / NLL0` (`/ N` with
    the reference's quirk). Drives ``model.tfb_sampler`` with a generator seeded with ``seed`` (common random
    numbers, as the search does)."""
    sampler = model.tfb_sampler
    saved = sampler.sigma, sampler.generator
    sampler.sigma, sampler.generator = sigma, torch.Generator().manual_seed(seed)
    flips, nll, nll0, count = 0, 0.0, 0.0, 0
    try:
        for batch in batches:
            with sampler.sampling(False):
                p0 = torch.softmax(_logits(model, batch).float(), -1)
            total = None
            with sampler.sampling(True):
                for _ in range(n_samples):
                    p = torch.softmax(_logits(model, batch).float(), -1)
                    total = p if total is None else total + p
            mean = total / n_samples
            for b, t in (batch["labels"][:, 1:] != -100).nonzero().tolist():  # position t predicts token t + 1
                target = int(p0[b, t].argmax())
                flips += int(mean[b, t].argmax()) != target
                nll -= math.log(float(mean[b, t, target]))
                nll0 -= math.log(float(p0[b, t, target]))
                count += 1
    finally:
        sampler.sigma, sampler.generator = saved
    if metric == "flip":
        return flips / count
    relative = abs(nll - nll0) / nll0
    return relative / count if quirks else relative


# ---------------------------------------------------------------------------------------------------------------------
# re-parameterisation


def test_reparameterize_keeps_product_and_logits_fp64():
    """fp64 weights: `B'A' = BA` to 1e-10 on every layer (including k_proj with r > out_features), the logits are
    unchanged, and B' has orthogonal columns (B'ᵀB' diagonal = d²)."""
    model = _tiny_lora(r=40, alpha=8, dtype=torch.float64, targets=["q_proj", "k_proj", "down_proj"])
    batch = _anchor_batches()[0]
    before, logits_before = _products(model), _logits(model, batch)
    old_b = {n: m.lora_B["default"].weight.detach().clone() for n, m in _lora_modules(model).items()}
    assert model.base_model.model.model.layers[0].self_attn.k_proj.out_features == 32  # r = 40 > m = 32

    assert tfb_reparameterize(model) == 6
    after = _products(model)
    for name, product in before.items():
        assert (after[name] - product).abs().max() <= 1e-10 * max(1.0, product.abs().max()), name
        module = _lora_modules(model)[name]
        b = module.lora_B["default"].weight
        assert b.shape == old_b[name].shape and module.lora_A["default"].weight.shape[0] == 40
        assert not torch.allclose(b, old_b[name])
        gram = b.T @ b
        off_diagonal = gram - torch.diag(torch.diagonal(gram))
        assert off_diagonal.abs().max() <= 1e-10 * gram.abs().max()
    assert (_logits(model, batch) - logits_before).abs().max() <= 1e-10

    once = {
        n: (m.lora_A["default"].weight.clone(), m.lora_B["default"].weight.clone())
        for n, m in _lora_modules(model).items()
    }
    assert tfb_reparameterize(model) == 6  # idempotent: the factors themselves, not only their product
    for name, module in _lora_modules(model).items():
        a, b = once[name]
        assert (module.lora_A["default"].weight - a).abs().max() <= 1e-10 * max(1.0, a.abs().max()), name
        assert (module.lora_B["default"].weight - b).abs().max() <= 1e-10 * max(1.0, b.abs().max()), name


def test_reparameterize_fp32_model():
    """fp32 weights: the SVD runs in fp32, so `B'A' = BA` and the logits hold to fp32 precision."""
    model = _tiny_lora()
    batch = _anchor_batches()[0]
    before, logits_before = _products(model), _logits(model, batch)
    tfb_reparameterize(model)
    for name, product in _products(model).items():
        assert (product - before[name]).abs().max() <= 1e-5 * before[name].abs().max(), name
    assert torch.allclose(_logits(model, batch), logits_before, atol=1e-5, rtol=0)


@HYPOTHESIS
@given(
    n=st.integers(1, 6),
    m=st.integers(1, 6),
    r=st.integers(1, 8),
    seed=st.integers(0, 2**16),
)
def test_reparameterize_property(n, m, r, seed):
    """For any shapes (r above or below m), the product is kept to 1e-10 in fp64 and B' has orthogonal columns."""
    model, layer = _linear_lora(n=n, m=m, r=r, seed=seed)
    product = layer.lora_B["default"].weight @ layer.lora_A["default"].weight
    tfb_reparameterize(model)
    b = layer.lora_B["default"].weight
    assert (b @ layer.lora_A["default"].weight - product).abs().max() <= 1e-10 * max(1.0, product.abs().max())
    gram = b.T @ b
    assert (gram - torch.diag(torch.diagonal(gram))).abs().max() <= 1e-10 * max(1.0, gram.abs().max())


# ---------------------------------------------------------------------------------------------------------------------
# the posterior's covariance


def _b_prime(m, r, seed):
    g = torch.Generator().manual_seed(seed)
    u, d, _ = torch.linalg.svd(torch.randn(m, r, generator=g, dtype=torch.float64), full_matrices=False)
    return u * d, u, d


def test_weight_noise_covariance_matches_theory():
    """`Cov(vec W) = σ² (U Uᵀ ⊗ I)`: full empirical covariance within 5 standard errors per entry; coordinates in
    the column space of B are iid with variance σ² (σ²·d²/(d+1e-6)² exactly); outside it the noise is 0."""
    m, r, n, sigma, scaling, draws = 5, 2, 3, 0.3, 0.5, 20000
    b_prime, u, d = _b_prime(m, r, seed=3)
    g = torch.Generator().manual_seed(0)
    w = torch.stack([tfb_weight_noise(b_prime, scaling, sigma, n, generator=g) for _ in range(draws)])  # (N, m, n)
    assert w.shape == (draws, m, n) and w.dtype == torch.float64

    # outside the column space: zero (up to fp64 rounding)
    assert _column_space_residual(b_prime, w.permute(1, 0, 2).reshape(m, -1)).abs().max() <= 1e-12

    def check_cov(samples, expected):
        cov = torch.cov(samples.T)
        se = ((torch.outer(expected.diagonal(), expected.diagonal()) + expected**2) / draws).sqrt()
        assert ((cov - expected).abs() <= 5 * se).all(), (cov - expected).abs().max()

    factor = (d / (d + D_EPS)) ** 2  # the reference's 1e-6 in σ/(d + 1e-6); 1 - factor < 1e-5 here
    kron = torch.kron(u @ torch.diag(factor) @ u.T, torch.eye(n, dtype=torch.float64))  # row-major vec
    check_cov(w.reshape(draws, -1), sigma**2 * kron)
    coords = torch.einsum("mi,Nmn->Nin", u, w).reshape(draws, -1)  # Uᵀ W: (N, r·n)
    check_cov(coords, sigma**2 * torch.diag(factor.repeat_interleave(n)))
    assert (factor > 1 - 1e-5).all()


@HYPOTHESIS
@given(
    m=st.integers(1, 6),
    r=st.integers(1, 6),
    n=st.integers(1, 5),
    seed=st.integers(0, 2**16),
    sigma=st.floats(1e-4, 10.0),
    s1=st.floats(0.05, 20.0),
    s2=st.floats(0.05, 20.0),
)
def test_weight_noise_properties(m, r, n, seed, sigma, s1, s2):
    """The noise lies in the column space of B, is linear in σ and does not depend on s (σ is on the ΔW scale)."""
    b_prime = _b_prime(m, min(r, m), seed)[0]

    def draw(scaling, sig):
        return tfb_weight_noise(b_prime, scaling, sig, n, generator=torch.Generator().manual_seed(seed))

    w = draw(s1, sigma)
    assert w.shape == (m, n)
    assert _column_space_residual(b_prime, w).abs().max() <= 1e-10 * max(sigma, 1.0)
    assert torch.allclose(draw(s1, 2 * sigma), 2 * w, rtol=1e-12, atol=1e-300)
    assert torch.allclose(draw(s2, sigma), w, rtol=1e-10, atol=1e-12 * sigma)


def test_weight_noise_bad_inputs():
    b_prime = _b_prime(4, 2, 0)[0]
    with pytest.raises(ValueError, match="sigma"):
        tfb_weight_noise(b_prime, 1.0, -0.1, 3)
    with pytest.raises(ValueError, match="scaling"):
        tfb_weight_noise(b_prime, 0.0, 0.1, 3)
    with pytest.raises(ValueError, match="in_features"):
        tfb_weight_noise(b_prime, 1.0, 0.1, 0)


# ---------------------------------------------------------------------------------------------------------------------
# sampling


def test_sampler_off_is_deterministic_model_exactly():
    """Sampling disabled (the default, `sampling(False)`, or σ = 0) returns the deterministic model's logits bit for
    bit; enabled with σ > 0 they differ, and the hooks leave no trace once the block ends or they are removed."""
    model = _tiny_lora()
    batch = _anchor_batches()[0]
    logits_before = _logits(model, batch)
    sampler = TfbSampler(model, sigma=0.05)
    deterministic = _logits(model, batch)
    assert torch.allclose(deterministic, logits_before, atol=1e-5, rtol=0)  # re-parameterisation only
    assert not sampler.enabled and torch.equal(_logits(model, batch), deterministic)
    with sampler.sampling(False):
        assert torch.equal(_logits(model, batch), deterministic)
    with sampler.sampling():
        sampled = _logits(model, batch)
        assert (sampled - deterministic).abs().max() > 1e-3
        assert not torch.equal(_logits(model, batch), sampled)  # a fresh draw per forward
        sampler.sigma = 0.0
        assert torch.equal(_logits(model, batch), deterministic)
    sampler.sigma = 0.05
    assert torch.equal(_logits(model, batch), deterministic)
    with model.disable_adapter(), sampler.sampling():  # disabled adapters get no noise
        no_adapter = _logits(model, batch)
    with model.disable_adapter():
        assert torch.equal(no_adapter, _logits(model, batch))
    sampler.remove()
    with sampler.sampling():
        assert torch.equal(_logits(model, batch), deterministic)


def _noise(model, sampler, x):
    with torch.no_grad():
        with sampler.sampling(False):
            clean = model(x)
        with sampler.sampling(True):
            return model(x) - clean


def test_weight_per_sequence_shares_one_weight_per_sequence():
    """One linear layer, two identical sequences of T = 5 tokens (n = 3): each sequence's noise is exactly
    `X ΔW_bᵀ` for one `ΔW_b` (least squares residual ~0), the two sequences get different ΔW, and ΔW lies in the
    column space of B. Flipout's per-token signs break the single-weight fit."""
    model, layer = _linear_lora(n=3, m=6, r=2)
    g = torch.Generator().manual_seed(5)
    x_seq = torch.randn(5, 3, generator=g, dtype=torch.float64)
    x = torch.stack([x_seq, x_seq])  # (2, 5, 3)

    sampler = TfbSampler(model, sigma=0.2, noise="weight_per_sequence", generator=torch.Generator().manual_seed(0))
    b_prime = layer.lora_B["default"].weight.detach()
    noise = _noise(model, sampler, x)  # (2, 5, 6)
    deltas = []
    for seq in range(2):
        delta_t = torch.linalg.lstsq(x_seq, noise[seq]).solution  # (3, 6) = ΔWᵀ
        assert (x_seq @ delta_t - noise[seq]).abs().max() <= 1e-12
        assert _column_space_residual(b_prime, delta_t.T).abs().max() <= 1e-12
        deltas.append(delta_t)
    assert (deltas[0] - deltas[1]).abs().max() > 1e-3
    sampler.remove()

    flipout = TfbSampler(model, sigma=0.2, noise="flipout_token", generator=torch.Generator().manual_seed(0))
    noise = _noise(model, flipout, x)
    residual = x_seq @ torch.linalg.lstsq(x_seq, noise[0]).solution - noise[0]
    assert residual.abs().max() > 1e-3 * noise[0].abs().max()
    assert _column_space_residual(b_prime, noise.reshape(-1, 6).T).abs().max() <= 1e-12  # still in col(B)
    tokens = torch.stack([x_seq[0]] * 4)[None]  # identical tokens of one sequence: decorrelated by the signs
    per_token = _noise(model, flipout, tokens)[0]
    assert (per_token[0] - per_token[1:]).abs().max() > 1e-3


@pytest.mark.parametrize("noise", NOISE_KINDS)
def test_sampler_noise_scale(noise):
    """Through the hooks, `E‖noise(x)‖² = σ² ‖x‖² Σ_i d_i²/(d_i + 1e-6)² ≈ σ² r ‖x‖²` for both noise kinds, with a
    second (inactive) adapter on the layer (one hook per layer: the noise is not added twice). Each forward's mean
    over its tokens is one iid sample; tolerance 5 standard errors."""
    model, layer = _linear_lora(n=4, m=6, r=3, alpha=6)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(9)
        model.add_adapter("other", LoraConfig(r=2, lora_alpha=2, target_modules=["lin"], init_lora_weights=False))
    model.to(torch.float64)
    model.set_adapter("default")
    sigma = 0.3
    sampler = TfbSampler(model, sigma=sigma, noise=noise, generator=torch.Generator().manual_seed(1))
    d = layer.lora_B["default"].weight.detach().norm(dim=0)
    expected = float((d**2 / (d + D_EPS) ** 2).sum())
    x = torch.randn(8, 2, 4, generator=torch.Generator().manual_seed(2), dtype=torch.float64)  # 8 seqs × 2 tokens
    samples = []
    for _ in range(600):
        q = _noise(model, sampler, x).pow(2).sum(-1) / (sigma**2 * x.pow(2).sum(-1))
        samples.append(q.mean())
    samples = torch.stack(samples)
    assert abs(samples.mean() - expected) <= 5 * samples.std() / math.sqrt(len(samples))
    assert abs(expected - 3) < 1e-4


def test_sampler_bad_noise_and_sigma():
    model = _tiny_lora()
    with pytest.raises(ValueError, match=r"flipout_token.*weight_per_sequence"):
        TfbSampler(model, sigma=0.1, noise="gaussian")
    with pytest.raises(ValueError, match="sigma"):
        TfbSampler(model, sigma=-1.0)


@pytest.mark.parametrize("variant", [{"use_map": True}, {"use_dora": True}])
def test_tfb_refuses_map_and_dora(variant):
    """MAP (and DoRA) normalise the update: TFB's noise would have to enter before that, so every entry point
    refuses them with a clear ValueError."""
    model, _ = build_tiny_model(seed=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = get_peft_model(model, StableLoraConfig(r=4, target_modules=["q_proj"], **variant))
    for call in (
        lambda: tfb_reparameterize(model),
        lambda: TfbSampler(model, sigma=0.1),
        lambda: tfb_bayesianize(model, _anchor_batches()),
    ):
        with pytest.raises(ValueError, match="plain LoRA"):
            call()
    assert not hasattr(model, "tfb_sampler")


def test_tfb_needs_lora_layers():
    model, _ = build_tiny_model(seed=0)
    with pytest.raises(ValueError, match="LoRA layers"):
        TfbSampler(model, sigma=0.1)
    with pytest.raises(ValueError, match="LoRA layers"):
        tfb_bayesianize(model, _anchor_batches())


# ---------------------------------------------------------------------------------------------------------------------
# predict_bayes


def test_predict_bayes():
    """Probabilities `(B, T, V)` fp32 whose rows sum to 1; n_samples = 1 without sampling (or σ = 0) is the softmax
    of the deterministic logits; with sampling it is the mean of the sampled softmaxes (same seeded draws); the
    model's train/eval mode is restored."""
    model = _tiny_lora()
    batch = _anchor_batches()[0]
    sampler = TfbSampler(model, sigma=0.05, generator=torch.Generator().manual_seed(0))
    model.tfb_sampler = sampler
    deterministic = torch.softmax(_logits(model, batch).float(), -1)

    assert torch.equal(predict_bayes(model, batch, n_samples=1, sample=False), deterministic)
    sampler.sigma = 0.0
    assert torch.equal(predict_bayes(model, batch, n_samples=1), deterministic)
    sampler.sigma = 0.05

    model.train()
    sampler.generator.manual_seed(7)
    probs = predict_bayes(model, batch, n_samples=3)
    assert model.training
    model.eval()
    assert probs.shape == (3, 10, 93) and probs.dtype == torch.float32
    assert torch.allclose(probs.sum(-1), torch.ones(3, 10), atol=1e-5, rtol=0)
    sampler.generator.manual_seed(7)
    with sampler.sampling():
        manual = torch.stack([torch.softmax(_logits(model, batch).float(), -1) for _ in range(3)]).mean(0)
    assert torch.allclose(probs, manual, atol=1e-6, rtol=0)
    assert (probs - deterministic).abs().max() > 1e-4

    other = TfbSampler(model, sigma=0.0)  # an explicit sampler wins over model.tfb_sampler
    assert torch.allclose(predict_bayes(model, batch, n_samples=2, sampler=other), deterministic, atol=1e-6)


@pytest.mark.parametrize("n_samples", [0, -1, 1.5, True])
def test_predict_bayes_bad_n_samples(n_samples):
    model = _tiny_lora()
    model.tfb_sampler = TfbSampler(model, sigma=0.05)
    with pytest.raises(ValueError, match="n_samples"):
        predict_bayes(model, _anchor_batches()[0], n_samples=n_samples)


def test_predict_bayes_without_sampler():
    model, batch = _tiny_lora(), _anchor_batches()[0]
    with pytest.raises(ValueError, match="tfb_bayesianize"):
        predict_bayes(model, batch)
    deterministic = predict_bayes(model, batch, n_samples=1, sample=False)  # no sampler needed for the baseline
    torch.testing.assert_close(deterministic, torch.softmax(_logits(model, batch).float(), dim=-1))


# ---------------------------------------------------------------------------------------------------------------------
# the σ search

SEARCH = dict(iters=6, n_samples=2, seed=3)


@pytest.mark.parametrize(
    "metric, budget, sigma_hi",
    [("flip", 0.1, None), ("flip", 0.1, 0.05), ("nll", 0.05, 8.0)],
)
def test_search_certificate(metric, budget, sigma_hi):
    """The returned σ satisfies the budget and 2σ violates it, by an independent recomputation of the criterion with
    the same seed; the sampler is installed with σ, the deterministic model is unchanged and the mode restored.
    (The tiny random model's relative NLL saturates near 8 %, hence an explicit σ_hi for "nll".)"""
    model = _tiny_lora()
    batches = _anchor_batches()
    logits_before = _logits(model, batches[0])
    model.train()
    result = tfb_bayesianize(model, batches, metric=metric, budget=budget, sigma_hi=sigma_hi, **SEARCH)
    assert model.training
    model.eval()
    sigma = result["sigma"]
    assert sigma > 0 and model.tfb_sampler.sigma == sigma and model.tfb_sampler.noise == "flipout_token"
    assert result["n_anchor"] == 2 * (3 * 8 - 2)  # 8 labelled next tokens per row, 2 padded in one row
    assert torch.allclose(_logits(model, batches[0]), logits_before, atol=1e-5, rtol=0)

    at_sigma = independent_criterion(model, batches, sigma, metric, SEARCH["n_samples"], SEARCH["seed"])
    at_double = independent_criterion(model, batches, 2 * sigma, metric, SEARCH["n_samples"], SEARCH["seed"])
    assert at_sigma <= budget < at_double and result["certified"] is True
    assert at_sigma == pytest.approx(result["criterion"], rel=1e-5, abs=1e-12)
    assert at_double == pytest.approx(result["criterion_at_2sigma"], rel=1e-5, abs=1e-12)
    history = dict(result["history"])
    assert history[sigma] == result["criterion"] and history[result["sigma_hi"]] > budget
    if sigma_hi is not None:
        assert result["sigma_hi"] == sigma_hi and sigma < sigma_hi


@pytest.mark.parametrize("metric, budgets, sigma_hi", [("flip", (0.05, 0.1, 0.3), None), ("nll", (0.02, 0.05), 8.0)])
def test_search_monotone_in_budget(metric, budgets, sigma_hi):
    sigmas = [
        tfb_bayesianize(_tiny_lora(), _anchor_batches(), metric=metric, budget=b, sigma_hi=sigma_hi, **SEARCH)["sigma"]
        for b in budgets
    ]
    assert all(a <= b for a, b in itertools.pairwise(sigmas)), sigmas
    assert sigmas[0] < sigmas[-1]


@pytest.mark.parametrize("metric, budget", [("nll", 3e-4), ("flip", 0.1)])
def test_search_reference_quirks(metric, budget):
    """`reference_quirks=True` is the reference's `fit`, re-implemented here on the independent criterion: bisection
    on [0, σ_hi] that returns the smallest violating σ (σ_hi if none), with the relative NLL divided by the number
    of anchor predictions."""
    model = _tiny_lora()
    batches = _anchor_batches()
    sigma_hi = 1.0
    with pytest.warns(UserWarning, match="uncertified"):
        result = tfb_bayesianize(
            model,
            batches,
            metric=metric,
            budget=budget,
            sigma_hi=sigma_hi,
            reference_quirks=True,
            allow_uncertified=True,
            **SEARCH,
        )
    assert result["certified"] is False

    def crit(sigma, quirks=True):
        return independent_criterion(model, batches, sigma, metric, SEARCH["n_samples"], SEARCH["seed"], quirks)

    low, high, best = 0.0, sigma_hi, sigma_hi
    for _ in range(SEARCH["iters"]):
        mid = (low + high) / 2
        if crit(mid) > budget:
            best = high = mid
        else:
            low = mid
    assert best < sigma_hi  # the case exercises a violation
    assert result["sigma"] == best and model.tfb_sampler.sigma == best
    assert crit(best) > budget and result["criterion"] == pytest.approx(crit(best), rel=1e-5)
    if metric == "nll":
        assert crit(best) == pytest.approx(crit(best, quirks=False) / result["n_anchor"], rel=1e-12)
        assert crit(best, quirks=False) > result["n_anchor"] * budget  # N times looser than the plain criterion


def test_search_raises_when_nothing_violates_up_to_sigma_hi():
    """σ_hi within the budget gives no certificate (2σ_hi was never seen to violate): refused, and no sampler is
    installed, unless `allow_uncertified=True`, which returns σ_hi flagged `certified=False` with a warning."""
    model = _tiny_lora()
    with pytest.raises(ValueError, match=r"no certified σ.*sigma_hi=1e-05.*`allow_uncertified=True`"):
        tfb_bayesianize(model, _anchor_batches(), metric="flip", budget=0.5, sigma_hi=1e-5, **SEARCH)
    assert not hasattr(model, "tfb_sampler")
    with pytest.warns(UserWarning, match="uncertified"):
        result = tfb_bayesianize(
            model, _anchor_batches(), metric="flip", budget=0.5, sigma_hi=1e-5, allow_uncertified=True, **SEARCH
        )
    assert result["sigma"] == 1e-5 and result["criterion"] <= 0.5 and result["certified"] is False
    assert result["criterion_at_2sigma"] <= 0.5
    assert model.tfb_sampler.sigma == 1e-5


def test_reference_quirks_needs_the_uncertified_opt_in():
    model = _tiny_lora()
    with pytest.raises(ValueError, match=r"`reference_quirks=True`.*`allow_uncertified=True`"):
        tfb_bayesianize(model, _anchor_batches(), metric="flip", budget=0.1, reference_quirks=True, **SEARCH)
    with pytest.raises(TypeError, match="`allow_uncertified`"):
        tfb_bayesianize(model, _anchor_batches(), allow_uncertified="yes", **SEARCH)


def test_search_weight_per_sequence():
    model = _tiny_lora()
    result = tfb_bayesianize(
        model, _anchor_batches(), metric="flip", budget=0.1, noise="weight_per_sequence", **SEARCH
    )
    assert model.tfb_sampler.noise == "weight_per_sequence"
    assert result["criterion"] <= 0.1 < result["criterion_at_2sigma"]


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"budget": 0.0}, "budget"),
        ({"budget": -0.1}, "budget"),
        ({"budget": 1.5}, "budget"),
        ({"metric": "accuracy"}, "metric"),
        ({"n_samples": 0}, "n_samples"),
        ({"iters": 0}, "iters"),
        ({"sigma_hi": 0.0}, "sigma_hi"),
        ({"noise": "gaussian"}, "noise"),
    ],
)
def test_search_bad_inputs(kwargs, field):
    model = _tiny_lora()
    products = _products(model)
    with pytest.raises(ValueError, match=field):
        tfb_bayesianize(model, _anchor_batches(), **kwargs)
    assert not hasattr(model, "tfb_sampler")
    for name, product in _products(model).items():  # nothing was touched
        assert torch.equal(product, products[name])


def test_search_needs_anchor_positions():
    batches = _anchor_batches()
    for batch in batches:
        batch["labels"][:] = -100
    model = _tiny_lora()
    hooks = sum(len(m._forward_hooks) for m in _lora_modules(model).values())
    with pytest.raises(ValueError, match="anchor"):
        tfb_bayesianize(model, batches)
    assert not hasattr(model, "tfb_sampler")
    assert sum(len(m._forward_hooks) for m in _lora_modules(model).values()) == hooks  # the failed search cleaned up


# ---------------------------------------------------------------------------------------------------------------------
# save / load


@pytest.mark.parametrize("save_before_search", [True, False])
def test_save_and_load_restore_the_sampler(tmp_path, save_before_search):
    """`save_tfb` writes `hf_stable_tfb.json` next to the adapter; `load_adapter` on a fresh base restores
    `model.tfb_sampler` with σ and the noise kind. The adapter may be saved before the search (original B, A): the
    restored sampler re-parameterises, so the loaded model's predictive equals the original's under the same draws."""
    model = _tiny_lora()
    batch = _anchor_batches()[0]
    if save_before_search:
        model.save_pretrained(tmp_path)
    result = tfb_bayesianize(model, _anchor_batches(), budget=0.1, noise="weight_per_sequence", **SEARCH)
    if not save_before_search:
        model.save_pretrained(tmp_path)
    file = save_tfb(model, str(tmp_path))
    assert file == os.path.join(tmp_path, "hf_stable_tfb.json")
    with open(file, encoding="utf-8") as f:
        state = json.load(f)
    assert state["sigma"] == result["sigma"] and state["noise"] == "weight_per_sequence"
    assert "tfb" in check_adapter(str(tmp_path))["variants"]

    base, _ = build_tiny_model(seed=0)
    loaded = load_adapter(base, str(tmp_path)).eval()
    assert loaded.tfb_sampler.sigma == result["sigma"] and loaded.tfb_sampler.noise == "weight_per_sequence"
    for module in _lora_modules(loaded).values():
        b = module.lora_B["default"].weight
        gram = b.T @ b
        assert (gram - torch.diag(torch.diagonal(gram))).abs().max() <= 1e-5 * gram.abs().max()
    assert torch.allclose(_logits(loaded, batch), _logits(model, batch), atol=1e-5, rtol=0)
    if save_before_search:  # same B' up to rounding → same noise under the same seed
        outputs = []
        for m in (model, loaded):
            m.tfb_sampler.generator = torch.Generator().manual_seed(0)
            outputs.append(predict_bayes(m, batch, n_samples=2))
        assert torch.allclose(outputs[0], outputs[1], atol=1e-4, rtol=0)
        assert (outputs[0] - torch.softmax(_logits(model, batch), -1)).abs().max() > 1e-5


def test_save_tfb_without_sampler(tmp_path):
    with pytest.raises(ValueError, match="tfb_bayesianize"):
        save_tfb(_tiny_lora(), str(tmp_path))
