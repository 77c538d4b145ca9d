"""The generalised task-arithmetic family: sparsify → (sign consensus) → weighted sum, and its magnitude methods.

Semantics follow mergekit 0.1.5 `merge_methods/generalized_task_arithmetic.py` (`GeneralizedTaskArithmeticMerge`,
`get_mask`) and `sparsify.py` (`magnitude`, `magnitude_outliers`, `rescaled_masked_tensor`), read, not copied:

1. sparsify each task vector `τ_i = x_i − base` (this module: by magnitude; `dare.py`: at random);
   with `rescale: true` the kept entries are scaled by `‖τ_i‖₁ / ‖kept τ_i‖₁` over the whole tensor (no rescale
   when either norm is below 1e-7);
2. weight: `w_i τ̃_i`;
3. with sign consensus ("sum"): majority sign = sign of `Σ_i w_i τ̃_i` (0 counts as +); keep the entries whose sign
   agrees (zeros never agree); the divisor is the weight sum of the agreeing models (1 where none agrees);
   without consensus: a plain sum, divided (when `normalize`) by `Σ w_i` (left undivided when |Σ w_i| < 1e-8);
4. `normalize` divides by the divisor, then `lambda` scales, and the base is added back by the engine.

The arithmetic is elementwise except for the whole-tensor statistics (magnitude thresholds, L1 norms), which the
engine gathers before the combine: any chunking gives bitwise the same output. Magnitude trimming keeps
`|τ| ≥ k-th largest |τ|` (`k = max(1, int(density · numel))`, mergekit 0.1.5); mergekit keeps exactly k entries
by argsort, which differs only where |τ| ties at the threshold.

Papers: TIES — Yadav et al. 2023, arXiv 2306.01708; Model Breadcrumbs — Davari & Belilovsky 2023, arXiv 2312.06795.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch

from hf_stable._validation import boolean, number
from hf_stable.papers import PAPERS
from hf_stable.registry import Field

from ..ties_ops import disjoint_add, disjoint_mean, elect, keep_at_least, keep_count
from ..ties_ops import previous_float as previous_float  # importable from here, as before the move
from ..ties_ops import trim as trim  # importable from here, as before the move
from .base import WEIGHT, ElementwiseMethod, _per_model, merge_method, round_


L1_EPS = 1e-7  # mergekit `rescaled_masked_tensor`: no rescale when either L1 norm is below this


def gta_combine(
    v: torch.Tensor | list[torch.Tensor],
    weights: torch.Tensor,
    *,
    divide: list[float] | None = None,
    multiply: list[float] | None = None,
    consensus: bool = True,
    normalize: bool = True,
    lam: float = 1.0,
    cdt: torch.dtype | None = None,
) -> torch.Tensor:
    """Generalised task arithmetic on one chunk of sparsified task vectors, elementwise (any chunking gives bitwise
    the same result).

    Args:
        v: `(N, n)` float32 task vectors (or N `(n,)` tensors), dropped entries already zero (`sparsify`).
        weights: `(N,)` per-model weights.
        divide: per model a divisor applied to the kept entries (DARE's 1/density rescale), or None.
        multiply: per model a factor applied to the kept entries (the L1 rescale), or None.
        consensus: TIES sign election + disjoint merge; otherwise a plain weighted sum.
        normalize: divide by the (agreeing) weight sum.
        lam: final scale λ.
        cdt: a 16-bit compute dtype: every intermediate is rounded to it where mergekit's is (its weights are a
            tensor of that dtype, its sums over the models accumulate in float32 and round once), or None.

    Returns:
        `(n,)` float32 merged task vector.
    """
    rows = [t.float() for t in v]
    n_models = len(rows)
    w = [float(x) for x in torch.as_tensor(weights).reshape(-1).tolist()]
    if len(w) != n_models:
        raise ValueError(f"weights has {len(w)} entries for {n_models} models.")
    if cdt is not None:  # mergekit's weights tensor has the task vectors' dtype
        w = torch.tensor(w, dtype=torch.float32).to(cdt).float().tolist()
    weighted = []
    for i, t in enumerate(rows):
        if divide is not None and divide[i] != 1.0:
            t = round_(t / divide[i], cdt)
        if multiply is not None and multiply[i] != 1.0:
            t = round_(t * multiply[i], cdt)
        weighted.append(round_(t * w[i], cdt) if w[i] != 1.0 else t)  # x · 1 = x exactly: no multiply
    # Explicit left-to-right sums (not .sum(dim=0)) keep the rounding independent of the chunk length.
    if consensus:
        total = weighted[0].clone()
        for t in weighted[1:]:
            total.add_(t)
        if cdt is not None:  # mergekit's sign is that of the rounded sum, and a sum rounded to −0 counts as +
            total = round_(total, cdt).add_(0.0)
        majority = elect(total)
        agreeing, divisor = torch.zeros_like(total), torch.zeros_like(total)
        for i, t in enumerate(weighted):
            disjoint_add(agreeing, divisor, t, majority, w[i])
        if cdt is not None:
            round_(agreeing, cdt), round_(divisor, cdt)
        mixed = disjoint_mean(agreeing, divisor, majority, w) if normalize else agreeing.mul_(majority)
    else:
        mixed = weighted[0].clone()
        for t in weighted[1:]:
            mixed.add_(t)
        round_(mixed, cdt)
        if normalize:
            total_w = sum(w) if cdt is None else float(torch.tensor(w).sum().to(cdt))
            if abs(total_w) >= 1e-8:
                mixed = mixed / total_w
    mixed = round_(mixed, cdt)
    if lam != 1.0:
        mixed = round_(mixed * lam, cdt)
    return mixed


def apply_ties(out: torch.Tensor, v: torch.Tensor, ties, offset: int) -> torch.Tensor:
    """Resolve threshold ties as mergekit's sort did: `ties` is `(boundary values, sorted flat indices kept among the
    entries whose |v| equals one)` from `mergekit_selection` (via the engine), or None. Entries of this chunk (flat
    index `offset + j`) at a boundary value are kept (`v`) iff listed, else set to +0."""
    if ties is None:
        return out
    bounds, kept = ties
    at = torch.isin(v.abs(), bounds).nonzero().reshape(-1)
    if at.numel():
        keep = torch.isin(at + offset, kept)
        out = out.clone() if out is v else out
        out[at] = torch.where(keep, v[at], torch.zeros((), dtype=v.dtype))
    return out


def l1_factors(sums: list[tuple[float, float]] | None, n_models: int, cdt: torch.dtype | None = None) -> list[float]:
    """`‖τ_i‖₁ / ‖kept τ_i‖₁` per model (1 where either norm is below `L1_EPS`); with a 16-bit `cdt`, both norms
    and their ratio rounded to it (mergekit's norms are tensors of the task vector's dtype)."""
    if sums is None:
        return [1.0] * n_models
    if cdt is not None:
        r = lambda x: float(torch.tensor(x, dtype=torch.float64).to(cdt))  # noqa: E731
        sums = [(r(before), r(after)) for before, after in sums]
        return [r(before / after) if before >= L1_EPS and after >= L1_EPS else 1.0 for before, after in sums]
    return [before / after if before >= L1_EPS and after >= L1_EPS else 1.0 for before, after in sums]


class GeneralizedTaskArithmetic(ElementwiseMethod):
    """Shared parameters, sums and combine of the sparsified task-arithmetic methods (mergekit GTA merges).

    Subclasses set `consensus` (sign election) and implement `sparsify` (per model the kept entries of a chunk).
    """

    consensus = True
    base = "task_vector"
    default_normalize = True
    default_rescale = False
    params = (
        WEIGHT,
        Field(
            "density", 1.0, "Fraction of each task vector kept.", number(low=0, high=1, low_open=True), per_model=True
        ),
        Field("lambda", 1.0, "Scale of the merged task vector.", number()),
        Field("normalize", True, "Divide by the (agreeing) weight sum.", boolean()),
        Field("rescale", False, "Rescale kept entries to the task vector's L1 norm (mergekit 0.1.5).", boolean()),
        Field("int8_mask", False, "mergekit's int8 sign mask (a memory option; no effect here).", boolean()),
    )

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # The defaults of `normalize`/`rescale` differ per method (mergekit's registry entries).
        defaults = {"normalize": cls.default_normalize, "rescale": cls.default_rescale}
        cls.params = tuple(replace(p, default=defaults[p.name]) if p.name in defaults else p for p in cls.params)

    def densities(self, params: Mapping[str, Any], n_models: int) -> tuple[float, ...] | None:
        d = _per_model(self.resolve(params)["density"], n_models, "density", self.name)
        return None if all(x >= 1 for x in d) else d

    def needs_sums(self, params: Mapping[str, Any]) -> bool:
        p = self.resolve(params)
        d = p["density"]
        sparse = any(x < 1 for x in (d if isinstance(d, (list, tuple)) else [d]))
        return bool(p["rescale"]) and p.get("rescale_norm", "l1") == "l1" and sparse

    def new_sums(self, n_models: int) -> list[list[float]]:
        return [[0.0, 0.0] for _ in range(n_models)]

    def sparsify(self, v, params, **kw) -> list[torch.Tensor | None]:
        """Per model the chunk's task vector with the dropped entries zeroed (None: the model keeps everything);
        `kw` are `combine`'s keywords."""
        raise NotImplementedError

    def accumulate(self, sums, v, weights, params, **kw):
        kept = self.sparsify(v, self.resolve(params), **kw)
        for i in range(v.shape[0]):
            whole = float(v[i].abs().sum(dtype=torch.float64))
            sums[i][0] += whole
            sums[i][1] += whole if kept[i] is None else float(kept[i].abs().sum(dtype=torch.float64))

    def combine(self, v, weights, params, *, sums=None, **kw):
        p = self.resolve(params)
        n_models = v.shape[0]
        sparse = self.sparsify(v, p, **kw)
        kept = [v[i] if k is None else k for i, k in enumerate(sparse)]
        divide = multiply = None
        if p["rescale"] and any(k is not None for k in sparse):
            if p.get("rescale_norm", "l1") == "inverse_density":
                divide = list(_per_model(p["density"], n_models, "density", self.name))
            else:
                if sums is None:
                    raise ValueError(f"{self.where}: rescale needs the whole-tensor L1 norms (sums=None)")
                multiply = l1_factors(sums, n_models, kw.get("cdt"))
        return gta_combine(
            kept,
            weights,
            divide=divide,
            multiply=multiply,
            consensus=self.consensus,
            normalize=bool(p["normalize"]),
            lam=float(p["lambda"]),
            cdt=kw.get("cdt"),
        )


class _MagnitudeMethod(GeneralizedTaskArithmetic):
    """Keep the `density` fraction of largest-|τ| entries per model (mergekit `sparsify.magnitude`)."""

    def ranks(self, params, n_models, numel):
        d = self.densities(params, n_models)
        return None if d is None else [(keep_count(x, numel),) for x in d]

    def sparsify(self, v, params, *, thresholds=None, ties=None, offset=0, **kw):
        if thresholds is None:
            return [None] * v.shape[0]
        thr = torch.as_tensor(thresholds, dtype=torch.float32).reshape(-1).tolist()
        ties = ties or [None] * v.shape[0]
        return [None if t <= 0 else apply_ties(keep_at_least(v[i], t), v[i], ties[i], offset)
                for i, t in enumerate(thr)]  # fmt: skip

    def mergekit_selection(self, w, i, params, thresholds):
        """mergekit's `sparsify.magnitude` keeps the first k of a descending argsort of |τ|; when |τ| ties at the
        threshold so that more than k entries reach it, those are its kept indices (else None: the rule is exact)."""
        d = _per_model(self.resolve(params)["density"], len(thresholds), "density", self.name)[i]
        t = float(thresholds[i].reshape(-1)[0])
        k = keep_count(d, w.numel())
        if d >= 1 or not t > 0 or int((w >= t).sum()) == k:
            return None
        return torch.argsort(w, descending=True)[:k]


@merge_method("ties", PAPERS["ties"])
class TiesMethod(_MagnitudeMethod):
    """Trim to density by magnitude, elect sign (sum), disjoint weighted mean of task vectors.

    TIES-merging (Yadav et al. 2023, arXiv 2306.01708).

    Params: `weight` and `density` (one per model), `lambda`, `normalize` (true), `rescale` (false; true scales the
    kept entries to the task vector's L1 norm), `int8_mask`.
    """



class _BreadcrumbsMethod(GeneralizedTaskArithmetic):
    """Drop the `gamma` fraction of largest-|τ| outliers and the smallest entries, keeping `density` of them
    (mergekit `sparsify.magnitude_outliers`): with `n_top = int(γ n)`, `k = int(d n)` and
    `n_bot = max(0, n − k − n_top)`, the entries of ascending |τ| rank `[n_bot, n_bot + k)` are kept."""

    default_normalize = False
    params = (
        *GeneralizedTaskArithmetic.params,
        Field("gamma", 0.01, "Fraction of largest-|τ| outliers removed.", number(low=0, high=1), per_model=True),
    )

    def ranks(self, params, n_models, numel):
        p = self.resolve(params)
        dens = _per_model(p["density"], n_models, "density", self.name)
        gammas = _per_model(p["gamma"], n_models, "gamma", self.name)
        if all(d >= 1 for d in dens):
            return None
        out = []
        for d, g in zip(dens, gammas, strict=True):
            if d >= 1:
                out.append((0, numel))  # keep all: no upper cut, lowest rank
                continue
            k, n_top = int(d * numel), int(g * numel)
            top_cut = numel - max(0, numel - k - n_top) - k  # largest entries dropped
            out.append((top_cut, top_cut + k))
        return out

    def sparsify(self, v, params, *, thresholds=None, ties=None, offset=0, **kw):
        if thresholds is None:
            return [None] * v.shape[0]
        thr = torch.as_tensor(thresholds, dtype=torch.float32).reshape(v.shape[0], 2).tolist()
        ties = ties or [None] * v.shape[0]
        out = []
        for i, (hi, lo) in enumerate(thr):
            low = keep_at_least(v[i], lo)
            kept = low - keep_at_least(low, hi) if math.isfinite(hi) else low  # x − x = +0 above hi
            out.append(apply_ties(kept, v[i], ties[i], offset))
        return out

    def mergekit_selection(self, w, i, params, thresholds):
        """mergekit's `sparsify.magnitude_outliers` keeps ascending sorted positions `[n_bot, n_bot + k)` of |τ|;
        when ties at either boundary make the threshold rule keep another count, those are its kept indices."""
        p = self.resolve(params)
        n = len(thresholds)
        d = _per_model(p["density"], n, "density", self.name)[i]
        g = _per_model(p["gamma"], n, "gamma", self.name)[i]
        if d >= 1:
            return None
        numel = w.numel()
        k, n_top = int(d * numel), int(g * numel)
        n_bot = max(0, numel - k - n_top)
        hi, lo = (float(x) for x in thresholds[i].reshape(-1)[:2])
        rule = (w >= lo) & (w < hi) if math.isfinite(hi) else (w >= lo)
        if int(rule.sum()) == k:
            return None
        return torch.sort(w, descending=False).indices[n_bot : n_bot + k]


@merge_method("breadcrumbs", PAPERS["breadcrumbs"])
class BreadcrumbsMethod(_BreadcrumbsMethod):
    """Drop the largest outliers (gamma) and the smallest entries (keep density), weighted sum.

    Model Breadcrumbs (Davari & Belilovsky 2023, arXiv 2312.06795): magnitude-outlier masks, no sign consensus.

    Params: `weight`, `density`, `gamma` (0.01; one per model), `lambda`, `normalize` (false), `rescale` (false).
    """

    consensus = False


@merge_method("breadcrumbs_ties", PAPERS["breadcrumbs"])
class BreadcrumbsTiesMethod(_BreadcrumbsMethod):
    """Model Breadcrumbs masks with TIES sign consensus.

    Davari & Belilovsky 2023 (arXiv 2312.06795) with TIES's sign election (Yadav et al. 2023, arXiv 2306.01708).
    """

    consensus = True
