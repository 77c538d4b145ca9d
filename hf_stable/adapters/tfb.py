"""TFB: training-free Bayesianisation of a trained LoRA adapter (Shi et al.; code `Wang-ML-Lab/bayesian-peft`).

1. Thin SVD of each `B = U diag(d) Vᵀ`; re-parameterise `B' = U diag(d)`, `A' = Vᵀ A` (so `B'A' = BA` exactly).
2. A Gaussian on `A'` with row stds `σ_A / d_i` makes the weight noise `s B' E` an isotropic Gaussian of variance σ²
   restricted to the column space of B: covariance `σ² (U Uᵀ ⊗ I)`, with σ on the ΔW scale (`σ = s σ_A`, so it is
   comparable across `lora_alpha` and `use_rslora`).
3. The largest σ whose predictions stay within a budget on anchor data (prediction flips, or relative NLL of the
   deterministic model's own predictions) is found by bisection — no training, no labels.

Sampling ("flipout") adds `(((x ⊙ r_in) Eᵀ) ⊙ s_out) B'ᵀ s` to each LoRA layer's output with one E per forward and
random signs per token, as the reference does; `noise="weight_per_sequence"` draws one E per sequence instead.

Deviations from the reference, each behind `reference_quirks=True`: it returns the smallest *violating* σ seen
(slightly over budget) where we return the largest *satisfying* one, and it divides the relative-NLL criterion by the
anchor-set size (making it N times looser). TFB applies to plain LoRA layers only (not MAP or DoRA, whose noise would
have to enter before their normalisation).
"""

from __future__ import annotations

import json
import math
import os
import statistics
from contextlib import contextmanager

import torch


TFB_FILE = "hf_stable_tfb.json"
NOISE_KINDS = ("flipout_token", "weight_per_sequence")
D_EPS = 1e-6


def _lora_layers(model):
    for module in model.modules():
        if hasattr(module, "lora_A") and hasattr(module, "lora_variant") and hasattr(module, "scaling"):
            for adapter in module.lora_A:
                if adapter in module.lora_variant:
                    raise ValueError(
                        f"TFB applies to plain LoRA layers; adapter {adapter!r} uses "
                        f"{type(module.lora_variant[adapter]).__name__}."
                    )
                yield module, adapter


@torch.no_grad()
def tfb_reparameterize(model) -> int:
    """Rewrite each LoRA pair as `B' = U diag(d)`, `A' = Vᵀ A` (fp32 SVD), leaving `B'A' = BA`. Returns the count."""
    count = 0
    for module, adapter in _lora_layers(model):
        a, b = module.lora_A[adapter].weight, module.lora_B[adapter].weight
        u, d, vh = torch.linalg.svd(b.float(), full_matrices=False)
        b.copy_((u * d).to(b.dtype))
        a.copy_((vh @ a.float()).to(a.dtype))
        count += 1
    return count


def tfb_weight_noise(
    b_prime: torch.Tensor, scaling: float, sigma: float, in_features: int, generator: torch.Generator | None = None
) -> torch.Tensor:
    """One draw of the weight noise `s B' E` with `E_ij ~ N(0, (σ/(s d_i))²)`, `d_i = ‖B'_{:,i}‖`. `(m, n)`, fp32.
    Its covariance is `σ² (U Uᵀ ⊗ I)`: isotropic in the column space of B."""
    d = b_prime.float().norm(dim=0)
    row_std = (sigma / scaling) / (d + D_EPS)
    e = torch.randn(b_prime.shape[1], in_features, generator=generator, device=b_prime.device) * row_std[:, None]
    return scaling * (b_prime.float() @ e)


class TfbSampler:
    """Adds TFB's weight noise to the output of every LoRA layer while sampling is enabled (forward hooks; the
    adapter weights are untouched). `sampler.sampling()` is a context manager; `sigma` can be changed in place."""

    def __init__(self, model, sigma: float, noise: str = "flipout_token", generator: torch.Generator | None = None):
        if noise not in NOISE_KINDS:
            raise ValueError(f"noise must be one of {NOISE_KINDS}, got {noise!r}.")
        self.model, self.sigma, self.noise, self.generator = model, float(sigma), noise, generator
        self.enabled = False
        self._handles = [module.register_forward_hook(self._hook) for module, _ in _lora_layers(model)]

    def _randn(self, *shape, device):
        return torch.randn(*shape, generator=self.generator, device=device)

    def _hook(self, module, inputs, output):
        if not self.enabled or self.sigma == 0:
            return output
        x = inputs[0].float()
        noise = torch.zeros(*x.shape[:-1], output.shape[-1], device=x.device)
        for adapter in module.active_adapters:
            if adapter not in module.lora_A:
                continue
            b = module.lora_B[adapter].weight.float()  # (m, r)
            scaling = module.scaling[adapter]
            row_std = (self.sigma / scaling) / (b.norm(dim=0) + D_EPS)  # (r,)
            r, n = b.shape[1], x.shape[-1]
            if self.noise == "flipout_token":
                e = self._randn(r, n, device=x.device) * row_std[:, None]
                sign_in = torch.sign(self._randn(*x.shape, device=x.device))
                sign_out = torch.sign(self._randn(*x.shape[:-1], r, device=x.device))
                low = ((x * sign_in) @ e.T) * sign_out
            else:  # one E per sequence: (batch, r, n)
                e = self._randn(x.shape[0], r, n, device=x.device) * row_std[None, :, None]
                low = torch.einsum("b...n,brn->b...r", x, e)
            noise = noise + scaling * (low @ b.T)
        return output + noise.to(output.dtype)

    @contextmanager
    def sampling(self, enabled: bool = True):
        previous, self.enabled = self.enabled, enabled
        try:
            yield self
        finally:
            self.enabled = previous

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _target_positions(batch):
    labels = batch["labels"][:, 1:]
    return labels != -100


@torch.no_grad()
def predict_bayes(model, batch: dict, n_samples: int = 10, sampler: TfbSampler | None = None) -> torch.Tensor:
    """Posterior-predictive next-token probabilities: the mean softmax over ``n_samples`` sampled forwards.
    `(B, T, V)` fp32. Uses ``model.tfb_sampler`` unless a sampler is given."""
    sampler = sampler or getattr(model, "tfb_sampler", None)
    if sampler is None:
        raise ValueError("No TFB sampler: run tfb_bayesianize(model, ...) or load the adapter with load_adapter.")
    inputs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask")}
    total = None
    with sampler.sampling():
        for _ in range(n_samples):
            probs = torch.softmax(model(**inputs).logits.float(), dim=-1)
            total = probs if total is None else total + probs
    return total / n_samples


def _anchor_stats(model, batches, sampler, n_samples):
    """Per anchor position: the deterministic prediction and the mean predictive probabilities (fp32)."""
    flips, nll, count = 0.0, 0.0, 0
    for batch, (pseudo, _) in batches:
        mask = _target_positions(batch)
        if sampler is None:
            probs = torch.softmax(model(**{k: batch[k] for k in ("input_ids", "attention_mask")}).logits.float(), -1)
        else:
            probs = predict_bayes(model, batch, n_samples, sampler)
        probs = probs[:, :-1][mask]
        flips += (probs.argmax(-1) != pseudo).float().sum().item()
        nll -= torch.log(probs.gather(-1, pseudo[:, None]).clamp(min=1e-30)).sum().item()
        count += pseudo.numel()
    return flips / max(count, 1), nll / max(count, 1), count


@torch.no_grad()
def tfb_bayesianize(
    model,
    anchor_loader,
    metric: str = "flip",
    budget: float = 0.01,
    sigma_hi: float | None = None,
    iters: int = 10,
    n_samples: int = 10,
    noise: str = "flipout_token",
    seed: int = 0,
    reference_quirks: bool = False,
) -> dict:
    """Find the largest σ whose posterior predictions stay within ``budget`` on anchor data, and install the sampler.

    Args:
        model: a `PeftModel` with a trained plain-LoRA adapter.
        anchor_loader: batches with ``input_ids``, ``attention_mask`` and ``labels`` (-100 where not predicted), e.g.
            a DataLoader over training data with the SFT collator. Labels only mark positions: the reference
            predictions are the deterministic model's own.
        metric (`str`): ``"flip"`` (share of anchor predictions whose argmax changes) or ``"nll"`` (relative change
            of the NLL of the deterministic predictions).
        budget (`float`): the tolerated flip rate / relative NLL change.
        sigma_hi (`float`, *optional*): upper end of the search on the ΔW scale; default `0.1 × median over layers of
            ‖sBA‖_F/√(mn)`, doubled (up to 5 times) until it violates the budget.
        iters (`int`): bisection steps. n_samples (`int`): samples per predictive evaluation.
        noise (`str`): ``"flipout_token"`` (reference) or ``"weight_per_sequence"``.
        seed (`int`): the noise uses a private generator reset at every evaluation (common random numbers across σ).
        reference_quirks (`bool`): reproduce the reference code (see the module docstring).

    Returns:
        `dict` with ``sigma`` (installed as `model.tfb_sampler`), ``sigma_hi``, ``criterion`` at σ and at 2σ,
        ``budget``, ``metric``, ``history`` of `(σ, criterion)`.
    """
    if metric not in ("flip", "nll"):
        raise ValueError(f"metric must be 'flip' or 'nll', got {metric!r}.")
    if not 0 < budget < 1:
        raise ValueError(f"budget must be in (0, 1), got {budget}.")
    was_training = model.training
    model.eval()
    tfb_reparameterize(model)
    device = next(model.parameters()).device
    batches = []
    for batch in anchor_loader:  # deterministic reference predictions
        batch = {k: v.to(device) for k, v in batch.items() if k in ("input_ids", "attention_mask", "labels")}
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
        pseudo = logits[:, :-1][_target_positions(batch)].argmax(-1)
        batches.append((batch, (pseudo, None)))
    _, nll0, n_anchor = _anchor_stats(model, batches, None, 1)
    generator = torch.Generator(device=device)
    sampler = TfbSampler(model, 0.0, noise, generator)

    def criterion(sigma: float) -> float:
        sampler.sigma = sigma
        generator.manual_seed(seed)
        flips, nll, _ = _anchor_stats(model, batches, sampler, n_samples)
        if metric == "flip":
            return flips
        value = abs(nll - nll0) / max(nll0, 1e-12)
        return value / n_anchor if reference_quirks else value

    if sigma_hi is None:
        ratios = [
            module.scaling[a]
            * (module.lora_B[a].weight.float() @ module.lora_A[a].weight.float()).norm().item()
            / math.sqrt(module.in_features * module.out_features)
            for module, a in _lora_layers(model)
        ]
        sigma_hi = 0.1 * statistics.median(ratios) if ratios and statistics.median(ratios) > 0 else 1e-2
        for _ in range(5):
            if criterion(sigma_hi) > budget:
                break
            sigma_hi *= 2
    history = []
    low, high, violator = 0.0, float(sigma_hi), None
    for _ in range(iters):
        mid = (low + high) / 2
        value = criterion(mid)
        history.append((mid, value))
        if value > budget:
            high, violator = mid, mid if reference_quirks else violator
        else:
            low = mid
    sigma = (violator if violator is not None else sigma_hi) if reference_quirks else low
    result = {
        "sigma": sigma,
        "sigma_hi": sigma_hi,
        "criterion": criterion(sigma),
        "criterion_at_2sigma": criterion(2 * sigma),
        "budget": budget,
        "metric": metric,
        "noise": noise,
        "history": history,
    }
    sampler.sigma = sigma
    sampler.generator = None
    if hasattr(model, "tfb_sampler"):
        model.tfb_sampler.remove()
    model.tfb_sampler = sampler
    model.train(was_training)
    return result


def save_tfb(model, path: str) -> str:
    """Write σ (and the noise kind) next to a saved adapter, so `load_adapter` restores sampling."""
    sampler = getattr(model, "tfb_sampler", None)
    if sampler is None:
        raise ValueError("The model has no TFB sampler to save; run tfb_bayesianize first.")
    from .. import __version__

    os.makedirs(path, exist_ok=True)
    file = os.path.join(path, TFB_FILE)
    tmp = file + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"sigma": sampler.sigma, "noise": sampler.noise, "hf_stable_version": __version__}, f, indent=2)
    os.replace(tmp, file)
    return file
