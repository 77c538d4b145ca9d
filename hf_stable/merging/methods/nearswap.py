"""NearSwap: take the other model's value where it is close to the base's, keep the base's where it is far.

Semantics follow mergekit 0.1.5 `merge_methods/nearswap.py` (read, not copied). With the base `a` (the first input)
and the other model `b`, per entry

    w = clamp(t / max(|a − b|, 1e-6), 0, 1),   out = w · b + (1 − w) · a

so entries that differ by at most `t` are taken from `b`, and larger differences fall back towards `a` as `t/|a − b|`.
In a 16-bit recipe every step is rounded to the recipe's dtype, as mergekit's tensors are (the 1e-6 floor too).

No paper (mergekit's reference: the QuartetAnemoi-70B-t0.0001 model card).
"""

from __future__ import annotations

import torch

from hf_stable._validation import number
from hf_stable.registry import Field

from .base import ElementwiseMethod, merge_method, round_


@merge_method(
    "nearswap", "NearSwap (mergekit; no paper)", url="https://huggingface.co/alchemonaut/QuartetAnemoi-70B-t0.0001"
)
class NearSwapMethod(ElementwiseMethod):
    """The other model's entries where they lie within t of the base's; towards the base elsewhere.

    NearSwap of a base (first input) and one other model. Params: `t` (required, ≥ 0).
    """

    ignores_weight = True  # mergekit 0.1.5 accepts a per-model weight here and ignores it
    base = "endpoint"
    min_models = 2
    max_models = 2
    params = (Field("t", None, "Distance below which the other model's entry is taken.", number(low=0)),)

    def _validate(self, params, n_models, has_base):
        if params["t"] is None:
            raise ValueError(f"{self.where} needs `t` (the distance below which the other model's entry is taken).")

    def combine(self, v, weights, params, *, cdt=None, **kw):
        t = float(self.resolve(params)["t"])
        a, b = v[0], v[1]
        floor = 1e-6 if cdt is None else float(torch.tensor(1e-6, dtype=torch.float64).to(cdt))
        gap = round_(a - b, cdt).abs_().clamp_(min=floor)
        # mergekit writes `t / tensor`, which torch evaluates as `reciprocal(tensor) * t` (two roundings)
        w = round_(round_(gap.reciprocal_(), cdt).mul_(t), cdt).clamp_(0, 1)
        return round_(round_(w * b, cdt) + round_(round_(1 - w, cdt) * a, cdt), cdt)
