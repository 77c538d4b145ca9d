"""Jacobian descent for multi-reward GRPO: aggregate the K per-reward policy gradients so that no reward's gradient is
opposed, instead of summing them (the `gradient_aggregation` family).

The Jacobian `J` `(K, d)` holds one policy gradient per reward function (row k: the gradient of TRL's GRPO loss with
the advantages of reward k alone). An aggregator maps it to the update `Σ_k α_k J_k` through coefficients `α` `(K,)`
computed from the Gram matrix `G = J Jᵀ` `(K, K)` alone, so the only large object is `J` itself:

* `sum` (the default, TRL's own path): `α = w`, the user's `reward_weights`; the Jacobian is never formed.
* `upgrad` (Quinton & Rey, "Jacobian Descent for Multi-Objective Optimization", arXiv 2406.16232): each weighted row
  `w_k J_k` is projected onto the dual cone `{x : J x ≥ 0}` and the projections are summed. In Gram space the
  projection of `Jᵀu` is `Jᵀv` with `v = argmin vᵀ G v s.t. v ≥ u` (the paper's Proposition 1), a K-dimensional QP.
  The update conflicts with no row (`J·update ≥ 0`), equals `Σ w_k J_k` when no two rows conflict, and is linear in
  a positive rescaling of one row. Followed: torchjd `src/torchjd/aggregation/_upgrad.py` and
  `_utils/dual_cone.py` (G normalised by its trace, `reg_eps·I` added, one QP per row). Our own: the QP is solved
  by an exact active-set method in float64 (torchjd calls quadprog), and a zero Jacobian gives a zero update where
  torchjd switches to the plain weighted sum below an absolute trace of `1e-4` (which LoRA gradients can reach).
* `aligned_mtl` (Senushkin et al., "Independent Component Alignment for Multi-Task Learning", arXiv 2305.19000):
  `G = V Λ Vᵀ`, `B = sqrt(λ_min) V Λ^{-1/2} Vᵀ` over the eigenvalues above `λ_max·K·ε_fp32` (the others are the
  rank deficit of parallel or zero rows), `α = B w`. Equivalently, with the SVD `J = U S Vᵀ`, the update is
  `σ_min V Uᵀ w`: every singular value of the system is set to the smallest one. Followed: torchjd
  `src/torchjd/aggregation/_aligned_mtl.py` (adapted there from SamsungLabs/MTL `code/optim/aligned`), scale mode
  `"min"`, the identity for a zero Gram matrix.

Memory: the Jacobian costs `K × n × 4` bytes for `n` trainable parameters (fp32 rows, accumulated over the
micro-batches of a step), on top of the model's own gradient: see [`jacobian_bytes`] and `jacobian_max_bytes`.

Per-reward advantages ([`reward_advantage_parts`]): GRPO's advantage of the weighted reward sum is linear in the
rewards within a group, `A = Σ_k w_k (r_k - mean_g r_k) / (s + 1e-4)` with `s` TRL's scale of the weighted sum (its
group std, batch std, or 1 for `scale_rewards="none"`). Row k uses the part `(r_k - mean_g r_k) / (s + 1e-4)`, so the
weighted sum of the rows is TRL's gradient exactly (the `sum` aggregator reproduces today's update) and each reward
keeps the scale the scalarised loss gives it; we do not z-score each column by its own std (GDPO's
`normalize_then_sum`), which would change what `reward_weights` mean.
"""

from __future__ import annotations

import torch

from .._validation import integer
from ..papers import Paper
from ..registry import Field, Registry, Requires
from .advantages import TRL_STD_EPS, _groups, _no_spread, nanstd


# ---------------------------------------------------------------------------------------------------------------------
# Per-reward advantages


def reward_advantage_parts(
    rewards: torch.Tensor, weights: torch.Tensor, num_generations: int, scale: str = "group"
) -> torch.Tensor:
    """The per-reward parts of TRL's GRPO advantage (`multi_objective_aggregation="sum_then_normalize"`).

    Args:
        rewards (`torch.Tensor` of shape `(N, K)`): the gathered rewards, NaN where a reward function returned None.
        weights (`torch.Tensor` of shape `(K,)`): `reward_weights`.
        num_generations (`int`): G; N is a multiple of it.
        scale (`str`): TRL's `scale_rewards`, `"group"`, `"batch"` or `"none"`.

    Returns:
        `(N, K)` fp32 `A_k = (r_k - mean_g r_k) / (s + 1e-4)` (no division for `"none"`), with `Σ_k w_k A_k` TRL's
        advantage. As in TRL a NaN entry counts 0 in the weighted sum and a row NaN in every column (unscorable) is
        left out of the group means and gets 0. A group whose weighted sum has no spread gets 0 in every column (TRL
        divides its roundoff by 1e-4 there; the columns themselves may still vary and would be amplified 10⁴-fold).
    """
    r = rewards.float()
    unscorable = torch.isnan(r).all(dim=1, keepdim=True)
    parts = torch.where(unscorable, torch.nan, torch.nan_to_num(r, nan=0.0))  # (N, K)
    total = (parts * weights.float().to(r.device)).sum(dim=1)  # (N,), NaN on unscorable rows
    grouped_parts, grouped_total = _groups(parts, num_generations), _groups(total, num_generations)
    centred = grouped_parts - torch.nanmean(grouped_parts, dim=1, keepdim=True)  # (B, G, K)
    if scale == "none":
        out = centred
    else:
        if scale == "group":
            std = nanstd(grouped_total, dim=1, keepdim=True) if num_generations > 1 else torch.zeros(1, 1)
        elif scale == "batch":
            std = nanstd(total, dim=0).reshape(1, 1) if total.numel() > 1 else torch.zeros(1, 1)
        else:
            raise ValueError(f"scale must be 'group', 'batch' or 'none', got {scale!r}.")
        out = centred / (std.to(r.device).unsqueeze(-1) + TRL_STD_EPS)
    out = torch.where(_no_spread(grouped_total).unsqueeze(-1), torch.zeros_like(out), out)
    return torch.nan_to_num(out.reshape(parts.shape), nan=0.0)


# ---------------------------------------------------------------------------------------------------------------------
# Gram matrix and aggregation


def jacobian_bytes(num_rewards: int, num_parameters: int) -> int:
    """Bytes of the fp32 Jacobian: `K × n × 4`."""
    return 4 * num_rewards * num_parameters


def gram(jacobian: torch.Tensor, chunk: int = 1 << 22) -> torch.Tensor:
    """`J Jᵀ` in float64, `(K, d) -> (K, K)`, over column chunks so that no float64 copy of `J` is made."""
    k = jacobian.shape[0]
    out = torch.zeros(k, k, dtype=torch.float64, device=jacobian.device)
    for start in range(0, jacobian.shape[1], chunk):
        block = jacobian[:, start : start + chunk].double()
        out += block @ block.T
    return out


def _nonnegative_qp(h: torch.Tensor, c: torch.Tensor, tol: float = 1e-12) -> torch.Tensor:
    """`argmin ½ xᵀ H x + cᵀ x s.t. x ≥ 0` for a positive definite `H` `(K, K)` and `c` `(K,)`, float64.

    Primal active-set method (Lawson & Hanson's NNLS, written for a quadratic form): free one variable whose
    gradient is most negative, solve the free block exactly, and step back to the boundary when the solution leaves
    the orthant. Finite for positive definite `H`; the iteration cap only guards against roundoff cycling."""
    k = c.numel()
    x = torch.zeros_like(c)
    free = torch.zeros(k, dtype=torch.bool, device=c.device)
    scale = tol * max(1.0, float(c.abs().max()))
    for _ in range(4 * k + 8):
        grad = h @ x + c
        blocked = (~free) & (grad < -scale)
        if not blocked.any():
            break
        free[torch.where(blocked, grad, torch.inf).argmin()] = True
        for _ in range(4 * k + 8):
            z = torch.zeros_like(x)
            idx = free.nonzero().squeeze(1)
            z[idx] = torch.linalg.solve(h[idx][:, idx], -c[idx])
            if (z[idx] > 0).all():
                x = z
                break
            leaving = free & (z <= 0)
            step = (x[leaving] / (x[leaving] - z[leaving]).clamp(min=1e-300)).min().clamp(0, 1)
            x = x + step * (z - x)
            free &= x > scale
            x = torch.where(free, x, torch.zeros_like(x))
            if not free.any():
                break
    return x


def project_dual_cone(gramian: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Coefficients `v` `(K,)` of the projection of `Jᵀu` onto the dual cone `{x : J x ≥ 0}` of the rows of `J`,
    from `G = J Jᵀ` (positive definite) `(K, K)` and `u` `(K,)`: `v = argmin vᵀ G v s.t. v ≥ u` (arXiv 2406.16232,
    Proposition 1), solved as `v = u + x` with `x ≥ 0`. Float64."""
    g, u = gramian.double(), u.double()
    return u + _nonnegative_qp(g, g @ u)


def upgrad_weights(gramian: torch.Tensor, preference: torch.Tensor, reg_eps: float = 1e-4) -> torch.Tensor:
    """UPGrad's coefficients `α = Σ_i v_i`, `v_i` the dual-cone projection of `w_i J_i` (arXiv 2406.16232).

    Args:
        gramian (`torch.Tensor` of shape `(K, K)`): `J Jᵀ`.
        preference (`torch.Tensor` of shape `(K,)`): the weights `w ≥ 0` of the rows.
        reg_eps (`float`): added to the diagonal of `G / trace(G)` (torchjd's default), so that parallel or zero
            rows leave a positive definite QP.

    Returns:
        `(K,)` float64; the update is `αᵀ J`. All zeros when `G` is zero (every row is a zero gradient).
    """
    g = gramian.double()
    trace = g.diagonal().sum()
    if not torch.isfinite(trace) or trace <= 0:
        return torch.zeros(g.shape[0], dtype=torch.float64, device=g.device)
    g = g / trace + reg_eps * torch.eye(g.shape[0], dtype=torch.float64, device=g.device)
    units = torch.diag(preference.double().to(g.device))  # row i: w_i e_i, the coefficients of w_i J_i
    return torch.stack([project_dual_cone(g, u) for u in units]).sum(dim=0)


def aligned_mtl_weights(gramian: torch.Tensor, preference: torch.Tensor) -> torch.Tensor:
    """Aligned-MTL's coefficients `α = B w`, `B = sqrt(λ_min) V Λ^{-1/2} Vᵀ` over the retained eigenpairs of
    `G = V Λ Vᵀ` (arXiv 2305.19000, Algorithm 1). Eigenvalues at or below `λ_max·K·ε_fp32` are dropped (the rows are
    fp32, so a smaller eigenvalue is roundoff); a zero `G` gives `B = I`. `(K, K), (K,) -> (K,)` float64."""
    g = gramian.double()
    eigenvalues, vectors = torch.linalg.eigh(g)
    tol = eigenvalues.max().clamp(min=0) * g.shape[0] * torch.finfo(torch.float32).eps
    keep = eigenvalues > tol
    w = preference.double().to(g.device)
    if not keep.any():
        return w
    lam, v = eigenvalues[keep], vectors[:, keep]
    balance = lam.min().sqrt() * (v * lam.rsqrt()) @ v.T
    return balance @ w


def sum_weights(gramian: torch.Tensor, preference: torch.Tensor) -> torch.Tensor:
    """The plain weighted sum, `α = w` (TRL's scalarised loss). `(K, K), (K,) -> (K,)` float64."""
    return preference.double().to(gramian.device)


def aggregate(jacobian: torch.Tensor, preference: torch.Tensor, method: str = "upgrad") -> torch.Tensor:
    """The update `αᵀ J` `(d,)` (fp32) of the Jacobian `(K, d)` under the `gradient_aggregation` ``method`` (`"sum"`
    or a registered name)."""
    weights = sum_weights if method == "sum" else GRADIENT_AGGREGATIONS.get(method).fn
    alpha = weights(gram(jacobian), preference)
    return alpha.to(jacobian.dtype) @ jacobian


# ---------------------------------------------------------------------------------------------------------------------
# Declarations: the `gradient_aggregation` family


UPGRAD_PAPER = Paper(
    "upgrad",
    "Jacobian Descent for Multi-Objective Optimization",
    "Pierre Quinton and Valérian Rey",
    "2406.16232",
    2024,
    "@misc{upgrad2024,\n  title         = {Jacobian Descent for Multi-Objective Optimization},\n"
    "  author        = {Pierre Quinton and Valérian Rey},\n  year          = {2024},\n"
    "  eprint        = {2406.16232},\n  archivePrefix = {arXiv}\n}",
)
ALIGNED_MTL_PAPER = Paper(
    "aligned_mtl",
    "Independent Component Alignment for Multi-Task Learning",
    "Senushkin",  # the first author's name as the CVPR 2023 paper's file gives it; co-authors unchecked here
    "2305.19000",
    2023,
    "@misc{aligned_mtl2023,\n  title         = {Independent Component Alignment for Multi-Task Learning},\n"
    "  author        = {Senushkin and others},\n"
    "  year          = {2023},\n  eprint        = {2305.19000},\n  archivePrefix = {arXiv}\n}",
)

GRADIENT_AGGREGATIONS = Registry(
    "gradient_aggregation", "aggregators of the per-reward policy gradients (Jacobian descent)", builtin=("sum",)
)

_MAX_BYTES = Field(
    "jacobian_max_bytes",
    2 << 30,
    "Largest Jacobian allowed, in bytes: K reward functions × n trainable parameters × 4 (fp32 rows); a larger "
    "one is refused at construction with its size.",
    check=integer(low=1),
)
# Each rule keeps the loss a sum of per-reward terms, so that row k is reward k's gradient alone.
_REQUIRES = (
    Requires("beta", lambda v: v == 0.0, "the KL term is no reward's: each row would count it again", fix=0.0),
    Requires("loss_mode", lambda v: v == "ppo", "the per-reward losses are TRL's surrogate"),
    Requires("advantage_estimator", lambda v: v == "grpo", "the rows split TRL's GRPO advantage by reward"),
    Requires("delta_l_alpha", lambda v: v is None, "set it to None"),
    Requires("advantage_filter_sigma", lambda v: v is None, "set it to None"),
    Requires("reward_weighting", lambda v: v == "static", "the aggregator replaces the reward-weight controller"),
    Requires("oblr_adaptive_lr", lambda v: v is False, "it reads the micro-batch gradients the Jacobian replaces"),
    Requires("use_liger_kernel", lambda v: v is False, "Liger's fused loss computes no per-reward loss"),
    Requires("entropy_coef", lambda v: v == 0.0, "the entropy bonus is no reward's"),
    Requires("use_adaptive_entropy", lambda v: v is False, "the entropy bonus is no reward's"),
    Requires(
        "multi_objective_aggregation",
        lambda v: v == "sum_then_normalize",
        "the rows split the advantage of the weighted reward sum",
    ),
)
for _name, _paper, _description in (
    ("upgrad", UPGRAD_PAPER, "project each reward's gradient onto the dual cone of all of them, then sum"),
    ("aligned_mtl", ALIGNED_MTL_PAPER, "align the principal components of the reward gradients"),
):
    GRADIENT_AGGREGATIONS.register(
        _name, paper=_paper, description=_description, fields=[_MAX_BYTES], requires=_REQUIRES
    )(upgrad_weights if _name == "upgrad" else aligned_mtl_weights)


__all__ = [
    "ALIGNED_MTL_PAPER",
    "GRADIENT_AGGREGATIONS",
    "UPGRAD_PAPER",
    "aggregate",
    "aligned_mtl_weights",
    "gram",
    "jacobian_bytes",
    "project_dual_cone",
    "reward_advantage_parts",
    "sum_weights",
    "upgrad_weights",
]
