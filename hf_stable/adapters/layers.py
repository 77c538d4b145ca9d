"""LoRA layer classes that know hf_stable's variants, registered through PEFT's custom-module hook.

PEFT resolves a layer's variant from the config fields tagged `is_lora_variant` and the layer's `lora_variants`
mapping (`peft/tuners/lora/layer.py: LoraLayer.resolve_lora_variant`); `LoraConfig._register_custom_module` makes PEFT
build these classes instead of its own (`peft/tuners/lora/model.py: LoraModel._create_new_module`). Combinations not
listed (e.g. MAP + DoRA) are refused by PEFT's resolver.
"""

from __future__ import annotations

import functools
import warnings

from peft.tuners.lora.layer import Linear as LoraLinear

from .._adapter_variants import ADAPTER_VARIANTS
from .bounded import SineLinearVariant
from .map import MapLinearVariant
from .svd import SvdLinearVariant, freeze_bases


# PEFT's `lora_variants` form: (config switch,) -> variant class; each class names its variant (`ADAPTER_VARIANTS`)
VARIANTS = {(ADAPTER_VARIANTS[cls.name],): cls for cls in (MapLinearVariant, SineLinearVariant, SvdLinearVariant)}


class _StableDeltaMixin:
    def get_delta_weight(self, adapter):
        # PEFT's version is `s·BA` whatever the variant; MAP, sine and SVD updates are not that
        variant = self.lora_variant.get(adapter)
        if isinstance(variant, (MapLinearVariant, SineLinearVariant, SvdLinearVariant)):
            return variant.delta_weight(self, adapter)
        return super().get_delta_weight(adapter)

    def set_adapter(self, adapter_names, inference_mode: bool = False) -> None:
        super().set_adapter(adapter_names, inference_mode=inference_mode)
        for name, variant in self.lora_variant.items():  # PEFT just made every `lora_*` of the active ones trainable
            if isinstance(variant, SvdLinearVariant):
                freeze_bases(self, name)


class StableLinear(_StableDeltaMixin, LoraLinear):
    """`peft.tuners.lora.Linear` plus the MAP and sine variants."""

    def __init__(self, base_layer, adapter_name, config, **kwargs):
        # PEFT's own dispatcher sets these for `nn.Linear` / GPT-2 `Conv1D`; the custom-module path does not
        fan_in_fan_out = _is_conv1d(base_layer)
        if config.fan_in_fan_out != fan_in_fan_out:
            warnings.warn(
                f"fan_in_fan_out={config.fan_in_fan_out} does not match the target "
                f"({type(base_layer).__name__}); setting it to {fan_in_fan_out}.",
                stacklevel=2,
            )
            config.fan_in_fan_out = fan_in_fan_out
        kwargs.setdefault("is_target_conv_1d_layer", fan_in_fan_out)
        super().__init__(base_layer, adapter_name, config=config, **kwargs)

    @property
    def lora_variants(self):
        return {**super().lora_variants, **VARIANTS}


def _is_conv1d(layer) -> bool:
    from peft.tuners.tuners_utils import BaseTunerLayer
    from transformers.pytorch_utils import Conv1D

    if isinstance(layer, BaseTunerLayer):
        layer = layer.get_base_layer()
    return isinstance(layer, Conv1D)


@functools.cache
def stable_linear_4bit():
    """The 4-bit layer class (built once, on first use: bitsandbytes is the optional `quant` extra)."""
    from peft.tuners.lora.bnb import Linear4bit

    from ._quant import unpack_cpu_4bit_

    class StableLinear4bit(_StableDeltaMixin, Linear4bit):
        """PEFT's bitsandbytes 4-bit LoRA layer plus MAP. MAP reads the dequantised weight; merging a MAP adapter
        into the 4-bit weight is refused (it would re-quantise the result): `merge_and_export` dequantises instead."""

        def resolve_lora_variant(self, *, config, **kwargs):
            if getattr(config, "use_svd", False):
                raise ValueError(
                    "`use_svd` is not supported on a 4-bit (bitsandbytes) base layer: its singular vectors would be "
                    "those of the dequantised weight, and a merge would re-quantise the result. Use MAP or plain "
                    "LoRA there, or a full-precision base."
                )
            if getattr(config, "use_sine", False):
                raise ValueError(
                    "`use_sine` is not supported on a 4-bit (bitsandbytes) base layer: its dense update would be "
                    "merged into, and rounded by, the quantised weight. Use MAP or plain LoRA there, or a "
                    "full-precision base."
                )
            if getattr(config, "use_map", False):
                return MapLinearVariant()
            return super().resolve_lora_variant(config=config, **kwargs)

        def merge(self, safe_merge: bool = False, adapter_names=None) -> None:
            names = self.active_adapters if adapter_names is None else adapter_names
            if any(isinstance(self.lora_variant.get(name), MapLinearVariant) for name in names):
                raise ValueError(
                    "A MAP adapter cannot be merged into a 4-bit weight: the merged weight would be re-quantised. Use "
                    "`hf_stable.adapters.merge_and_export`, which dequantises the base and exports full precision."
                )
            unpack_cpu_4bit_(self.get_base_layer())  # PEFT's merge would misread bitsandbytes' CPU repacking
            super().merge(safe_merge=safe_merge, adapter_names=adapter_names)

    StableLinear4bit.__module__ = __name__
    StableLinear4bit.__qualname__ = "StableLinear4bit"
    return StableLinear4bit


def _refusal(what: str):
    def refuse(target, adapter_name, config, **kwargs):
        raise ValueError(
            f"`use_map`/`use_sine`/`use_svd` support `nn.Linear`, GPT-2 `Conv1D` and 4-bit bitsandbytes layers "
            f"(`use_svd`: not 4-bit), not {what} "
            f"({type(target).__name__}); leave those out of `target_modules` or use a separate plain LoRA config."
        )

    return refuse


def custom_modules() -> dict:
    """`{target type: layer class}` for `_register_custom_module`. Quantised layers come first: bitsandbytes'
    `Linear4bit` and `Linear8bitLt` subclass `nn.Linear`, and PEFT takes the first `isinstance` match. Layer types the
    variants do not implement get a clear refusal instead of PEFT's "unsupported variant combination"."""
    import torch.nn as nn
    from transformers.pytorch_utils import Conv1D

    mapping = {}
    try:
        import bitsandbytes as bnb
    except ImportError:  # the optional `quant` extra
        pass
    else:
        mapping[bnb.nn.Linear4bit] = stable_linear_4bit()
        mapping[bnb.nn.Linear8bitLt] = _refusal("8-bit bitsandbytes layers")
    mapping[nn.Linear] = StableLinear
    mapping[Conv1D] = StableLinear
    mapping[nn.Embedding] = _refusal("embeddings")
    mapping[nn.modules.conv._ConvNd] = _refusal("convolutions")
    return mapping


def __getattr__(name: str):
    if name == "StableLinear4bit":  # importable (and picklable) by name once bitsandbytes is installed
        return stable_linear_4bit()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
