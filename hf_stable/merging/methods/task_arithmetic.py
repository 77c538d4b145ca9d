"""Task arithmetic: `base + λ Σ_i w_i τ_i` with task vectors `τ_i = x_i − base`.

Semantics follow mergekit `merge_methods/generalized_task_arithmetic.py::GTATask.execute` with no sparsification
and no consensus (read, not copied): `normalize` (default false) divides by `Σ w_i` (left undivided when
|Σ w_i| < 1e-8), then the sum is scaled by `lambda` (default 1).
Paper: Ilharco et al. 2022, "Editing models with task arithmetic", arXiv 2212.04089.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from hf_stable.merging.methods.base import MERGE_METHODS, GramMethod


def task_arithmetic_coefficients(weights: torch.Tensor, lam: float = 1.0, normalize: bool = False) -> torch.Tensor:
    """`(N,)` → `(N,)` float64 coefficients of the task vectors: `λ w` (or `λ w / Σw`)."""
    w = torch.as_tensor(weights, dtype=torch.float64).reshape(-1)
    if normalize:
        total = float(w.sum())
        if abs(total) >= 1e-8:  # mergekit: divisor[|divisor| < 1e-8] = 1
            w = w / total
    return lam * w


@MERGE_METHODS.register(
    "task_arithmetic",
    paper="Ilharco et al. 2022, Editing models with task arithmetic (arXiv 2212.04089)",
    url="https://arxiv.org/abs/2212.04089",
    description="base + λ Σ w_i (x_i − base).",
)
class TaskArithmeticMethod(GramMethod):
    """Task arithmetic (Ilharco et al. 2022, arXiv 2212.04089). Params: `lambda` (1.0), `normalize` (false)."""

    default_name = "task_arithmetic"
    param_defaults = {"lambda": 1.0, "normalize": False}

    def space(self, params, has_base):
        return "task_vector"

    def _validate(self, params, n_models, has_base):
        self._check_number(self.name, "lambda", params["lambda"])
        self._check_bool(self.name, "normalize", params["normalize"])

    def needs_gram(self, params: Mapping[str, Any]) -> bool:
        return False

    def coefficients(self, gram, weights, params):
        p = self.resolve(params)
        return task_arithmetic_coefficients(weights, float(p["lambda"]), bool(p["normalize"]))
