"""Stable-SPAM: spike-aware clipping, gradient-norm normalisation and periodic moment reset around AdamW.

Huang et al., *Stable-SPAM: How to Train in 4-Bit More Stably than 16-Bit Adam*, arXiv 2502.17055. Followed: the
authors' optimizer, ``galore_torch/stablespam.py`` of ``TianjinYellow/StableSPAM`` (class ``StableSPAM``), rewritten
here in our own words; the update is the same as that file's on the same gradients (tested to 1e-6 against an
independent re-derivation in ``tests/stability/test_stable_spam.py``).

For every parameter with gradient ``G`` (any shape), at its step ``k`` (1-based) and the optimizer's step ``t``:

1. **Spike clipping at the historical maximum** (`spike_clip`): ``m_max ← θ·m_max + (1 − θ)·max|G|``, threshold
   ``τ = m_max / (1 − θᵏ)``; every entry with ``|G_ij| > τ`` becomes ``G_ij / max|G| · τ`` (sign kept, magnitude at
   most τ).
2. **Normalisation by the historical ℓ2-norm statistics** (`norm_rescale`): with ``n = ‖G‖₂`` of the clipped matrix,
   ``m ← γ₁'·m + (1 − γ₁')·n``, ``v ← γ₂·v + (1 − γ₂)·n²``, and ``G ← G / n · m̂ / (√v̂ + ε)`` (bias-corrected with
   ``k``): the new norm is the ratio ``m̂/(√v̂ + ε)``, about 1 while the norm is steady; a zero gradient stays
   zero.
3. **Momentum decay** (optional, `momentum_scale`): with ``decay_steps = T`` set, β₁ and γ₁ are multiplied by
   ``s_t = η_min + (1 − η_min)·(1 + cos(π·t / (T + 1))) / 2`` (a cosine from 1 to ``eta_min``, as the reference's
   ``CosineDecay`` with ``total_T``), so ``γ₁' = γ₁·s_t`` and ``β₁' = β₁·s_t``.
4. **Moment reset** every ``reset_interval`` optimizer steps (the reference's ``update_proj_gap``), then
   **AdamW**: decoupled weight decay ``p ← p·(1 − lr·wd)`` first, ``M ← β₁'M + (1 − β₁')G``,
   ``V ← β₂V + (1 − β₂)G²``, ``p ← p − lr/(1 − β₁'ᵏ) · M / (√V/√(1 − β₂ᵏ) + ε)``.

Two details of the reference are kept because they define its update: at a reset step the per-parameter step ``k``
restarts at 1, but the update of that step still uses the moments accumulated so far (bias-corrected as at step 1),
and the zeroed moments take effect from the next step; the restarted ``k`` also bias-corrects steps 1 and 2 from then
on, so right after a reset the clipping threshold is ``m_max / (1 − θᵏ)`` with a small ``k`` (loose: with θ = 0.999,
500× the running maximum at ``k = 2``) and tightens over the following ``~1/(1 − θ)`` steps.

Ours, beyond the reference: the clip and normalisation run in fp32 whatever the parameter's dtype, and the three
statistics stay fp32 through ``load_state_dict`` (torch casts optimizer state to the parameter's dtype); a step in
which no parameter has a gradient (the stability guard's skip) is not counted; ``amsgrad`` and the reference's
``gamma1=-1`` shortcut are not offered. Defaults are the reference constructor's: γ₁ = 0.7, γ₂ = 0.9, θ = 0.999, reset
every 1000 steps, no momentum decay (its pretraining runs set ``total_T`` to the run's length, ``eta_min=0.5``).

Pure torch.
"""

from __future__ import annotations

import math

import torch


__all__ = ["StableSPAM", "momentum_scale", "norm_rescale", "spike_clip"]

STEPS_KEY = "stable_spam_steps"  # the optimizer-wide step count, kept in the state dict beside "state"
_FP32_STATE = ("m_max", "m_norm", "v_norm")


def spike_clip(grad: torch.Tensor, m_max: torch.Tensor, step: int, theta: float):
    """Clip the spiked entries of one gradient at its bias-corrected historical maximum.

    Args:
        grad: the gradient, any shape (fp32).
        m_max: ``()`` the EMA of ``max|G|`` before this step (fp32).
        step: the parameter's step ``k`` ≥ 1 (bias correction).
        theta: EMA coefficient θ ∈ [0, 1).

    Returns:
        ``(clipped, m_max, n_clipped)``: the gradient (shape of ``grad``), the updated ``()`` EMA, and the ``()``
        number of entries clipped.
    """
    g_max = grad.abs().max()
    m_max = theta * m_max + (1.0 - theta) * g_max
    threshold = m_max / (1.0 - theta**step)
    over = grad.abs() > threshold
    # an entry above the threshold implies max|G| > 0: the guard only keeps the discarded branch finite
    safe_max = torch.where(g_max > 0, g_max, torch.ones_like(g_max))
    return torch.where(over, grad / safe_max * threshold, grad), m_max, over.sum()


def norm_rescale(
    grad: torch.Tensor,
    m_norm: torch.Tensor,
    v_norm: torch.Tensor,
    step: int,
    gamma1: float,
    gamma2: float,
    eps: float,
):
    """Rescale a gradient to the bias-corrected ratio of its ℓ2-norm's first and second moments.

    Args:
        grad: the (clipped) gradient, any shape (fp32).
        m_norm, v_norm: ``()`` EMAs of ``‖G‖₂`` and ``‖G‖₂²`` before this step (fp32).
        step: the parameter's step ``k`` ≥ 1.
        gamma1: the effective first-moment coefficient (γ₁ times the momentum scale), in [0, 1).
        gamma2: the second-moment coefficient, in [0, 1).
        eps: added to ``√v̂``.

    Returns:
        ``(rescaled, m_norm, v_norm)``: ``G / ‖G‖ · m̂ / (√v̂ + ε)`` (``G`` unchanged when ``‖G‖ = 0``) and the updated
        ``()`` moments.
    """
    norm = torch.linalg.vector_norm(grad)
    m_norm = gamma1 * m_norm + (1.0 - gamma1) * norm
    v_norm = gamma2 * v_norm + (1.0 - gamma2) * norm**2
    m_hat = m_norm / (1.0 - gamma1**step)
    v_hat = v_norm / (1.0 - gamma2**step)
    target = m_hat / (v_hat.sqrt() + eps)
    positive = norm > 0
    safe_norm = torch.where(positive, norm, torch.ones_like(norm))
    return torch.where(positive, grad / safe_norm * target, grad), m_norm, v_norm


def momentum_scale(step: int, decay_steps: int | None, eta_min: float) -> float:
    """``s_t``: 1 without decay, else the cosine from 1 (t = 0) to ``eta_min`` (t = ``decay_steps`` + 1); past that
    the cosine rises again, as the reference's."""
    if decay_steps is None:
        return 1.0
    return eta_min + (1.0 - eta_min) * (1.0 + math.cos(math.pi * step / (decay_steps + 1))) / 2.0


class StableSPAM(torch.optim.Optimizer):
    """The Stable-SPAM optimizer (see the module docstring for the update).

    Args:
        params: parameters or param groups (a group may set ``lr``, ``betas``, ``eps``, ``weight_decay``).
        lr, betas, eps, weight_decay: AdamW's (decoupled weight decay).
        gamma1, gamma2: EMA coefficients of the gradient norm's first and second moments (reference defaults 0.7, 0.9).
        theta: EMA coefficient of the historical ``max|G|`` (the reference's ``gamma3``, 0.999).
        reset_interval: zero Adam's moments every this many optimizer steps (the reference's ``update_proj_gap``);
            0 never resets.
        decay_steps: cosine momentum decay horizon (the reference's ``total_T``); None: no decay.
        eta_min: the momentum scale at the end of the decay.

    State per parameter: ``step`` (int), ``exp_avg``, ``exp_avg_sq`` (the parameter's dtype), ``m_max``, ``m_norm``,
    ``v_norm`` (fp32 scalars); optimizer-wide: the step count, under ``"stable_spam_steps"`` in the state dict. After
    each step ``last_clip_fraction`` holds the fraction of gradient entries clipped (a tensor; no device sync).
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        gamma1: float = 0.7,
        gamma2: float = 0.9,
        theta: float = 0.999,
        reset_interval: int = 1000,
        decay_steps: int | None = None,
        eta_min: float = 0.5,
    ):
        from .._validation import check_int, check_number

        check_number("lr", lr, low=0)
        check_number("eps", eps, low=0)
        check_number("weight_decay", weight_decay, low=0)
        for i, beta in enumerate(betas):
            check_number(f"betas[{i}]", beta, low=0, high=1, high_open=True)
        for name, value in (("gamma1", gamma1), ("gamma2", gamma2), ("theta", theta)):
            check_number(name, value, low=0, high=1, high_open=True)
        check_int("reset_interval", reset_interval, low=0)
        if decay_steps is not None:
            check_int("decay_steps", decay_steps, low=1)
        check_number("eta_min", eta_min, low=0, high=1)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.gamma1, self.gamma2, self.theta = float(gamma1), float(gamma2), float(theta)
        self.reset_interval, self.decay_steps, self.eta_min = int(reset_interval), decay_steps, float(eta_min)
        self.total_steps = 0
        self.last_clip_fraction: torch.Tensor | None = None

    @property
    def resets(self) -> int:
        """Moment resets so far."""
        return self.total_steps // self.reset_interval if self.reset_interval else 0

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not any(p.grad is not None for group in self.param_groups for p in group["params"]):
            return loss
        self.total_steps += 1
        scale = momentum_scale(self.total_steps, self.decay_steps, self.eta_min)
        reset = self.reset_interval > 0 and self.total_steps % self.reset_interval == 0
        clipped, entries = None, 0
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None or p.grad.numel() == 0:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("StableSPAM does not support sparse gradients.")
                n = self._update(p, group, scale, reset)
                clipped = n if clipped is None else clipped + n
                entries += p.grad.numel()
        if clipped is not None:
            self.last_clip_fraction = clipped / entries
        return loss

    def _update(self, p: torch.Tensor, group: dict, scale: float, reset: bool) -> torch.Tensor:
        state = self.state[p]
        if "exp_avg" not in state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            for key in _FP32_STATE:
                state[key] = torch.zeros((), dtype=torch.float32, device=p.device)
        p.mul_(1.0 - group["lr"] * group["weight_decay"])
        state["step"] += 1
        k = state["step"]
        grad, state["m_max"], n_clipped = spike_clip(p.grad.float(), state["m_max"], k, self.theta)
        grad, state["m_norm"], state["v_norm"] = norm_rescale(
            grad, state["m_norm"], state["v_norm"], k, self.gamma1 * scale, self.gamma2, group["eps"]
        )
        if reset:
            state["step"] = k = 1
        beta1, beta2 = group["betas"]
        beta1 = beta1 * scale
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        grad = grad.to(exp_avg.dtype)
        exp_avg.mul_(beta1).add_(grad, alpha=1.0 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        denom = (exp_avg_sq.sqrt() / math.sqrt(1.0 - beta2**k)).add_(group["eps"])
        p.add_(exp_avg / denom, alpha=-group["lr"] / (1.0 - beta1**k))
        if reset:  # the reset takes effect from the next step (the reference's order)
            exp_avg.zero_()
            exp_avg_sq.zero_()
        return n_clipped

    def state_dict(self):
        state = super().state_dict()
        state[STEPS_KEY] = self.total_steps
        return state

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        self.total_steps = int(state_dict.pop(STEPS_KEY, 0))
        saved = state_dict.get("state", {})
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        super().load_state_dict(state_dict)
        params = [p for group in self.param_groups for p in group["params"]]
        # torch cast every state tensor to its parameter's dtype: put the fp32 statistics back
        for index, p in zip(saved_ids, params, strict=True):
            entry = saved.get(index, {})
            for key in _FP32_STATE:
                if key in entry:
                    self.state[p][key] = entry[key].detach().to(device=p.device, dtype=torch.float32, copy=True)
