"""Spherical interpolation of two models: SLERP (mergekit `slerp`) and NuSLERP (mergekit `nuslerp`).

SLERP follows mergekit 0.1.5 `merge_methods/slerp.py::slerp` (read, not copied): the angle comes from the
normalised inputs, the coefficients are applied to the RAW inputs, and when `|cos Ω| > 0.9995` it falls back to
linear interpolation. The base model is the t = 0 end: the engine orders the two inputs so that input 0 is the
base of a mergekit recipe. `t` outside [0, 1] extrapolates and is refused unless `allow_extrapolation: true`.

NuSLERP follows mergekit 0.1.5 `merge_methods/nuslerp.py`: two models (plus an optional base, whose task vectors
are interpolated), `t = w_1 / (w_0 + w_1)` from the weights (0.5 when they cancel); with `nuslerp_flatten: true`
(the default) one angle per tensor, otherwise one per row (`nuslerp_row_wise: false`, the vectors along the last
dimension) or per column (`nuslerp_row_wise: true`); linear interpolation only for exactly colinear inputs
(`1 − cos² ≤ 1e-16`).

Paper: Shoemake 1985, "Animating rotation with quaternion curves" (SIGGRAPH); NuSLERP has no paper.
"""

from __future__ import annotations

import torch

from hf_stable._validation import boolean, number
from hf_stable.merging.gram import slerp_coefficients
from hf_stable.registry import Field

from .base import MERGEKIT_METHODS_URL, WEIGHT, ElementwiseMethod, GramMethod, merge_method, warn_ignored


def _t_from_weights(weights, *, cancel_tol: float | None = None) -> float:
    w = [float(x) for x in weights]
    total = w[0] + w[1]
    if cancel_tol is not None and abs(total) < cancel_tol:
        return 0.5
    if total == 0:
        raise ValueError("slerp without `t` needs weights with a non-zero sum.")
    return w[1] / total


@merge_method(
    "slerp",
    "Shoemake 1985, Animating rotation with quaternion curves (SIGGRAPH)",
    url="https://doi.org/10.1145/325165.325242",
)
class SlerpMethod(GramMethod):
    """Spherical interpolation of two models at t (lerp when nearly colinear), mergekit semantics.

    SLERP of exactly two inputs (Shoemake 1985).

    Params: `t` (None → `w_1 / (w_0 + w_1)` from the per-model weights), `allow_extrapolation` (false: `t` must lie
    in [0, 1]). The base model is one of the two endpoints (t = 0); there is no task-vector variant (see nuslerp).
    """

    base = "endpoint"
    params = (
        WEIGHT,
        Field("t", None, "Interpolation position from the base (0) to the other model (1).", number()),
        Field("allow_extrapolation", False, "Accept t outside [0, 1].", boolean()),
    )
    min_models = 2
    max_models = 2

    def _t(self, weights, p) -> float:
        return float(p["t"]) if p["t"] is not None else _t_from_weights(weights)

    def _validate(self, params, n_models, has_base):
        t = params["t"]
        if t is not None and not params["allow_extrapolation"] and not 0.0 <= t <= 1.0:
            raise ValueError(
                f"{self.where}: `t`={t} lies outside [0, 1] and would extrapolate beyond the two models; set "
                "allow_extrapolation: true to do that on purpose."
            )

    def validate_weights(self, weights, params) -> None:
        p = self.resolve(params)
        if weights is None:
            return
        if p["t"] is not None:  # mergekit 0.1.5 accepts both and interpolates at t
            warn_ignored(f"{self.where}: `weight` has no effect when `t` is given (t wins, as in mergekit 0.1.5)")
            return
        t = self._t(weights, p)
        if not p["allow_extrapolation"] and not 0.0 <= t <= 1.0:
            raise ValueError(
                f"{self.where}: the weights {list(weights)} give t = {t:g}, outside [0, 1]; set "
                "allow_extrapolation: true to extrapolate."
            )

    def coefficients(self, gram, weights, params):
        return slerp_coefficients(gram, self._t(weights, self.resolve(params)))

    def mergekit_direct(self, params) -> bool:
        return True

    def mergekit_merge(self, xs, base, weights, params):
        v0, v1 = (base, xs[0]) if base is not None else xs
        t = self._t(weights if weights is not None else [1.0, 1.0], self.resolve(params))
        return slerp_mergekit(t, v0, v1)


# mergekit 0.1.5 `slerp` computes its float32 norms and dots over column blocks of this many elements
_MERGEKIT_BLOCK = 1024 * 1024


def slerp_mergekit(t: float, v0: torch.Tensor, v1: torch.Tensor, *, dot_threshold: float = 0.9995) -> torch.Tensor:
    """mergekit 0.1.5's SLERP arithmetic (`merge_methods/slerp.py::slerp` for one tensor, followed step by step, not
    copied): float32 (float64 for float64 inputs) norms and dot accumulated over column blocks, the inputs divided by
    their norms before the dot, the coefficients applied to the raw inputs, the result in the inputs' dtype.

    Args:
        t: position from `v0` (0) to `v1` (1). `v0`, `v1`: one shape and dtype.

    Returns:
        The interpolated tensor, shape and dtype of `v0`.
    """
    wide = torch.float64 if v0.dtype == torch.float64 else torch.float32
    a, b = v0.reshape(1, -1), v1.reshape(1, -1)
    tt = torch.tensor([t], dtype=wide).reshape(-1, 1)
    if not a.shape[1]:
        return ((1 - tt) * a + tt * b).reshape(v0.shape).to(v0.dtype)
    blocks = [slice(s, s + _MERGEKIT_BLOCK) for s in range(0, a.shape[1], _MERGEKIT_BLOCK)]

    def norm(x):  # the norm of the blocks' norms
        parts = [torch.linalg.vector_norm(x[:, k].to(wide), dim=1, keepdim=True) for k in blocks]
        r = torch.linalg.vector_norm(torch.stack(parts), dim=0)
        return torch.where(r > 1e-8, r, 1)

    ra, rb = norm(a), norm(b)
    # in place where mergekit makes a temporary: the same operations on the same operands, fewer passes
    cos = torch.stack([(a[:, k].to(wide) / ra).mul_(b[:, k].to(wide) / rb).sum(dim=1, keepdim=True) for k in blocks])
    cos = cos.sum(dim=0).clamp(-1, 1)
    straight = cos.abs() > dot_threshold
    angle = torch.acos(torch.where(straight, 0, cos))
    sin = torch.sin(angle)
    ca = torch.where(straight, 1 - tt, torch.sin((1 - tt) * angle) / sin)
    cb = torch.where(straight, tt, torch.sin(tt * angle) / sin)
    out = torch.empty_like(a)
    for k in blocks:
        if out.dtype == wide:
            torch.mul(ca, a[:, k], out=out[:, k]).add_(cb * b[:, k])
        else:
            out[:, k] = ca * a[:, k].to(wide) + cb * b[:, k].to(wide)
    return out.reshape(v0.shape)


def nuslerp_coefficients(gram: torch.Tensor, t: float) -> torch.Tensor:
    """`(..., 2)` float64 NuSLERP coefficients of the RAW vectors from `(..., 2, 2)` Gram matrices.

    `cos = G01 / (max(r0, 1e-7) max(r1, 1e-7))` clipped to [-1, 1] (mergekit `_normalize` clamps norms at 1e-7);
    colinear (`1 − cos² ≤ 1e-16`) → `(1 − t, t)`, else `(sin((1 − t)θ), sin(tθ)) / sin θ`.
    """
    g = torch.as_tensor(gram, dtype=torch.float64)
    r0 = g[..., 0, 0].clamp_min(0).sqrt().clamp_min(1e-7)
    r1 = g[..., 1, 1].clamp_min(0).sqrt().clamp_min(1e-7)
    cos = (g[..., 0, 1] / (r0 * r1)).clamp(-1.0, 1.0)
    colinear = (1 - cos * cos) <= 1e-16
    theta = torch.acos(torch.where(colinear, torch.zeros_like(cos), cos))
    sin = torch.sin(theta)
    safe = torch.where(colinear, torch.ones_like(sin), sin)
    c0 = torch.where(colinear, torch.full_like(cos, 1 - t), torch.sin((1 - t) * theta) / safe)
    c1 = torch.where(colinear, torch.full_like(cos, t), torch.sin(t * theta) / safe)
    return torch.stack([c0, c1], dim=-1)


def nuslerp_mergekit(t: float, v0: torch.Tensor, v1: torch.Tensor, *, flatten: bool, columns: bool) -> torch.Tensor:
    """mergekit 0.1.5's NuSLERP arithmetic (`merge_methods/nuslerp.py::nuslerp`, followed operation by operation, not
    copied), in the inputs' dtype: every intermediate is rounded to it as mergekit's are.

    Args:
        t: interpolation position.
        v0, v1: same shape and dtype; one angle over the whole tensor (`flatten`), else per vector along the last
            dimension, or along the first one (`columns`).

    Returns:
        The interpolated tensor, shape and dtype of `v0`.
    """
    shape = v0.shape
    if flatten:
        v0, v1 = v0.reshape(-1), v1.reshape(-1)
    elif columns:
        v0, v1 = v0.transpose(0, -1), v1.transpose(0, -1)
    u0 = v0 / torch.norm(v0, dim=-1, keepdim=True).clamp(min=1e-7)
    u1 = v1 / torch.norm(v1, dim=-1, keepdim=True).clamp(min=1e-7)
    cos = torch.sum(u0 * u1, dim=-1, keepdim=True).clamp(-1, 1)
    straight = (1 - cos.square()) <= 1e-16  # mergekit: eps² with eps = 1e-8
    angle = torch.acos(torch.where(straight, 0, cos))
    curved = (torch.sin((1 - t) * angle) * v0 + torch.sin(t * angle) * v1) / torch.sin(angle)
    out = torch.where(straight, (1 - t) * v0 + t * v1, curved)
    if columns and not flatten:
        out = out.transpose(0, -1)
    return out.reshape(shape)


@merge_method("nuslerp", "NuSLERP (mergekit; no paper)", url=MERGEKIT_METHODS_URL)
class NuSlerpMethod(ElementwiseMethod, GramMethod):
    """SLERP of two models (or their task vectors) with t from the weights; per tensor, row or column.

    NuSLERP (mergekit): `t = w_1/(w_0 + w_1)`; task vectors when a base is given.

    Params: `weight` (one per model), `nuslerp_flatten` (true: one angle per tensor), `nuslerp_row_wise` (false:
    per row; true: per column; only without flattening).
    """

    kind = "elementwise"
    base = "optional"
    min_models = 2
    max_models = 2
    params = (
        WEIGHT,
        Field("nuslerp_flatten", True, "One angle per tensor (else per row or column).", boolean()),
        Field("nuslerp_row_wise", False, "Without flattening: one angle per column instead of per row.", boolean()),
    )

    def kind_for(self, params) -> str:
        return "gram" if self.resolve(params)["nuslerp_flatten"] else "elementwise"

    def _validate(self, params, n_models, has_base):
        if params["nuslerp_flatten"] and params["nuslerp_row_wise"]:  # mergekit 0.1.5: flattening wins
            warn_ignored(
                f"{self.where}: `nuslerp_row_wise` has no effect with `nuslerp_flatten`: true (one angle per tensor, "
                "as in mergekit 0.1.5)"
            )

    def row_local_for(self, params) -> bool:
        return not self.resolve(params)["nuslerp_flatten"]  # rows, or columns gathered row by row

    def needs_sums(self, params) -> bool:
        p = self.resolve(params)
        return not p["nuslerp_flatten"] and bool(p["nuslerp_row_wise"])

    def _t(self, weights) -> float:
        return _t_from_weights(weights, cancel_tol=1e-6)

    def mergekit_direct(self, params) -> bool:
        return True

    def mergekit_merge(self, xs, base, weights, params):
        """mergekit 0.1.5 `nuslerp_merge_method`: task vectors subtracted and the base added back in the dtype."""
        p = self.resolve(params)
        t = self._t(weights if weights is not None else [1.0, 1.0])
        kw = {"flatten": bool(p["nuslerp_flatten"]), "columns": bool(p["nuslerp_row_wise"])}
        if base is None:
            return nuslerp_mergekit(t, xs[0], xs[1], **kw)
        return base + nuslerp_mergekit(t, xs[0] - base, xs[1] - base, **kw)

    def coefficients(self, gram, weights, params):
        return nuslerp_coefficients(gram, self._t(weights))

    def new_sums(self, n_models):
        return {}

    def accumulate(self, sums, v, weights, params, *, row_len=None, shape=None, **kw):
        if shape is not None and len(shape) <= 1:  # a vector has one "column" direction: the whole vector
            row_len = 1
        cols = v.to(torch.float64).reshape(2, -1, row_len)  # (2, rows, columns)
        g = torch.einsum("irc,jrc->cij", cols, cols)  # (columns, 2, 2)
        sums["gram"] = g if "gram" not in sums else sums["gram"].add_(g)

    def combine(self, v, weights, params, *, thresholds=None, sums=None, row_len=None, shape=None, **kw):
        t = self._t(weights)
        n = v.shape[-1]
        if sums and shape is not None and len(shape) <= 1:
            row_len = 1
        rows = v.reshape(2, -1, row_len or n)
        if sums:  # per column: Gram over every row of the tensor
            c = nuslerp_coefficients(sums["gram"], t).to(torch.float32)  # (columns, 2)
            out = rows[0] * c[:, 0]
            out.add_(rows[1] * c[:, 1])
        else:  # per row
            r64 = rows.to(torch.float64)
            g = torch.einsum("irc,jrc->rij", r64, r64)
            c = nuslerp_coefficients(g, t).to(torch.float32)  # (rows, 2)
            out = rows[0] * c[:, :1]
            out.add_(rows[1] * c[:, 1:])
        return out.reshape(n)
