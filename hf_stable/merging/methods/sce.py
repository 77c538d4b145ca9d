"""SCE (Select, Calculate, Erase): FuseChat's merge of task vectors with per-model coefficients from their size.

Semantics follow mergekit 0.1.5 `merge_methods/sce.py` (`sce_merge`, `sce_weight`, `sce_mask`; read, not
copied). With task vectors `τ_i = x_i − base` of one tensor:

1. **select** (`select_topk` < 1): keep the positions whose variance across the models (population variance) is
   among the `int(select_topk · #nonzero variances)` largest; zero the rest in every τ_i;
2. **calculate**: `c_i = mean(τ_i²) / Σ_j mean(τ_j²)` over the tensor (`1/N` each when that sum is below 1e-6);
3. **erase**: TIES's sign election (the sign of `Σ_i τ_i`, 0 counting as +); each entry keeps its model's `c_i`
   where its sign agrees, else 0;
4. `out = base + Σ_i c_i m_i τ_i / max(Σ_i c_i m_i, 1e-6)`.

Selection and coefficients need the whole tensor, so the engine hands the method each tensor whole (one chunk,
like mergekit, which holds every tensor whole); the operations run in the recipe's dtype, so a 16-bit recipe gives
mergekit's roundings (and its `topk` choice among tied variances).

Paper: Wan et al. 2024, "FuseChat: Knowledge Fusion of Chat Models", arXiv 2408.07990.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hf_stable._validation import boolean, number
from hf_stable.papers import PAPERS
from hf_stable.registry import Field

from .base import ElementwiseMethod, merge_method


_BLOCK = 1 << 20  # positions per block of the elementwise steps

# `row(i, start, stop) -> (stop − start,)`: a fresh tensor holding positions [start, stop) of model i's task vector
# (the engine builds it from the stored inputs, so no (N, n) copy of a whole tensor is ever held)
Rows = Callable[[int, int, int], torch.Tensor]


def population_variance(tv: torch.Tensor, block: int = _BLOCK) -> torch.Tensor:
    """`(N, n)` → `(n,)` variance over dim 0 (population, `unbiased=False`) in `tv`'s dtype, bit for bit what
    `torch.var(tv, dim=0, unbiased=False)` gives on CPU, which mergekit calls.

    That kernel runs Welford's update in float64 over the N values of each position, in order, and rounds the
    float64 result to the dtype (through float32 for a 16-bit one). It does so position by position, which made
    this one call most of SCE's time; the same updates on blocks of positions give the same bits in a few passes.
    """
    return _variance_of_rows(lambda i, a, b: tv[i, a:b], tv.shape[0], tv.shape[1], tv.dtype, block)


def _variance_of_rows(row: Rows, n_models: int, n: int, dtype: torch.dtype, block: int = _BLOCK) -> torch.Tensor:
    out = torch.empty(n, dtype=dtype)
    for s in range(0, n, block):
        e = min(n, s + block)
        mean = torch.zeros(e - s, dtype=torch.float64)
        m2 = torch.zeros_like(mean)
        for k in range(n_models):
            x = row(k, s, e).to(torch.float64, copy=True)
            delta = x - mean
            mean += delta / (k + 1)
            m2 += delta * x.sub_(mean)
        var = m2.div_(n_models)
        out[s:e] = var if dtype in (torch.float32, torch.float64) else var.to(torch.float32)
    return out


def sce_combine(tv: torch.Tensor, select_topk: float) -> torch.Tensor:
    """`(N, n)` task vectors of one whole tensor (any float dtype) → `(n,)` merged task vector in that dtype.

    Only the selection and the coefficients need the whole tensor; the rest is elementwise and runs on blocks of
    positions (the same bits as whole, fewer whole-tensor temporaries).
    """
    out = torch.empty(tv.shape[1], dtype=tv.dtype)
    for s, block in sce_blocks(lambda i, a, b: tv[i, a:b].clone(), tv.shape[0], tv.shape[1], tv.dtype, select_topk):
        out[s : s + block.numel()] = block
    return out


def sce_blocks(row: Rows, n_models: int, n: int, dtype: torch.dtype, select_topk: float, block: int | None = None):
    """`sce_combine` on task vectors given row by row (`row`, in `dtype`): yields `(start, merged[start:stop])`
    blocks in order. At most one whole row, the variance, the selection and one `(N, block)` block are alive."""
    block = block or _BLOCK
    keep = None  # mergekit multiplies by a 0/1 mask; a bool one gives the same products (x · 0 keeps x's sign)
    if select_topk < 1:
        keep = torch.zeros(n, dtype=torch.bool)
        if select_topk > 0:
            spread = _variance_of_rows(row, n_models, n, dtype)  # ≥ +0 (never −0): its own |·|, which mergekit takes
            k = int(int(torch.count_nonzero(spread)) * select_topk)
            if k > 0:
                # sorted=False selects the same entries: the kernel partitions, and only sorts what it selected
                keep[torch.topk(spread, k=k, largest=True, sorted=False).indices] = True
            del spread

    def masked(x, s):  # x is fresh: masked in place, mergekit's `x * mask` bit for bit
        return x if keep is None else x.mul_(keep[s : s + x.shape[-1]])

    # whole rows, one at a time: mergekit's reduction order without an (N, n) masked copy
    size = torch.stack([masked(row(i, 0, n), 0).square_().mean() for i in range(n_models)])
    total = float(size.sum())
    coeff = (torch.full_like(size, 1 / n_models) if abs(total) < 1e-6 else size / total).unsqueeze(-1)
    for s in range(0, n, block):
        e = min(n, s + block)
        x = masked(torch.stack([row(i, s, e) for i in range(n_models)]), s)
        majority = (x.sum(dim=0) >= 0).to(x.dtype) * 2 - 1
        erased = coeff * (x.sign() == majority)
        yield s, (x * erased).sum(dim=0) / erased.sum(dim=0).clamp(min=1e-6)


@merge_method("sce", PAPERS["fusechat_sce"])
class SceMethod(ElementwiseMethod):
    """Select high-variance positions, weight task vectors by their mean square, erase minority signs.

    SCE (Wan et al. 2024, arXiv 2408.07990). Params: `select_topk` (1.0: keep every position), `int8_mask`.
    """

    base = "task_vector"
    row_local = True
    whole_tensor = True
    ignores_weight = True  # mergekit 0.1.5 accepts a per-model weight on sce and ignores it
    params = (
        Field("select_topk", 1.0, "Fraction of positions (by variance across models) kept.", number(low=0, high=1)),
        Field("int8_mask", False, "mergekit's memory option for its masks (no effect on the values).", boolean()),
    )

    def combine(self, v, weights, params, *, cdt=None, **kw):
        topk = float(self.resolve(params)["select_topk"])
        tv = v.to(cdt) if cdt is not None else v
        return sce_combine(tv, topk).float()

    def combine_rows(self, row: Rows, n_models: int, n: int, params, *, cdt=None):
        """`combine` of a whole tensor given row by row (`row` in float32): `(start, merged block)` in float32."""
        topk = float(self.resolve(params)["select_topk"])
        if cdt is not None:
            row32, row = row, lambda i, a, b: row32(i, a, b).to(cdt)
        for s, block in sce_blocks(row, n_models, n, cdt or torch.float32, topk):
            yield s, block.float()
