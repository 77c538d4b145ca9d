"""Merge recipes: mergekit 0.1.5's YAML (`models:` and `slices:` forms), plus hf_stable's engine fields.

A recipe names a method, the input models (local folders or Hub ids with an optional `@revision`), an optional
base model, and parameters. Parameter semantics follow mergekit 0.1.5 `config.py` (`evaluate_setting`,
`ConfigReader`), `parameter_resolver.py` and `plan.py` (`MergePlanner`), re-written from their behaviour:

* a value is a scalar (number, bool or string), a **gradient** (a list of numbers, linearly interpolated over the
  layer position `t ∈ [0, 1]`; a list of strings/bools is stepped), or a list of **conditionals**
  `{filter: str, value: <scalar or gradient>}` where the first entry whose filter matches the tensor name wins
  (`filter` omitted or `"*"` matches everything; mergekit matches by substring, we also accept `fnmatch` globs);
* `t = offset / (n − 1)` for the `offset`-th layer of a slice of `n` layers (`t = 1` for a one-layer slice; the
  `models:` form is one slice over all layers); every tensor outside the layer stack (embeddings, final norm,
  `lm_head`) is evaluated at `t = 0`, as mergekit's `plan_module` does for its pre and post weights;
* lookup order, highest first: the slice source's (or model's) `parameters`, the slice's `parameters`, the global
  `parameters`; a conditional list with no matching entry falls through to the next level, then to the method's
  default. An empty `parameters:` is an empty mapping.

The `slices:` form: each slice lists `sources` (a model, a `layer_range: [start, stop)` and per-source
`parameters`) and optional `parameters`; all sources of a slice span the same number of layers. The output's layers
are the slices' layers in order (a frankenmerge with `passthrough`); a single slice whose sources span every layer of
their models is the `models:` form.

hf_stable extensions (top-level keys): `seed`, `memory_budget`, `max_shard_size`, `allow_pickle`,
`filter_exclude` (globs of tensors merged linearly instead of by the method; also accepted inside `parameters`),
`weights` (one weight per model, instead of `models[i].parameters.weight`), `drop_cache`, `fp32_arithmetic`
(float32 arithmetic whatever `dtype` says: not mergekit's numbers), `name`. Unsupported
mergekit features (`modules`, a slice's `base_model`/`residual_weight`, `chat_template`) are refused with a message
saying so; `tokenizer_source` (`base`, `union`, a model) and the `tokenizer:` block (`source`, per-token `tokens`,
`pad_to_multiple_of`; `tokens`) align the vocabularies as mergekit does (`vocab`).

This module imports no torch at import time (`import hf_stable.merging` stays cheap); method names and parameters are
checked against `hf_stable.merging.methods` when a recipe is built.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .model_refs import ModelRef, OutputSlice, SliceSource
from .resolve import split_revision
from .settings import (
    evaluate_setting,
    filter_matches,
    is_pre_layer,
    layer_index,
    layer_position,
    parse_parameters,
    with_layer,
)
from .tokens import TokenEmbedding, parse_pad, parse_tokens


_MERGEKIT_UNSUPPORTED = {
    "modules": "multi-module recipes are not supported; list whole models under `models:` or use `slices:`",
    "chat_template": "`chat_template` is not supported; set it on the tokenizer after merging",
}
_TOP_LEVEL_KEYS = {
    "merge_method",
    "models",
    "slices",
    "base_model",
    "parameters",
    "dtype",
    "out_dtype",
    "tokenizer_source",
    "tokenizer",
    # hf_stable extensions
    "seed",
    "memory_budget",
    "max_shard_size",
    "allow_pickle",
    "filter_exclude",
    "weights",
    "drop_cache",
    "fp32_arithmetic",
    "name",
}
_REMOVED_KEYS = {
    "read_threads": "`read_threads` was removed: the engine reads with one I/O thread ahead of the compute",
}

# torch dtype names accepted for `dtype` / `out_dtype`, mapped to safetensors dtype strings.
DTYPE_NAMES = {
    "float32": "F32",
    "fp32": "F32",
    "float": "F32",
    "float16": "F16",
    "fp16": "F16",
    "half": "F16",
    "bfloat16": "BF16",
    "bf16": "BF16",
    "float64": "F64",
    "fp64": "F64",
}


@dataclass
class MergeConfig:
    """A merge recipe (mergekit `models:`/`slices:` YAML superset). See the module docstring for the semantics.

    Attributes:
        merge_method: a `hf_stable.merging.methods.MERGE_METHODS` name, or `fw_merging` (data-driven).
        models: input models, in order (ordered checkpoints for `wsm`); for a `slices:` recipe, every source model
            once, in order of appearance (without parameters).
        slices: the `slices:` form, or None for a `models:` recipe.
        base_model: the base for task-vector methods (and slerp's t = 0 end); `None` if unused.
        parameters: global parameters (method parameters and per-model defaults such as `weight`).
        dtype: the dtype of the arithmetic, as in mergekit: inputs are rounded to it when read and the method's
            operations are rounded to it where mergekit's are (so outputs equal mergekit's); also the output dtype
            when `out_dtype` is absent. Without it: the inputs' common dtype (`plan.compute_dtype_of`).
        out_dtype: output dtype (`float32`, `bfloat16`, `float16`); default `dtype`, else the first input's.
        fp32_arithmetic: compute in float32 (Gram statistics in float64) whatever `dtype` says, rounding once to the
            output dtype: more precise than mergekit and therefore not mergekit's numbers (an hf_stable extension;
            the model card says so).
        tokenizer_source: `base`, `union`, or a model of the recipe / a path: the output vocabulary, every model's
            embedding and `lm_head` rows moved into it (`vocab`); default the base's tokenizer files, else the first's.
        tokenizer_tokens: the `tokenizer:` block's `tokens` (`{token: tokens.TokenEmbedding}`): per-token row sources,
            tokens the output lacks added.
        pad_to_multiple_of: the `tokenizer:` block's: the vocabulary axis rounded up, the new rows each model's mean.
        seed: seed of the counter-based RNG of random methods (DARE, DELLA).
        memory_budget: default ceiling on the engine's buffers for `merge()` (`"2GB"`, bytes).
        max_shard_size: output shard size (`"5GB"`, bytes).
        allow_pickle: accept `pytorch_model.bin` inputs (loaded in memory with `weights_only=True`).
        filter_exclude: globs (or substrings) of tensor names merged linearly with the models' weights.
        drop_cache: `posix_fadvise(DONTNEED)` the inputs after reading them.
        extra: hf_stable-specific keys kept for `to_yaml` (e.g. `name`).
    """

    merge_method: str
    models: list[ModelRef]
    base_model: ModelRef | None = None
    parameters: dict[str, Any] = field(default_factory=dict)
    dtype: str | None = None
    out_dtype: str | None = None
    tokenizer_source: str | None = None
    tokenizer_tokens: dict[str, TokenEmbedding] | None = None
    pad_to_multiple_of: int | None = None
    seed: int = 0
    memory_budget: str | int | None = None
    max_shard_size: str | int = "5GB"
    allow_pickle: bool = False
    filter_exclude: list[str] = field(default_factory=list)
    drop_cache: bool = False
    fp32_arithmetic: bool = False
    slices: list[OutputSlice] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if not isinstance(self.merge_method, str) or not self.merge_method:
            raise ValueError(f"merge_method must be a method name, got {self.merge_method!r}")
        if self.slices is not None:
            self.slices = [s if isinstance(s, OutputSlice) else OutputSlice.parse(s, f"slices[{i}]")
                           for i, s in enumerate(self.slices)]  # fmt: skip
            if not self.slices:
                raise ValueError("slices: at least one slice is required")
            seen: dict[str, ModelRef] = {}
            for sl in self.slices:
                for src in sl.sources:
                    seen.setdefault(src.model.spec, ModelRef(src.model.model, src.model.revision))
            self.models = list(seen.values())
        else:
            self.models = [ModelRef.parse(m, f"models[{i}]") for i, m in enumerate(self.models or [])]
        if self.base_model is not None:
            self.base_model = ModelRef.parse(self.base_model, "base_model")
        if not self.models:
            raise ValueError("models: at least one input model is required")
        self.parameters = (
            parse_parameters(self.parameters, "parameters") if not self.is_data_driven else dict(self.parameters or {})
        )
        if "filter_exclude" in self.parameters:
            self.filter_exclude = list(self.filter_exclude) + list(_as_list(self.parameters.pop("filter_exclude")))
        if isinstance(self.filter_exclude, str):
            self.filter_exclude = [self.filter_exclude]
        self.filter_exclude = [str(p) for p in self.filter_exclude]
        for key in ("dtype", "out_dtype"):
            value = getattr(self, key)
            if value is not None and str(value).replace("torch.", "") not in DTYPE_NAMES:
                raise ValueError(f"{key}={value!r} is not supported; use one of {sorted(DTYPE_NAMES)}")
            if value is not None:
                setattr(self, key, str(value).replace("torch.", ""))
        self.tokenizer_tokens = parse_tokens(self.tokenizer_tokens)
        self.pad_to_multiple_of = parse_pad(self.pad_to_multiple_of, "pad_to_multiple_of")
        if (self.tokenizer_tokens or self.pad_to_multiple_of) and self.tokenizer_source is None:
            self.tokenizer_source = "union"  # the tokenizer: block's default source
        if not isinstance(self.fp32_arithmetic, bool):
            raise ValueError(f"fp32_arithmetic must be true or false, got {self.fp32_arithmetic!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if not self.is_data_driven:
            method = self.method
            if method.base == "endpoint" and self.slices is None:
                n = len(self.input_models())
                if method.max_models is not None and n > method.max_models:
                    raise ValueError(
                        f"merge_method {self.merge_method!r} interpolates exactly {method.max_models} models (the "
                        f"base_model is the t=0 end when given), got {n}: {[m.spec for m in self.input_models()]}"
                    )

    # ----------------------------------------------------------------------------------------------- construction
    @classmethod
    def from_dict(cls, data: dict) -> MergeConfig:
        """Build from a parsed recipe; unknown or unsupported keys raise `ValueError` naming them."""
        if not isinstance(data, dict):
            raise ValueError(f"a merge recipe must be a mapping, got {type(data).__name__}")
        data = copy.deepcopy(data)
        if "merge_method" not in data:
            raise ValueError("merge_method is required")
        if _method_traits(data["merge_method"]).data_driven:
            if data.get("tokenizer") is not None:  # it would reach the constructor as an unknown keyword
                raise ValueError(
                    f"tokenizer: the `tokenizer:` block is not supported with merge_method {data['merge_method']!r} "
                    "(a data-driven method); give `tokenizer_source: base|<model>` instead"
                )
            # Data-driven recipes have their own schema (e.g. fw_merging's `pool`, `objective`): kept in `extra`.
            known = {k: data.pop(k) for k in list(data) if k in _TOP_LEVEL_KEYS - {"name", "slices", "weights"}}
            if not known.get("models") and isinstance(data.get("pool"), list):
                known["models"] = data["pool"]
            return cls(extra=data, **known)
        for key, why in {**_MERGEKIT_UNSUPPORTED, **_REMOVED_KEYS}.items():
            if key in data and data[key] is not None:
                raise ValueError(f"{key}: {why}" + (" (unsupported mergekit feature)" if key in _MERGEKIT_UNSUPPORTED
                                                     else ""))  # fmt: skip
        unknown = set(data) - _TOP_LEVEL_KEYS - set(_MERGEKIT_UNSUPPORTED) - set(_REMOVED_KEYS)
        if unknown:
            raise ValueError(f"unknown recipe keys {sorted(unknown)}; allowed: {sorted(_TOP_LEVEL_KEYS)}")
        if data.get("models") and data.get("slices"):
            raise ValueError("give exactly one of `models:` (whole models) or `slices:` (layer ranges), not both")
        if not data.get("models") and not data.get("slices"):
            raise ValueError("models: at least one input model is required (or `slices:` with layer ranges)")
        tokenizer = data.pop("tokenizer", None)
        if tokenizer is not None:
            if not isinstance(tokenizer, dict) or set(tokenizer) - {"source", "tokens", "pad_to_multiple_of"}:
                raise ValueError(
                    "tokenizer: expected {source: union|base|<model>, tokens: {...}, pad_to_multiple_of: N}, "
                    f"got {tokenizer!r}"
                )
            if data.get("tokenizer_source"):
                raise ValueError("give either tokenizer_source or tokenizer, not both")
            data["tokenizer_source"] = tokenizer.get("source") or "union"  # mergekit's TokenizerConfig default
            data["tokenizer_tokens"] = tokenizer.get("tokens")
            data["pad_to_multiple_of"] = tokenizer.get("pad_to_multiple_of")
        weights = data.pop("weights", None)
        models = data.pop("models", None) or []
        if not isinstance(models, list):
            raise ValueError(f"models must be a list, got {models!r}")
        if weights is not None:
            if data.get("slices"):
                raise ValueError("`weights` applies to the models: form; set weight per slice source instead")
            models = _apply_weights(models, weights)
        extra = {"name": data.pop("name")} if "name" in data else {}
        return cls(models=models, extra=extra, **data)

    @classmethod
    def from_yaml(cls, path_or_str: str | os.PathLike) -> MergeConfig:
        """Read a recipe from a YAML file path or a YAML string."""
        return cls.from_dict(load_recipe_dict(path_or_str))

    @classmethod
    def build(
        cls,
        merge_method: str,
        models: list[str | os.PathLike],
        *,
        weights: list[float] | None = None,
        base_model: str | os.PathLike | None = None,
        parameters: dict | None = None,
        **fields,
    ) -> MergeConfig:
        """Python shortcut: `MergeConfig.build("ties", [a, b], weights=[1, 1], base_model=base, parameters=...)`."""
        specs: list[Any] = [{"model": str(m)} for m in models]
        if weights is not None:
            specs = _apply_weights(specs, weights)
        for key, why in _REMOVED_KEYS.items():
            if key in fields:
                raise ValueError(f"{key}: {why}")
        return cls(
            merge_method=merge_method,
            models=specs,
            base_model=str(base_model) if base_model is not None else None,
            parameters=dict(parameters or {}),
            **fields,
        )

    def to_dict(self, *, redact: bool = False) -> dict:
        """The recipe as a dict; `redact=True` names local inputs by folder name only (what goes to the Hub)."""
        name = _public_name if redact else (lambda s: s)
        d: dict[str, Any] = {"merge_method": self.merge_method}
        if self.base_model is not None:
            d["base_model"] = name(self.base_model.spec)
        if self.slices is not None:
            d["slices"] = [s.to_dict() for s in self.slices]
            for sl in d["slices"]:
                for src in sl["sources"]:
                    src["model"] = name(src["model"])
        else:
            d["models"] = [{**m.to_dict(), "model": name(m.spec)} for m in self.models]
        if self.parameters:
            d["parameters"] = copy.deepcopy(self.parameters)
        for key in ("dtype", "out_dtype", "memory_budget"):
            if getattr(self, key) is not None:
                d[key] = getattr(self, key)
        if self.tokenizer_tokens or self.pad_to_multiple_of:
            block: dict[str, Any] = {"source": name(self.tokenizer_source or "union")}
            if self.tokenizer_tokens:
                block["tokens"] = {t: e.to_dict(name) for t, e in self.tokenizer_tokens.items()}
            if self.pad_to_multiple_of:
                block["pad_to_multiple_of"] = self.pad_to_multiple_of
            d["tokenizer"] = block
        elif self.tokenizer_source is not None:
            d["tokenizer_source"] = name(self.tokenizer_source)
        if self.filter_exclude:
            d["filter_exclude"] = list(self.filter_exclude)
        if self.seed:
            d["seed"] = self.seed
        if self.max_shard_size != "5GB":
            d["max_shard_size"] = self.max_shard_size
        if self.allow_pickle:
            d["allow_pickle"] = True
        if self.drop_cache:
            d["drop_cache"] = True
        if self.fp32_arithmetic:
            d["fp32_arithmetic"] = True
        extra = copy.deepcopy(self.extra)
        if redact and self.is_data_driven:
            extra = _redact_paths(extra)
        d.update(extra)
        return d

    def to_yaml(self, *, redact: bool = False) -> str:
        """The recipe as YAML; `MergeConfig.from_yaml(cfg.to_yaml())` gives an equal config."""
        import yaml

        return yaml.safe_dump(self.to_dict(redact=redact), sort_keys=False, allow_unicode=True)

    # ----------------------------------------------------------------------------------------------- semantics
    @property
    def method(self):
        """The `MergeMethod` of `merge_method` (raises `ValueError` listing the valid names)."""
        return _method_traits(self.merge_method)

    @property
    def is_data_driven(self) -> bool:
        return _method_traits(self.merge_method).data_driven

    def input_models(self, *, uses_base: bool | None = None) -> list[ModelRef]:
        """The models whose tensors enter the combination (`models:` form), in order.

        * base-endpoint methods (slerp): `[base, other]` when a base is given (mergekit's t = 0 end is the base);
        * task-vector methods (`uses_base=True`): `models` without entries equal to `base_model` (mergekit
          recipes often list the base among the models, without parameters);
        * otherwise: `models` as given.
        """
        if self.base_model is not None and not self.is_data_driven and self.method.base_is_input(
            self.method.resolve(self.global_parameters(self.slices[0] if self.slices else None))
        ):
            others = [m for m in self.models if not m.same_model(self.base_model)]
            return [self.base_model, *others]
        if uses_base and self.base_model is not None:
            return [m for m in self.models if not m.same_model(self.base_model)]
        return list(self.models)

    def validate(self) -> Any:
        """Check the method name and its global parameters against the registry; returns the method object.

        Raises `ValueError` for an unknown method (listing the registered names), a missing base model, or
        parameters the method rejects.
        """
        if self.is_data_driven:
            return None
        method = self.method
        params = method.resolve(self.global_parameters(self.slices[0] if self.slices else None))
        has_base = self.base_model is not None
        if method.requires_base(params) and not has_base:
            raise ValueError(
                f"merge_method {self.merge_method!r} needs base_model (it merges task vectors θ_i − θ_base); "
                "add `base_model:` to the recipe"
            )
        uses_base = has_base and method.space(params, has_base) == "task_vector"
        if self.slices is None:
            n = len(self.input_models(uses_base=uses_base))
        else:
            n = len([s for s in self.slices[0].sources if not (uses_base and s.model.same_model(self.base_model))])
        if n == 0:
            raise ValueError("after removing base_model from models, no input model is left")
        method.validate(params, n, has_base)
        return method

    def global_parameters(self, out_slice: OutputSlice | None = None, tensor_name: str = "", t: float = 0.0):
        """Method-level (shared) parameters of a tensor: the slice's, then the global ones."""
        out: dict[str, Any] = {}
        for scope in (self.parameters, out_slice.parameters if out_slice else None):
            for key, setting in (scope or {}).items():
                value = evaluate_setting(setting, tensor_name, t)
                if value is not None:
                    out[key] = value
        return out

    @staticmethod
    def own_parameters(ref_params: dict[str, Any], tensor_name: str, t: float) -> dict[str, Any]:
        """One input's own parameters (its model entry or slice source) for a tensor; the slice's and the global
        ones fill what it leaves unset (`methods.base.gather_params`)."""
        out: dict[str, Any] = {}
        for key, setting in (ref_params or {}).items():
            value = evaluate_setting(setting, tensor_name, t)
            if value is not None:
                out[key] = value
        return out

    def is_excluded(self, tensor_name: str) -> bool:
        """`True` when `filter_exclude` routes this tensor to a plain weighted average."""
        return any(filter_matches(p, tensor_name) for p in self.filter_exclude)


def _method_traits(name: str):
    from hf_stable.merging.methods import get_merge_method

    return get_merge_method(name)


def _public_name(spec: str) -> str:
    """A model as it may be published: a Hub id as written, a local path by its folder name."""
    from .resolve import is_hub_id

    if is_hub_id(spec):
        return spec
    model, _ = split_revision(spec)
    return Path(str(model).rstrip("/\\")).name or str(model)


def _redact_paths(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: (_public_name(v) if k == "model" and isinstance(v, str) else _redact_paths(v)) for k, v in
                value.items()}  # fmt: skip
    if isinstance(value, list):
        return [_redact_paths(v) for v in value]
    if isinstance(value, str) and (os.path.isabs(value) or value.startswith("~")):
        return Path(value).name
    return value


def load_recipe_dict(path_or_str: str | os.PathLike) -> dict:
    """Parse a recipe from a YAML file (path) or a YAML string into a dict (no validation)."""
    import yaml

    text = str(path_or_str)
    looks_like_path = isinstance(path_or_str, os.PathLike) or ("\n" not in text and ":" not in text)
    if looks_like_path or ("\n" not in text and Path(text).is_file()):
        if not Path(text).is_file():
            raise FileNotFoundError(f"merge recipe {text!r}: no such file")
        text = Path(text).read_text(encoding="utf-8")
    data = yaml.safe_load(text)
    if not isinstance(data, dict):
        raise ValueError(f"a merge recipe must be a YAML mapping, got {type(data).__name__}")
    return data


def _as_list(v: Any) -> list:
    return [v] if isinstance(v, str) else list(v or [])


def _apply_weights(models: list, weights: Any) -> list:
    if not isinstance(weights, (list, tuple)):
        raise ValueError(f"weights must be a list with one number per model, got {weights!r}")
    if len(weights) != len(models):
        raise ValueError(f"weights has {len(weights)} entries but models has {len(models)}; give one weight per model")
    out = []
    for i, (m, w) in enumerate(zip(models, weights, strict=True)):
        spec = {"model": str(m)} if isinstance(m, (str, os.PathLike)) else copy.deepcopy(m)
        params = dict(spec.get("parameters") or {})
        if "weight" in params:
            raise ValueError(f"models[{i}] has parameters.weight and `weights` is given too; use one of them")
        params["weight"] = w
        spec["parameters"] = params
        out.append(spec)
    return out


# The recipe API, `settings`' and `model_refs`' parts included, so `from hf_stable.merging.config import X` keeps
# working for every X it has offered.
__all__ = [
    "DTYPE_NAMES",
    "MergeConfig",
    "ModelRef",
    "OutputSlice",
    "SliceSource",
    "evaluate_setting",
    "is_pre_layer",
    "layer_index",
    "layer_position",
    "load_recipe_dict",
    "with_layer",
]
