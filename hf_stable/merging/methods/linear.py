"""Linear merge (weighted average of full weights).

Semantics follow mergekit `merge_methods/linear.py::LinearMergeTask.execute` (read, not copied):
`Σ_i w_i x_i`, divided by `Σ_i w_i` when `normalize` (default true).
Paper: Wortsman et al. 2022, "Model soups", arXiv 2203.05482.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from hf_stable.merging.methods.base import MERGE_METHODS, GramMethod


def linear_coefficients(weights: torch.Tensor, normalize: bool = True) -> torch.Tensor:
    """`(N,)` → `(N,)` float64: `w`, or `w / Σw` when `normalize`."""
    w = torch.as_tensor(weights, dtype=torch.float64).reshape(-1)
    if not normalize:
        return w.clone()
    total = float(w.sum())
    if total == 0.0:
        raise ValueError(f"linear merge with normalize=true needs weights with a non-zero sum, got {w.tolist()}.")
    return w / total


@MERGE_METHODS.register(
    "linear",
    paper="Wortsman et al. 2022, Model soups (arXiv 2203.05482)",
    url="https://arxiv.org/abs/2203.05482",
    description="Weighted average Σ w_i x_i (/ Σ w_i when normalize).",
)
class LinearMethod(GramMethod):
    """Weighted average of the inputs (Wortsman et al. 2022, arXiv 2203.05482). Params: `normalize` (true)."""

    default_name = "linear"
    param_defaults = {"normalize": True}

    def _validate(self, params, n_models, has_base):
        self._check_bool(self.name, "normalize", params["normalize"])

    def needs_gram(self, params: Mapping[str, Any]) -> bool:
        return False

    def coefficients(self, gram, weights, params):
        return linear_coefficients(weights, bool(self.resolve(params)["normalize"]))
