"""Reinforced Agent Merging (RAM) and its tensor-local rescaled variant (RAM+).

Semantics follow mergekit 0.1.5 `merge_methods/ram.py` (`ram`, `ramplus_tl`; read, not copied). With task vectors
`τ_i = x_i − base`, an entry of model i *contributes* where `|τ_i| > epsilon`; `c` is the number of contributing
models at a position. Where exactly one model contributes (a *unique* entry) its change is kept whole; where several
do (a *shared* entry) their changes are averaged (`τ_i / c`); elsewhere the base is kept:

    out = base + Σ_i [|τ_i| > ε] (τ_i · [c = 1] · λ_i + τ_i / c · [c > 1])

RAM has `λ_i = 1`. RAM+ (`ramplus_tl`) rescales each model's unique entries by `λ_i = 1 + r · min(max(ρ_i, 0),
alpha)`, with `ρ_i` = (model i's shared entries) / max(its unique entries, ε) counted over the whole tensor (a
pass before the combine). In a 16-bit recipe every step is rounded to the recipe's dtype where mergekit's is; RAM+'s
`λ` is float32 there, which makes mergekit's result float32: it is written as float32 unless `out_dtype` is set.

Paper: Yuan et al. 2026, "Behavior Knowledge Merge in Reinforced Agentic Models", arXiv 2601.13572.
"""

from __future__ import annotations

import torch

from hf_stable._validation import number
from hf_stable.papers import PAPERS
from hf_stable.registry import Field

from .base import ElementwiseMethod, merge_method, round_


_EPSILON = Field("epsilon", 1e-5, "A task-vector entry contributes where its magnitude exceeds this.", number(low=0))


def _contributions(v: torch.Tensor, epsilon: float, cdt) -> tuple[torch.Tensor, torch.Tensor]:
    """`(N, n)` bool contributing entries and `(n,)` int64 counts; with a 16-bit `cdt` ε is rounded to it, as a
    Python number compared with a tensor of that dtype is."""
    if cdt is not None:
        epsilon = float(torch.tensor(epsilon, dtype=torch.float64).to(cdt))
    nonzero = v.abs() > epsilon
    return nonzero, nonzero.sum(dim=0)


def ram_combine(v: torch.Tensor, epsilon: float, scales: list[float] | None = None, cdt=None) -> torch.Tensor:
    """`(N, n)` float32 task vectors → `(n,)` merged task vector (`scales`: RAM+'s λ_i, float32; None: RAM)."""
    nonzero, counts = _contributions(v, epsilon, cdt)
    unique, shared = counts == 1, counts > 1
    divisor = counts.clamp(min=1).to(torch.float32)
    out = torch.zeros_like(v[0])
    for i in range(v.shape[0]):
        t = v[i] * nonzero[i]
        kept = t * unique
        if scales is not None:
            kept = kept * scales[i]  # float32 in mergekit whatever the dtype
        averaged = round_((t * shared) / divisor, cdt)
        out.add_(kept + averaged)
    return out if scales is not None else round_(out, cdt)


class _RamBase(ElementwiseMethod):
    base = "task_vector"
    min_models = 1
    ignores_weight = True  # mergekit 0.1.5 accepts a per-model weight here and ignores it


@merge_method("ram", PAPERS["ram_merging"])
class RamMethod(_RamBase):
    """Keep each model's unique task-vector entries, average the shared ones (|τ| > epsilon).

    Reinforced Agent Merging (Yuan et al. 2026, arXiv 2601.13572). Params: `epsilon` (1e-5).
    """

    params = (_EPSILON,)

    def combine(self, v, weights, params, *, cdt=None, **kw):
        return ram_combine(v, float(self.resolve(params)["epsilon"]), None, cdt)


@merge_method("ramplus_tl", PAPERS["ram_merging"])
class RamPlusMethod(_RamBase):
    """RAM with each model's unique entries rescaled by its shared/unique ratio over the tensor (RAM+).

    RAM+ with tensor-local counts (Yuan et al. 2026, arXiv 2601.13572). Params: `r` (0.1), `alpha` (0.2),
    `epsilon` (1e-5)."""

    float32_result = True
    params = (
        Field("r", 0.1, "Rescale strength of the unique entries.", number()),
        Field("alpha", 0.2, "Cap of the shared/unique ratio.", number(low=0)),
        _EPSILON,
    )

    def needs_sums(self, params) -> bool:
        return True

    def new_sums(self, n_models: int) -> list[list[int]]:
        return [[0, 0] for _ in range(n_models)]

    def accumulate(self, sums, v, weights, params, *, cdt=None, **kw):
        nonzero, counts = _contributions(v, float(self.resolve(params)["epsilon"]), cdt)
        for i in range(v.shape[0]):
            sums[i][0] += int((nonzero[i] & (counts > 1)).sum())
            sums[i][1] += int((nonzero[i] & (counts == 1)).sum())

    def scales(self, sums, params) -> list[float]:
        """λ_i in float32 (mergekit: integer counts over a float32-clamped divisor)."""
        p = self.resolve(params)
        shared = torch.tensor([s for s, _ in sums], dtype=torch.int64)
        unique = torch.tensor([u for _, u in sums], dtype=torch.int64).clamp(min=float(p["epsilon"]))
        rho = shared / unique
        return (1 + float(p["r"]) * rho.clamp(min=0, max=float(p["alpha"]))).tolist()

    def combine(self, v, weights, params, *, sums=None, cdt=None, **kw):
        return ram_combine(v, float(self.resolve(params)["epsilon"]), self.scales(sums, params), cdt)
