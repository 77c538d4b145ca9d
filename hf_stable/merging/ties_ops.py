"""The tensor operations of TIES-merging (Yadav et al. 2023, arXiv 2306.01708): magnitude trimming, sign election
and the disjoint mean.

They live below the method plugins because two users share them: the `ties` family of merge methods
(`methods.ties.gta_combine`, and DARE/DELLA through it) and FW-Merging's TIES local merge (`fw_local`). Trimming
counts as mergekit 0.1.5 `sparsify.magnitude` does (`keep_count`); the rule it keeps by is in `methods.ties`.
"""

from __future__ import annotations

import math

import torch

from .quantile import kth_largest_abs_tensor


def keep_count(density: float, numel: int) -> int:
    """Elements kept by magnitude trimming: `max(1, int(density · numel))` for a non-empty tensor and a positive
    density, as mergekit 0.1.5 `sparsify.magnitude` (`k = max(1, int(density * tensor.numel()))`)."""
    if numel <= 0 or density <= 0:
        return 0
    return min(numel, max(1, int(density * numel)))


def previous_float(x: float) -> float:
    """The largest float32 below `x` (`|t| > previous_float(x)` ⟺ `|t| ≥ x` for float32 t)."""
    return float(torch.nextafter(torch.tensor(x, dtype=torch.float32), torch.tensor(-math.inf)))


def keep_at_least(t: torch.Tensor, threshold: float) -> torch.Tensor:
    """`t` with the entries whose |t| is below `threshold` set to +0: one `hardshrink` at the float32 just below it."""
    if threshold <= 0:
        return t
    return torch.nn.functional.hardshrink(t, previous_float(threshold)) if math.isfinite(threshold) else t * 0.0


def trim(tau: torch.Tensor, density: float) -> torch.Tensor:
    """`tau` (any shape) with its entries below the k-th largest |τ| zeroed, `k = keep_count(density, numel)`:
    the magnitude trimming of `ties` on a whole tensor."""
    if density >= 1:
        return tau
    return keep_at_least(tau.float(), kth_largest_abs_tensor(tau, keep_count(density, tau.numel())))


# The election and the disjoint mean use float arithmetic instead of boolean masks (`torch.where`, `==`), which run
# several times slower on CPU, with the same values:
# * the agreeing entries of one position all have the majority sign m, so their sum is m · Σ|x| exactly (IEEE
#   addition is symmetric in sign), and |x| where sign(x) = m is relu(x · m);
# * a model agrees where relu(x · m) > 0, so its weight enters the divisor as sign(relu(x · m)) · w.
def elect(total: torch.Tensor) -> torch.Tensor:
    """TIES sign election: +1 where `Σ_i w_i τ̃_i ≥ 0`, else −1 ("sum" consensus; 0 counts as +).

    `copysign(1, total)`: a sum is −0 only where every term is ±0, and there no model agrees whatever the sign.
    """
    return torch.copysign(torch.ones((), dtype=total.dtype), total)


def disjoint_add(agreeing: torch.Tensor, divisor: torch.Tensor, weighted: torch.Tensor, majority, w: float) -> None:
    """Add one model's |w_i τ̃_i| where its sign is the majority's (zeros never agree) to `agreeing`, and `w_i` there
    to `divisor`."""
    r = (weighted * majority).clamp_(min=0)
    agreeing.add_(r)
    agree = torch.sign(r)
    divisor.add_(agree if w == 1.0 else agree.mul_(w))


def disjoint_mean(agreeing: torch.Tensor, divisor: torch.Tensor, majority, weights=None) -> torch.Tensor:
    """`majority · agreeing / divisor`, with 1 where no model agrees (`agreeing` is 0 there).

    With positive weights the divisor is 0 or at least the smallest weight, so raising it to that weight changes only
    the zeros; otherwise `divisor + (1 − sign|divisor|)` adds exactly 0 where it is not 0.
    """
    if weights is not None and all(x > 0 for x in weights):
        divisor = divisor.clamp_(min=min(weights))
    else:
        divisor = divisor.add(torch.sign(divisor.abs()).neg_().add_(1))
    return agreeing.mul_(majority).div_(divisor)
