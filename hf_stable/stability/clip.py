"""Component-wise gradient clipping: fixed per-group bounds (arXiv 2210.10325) and AdaGC's adaptive bounds
(arXiv 2502.11034).

Fixed (the fine-tuning-stability paper's method, verified in its authors' code): every group ``G`` of parameters has
its own bound ``c_G``; ``g_G ← g_G · min(1, c_G / (‖g_G‖ + 1e-6))`` with ``‖g_G‖ = sqrt(Σ_{p∈G} ‖g_p‖²)``. With
``groups="param"`` each tensor is a group (the authors call ``clip_grad_norm_`` on each parameter). Unlike global
clipping, a small bound changes the *direction* of the update.

Adaptive (AdaGC): each group clips against an exponential moving average ``γ_G`` of its own past *clipped* norms:
``h = min(1, λ_rel·γ_{t−1} / ‖g‖)``, ``γ_t = β·γ_{t−1} + (1 − β)·h‖g‖``. During the first ``warmup_steps`` the clip is
global with the absolute bound ``λ_abs`` and ``γ`` tracks the running minimum of the clipped norms, as the paper does.

Groups: ``"param"``; ``"module"`` (the parameter name without its last component); ``"layer"`` (the
``layers.<i>.`` index; parameters outside any layer — embeddings, final norm, lm_head — each form their own group);
or a list of regular expressions (the first that matches, via ``re.search``, names the group; unmatched parameters
each form their own group).

Shapes: norms are 1-D float32 tensors with one entry per group. Pure torch.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

import torch


__all__ = ["EPS", "adagc_coefficients", "apply_coefficients", "clip_coefficients", "group_norms", "group_parameters"]

EPS = 1e-6
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _group_key(name: str, groups: str | Sequence[str]) -> str:
    if groups == "param":
        return name
    if groups == "module":
        return name.rsplit(".", 1)[0] if "." in name else name
    if groups == "layer":
        match = _LAYER.search(name)
        return f"layers.{match.group(1)}" if match else name
    for pattern in groups:
        if re.search(pattern, name):
            return pattern
    return name


def group_parameters(
    named_params: Iterable[tuple[str, torch.Tensor]], groups: str | Sequence[str] = "param"
) -> dict[str, list[tuple[str, torch.Tensor]]]:
    """``{group_name: [(param_name, param), ...]}`` in first-seen order."""
    out: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for name, p in named_params:
        out.setdefault(_group_key(name, groups), []).append((name, p))
    return out


def group_norms(grouped_grads: Sequence[Sequence[torch.Tensor]]) -> torch.Tensor:
    """L2 norm of each group's concatenated gradients (float32, one fused ``_foreach_norm`` over all tensors)."""
    flat = [g for grads in grouped_grads for g in grads]
    if not flat:
        return torch.zeros(len(grouped_grads))
    norms = torch.stack([n.float() for n in torch._foreach_norm(flat)])
    sizes = torch.tensor([len(grads) for grads in grouped_grads], device=norms.device)
    index = torch.repeat_interleave(torch.arange(len(grouped_grads), device=norms.device), sizes)
    squares = torch.zeros(len(grouped_grads), device=norms.device, dtype=torch.float32)
    squares.index_add_(0, index, norms * norms)
    return squares.sqrt()


def clip_coefficients(norms: torch.Tensor, max_norms: torch.Tensor | float) -> torch.Tensor:
    """``min(1, c / (‖g‖ + 1e-6))`` per group."""
    max_norms = torch.as_tensor(max_norms, dtype=norms.dtype, device=norms.device)
    return torch.clamp(max_norms / (norms + EPS), max=1.0)


def apply_coefficients(grouped_grads: Sequence[Sequence[torch.Tensor]], coefficients: torch.Tensor) -> None:
    """Multiply each group's gradients in place by its coefficient (one ``_foreach_mul_``)."""
    flat, scales = [], []
    for grads, coef in zip(grouped_grads, coefficients.unbind(0), strict=True):
        for g in grads:
            flat.append(g)
            scales.append(coef.to(g.dtype))
    if flat:
        torch._foreach_mul_(flat, scales)


def adagc_coefficients(
    norms: torch.Tensor,
    gamma: torch.Tensor,
    step: int,
    *,
    warmup_steps: int = 100,
    lambda_abs: float = 1.0,
    lambda_rel: float = 1.05,
    beta: float = 0.98,
) -> tuple[torch.Tensor, torch.Tensor]:
    """AdaGC's clip coefficients for 1-based optimizer ``step`` and the updated EMA.

    Args:
        norms: (G,) current group norms.
        gamma: (G,) EMA of past clipped norms; ``inf`` where a group has no history yet.
    Returns:
        ``(coefficients (G,), new_gamma (G,))``.
    """
    if step <= warmup_steps:
        total = norms.pow(2).sum().sqrt()
        coef = torch.clamp(torch.as_tensor(lambda_abs, dtype=norms.dtype) / (total + EPS), max=1.0).expand_as(norms)
        return coef.clone(), torch.minimum(gamma, coef * norms)
    fresh = torch.isinf(gamma)
    limit = torch.where(fresh, norms, lambda_rel * gamma)  # a group with no history is not clipped on first sight
    coef = torch.clamp(limit / (norms + EPS), max=1.0)
    clipped = coef * norms
    new_gamma = torch.where(fresh, clipped, beta * gamma + (1.0 - beta) * clipped)
    return coef, new_gamma
