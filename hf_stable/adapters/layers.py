"""LoRA layer classes that know hf_stable's variants, registered through PEFT's custom-module hook.

PEFT resolves a layer's variant from the config fields tagged `is_lora_variant` and the layer's `lora_variants`
mapping (`peft/tuners/lora/layer.py: LoraLayer.resolve_lora_variant`); `LoraConfig._register_custom_module` makes PEFT
build these classes instead of its own (`peft/tuners/lora/model.py: LoraModel._create_new_module`). Combinations not
listed (e.g. MAP + DoRA) are refused by PEFT's resolver.
"""

from __future__ import annotations

from peft.tuners.lora.layer import Linear as LoraLinear

from .bounded import SineLinearVariant
from .map import MapLinearVariant


VARIANTS = {("use_map",): MapLinearVariant, ("use_sine",): SineLinearVariant}


class StableLinear(LoraLinear):
    """`peft.tuners.lora.Linear` plus the MAP and sine variants."""

    @property
    def lora_variants(self):
        return {**super().lora_variants, **VARIANTS}

    def get_delta_weight(self, adapter):
        if adapter in self.lora_variant and isinstance(self.lora_variant[adapter], SineLinearVariant):
            return SineLinearVariant.delta(self, adapter)
        return super().get_delta_weight(adapter)


def custom_modules() -> dict:
    """`{target type: layer class}` for `_register_custom_module`; 4-bit layers first (they subclass `nn.Linear`)."""
    import torch.nn as nn

    mapping = {}
    try:
        import bitsandbytes as bnb
        from peft.tuners.lora.bnb import Linear4bit

        class StableLinear4bit(Linear4bit):
            """PEFT's bitsandbytes 4-bit LoRA layer plus MAP (reads the dequantised weight, merges dequantised)."""

            def resolve_lora_variant(self, *, config, **kwargs):
                if getattr(config, "use_sine", False):
                    raise ValueError("use_sine is not supported on a 4-bit base layer; use MAP or plain LoRA there.")
                if getattr(config, "use_map", False):
                    return MapLinearVariant()
                return super().resolve_lora_variant(config=config, **kwargs)

        mapping[bnb.nn.Linear4bit] = StableLinear4bit
    except ImportError:  # bitsandbytes is the optional `quant` extra
        pass
    mapping[nn.Linear] = StableLinear
    return mapping
