"""TFB: training-free Bayesianisation of a trained LoRA adapter.

Shi, Wang, Han, Zhang, Wang, "Training-Free Bayesianization for Low-Rank Adapters of Large Language Models",
arXiv 2412.05723 (NeurIPS 2025); reference code `Wang-ML-Lab/bayesian-peft` (`modelwrappers/tfblora*.py`,
`modelwrappers/blob.py`).

For a LoRA layer with `A (r, n)`, `B (m, r)` and scale `s` (`ΔW = s B A`, `m = out_features`, `n = in_features`):

1. Thin SVD of `B = U diag(d) Vᵀ`; re-parameterise `B' = U diag(d)`, `A' = Vᵀ A` (so `B'A' = BA` exactly).
2. A Gaussian on `A'` with row stds `σ_A / d_i` makes the weight noise `s B' E` an isotropic Gaussian of variance σ²
   restricted to the column space of B: covariance `σ² (U Uᵀ ⊗ I)`, with σ on the ΔW scale (`σ = s σ_A`, so it is
   comparable across `lora_alpha` and `use_rslora`).
3. The largest σ whose predictions stay within a budget on anchor data (prediction flips, or relative NLL of the
   deterministic model's own predictions) is found by bisection — no training, no labels.

Sampling ("flipout") adds `(((x ⊙ r_in) Eᵀ) ⊙ s_out) B'ᵀ s` to each LoRA layer's output with one E per forward and
random signs per token, as the reference does; `noise="weight_per_sequence"` draws one E per sequence instead.

Deviations from the reference, each behind `reference_quirks=True`: it returns the smallest *violating* σ seen
(slightly over budget) where we return a *satisfying* one (`criterion(σ) ≤ budget < criterion(2σ)`), and it divides
the relative-NLL criterion by the number of anchor predictions (making it N times looser). The reference searches
`[0.001, σ_hi]` on the `σ_A` scale; we search `[0, σ_hi]` on the ΔW scale in both modes. TFB applies to plain LoRA
`Linear` layers only (not MAP or DoRA, whose noise would have to enter before their normalisation).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import warnings
from contextlib import contextmanager

import torch

from .._validation import check_bool
from .._version import __version__


TFB_FILE = "hf_stable_tfb.json"
NOISE_KINDS = ("flipout_token", "weight_per_sequence")
METRICS = ("flip", "nll")
D_EPS = 1e-6  # added to d_i in the row stds, as the reference does


def _lora_layers(model):
    """Yield `(module, adapter)` for every LoRA adapter of every LoRA layer; refuse variants TFB cannot handle."""
    for module in model.modules():
        if hasattr(module, "lora_A") and hasattr(module, "lora_variant") and hasattr(module, "scaling"):
            for adapter in module.lora_A:
                if adapter in module.lora_variant:
                    raise ValueError(
                        f"TFB applies to plain LoRA layers; adapter {adapter!r} uses "
                        f"{type(module.lora_variant[adapter]).__name__}."
                    )
                weight = module.lora_B[adapter].weight
                if weight.dim() != 2 or module.lora_A[adapter].weight.dim() != 2:
                    raise ValueError(
                        f"TFB applies to LoRA Linear layers only; {type(module).__name__} has a "
                        f"{weight.dim()}-d lora_B weight."
                    )
                yield module, adapter


def _lora_modules(model) -> list:
    """The LoRA layers, each once (a layer with several adapters is one module)."""
    modules, seen = [], set()
    for module, _ in _lora_layers(model):
        if id(module) not in seen:
            seen.add(id(module))
            modules.append(module)
    return modules


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32, or fp64 for fp64 tensors (half precision has no SVD and overflows with σ/1e-6)."""
    return torch.promote_types(dtype, torch.float32)


@torch.no_grad()
def tfb_reparameterize(model) -> int:
    """Rewrite each LoRA pair in place as `B' = U diag(d)`, `A' = Vᵀ A`, leaving `B'A' = BA`.

    With `B (m, r)`, `A (r, n)` and `k = min(m, r)`: `U (m, k)`, `d (k,)`, `V (r, k)`. When `r > m`, `B'` gets
    `r - k` zero columns and `A'` the matching zero rows, so the shapes stay `(m, r)` and `(r, n)`. The SVD runs in
    fp32 (fp64 for fp64 weights); the result is cast back to the weights' dtype. Idempotent up to rounding
    (singular vectors get a fixed sign), unless singular values tie.
    TFB: Shi et al., arXiv 2412.05723.

    Returns:
        `int`: the number of (layer, adapter) pairs rewritten.
    """
    count = 0
    for module, adapter in _lora_layers(model):
        a, b = module.lora_A[adapter].weight, module.lora_B[adapter].weight  # (r, n), (m, r)
        dtype = _compute_dtype(b.dtype)
        u, d, vh = torch.linalg.svd(b.to(dtype), full_matrices=False)  # (m, k), (k,), (k, r)
        # SVD signs are arbitrary: fix them (largest entry of each column of U positive) so that re-running on an
        # already re-parameterised pair leaves it unchanged and a seeded noise draw stays reproducible across calls
        pivot = u.abs().argmax(dim=0)
        sign = torch.sign(u[pivot, torch.arange(u.shape[1])])
        sign[sign == 0] = 1
        u, vh = u * sign, vh * sign[:, None]
        b_new, a_new = u * d, vh @ a.to(dtype)  # (m, k), (k, n)
        rank, k = b.shape[1], d.shape[0]
        if k < rank:
            b_new = torch.cat([b_new, b_new.new_zeros(b.shape[0], rank - k)], dim=1)
            a_new = torch.cat([a_new, a_new.new_zeros(rank - k, a.shape[1])], dim=0)
        b.copy_(b_new.to(b.dtype))
        a.copy_(a_new.to(a.dtype))
        count += 1
    return count


def _row_std(b_prime: torch.Tensor, scaling: float, sigma: float) -> torch.Tensor:
    """`(r,)`: the std of row i of E, `σ / (s (d_i + 1e-6))` with `d_i = ‖B'_{:,i}‖`."""
    return (sigma / scaling) / (b_prime.norm(dim=0) + D_EPS)


def tfb_weight_noise(
    b_prime: torch.Tensor, scaling: float, sigma: float, in_features: int, generator: torch.Generator | None = None
) -> torch.Tensor:
    """One draw of TFB's weight noise `s B' E` (Shi et al., arXiv 2412.05723).

    Args:
        b_prime (`torch.Tensor` of shape `(m, r)`): the re-parameterised `B' = U diag(d)` (orthogonal columns; see
            `tfb_reparameterize`).
        scaling (`float`): the LoRA scale s (`α/r`, or `α/√r` with rsLoRA); must be non-zero.
        sigma (`float`): σ ≥ 0, the noise std on the ΔW scale.
        in_features (`int`): n.
        generator (`torch.Generator`, *optional*): source of the draws.

    Returns:
        `torch.Tensor` of shape `(m, n)`, fp32 (fp64 for an fp64 `b_prime`): `s B' E` with `E (r, n)`,
        `E_ij ~ N(0, (σ / (s (d_i + 1e-6)))²)`, `d_i = ‖B'_{:,i}‖`. Its covariance is `σ² (U Uᵀ ⊗ I)`: every column is
        `N(0, σ² U Uᵀ)` (isotropic variance σ² in the column space of B, nothing outside), columns independent.
    """
    if not sigma >= 0:
        raise ValueError(f"sigma must be >= 0, got {sigma}.")
    if scaling == 0:
        raise ValueError("scaling must be non-zero.")
    if in_features < 1:
        raise ValueError(f"in_features must be >= 1, got {in_features}.")
    b = b_prime.to(_compute_dtype(b_prime.dtype))
    row_std = _row_std(b, scaling, sigma)
    e = torch.randn(b.shape[1], in_features, generator=generator, device=b.device, dtype=b.dtype)
    return scaling * (b @ (e * row_std[:, None]))


class TfbSampler:
    """Adds TFB's weight noise to the output of every LoRA layer while sampling is enabled.

    Forward hooks on the LoRA layers (one per layer) add, for every active adapter, with `x (..., n)` the layer input:

    * ``noise="flipout_token"`` (the reference, `blob_linear_forward`): one `E (r, n)` per forward and random signs
      `r_in (..., n)`, `s_out (..., r)` per token: `(((x ⊙ r_in) Eᵀ) ⊙ s_out) B'ᵀ s`;
    * ``noise="weight_per_sequence"``: one `E_b (r, n)` per sequence (first dimension of x), shared by all its tokens:
      `x E_bᵀ B'ᵀ s`, i.e. sequence b sees the weight `W + s B' E_b`.

    with E's row stds `σ / (s (d_i + 1e-6))`, so the weight noise has covariance `σ² (U Uᵀ ⊗ I)` (Shi et al., arXiv
    2412.05723). The noise is computed in fp32 (fp64 for fp64 inputs) and added in the output's dtype. Layers whose
    adapters are disabled get no noise.

    The noise formula needs `B'` with orthogonal columns, so the constructor applies `tfb_reparameterize` (which
    leaves `B'A' = BA`: the deterministic model is unchanged up to rounding). The adapter weights are not touched
    afterwards. `sampler.sampling()` is a context manager; `sigma` can be changed in place.

    Args:
        model: a model with plain LoRA layers (a `PeftModel`).
        sigma (`float`): σ ≥ 0 on the ΔW scale.
        noise (`str`): one of ``"flipout_token"``, ``"weight_per_sequence"``.
        generator (`torch.Generator`, *optional*): source of the noise (the global RNG when `None`).
    """

    def __init__(self, model, sigma: float, noise: str = "flipout_token", generator: torch.Generator | None = None):
        if noise not in NOISE_KINDS:
            raise ValueError(f"noise must be one of {NOISE_KINDS}, got {noise!r}.")
        if not float(sigma) >= 0:
            raise ValueError(f"sigma must be >= 0, got {sigma}.")
        modules = _lora_modules(model)
        if not modules:
            raise ValueError("TFB needs a model with LoRA layers; none found.")
        tfb_reparameterize(model)
        self.model, self.sigma, self.noise, self.generator = model, float(sigma), noise, generator
        self.enabled = False
        self._handles = [module.register_forward_hook(self._hook) for module in modules]

    def _randn(self, *shape, device, dtype):
        return torch.randn(*shape, generator=self.generator, device=device, dtype=dtype)

    def _sign(self, *shape, device, dtype):
        return torch.sign(self._randn(*shape, device=device, dtype=dtype))

    def _hook(self, module, inputs, output):
        if not self.enabled or self.sigma == 0 or getattr(module, "disable_adapters", False):
            return output
        dtype = _compute_dtype(inputs[0].dtype)
        x = inputs[0].to(dtype)  # (..., n)
        noise = None
        for adapter in module.active_adapters:
            if adapter not in module.lora_A:
                continue
            b = module.lora_B[adapter].weight.to(dtype)  # (m, r)
            scaling = module.scaling[adapter]
            row_std = _row_std(b, scaling, self.sigma)  # (r,)
            r, n = b.shape[1], x.shape[-1]
            if self.noise == "flipout_token":
                e = self._randn(r, n, device=x.device, dtype=dtype) * row_std[:, None]
                sign_in = self._sign(*x.shape, device=x.device, dtype=dtype)
                sign_out = self._sign(*x.shape[:-1], r, device=x.device, dtype=dtype)
                low = ((x * sign_in) @ e.T) * sign_out  # (..., r)
            else:  # one E per sequence: (batch, r, n)
                e = self._randn(x.shape[0], r, n, device=x.device, dtype=dtype) * row_std[None, :, None]
                low = torch.einsum("b...n,brn->b...r", x, e)
            term = scaling * (low @ b.T)  # (..., m)
            noise = term if noise is None else noise + term
        return output if noise is None else output + noise.to(output.dtype)

    @contextmanager
    def sampling(self, enabled: bool = True):
        """Within the block, sampling is on (or off with ``enabled=False``); the previous state is restored."""
        previous, self.enabled = self.enabled, enabled
        try:
            yield self
        finally:
            self.enabled = previous

    def remove(self) -> None:
        """Remove the hooks (the model is deterministic again)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _target_positions(batch) -> torch.Tensor:
    """`(B, T-1)` bool: the positions whose next token is predicted (``labels != -100``, else the attention mask)."""
    if "labels" in batch:
        return batch["labels"][:, 1:] != -100
    if "attention_mask" in batch:
        return batch["attention_mask"][:, 1:].bool()
    return torch.ones_like(batch["input_ids"][:, 1:], dtype=torch.bool)


def _model_inputs(batch, device):
    return {k: batch[k].to(device) for k in ("input_ids", "attention_mask") if k in batch}


@torch.no_grad()
def predict_bayes(
    model, batch: dict, n_samples: int = 10, sampler: TfbSampler | None = None, sample: bool = True
) -> torch.Tensor:
    """Posterior-predictive next-token probabilities of a TFB model (Shi et al., arXiv 2412.05723): the mean softmax
    over ``n_samples`` sampled forwards, in eval mode (the mode is restored).

    Args:
        model: the model carrying the sampler's hooks.
        batch (`dict`): ``input_ids`` `(B, T)` and optionally ``attention_mask`` `(B, T)`; other keys are ignored.
        n_samples (`int`): forwards to average, ≥ 1.
        sampler (`TfbSampler`, *optional*): defaults to ``model.tfb_sampler``.
        sample (`bool`): with `False` the forwards are deterministic (the softmax of the plain model).

    Returns:
        `torch.Tensor` of shape `(B, T, V)`, fp32 (rows sum to 1).
    """
    if isinstance(n_samples, bool) or not isinstance(n_samples, int) or n_samples < 1:
        raise ValueError(f"n_samples must be an int >= 1, got {n_samples!r}.")
    sampler = sampler if sampler is not None else getattr(model, "tfb_sampler", None)
    if sampler is None and sample:
        raise ValueError("No TFB sampler: run tfb_bayesianize(model, ...) or load the adapter with load_adapter.")
    inputs = _model_inputs(batch, next(model.parameters()).device)
    was_training = model.training
    model.eval()
    total = None
    try:
        with sampler.sampling(sample) if sampler is not None else contextlib.nullcontext():
            for _ in range(n_samples):
                probs = torch.softmax(model(**inputs).logits.float(), dim=-1)
                total = probs if total is None else total + probs
    finally:
        model.train(was_training)
    return total / n_samples


@torch.no_grad()
def _anchor_stats(model, batches, sampler, n_samples):
    """Flip rate and mean NLL of the pseudo-labels over all anchor positions, and their count.

    ``batches``: `[(batch, pseudo)]` with `pseudo` the deterministic argmax at the target positions. Without a sampler
    the forwards are deterministic.
    """
    flips, nll, count = 0.0, 0.0, 0
    for batch, pseudo in batches:
        mask = _target_positions(batch)
        if sampler is None:
            probs = torch.softmax(model(**_model_inputs(batch, pseudo.device)).logits.float(), -1)
        else:
            probs = predict_bayes(model, batch, n_samples, sampler)
        probs = probs[:, :-1][mask]  # (N_b, V)
        flips += (probs.argmax(-1) != pseudo).sum().item()
        nll -= torch.log(probs.gather(-1, pseudo[:, None]).clamp(min=1e-30)).sum().item()
        count += pseudo.numel()
    return flips / max(count, 1), nll / max(count, 1), count


def _default_sigma_hi(model) -> float:
    """`0.1 × median over LoRA layers of ‖s B A‖_F / √(m n)` (1e-2 when every update is zero)."""
    ratios = []
    for module, adapter in _lora_layers(model):
        a, b = module.lora_A[adapter].weight, module.lora_B[adapter].weight
        dtype = _compute_dtype(b.dtype)
        update = abs(module.scaling[adapter]) * (b.to(dtype) @ a.to(dtype)).norm().item()
        ratios.append(update / math.sqrt(b.shape[0] * a.shape[1]))
    median = statistics.median(ratios) if ratios else 0.0
    return 0.1 * median if median > 0 else 1e-2


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
    allow_uncertified: bool = False,
) -> dict:
    """Find the largest σ whose posterior predictions stay within ``budget`` on anchor data, and install the sampler
    as ``model.tfb_sampler`` (TFB, Shi et al., arXiv 2412.05723; the reference's `TFBLoRA.fit`).

    The LoRA weights are re-parameterised in place (`tfb_reparameterize`; the deterministic model is unchanged).
    The criterion at σ is computed over all anchor target positions with the predictive `predict_bayes(...,
    n_samples)`, against the deterministic model's argmax `y*` (pseudo-labels; labels only mark positions):

    * ``"flip"``: the share of positions whose predictive argmax differs from `y*`;
    * ``"nll"``: `|NLL_σ − NLL_0| / NLL_0`, NLL the mean of `−log p(y*)` over the positions (`/ N` more with
      ``reference_quirks``, N = number of positions).

    Search: ``iters`` bisection steps on `[0, σ_hi]` give `low` (halved further if every probe violated, doubled while
    `2σ` still satisfies a non-monotone criterion). The result is *certified* when `criterion(σ) ≤ budget <
    criterion(2σ)`. An uncertified σ raises a `ValueError` unless ``allow_uncertified=True`` (then it is returned
    with a warning and ``certified=False``): σ_hi itself when nothing up to it violates the budget, or a σ whose
    doubling never violated it. With ``reference_quirks=True`` the result is the smallest violating σ probed (σ_hi if
    none), which is uncertified by construction, so it needs ``allow_uncertified=True`` as well.

    Args:
        model: a `PeftModel` with a trained plain-LoRA adapter.
        anchor_loader: iterable of batches with ``input_ids`` `(B, T)`, ``attention_mask`` `(B, T)` and ``labels``
            `(B, T)` (-100 where not predicted; without labels every attended next token counts), e.g. a DataLoader
            over training data with the SFT collator.
        metric (`str`): ``"flip"`` or ``"nll"``.
        budget (`float`): the tolerated flip rate / relative NLL change, in (0, 1).
        sigma_hi (`float`, *optional*): upper end of the search on the ΔW scale, > 0; default `0.1 × median over
            layers of ‖sBA‖_F/√(mn)`, doubled (up to 5 times) until it violates the budget.
        iters (`int`): bisection steps, ≥ 1. n_samples (`int`): samples per predictive evaluation, ≥ 1.
        noise (`str`): ``"flipout_token"`` (reference) or ``"weight_per_sequence"``.
        seed (`int`): the noise uses a private generator reset to ``seed`` at every evaluation of the criterion
            (common random numbers across σ); the installed sampler then uses the global RNG.
        reference_quirks (`bool`): reproduce the reference code (see the module docstring).
        allow_uncertified (`bool`): return a σ without the certificate `criterion(σ) ≤ budget < criterion(2σ)`
            instead of raising.

    Returns:
        `dict` with ``sigma`` (installed as `model.tfb_sampler`), ``sigma_hi``, ``criterion`` at σ and
        ``criterion_at_2sigma``, ``certified``, ``budget``, ``metric``, ``noise``, ``n_anchor`` (positions) and
        ``history`` of `(σ, criterion)` in evaluation order.
    """
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {METRICS}, got {metric!r}.")
    if not 0 < budget < 1:
        raise ValueError(f"budget must be in (0, 1), got {budget}.")
    if sigma_hi is not None and not sigma_hi > 0:
        raise ValueError(f"sigma_hi must be > 0, got {sigma_hi}.")
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 1:
        raise ValueError(f"iters must be an int >= 1, got {iters!r}.")
    if isinstance(n_samples, bool) or not isinstance(n_samples, int) or n_samples < 1:
        raise ValueError(f"n_samples must be an int >= 1, got {n_samples!r}.")
    if noise not in NOISE_KINDS:
        raise ValueError(f"noise must be one of {NOISE_KINDS}, got {noise!r}.")
    check_bool("reference_quirks", reference_quirks)
    check_bool("allow_uncertified", allow_uncertified)
    if reference_quirks and not allow_uncertified:
        raise ValueError(
            "`reference_quirks=True` returns the reference's σ, the smallest one probed that *violates* the budget: "
            "it is uncertified by construction. Pass `allow_uncertified=True` as well to accept that."
        )
    if not _lora_modules(model):  # also refuses MAP / DoRA / sine adapters
        raise ValueError("TFB needs a model with LoRA layers; none found.")

    was_training = model.training
    device = next(model.parameters()).device
    generator = torch.Generator(device=device)
    sampler = None
    model.eval()
    try:
        sampler = TfbSampler(model, 0.0, noise, generator)  # re-parameterises
        batches = []
        for batch in anchor_loader:  # deterministic reference predictions (pseudo-labels)
            batch = {k: v.to(device) for k, v in batch.items() if k in ("input_ids", "attention_mask", "labels")}
            logits = model(**_model_inputs(batch, device)).logits.float()
            batches.append((batch, logits[:, :-1][_target_positions(batch)].argmax(-1)))
        _, nll0, n_anchor = _anchor_stats(model, batches, None, 1)
        if n_anchor == 0:
            raise ValueError("anchor_loader has no target positions (all labels are -100, or it is empty).")

        history, cache = [], {}

        def criterion(sigma: float) -> float:
            if sigma not in cache:
                sampler.sigma = sigma
                generator.manual_seed(seed)
                flips, nll, _ = _anchor_stats(model, batches, sampler, n_samples)
                if metric == "flip":
                    value = flips
                else:
                    value = abs(nll - nll0) / max(nll0, 1e-12)
                    value = value / n_anchor if reference_quirks else value
                cache[sigma] = value
                history.append((sigma, value))
            return cache[sigma]

        auto = sigma_hi is None
        sigma_hi = _default_sigma_hi(model) if auto else float(sigma_hi)
        if auto:
            for _ in range(5):
                if criterion(sigma_hi) > budget:
                    break
                sigma_hi *= 2
        hi_violates = criterion(sigma_hi) > budget

        low, high, violator = 0.0, sigma_hi, None
        if reference_quirks or hi_violates:
            for _ in range(iters):
                mid = (low + high) / 2
                if criterion(mid) > budget:
                    high = violator = mid
                else:
                    low = mid
        if reference_quirks:
            sigma = violator if violator is not None else sigma_hi
        elif not hi_violates:
            sigma = sigma_hi
        else:
            if low == 0.0:  # every probe violated: halve until one satisfies (criterion(0) = 0)
                for _ in range(40):
                    high /= 2
                    if criterion(high) <= budget:
                        low = high
                        break
            for _ in range(20):  # certificate: criterion(2σ) > budget, also for a non-monotone criterion
                if low == 0.0 or criterion(2 * low) > budget:
                    break
                low *= 2
            sigma = low
        at_sigma = criterion(sigma) if sigma > 0 else 0.0
        at_double = criterion(2 * sigma) if sigma > 0 else 0.0
        certified = at_sigma <= budget < at_double
        if not certified:
            why = (
                f"the {metric} criterion stays within the budget {budget} up to sigma_hi={sigma_hi:.4g} (returned)"
                if not hi_violates and not reference_quirks
                else f"criterion(σ={sigma:.4g}) = {at_sigma:.4g} and criterion(2σ) = {at_double:.4g} against the "
                f"budget {budget}"
            )
            if not allow_uncertified:
                raise ValueError(
                    f"TFB found no certified σ (criterion(σ) <= budget < criterion(2σ)): {why}. Pass a larger "
                    "`sigma_hi` to search further, or `allow_uncertified=True` to accept this σ."
                )
            warnings.warn(f"TFB: σ = {sigma:.4g} is uncertified: {why}.", stacklevel=3)
        result = {
            "sigma": sigma,
            "sigma_hi": sigma_hi,
            "criterion": at_sigma,
            "criterion_at_2sigma": at_double,
            "certified": certified,
            "budget": budget,
            "metric": metric,
            "noise": noise,
            "n_anchor": n_anchor,
            "history": history,
        }
    except BaseException:
        if sampler is not None:
            sampler.remove()
        raise
    finally:
        model.train(was_training)
    sampler.sigma = sigma
    sampler.generator = None
    previous = getattr(model, "tfb_sampler", None)
    if previous is not None:
        previous.remove()
    model.tfb_sampler = sampler
    return result


def save_tfb(model, path: str) -> str:
    """Write σ and the noise kind of ``model.tfb_sampler`` (TFB, Shi et al., arXiv 2412.05723) to
    ``path/hf_stable_tfb.json``, next to the adapter saved there with `model.save_pretrained(path)`, so
    `hf_stable.adapters.load_adapter` restores the sampler (it re-parameterises the loaded weights, so the adapter
    may be saved before or after the search).

    Returns:
        `str`: the file written.
    """
    sampler = getattr(model, "tfb_sampler", None)
    if sampler is None:
        raise ValueError("The model has no TFB sampler to save; run tfb_bayesianize first.")
    os.makedirs(path, exist_ok=True)
    file = os.path.join(path, TFB_FILE)
    tmp = file + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"sigma": sampler.sigma, "noise": sampler.noise, "hf_stable_version": __version__}, f, indent=2)
    os.replace(tmp, file)
    return file
