"""Name -> method registries, one per family.

Every method hf_stable implements is a pure function registered under a snake_case name with the paper it comes
from, in the style of mergekit's ``@merge_method`` decorator and verl's ``register_policy_loss``. Configs validate
their string fields against these registries, so a typo fails early with the list of valid names.

This module imports nothing heavy: it is loaded by ``import hf_stable``.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO


@dataclass(frozen=True)
class Method:
    """A registered method: the callable plus what a user needs to find its source."""

    name: str
    family: str
    fn: Callable[..., Any]
    paper: str
    url: str
    description: str = ""
    defaults: dict[str, Any] = field(default_factory=dict)

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


class Registry:
    """Maps names to [`Method`]s for one family (for example ``"sft_objective"``).

    Example:
    ```python
    >>> SFT_OBJECTIVES = Registry("sft_objective")
    >>> @SFT_OBJECTIVES.register("nll", paper="Maximum likelihood", url="")
    ... def nll(log_probs, mask): ...
    >>> SFT_OBJECTIVES.get("nlll")
    ValueError: Unknown sft_objective 'nlll'. Valid names: nll.
    ```
    """

    def __init__(self, family: str, description: str = ""):
        self.family = family
        self.description = description
        self._methods: dict[str, Method] = {}
        _FAMILIES[family] = self

    def register(self, name: str, *, paper: str, url: str, description: str = "", **defaults) -> Callable:
        """Decorator registering ``fn`` under ``name``; re-registering a name is an error."""

        def decorator(fn: Callable) -> Callable:
            if name in self._methods:
                raise ValueError(f"{self.family} '{name}' is already registered.")
            self._methods[name] = Method(name, self.family, fn, paper, url, description, dict(defaults))
            return fn

        return decorator

    def get(self, name: str) -> Method:
        """The method called ``name``; raises ``ValueError`` listing the valid names otherwise."""
        try:
            return self._methods[name]
        except (KeyError, TypeError):
            raise ValueError(f"Unknown {self.family} {name!r}. Valid names: {', '.join(self.names())}.") from None

    def names(self) -> list[str]:
        return list(self._methods)

    def __contains__(self, name: object) -> bool:
        return name in self._methods

    def __iter__(self):
        return iter(self._methods.values())

    def __len__(self) -> int:
        return len(self._methods)


_FAMILIES: dict[str, Registry] = {}

# Modules whose import registers methods. A family that lands adds its module here.
_METHOD_MODULES = (
    "hf_stable.losses.sft",
    "hf_stable.losses.advantages",
    "hf_stable.losses.aggregation",
    "hf_stable.losses.policy",
    "hf_stable.losses.reward_weighting",
    "hf_stable.losses.unlearning",
    "hf_stable.trainers._unlearn_methods",
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
            print(f"  {method.name:<22} {method.paper}  <{method.url}>", file=out)
        listing[registry.family] = registry.names()
    return listing
