"""Matrix functions for the stability monitors: stable rank, power iteration, the matrix sign and its correction.

* Stable rank (arXiv 2602.01734): ``sr(W) = ‖W‖_F² / ‖W‖₂²`` ∈ [1, rank(W)], a smooth lower bound of the rank that
  collapses towards 1 when one direction dominates.
* Power iteration on ``WᵀW`` (or ``WWᵀ``, the smaller side) estimates ``‖W‖₂``; persisting the vector between calls
  (a warm start) makes 2–3 iterations enough once the weights move slowly.
* ``msign(W) = U Vᵀ`` for ``W = U Σ Vᵀ``: every non-zero singular value set to 1. Exact by SVD, or by the quintic
  Newton–Schulz iteration of ``torch.optim.Muon`` (coefficients (3.4445, −4.7750, 2.0315), 5 steps), which maps the
  singular values into roughly [0.7, 1.2] rather than exactly 1.
* The MSign correction (reconstructed from arXiv 2602.01734's abstract):
  ``W ← (1 − α)·W + α·c·msign(W)`` with ``c = ‖W‖_F / ‖msign(W)‖_F``, so with α = 1 the Frobenius norm is kept and the
  stable rank becomes ``min(m, n)`` (exactly, with the SVD sign of a full-rank W).

Shapes: ``W`` is ``(m, n)``; vectors are ``(n,)`` for the right side. Computed in float32 (float64 input stays
float64). Pure torch.
"""

from __future__ import annotations

import torch


__all__ = [
    "MUON_NS_COEFFICIENTS",
    "msign",
    "msign_correction",
    "newton_schulz_msign",
    "power_iteration",
    "spectral_norm",
    "stable_rank",
    "svd_msign",
]

MUON_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
EXACT_BELOW = 512  # spectral norms of matrices with both sides below this use an exact SVD-based norm


def _float(w: torch.Tensor) -> torch.Tensor:
    return w if w.dtype == torch.float64 else w.float()


def power_iteration(
    w: torch.Tensor, v: torch.Tensor | None = None, iters: int = 8, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Largest singular value of ``w`` (m, n) by ``iters`` rounds of ``v ← WᵀW v / ‖·‖``.

    Args:
        v: warm-start right vector (n,); random normal when ``None``.
    Returns:
        ``(sigma, v)``: 0-d tensor ``‖W v‖`` and the unit right vector (n,). A zero matrix gives ``sigma = 0``.
    """
    w = _float(w)
    if v is None:
        v = torch.randn(w.shape[1], dtype=w.dtype, device=w.device, generator=generator)
    v = v.to(dtype=w.dtype, device=w.device)
    v = v / v.norm().clamp_min(torch.finfo(w.dtype).tiny)
    for _ in range(int(iters)):
        u = w @ v
        v_new = w.T @ u
        norm = v_new.norm()
        if norm == 0:
            break
        v = v_new / norm
    return (w @ v).norm(), v


def spectral_norm(
    w: torch.Tensor, v: torch.Tensor | None = None, iters: int = 8, exact_below: int = EXACT_BELOW
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``‖W‖₂``: exact (``torch.linalg.matrix_norm(W, 2)``) when both sides are below ``exact_below``, else by
    [`power_iteration`] on the smaller Gram side. Returns ``(sigma, v)`` (``v`` is ``None`` on the exact path)."""
    w = _float(w)
    if max(w.shape) < exact_below:
        return torch.linalg.matrix_norm(w, ord=2), None
    if w.shape[0] < w.shape[1]:  # iterate on the smaller Gram matrix: W Wᵀ (m×m) via the transpose
        return power_iteration(w.T, v, iters)
    return power_iteration(w, v, iters)


def stable_rank(w: torch.Tensor, sigma_max: torch.Tensor | None = None) -> torch.Tensor:
    """``‖W‖_F² / ‖W‖₂²`` (exact spectral norm unless ``sigma_max`` is given); 0 for a zero matrix."""
    w = _float(w)
    sigma = torch.linalg.matrix_norm(w, ord=2) if sigma_max is None else sigma_max.to(w.dtype)
    fro2 = (w * w).sum()
    return torch.where(sigma > 0, fro2 / (sigma * sigma).clamp_min(torch.finfo(w.dtype).tiny), torch.zeros_like(fro2))


def svd_msign(w: torch.Tensor, rtol: float | None = None) -> torch.Tensor:
    """Exact ``U Vᵀ`` over the singular values above ``rtol·σ_max`` (default: the dtype's eps × max(m, n))."""
    w = _float(w)
    u, s, vh = torch.linalg.svd(w, full_matrices=False)
    if rtol is None:
        rtol = torch.finfo(w.dtype).eps * max(w.shape)
    keep = s > rtol * s.max().clamp_min(torch.finfo(w.dtype).tiny)
    return (u[:, keep] @ vh[keep, :]) if keep.any() else torch.zeros_like(w)


def newton_schulz_msign(
    w: torch.Tensor, steps: int = 5, coefficients: tuple[float, float, float] = MUON_NS_COEFFICIENTS, eps: float = 1e-7
) -> torch.Tensor:
    """Approximate ``msign(W)``: normalise ``X = W / (‖W‖_F + eps)`` (so every singular value is ≤ 1), then
    ``steps`` times ``X ← aX + (bA + cA²)X`` with ``A = XXᵀ`` on the wide orientation (tall inputs are transposed)."""
    a, b, c = coefficients
    x = _float(w)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / (x.norm() + eps)
    for _ in range(int(steps)):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def msign(w: torch.Tensor, method: str = "newton_schulz", steps: int = 5) -> torch.Tensor:
    """``msign`` by ``method`` in {"newton_schulz", "svd"}."""
    if method == "svd":
        return svd_msign(w)
    if method == "newton_schulz":
        return newton_schulz_msign(w, steps=steps)
    raise ValueError(f"`method`={method!r} is not valid. Allowed values: 'newton_schulz', 'svd'.")


def msign_correction(w: torch.Tensor, alpha: float = 1.0, method: str = "newton_schulz") -> torch.Tensor:
    """``(1 − α)·W + α·(‖W‖_F / ‖msign(W)‖_F)·msign(W)`` in the dtype of ``w``; a zero matrix is returned as is."""
    wf = _float(w)
    sign = msign(wf, method)
    sign_norm = sign.norm()
    if sign_norm == 0:
        return w.clone()
    corrected = (1.0 - alpha) * wf + alpha * (wf.norm() / sign_norm) * sign
    return corrected.to(w.dtype)
