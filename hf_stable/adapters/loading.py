"""Loading, checking and exporting hf_stable adapters.

`load_adapter` restores MAP and sine layers exactly (and TFB sampling when the folder has it). After `import
hf_stable`, `PeftModel.from_pretrained` / `AutoPeftModelForCausalLM` load them correctly too (see
`hf_stable._peft_hook`); without hf_stable, stock PEFT would silently load plain LoRA — `check_adapter` says what a
folder needs.
"""

from __future__ import annotations

import json
import logging
import os

import torch


logger = logging.getLogger(__name__)

CONFIG_FILE = "adapter_config.json"
TFB_FILE = "hf_stable_tfb.json"


def _read_config(path: str) -> dict:
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(file):
        raise FileNotFoundError(f"No {CONFIG_FILE} in {path}: not a PEFT adapter folder.")
    with open(file, encoding="utf-8") as f:
        return json.load(f)


def check_adapter(path: str) -> dict:
    """Which hf_stable variants an adapter folder needs.

    Returns:
        `dict` with ``variants`` (subset of ``"map"``, ``"sine"``, ``"tfb"``), ``needs_hf_stable`` (whether stock PEFT
        would load it wrongly), ``hf_stable_version`` (that saved it) and ``peft_type``.
    """
    config = _read_config(path)
    variants = [name for key, name in (("use_map", "map"), ("use_sine", "sine")) if config.get(key)]
    if os.path.isfile(os.path.join(path, TFB_FILE)):
        variants.append("tfb")
    return {
        "variants": variants,
        "needs_hf_stable": bool(variants),
        "hf_stable_version": config.get("hf_stable_version"),
        "peft_type": config.get("peft_type"),
    }


def load_adapter(base_model, path: str, adapter_name: str = "default", is_trainable: bool = False, **kwargs):
    """Load a LoRA adapter saved by hf_stable (or plain PEFT) onto ``base_model``, restoring MAP/sine layers and TFB
    sampling. Same keyword arguments as `PeftModel.from_pretrained`."""
    from peft import PeftConfig, PeftModel

    from .config import StableLoraConfig

    saved = _read_config(path)
    config = StableLoraConfig.from_saved_dict(saved) if check_adapter(path)["variants"] else None
    if config is None:
        config = PeftConfig.from_pretrained(path)
    model = PeftModel.from_pretrained(
        base_model, path, adapter_name=adapter_name, is_trainable=is_trainable, config=config, **kwargs
    )
    tfb_file = os.path.join(path, TFB_FILE)
    if os.path.isfile(tfb_file):
        from .tfb import TfbSampler

        with open(tfb_file, encoding="utf-8") as f:
            state = json.load(f)
        model.tfb_sampler = TfbSampler(model, sigma=state["sigma"], noise=state.get("noise", "flipout_token"))
    return model


def merge_and_export(model, output_dir: str, tokenizer=None, safe_serialization: bool = True):
    """Merge the adapters into the base weights and save a plain `transformers` model.

    A 4-bit (bitsandbytes) base is dequantised first — merging into quantised weights would add rounding error — and
    the export is full precision; this is logged and returned in the result.

    Returns:
        `dict` with ``output_dir`` and ``dequantized`` (bool).
    """
    from peft import PeftModel

    if not isinstance(model, PeftModel):
        raise TypeError(f"merge_and_export expects a PeftModel, got {type(model).__name__}.")
    base = model.get_base_model()
    dequantized = bool(getattr(base, "is_loaded_in_4bit", False) or getattr(base, "is_loaded_in_8bit", False))
    if dequantized:
        logger.warning("The base model is quantised: dequantising it before merging; the export is full precision.")
        merged = _merge_dequantized(model)
    else:
        merged = model.merge_and_unload()
    tmp = output_dir.rstrip("/") + ".tmp"
    merged.save_pretrained(tmp, safe_serialization=safe_serialization)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    if os.path.isdir(output_dir):
        import shutil

        shutil.rmtree(output_dir)
    os.replace(tmp, output_dir)
    return {"output_dir": output_dir, "dequantized": dequantized}


@torch.no_grad()
def _merge_dequantized(model):
    """Rebuild every adapted layer as a float `nn.Linear` holding its dequantised weight plus the merged adapter, and
    every other quantised layer as its dequantised float copy (fp32 throughout). PEFT's own 4-bit merge would
    re-quantise the merged weight."""
    from ._quant import dequantized_weight

    def dense_from(base, weight):
        dense = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=base.bias is not None)
        dense.weight.data = weight
        if base.bias is not None:
            dense.bias.data = base.bias.data.float()
        return dense

    for parent in list(model.modules()):
        for name, module in list(parent.named_children()):
            if hasattr(module, "lora_A") and hasattr(module, "get_base_layer"):
                base = module.get_base_layer()
                weight = dequantized_weight(base).float()
                for adapter in module.active_adapters:
                    if adapter not in module.lora_A:
                        continue
                    if adapter in module.lora_variant:
                        weight = module.lora_variant[adapter].merge_safe(module, adapter, weight).float()
                    else:
                        weight = weight + module.get_delta_weight(adapter).float()
                setattr(parent, name, dense_from(base, weight))
            elif type(module).__name__ in ("Linear4bit", "Linear8bitLt"):  # quantised but not adapted
                setattr(parent, name, dense_from(module, dequantized_weight(module).float()))
    base_model = model.get_base_model()
    base_model.config.__dict__.pop("quantization_config", None)
    for attr in ("hf_quantizer", "is_quantized", "is_loaded_in_4bit", "is_loaded_in_8bit", "quantization_method"):
        if attr in base_model.__dict__:
            delattr(base_model, attr)
    return base_model.float()
