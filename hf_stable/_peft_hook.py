"""Makes stock PEFT load hf_stable adapters correctly once `hf_stable` is imported.

PEFT builds an adapter's config with `PeftConfigMixin.from_peft_type`, which drops unknown keys with a warning, so a
saved MAP or sine adapter would silently come back as plain LoRA (`use_map` dropped) with wrong outputs. hf_stable
wraps that classmethod: configs carrying an hf_stable variant become `StableLoraConfig`, which registers the layers
that implement the variant. `import hf_stable` must stay cheap, so nothing here imports peft: if peft is already
loaded the wrapper is installed at once, otherwise a one-shot import hook installs it right after `peft.config` runs.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys


TARGET = "peft.config"
# The one list of hf_stable's LoRA variants: name -> the `StableLoraConfig` switch (`is_lora_variant`) that selects it.
# Kept here because this module must not import peft; `hf_stable.adapters` derives everything else from it.
ADAPTER_VARIANTS = {"map": "use_map", "sine": "use_sine"}
VARIANT_KEYS = tuple(ADAPTER_VARIANTS.values())


def _wrap(config_module) -> None:
    mixin = config_module.PeftConfigMixin
    if getattr(mixin.from_peft_type, "_hf_stable", False):
        return
    original = mixin.from_peft_type.__func__

    def from_peft_type(cls, **kwargs):
        if any(kwargs.get(key) for key in VARIANT_KEYS):
            from .adapters.config import StableLoraConfig  # imported at call time: peft is fully loaded by then

            return StableLoraConfig.from_saved_dict(kwargs)
        return original(cls, **kwargs)

    from_peft_type._hf_stable = True
    mixin.from_peft_type = classmethod(from_peft_type)


class _LoaderWrapper(importlib.abc.Loader):
    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        _wrap(module)


class _PeftConfigFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != TARGET:
            return None
        sys.meta_path.remove(self)  # one shot, and no recursion into ourselves
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _LoaderWrapper(spec.loader)
        return spec


def install() -> None:
    if TARGET in sys.modules:
        _wrap(sys.modules[TARGET])
    elif not any(isinstance(f, _PeftConfigFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _PeftConfigFinder())
