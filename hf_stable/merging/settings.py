"""Parameter settings of a merge recipe and the layer names they are evaluated at (mergekit 0.1.5 semantics; the
rules are in `config`'s module docstring): a tensor's layer index and gradient position `t`, a setting's value
(scalar, gradient or conditionals) at that position, and the checks a `parameters:` mapping passes when it is read.
"""

from __future__ import annotations

import fnmatch
import re
from typing import Any


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
    """mergekit 0.1.5's gradient position `t ∈ [0, 1]` of a tensor (see `config`'s module docstring).

    `offset` is the layer's position within its slice (its layer index for the `models:` form), `num_layers` the
    slice's layer count; tensors outside the layers (`offset=None`) are at `t = 0`.
    """
    if offset is None:
        return 0.0
    if not num_layers or num_layers <= 1:
        return 1.0
    return min(1.0, offset / (num_layers - 1))


def filter_matches(pattern: Any, tensor_name: str) -> bool:
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
            if filter_matches(setting.get("filter"), tensor_name)
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
            if filter_matches(cond.get("filter"), tensor_name):
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


def parse_parameters(value: Any, where: str) -> dict[str, Any]:
    """A `parameters:` mapping (None, as an empty YAML `parameters:` gives, is an empty mapping)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be a mapping, got {value!r}")
    for k, v in value.items():
        _check_setting(k, v, where)
    return dict(value)
