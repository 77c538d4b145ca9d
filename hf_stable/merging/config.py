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
mergekit features (`modules`, a slice's `base_model`/`residual_weight`, `tokenizer:` added tokens, `chat_template`,
and `tokenizer_source: union` over differing vocabularies) are refused with a message saying so.

This module imports no torch at import time (`import hf_stable.merging` stays cheap); method names and parameters are
checked against `hf_stable.merging.methods` when a recipe is built.
"""

from __future__ import annotations

import copy
import fnmatch
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .resolve import split_revision


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

# Tensor names inside a repeated block: `model.layers.3.mlp...`, GPT-2's `h.3.`, `blocks.3.`, BERT's `layer.3.`.
_LAYER_RE = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)(?:\.|$)")
_PRE_LAYER_HINTS = ("embed", "wte", "wpe", "word_embeddings", "tok_embeddings", "position_embeddings")


def layer_index(tensor_name: str) -> int | None:
    """The decoder-layer index in a tensor name (`model.layers.3.mlp.up_proj.weight` → 3), else `None`."""
    m = _LAYER_RE.search(tensor_name)
    return int(m.group(1)) if m else None


def with_layer(tensor_name: str, index: int) -> str:
    """`tensor_name` with its layer index replaced by `index`."""
    m = _LAYER_RE.search(tensor_name)
    if m is None:
        raise ValueError(f"tensor {tensor_name!r} is not inside a layer")
    return tensor_name[: m.start(1)] + str(index) + tensor_name[m.end(1) :]


def is_pre_layer(tensor_name: str) -> bool:
    """A tensor outside the layers that comes before them (embeddings); the others (norm, lm_head) come after."""
    return any(h in tensor_name for h in _PRE_LAYER_HINTS)


def layer_position(tensor_name: str, offset: int | None, num_layers: int | None) -> float:
    """mergekit 0.1.5's gradient position `t ∈ [0, 1]` of a tensor (see the module docstring).

    `offset` is the layer's position within its slice (its layer index for the `models:` form), `num_layers` the
    slice's layer count; tensors outside the layers (`offset=None`) are at `t = 0`.
    """
    if offset is None:
        return 0.0
    if not num_layers or num_layers <= 1:
        return 1.0
    return min(1.0, offset / (num_layers - 1))


def _filter_matches(pattern: Any, tensor_name: str) -> bool:
    if pattern is None or pattern == "*":
        return True
    pattern = str(pattern)
    return pattern in tensor_name or fnmatch.fnmatchcase(tensor_name, pattern)


def _is_scalar(v: Any) -> bool:
    return isinstance(v, (int, float, bool, str))


def evaluate_setting(setting: Any, tensor_name: str, t: float) -> Any:
    """Value of one parameter setting for a tensor at layer position `t`; `None` when no conditional matches.

    Follows mergekit's `evaluate_setting`: numeric lists interpolate linearly between neighbouring entries,
    other scalar lists are stepped (`setting[int(t·(len−1))]`), conditional lists return the first match.
    """
    if setting is None or _is_scalar(setting):
        return setting
    if isinstance(setting, dict):  # a single conditional
        return (
            evaluate_setting(setting["value"], tensor_name, t)
            if _filter_matches(setting.get("filter"), tensor_name)
            else None
        )
    if isinstance(setting, (list, tuple)):
        if not setting:
            return None
        if all(isinstance(e, (int, float)) and not isinstance(e, bool) for e in setting):
            scaled = t * (len(setting) - 1)
            i0 = int(scaled)
            i1 = min(len(setting) - 1, i0 + 1)
            frac = scaled - i0
            return (1 - frac) * setting[i0] + frac * setting[i1]
        if all(_is_scalar(e) for e in setting):
            return setting[int(t * (len(setting) - 1))]
        for cond in setting:
            if _filter_matches(cond.get("filter"), tensor_name):
                return evaluate_setting(cond["value"], tensor_name, t)
        return None
    raise TypeError(f"unexpected parameter setting {setting!r} for tensor {tensor_name!r}")


def _check_setting(name: str, setting: Any, where: str) -> None:
    """Reject malformed settings when the recipe is read, not halfway through a merge."""
    if setting is None or _is_scalar(setting):
        return
    if isinstance(setting, dict):
        setting = [setting]
    if isinstance(setting, (list, tuple)):
        if not setting:
            raise ValueError(f"{where}.{name}: an empty list is not a valid parameter value")
        if all(_is_scalar(e) for e in setting):
            return
        for cond in setting:
            if not isinstance(cond, dict) or "value" not in cond or not set(cond) <= {"filter", "value"}:
                raise ValueError(
                    f"{where}.{name}: a list must hold only scalars (a gradient) or only {{filter, value}} "
                    f"conditionals, got {cond!r}"
                )
            _check_setting(name, cond["value"], where)
            if isinstance(cond["value"], dict) or (
                isinstance(cond["value"], list) and not all(_is_scalar(e) for e in cond["value"])
            ):
                raise ValueError(f"{where}.{name}: a conditional's value must be a scalar or a gradient list")
        return
    raise ValueError(f"{where}.{name}: unsupported value {setting!r} (scalar, gradient list or conditionals)")


def _parameters(value: Any, where: str) -> dict[str, Any]:
    """A `parameters:` mapping (None, as an empty YAML `parameters:` gives, is an empty mapping)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be a mapping, got {value!r}")
    for k, v in value.items():
        _check_setting(k, v, where)
    return dict(value)


@dataclass
class ModelRef:
    """One input model: a local folder/file or a Hub id, an optional pinned revision, per-model parameters."""

    model: str
    revision: str | None = None
    parameters: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, spec: Any, where: str, *, extra_keys: tuple[str, ...] = ()) -> ModelRef:
        if isinstance(spec, ModelRef):
            return copy.deepcopy(spec)
        if isinstance(spec, (str, os.PathLike)):
            spec = {"model": str(spec)}
        if not isinstance(spec, dict) or "model" not in spec:
            raise ValueError(f"{where}: expected a model path/id or {{model: ..., parameters: {{...}}}}, got {spec!r}")
        extra = set(spec) - {"model", "parameters", *extra_keys}
        if extra:
            raise ValueError(f"{where}: unknown keys {sorted(extra)} (allowed: model, parameters, *{extra_keys})")
        model, revision = str(spec["model"]), None
        # `org/name@rev` pins a Hub revision (mergekit's ModelReference syntax); a local path containing '@' wins.
        if "@" in model and not Path(model).exists():
            model, revision = model.rsplit("@", 1)
            if not model or not revision:
                raise ValueError(f"{where}: {spec['model']!r} is not of the form path_or_id[@revision]")
        return cls(model, revision, _parameters(spec.get("parameters"), f"{where}.parameters"))

    @property
    def spec(self) -> str:
        return self.model if self.revision is None else f"{self.model}@{self.revision}"

    def same_model(self, other: ModelRef | None) -> bool:
        return other is not None and self.model == other.model and self.revision == other.revision

    def to_dict(self) -> dict:
        d: dict[str, Any] = {"model": self.spec}
        if self.parameters:
            d["parameters"] = copy.deepcopy(self.parameters)
        return d


@dataclass
class SliceSource:
    """One source of an output slice: a model (with its per-source parameters) and a layer range `[start, stop)`."""

    model: ModelRef
    layer_range: tuple[int, int]

    def to_dict(self) -> dict:
        return {**self.model.to_dict(), "layer_range": list(self.layer_range)}


@dataclass
class OutputSlice:
    """A run of output layers merged from `sources` (each spanning the same number of layers)."""

    sources: list[SliceSource]
    parameters: dict[str, Any] = field(default_factory=dict)

    @property
    def n_layers(self) -> int:
        a, b = self.sources[0].layer_range
        return b - a

    def to_dict(self) -> dict:
        d: dict[str, Any] = {"sources": [s.to_dict() for s in self.sources]}
        if self.parameters:
            d["parameters"] = copy.deepcopy(self.parameters)
        return d

    @classmethod
    def parse(cls, spec: Any, where: str) -> OutputSlice:
        if not isinstance(spec, dict) or "sources" not in spec:
            raise ValueError(f"{where}: expected {{sources: [...], parameters: {{...}}}}, got {spec!r}")
        unsupported = {"base_model", "residual_weight"} & set(spec)
        if unsupported:
            raise ValueError(
                f"{where}: {sorted(unsupported)} per slice is not supported (unsupported mergekit feature); set "
                "base_model at the top level"
            )
        extra = set(spec) - {"sources", "parameters"}
        if extra:
            raise ValueError(f"{where}: unknown keys {sorted(extra)} (allowed: sources, parameters)")
        if not isinstance(spec["sources"], list) or not spec["sources"]:
            raise ValueError(f"{where}.sources: at least one source is required")
        sources = []
        for j, src in enumerate(spec["sources"]):
            w = f"{where}.sources[{j}]"
            ref = ModelRef.parse(src, w, extra_keys=("layer_range",))
            rng = src.get("layer_range") if isinstance(src, dict) else None
            if (
                not isinstance(rng, (list, tuple))
                or len(rng) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in rng)
                or not 0 <= rng[0] < rng[1]
            ):
                raise ValueError(f"{w}.layer_range: expected [start, stop) with 0 <= start < stop, got {rng!r}")
            sources.append(SliceSource(ref, (int(rng[0]), int(rng[1]))))
        lengths = {s.layer_range[1] - s.layer_range[0] for s in sources}
        if len(lengths) > 1:
            raise ValueError(f"{where}: every source of a slice must span the same number of layers, got {lengths}")
        return cls(sources, _parameters(spec.get("parameters"), f"{where}.parameters"))


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
        tokenizer_source: `base`, or a model path whose tokenizer files are copied; default base, else first.
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
            _parameters(self.parameters, "parameters") if not self.is_data_driven else dict(self.parameters or {})
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
            if not isinstance(tokenizer, dict) or set(tokenizer) - {"source"}:
                raise ValueError(
                    "tokenizer: only {source: base|<model>} is supported (added tokens, embedding sources and "
                    "pad_to_multiple_of are unsupported mergekit features)"
                )
            if data.get("tokenizer_source"):
                raise ValueError("give either tokenizer_source or tokenizer, not both")
            data["tokenizer_source"] = tokenizer.get("source")
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
        if self.tokenizer_source is not None:
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
        return any(_filter_matches(p, tensor_name) for p in self.filter_exclude)


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
