"""PAMA, Pareto Multi-Objective Alignment (He & Maghsudi, arXiv 2508.07768, ECML/PKDD 2025): the pure torch math of
the `pama` reward-weight controller ([`hf_stable.losses.reward_control`]).

PAMA replaces the min-norm problem of gradient-based multi-objective optimisation (MGDA: `min_{α ∈ Δ} ‖Σ_k α_k
∇J_k‖²`, O(K²·d) for d parameters) by a convex problem over the K objective weights alone, solved in closed form at
O(K), and shows convergence to a Pareto stationary point; it trains with "Noon PPO", PPO whose advantages are clipped
at zero (`A = max(A', 0)`).

What is reconstructed here (no author code was found, and the paper's derivation is not reproduced): the objective's
gradient is `∇J_k = (1/N) Σ_n A_{n,k} ∇log π(y_n)`, with `A_{n,k}` completion n's group-centred (or group-standardised)
reward k. Modelling the per-completion score vectors `∇log π(y_n)` as orthogonal with equal norms turns the Gram
matrix into `⟨∇J_j, ∇J_k⟩ ∝ Σ_n A_{n,j} A_{n,k}`; keeping its diagonal `c_k = mean_n A_{n,k}²` (the objectives'
advantage columns treated as uncorrelated) gives the convex problem

    min_{α ∈ Δ} Σ_k c_k α_k²,   solved by   α_k = (1/c_k) / Σ_j (1/c_j),

O(N·K) for the statistics and O(K) for the solve. At that α every objective has the same first-order gain
`⟨d, ∇J_k⟩ = α_k c_k = ‖d‖²` along `d = Σ α_k ∇J_k` (MGDA's common-descent condition); when the advantage columns are
orthogonal the closed form is MGDA's exact min-norm point. With `positive_part=True` the statistic uses Noon PPO's
clipped advantages `max(A, 0)`. An objective whose advantages are all zero in a batch (constant reward, groups of one)
has no gradient: MGDA would stop (the zero direction is Pareto stationary); it is left out instead (weight 0), so the
batch still trains the others, and when every objective is flat the caller keeps its weights.
"""

from __future__ import annotations

import torch

from .._validation import boolean, choice, number
from ..papers import Paper
from ..registry import Field
from .advantages import group_zscore
from .controller_base import REWARD_WEIGHTINGS, RewardWeightController


# kept beside its code (not in `hf_stable.papers`) so that the paper table other modules load stays unchanged
PAMA_PAPER = Paper(
    "pama",
    "Pareto Multi-Objective Alignment for Language Models",
    "He, Qiang and Maghsudi, Setareh",
    "2508.07768",
    2025,
    "@misc{pama2025,\n"
    "  title         = {Pareto Multi-Objective Alignment for Language Models},\n"
    "  author        = {He, Qiang and Maghsudi, Setareh},\n"
    "  year          = {2025},\n  eprint        = {2508.07768},\n  archivePrefix = {arXiv}\n}",
)

SCALES = ("reward", "group")

# below this fraction of the largest statistic an objective counts as flat (rounding of a centred constant column)
_FLAT = 1e-12


def pama_statistics(
    rewards: torch.Tensor,
    num_generations: int,
    objective_weights: torch.Tensor | None = None,
    positive_part: bool = True,
    scale: str = "reward",
) -> torch.Tensor:
    """The per-objective statistic `c_k = mean_n A_{n,k}²` of the closed form (the diagonal of the objectives' Gram
    matrix under orthogonal per-completion scores).

    Args:
        rewards (`torch.Tensor` of shape `(N, K)`): raw rewards, N = groups × `num_generations`, NaN where a reward
            does not apply (left out of its group's mean and of the average).
        num_generations (`int`): G, the group size.
        objective_weights (`torch.Tensor` of shape `(K,)`, *optional*): `b`, the objectives are `b_k r_k` (the user's
            `reward_weights`: units and signs). Default ones.
        positive_part (`bool`): Noon PPO's `max(A, 0)` before squaring.
        scale (`str`): `"reward"`: `A` is the group-centred `b_k r_k` (TRL's `sum_then_normalize` scalarises these);
            `"group"`: GDPO's per-reward advantage (`normalize_then_sum`), `(b_k r_k - mean) / (std + 1e-4)` with the
            group's Bessel-corrected std, scale-free up to the 1e-4.

    Returns:
        `torch.Tensor` of shape `(K,)`, fp32, ≥ 0 and finite: a group whose values of a reward are all equal (or a
        group of one) contributes zeros, and an objective with no valid entry gets 0.
    """
    if scale not in SCALES:
        raise ValueError(f"`pama_scale` must be one of {SCALES}, got {scale!r}.")
    k = rewards.shape[1]
    b = torch.ones(k) if objective_weights is None else objective_weights.reshape(k).float()
    objectives = rewards.float() * b
    # the trainer's own per-reward advantages (TRL's centring, GDPO's z-score): NaN entries and flat groups give 0
    trl_scale = "none" if scale == "reward" else "group"
    advantages = torch.stack([group_zscore(objectives[:, j], num_generations, trl_scale) for j in range(k)], dim=1)
    if positive_part:
        advantages = advantages.clamp(min=0)
    total = (~torch.isnan(objectives)).sum(0)
    return advantages.pow(2).sum(0) / total.clamp(min=1)


def pama_weights(statistics: torch.Tensor) -> torch.Tensor:
    """The closed-form minimiser of `Σ_k c_k α_k²` over the simplex: `α_k = (1/c_k) / Σ_j (1/c_j)` over the objectives
    with `c_k > 0`, 0 for the flat ones (`c_k ≤ 1e-12 · max c`). `(K,) -> (K,)` fp32, non-negative, summing to 1;
    all zeros when every objective is flat (no direction: the caller keeps its weights).
    """
    c = statistics.double().reshape(-1)
    if not torch.isfinite(c).all() or (c < 0).any():
        raise ValueError(f"PAMA statistics must be finite and non-negative, got {statistics.tolist()}.")
    top = c.max() if c.numel() else c.new_zeros(())
    active = (c > _FLAT * top) & (top > 0)
    inverse = torch.where(active, 1.0 / torch.where(active, c, 1.0), 0.0)
    total = inverse.sum()
    return (inverse / total).float() if total > 0 else torch.zeros_like(c, dtype=torch.float32)


def pama_min_norm(statistics: torch.Tensor, alpha: torch.Tensor) -> float:
    """`Σ_k c_k α_k²`, the squared norm of the combined direction under the model (`1 / Σ 1/c_k` at the optimum): the
    distance from Pareto stationarity; 0 when every objective is flat."""
    return float((statistics.double() * alpha.double().pow(2)).sum())


@REWARD_WEIGHTINGS.register(
    "pama",
    paper=PAMA_PAPER,
    description="closed-form Pareto (min-norm) weights from per-objective advantage statistics, O(K)",
    fields=[
        Field(
            "pama_positive_part",
            True,
            "Statistics on Noon PPO's clipped advantages `max(A, 0)` (the paper's); False: on the signed advantages "
            "(those of TRL's unclipped loss).",
            check=boolean(),
            param="positive_part",
        ),
        Field(
            "pama_scale",
            "reward",
            "Advantages in the statistics: 'reward' (group-centred weighted rewards, as `sum_then_normalize` "
            "scalarises them) or 'group' (also divided by the group std, GDPO's `normalize_then_sum`; scale-free).",
            check=choice(*SCALES),
            param="scale",
        ),
        Field(
            "pama_ema",
            1.0,
            "EMA rate of the statistics across generation batches (1: each batch alone, the paper's per-step solve).",
            check=number(low=0, high=1, low_open=True),
            param="ema",
        ),
    ],
)
class PAMAController(RewardWeightController):
    """PAMA weights (arXiv 2508.07768; the reconstruction is in the module docstring): after each generation batch,
    `α = pama_weights(c̄)` from the EMA `c̄` of [`pama_statistics`] of the objectives `b_k r_k`, and the next batch is
    scalarised by `w = K · α ⊙ b` (`w = b` when the objectives are balanced, `c_k` all equal). Before the first batch,
    and after a batch where every objective is flat, the weights stay where they were (`α` uniform at the start)."""

    adaptive = True

    def __init__(self, base_weights, positive_part=True, scale="reward", ema=1.0):
        super().__init__(base_weights)
        self.positive_part, self.scale, self.ema = positive_part, scale, ema
        k = self.base.numel()
        self.alpha = torch.full((k,), 1.0 / k)
        self.statistics: torch.Tensor | None = None

    @property
    def weights(self):
        return self.base.numel() * self.alpha * self.base

    def observe(self, rewards, advantages, num_generations, context):
        c = pama_statistics(rewards, num_generations, self.base, self.positive_part, self.scale)
        self.statistics = c if self.statistics is None else (1 - self.ema) * self.statistics + self.ema * c
        alpha = pama_weights(self.statistics)
        if alpha.sum() > 0:
            self.alpha = alpha
        out = {f"pama/stat_{k}": v for k, v in enumerate(self.statistics.tolist())}
        out.update({f"pama/alpha_{k}": v for k, v in enumerate(self.alpha.tolist())})
        out["pama/min_norm"] = pama_min_norm(self.statistics, self.alpha)
        return out

    def state_dict(self):
        state = {"alpha": self.alpha}
        if self.statistics is not None:
            state["statistics"] = self.statistics
        return state

    def load_state_dict(self, state):
        self.alpha = state["alpha"].float()
        self.statistics = state["statistics"].float() if "statistics" in state else None


__all__ = ["PAMA_PAPER", "SCALES", "PAMAController", "pama_min_norm", "pama_statistics", "pama_weights"]
