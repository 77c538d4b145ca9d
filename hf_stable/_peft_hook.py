"""Makes stock PEFT load hf_stable adapters correctly once `hf_stable` is imported, and refuse them loudly without.

Saved format: a MAP or sine adapter's `adapter_config.json` carries `peft_type` = `SAVED_PEFT_TYPE` instead of
`"LORA"`. Stock PEFT looks that value up in its registry (`PEFT_TYPE_TO_CONFIG_MAPPING`) before building anything,
so `PeftModel.from_pretrained`, `AutoPeftModel*`, `model.load_adapter` and hot-swapping raise a `KeyError` that
names hf_stable, where a plain `"LORA"` file would silently load as plain LoRA (PEFT drops the unknown `use_map`
key with only a "higher version" warning) with wrong outputs.

After `import hf_stable`, two classmethods of `peft.config.PeftConfigMixin` are wrapped: `_get_peft_type` reads the
marker as `"LORA"`, and `from_peft_type` builds configs that carry the marker or an hf_stable variant as
`StableLoraConfig`, which registers the layers that implement the variant. `import hf_stable` must stay cheap, so
nothing here imports peft: if peft is already loaded the wrappers are installed at once, otherwise a one-shot import
hook installs them right after `peft.config` runs.

The hook runs inside PEFT's own import, so it must never break it: if those internals have moved (a PEFT release
outside the pinned range), it warns once, naming the lost feature, and leaves PEFT as it is. MAP/sine folders then
fail loudly in PEFT's loaders (the `peft_type` marker), and `hf_stable.adapters.load_adapter` still loads them.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import warnings

# the variants and markers live below `hf_stable.adapters`, which this hook imports when PEFT loads a config;
# re-exported here, where earlier code read them
from ._adapter_variants import (  # noqa: F401
    ADAPTER_VARIANTS,
    PEFT_TYPE,
    SAVED_PEFT_TYPE,
    VARIANT_KEYS,
    is_hf_stable_config,
)


TARGET = "peft.config"
LOST_FEATURE = (
    "loading MAP/sine adapters through PEFT's own loaders (`PeftModel.from_pretrained`, `AutoPeftModel*`, "
    "`model.load_adapter`): they will raise; `hf_stable.adapters.load_adapter` still loads them"
)
_warned = False


def _warn_lost(error: BaseException) -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(
            f"hf_stable could not hook PEFT's config loading ({type(error).__name__}: {error}); lost: {LOST_FEATURE}. "
            "This PEFT version is outside the range hf_stable supports.",
            stacklevel=2,
        )


def _wrap(config_module) -> None:
    try:
        _install_wrappers(config_module)
    except Exception as error:  # PEFT's internals moved: never break `import peft`
        _warn_lost(error)


def _install_wrappers(config_module) -> None:
    mixin = config_module.PeftConfigMixin
    if getattr(mixin.from_peft_type, "_hf_stable", False):
        return
    # both found before either is replaced: half a hook would load configs it cannot resolve
    original = mixin.from_peft_type.__func__
    original_type = mixin._get_peft_type.__func__

    def from_peft_type(cls, **kwargs):
        if is_hf_stable_config(kwargs):
            from .adapters.config import StableLoraConfig  # imported at call time: peft is fully loaded by then

            return StableLoraConfig.from_saved_dict(kwargs)
        return original(cls, **kwargs)

    def _get_peft_type(cls, model_id, **kwargs):
        peft_type = original_type(cls, model_id, **kwargs)
        return PEFT_TYPE if peft_type == SAVED_PEFT_TYPE else peft_type

    from_peft_type._hf_stable = _get_peft_type._hf_stable = True
    mixin._get_peft_type = classmethod(_get_peft_type)
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
        try:
            spec = importlib.util.find_spec(fullname)
        except Exception as error:  # the ordinary import then reports the problem itself
            _warn_lost(error)
            return None
        if spec is not None and spec.loader is not None:
            spec.loader = _LoaderWrapper(spec.loader)
        return spec


def install() -> None:
    if TARGET in sys.modules:
        _wrap(sys.modules[TARGET])
    elif not any(isinstance(f, _PeftConfigFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _PeftConfigFinder())
