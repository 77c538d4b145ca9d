"""Representation drift: how much the pairwise-distance geometry of a fixed probe set changes, and linear CKA.

Our reading of the unsupervised geometric stability measure (Shesha; abstract only, reconstructed): for probe
representations ``X ∈ R^{N×d}`` (one row per probe sequence), ``D(X)`` is the vector of the ``N(N−1)/2`` pairwise
distances (upper triangle, row-major, like ``scipy.spatial.distance.pdist``); the stability of ``X₁`` against a
reference ``X₀`` is the Spearman rank correlation of ``D(X₀)`` and ``D(X₁)``, and ``drift = 1 − stability``. It is
invariant to rotations and isotropic scaling of either representation (both keep the ranking of distances).

Linear CKA (Kornblith et al., arXiv 1905.00414) after column centring:
``CKA = ‖X₁ᵀX₀‖_F² / (‖X₀ᵀX₀‖_F · ‖X₁ᵀX₁‖_F)``, invariant to orthogonal transforms and isotropic scaling.

Shapes: ``X`` is ``(N, d)`` with ``N ≥ 2``; distance vectors are ``(N(N−1)/2,)``. float64 throughout (N is small).
Pure torch.
"""

from __future__ import annotations

import torch


__all__ = ["linear_cka", "pairwise_distances", "rankdata", "rdm_stability", "spearman"]


def pairwise_distances(x: torch.Tensor, metric: str = "cosine") -> torch.Tensor:
    """Condensed pairwise distances of the rows of ``x`` (N, d): ``"cosine"`` (``1 − x̂ᵢ·x̂ⱼ``, a zero row has
    similarity 0 to everything) or ``"euclidean"``."""
    x = x.double()
    n = x.shape[0]
    i, j = torch.triu_indices(n, n, offset=1, device=x.device)
    if metric == "cosine":
        unit = x / x.norm(dim=1, keepdim=True).clamp_min(torch.finfo(x.dtype).tiny)
        return 1.0 - (unit[i] * unit[j]).sum(dim=1)
    if metric == "euclidean":
        return (x[i] - x[j]).norm(dim=1)
    raise ValueError(f"`distance`={metric!r} is not valid. Allowed values: 'cosine', 'euclidean'.")


def rankdata(a: torch.Tensor) -> torch.Tensor:
    """1-based ranks of a 1-D tensor, ties get the average of their ranks (``scipy.stats.rankdata`` default)."""
    a = a.double().flatten()
    order = torch.argsort(a, stable=True)
    sorted_a = a[order]
    n = a.numel()
    # boundaries of runs of equal values in the sorted order
    new_run = torch.ones(n, dtype=torch.bool, device=a.device)
    new_run[1:] = sorted_a[1:] != sorted_a[:-1]
    run_id = torch.cumsum(new_run.long(), 0) - 1
    starts = torch.nonzero(new_run).flatten()
    ends = torch.cat([starts[1:], torch.tensor([n], device=a.device)])
    avg = (starts + ends + 1).double() / 2.0  # mean of ranks start+1 .. end
    ranks = torch.empty(n, dtype=torch.float64, device=a.device)
    ranks[order] = avg[run_id]
    return ranks


def _pearson(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a = a - a.mean()
    b = b - b.mean()
    denom = a.norm() * b.norm()
    if denom == 0:  # a constant vector: correlation undefined; equal constants are perfectly stable
        return torch.tensor(1.0 if torch.equal(a, b) else 0.0, dtype=torch.float64)
    return (a @ b) / denom


def spearman(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Spearman rank correlation (Pearson of average-tie ranks) of two 1-D tensors of equal length."""
    if a.numel() != b.numel():
        raise ValueError(f"spearman needs equal lengths, got {a.numel()} and {b.numel()}.")
    return _pearson(rankdata(a), rankdata(b))


def rdm_stability(x0: torch.Tensor, x1: torch.Tensor, metric: str = "cosine") -> torch.Tensor:
    """Spearman ρ between the pairwise-distance vectors of ``x0`` and ``x1`` (both (N, ·), same N ≥ 3)."""
    if x0.shape[0] != x1.shape[0]:
        raise ValueError(f"both representations need the same probe rows, got {x0.shape[0]} and {x1.shape[0]}.")
    return spearman(pairwise_distances(x0, metric), pairwise_distances(x1, metric))


def linear_cka(x0: torch.Tensor, x1: torch.Tensor) -> torch.Tensor:
    """Linear CKA of (N, d0) and (N, d1) representations after column centring; 0 if either is constant."""
    x0 = x0.double() - x0.double().mean(dim=0, keepdim=True)
    x1 = x1.double() - x1.double().mean(dim=0, keepdim=True)
    cross = (x1.T @ x0).pow(2).sum()
    norm0 = (x0.T @ x0).norm()
    norm1 = (x1.T @ x1).norm()
    denom = norm0 * norm1
    return cross / denom if denom > 0 else torch.zeros((), dtype=torch.float64)
