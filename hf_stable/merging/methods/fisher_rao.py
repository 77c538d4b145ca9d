"""Fisher–Rao merging: weighted spherical Karcher mean per tensor with norm restoration, solved from the Gram;
and mergekit's Multi-SLERP, the normalised weighted mean of unit directions.

Paper: Wang, Ye, Yin 2026, Fisher–Rao merging (arXiv 2603.04972); its reference code is mergekit's `karcher`
method (`merge_methods/karcher.py`, read, not copied). hf_stable differs on purpose (docs/merging.md,
"Fisher–Rao"): per-model weights are honoured, the solve is fp64 from the Gram with `atan2`, the step is
backtracked, and `space: task_vector` merges task vectors.

Registered names: `fisher_rao` and its alias `karcher` (solver chosen by `solver`), the norm-restored Euclidean
baselines `nre` and `nre_unit`, and `multislerp` (mergekit 0.1.5 `merge_methods/multislerp.py` semantics: weights
normalised when `normalize_weights`, unit vectors `x / (‖x‖ + eps)`, task vectors when a base is given).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from hf_stable._validation import boolean, choice, integer, number
from hf_stable.merging.gram import NORM_MODES, SOLVERS, karcher_coefficients, norms_from_gram
from hf_stable.papers import PAPERS
from hf_stable.registry import Field

from .base import SPACES, WEIGHT, GramMethod, merge_method


_SPACE = Field("space", "weights", "`weights` or `task_vector` (x_i − base).", choice(*SPACES))
_NORM = Field("norm", "weighted_mean", "Norm restored on the merged direction.", choice(*NORM_MODES))
_EPS = Field("eps", 1e-12, "Inputs with a smaller norm are dropped.", number(low=0))
_GRANULARITY = Field("granularity", "tensor", "One block per named tensor (the only one built).", choice("tensor"))


class FisherRaoMethod(GramMethod):
    """Weighted spherical Karcher mean per tensor + norm restoration, from the Gram matrix (fp64).

    Fisher–Rao / Karcher merge (Wang, Ye, Yin 2026, arXiv 2603.04972). Params: `weight` (≥ 0), `space`, `solver`
    (`karcher` | `nre` | `nre_unit`), `norm`, `max_iter` (50), `tol` (1e-7 rad), `step` (1.0), `eps` (1e-12: inputs
    with a smaller norm are dropped), `granularity` (`tensor`).
    """

    base = "by_space"
    fixed_solver: str | None = None
    params = (
        WEIGHT,
        _SPACE,
        Field("solver", "karcher", "Karcher iteration or a norm-restored Euclidean baseline.", choice(*SOLVERS)),
        _NORM,
        Field("max_iter", 50, "Iteration cap of the Karcher solver.", integer(low=0)),
        Field("tol", 1e-7, "Stop when the Riemannian gradient norm is below this (radians).", number(low=0)),
        Field("step", 1.0, "Initial step η of the exponential map.", number(low=0, high=1, low_open=True)),
        _EPS,
        _GRANULARITY,
    )

    def coefficients(self, gram, weights, params):
        p = self.resolve(params)
        return karcher_coefficients(
            gram,
            weights,
            solver=self.fixed_solver or p["solver"],
            norm=p["norm"],
            max_iter=int(p["max_iter"]),
            tol=float(p["tol"]),
            step=float(p["step"]),
            eps=float(p["eps"]),
        )


class _NREMethod(FisherRaoMethod):
    params = (WEIGHT, _SPACE, _NORM, _EPS, _GRANULARITY)

    def coefficients(self, gram, weights, params):
        p = self.resolve(params)
        return karcher_coefficients(gram, weights, solver=self.fixed_solver, norm=p["norm"], eps=float(p["eps"]))


class NREMethod(_NREMethod):
    """Norm-restored Euclidean: weighted average rescaled to the weighted mean norm.

    `s · Σα x / ‖Σα x‖`, the baseline of Wang, Ye, Yin 2026 (arXiv 2603.04972).
    """

    fixed_solver = "nre"


class NREUnitMethod(_NREMethod):
    """Normalised weighted mean of unit directions rescaled.

    `s` times the normalised mean of the unit directions (the Karcher initialisation).
    """

    fixed_solver = "nre_unit"


def multislerp_coefficients(
    gram: torch.Tensor, weights: torch.Tensor, *, normalize_weights: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """`(N,)` float64 coefficients of mergekit's Multi-SLERP from the `(N, N)` Gram of the inputs.

    `u_i = x_i / (r_i + eps)`, `m = Σ w_i u_i`, output `(Σ w_i r_i) · m / ‖m‖` (the tangent-space step of
    mergekit's code is zero: the weighted tangent mean at the normalised mean vanishes identically). When `‖m‖ <
    eps`: two inputs fall back to `w_0 x_0 + w_1 x_1`, more raise `ValueError` (as mergekit).
    """
    g = torch.as_tensor(gram, dtype=torch.float64)
    n = g.shape[0]
    w = torch.as_tensor(weights, dtype=torch.float64).reshape(-1)
    if n == 1:
        return torch.ones(1, dtype=torch.float64)
    if normalize_weights:
        w = w / w.sum()
    r = norms_from_gram(g)
    a = w / (r + eps)  # m = Σ a_i x_i
    m_norm = torch.sqrt((a @ g @ a).clamp_min(0.0))
    if m_norm < eps:
        if n == 2:
            return w.clone()
        raise ValueError(
            "multislerp: the weighted sum of the unit inputs is zero (antipodal inputs with balancing weights); "
            "use different weights."
        )
    return (w * r).sum() * a / m_norm


def multislerp_mergekit(
    xs: list[torch.Tensor], base: torch.Tensor | None, weights, *, normalize_weights: bool, eps: float
) -> torch.Tensor:
    """mergekit 0.1.5's Multi-SLERP arithmetic (`merge_methods/multislerp.py`, followed step by step, not copied) in
    the inputs' dtype: the weights, norms, unit vectors, tangent step and norm restoration are all in that dtype.

    Args:
        xs: N tensors of one shape and dtype; `base`: the origin (task vectors) or None; `weights`: N floats.

    Returns:
        The merged tensor (shape and dtype of `xs[0]`).
    """
    if len(xs) == 1:
        return xs[0]
    v = torch.stack(xs)
    if base is not None:
        v = v - base
    flat = v.view(len(xs), -1)
    w = torch.tensor(list(weights), dtype=v.dtype)
    if normalize_weights:
        w = w / w.sum()
    r = torch.norm(flat, dim=-1, keepdim=True)
    units = flat / (r + eps)
    mean = (units * w.view(-1, 1)).sum(0)
    mean_norm = torch.norm(mean)
    if mean_norm < eps:
        if len(xs) != 2:
            raise ValueError(
                "multislerp: the weighted sum of the unit inputs is zero (antipodal inputs with balancing weights); "
                "use different weights."
            )
        out = (v[0] * w[0] + v[1] * w[1]).view(v.shape[1:])  # two inputs: their weighted sum
    else:
        mean = mean / mean_norm
        tangents = units - (units * mean).sum(-1, keepdim=True) * mean
        step = (tangents * w.view(-1, 1)).sum(0)
        length = torch.norm(step) + eps
        out = mean * torch.cos(length) + step * (torch.sin(length) / length)
        out = (out * (r.squeeze(-1) * w).sum()).view(v.shape[1:])
    return out if base is None else out + base


@merge_method(
    "multislerp",
    "Goddard 2025, Multi-SLERP (blog post; no paper)",
    url="https://goddard.blog/posts/multislerp-wow-what-a-cool-idea",
)
class MultiSlerpMethod(GramMethod):
    """Normalised weighted mean of unit directions times the weighted mean norm (mergekit multislerp).

    mergekit's Multi-SLERP. Params: `weight`, `normalize_weights` (true), `eps` (1e-8). Task vectors when a base
    model is given."""

    base = "optional"
    params = (
        WEIGHT,
        Field("normalize_weights", True, "Normalise the weights to sum to 1.", boolean()),
        Field("eps", 1e-8, "Added to the norms before normalising.", number(low=0)),
    )

    def coefficients(self, gram, weights, params):
        p = self.resolve(params)
        return multislerp_coefficients(gram, weights, normalize_weights=bool(p["normalize_weights"]), eps=p["eps"])

    def mergekit_direct(self, params) -> bool:
        return True

    def mergekit_merge(self, xs, base, weights, params):
        p = self.resolve(params)
        w = weights if weights is not None else [1.0] * len(xs)
        return multislerp_mergekit(xs, base, w, normalize_weights=bool(p["normalize_weights"]), eps=float(p["eps"]))


def karcher_mergekit(xs: list[torch.Tensor], *, max_iter: int, tol: float) -> torch.Tensor:
    """mergekit 0.1.5's `karcher` arithmetic (`merge_methods/karcher.py::karcher_merge_tensors` with α = 1/N, followed
    step by step, not copied): norms in float32 (float64 for float64 inputs), the unit vectors, the mean and the
    tangent steps in the inputs' dtype, the stopping tests on those values.

    Args:
        xs: N tensors of one shape and dtype. `max_iter`, `tol`: mergekit's iteration cap and tolerance.

    Returns:
        `(Σ α_i ‖x_i‖) · mean direction`, shape and dtype of `xs[0]`.
    """
    if len(xs) == 1:
        return xs[0]
    wide = torch.float64 if xs[0].dtype == torch.float64 else torch.float32
    alphas = [1.0 / len(xs)] * len(xs)
    norms = [torch.linalg.vector_norm(x.to(wide)) for x in xs]
    units = [torch.zeros_like(x) if r.item() == 0.0 else (x / r).to(x.dtype) for x, r in zip(xs, norms, strict=True)]
    keep = [i for i, r in enumerate(norms) if r.item() > tol]
    if not keep:
        return sum(x * 0 for x in xs)
    total = sum(alphas[i] for i in keep)
    pairs = [(alphas[i] / total, units[i]) for i in keep]
    mean = torch.zeros_like(pairs[0][1])
    for a, u in pairs:
        mean += a * u
    r = torch.linalg.vector_norm(mean.to(wide))
    mean = pairs[0][1].clone() if r.item() < tol else (mean / r).to(mean.dtype)
    for _ in range(max_iter):
        step = torch.zeros_like(mean)
        for a, u in pairs:
            cos = torch.clamp(torch.dot(mean.flatten(), u.flatten()), -1.0, 1.0)
            angle = torch.arccos(cos)
            if angle.item() < tol:
                continue
            step += a * (angle / torch.sin(angle)) * (u - cos * mean)
        length = torch.linalg.vector_norm(step.to(wide))
        if length.item() < tol:
            break
        mean = (torch.cos(length) * mean + torch.sin(length) * (step / length)).to(mean.dtype)
        r = torch.linalg.vector_norm(mean.to(wide))
        if r.item() > tol:
            mean = (mean / r).to(mean.dtype)
    return sum(a * r for a, r in zip(alphas, norms, strict=True)) * mean


class KarcherMethod(FisherRaoMethod):
    """fisher_rao under mergekit's name and iteration defaults (max_iter 10, tol 1e-5; uniform weights, as mergekit).

    mergekit's name for the Fisher–Rao merge, with mergekit 0.1.5 `karcher`'s iteration defaults (`max_iter` 10,
    `tol` 1e-5) and its uniform weights (a recipe's per-model weights are ignored with a warning, as mergekit
    ignores them), so a mergekit recipe gives mergekit's result; `fisher_rao` honours weights."""

    def coefficients(self, gram, weights, params):
        """mergekit 0.1.5 `karcher_merge_method`: α = 1/N for every input, whatever the recipe's weights."""
        return super().coefficients(gram, torch.ones_like(torch.as_tensor(weights, dtype=torch.float64)), params)

    def mergekit_direct(self, params) -> bool:
        """mergekit's own method: full weights, the Karcher solver, and the defaults of hf_stable's extra settings."""
        p = self.resolve(params)
        extras = {k: p[k] for k in ("space", "solver", "norm", "step", "eps")}
        return extras == {k: self.param(k).default for k in extras}

    def mergekit_merge(self, xs, base, weights, params):
        p = self.resolve(params)
        inputs = [*xs, base] if base is not None else xs  # mergekit's tensor group lists the base after the others
        return karcher_mergekit(inputs, max_iter=int(p["max_iter"]), tol=float(p["tol"]))

    def base_is_input(self, params) -> bool:
        """mergekit 0.1.5's `karcher` averages every entry of its tensor group, the base model's included: a base
        given with full weights (`space: weights`) is one more input of the mean, with weight 1."""
        return self.space(params, True) == "weights"

    ignores_weight = True  # mergekit 0.1.5's karcher averages uniformly: a weight is accepted, warned, unused
    params = tuple(
        replace(p, default={"max_iter": 10, "tol": 1e-5}.get(p.name, p.default))
        for p in FisherRaoMethod.params
        if p.name != "weight"
    )


# registered here, after multislerp, so the listing keeps its order
merge_method("fisher_rao", PAPERS["fisher_rao_merging"])(FisherRaoMethod)
merge_method("karcher", PAPERS["fisher_rao_merging"])(KarcherMethod)
merge_method("nre", PAPERS["fisher_rao_merging"])(NREMethod)
merge_method("nre_unit", PAPERS["fisher_rao_merging"])(NREUnitMethod)
