"""Reward functions named in configs: a registry name of hf_stable or TRL, or a dotted import path."""

from __future__ import annotations

import importlib
import os
import sys


def resolve_reward_function(name: str):
    """The reward function called ``name``: hf_stable's `REWARD_FUNCTIONS`, then `trl.rewards`, then an import path
    such as ``my_lib.rewards.correct`` (the current directory is importable, as in TRL's script)."""
    from . import REWARD_FUNCTIONS

    if name in REWARD_FUNCTIONS:
        method = REWARD_FUNCTIONS.get(name)
        if "refused" in method.extra:  # a reward that needs something only the user has (a judge model)
            raise ValueError(method.extra["refused"])
        return method.fn
    import trl.rewards

    if not name.startswith("_") and callable(getattr(trl.rewards, name, None)):
        return getattr(trl.rewards, name)
    if "." in name:
        module_path, attr = name.rsplit(".", 1)
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            return getattr(importlib.import_module(module_path), attr)
        except (ImportError, AttributeError) as error:
            raise ValueError(f"Could not import reward function {name!r}: {error}") from error
    trl_names = [n for n in dir(trl.rewards) if not n.startswith("_") and callable(getattr(trl.rewards, n))]
    raise ValueError(
        f"Unknown reward function {name!r}. Valid names: {', '.join(REWARD_FUNCTIONS.names() + trl_names)}, or a "
        "dotted import path such as 'my_lib.rewards.correct'."
    )
