"""Name -> method registries, one per family, where each method is **declared once**.

A declaration holds everything hf_stable knows about a method, so nothing else has to repeat it:

- the callable (a pure function, or a class for stateful methods such as reward-weight controllers);
- the config fields it reads ([`Field`]: name as the user spells it, default, help, validator, and the keyword the
  callable takes), from which the trainers' config dataclasses *generate* their fields ([`declare_fields`]);
- the host (TRL/transformers) options it reads (``reads``), honours (``honours``) or needs set a certain way
  (``requires``), so a config refuses a combination by name instead of silently ignoring an option;
- its paper (a [`~hf_stable.papers.Paper`]), used by model cards and the docs' paper index.

Trainers dispatch on declarations: ``method = REGISTRY.get(args.<selector>)`` then
``method(..., **method.params_from(args))``; they keep no per-method table. This follows verl's
``register_adv_est`` (an estimator reads its own config, ``verl/trainer/ppo/core_algos.py``) and PEFT's config-field
metadata (``is_lora_variant``, ``peft/tuners/lora/config.py``).

This module imports nothing heavy: it is loaded by ``import hf_stable``.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TextIO

from ._validation import Check, check_choice


@dataclass(frozen=True)
class Field:
    """A config field that a method reads.

    Args:
        name: the config field, as the user spells it (``"sgrpo_noise_p"``).
        default: its default, which reproduces the paper.
        help: one line for ``--help`` and the generated docstring.
        check: validator ``check(name, value)`` from [`hf_stable._validation`]; ``None`` accepts any value of ``type``.
        param: the keyword the method's callable takes (``"noise_p"``); ``None`` when the callable does not take it
            and its host reads it by name (e.g. a loss mode's normaliser choice).
        type: the annotation of the generated dataclass field; inferred from ``default`` when left out.
        per_model: one value per input model (a merge method's per-input recipe parameters, mergekit's ``weight``,
            ``density``, ...); a scalar is broadcast.
    """

    name: str
    default: Any
    help: str
    check: Check | None = None
    param: str | None = None
    type: Any = None
    per_model: bool = False

    def annotation(self) -> Any:
        if self.type is not None:
            return self.type
        if self.default is None:
            raise TypeError(f"Field {self.name!r} has default None: give its `type`.")
        return type(self.default)

    def parse(self, value: Any) -> Any:
        """``value`` read as its check's number type (``check.parse``) when written as a string, each entry of a
        per-model list too: YAML reads ``1e-5`` as the string "1e-5", which mergekit's pydantic recipe models read as
        a number. A string that is no number stays, for the check to refuse by name."""
        parse = getattr(self.check, "parse", None)
        if parse is None:
            return value
        if isinstance(value, (list, tuple)) and self.per_model:
            return [self.parse(x) for x in value]
        if isinstance(value, str):
            try:
                return parse(value.strip())
            except ValueError:
                return value
        return value


_UNSET: Any = type("Unset", (), {"__repr__": lambda self: "<unset>"})()


@dataclass(frozen=True)
class Requires:
    """A host option that must satisfy ``ok(value)`` while the method is active; ``why`` says what to set instead.

    ``fix`` is a value that satisfies it (set by ``Registry.activation``); with ``when``, the rule binds only for
    configs where ``when(args)`` holds (e.g. an option that is redundant under one of the method's own settings).
    """

    option: str
    ok: Callable[[Any], bool]
    why: str
    fix: Any = _UNSET
    when: Callable[[Any], bool] | None = None


@dataclass(frozen=True)
class Method:
    """A registered method: its callable and declaration."""

    name: str
    family: str
    fn: Callable[..., Any]
    paper: Any  # a `hf_stable.papers.Paper`, or a plain description for methods without one (e.g. "nll")
    description: str = ""
    fields: tuple[Field, ...] = ()
    reads: Mapping[str, str] = field(default_factory=dict)  # callable keyword -> host option it takes its value from
    requires: tuple[Requires, ...] = ()
    honours: tuple[str, ...] = ()  # host options this method applies (documentation and the option-coverage test)
    extra: Mapping[str, Any] = field(default_factory=dict)  # family-specific metadata (e.g. a loss mode's scheme)
    example: Mapping[str, Any] = field(default_factory=dict)  # config values a minimal run needs besides the selector

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    @property
    def url(self) -> str:
        return getattr(self.paper, "url", None) or self.extra.get("url", "")

    @property
    def paper_text(self) -> str:
        return getattr(self.paper, "short", None) or str(self.paper or "")

    @property
    def defaults(self) -> dict[str, Any]:
        """``{callable keyword: default}`` of the declared fields."""
        legacy = {k: v for k, v in self.extra.items() if k != "url"}  # until every family declares `fields`
        return {**legacy, **{f.param: f.default for f in self.fields if f.param is not None}}

    def params_from(self, args: Any) -> dict[str, Any]:
        """The keyword arguments of the callable, read from a config (the method reads its own config)."""
        params = {f.param: getattr(args, f.name) for f in self.fields if f.param is not None}
        params.update({param: getattr(args, option) for param, option in self.reads.items()})
        return params

    def settings_from(self, args: Any) -> dict[str, Any]:
        """``{config field: value}`` of the declared fields, e.g. for a model card."""
        return {f.name: getattr(args, f.name) for f in self.fields}

    def host_problems(self, args: Any) -> list[str]:
        """The host options set in a way this method cannot honour, each with what to do instead."""
        problems = []
        for rule in self.requires:
            if rule.when is not None and not rule.when(args):
                continue
            value = getattr(args, rule.option)
            if not rule.ok(value):
                problems.append(f"{rule.option}={value!r} ({rule.why})")
        return problems


class Registry:
    """Maps names to [`Method`]s for one family (for example ``"advantage_estimator"``).

    ``selector`` is the config field that picks the family's method (defaults to the family name); ``builtin`` lists
    selector values handled by the host itself (e.g. ``loss_mode="ppo"`` is TRL's own surrogate; ``None`` for "off").

    A *switch* family (``enable`` given) has one method, turned on by any selector value other than ``None``/``False``
    (e.g. ``stable_rank_reward=True``, or ``delta_l_alpha=0.75``, which the method also reads); ``enable`` is a value
    that turns it on, and ``selector_check`` validates the selector's value.

    Example:
    ```python
    >>> ESTIMATORS = Registry("advantage_estimator")
    >>> @ESTIMATORS.register("mine", paper=PAPERS["grpo"], fields=[Field("mine_tau", 1.0, "τ.", param="tau")])
    ... def mine(rewards, lengths, num_generations, weights, tau=1.0): ...
    >>> ESTIMATORS.get("mien")
    ValueError: Unknown advantage_estimator 'mien'. Valid names: mine.
    ```
    """

    def __init__(
        self,
        family: str,
        description: str = "",
        *,
        selector: str | None = None,
        builtin: Iterable[Any] = (),
        enable: Any = None,
        selector_check: Check | None = None,
    ):
        self.family = family
        self.description = description
        self.selector = selector or family
        self.builtin = tuple(builtin)
        self.enable = enable
        self.selector_check = selector_check
        self._methods: dict[str, Method] = {}
        _FAMILIES[family] = self

    @property
    def is_switch(self) -> bool:
        return self.enable is not None

    def register(
        self,
        name: str,
        *,
        paper: Any = None,
        description: str = "",
        fields: Iterable[Field] = (),
        reads: Mapping[str, str] | None = None,
        requires: Iterable[Requires] = (),
        honours: Iterable[str] = (),
        example: Mapping[str, Any] | None = None,
        **extra,
    ) -> Callable:
        """Decorator registering ``fn`` under ``name``; re-registering a name is an error."""

        def decorator(fn: Callable | None) -> Callable | None:
            if name in self._methods or name in self.builtin:
                raise ValueError(f"{self.family} '{name}' is already registered.")
            if self.is_switch and self._methods:
                raise ValueError(f"{self.family} is a switch ({self.selector}): it holds one method.")
            self._methods[name] = Method(
                name,
                self.family,
                fn,
                paper,
                description,
                tuple(fields),
                dict(reads or {}),
                tuple(requires),
                tuple(honours),
                dict(extra),
                dict(example or {}),
            )
            return fn

        return decorator

    def declare(self, name: str, **declaration) -> None:
        """Declare a method the trainer computes itself (no callable), e.g. ``sft_objective="auto"``, which resolves
        to another objective: its fields, requirements and paper are declared like any other method's."""
        self.register(name, **declaration)(None)

    def get(self, name: str) -> Method:
        """The method called ``name``; raises ``ValueError`` naming the selector and listing the valid names."""
        try:
            return self._methods[name]
        except (KeyError, TypeError):
            valid = ", ".join(str(choice) for choice in self.choices() or self._methods)
            raise ValueError(f"Unknown {self.selector} {name!r}. Valid names: {valid}.") from None

    def choices(self) -> list[Any]:
        """Every value the selector accepts: the host's built-ins, then the registered names (a switch's selector
        takes values, not names: ``[]``)."""
        return [] if self.is_switch else [*self.builtin, *self._methods]

    def activation(self, name: str) -> dict[str, Any]:
        """The config values that make method ``name`` active and runnable: its selector value, the ``fix`` of each
        host requirement, and its ``example`` values, e.g. ``{"delta_l_alpha": 1.0, "loss_type": "dr_grpo"}``."""
        method = self.get(name)
        values = {self.selector: self.enable if self.is_switch else name}
        values.update({rule.option: rule.fix for rule in method.requires if rule.fix is not _UNSET and not rule.when})
        return {**values, **method.example}

    def names(self) -> list[str]:
        return list(self._methods)

    def fields(self) -> list[Field]:
        """Every declared field of the family, once each (a field shared by several methods is declared once)."""
        seen: dict[str, Field] = {}
        for method in self:
            for f in method.fields:
                if f.name in seen and seen[f.name] != f:
                    raise TypeError(f"{self.family}: field {f.name!r} is declared twice with different settings.")
                seen[f.name] = f
        return list(seen.values())

    def readers(self, field_name: str) -> list[Method]:
        """The methods that read config field ``field_name``."""
        return [m for m in self if any(f.name == field_name for f in m.fields)]

    def active(self, args: Any) -> Method | None:
        """The method the config selects, or ``None`` for a host built-in (or no selector value)."""
        value = getattr(args, self.selector)
        if self.is_switch:
            return None if value is None or value is False else next(iter(self._methods.values()))
        return None if value is None or value in self.builtin else self.get(value)

    def validate(self, args: Any) -> None:
        """Check the selector, every declared field, and the active method's host requirements."""
        if self.is_switch:
            if self.selector_check is not None:
                self.selector_check(self.selector, getattr(args, self.selector))
        else:
            check_choice(self.selector, getattr(args, self.selector), self.choices())
        for f in self.fields():
            if f.check is not None:
                f.check(f.name, getattr(args, f.name))
        method = self.active(args)
        if method is not None:
            problems = method.host_problems(args)
            if problems:
                chosen = getattr(args, self.selector)
                raise ValueError(f"{self.selector}={chosen!r} cannot be combined with: {'; '.join(problems)}.")

    def __contains__(self, name: object) -> bool:
        return name in self._methods

    def __iter__(self):
        return iter(self._methods.values())

    def __len__(self) -> int:
        return len(self._methods)


METHOD_KEY = "__hf_stable_fields__"  # class attribute: {generated field name: the registry family it comes from}


def declare_fields(*registries: Registry) -> Callable[[type], type]:
    """Class decorator, applied *below* ``@dataclass``: add every field the registries' methods declare.

    Each becomes an ordinary dataclass field with ``metadata={"help": ...}``, so ``HfArgumentParser``/``TrlParser``,
    YAML configs and ``--help`` see it like a hand-written one, and the class docstring gains a generated section
    listing them per method. ``{field: family}`` is kept in the class attribute ``METHOD_KEY``.
    """

    def decorate(cls: type) -> type:
        annotations = dict(inspect.get_annotations(cls))
        doc, generated = [], {}
        families = dict(getattr(cls, METHOD_KEY, {}))
        for registry in registries:
            for f in registry.fields():
                if generated.get(f.name) == f:
                    continue  # one field read by methods of several families (e.g. the correctness reward)
                if f.name in annotations:
                    raise TypeError(f"{cls.__name__}.{f.name} comes from {registry.family}: remove it.")
                generated[f.name] = f
                annotations[f.name] = f.annotation()
                default = (
                    dataclasses.field(default_factory=lambda v=f.default: list(v))
                    if isinstance(f.default, list)
                    else dataclasses.field(default=f.default)
                )
                # only argparse keywords in the metadata: `HfArgumentParser` passes it to `add_argument`
                default.metadata = {"help": f.help.replace("%", "%%")}
                setattr(cls, f.name, default)
                families[f.name] = registry.family
            doc.append(_doc_section(registry))
        cls.__annotations__ = annotations
        cls.__doc__ = (cls.__doc__ or "") + "".join(doc)
        setattr(cls, METHOD_KEY, families)
        return cls

    return decorate


def _type_name(annotation: Any) -> str:
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "")


def _doc_section(registry: Registry) -> str:
    lines = [f"\n        > Fields declared by the `{registry.selector}` methods ({registry.description})\n"]
    for method in registry:
        for f in method.fields:
            if registry.readers(f.name)[0] is not method:
                continue  # shared fields are listed once, under their first reader
            readers = ", ".join(f"`{m.name}`" for m in registry.readers(f.name))
            lines.append(
                f"        {f.name} (`{_type_name(f.annotation())}`, *optional*, defaults to `{f.default!r}`):\n"
                f"            {f.help} Read by {readers}.\n"
            )
    return "\n" + "".join(lines)


def declared_field_names(config_cls: type) -> dict[str, str]:
    """``{field name: registry family}`` of the fields ``declare_fields`` generated on ``config_cls``."""
    return dict(getattr(config_cls, METHOD_KEY, {}))


_FAMILIES: dict[str, Registry] = {}

# Modules whose import registers methods. A family that lands adds its module here.
_METHOD_MODULES = (
    "hf_stable.losses.sft",
    "hf_stable.losses.advantages",
    "hf_stable.losses.aggregation",
    "hf_stable.losses.policy",
    "hf_stable.losses.reward_control",
    "hf_stable.losses.jacobian",
    "hf_stable.callbacks.snr_lr",
    "hf_stable.callbacks.declarations",
    "hf_stable.losses.unlearning",
    "hf_stable.trainers.unlearning.methods",
    "hf_stable.rewards",
    "hf_stable.merging.methods",
)


def _load_all() -> None:
    for module in _METHOD_MODULES:
        importlib.import_module(module)


def get_registry(family: str) -> Registry:
    """The registry of ``family``; raises ``ValueError`` listing the families otherwise."""
    _load_all()
    if family not in _FAMILIES:
        raise ValueError(f"Unknown method family {family!r}. Valid families: {', '.join(sorted(_FAMILIES))}.")
    return _FAMILIES[family]


def list_methods(family: str | None = None, file: TextIO | None = None) -> dict[str, list[str]]:
    """Print every registered method, grouped by family, and return ``{family: [names]}``.

    Args:
        family (`str`, *optional*):
            Only this family.
        file (text stream, *optional*, defaults to `sys.stdout`):
            Where to print.
    """
    _load_all()
    out = file or sys.stdout
    families = [get_registry(family)] if family is not None else [_FAMILIES[k] for k in sorted(_FAMILIES)]
    listing = {}
    for registry in families:
        print(f"{registry.family}:", file=out)
        for method in registry:
            print(f"  {method.name:<22} {method.paper_text}  <{method.url}>", file=out)
        listing[registry.family] = registry.names()
    return listing


__all__ = [
    "METHOD_KEY",
    "Field",
    "Method",
    "Registry",
    "Requires",
    "declare_fields",
    "declared_field_names",
    "get_registry",
    "list_methods",
]
