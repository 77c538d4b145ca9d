"""SLERP of two models (Shoemake 1985, "Animating rotation with quaternion curves", SIGGRAPH).

Semantics follow mergekit `merge_methods/slerp.py::slerp` (read, not copied): the angle comes from the normalised
inputs, the coefficients are applied to the RAW inputs, and when `|cos Ω| > 0.9995` it falls back to linear
interpolation. mergekit interpolates from its `base_model` (t = 0) to the other model (t = 1): the engine orders
the two inputs so that input 0 is the base model of a mergekit recipe.
"""

from __future__ import annotations

from hf_stable.merging.gram import slerp_coefficients
from hf_stable.merging.methods.base import MERGE_METHODS, GramMethod


@MERGE_METHODS.register(
    "slerp",
    paper="Shoemake 1985, Animating rotation with quaternion curves (SIGGRAPH)",
    url="https://doi.org/10.1145/325165.325242",
    description="Spherical interpolation of two models at t (lerp when nearly colinear), mergekit semantics.",
)
class SlerpMethod(GramMethod):
    """SLERP of exactly two inputs (Shoemake 1985).

    Params: `t` (None → `w_1 / (w_0 + w_1)` from the per-model weights). Weights space only: as in mergekit, the
    base model is one of the two endpoints (t = 0), so there is no task-vector variant here.
    """

    default_name = "slerp"
    param_defaults = {"t": None}
    min_models = 2
    max_models = 2

    def _validate(self, params, n_models, has_base):
        if params["t"] is not None:
            self._check_number(self.name, "t", params["t"])

    def coefficients(self, gram, weights, params):
        t = self.resolve(params)["t"]
        if t is None:
            w = [float(x) for x in weights]
            if w[0] + w[1] == 0:
                raise ValueError("slerp without `t` needs weights with a non-zero sum.")
            t = w[1] / (w[0] + w[1])
        return slerp_coefficients(gram, float(t))
