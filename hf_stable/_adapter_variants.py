"""The one list of hf_stable's LoRA variants and the markers their saved configs carry.

Kept apart from `hf_stable.adapters` because `import hf_stable` reads it (through `hf_stable._peft_hook`) and must not
import peft or torch: `hf_stable.adapters` and the PEFT hook both derive everything else from it.
"""

from __future__ import annotations


# name -> the `StableLoraConfig` switch (`is_lora_variant`) that selects it
ADAPTER_VARIANTS = {"map": "use_map", "sine": "use_sine", "svd": "use_svd"}
VARIANT_KEYS = tuple(ADAPTER_VARIANTS.values())
# `peft_type` written for MAP/sine adapters: unknown to stock PEFT, so its lookup fails with this text as the message
SAVED_PEFT_TYPE = (
    "LORA+hf_stable: a MAP/sine adapter, load it with hf_stable (pip install hf-stable; import hf_stable)"
)
PEFT_TYPE = "LORA"


def is_hf_stable_config(values: dict) -> bool:
    """Whether a saved adapter config dictionary needs hf_stable (an hf_stable variant, or the saved marker)."""
    return values.get("peft_type") == SAVED_PEFT_TYPE or any(values.get(key) for key in VARIANT_KEYS)
