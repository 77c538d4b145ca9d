"""Reward-weight controllers and reward transforms for multi-objective GRPO: the pure torch update rules.

A controller chooses the weights `w` that scalarise the K rewards (TRL's `reward_weights`) before the advantage
estimator runs, from statistics of the previous generation batch; a transform rewrites the reward columns themselves.
The stateful classes built on these rules, which the trainer dispatches to, are in
[`hf_stable.losses.reward_control`].

* `static`: the user's `reward_weights`.
* `hypervolume` (arXiv 2509.11452): a step multiplier from the hypervolume contribution of validation means.
* `gradient` (arXiv 2509.11452): weights by mirror ascent on the objectives' gradient inner products.
* `ctwa` (arXiv 2602.06869): log-weights raised while an objective's reward does not covary with the update.
* `lagrangian` (arXiv 2310.04373): dual multipliers keeping each mean reward below a threshold.
"""

from __future__ import annotations

import math

import torch


# ---------------------------------------------------------------------------------------------------------------------
# Hypervolume


def hypervolume(points: torch.Tensor, reference: torch.Tensor) -> float:
    """Exact hypervolume dominated by ``points`` `(P, K)` above ``reference`` `(K,)` (maximisation), by slicing the
    last objective (exponential in K; meant for a handful of objectives)."""
    pts = [p for p in points.double().tolist() if all(a > b for a, b in zip(p, reference.tolist(), strict=True))]
    return _hv(pts, reference.double().tolist())


def _hv(points: list[list[float]], ref: list[float]) -> float:
    if not points:
        return 0.0
    if len(ref) == 1:
        return max(p[0] for p in points) - ref[0]
    points = sorted(points, key=lambda p: p[-1], reverse=True)
    volume = 0.0
    for i, p in enumerate(points):
        below = points[i + 1][-1] if i + 1 < len(points) else ref[-1]
        if p[-1] > below:  # the slab (below, p[-1]] is covered by the points at or above p[-1]
            volume += (p[-1] - below) * _hv([q[:-1] for q in points[: i + 1]], ref[:-1])
    return volume


def hypervolume_contribution(front: torch.Tensor, point: torch.Tensor, reference: torch.Tensor) -> float:
    """`HV(front ∪ {point}) - HV(front)`, clamped at 0. `front` `(P, K)`, `point` and `reference` `(K,)`."""
    with_point = torch.cat([front.reshape(-1, point.numel()), point.reshape(1, -1)])
    return max(0.0, hypervolume(with_point, reference) - hypervolume(front.reshape(-1, point.numel()), reference))


def hypervolume_step(front: torch.Tensor, point: torch.Tensor, reference: torch.Tensor):
    """One hypervolume-guided step: the meta multiplier `m = 0.5 + 1.5 tanh(HVC)` ∈ [0.5, 2) for the next update and
    the front with ``point`` added when it contributes. Objectives are maximised (flip minimised ones before).

    Returns:
        `(multiplier, new_front, hvc)`.
    """
    hvc = hypervolume_contribution(front, point, reference)
    new_front = torch.cat([front.reshape(-1, point.numel()), point.reshape(1, -1)]) if hvc > 0 else front
    return 0.5 + 1.5 * math.tanh(hvc), new_front, hvc


# ---------------------------------------------------------------------------------------------------------------------
# Gradient-based weights


def influence_scores(gradients: torch.Tensor) -> torch.Tensor:
    """`s_k = Σ_j <g_k, g_j>`: first-order gain of all objectives from a step along objective k's gradient.
    `(K, D) -> (K,)`, fp64 accumulation."""
    g = gradients.double()
    return (g @ g.T).sum(dim=1).float()


def gradient_weight_update(weights: torch.Tensor, scores: torch.Tensor, lr: float, regularization: float = 1e-5):
    """Mirror ascent on the simplex: `w ← softmax(log w + η s / μ)` (`dynamic-reward-weighting:
    ray_trainer_optimization.py`, single η). `(K,), (K,) -> (K,)`; weights stay positive and sum to 1."""
    logits = torch.log(weights.double().clamp(min=1e-30)) + lr * scores.double() / regularization
    return torch.softmax(logits, dim=0).float()


# ---------------------------------------------------------------------------------------------------------------------
# CTWA


def ctwa_covariance(
    rewards: torch.Tensor, train_weight: torch.Tensor, num_generations: int, use_corr: bool = False, eps: float = 1e-6
) -> tuple[torch.Tensor, dict[str, float]]:
    """Within-group covariance (or correlation) of each objective's reward with the training signal, averaged over
    groups (CTWA, arXiv 2602.06869; `ctwa: compute_ctwa_stats`).

    Args:
        rewards (`torch.Tensor` of shape `(N, K)`): raw rewards (NaN where a reward does not apply).
        train_weight (`torch.Tensor` of shape `(N,)`): each completion's training weight `W_i` (its advantage for
            on-policy single-iteration training, where the ratio is 1).
        num_generations (`int`): G.
        use_corr (`bool`): correlation instead of covariance (scale-free targets).

    Returns:
        `(c (K,), metrics)`; groups where an objective or W has no spread contribute 0 to the covariance and are
        skipped for the correlation.
    """
    r = rewards.float().reshape(-1, num_generations, rewards.shape[1])
    w = train_weight.float().reshape(-1, num_generations, 1).expand_as(r)
    valid = ~torch.isnan(r)
    n = valid.sum(1, keepdim=True).float()
    rm = torch.where(valid, r, 0.0).sum(1, keepdim=True) / n.clamp(min=1)
    wm = torch.where(valid, w, 0.0).sum(1, keepdim=True) / n.clamp(min=1)
    ru, wu = torch.where(valid, r - rm, 0.0), torch.where(valid, w - wm, 0.0)
    cov = (ru * wu).sum(1) / n.squeeze(1).clamp(min=1)  # (B, K)
    usable = n.squeeze(1) >= 2
    if use_corr:
        sr = (ru.pow(2).sum(1) / n.squeeze(1).clamp(min=1)).sqrt()
        sw = (wu.pow(2).sum(1) / n.squeeze(1).clamp(min=1)).sqrt()
        usable = usable & (sr > eps) & (sw > eps)
        cov = cov / (sr * sw).clamp(min=eps)
    cov = torch.where(usable, cov, torch.zeros_like(cov))
    c = cov.sum(0) / usable.float().sum(0).clamp(min=1)
    return c, {"groups_used": usable.float().sum(0).mean().item()}


def ctwa_update(
    log_weights: torch.Tensor,
    ema: torch.Tensor | None,
    covariance: torch.Tensor,
    targets: torch.Tensor,
    lambda_lr: float = 0.05,
    ema_tau: float = 0.1,
    objective_means: torch.Tensor | None = None,
    objective_targets: torch.Tensor | None = None,
    max_log_weight: float | None = None,
):
    """One CTWA step: `c̄ ← (1-τ) c̄ + τ c` (first step: `c̄ = c`), deficit `d = max(0, target - c̄)` (gated to 0 for an
    objective whose mean already reached its `objective_targets` cap), `log λ ← log λ + η d`. λ = exp(log λ) is not
    renormalised (the reference's rule); ``max_log_weight`` bounds it.

    Returns:
        `(new_log_weights (K,), new_ema (K,), deficit (K,))`.
    """
    covariance = covariance.float()
    ema = covariance.clone() if ema is None else (1 - ema_tau) * ema.float() + ema_tau * covariance
    deficit = (targets.float() - ema).clamp(min=0)
    if objective_means is not None and objective_targets is not None:
        deficit = torch.where(objective_means.float() >= objective_targets.float(), torch.zeros_like(deficit), deficit)
    new = log_weights.float() + lambda_lr * deficit
    if max_log_weight is not None:
        new = new.clamp(max=max_log_weight)
    return new, ema, deficit


# ---------------------------------------------------------------------------------------------------------------------
# Lagrangian (constrained composite reward models)


def lagrangian_update(
    multipliers: torch.Tensor, objective_means: torch.Tensor, thresholds: torch.Tensor, lr: float = 0.01
) -> torch.Tensor:
    """Projected dual ascent `μ_k ← max(0, μ_k + η (E[r_k] - θ_k))` on `E[r_k] ≤ θ_k`; NaN thresholds mean
    unconstrained (μ stays 0); a NaN mean (no sample scored) leaves μ_k unchanged. The scalarised reward is
    `Σ_k b_k (1 - μ_k) r_k`. `(K,) -> (K,)`."""
    step = torch.nan_to_num(objective_means.float() - thresholds.float(), nan=0.0)  # no data: keep μ
    new = (multipliers.float() + lr * step).clamp(min=0)
    return torch.where(torch.isnan(thresholds.float()), torch.zeros_like(new), new)


# ---------------------------------------------------------------------------------------------------------------------
# Transforms


def brme_reward(head_rewards: torch.Tensor, lam: float = 0.5) -> torch.Tensor:
    """Reward-robust scalar of an ensemble: `λ·mean_h r_h + (1-λ)·min_h r_h` (Yan et al., arXiv 2409.15360; the
    nominal term is the heads' mean, our reading). NaN heads are ignored; all-NaN rows stay NaN. `(N, H) -> (N,)`."""
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"lam must be in [0, 1], got {lam}.")
    r = head_rewards.float()
    valid = ~torch.isnan(r)
    mean = torch.nanmean(r, dim=1)
    low = torch.where(valid, r, torch.full_like(r, torch.inf)).min(dim=1).values
    out = lam * mean + (1 - lam) * low
    return torch.where(valid.any(dim=1), out, torch.full_like(out, math.nan))
