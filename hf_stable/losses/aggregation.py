"""Loss aggregation across completions of different lengths: pure torch functions.

Reference aggregators (what TRL's `loss_type` computes, as per-sample weights on `Σ_t ℓ_{i,t}`) and ΔL
normalisation, the minimum-variance unbiased weighting (He et al., arXiv 2509.07558; `zerolllin/Delta-L-Normalization:
compute_grpo_outcome_advantage`). ΔL is applied as a per-sample multiplier on the advantages together with TRL's
constant normaliser `loss_type="dr_grpo"`: the PPO-clip loss is positively homogeneous in the advantage, so
`ℓ(ω A) = ω ℓ(A)` for ω > 0, and the result is exactly `Σ_i (L_i^{-α} / Σ_j L_j^{-α}) Σ_t ℓ_{i,t} / L_max`.
"""

from __future__ import annotations

import torch

from .._validation import choice, number
from ..papers import PAPERS
from ..registry import Field, Registry, Requires


# A switch: setting `delta_l_alpha` (the exponent α, which the method reads) turns ΔL on.
LOSS_AGGREGATIONS = Registry(
    "loss_aggregation",
    "per-sample weights on the summed token losses",
    selector="delta_l_alpha",
    enable=1.0,
    selector_check=number(low=0, allow_none=True),
)


@LOSS_AGGREGATIONS.register(
    "delta_l",
    paper=PAPERS["delta_l"],
    description="ΔL normalisation: per-sample weights `L_i^-α / mean L^-α` on the advantages",
    fields=[
        Field(
            "delta_l_scope",
            "batch",
            "Normalise ΔL weights over the batch (reference) or within each group.",
            check=choice("batch", "group"),
            param="scope",
        ),
        Field(
            "delta_l_max_weight",
            None,
            "Cap on a ΔL weight.",
            check=number(low=0, low_open=True, allow_none=True),
            param="max_weight",
            type=float | None,
        ),
    ],
    reads={"alpha": "delta_l_alpha"},
    requires=[
        Requires(
            "loss_type",
            lambda value: value == "dr_grpo",
            "`delta_l_alpha` multiplies the advantages by length weights and needs the constant normaliser of "
            "loss_type='dr_grpo', or lengths would be normalised twice; set loss_type='dr_grpo'",
            fix="dr_grpo",
        )
    ],
)
def delta_l_weights(
    lengths: torch.Tensor,
    alpha: float,
    num_generations: int | None = None,
    scope: str = "batch",
    max_weight: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """ΔL per-sample multipliers `ω_i = L_i^{-α} / mean_j L_j^{-α}` (mean over valid samples of the batch or group).

    α = 1 is the minimum-variance choice, α = 0 gives constant weights (Dr. GRPO), α < 1 keeps more weight on long
    responses. Empty completions (L = 0, e.g. masked truncations) get weight 0 and are left out of the mean.

    Args:
        lengths (`torch.Tensor` of shape `(N,)`): token counts in the loss mask of the whole generation batch,
            gathered across processes.
        alpha (`float` ≥ 0): the exponent α.
        num_generations (`int`, *optional*): group size, needed for ``scope="group"``.
        scope (`str`, defaults to `"batch"`): normalise over the batch (reference) or within each group.
        max_weight (`float`, *optional*): cap on ω (very short responses get large weights when α ≥ 1).

    Returns:
        `(weights (N,), metrics)` with metrics ``max_weight``, ``mean_length``.
    """
    if alpha < 0:
        raise ValueError(f"alpha must be >= 0, got {alpha}.")
    lengths = lengths.float()
    valid = lengths > 0
    if not valid.any():
        return torch.zeros_like(lengths), {"max_weight": 0.0, "mean_length": 0.0}
    scaled = lengths.clamp(min=1) / lengths[valid].mean()  # O(1) numbers; cancels in the ratio
    x = torch.where(valid, scaled.pow(-alpha), torch.zeros_like(scaled))
    if scope == "batch":
        x = x / x[valid].mean()
    elif scope == "group":
        if num_generations is None or lengths.numel() % num_generations:
            raise ValueError("scope='group' needs num_generations dividing the batch.")
        g, v = x.view(-1, num_generations), valid.view(-1, num_generations)
        mean = g.sum(1, keepdim=True) / v.sum(1, keepdim=True).clamp(min=1)
        x = torch.where(mean > 0, g / mean.clamp(min=1e-12), torch.zeros_like(g)).view(-1)
    else:
        raise ValueError(f"scope must be 'batch' or 'group', got {scope!r}.")
    if max_weight is not None:
        x = x.clamp(max=max_weight)
    return x, {"max_weight": x.max().item(), "mean_length": lengths[valid].mean().item()}


def trl_sample_weights(lengths: torch.Tensor, loss_type: str, max_completion_length: int) -> torch.Tensor:
    """Weight each TRL `loss_type` puts on a sample's summed token loss over one batch (`grpo_trainer._compute_loss`):
    `grpo` 1/(B L_i) (length-biased), `dapo` 1/Σ_j L_j, `dr_grpo` 1/(B L_max). For documentation and tests. `(N,)`."""
    lengths = lengths.float()
    n = lengths.numel()
    if loss_type == "grpo":
        return 1.0 / (n * lengths.clamp(min=1))
    if loss_type == "dapo":
        return torch.full_like(lengths, 1.0 / lengths.sum().clamp(min=1).item())
    if loss_type == "dr_grpo":
        return torch.full_like(lengths, 1.0 / (n * max_completion_length))
    raise ValueError(f"loss_type must be 'grpo', 'dapo' or 'dr_grpo', got {loss_type!r}.")
