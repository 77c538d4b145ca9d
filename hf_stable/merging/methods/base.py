"""The merge-method interface shared by the streaming engine and the in-memory reference.

Two kinds of methods (spec `merging.md` §0):

* **gram** — the output is a linear combination `[base +] Σ_i c_i v_i` of the inputs `v_i` (full weights or task
  vectors, see `space`). The coefficients `c` depend only on the N×N fp64 Gram matrix `G[i,j] = <v_i, v_j>`
  (or on nothing at all) and on the per-model weights, so the engine can stream: one pass for the Gram, a tiny
  solve, one pass to combine (`apply_coefficients`).
* **elementwise** — each output element needs the N input values at that position (TIES, DARE) plus per-(model,
  tensor) statistics: magnitude thresholds computed by the engine over the WHOLE tensor. `combine` is a pure
  function of one tile and is identical for any tiling (DARE masks come from a counter-based RNG keyed on the
  flat element index, `hf_stable.merging.rng`).

Registry convention: `MERGE_METHODS.get(name).fn` is a zero-argument factory (the method class, or a partial of
it for aliases); `get_merge_method(name)` calls it and returns a `MergeMethod` instance.

Parameters: a method receives ONE resolved dict `params` (global parameters merged with `param_defaults`).
Per-model tensor parameters other than `weight` (only `density` today, as mergekit allows) are passed in that
dict as a list with one value per model; `gather_params(global_params, per_model_params)` builds that dict and the
weight vector from mergekit-style per-model dicts.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch

from hf_stable.registry import Registry


MERGE_METHODS = Registry(
    "merge_method",
    "Model-merging methods: gram kind (coefficients from the Gram matrix) or elementwise kind (TIES/DARE).",
)

SPACES = ("weights", "task_vector")

# Keys the config may carry next to a method's own parameters; `resolve` drops them. mergekit recipes use
# `int8_mask` (a memory option of its GTA methods, meaningless here); `filter_exclude` and `granularity` are read by
# the engine; a global `weight` travels as the weight vector, not in `params`.
PASSTHROUGH_PARAMS = frozenset({"int8_mask", "filter_exclude", "granularity", "weight"})

# Parameters that mergekit defines per model (`tensor_parameters`); `weight` travels as the weight vector.
PER_MODEL_PARAMS = ("weight", "density")


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


class MergeMethod:
    """Base class. Subclasses set `kind`, `param_defaults`, and implement the kind's methods.

    Attributes:
        name (`str`): registered name (aliases keep their own name, e.g. ``"karcher"``).
        kind (`str`): ``"gram"`` or ``"elementwise"``.
        param_defaults (`dict`): every parameter the method reads, with its default.
        choices (`dict[str, tuple]`): allowed values of categorical parameters (checked by `validate`).
    """

    kind: ClassVar[str] = ""
    default_name: ClassVar[str] = ""
    param_defaults: ClassVar[dict[str, Any]] = {}
    choices: ClassVar[dict[str, tuple]] = {}
    min_models: ClassVar[int] = 1
    max_models: ClassVar[int | None] = None

    def __init__(self, name: str | None = None):
        self.name = name or self.default_name

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, kind={self.kind!r})"

    # ------------------------------------------------------------------ parameters
    def resolve(self, params: Mapping[str, Any] | None) -> dict[str, Any]:
        """`param_defaults` updated with `params` (passthrough keys dropped)."""
        out = dict(self.param_defaults)
        for key, value in (params or {}).items():
            if key in PASSTHROUGH_PARAMS:
                continue
            out[key] = value
        return out

    def requires_base(self, params: Mapping[str, Any]) -> bool:
        """Whether a `base_model` is needed (true for task-vector space)."""
        return self.space(params, has_base=True) == "task_vector"

    def space(self, params: Mapping[str, Any], has_base: bool) -> str:
        """``"weights"`` (v_i = x_i) or ``"task_vector"`` (v_i = x_i − base; the engine adds base back)."""
        return "weights"

    def validate(self, params: Mapping[str, Any], n_models: int, has_base: bool) -> None:
        """Raise `ValueError` naming the offending parameter and its allowed values."""
        granularity = (params or {}).get("granularity", "tensor")
        if granularity != "tensor":  # spec §3.2: `global` and `row` are research options not built yet
            raise ValueError(
                f"merge_method {self.name!r}: granularity={granularity!r} is not supported; only 'tensor' (one block "
                "per named tensor) is implemented."
            )
        params = self.resolve(params)
        unknown = sorted(set(params) - set(self.param_defaults))
        if unknown:
            raise ValueError(
                f"merge_method {self.name!r}: unknown parameter(s) {unknown}. "
                f"Allowed: {sorted(self.param_defaults)} (plus {sorted(PASSTHROUGH_PARAMS)})."
            )
        for key, allowed in self.choices.items():
            if params.get(key) not in allowed:
                raise ValueError(
                    f"merge_method {self.name!r}: parameter {key!r}={params.get(key)!r}; allowed values: "
                    f"{', '.join(map(repr, allowed))}."
                )
        if n_models < self.min_models or (self.max_models is not None and n_models > self.max_models):
            want = (
                f"exactly {self.min_models}"
                if self.max_models == self.min_models
                else f"at least {self.min_models}" + (f" and at most {self.max_models}" if self.max_models else "")
            )
            raise ValueError(f"merge_method {self.name!r} needs {want} input models, got {n_models}.")
        if self.requires_base(params) and not has_base:
            raise ValueError(
                f"merge_method {self.name!r} works on task vectors (space='task_vector') and needs a base_model."
            )
        self._validate(params, n_models, has_base)

    def _validate(self, params: dict[str, Any], n_models: int, has_base: bool) -> None:
        """Method-specific checks on resolved params."""

    @staticmethod
    def _check_number(
        method: str, key: str, value: Any, *, low: float | None = None, high: float | None = None, low_open=False
    ):
        if not _is_number(value):
            raise ValueError(f"merge_method {method!r}: parameter {key!r} must be a number, got {value!r}.")
        if low is not None and (value <= low if low_open else value < low):
            raise ValueError(
                f"merge_method {method!r}: parameter {key!r}={value!r} must be {'>' if low_open else '>='} {low}."
            )
        if high is not None and value > high:
            raise ValueError(f"merge_method {method!r}: parameter {key!r}={value!r} must be <= {high}.")

    @staticmethod
    def _check_bool(method: str, key: str, value: Any):
        if not isinstance(value, bool):
            raise ValueError(f"merge_method {method!r}: parameter {key!r} must be true or false, got {value!r}.")


class GramMethod(MergeMethod):
    """Output `[base +] Σ_i c_i v_i` with `c = coefficients(gram, weights, params)`."""

    kind = "gram"

    def needs_gram(self, params: Mapping[str, Any]) -> bool:
        """False when `coefficients` ignores the Gram (linear, task arithmetic, WSM): the engine may pass None."""
        return True

    def coefficients(
        self, gram: torch.Tensor | None, weights: torch.Tensor, params: Mapping[str, Any]
    ) -> torch.Tensor:
        """Coefficients of the merge.

        Args:
            gram: `(N, N)` float64, `G[i,j] = <v_i, v_j>` over the whole tensor in `space`; None if not `needs_gram`.
            weights: `(N,)` float64 per-model `weight`.
            params: resolved parameters (`resolve`).

        Returns:
            `(N,)` float64 `c` such that the merged vector is `Σ_i c_i v_i`.
        """
        raise NotImplementedError


class ElementwiseMethod(MergeMethod):
    """Output `[base +] combine(v)` computed position by position (TIES/DARE family)."""

    kind = "elementwise"

    def density(self, params: Mapping[str, Any]) -> float | tuple[float, ...] | None:
        """Fraction kept by per-model MAGNITUDE trimming (None: no thresholds needed).

        A tuple when `density` is given per model. Prefer `densities(params, n_models)`.
        """
        return None

    def densities(self, params: Mapping[str, Any], n_models: int) -> tuple[float, ...] | None:
        """Per-model magnitude-trim densities (length `n_models`), or None when no thresholds are needed.

        The engine computes `thresholds[i] = kth_largest_abs(v_i over the whole tensor, keep_count(d_i, numel))`
        for each model i (None for the whole vector if every density is ≥ 1).
        """
        d = self.density(params)
        if d is None:
            return None
        d = _per_model(d, n_models, "density", self.name)
        if all(x >= 1 for x in d):
            return None
        return d

    def combine(
        self,
        v: torch.Tensor,
        weights: torch.Tensor,
        params: Mapping[str, Any],
        *,
        thresholds: torch.Tensor | None,
        tensor_name: str,
        offset: int,
        seed: int,
    ) -> torch.Tensor:
        """Merge one tile.

        Args:
            v: `(N, n)` float32, the inputs in `space` (a flat tile of the tensor).
            weights: `(N,)` float32 per-model weights.
            params: resolved parameters.
            thresholds: `(N,)` float32 k-th largest |v_i| over the whole tensor (keep |v| ≥ threshold), or None.
            tensor_name: name of the tensor (keys the DARE RNG).
            offset: flat element index of `v[:, 0]` within the tensor.
            seed: merge seed.

        Returns:
            `(n,)` float32 merged vector in `space` (the engine adds the base for task vectors).
        """
        raise NotImplementedError


def keep_count(density: float, numel: int) -> int:
    """Elements kept by magnitude trimming: `int(density · numel)`, as PEFT `magnitude_based_pruning` and mergekit
    `sparsify.magnitude` (`k = int(density * tensor.numel())`)."""
    return min(numel, int(density * numel))


def _per_model(value: Any, n_models: int, key: str, method: str) -> tuple[float, ...]:
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        if len(value) != n_models:
            raise ValueError(
                f"merge_method {method!r}: per-model parameter {key!r} has {len(value)} values for {n_models} models."
            )
        return tuple(_number(x, key, method) for x in value)
    return (_number(value, key, method),) * n_models


def _number(value: Any, key: str, method: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"merge_method {method!r}: parameter {key!r} must be a number, got {value!r}.")
    return float(value)


def per_model(params: Mapping[str, Any], key: str, n_models: int, method: str = "") -> tuple[float, ...]:
    """`params[key]` as one float per model (a scalar is broadcast)."""
    return _per_model(params[key], n_models, key, method)


def gather_params(
    global_params: Mapping[str, Any] | None, per_model_params: Sequence[Mapping[str, Any]]
) -> tuple[list[float] | None, dict[str, Any]]:
    """Split mergekit-style per-model parameter dicts into `(weights, params)`.

    `weight` becomes the weight list (None if no model sets it; a model without it gets 1.0). Any other
    per-model key (`density`) becomes a list in `params` (the global value, if any, fills models that omit it);
    a list whose values are all equal collapses to a scalar.
    """
    params = dict(global_params or {})
    n = len(per_model_params)
    weights = None
    if any("weight" in p for p in per_model_params):
        weights = [float(p.get("weight", 1.0)) for p in per_model_params]
    keys = {k for p in per_model_params for k in p} - {"weight"}
    for key in sorted(keys):
        fill = params.get(key)
        values = []
        for i, p in enumerate(per_model_params):
            if key in p:
                values.append(p[key])
            elif fill is not None:
                values.append(fill)
            else:
                raise ValueError(f"per-model parameter {key!r} is set for some models but not for model {i}.")
        params[key] = values[0] if all(v == values[0] for v in values) else values
    if n and "weight" in params and weights is None:
        weights = [float(params.pop("weight"))] * n
    params.pop("weight", None)
    return weights, params


def apply_coefficients(
    v: torch.Tensor, coefficients: torch.Tensor, base: torch.Tensor | None = None, *, inplace: bool = False
) -> torch.Tensor:
    """`[base +] Σ_i c_i v_i`, elementwise in float32 with a fixed summation order (bitwise tiling-invariant).

    Args:
        v: `(N, n)` float32 (any float dtype is upcast).
        coefficients: `(N,)` (float64 from `coefficients`; cast to float32 here).
        base: `(n,)` or None; added last.
        inplace: scale the rows of a float32 `v` in place and accumulate into `v[0]` (the engine's private tile
            buffer): no temporaries, and the same roundings as the out-of-place form, so the result is bitwise equal.

    Returns:
        `(n,)` float32.
    """
    # Separate multiply and add (never `add_(..., alpha=)`): a fused multiply-add in the vectorised body but not in
    # the scalar tail of a torch kernel would make an element's rounding depend on its position in the tile.
    inplace = inplace and v.dtype == torch.float32
    v = v.float()
    c = coefficients.to(torch.float32).tolist()
    out = v[0].mul_(c[0]) if inplace else v[0] * c[0]
    for i in range(1, len(c)):
        out.add_(v[i].mul_(c[i]) if inplace else v[i] * c[i])
    if base is not None:
        out.add_(base.float())
    return out


def get_merge_method(name: str | MergeMethod) -> MergeMethod:
    """A `MergeMethod` instance for `name` (raises `ValueError` listing valid names); instances pass through."""
    if isinstance(name, MergeMethod):
        return name
    return MERGE_METHODS.get(name).fn()
