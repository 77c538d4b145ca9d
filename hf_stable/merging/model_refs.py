"""The input models of a merge recipe: `ModelRef` (a local folder or Hub id, an optional `@revision`, per-model
parameters) and, for the `slices:` form, `OutputSlice`s of `SliceSource`s (a model and a layer range). Each parses
its YAML mapping and raises `ValueError` naming the key at fault.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .settings import parse_parameters


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
        return cls(model, revision, parse_parameters(spec.get("parameters"), f"{where}.parameters"))

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
        return cls(sources, parse_parameters(spec.get("parameters"), f"{where}.parameters"))
