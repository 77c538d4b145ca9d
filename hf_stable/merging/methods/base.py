"""The merge-method interface shared by the streaming engine and the in-memory reference.

Two kinds of methods (see `docs/merging.md`, "How the engine streams"):

* **gram** — the output is a linear combination `[base +] Σ_i c_i v_i` of the inputs `v_i` (full weights or task
  vectors, see `space`). The coefficients `c` depend only on the N×N fp64 Gram matrix `G[i,j] = <v_i, v_j>`
  (or on nothing at all) and on the per-model weights, so the engine streams: one pass for the Gram, a tiny
  solve, one pass to combine (`apply_coefficients`).
* **elementwise** — each output element needs the N input values at that position plus per-(model, tensor)
  statistics gathered over the WHOLE tensor before the combine: k-th largest scores (`ranks`, TIES and
  breadcrumbs thresholds) and method sums (`new_sums`/`accumulate`, e.g. the L1 norms of a rescale). `combine` is
  a pure function of one chunk and gives bitwise the same result for any chunking (random masks come from a
  counter-based RNG keyed on the flat element index, `hf_stable.merging.rng`). `row_local` methods (DELLA's ranks
  within a row, per-row SLERP, filter-wise model stock) see whole logical rows in every chunk.

A method is declared once, on its class (`@merge_method(name, paper)`): its parameters (`hf_stable.registry.Field`,
the declaration the trainer methods' config fields use: default, a validator from `hf_stable._validation`, one value
per model or not), what it does with a base model (`base`), how many inputs it takes, its paper (on the registration)
and, in the first paragraph of its docstring, what it does in one line.
Config, planner, engine, card and the parameter-effect test all read these declarations.

Registry convention: `MERGE_METHODS.get(name).fn` is a zero-argument factory (the method class, or a partial of
it for aliases); `get_merge_method(name)` calls it and returns a `MergeMethod` instance.
"""

from __future__ import annotations

import inspect
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import torch

from hf_stable._validation import Check, number
from hf_stable.merging.ties_ops import keep_count as keep_count  # defined below the plugins: FW-Merging shares it
from hf_stable.registry import Field, Registry


MERGE_METHODS = Registry(
    "merge_method",
    "Model-merging methods: gram kind (coefficients from the Gram matrix) or elementwise kind (TIES/DARE family).",
)

SPACES = ("weights", "task_vector")

# Where mergekit documents its methods: the reference of the methods that have no paper.
MERGEKIT_METHODS_URL = "https://github.com/arcee-ai/mergekit/blob/main/docs/merge_methods.md"

# What a method does with `base_model`:
#   "unused"       - weights-space method; the base is not an input (a base given in the recipe is not read);
#   "task_vector"  - needs a base; merges task vectors v_i = x_i − base and adds the base back;
#   "optional"     - task vectors when a base is given, full weights otherwise (multislerp, nuslerp);
#   "endpoint"     - the base is one of the inputs, the first one (slerp: its t = 0 end);
#   "by_space"     - chosen by the `space` parameter (fisher_rao family).
BASE_POLICIES = ("unused", "task_vector", "optional", "endpoint", "by_space")


def Param(name: str, default: Any, help: str, check: Check | None = None, per_model: bool = False) -> Field:
    """The earlier spelling of a merge parameter: a `hf_stable.registry.Field` with `per_model` (kept for plugins)."""
    return Field(name, default, help, check, per_model=per_model)


WEIGHT = Field("weight", 1.0, "Per-model weight.", number(), per_model=True)


class MergeMethod:
    """Base class. Subclasses set `kind`, `params`, `base`, the input counts, and implement the kind's methods.

    Attributes:
        name (`str`): registered name (aliases keep their own name, e.g. ``"karcher"``).
        kind (`str`): ``"gram"`` or ``"elementwise"``.
        params (`tuple[Field, ...]`): every parameter the method reads (`Field.per_model`: one value per input).
        base (`str`): one of `BASE_POLICIES`.
        min_models, max_models (`int`): inputs other than the base model.
    """

    kind: ClassVar[str] = ""
    default_name: ClassVar[str] = ""
    params: ClassVar[tuple[Field, ...]] = ()
    base: ClassVar[str] = "unused"
    min_models: ClassVar[int] = 1
    max_models: ClassVar[int | None] = None
    data_driven: ClassVar[bool] = False
    # mergekit 0.1.5 accepts a per-model `weight` on this method and ignores it (checked on its outputs): accepted
    # with a warning instead of refused.
    ignores_weight: ClassVar[bool] = False

    def mergekit_direct(self, params: Mapping[str, Any]) -> bool:
        """Whether `mergekit_merge` reproduces mergekit 0.1.5's arithmetic for these parameters (the engine then uses
        it on whole tensors, unless `fp32_arithmetic`); False: the streaming path is mergekit's to the last bit."""
        return False

    def mergekit_merge(
        self, xs: list[torch.Tensor], base: torch.Tensor | None, weights: list[float] | None, params: Mapping[str, Any]
    ) -> torch.Tensor:
        """One whole tensor merged with mergekit 0.1.5's own operations, in its order and in its dtypes.

        Args:
            xs: the inputs other than the base, each with the tensor's shape, in the compute dtype (the recipe's
                `dtype`: mergekit casts every input to it when it loads it).
            base: the base model's tensor when the recipe has one and the method reads it (task vectors: the method
                subtracts it and adds it back itself; `base_is_input`: the method's base end or one more input),
                same shape and dtype; else None.
            weights: per-model weights, or None.
            params: resolved parameters.

        Returns:
            The merged tensor with the inputs' shape, in the dtype mergekit's method returns (the engine rounds it
            once to the output dtype, as mergekit does when it writes).
        """
        raise NotImplementedError

    def __init__(self, name: str | None = None):
        self.name = name or self.default_name

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, kind={self.kind!r})"

    @property
    def where(self) -> str:
        return f"merge_method {self.name!r}"

    # ------------------------------------------------------------------ parameters
    @classmethod
    def param(cls, name: str) -> Field | None:
        return next((p for p in cls.params if p.name == name), None)

    @property
    def param_defaults(self) -> dict[str, Any]:
        return {p.name: p.default for p in self.params if p.name != "weight"}

    @property
    def per_model_params(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params if p.per_model)

    def resolve(self, params: Mapping[str, Any] | None) -> dict[str, Any]:
        """Defaults updated with `params` (`weight` travels as the weight vector, never in `params`)."""
        out = self.param_defaults
        for key, value in (params or {}).items():
            if key != "weight":
                p = self.param(key)
                out[key] = value if p is None else p.parse(value)
        return out

    def uses_weights(self) -> bool:
        return self.param("weight") is not None

    def kind_for(self, params: Mapping[str, Any]) -> str:
        """How the engine streams this method with these parameters: ``"gram"`` or ``"elementwise"``."""
        return self.kind

    def validate_weights(self, weights: Sequence[float] | None, params: Mapping[str, Any]) -> None:
        """Refuse per-model weights the method would not read (nothing is silently ignored)."""
        if weights is not None and not self.uses_weights():
            if self.ignores_weight:
                warn_ignored(f"{self.where}: a per-model `weight` has no effect (mergekit 0.1.5 ignores it too)")
                return
            raise ValueError(f"{self.where} does not take a per-model `weight`; remove it from the recipe.")

    def space(self, params: Mapping[str, Any], has_base: bool) -> str:
        """``"weights"`` (v_i = x_i) or ``"task_vector"`` (v_i = x_i − base; the engine adds base back)."""
        if self.base == "task_vector" or (self.base == "optional" and has_base):
            return "task_vector"
        if self.base == "by_space":
            return self.resolve(params).get("space", "weights")
        return "weights"

    def base_is_input(self, params: Mapping[str, Any]) -> bool:
        """Whether a given `base_model` is one of the inputs, the first (slerp's t = 0 end; mergekit's `karcher`)."""
        return self.base == "endpoint"

    def requires_base(self, params: Mapping[str, Any]) -> bool:
        """Whether a `base_model` is needed (task vectors). An endpoint method's first model is its base end when no
        base_model is given."""
        if self.base == "by_space":
            return self.resolve(params).get("space", "weights") == "task_vector"
        return self.base == "task_vector"

    def validate(self, params: Mapping[str, Any], n_models: int, has_base: bool) -> None:
        """Raise `ValueError`/`TypeError` naming the offending parameter and its allowed values.

        `n_models` counts the inputs other than the base (for `base = "endpoint"` methods, the base counts).
        """
        params = self.resolve(params)
        declared = {p.name for p in self.params}
        unknown = sorted(set(params) - declared)
        if unknown:
            raise ValueError(f"{self.where}: unknown parameter(s) {unknown}. Allowed: {sorted(declared)}.")
        for p in self.params:
            if p.name == "weight" or p.check is None or (params.get(p.name) is None and p.default is None):
                continue
            values = params[p.name]
            if p.per_model:
                values = _per_model(values, n_models, p.name, self.name)
            else:
                values = (values,)
            for value in values:
                try:
                    p.check(p.name, value, where=self.where)
                except TypeError as err:  # a recipe error is a bad value: `boolean`'s TypeError too
                    raise ValueError(str(err)) from None
        if n_models < self.min_models or (self.max_models is not None and n_models > self.max_models):
            want = (
                f"exactly {self.min_models}"
                if self.max_models == self.min_models
                else f"at least {self.min_models}" + (f" and at most {self.max_models}" if self.max_models else "")
            )
            raise ValueError(f"{self.where} needs {want} input models, got {n_models}.")
        if self.requires_base(params) and not has_base:
            raise ValueError(f"{self.where} works on task vectors (x_i − base) and needs a base_model.")
        self._validate(params, n_models, has_base)

    def _validate(self, params: dict[str, Any], n_models: int, has_base: bool) -> None:
        """Method-specific checks on resolved params (cross-parameter rules)."""


def merge_method(name: str, paper: Any, **registration: Any) -> Callable[[type[MergeMethod]], type[MergeMethod]]:
    """Class decorator declaring a merge method: registers the class in `MERGE_METHODS` under `name`, which becomes
    its `default_name`, with its paper; the first paragraph of its docstring is the one-line description (model
    card, docs). `registration`: further `Registry.register` keywords, e.g. `url` for a method without an arXiv paper.
    """

    def register(cls: type[MergeMethod]) -> type[MergeMethod]:
        if not cls.__doc__:  # its own (`__doc__` is not inherited): a parent's docstring describes another method
            raise TypeError(f"merge method {name!r} ({cls.__name__}) needs a docstring: its first line describes it.")
        summary = " ".join(inspect.cleandoc(cls.__doc__).split("\n\n", 1)[0].split())
        MERGE_METHODS.register(name, paper=paper, description=summary, **registration)(cls)
        cls.default_name = name
        return cls

    return register


def round_(x: torch.Tensor, cdt: torch.dtype | None) -> torch.Tensor:
    """`x` (float32) rounded in place to the compute dtype `cdt` and held in float32, or `x` unchanged (`cdt` None).

    On CPU a float16/bfloat16 torch operation computes in float32 and rounds its result once (`sum` over a dimension
    accumulates in float32 and rounds once), so a float32 operation followed by `round_` gives bitwise the value
    mergekit's operation in `cdt` gives; the methods call it where mergekit's tensors are in the recipe's dtype.
    """
    if cdt is not None:
        x.copy_(x.to(cdt))
    return x


def warn_ignored(message: str) -> None:
    """A recipe setting mergekit accepts and ignores: accepted as mergekit does, and said."""
    import warnings

    warnings.warn(message, UserWarning, stacklevel=3)


class GramMethod(MergeMethod):
    """Output `[base +] Σ_i c_i v_i` with `c = coefficients(gram, weights, params)`."""

    kind = "gram"
    # Whether `rounded_combine` replaces the coefficient combine when the arithmetic is in a 16-bit dtype.
    rounded: ClassVar[bool] = False
    # Whether it also replaces it in a float32 recipe (not under `fp32_arithmetic`): where mergekit's float32 order
    # rounds differently from the coefficient combine (linear: Σ wᵢxᵢ / Σ w, not Σ (wᵢ / Σ w) xᵢ).
    rounded_float32: ClassVar[bool] = False

    def rounded_combine(
        self, v: torch.Tensor, weights: torch.Tensor, params: Mapping[str, Any], cdt: torch.dtype
    ) -> torch.Tensor:
        """mergekit's operations in its order, rounded to `cdt` where mergekit's tensors are in it.

        Args:
            v: `(N, n)` float32 inputs in `space`, already rounded to `cdt` (task vectors rounded after the
                subtraction).
            weights: `(N,)` float32 per-model weights.

        Returns:
            `(n,)` float32 holding `cdt` values (the engine adds the base and rounds again).
        """
        raise NotImplementedError

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
    """Output `[base +] combine(v)` computed position by position (TIES/DARE family and row-local methods)."""

    kind = "elementwise"
    row_local: ClassVar[bool] = False

    def row_local_for(self, params: Mapping[str, Any]) -> bool:
        """Whether `combine`/`accumulate` need whole logical rows (a 1-D tensor is one row)."""
        return self.row_local

    def ranks(self, params: Mapping[str, Any], n_models: int, numel: int) -> list[tuple[int, ...]] | None:
        """Per model, the ranks `k` (1 = largest) of `score(v_i)` the combine needs, or None (no selection pass).

        The engine computes `thresholds[i, j]` = the `ranks[i][j]`-th largest score of model i over the WHOLE
        tensor (`inf` for k ≤ 0) and passes `thresholds` `(N, K)` (`(N,)` when K = 1) to `accumulate`/`combine`.
        """
        return None

    def densities(self, params: Mapping[str, Any], n_models: int) -> tuple[float, ...] | None:
        """Per-model magnitude-trim densities, or None when no thresholds are needed (TIES family)."""
        return None

    def score(self, v: torch.Tensor, *, base: torch.Tensor | None, row_len: int, cdt=None) -> torch.Tensor:
        """`(N, n)` non-negative float32 values ranked by `ranks` (default `|v|`); `cdt` as in `combine`."""
        return v.abs()

    def mergekit_selection(self, w: torch.Tensor, i: int, params: Mapping[str, Any], thresholds: torch.Tensor):
        """The flat indices mergekit's sort keeps for model `i`, from its whole-tensor scores `w` (`(numel,)`
        float32), when ties at the thresholds make the threshold rule keep another set; None otherwise (or for a
        method without a sort-based selection). In a 16-bit recipe the engine passes the kept entries at the
        boundary values to `combine` as `ties` (`ties.apply_ties`)."""
        return None

    def needs_sums(self, params: Mapping[str, Any]) -> bool:
        """Whether `combine` needs whole-tensor sums gathered by `accumulate` in a pass before it."""
        return False

    def new_sums(self, n_models: int) -> Any:
        return None

    def accumulate(self, sums: Any, v: torch.Tensor, weights: torch.Tensor, params: Mapping[str, Any], **kw) -> None:
        """Add one chunk `v (N, n)` to `sums` (same keywords as `combine`)."""

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
        sums: Any = None,
        base: torch.Tensor | None = None,
        row_len: int | None = None,
        shape: tuple[int, ...] | None = None,
    ) -> torch.Tensor:
        """Merge one chunk.

        Args:
            v: `(N, n)` float32, the inputs in `space` (a flat chunk of the tensor).
            weights: `(N,)` float32 per-model weights.
            params: resolved parameters.
            thresholds: `(N,)` or `(N, K)` float32 k-th largest scores over the whole tensor (see `ranks`), or None.
            tensor_name: name of the tensor (keys the random masks).
            offset: flat element index of `v[:, 0]` within the tensor.
            seed: merge seed.
            sums: what `accumulate` gathered over the whole tensor (None if not `needs_sums`).
            base: `(n,)` float32 base chunk for task-vector methods (the engine adds it back), else None.
            row_len: elements per logical row (row-local methods; chunks hold whole rows; a vector is one row).
            shape: the whole tensor's shape.
            cdt: the 16-bit compute dtype whose roundings the method reproduces (`round_`), or None (float32).

        Returns:
            `(n,)` float32 merged vector in `space` (the engine adds the base for task vectors).
        """
        raise NotImplementedError


def _per_model(value: Any, n_models: int, key: str, method: str) -> tuple[float, ...]:
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        if len(value) != n_models:
            raise ValueError(
                f"merge_method {method!r}: per-model parameter `{key}` has {len(value)} values for {n_models} models."
            )
        return tuple(_value(x, key, method) for x in value)
    return (_value(value, key, method),) * n_models


def _value(value: Any, key: str, method: str) -> Any:
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if not isinstance(value, numbers.Real):
        raise ValueError(f"merge_method {method!r}: `{key}` must be a number, got {value!r}.")
    return float(value)


def per_model(params: Mapping[str, Any], key: str, n_models: int, method: str = "") -> tuple[float, ...]:
    """`params[key]` as one value per model (a scalar is broadcast)."""
    return _per_model(params[key], n_models, key, method)


def gather_params(
    global_params: Mapping[str, Any] | None,
    per_model_params: Sequence[Mapping[str, Any]],
    defaults: Mapping[str, Any] | None = None,
) -> tuple[list[float] | None, dict[str, Any]]:
    """Split mergekit-style per-model parameter dicts into `(weights, params)`.

    `weight` becomes the weight list (None if no model sets it; a model without it gets 1.0). Any other
    per-model key (`density`) becomes a list in `params`: a model that omits it gets the global value, else the
    method's default (`defaults`, as mergekit resolves a missing per-input parameter); a list whose values are all
    equal collapses to a scalar.
    """
    params = dict(global_params or {})
    n = len(per_model_params)
    weights = None
    if any("weight" in p for p in per_model_params):
        weights = [float(p.get("weight", 1.0)) for p in per_model_params]
    keys = {k for p in per_model_params for k in p} - {"weight"}
    for key in sorted(keys):
        fill = params.get(key, (defaults or {}).get(key))
        values = []
        for i, p in enumerate(per_model_params):
            if key in p:
                values.append(p[key])
            elif fill is not None:
                values.append(fill)
            else:
                raise ValueError(f"per-model parameter `{key}` is set for some models but not for model {i}.")
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
        inplace: scale the rows of a float32 `v` in place and accumulate into `v[0]`: no temporaries, and the same
            roundings as the out-of-place form, so the result is bitwise equal.

    Returns:
        `(n,)` float32.
    """
    # Separate multiply and add (never `add_(..., alpha=)`): a fused multiply-add in the vectorised body but not in
    # the scalar tail of a torch kernel would make an element's rounding depend on its position in the chunk.
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
