"""Task arithmetic: `base + λ Σ_i w_i τ_i` with task vectors `τ_i = x_i − base`.

Semantics follow mergekit 0.1.5 `merge_methods/generalized_task_arithmetic.py` with no sparsification and no
consensus (read, not copied): `normalize` (default false) divides by `Σ w_i` (left undivided when |Σ w_i| < 1e-8),
then the sum is scaled by `lambda` (default 1).
Paper: Ilharco et al. 2022, "Editing models with task arithmetic", arXiv 2212.04089.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from hf_stable._validation import boolean, number
from hf_stable.papers import PAPERS
from hf_stable.registry import Field

from .base import WEIGHT, GramMethod, merge_method


def task_arithmetic_coefficients(weights: torch.Tensor, lam: float = 1.0, normalize: bool = False) -> torch.Tensor:
    """`(N,)` → `(N,)` float64 coefficients of the task vectors: `λ w` (or `λ w / Σw`)."""
    w = torch.as_tensor(weights, dtype=torch.float64).reshape(-1)
    if normalize:
        total = float(w.sum())
        if abs(total) >= 1e-8:  # mergekit: divisor[|divisor| < 1e-8] = 1
            w = w / total
    return lam * w


@merge_method("task_arithmetic", PAPERS["task_arithmetic"])
class TaskArithmeticMethod(GramMethod):
    """base + λ Σ w_i (x_i − base).

    Task arithmetic (Ilharco et al. 2022, arXiv 2212.04089). Params: `weight`, `lambda` (1), `normalize` (false).
    """

    base = "task_vector"
    params = (
        WEIGHT,
        Field("lambda", 1.0, "Scale of the summed task vectors.", number()),
        Field("normalize", False, "Divide by the weight sum.", boolean()),
    )

    rounded = True

    def needs_gram(self, params: Mapping[str, Any]) -> bool:
        return False

    def coefficients(self, gram, weights, params):
        p = self.resolve(params)
        return task_arithmetic_coefficients(weights, float(p["lambda"]), bool(p["normalize"]))

    def rounded_combine(self, v, weights, params, cdt):
        """mergekit computes task arithmetic as its generalised task arithmetic without sparsification or consensus,
        in the recipe's dtype."""
        from .ties import gta_combine

        p = self.resolve(params)
        return gta_combine(v, weights, consensus=False, normalize=bool(p["normalize"]), lam=float(p["lambda"]),
                           cdt=cdt)  # fmt: skip
