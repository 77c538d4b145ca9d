"""fp64 Gram matrices and the coefficient-space solvers built on them (docs/merging.md, "Fisher–Rao").

Everything here is a pure torch function. The coefficient solvers take the N×N Gram matrix `G[i,j] = <x_i, x_j>`
of the inputs (accumulated in float64 over a whole tensor, possibly tile by tile with `accumulate_gram`) and
return `c (N,)` float64 such that the merged vector is `Σ_i c_i x_i` — a linear combination of the RAW inputs.

* `karcher_coefficients`: weighted spherical Karcher (Fréchet) mean of the unit directions, then norm restoration
  — the Fisher–Rao merge (Wang, Ye, Yin, arXiv 2603.04972, its spherical proxy). Same iteration as the direct
  solver `karcher_direct`, written in the coordinates `u = Σ_i β_i x̂_i`, so no d-dimensional vector is ever formed.
* `nre_coefficients`: norm-restored Euclidean baselines `nre` (raw weighted mean, rescaled) and `nre_unit`
  (normalised mean of unit directions, rescaled).
* `slerp_coefficients`: Shoemake's SLERP (1985) with mergekit's conventions (`merge_methods/slerp.py::slerp`):
  coefficients from the angle between the normalised inputs, applied to the raw inputs; linear interpolation
  when `|cos| > 0.9995`.

Differences from mergekit `merge_methods/karcher.py::karcher_merge_tensors` (read, not copied): per-model weights
are honoured (mergekit hard-codes α = 1/N), all arithmetic is fp64, angles use `atan2(s, c)` instead of
`arccos(c)` (which returns 0 below ~3.5e-4 rad in fp32 and ~3.6° in bf16), and the step is backtracked.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable

import torch


NORM_MODES = ("weighted_mean", "mean", "median", "max", "geometric", "none")
SOLVERS = ("karcher", "nre", "nre_unit")


# ---------------------------------------------------------------------------------------------------- Gram helpers
# Columns converted to float64 at a time: bounds the fp64 copy of a tile to N × 1 MiB instead of doubling the tile
# (a whole-tile `.double()` pushed a 2GB-budget Karcher merge of 8 inputs 0.5 GiB over its budget). 128k columns
# keep a block of a few inputs in the CPU caches between its conversion and its product: a Gram of two inputs took
# 2.5 ms per million elements instead of 6 ms with 1M-column blocks, a quarter of a small SLERP merge's time.
GRAM_CHUNK = 1 << 17


def gram(x: torch.Tensor) -> torch.Tensor:
    """`x (N, n)` → `(N, N)` float64 Gram `x xᵀ`, accumulated over column chunks of `GRAM_CHUNK`."""
    x = x.reshape(x.shape[0], -1)
    if x.shape[1] <= GRAM_CHUNK:
        xd = x.to(torch.float64)
        return xd @ xd.T
    acc = torch.zeros(x.shape[0], x.shape[0], dtype=torch.float64)
    for start in range(0, x.shape[1], GRAM_CHUNK):
        chunk = x[:, start : start + GRAM_CHUNK].to(torch.float64)
        acc.add_(chunk @ chunk.T)
    return acc


class GramAccumulator:
    """fp64 Gram `X Xᵀ` of N vectors streamed in chunks, bitwise independent of the chunking.

    Elements are staged in fp64 blocks of `block` elements (the last one shorter); each block's `X_b X_bᵀ` is added
    to the sum in order, exactly as `gram` does on the whole `(N, n)` matrix. Memory: `N × block × 8` bytes.
    """

    def __init__(self, n: int, block: int = GRAM_CHUNK):
        self.n, self.block = n, block
        self.staging = torch.empty(n, block, dtype=torch.float64)
        self.fill = 0
        self.acc = torch.zeros(n, n, dtype=torch.float64)
        self.blocks = 0

    def add(self, i: int, start: int, values: torch.Tensor) -> None:
        """Stage `values` (float32) as elements `start … start+len−1` of the current block's row i."""
        self.staging[i, start : start + values.numel()].copy_(values)

    def advance(self, m: int) -> None:
        """The staged rows grew by `m` elements (all N rows); a full block is added to the sum."""
        self.fill += m
        if self.fill == self.block:
            self._flush()

    def room(self) -> int:
        return self.block - self.fill

    def _flush(self) -> None:
        if self.fill == 0:
            return
        x = self.staging if self.fill == self.block else self.staging[:, : self.fill].contiguous()
        g = x @ x.T
        self.acc = g if self.blocks == 0 else self.acc.add_(g)
        self.blocks += 1
        self.fill = 0

    def result(self) -> torch.Tensor:
        """The Gram of everything added (adds the last, partial block)."""
        self._flush()
        return self.acc


def accumulate_gram(acc: torch.Tensor | None, tile: torch.Tensor) -> torch.Tensor:
    """Add the Gram of one tile `(N, n)` to `acc (N, N)` float64 (None starts a new accumulator)."""
    g = gram(tile)
    return g if acc is None else acc.add_(g)


def gram_of_chunks(chunks: Iterable[torch.Tensor]) -> torch.Tensor:
    """Gram over the concatenation (along the element axis) of `(N, n_k)` chunks."""
    acc = None
    for chunk in chunks:
        acc = accumulate_gram(acc, chunk)
    if acc is None:
        raise ValueError("gram_of_chunks: no chunks.")
    return acc


def norms_from_gram(g: torch.Tensor) -> torch.Tensor:
    """`(N,)` float64 `r_i = sqrt(max(G_ii, 0))`."""
    return torch.diagonal(g).clamp_min(0).sqrt()


def unit_gram(g: torch.Tensor, r: torch.Tensor | None = None) -> torch.Tensor:
    """`Ĝ[i,j] = G[i,j] / (r_i r_j)`, clipped to [-1, 1], exact ones on the diagonal (inputs with r > 0 only)."""
    r = norms_from_gram(g) if r is None else r
    u = g / torch.outer(r, r)
    u = u.clamp(-1.0, 1.0)
    u.fill_diagonal_(1.0)
    return u


def angles_from_gram(g: torch.Tensor) -> torch.Tensor:
    """Pairwise angles `(N, N)` in radians from a Gram matrix (diagnostics)."""
    return torch.arccos(unit_gram(g))


# ---------------------------------------------------------------------------------------------------- helpers
def _normalize_weights(weights: torch.Tensor | None, n: int) -> torch.Tensor:
    if weights is None:
        return torch.full((n,), 1.0 / n, dtype=torch.float64)
    w = torch.as_tensor(weights, dtype=torch.float64).reshape(-1)
    if w.numel() != n:
        raise ValueError(f"weights has {w.numel()} entries for {n} inputs.")
    if (w < 0).any() or not torch.isfinite(w).all():
        raise ValueError(f"weights must be finite and >= 0 for a spherical mean, got {w.tolist()}.")
    total = w.sum()
    if total <= 0:
        raise ValueError(f"weights must not all be zero, got {w.tolist()}.")
    return w / total


def restore_norm(r: torch.Tensor, alpha: torch.Tensor, mode: str) -> torch.Tensor:
    """Scalar norm `s` (float64) from norms `r (M,)` and normalised weights `alpha (M,)`: the norm restored on the
    merged direction."""
    if mode == "weighted_mean":
        return (alpha * r).sum()
    if mode == "mean":
        return r.mean()
    if mode == "median":
        return torch.quantile(r, 0.5)  # midpoint of the two middle values for an even count
    if mode == "max":
        return r.max()
    if mode == "geometric":
        return torch.exp((alpha * torch.log(r)).sum())
    if mode == "none":
        return torch.ones((), dtype=torch.float64)
    raise ValueError(f"norm={mode!r}; allowed values: {', '.join(NORM_MODES)}.")


def _drop_small(r: torch.Tensor, alpha: torch.Tensor, eps: float) -> torch.Tensor:
    """Indices of inputs with norm > eps and non-zero weight."""
    return torch.nonzero((r > eps) & (alpha > 0)).reshape(-1)


# ---------------------------------------------------------------------------------------------------- Karcher
def _spherical_state(gh: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor):
    """At `u = Σ β_j x̂_j` (unit): cosines `c`, sines `s`, angles `θ = atan2(s, c)` and `F = ½ Σ α θ²`."""
    c = gh @ beta
    # ||x̂_i − c_i u||² = 1 − c_i² when ||u|| = 1 and the diagonal of Ĝ is exactly 1.
    s = (1.0 - c * c).clamp_min(0.0).sqrt()
    theta = torch.atan2(s, c)
    return c, s, theta, 0.5 * (alpha * theta * theta).sum()


def _unit_normalize(gh: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    return beta / torch.sqrt((beta @ gh @ beta).clamp_min(1e-300))


def karcher_unit_coefficients(
    gh: torch.Tensor,
    alpha: torch.Tensor,
    *,
    max_iter: int = 50,
    tol: float = 1e-7,
    step: float = 1.0,
    eta_min: float = 1.0 / 64,
    eps: float = 1e-12,
    fallback: bool = True,
) -> tuple[torch.Tensor, dict]:
    """Weighted Karcher mean on the unit sphere in coefficient space: `u = Σ_i β_i x̂_i`.

    Args:
        gh: `(M, M)` float64 unit Gram `Ĝ` (unit diagonal) of the directions `x̂_i`.
        alpha: `(M,)` float64 weights, summing to 1, all > 0.
        max_iter, tol, step, eta_min: iteration cap, stop when `||T|| < tol`, initial step η, smallest η.
        fallback: when the largest angle from the initial point `u_0` is ≥ π/2 (the Karcher mean need not be
            unique), stop at once with `info["fallback"] = True` and `β` of `u_0`; the caller switches to NRE.

    Returns:
        `β (M,)` with `u = Σ β_i x̂_i` unit, and an info dict (`iters`, `grad_norm`, `fallback`, `F`).
    """
    m = alpha.numel()
    info = {"iters": 0, "grad_norm": 0.0, "fallback": False, "F": 0.0}
    # Step 2: normalised chordal mean of the unit directions.
    beta = alpha.clone()
    nrm2 = beta @ gh @ beta
    if nrm2 <= eps * eps:
        warnings.warn(
            "Karcher mean: the weighted mean of unit directions is ~0 (near-antipodal inputs); starting from the "
            "direction with the largest weight.",
            stacklevel=3,
        )
        beta = torch.zeros(m, dtype=torch.float64)
        beta[int(torch.argmax(alpha))] = 1.0
    else:
        beta = beta / nrm2.sqrt()
    c, s, theta, f = _spherical_state(gh, alpha, beta)
    if fallback and float(theta.max()) >= math.pi / 2:
        info["fallback"] = True
        return beta, info
    eye = torch.eye(m, dtype=torch.float64)
    for it in range(max_iter + 1):
        # Log map of every x̂_i at u: (θ_i / s_i)(x̂_i − c_i u); coefficient vector (e_i − c_i β) per row.
        scale = torch.where(s > 0, theta / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(s))
        tau = ((alpha * scale)[:, None] * (eye - c[:, None] * beta[None, :])).sum(0)
        n = torch.sqrt((tau @ gh @ tau).clamp_min(0.0))
        info["iters"], info["grad_norm"], info["F"] = it, float(n), float(f)
        if float(n) < tol or it == max_iter:
            break
        eta = step
        while True:
            # Exponential map: u ← cos(η n) u + sin(η n) T/n, renormalised.
            cand = _unit_normalize(gh, torch.cos(eta * n) * beta + torch.sin(eta * n) * tau / n)
            c2, s2, theta2, f2 = _spherical_state(gh, alpha, cand)
            if f2 <= f or eta <= eta_min:
                break
            eta *= 0.5  # backtracking (our addition, free in coefficient space)
        beta, c, s, theta, f = cand, c2, s2, theta2, f2
    return beta, info


def karcher_coefficients(
    gram: torch.Tensor,
    weights: torch.Tensor | None = None,
    *,
    solver: str = "karcher",
    norm: str = "weighted_mean",
    max_iter: int = 50,
    tol: float = 1e-7,
    step: float = 1.0,
    eps: float = 1e-12,
    return_info: bool = False,
):
    """Fisher–Rao merge coefficients from the Gram matrix (Wang, Ye, Yin 2026, arXiv 2603.04972).

    Args:
        gram: `(N, N)` float64 `G[i,j] = <x_i, x_j>` of the inputs (full weights or task vectors).
        weights: `(N,)` non-negative per-model weights (normalised here to α, Σα = 1); None = uniform.
        solver: ``"karcher"`` (Riemannian fixed point, backtracking), ``"nre"`` (`s·Σα x / ||Σα x||`) or
            ``"nre_unit"`` (`s·u_0`, the normalised mean of unit directions).
        norm: norm restoration `s`: one of `NORM_MODES`.
        max_iter, tol, step: iteration cap, stopping tolerance on the Riemannian gradient norm (radians), initial η.
        eps: inputs with norm ≤ eps are dropped (α renormalised over the rest); if none is left the result is 0.

    Returns:
        `(N,)` float64 `c` with merged vector `Σ_i c_i x_i` (and an info dict if `return_info`).
        When the largest angle from `u_0` is ≥ π/2 the Karcher solver warns and falls back to ``"nre"``.
    """
    if solver not in SOLVERS:
        raise ValueError(f"solver={solver!r}; allowed values: {', '.join(SOLVERS)}.")
    if norm not in NORM_MODES:
        raise ValueError(f"norm={norm!r}; allowed values: {', '.join(NORM_MODES)}.")
    g = torch.as_tensor(gram, dtype=torch.float64)
    n = g.shape[0]
    alpha_all = _normalize_weights(weights, n)
    info = {"solver": solver, "iters": 0, "grad_norm": 0.0, "fallback": False, "kept": n}
    c_out = torch.zeros(n, dtype=torch.float64)
    if n == 1:
        c_out[0] = 1.0  # N = 1: the input itself
        return (c_out, info) if return_info else c_out
    r_all = norms_from_gram(g)
    keep = _drop_small(r_all, alpha_all, eps)
    info["kept"] = int(keep.numel())
    if keep.numel() == 0:
        return (c_out, info) if return_info else c_out
    gk = g[keep][:, keep]
    r = r_all[keep]
    alpha = alpha_all[keep] / alpha_all[keep].sum()
    s = restore_norm(r, alpha, norm)
    gh = unit_gram(gk, r)
    if solver == "karcher":
        beta, kinfo = karcher_unit_coefficients(gh, alpha, max_iter=max_iter, tol=tol, step=step, eps=eps)
        info.update(kinfo)
        if kinfo["fallback"]:
            warnings.warn(
                "Fisher–Rao/Karcher: an input is at least π/2 from the initial mean, so the Karcher mean may not be "
                "unique; falling back to solver='nre'.",
                stacklevel=2,
            )
            solver = "nre"
        else:
            c_out[keep] = s * beta / r
    if solver == "nre_unit":
        beta = alpha / torch.sqrt((alpha @ gh @ alpha).clamp_min(1e-300))
        c_out[keep] = s * beta / r
    elif solver == "nre":
        nrm = torch.sqrt((alpha @ gk @ alpha).clamp_min(0.0))
        if nrm <= eps:
            c_out[keep] = 0.0
        else:
            c_out[keep] = s * alpha / nrm
    return (c_out, info) if return_info else c_out


def karcher_direct(
    vectors: torch.Tensor,
    weights: torch.Tensor | None = None,
    *,
    norm: str = "weighted_mean",
    max_iter: int = 50,
    tol: float = 1e-7,
    step: float = 1.0,
    eta_min: float = 1.0 / 64,
    eps: float = 1e-12,
) -> torch.Tensor:
    """Reference solver on explicit vectors, float64; for tests and small problems.

    Args:
        vectors: `(N, d)` inputs.
        weights: `(N,)` non-negative weights (normalised to α); None = uniform.

    Returns:
        `(d,)` float64 merged vector `s · u` (no NRE fallback: it always iterates).
    """
    x = vectors.reshape(vectors.shape[0], -1).to(torch.float64)
    n = x.shape[0]
    alpha = _normalize_weights(weights, n)
    if n == 1:
        return x[0].clone()
    r = x.norm(dim=1)
    keep = _drop_small(r, alpha, eps)
    if keep.numel() == 0:
        return torch.zeros(x.shape[1], dtype=torch.float64)
    x, r = x[keep], r[keep]
    alpha = alpha[keep] / alpha[keep].sum()
    xh = x / r[:, None]
    s_out = restore_norm(r, alpha, norm)

    def state(u):
        c = xh @ u
        v = xh - c[:, None] * u[None, :]
        s = v.norm(dim=1)  # the tangent vector itself: no cancellation in 1 − c²
        theta = torch.atan2(s, c)
        return c, v, s, theta, 0.5 * (alpha * theta * theta).sum()

    m = (alpha[:, None] * xh).sum(0)
    if m.norm() <= eps:
        u = xh[int(torch.argmax(alpha))].clone()
    else:
        u = m / m.norm()
    _, v, s, theta, f = state(u)
    for it in range(max_iter + 1):
        scale = torch.where(s > 0, theta / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(s))
        t = (alpha * scale) @ v
        tn = t.norm()
        if float(tn) < tol or it == max_iter:
            break
        eta = step
        while True:
            cand = torch.cos(eta * tn) * u + torch.sin(eta * tn) * t / tn
            cand = cand / cand.norm()
            _, v2, s2, theta2, f2 = state(cand)
            if f2 <= f or eta <= eta_min:
                break
            eta *= 0.5
        u, v, s, theta, f = cand, v2, s2, theta2, f2
    return s_out * u


# ---------------------------------------------------------------------------------------------------- SLERP
SLERP_DOT_THRESHOLD = 0.9995  # mergekit merge_methods/slerp.py::slerp DOT_THRESHOLD


def slerp_coefficients(gram: torch.Tensor, t: float, *, eps: float = 1e-8) -> torch.Tensor:
    """SLERP (Shoemake 1985) coefficients for two inputs, applied to the RAW inputs (mergekit convention).

    `cos Ω = Ĝ[0,1]`; if `|cos Ω| > 0.9995` (or a norm ≤ eps) → lerp `(1−t, t)`; else
    `(sin((1−t)Ω)/sin Ω, sin(tΩ)/sin Ω)`.

    Args:
        gram: `(2, 2)` float64 Gram of the two inputs.
        t: interpolation from input 0 (t = 0) to input 1 (t = 1).

    Returns:
        `(2,)` float64.
    """
    g = torch.as_tensor(gram, dtype=torch.float64)
    if g.shape != (2, 2):
        raise ValueError(f"slerp needs exactly 2 inputs, got a Gram of shape {tuple(g.shape)}.")
    r = norms_from_gram(g)
    lerp = torch.tensor([1.0 - t, t], dtype=torch.float64)
    if bool((r <= eps).any()):
        return lerp
    cos = float((g[0, 1] / (r[0] * r[1])).clamp(-1.0, 1.0))
    if abs(cos) > SLERP_DOT_THRESHOLD:
        return lerp
    omega = math.acos(cos)
    so = math.sin(omega)
    return torch.tensor([math.sin((1.0 - t) * omega) / so, math.sin(t * omega) / so], dtype=torch.float64)
