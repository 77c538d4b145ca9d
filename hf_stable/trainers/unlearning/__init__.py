"""Unlearning: `UnlearningTrainer` and `UnlearningConfig` (forget a set of examples, keep the rest).

Modules: ``methods`` (each method declared once), ``config``, ``trainer``, ``data`` (rows, pairs, collator),
``targets`` (DMM target distributions, `precompute_dmm_targets`), ``reference`` (the starting model as a reference),
``multigrad`` (the multi-gradient step), ``checks`` (refusals at construction), ``card`` (the model card).
Names are imported on first access, so reading the method declarations does not import transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING


_EXPORTS = {
    "UNLEARNING_METHODS": "methods",
    "UnlearningConfig": "config",
    "UnlearningTrainer": "trainer",
    "precompute_dmm_targets": "targets",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:
    from .config import UnlearningConfig as UnlearningConfig
    from .methods import UNLEARNING_METHODS as UNLEARNING_METHODS
    from .targets import precompute_dmm_targets as precompute_dmm_targets
    from .trainer import UnlearningTrainer as UnlearningTrainer
