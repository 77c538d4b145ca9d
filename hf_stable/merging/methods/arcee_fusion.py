"""Arcee Fusion: keep the base except where the other model's change is important.

Semantics follow mergekit 0.1.5 `merge_methods/arcee_fusion.py` (read, not copied). With the base `b` and the
other model `x` (two inputs, the base first), the importance of an entry is `|x − b| · KL_row`, where `KL_row`
is `Σ p log(p / q)` over its row with `p = softmax(x_row) + 1e-8`, `q = softmax(b_row) + 1e-8` (a vector is one
row). The threshold is `median + 1.5 (q3 − q1)` of the importances over the whole tensor (the entries at sorted
positions `int(q · (numel − 1))`, exact here; mergekit samples 10⁶ entries with replacement above that size), and
the output is `b + (x − b) · [importance ≥ threshold]`. In a 16-bit recipe every step up to the mask is rounded to
the recipe's dtype and the output is float32 (mergekit's float32 mask promotes it), unless `out_dtype` is set.

No paper (Arcee AI's description: https://arcee.ai).
"""

from __future__ import annotations

import torch

from .base import ElementwiseMethod, merge_method


QUANTILES = (0.25, 0.5, 0.75)


def importance(x: torch.Tensor, b: torch.Tensor, row_len: int, cdt: torch.dtype | None = None) -> torch.Tensor:
    """`(n,)` float32 importance of the entries of whole rows `x`, `b` (`(n,)` float32, `n` a multiple of
    `row_len`); with a 16-bit `cdt` every intermediate is rounded to it, as mergekit's tensors are."""
    r = (lambda t: t.to(cdt).float()) if cdt is not None else (lambda t: t)
    xr, br = x.reshape(-1, row_len), b.reshape(-1, row_len)
    diff = r(xr - br).abs()
    p = r(r(torch.softmax(xr, dim=-1)) + 1e-8)
    q = r(r(torch.softmax(br, dim=-1)) + 1e-8)
    kl = r(torch.sum(r(p * r(torch.log(r(p / q)))), dim=-1, keepdim=True))
    return r(diff * kl).reshape(-1)


def quantile_ranks(numel: int) -> tuple[int, ...]:
    """Ranks (1 = largest) of the entries at ascending positions `int(q · (numel − 1))`, q = 0.25, 0.5, 0.75."""
    q = torch.tensor(QUANTILES, dtype=torch.float32)
    positions = (q * (numel - 1)).long().tolist()
    return tuple(numel - pos for pos in positions)


@merge_method("arcee_fusion", "Arcee Fusion (Arcee AI; no paper)", url="https://arcee.ai")
class ArceeFusionMethod(ElementwiseMethod):
    """Base plus the other model's changes whose importance (|Δ| × row KL) is an upper outlier.

    Arcee Fusion of a base (first input) and one other model. No parameters.
    """

    ignores_weight = True
    # mergekit's result is float32 whatever the recipe's dtype (its mask is float32): written as float32 unless the
    # recipe sets out_dtype.
    float32_result = True

    base = "endpoint"
    row_local = True
    min_models = 2
    max_models = 2

    def ranks(self, params, n_models, numel):
        return [quantile_ranks(numel), None]

    def score(self, v, *, base, row_len, cdt=None):
        imp = importance(v[1], v[0], row_len or v.shape[-1], cdt)
        return torch.stack([imp, imp])

    def combine(self, v, weights, params, *, thresholds=None, sums=None, row_len=None, shape=None, cdt=None, **kw):
        q1, median, q3 = (torch.tensor(float(x), dtype=torch.float32) for x in thresholds[0][:3])
        if cdt is None:
            threshold = median + 1.5 * (q3 - q1)
        else:  # mergekit's quantiles are tensors of the 16-bit dtype
            threshold = (median + (1.5 * (q3 - q1).to(cdt).float()).to(cdt).float()).to(cdt).float()
        mask = (importance(v[1], v[0], row_len or v.shape[-1], cdt) >= threshold).float()
        # mergekit's mask is float32: the 16-bit difference times it, plus the base, is float32 arithmetic
        diff = v[1] - v[0] if cdt is None else (v[1] - v[0]).to(cdt).float()
        return v[0] + diff * mask
