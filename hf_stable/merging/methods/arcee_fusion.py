"""Arcee Fusion: keep the base except where the other model's change is important.

Semantics follow mergekit 0.1.5 `merge_methods/arcee_fusion.py` (read, not copied). With the base `b` and the
other model `x` (two inputs, the base first), the importance of an entry is `|x − b| · KL_row`, where `KL_row`
is `Σ p log(p / q)` over its row with `p = softmax(x_row) + 1e-8`, `q = softmax(b_row) + 1e-8` (a vector is one
row). The threshold is `median + 1.5 (q3 − q1)` of the importances over the whole tensor (the entries at sorted
positions `int(q · (numel − 1))`, exact here; mergekit samples 10⁶ entries with replacement above that size), and
the output is `b + (x − b) · [importance ≥ threshold]`.

No paper (Arcee AI's description: https://arcee.ai).
"""

from __future__ import annotations

import torch

from .base import MERGE_METHODS, ElementwiseMethod


QUANTILES = (0.25, 0.5, 0.75)


def importance(x: torch.Tensor, b: torch.Tensor, row_len: int) -> torch.Tensor:
    """`(n,)` float32 importance of the entries of whole rows `x`, `b` (`(n,)` float32, `n` a multiple of
    `row_len`)."""
    xr, br = x.reshape(-1, row_len), b.reshape(-1, row_len)
    diff = (xr - br).abs()
    p = torch.softmax(xr, dim=-1) + 1e-8
    q = torch.softmax(br, dim=-1) + 1e-8
    kl = torch.sum(p * torch.log(p / q), dim=-1, keepdim=True)
    return (diff * kl).reshape(-1)


def quantile_ranks(numel: int) -> tuple[int, ...]:
    """Ranks (1 = largest) of the entries at ascending positions `int(q · (numel − 1))`, q = 0.25, 0.5, 0.75."""
    q = torch.tensor(QUANTILES, dtype=torch.float32)
    positions = (q * (numel - 1)).long().tolist()
    return tuple(numel - pos for pos in positions)


@MERGE_METHODS.register(
    "arcee_fusion",
    paper="Arcee Fusion (Arcee AI; no paper)",
    url="https://arcee.ai",
    description="Base plus the other model's changes whose importance (|Δ| × row KL) is an upper outlier.",
)
class ArceeFusionMethod(ElementwiseMethod):
    """Arcee Fusion of a base (first input) and one other model. No parameters."""

    default_name = "arcee_fusion"
    base = "endpoint"
    row_local = True
    min_models = 2
    max_models = 2

    def ranks(self, params, n_models, numel):
        return [quantile_ranks(numel), None]

    def score(self, v, *, base, row_len):
        imp = importance(v[1], v[0], row_len or v.shape[-1])
        return torch.stack([imp, imp])

    def combine(self, v, weights, params, *, thresholds=None, sums=None, row_len=None, shape=None, **kw):
        q1, median, q3 = (torch.tensor(float(x), dtype=torch.float32) for x in thresholds[0][:3])
        threshold = median + 1.5 * (q3 - q1)
        mask = (importance(v[1], v[0], row_len or v.shape[-1]) >= threshold).float()
        return v[0] + (v[1] - v[0]) * mask
