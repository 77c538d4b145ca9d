"""Model Stock: move from the base towards the average of the fine-tunes by a factor set by their angle.

Semantics follow mergekit 0.1.5 `merge_methods/model_stock.py` (read, not copied): with task vectors
`τ_i = x_i − base`, `cos θ` is the mean over pairs i < j of `<τ_i, τ_j> / max(‖τ_i‖ ‖τ_j‖, 1e-6)` (clipped to
[-1, 1]), `t = N cos θ / (1 + (N − 1) cos θ)` (0 where the denominator is below 1e-6), and the output is
`t · mean(x_i) + (1 − t) · base = base + (t / N) Σ_i τ_i`. One angle per tensor, or per row (`filter_wise: true`;
a vector is one row).

Paper: Jang, Yun, Han 2024, "Model Stock: All we need is just a few fine-tuned models", arXiv 2403.19522.
"""

from __future__ import annotations

import torch

from hf_stable._validation import boolean
from hf_stable.papers import PAPERS
from hf_stable.registry import Field

from .base import ElementwiseMethod, GramMethod, merge_method


def model_stock_coefficients(gram: torch.Tensor) -> torch.Tensor:
    """`(..., N)` float64 coefficients `t/N` of the task vectors from `(..., N, N)` Gram matrices (N ≥ 2)."""
    g = torch.as_tensor(gram, dtype=torch.float64)
    n = g.shape[-1]
    r = torch.diagonal(g, dim1=-2, dim2=-1).clamp_min(0).sqrt()
    i, j = torch.triu_indices(n, n, offset=1)
    cos = (g[..., i, j] / (r[..., i] * r[..., j]).clamp_min(1e-6)).clamp(-1.0, 1.0).mean(-1)
    den = 1 + (n - 1) * cos
    t = torch.where(den.abs() < 1e-6, torch.zeros_like(cos), n * cos / torch.where(den.abs() < 1e-6, 1.0, den))
    return (t / n).unsqueeze(-1).expand(*t.shape, n)


def model_stock_mergekit(xs: list[torch.Tensor], base: torch.Tensor, *, filter_wise: bool) -> torch.Tensor:
    """mergekit 0.1.5's Model Stock arithmetic (`merge_methods/model_stock.py`, followed step by step, not copied) in
    the inputs' dtype: task vectors, pairwise cosines, `t`, the mean of the fine-tunes and the interpolation are all
    rounded to it as mergekit's are.

    Args:
        xs: N ≥ 2 fine-tuned tensors; `base`: the base tensor (same shape and dtype); `filter_wise`: one angle per
            row (a vector is one row) instead of per tensor.

    Returns:
        The merged tensor, shape and dtype of `base`.
    """
    shape = base.shape
    if not filter_wise:
        base, xs = base.reshape(-1), [x.reshape(-1) for x in xs]
    elif base.dim() == 1:
        base, xs = base.unsqueeze(0), [x.unsqueeze(0) for x in xs]
    taus = [x - base for x in xs]
    cosines = []
    for i, a in enumerate(taus):
        for b in taus[i + 1 :]:
            denom = torch.norm(a, dim=-1) * torch.norm(b, dim=-1)
            cosines.append(((a * b).sum(dim=-1) / denom.clamp(min=1e-6)).clamp(-1, 1))
    cos = torch.stack(cosines).mean(dim=0).unsqueeze(-1)
    n = len(xs)
    den = 1 + (n - 1) * cos
    singular = den.abs() < 1e-6  # no finite estimate: the base is kept
    t = torch.where(singular, torch.zeros_like(cos), (n * cos) / torch.where(singular, torch.ones_like(den), den))
    # mergekit's `sum(xs) / n`, `t * mean + (1 - t) * base`, with its temporaries updated in place (same bits: 0 + x
    # first, as Python's sum starts, so a −0 becomes +0 as there)
    acc = xs[0] + 0
    for x in xs[1:]:
        acc.add_(x)
    acc.div_(n).mul_(t)
    return acc.add_((1 - t) * base).reshape(shape)


@merge_method("model_stock", PAPERS["model_stock"])
class ModelStockMethod(ElementwiseMethod, GramMethod):
    """base + t·mean(τ_i) with t from the mean pairwise angle of the task vectors.

    Model Stock (Jang, Yun, Han 2024, arXiv 2403.19522). Params: `filter_wise` (false: one angle per tensor).
    """

    ignores_weight = True

    kind = "elementwise"
    base = "task_vector"
    min_models = 2
    params = (Field("filter_wise", False, "One angle per row instead of per tensor.", boolean()),)

    def kind_for(self, params) -> str:
        return "elementwise" if self.resolve(params)["filter_wise"] else "gram"

    def row_local_for(self, params) -> bool:
        return bool(self.resolve(params)["filter_wise"])

    def coefficients(self, gram, weights, params):
        return model_stock_coefficients(gram)

    def mergekit_direct(self, params) -> bool:
        return True

    def mergekit_merge(self, xs, base, weights, params):
        return model_stock_mergekit(xs, base, filter_wise=bool(self.resolve(params)["filter_wise"]))

    def combine(self, v, weights, params, *, thresholds=None, sums=None, row_len=None, shape=None, **kw):
        n_models, n = v.shape
        rows = v.reshape(n_models, -1, row_len or n)
        r64 = rows.to(torch.float64)
        c = model_stock_coefficients(torch.einsum("irc,jrc->rij", r64, r64)).to(torch.float32)  # (rows, N)
        out = rows[0] * c[:, :1]
        for i in range(1, n_models):
            out.add_(rows[i] * c[:, i : i + 1])
        return out.reshape(n)
