"""Merge recipes: a superset of mergekit's YAML (`models:` form), plus hf_stable's streaming-engine fields.

A recipe names a method, the input models (local folders or Hub ids with an optional `@revision`), an optional
base model, and parameters. Parameter semantics follow mergekit's `mergekit/config.py` (`evaluate_setting`,
`ConfigReader.parameter`) and `mergekit/plan.py` (`MergePlanner.plan_slice`), re-written here from their
behaviour, not copied:

* a value is a scalar (number, bool or string), a **gradient** (a list of numbers, linearly interpolated over the
  layer position `t ∈ [0, 1]`; a list of strings/bools is stepped), or a list of **conditionals**
  `{filter: str, value: <scalar or gradient>}` where the first entry whose filter matches the tensor name wins
  (`filter` omitted or `"*"` matches everything; mergekit matches by substring, we also accept `fnmatch` globs);
* `t = layer_index / (num_layers − 1)` for tensors inside a decoder layer (`t = 1` for a one-layer model);
  tensors before the layers (embeddings) use `t = 0`, those after (final norm, `lm_head`) use `t = 1`;
* lookup order for a per-model quantity (`weight`, `density`, ...): `models[i].parameters`, then the global
  `parameters`; a conditional list with no matching entry falls through to the next level, then to the method's
  default.

hf_stable extensions (top-level keys): `seed`, `memory_budget`, `max_shard_size`, `allow_pickle`,
`filter_exclude` (globs of tensors merged linearly instead of by the method; also accepted inside `parameters`
as in the spec §3.6), `weights` (one weight per model, instead of `models[i].parameters.weight`), `read_threads`,
`drop_cache`. Unsupported mergekit features (`slices`, `modules`, `tokenizer:` unions and added tokens,
`tokenizer_source: union`, `chat_template`) are rejected with a message saying so.

This module imports no torch: the CLI's dry run and `import hf_stable.merging` stay cheap. Method names and
parameters are checked against `hf_stable.merging.methods` in `MergeConfig.validate()` (imports torch).
"""

from __future__ import annotations

import copy
import fnmatch
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


# Data-driven methods are not in the `MERGE_METHODS` registry: the engine hands them to their own module.
DATA_DRIVEN_METHODS = {"fw_merging": "hf_stable.merging.fw"}

# Methods whose inputs are exactly two endpoints: the base model (t = 0) and one other model (t = 1), as mergekit's
# `slerp` (`mergekit/merge_methods/slerp.py`: the base is the t = 0 end).
TWO_ENDPOINT_METHODS = {"slerp"}

_MERGEKIT_UNSUPPORTED = {
    "slices": "layer slices (frankenmerges) are not supported; list whole models under `models:`",
    "modules": "multi-module recipes are not supported; list whole models under `models:`",
    "chat_template": "`chat_template` is not supported; set it on the tokenizer after merging",
}
_TOP_LEVEL_KEYS = {
    "merge_method",
    "models",
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
    "read_threads",
    "drop_cache",
    "name",
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


def layer_position(tensor_name: str, layer: int | None, num_layers: int | None) -> float:
    """mergekit's gradient position `t ∈ [0, 1]` of a tensor (see the module docstring)."""
    if layer is None:
        # mergekit plans architecture "pre weights" with t = 0 and "post weights" with t = 1; without an
        # architecture table we tell them apart by name (embeddings come before the layers).
        return 0.0 if any(h in tensor_name for h in _PRE_LAYER_HINTS) else 1.0
    if not num_layers or num_layers <= 1:
        return 1.0
    return min(1.0, layer / (num_layers - 1))


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


@dataclass
class ModelRef:
    """One input model: a local folder/file or a Hub id, an optional pinned revision, per-model parameters."""

    model: str
    revision: str | None = None
    parameters: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, spec: Any, where: str) -> ModelRef:
        if isinstance(spec, ModelRef):
            return copy.deepcopy(spec)
        if isinstance(spec, (str, os.PathLike)):
            spec = {"model": str(spec)}
        if not isinstance(spec, dict) or "model" not in spec:
            raise ValueError(f"{where}: expected a model path/id or {{model: ..., parameters: {{...}}}}, got {spec!r}")
        extra = set(spec) - {"model", "parameters"}
        if extra:
            raise ValueError(f"{where}: unknown keys {sorted(extra)} (allowed: model, parameters)")
        model = str(spec["model"])
        revision = None
        # `org/name@rev` pins a Hub revision (mergekit's ModelReference syntax); a local path containing '@' wins.
        if "@" in model and not Path(model).exists():
            model, revision = model.rsplit("@", 1)
            if not model or not revision:
                raise ValueError(f"{where}: {spec['model']!r} is not of the form path_or_id[@revision]")
        params = spec.get("parameters") or {}
        if not isinstance(params, dict):
            raise ValueError(f"{where}.parameters must be a mapping, got {params!r}")
        for k, v in params.items():
            _check_setting(k, v, f"{where}.parameters")
        return cls(model, revision, dict(params))

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


def resolve_model_path(ref: ModelRef) -> str:
    """A local folder for `ref`: the path itself when it exists, else a Hub snapshot (weights, configs, tokenizer).

    Hub downloads use `huggingface_hub.snapshot_download` with `allow_patterns` limited to safetensors, JSON and
    tokenizer files, at `ref.revision` (untested offline; local folders never touch the network).
    """
    if Path(ref.model).exists():
        return ref.model
    if ref.model.startswith((".", "/", "~")) or ref.model.count("/") > 1:
        raise FileNotFoundError(f"model {ref.spec!r}: no such local folder (and it does not look like a Hub id)")
    from huggingface_hub import snapshot_download

    return snapshot_download(
        ref.model,
        revision=ref.revision,
        allow_patterns=["*.safetensors", "*.json", "tokenizer*", "*.model", "*.tiktoken", "*.txt"],
    )


@dataclass
class MergeConfig:
    """A merge recipe (mergekit `models:` YAML superset). See the module docstring for parameter semantics.

    Attributes:
        merge_method: a `hf_stable.merging.methods.MERGE_METHODS` name, or `fw_merging` (data-driven).
        models: input models, in order (ordered checkpoints for `wsm`).
        base_model: the base for task-vector methods (and slerp's t = 0 end); `None` if unused.
        parameters: global parameters (method parameters and per-model defaults such as `weight`).
        dtype: compute dtype of mergekit recipes; the engine always computes in fp32/fp64, so this only sets the
            output dtype when `out_dtype` is absent.
        out_dtype: output dtype (`float32`, `bfloat16`, `float16`); default `dtype`, else the first input's.
        tokenizer_source: `base`, or a model path whose tokenizer files are copied; default base, else first.
        seed: seed of the counter-based RNG of random methods (DARE).
        memory_budget: default budget for `merge()` (`"2GB"`, bytes); `None` → the engine's default.
        max_shard_size: output shard size (`"5GB"`, bytes).
        allow_pickle: accept `pytorch_model.bin` inputs (loaded in memory with `weights_only=True`).
        filter_exclude: globs (or substrings) of tensor names merged linearly with the models' weights.
        read_threads, drop_cache: reader options.
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
    read_threads: int | None = None
    drop_cache: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        self.models = [ModelRef.parse(m, f"models[{i}]") for i, m in enumerate(self.models or [])]
        if self.base_model is not None:
            self.base_model = ModelRef.parse(self.base_model, "base_model")
        if not isinstance(self.merge_method, str) or not self.merge_method:
            raise ValueError(f"merge_method must be a method name, got {self.merge_method!r}")
        if not self.models:
            raise ValueError("models: at least one input model is required")
        if not isinstance(self.parameters, dict):
            raise ValueError(f"parameters must be a mapping, got {self.parameters!r}")
        self.parameters = dict(self.parameters)
        if "filter_exclude" in self.parameters:  # spec §3.6 places it among the parameters
            self.filter_exclude = list(self.filter_exclude) + list(_as_list(self.parameters.pop("filter_exclude")))
        if isinstance(self.filter_exclude, str):
            self.filter_exclude = [self.filter_exclude]
        self.filter_exclude = [str(p) for p in self.filter_exclude]
        if self.merge_method not in DATA_DRIVEN_METHODS:  # data-driven methods validate their own parameters
            for k, v in self.parameters.items():
                _check_setting(k, v, "parameters")
        for key in ("dtype", "out_dtype"):
            value = getattr(self, key)
            if value is not None and str(value).replace("torch.", "") not in DTYPE_NAMES:
                raise ValueError(f"{key}={value!r} is not supported; use one of {sorted(DTYPE_NAMES)}")
            if value is not None:
                setattr(self, key, str(value).replace("torch.", ""))
        if self.tokenizer_source == "union":
            raise ValueError("tokenizer_source: union is not supported (vocabularies must match); use base or a model")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.merge_method in TWO_ENDPOINT_METHODS:
            n = len(self.input_models())
            if n != 2:
                raise ValueError(
                    f"merge_method {self.merge_method!r} interpolates exactly 2 models (the base_model is the t=0 "
                    f"end when given), got {n}: {[m.spec for m in self.input_models()]}"
                )

    # ----------------------------------------------------------------------------------------------- construction
    @classmethod
    def from_dict(cls, data: dict) -> MergeConfig:
        """Build from a parsed recipe; unknown or unsupported keys raise `ValueError` naming them."""
        if not isinstance(data, dict):
            raise ValueError(f"a merge recipe must be a mapping, got {type(data).__name__}")
        data = copy.deepcopy(data)
        if data.get("merge_method") in DATA_DRIVEN_METHODS:
            # Data-driven recipes have their own schema (e.g. fw_merging's `pool`, `objective`): kept in `extra`.
            known = {k: data.pop(k) for k in list(data) if k in _TOP_LEVEL_KEYS - {"name"}}
            if not known.get("models") and isinstance(data.get("pool"), list):
                known["models"] = data["pool"]
            known.pop("weights", None)
            return cls(extra=data, **known)
        for key, why in _MERGEKIT_UNSUPPORTED.items():
            if data.get(key):
                raise ValueError(f"{key}: {why} (unsupported mergekit feature)")
        unknown = set(data) - _TOP_LEVEL_KEYS - set(_MERGEKIT_UNSUPPORTED)
        if unknown:
            raise ValueError(f"unknown recipe keys {sorted(unknown)}; allowed: {sorted(_TOP_LEVEL_KEYS)}")
        if "merge_method" not in data:
            raise ValueError("merge_method is required")
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
        return cls(
            merge_method=merge_method,
            models=specs,
            base_model=str(base_model) if base_model is not None else None,
            parameters=dict(parameters or {}),
            **fields,
        )

    def to_dict(self) -> dict:
        d: dict[str, Any] = {"merge_method": self.merge_method}
        if self.base_model is not None:
            d["base_model"] = self.base_model.spec
        d["models"] = [m.to_dict() for m in self.models]
        if self.parameters:
            d["parameters"] = copy.deepcopy(self.parameters)
        for key in ("dtype", "out_dtype", "tokenizer_source", "memory_budget"):
            if getattr(self, key) is not None:
                d[key] = getattr(self, key)
        if self.filter_exclude:
            d["filter_exclude"] = list(self.filter_exclude)
        if self.seed:
            d["seed"] = self.seed
        if self.max_shard_size != "5GB":
            d["max_shard_size"] = self.max_shard_size
        if self.allow_pickle:
            d["allow_pickle"] = True
        if self.read_threads is not None:
            d["read_threads"] = self.read_threads
        if self.drop_cache:
            d["drop_cache"] = True
        d.update(self.extra)
        return d

    def to_yaml(self) -> str:
        """The recipe as YAML; `MergeConfig.from_yaml(cfg.to_yaml())` gives an equal config."""
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    # ----------------------------------------------------------------------------------------------- semantics
    @property
    def is_data_driven(self) -> bool:
        return self.merge_method in DATA_DRIVEN_METHODS

    def input_models(self, *, uses_base: bool | None = None) -> list[ModelRef]:
        """The models whose tensors enter the combination, in order.

        * two-endpoint methods (slerp): `[base, other]` when a base is given (mergekit's t = 0 end is the base);
        * task-vector methods (`uses_base=True`): `models` without entries equal to `base_model` (mergekit
          recipes often list the base among the models, without parameters);
        * otherwise: `models` as given.
        """
        if self.merge_method in TWO_ENDPOINT_METHODS and self.base_model is not None:
            others = [m for m in self.models if not m.same_model(self.base_model)]
            return [self.base_model, *others]
        if uses_base and self.base_model is not None:
            return [m for m in self.models if not m.same_model(self.base_model)]
        return list(self.models)

    def validate(self) -> Any:
        """Check the method name and its global parameters against the registry; returns the method object.

        Raises `ValueError` for an unknown method (listing the registered names), a missing base model, or
        parameters the method rejects. Imports torch (the methods package).
        """
        if self.is_data_driven:
            return None
        from hf_stable.merging.methods import get_merge_method

        method = get_merge_method(self.merge_method)
        params = method.resolve(self.resolve_params("", None, None, None))
        has_base = self.base_model is not None
        if method.requires_base(params) and not has_base:
            raise ValueError(
                f"merge_method {self.merge_method!r} needs base_model (it merges task vectors θ_i − θ_base); "
                "add `base_model:` to the recipe"
            )
        uses_base = has_base and method.space(params, has_base) == "task_vector"
        n = len(self.input_models(uses_base=uses_base))
        if n == 0:
            raise ValueError("after removing base_model from models, no input model is left")
        method.validate(params, n, has_base)
        return method

    def resolve_params(
        self,
        tensor_name: str,
        model_index: int | None,
        layer_index: int | None,
        num_layers: int | None,
        *,
        models: list[ModelRef] | None = None,
        own_only: bool = False,
    ) -> dict[str, Any]:
        """Parameters of one tensor: global ones (`model_index=None`) or those of input model `model_index`.

        `models` is the input list the index refers to (default `self.models`); a model without its own entry
        (e.g. the base added for slerp) gets the global values; `own_only=True` returns only the model's own
        entries (for `methods.base.gather_params`, which fills in the globals itself). Values are evaluated at the
        tensor's layer position (`layer_position`); a setting whose conditionals all miss falls through to the
        next level.
        """
        t = layer_position(tensor_name, layer_index, num_layers)
        out: dict[str, Any] = {}
        for key, setting in () if own_only and model_index is not None else self.parameters.items():
            value = evaluate_setting(setting, tensor_name, t)
            if value is not None:
                out[key] = value
        if model_index is not None:
            ref = (models or self.models)[model_index]
            for key, setting in ref.parameters.items():
                value = evaluate_setting(setting, tensor_name, t)
                if value is not None:
                    out[key] = value
        return out

    def is_excluded(self, tensor_name: str) -> bool:
        """`True` when `filter_exclude` routes this tensor to a plain weighted average."""
        return any(_filter_matches(p, tensor_name) for p in self.filter_exclude)


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
