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

import torch

from hf_stable._validation import boolean, number
from hf_stable.papers import PAPERS
from hf_stable.registry import Field

from .base import ElementwiseMethod, merge_method


def sce_combine(tv: torch.Tensor, select_topk: float) -> torch.Tensor:
    """`(N, n)` task vectors of one whole tensor (any float dtype) → `(n,)` merged task vector in that dtype."""
    n_models = tv.shape[0]
    if select_topk < 1:
        keep = torch.zeros_like(tv[0])
        if select_topk > 0:
            spread = torch.var(tv, dim=0, unbiased=False)
            k = int(int(torch.count_nonzero(spread)) * select_topk)
            if k > 0:
                keep[torch.topk(spread.abs(), k=k, largest=True).indices] = 1
        tv = tv * keep
    majority = (tv.sum(dim=0) >= 0).to(tv.dtype) * 2 - 1
    agrees = tv.sign() == majority
    size = tv.square().mean(dim=1)
    total = float(size.sum())
    coeff = torch.full_like(size, 1 / n_models) if abs(total) < 1e-6 else size / total
    erased = coeff.unsqueeze(-1) * agrees
    return (tv * erased).sum(dim=0) / erased.sum(dim=0).clamp(min=1e-6)


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
