"""TIES-merging and the shared sparsify → sign-consensus → disjoint-mean combine of the task-arithmetic family.

Semantics follow mergekit `merge_methods/generalized_task_arithmetic.py` (`GTATask.execute`, `get_mask`) and
`sparsify.py::magnitude` (read, not copied), and agree with PEFT `utils/merge_utils.py::ties` when all weights are
1 (PEFT elects the sign on unweighted deltas and divides by the count of agreeing models):

1. trim: each task vector keeps its `density` fraction of largest-magnitude entries (`|τ_i| ≥ thr_i`, where
   `thr_i` is the k-th largest |τ_i| over the whole tensor, `k = int(density_i · numel)`);
2. elect: majority sign = sign of `Σ_i w_i τ̃_i` ("sum" consensus; 0 counts as +);
3. disjoint merge: `Σ_i w_i τ̃_i [sign(w_i τ̃_i) = majority]`, divided (when `normalize`, default true) by
   `Σ_i w_i [agree_i]` (1 where nothing agrees), then scaled by `lambda`.

Paper: Yadav et al. 2023, "TIES-Merging: Resolving interference when merging models", arXiv 2306.01708.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from hf_stable.merging.methods.base import MERGE_METHODS, ElementwiseMethod, _per_model


def gta_combine(
    v: torch.Tensor,
    weights: torch.Tensor,
    *,
    keep: list[torch.Tensor | None] | None = None,
    rescale: list[float] | None = None,
    consensus: bool = True,
    normalize: bool = True,
    lam: float = 1.0,
) -> torch.Tensor:
    """Generalised task arithmetic on one tile, elementwise (any tiling gives bitwise the same result).

    Args:
        v: `(N, n)` float32 task vectors.
        weights: `(N,)` per-model weights.
        keep: per model a `(n,)` bool mask of kept entries (None = keep all).
        rescale: per model a divisor applied to kept entries (DARE: the keep probability), or None.
        consensus: TIES sign election + disjoint merge; otherwise a plain weighted sum.
        normalize: divide by the (agreeing) weight sum.
        lam: final scale λ.

    Returns:
        `(n,)` float32 merged task vector.
    """
    v = v.float()
    n_models = v.shape[0]
    w = [float(x) for x in torch.as_tensor(weights).reshape(-1).tolist()]
    if len(w) != n_models:
        raise ValueError(f"weights has {len(w)} entries for {n_models} models.")
    weighted = []
    for i in range(n_models):
        t = v[i]
        if keep is not None and keep[i] is not None:
            t = torch.where(keep[i], t, torch.zeros((), dtype=t.dtype))
        if rescale is not None and rescale[i] != 1.0:
            t = t / rescale[i]
        weighted.append(t * w[i])
    # Explicit left-to-right sums (not .sum(dim=0)) keep the rounding independent of the tile length.
    if consensus:
        total = weighted[0].clone()
        for t in weighted[1:]:
            total.add_(t)
        majority = torch.where(total >= 0, 1.0, -1.0)
        mixed = torch.zeros_like(total)
        divisor = torch.zeros_like(total)
        for i, t in enumerate(weighted):
            agree = torch.sign(t) == majority
            mixed.add_(torch.where(agree, t, torch.zeros((), dtype=t.dtype)))
            divisor.add_(agree.to(torch.float32) * w[i])
        if normalize:
            divisor = torch.where(divisor == 0, torch.ones((), dtype=divisor.dtype), divisor)
            mixed = mixed / divisor
    else:
        mixed = weighted[0].clone()
        for t in weighted[1:]:
            mixed.add_(t)
        if normalize:
            total_w = sum(w)
            if abs(total_w) >= 1e-8:
                mixed = mixed / total_w
    if lam != 1.0:
        mixed = mixed * lam
    return mixed


def magnitude_keep(v: torch.Tensor, thresholds: torch.Tensor | None) -> list[torch.Tensor | None] | None:
    """Per-model `|v_i| ≥ thr_i` masks (`v (N, n)`, `thresholds (N,)`); None entries keep all."""
    if thresholds is None:
        return None
    thr = torch.as_tensor(thresholds, dtype=torch.float32).reshape(-1).tolist()
    return [None if t <= 0.0 else v[i].abs() >= t for i, t in enumerate(thr)]


class GeneralizedTaskArithmetic(ElementwiseMethod):
    """Shared parameters and validation of TIES/DARE (mergekit `GeneralizedTaskArithmeticMerge`)."""

    consensus = True
    param_defaults = {"density": 1.0, "lambda": 1.0, "normalize": True}

    def space(self, params, has_base):
        return "task_vector"

    def _validate(self, params, n_models, has_base):
        for d in _per_model(params["density"], n_models, "density", self.name):
            self._check_number(self.name, "density", d, low=0.0, high=1.0, low_open=True)
        self._check_number(self.name, "lambda", params["lambda"])
        self._check_bool(self.name, "normalize", params["normalize"])
        if "rescale" in params:
            self._check_bool(self.name, "rescale", params["rescale"])


@MERGE_METHODS.register(
    "ties",
    paper="Yadav et al. 2023, TIES-Merging (arXiv 2306.01708)",
    url="https://arxiv.org/abs/2306.01708",
    description="Trim to density by magnitude, elect sign (sum), disjoint weighted mean of task vectors.",
)
class TiesMethod(GeneralizedTaskArithmetic):
    """TIES-merging (Yadav et al. 2023, arXiv 2306.01708).

    Params: `density` (1.0; scalar or one per model), `lambda` (1.0), `normalize` (true). The engine supplies
    `thresholds[i]` = k-th largest |τ_i| over the whole tensor, `k = keep_count(density_i, numel)`.
    """

    default_name = "ties"
    param_defaults = {"density": 1.0, "lambda": 1.0, "normalize": True, "rescale": False}

    def _validate(self, params, n_models, has_base):
        super()._validate(params, n_models, has_base)
        if params["rescale"]:
            raise ValueError(
                "merge_method 'ties': parameter 'rescale' must be false (magnitude trimming is not rescaled)."
            )

    def density(self, params: Mapping[str, Any]):
        d = self.resolve(params)["density"]
        return tuple(float(x) for x in d) if isinstance(d, (list, tuple)) else float(d)

    def combine(self, v, weights, params, *, thresholds, tensor_name, offset, seed):
        p = self.resolve(params)
        return gta_combine(
            v,
            weights,
            keep=magnitude_keep(v, thresholds),
            consensus=True,
            normalize=bool(p["normalize"]),
            lam=float(p["lambda"]),
        )
