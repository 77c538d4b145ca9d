"""Typed options of the stability callbacks, each declared once: name, type, default, validator, help.

A family of callbacks takes one frozen dataclass (`GuardConfig`, `ComponentClipConfig`, `DegenerateRunConfig`).
Its fields are declared with [`option`], which keeps the validator and the help in the field's metadata, so:

- the dataclass validates itself (``__post_init__``, one check per field naming it, then the family's cross-field
  rules in ``_check``);
- [`config_fields`] *generates* the matching trainer-config fields (``guard_window``, ``component_clip_mode``, ...),
  the way `hf_stable.registry.declare_fields` does for methods, and [`options_from`] reads them back;
- ``dataclasses.asdict`` gives the callback's constructor arguments (what transformers stores to rebuild it).

Pure Python: no torch, no transformers, nothing above this layer (callbacks import it, never the reverse).
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Callable, Iterable
from typing import Any

from .._validation import Check


__all__ = [
    "OPTIONS_KEY",
    "Options",
    "changed_fields",
    "check_config_fields",
    "config_field_name",
    "config_fields",
    "generated_fields",
    "option",
    "options_from",
]

OPTIONS_KEY = "__hf_stable_options__"  # class attribute: {generated field name: (family prefix, option name)}


def option(
    default: Any,
    help: str,
    check: Check | None = None,
    *,
    flag: bool = True,
    config_type: Any = None,
    config_check: Check | None = None,
):
    """A dataclass field of an options class.

    Args:
        default: the callback's default.
        help: one line for ``--help``, the generated config docstring and the docs.
        check: ``check(name, value)`` from `hf_stable._validation`, run on construction (and on the generated config
            field, under the config field's name).
        flag: False for options a config file cannot carry (a dataset, an instance name, a regex → bound mapping):
            no config field is generated for them.
        config_type, config_check: the generated field's annotation and validator when the config takes a narrower
            value than the Python API (e.g. a group name, where the API also takes a list of regexes).
    """
    metadata = {"help": help, "check": check, "flag": flag, "config_type": config_type, "config_check": config_check}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda v=default: type(v)(v), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


class Options:
    """Base of the frozen options dataclasses: per-field checks, then the class's cross-field ``_check``."""

    def __post_init__(self):
        for f in dataclasses.fields(self):
            check = f.metadata.get("check")
            if check is not None:
                check(f.name, getattr(self, f.name))
        self._check()

    def _check(self) -> None:
        """Cross-field rules of the family (raise ValueError naming the options)."""

    @classmethod
    def flags(cls) -> list[dataclasses.Field]:
        """The options that have a generated config field."""
        return [f for f in dataclasses.fields(cls) if f.metadata.get("flag", True)]

    def kwargs_for(self, fn: Callable) -> dict[str, Any]:
        """The options ``fn`` takes as keyword arguments (e.g. the pure policy built from them)."""
        names = inspect.signature(fn).parameters
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name in names}


def config_field_name(prefix: str, name: str) -> str:
    """``prefix + name``, unless the option already starts with the prefix (``guard_clip_norm``)."""
    return name if name.startswith(prefix) else prefix + name


def _annotation(f: dataclasses.Field, hint: Any, default: Any) -> Any:
    annotation = f.metadata.get("config_type") or hint
    if default is None and annotation is not None and type(None) not in getattr(annotation, "__args__", ()):
        annotation = annotation | None
    return annotation


def config_fields(options_cls: type[Options], prefix: str, defaults: dict[str, Any] | None = None):
    """Class decorator, applied *below* ``@dataclass``: add one config field per flag option of ``options_cls``.

    The field is ``prefix + option`` (`config_field_name`), with the option's help and default (``defaults`` overrides
    a default for this config, e.g. ``max_norm=None`` when ``None`` switches the family off). ``{field: (prefix,
    option)}`` is kept in the class attribute ``OPTIONS_KEY``.
    """
    defaults = defaults or {}

    def decorate(cls: type) -> type:
        annotations = dict(inspect.get_annotations(cls))
        generated = dict(getattr(cls, OPTIONS_KEY, {}))
        hints = typing.get_type_hints(options_cls)
        for f in options_cls.flags():
            name = config_field_name(prefix, f.name)
            if name in annotations:
                raise TypeError(f"{cls.__name__}.{name} is generated from {options_cls.__name__}: remove it.")
            default = defaults.get(f.name, f.default if f.default is not dataclasses.MISSING else f.default_factory())
            annotations[name] = _annotation(f, hints[f.name], default)
            generated_field = dataclasses.field(default=default)
            generated_field.metadata = {"help": f.metadata["help"].replace("%", "%%")}
            setattr(cls, name, generated_field)
            generated[name] = (prefix, f.name)
        cls.__annotations__ = annotations
        setattr(cls, OPTIONS_KEY, generated)
        return cls

    return decorate


def generated_fields(config: Any, prefix: str) -> dict[str, str]:
    """``{config field: option}`` of the family ``prefix`` on ``config`` (empty for a config without them)."""
    return {name: opt for name, (p, opt) in getattr(config, OPTIONS_KEY, {}).items() if p == prefix}


def check_config_fields(config: Any, options_cls: type[Options], prefix: str) -> None:
    """Validate the generated fields of one family under their config names (``None`` = the config's "off")."""
    by_option = {f.name: f for f in dataclasses.fields(options_cls)}
    for name, opt in generated_fields(config, prefix).items():
        value = getattr(config, name)
        meta = by_option[opt].metadata
        check = meta.get("config_check") or meta.get("check")
        if check is not None and value is not None:
            check(name, value)


def changed_fields(config: Any, prefix: str) -> list[str]:
    """The generated fields of ``prefix`` that differ from the config class's default."""
    defaults = {f.name: f.default for f in dataclasses.fields(type(config))}
    return [name for name in generated_fields(config, prefix) if getattr(config, name) != defaults.get(name)]


def options_from(config: Any, options_cls: type[Options], prefix: str, skip: Iterable[str] = ()) -> dict[str, Any]:
    """``{option: value}`` read from the generated fields of ``config`` (those present; ``skip`` left out)."""
    names = {config_field_name(prefix, f.name): f.name for f in options_cls.flags() if f.name not in set(skip)}
    return {opt: getattr(config, name) for name, opt in names.items() if hasattr(config, name)}
