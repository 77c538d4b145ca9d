"""Linear merge (weighted average of full weights) and passthrough (one model, optionally scaled).

Linear follows mergekit 0.1.5 `merge_methods/linear.py` (read, not copied): `Σ_i w_i x_i`, divided by `Σ_i w_i`
when `normalize` (default true). Passthrough follows `merge_methods/passthrough.py`: one input per output tensor
(the layer-range slices of a frankenmerge), multiplied by its `scale` when given.

Paper: Wortsman et al. 2022, "Model soups", arXiv 2203.05482.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from hf_stable._validation import boolean, number
from hf_stable.papers import PAPERS
from hf_stable.registry import Field

from .base import MERGEKIT_METHODS_URL, WEIGHT, GramMethod, _per_model, merge_method, round_


def linear_coefficients(weights: torch.Tensor, normalize: bool = True) -> torch.Tensor:
    """`(N,)` → `(N,)` float64: `w`, or `w / Σw` when `normalize`."""
    w = torch.as_tensor(weights, dtype=torch.float64).reshape(-1)
    if not normalize:
        return w.clone()
    total = float(w.sum())
    if total == 0.0:
        raise ValueError(f"linear merge with normalize=true needs weights with a non-zero sum, got {w.tolist()}.")
    return w / total


@merge_method("linear", PAPERS["model_soups"])
class LinearMethod(GramMethod):
    """Weighted average Σ w_i x_i (/ Σ w_i when normalize).

    Weighted average of the inputs (Wortsman et al. 2022, arXiv 2203.05482). Params: `weight`, `normalize`.
    """

    params = (WEIGHT, Field("normalize", True, "Divide by the weight sum.", boolean()))

    rounded = True
    rounded_float32 = True  # with weights not summing to 1, w / Σw rounds: 1 ulp off mergekit's Σ wᵢxᵢ / Σ w

    def needs_gram(self, params: Mapping[str, Any]) -> bool:
        return False

    def coefficients(self, gram, weights, params):
        return linear_coefficients(weights, bool(self.resolve(params)["normalize"]))

    def rounded_combine(self, v, weights, params, cdt):
        """mergekit's order in a 16-bit or float32 recipe: the inputs (rounded to `cdt`) summed as `Σ w_i x_i` in
        float32, input order, each step a fused multiply-add (mergekit's `addcmul_`; emulated in float64, where the
        product of a 16-bit or float32 input and a float32 weight is exact), then divided by the float32 `Σ w_i`;
        rounded to `cdt`."""
        w = torch.as_tensor(weights, dtype=torch.float32).reshape(-1)
        out = torch.zeros_like(v[0])
        for i, c in enumerate(w.tolist()):
            out.copy_(out.double().add_(v[i].double().mul_(c)))
        if self.resolve(params)["normalize"]:
            total = w.sum()
            if float(total) == 0.0:
                linear_coefficients(w, True)  # raises, naming the weights
            out.div_(total)
        return round_(out, cdt)


@merge_method("passthrough", "Passthrough (mergekit; no paper)", url=MERGEKIT_METHODS_URL)
class PassthroughMethod(GramMethod):
    """Copy one model's tensors (layer-range slices build frankenmerges), times an optional scale.

    One input per output tensor, copied (times `scale` when given). Params: `scale` (one per model, unset).
    """

    max_models = 1
    params = (Field("scale", None, "Multiply the tensor by this factor.", number(), per_model=True),)

    def needs_gram(self, params: Mapping[str, Any]) -> bool:
        return False

    def coefficients(self, gram, weights, params):
        scale = self.resolve(params)["scale"]
        s = 1.0 if scale is None else _per_model(scale, 1, "scale", self.name)[0]
        return torch.tensor([1.0 if s is None else float(s)], dtype=torch.float64)
