"""Loading, checking and exporting hf_stable adapters.

`load_adapter` restores MAP and sine layers exactly (and TFB sampling when the folder has it). After `import
hf_stable`, `PeftModel.from_pretrained` / `AutoPeftModelForCausalLM` load them correctly too; without hf_stable,
stock PEFT refuses them (their saved `peft_type` is unknown to it, see `hf_stable._peft_hook`). `check_adapter` says
what a folder needs.
"""

from __future__ import annotations

import json
import logging
import os
import shutil

import torch

from .._adapter_variants import ADAPTER_VARIANTS, is_hf_stable_config


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
        `dict` with ``variants`` (subset of ``"map"``, ``"sine"``, ``"tfb"``), ``needs_hf_stable`` (whether loading it
        needs hf_stable: stock PEFT refuses MAP/sine folders and ignores the TFB sidecar), ``hf_stable_version`` (that
        saved it) and ``peft_type`` (as saved: `hf_stable._peft_hook.SAVED_PEFT_TYPE` for MAP/sine).
    """
    config = _read_config(path)
    variants = [name for name, key in ADAPTER_VARIANTS.items() if config.get(key)]
    if os.path.isfile(os.path.join(path, TFB_FILE)):
        variants.append("tfb")
    return {
        "variants": variants,
        "needs_hf_stable": bool(variants) or is_hf_stable_config(config),
        "hf_stable_version": config.get("hf_stable_version"),
        "peft_type": config.get("peft_type"),
    }


def load_adapter(base_model, path: str, adapter_name: str = "default", is_trainable: bool = False, **kwargs):
    """Load a LoRA adapter saved by hf_stable (or plain PEFT) onto ``base_model``, restoring MAP/sine layers and TFB
    sampling. Same keyword arguments as `PeftModel.from_pretrained`; works without the `import hf_stable` hook."""
    from peft import PeftConfig, PeftModel

    from .config import StableLoraConfig

    config = kwargs.pop("config", None)
    if config is None:
        saved = _read_config(path)
        if is_hf_stable_config(saved):
            config = StableLoraConfig.from_saved_dict(saved)
        else:
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


def merge_and_export(model, output_dir: str, tokenizer=None, safe_serialization: bool = True) -> dict:
    """Merge the active adapters into the base weights and save a plain `transformers` model; ``model`` is consumed
    (its layers are replaced, as with `merge_and_unload`).

    A 4-bit or 8-bit (bitsandbytes) base is dequantised first — merging into quantised weights would re-quantise the
    merged weight — and the export is full precision (fp32) without a `quantization_config`; this is logged and
    returned in the result. The folder is written under ``output_dir + ".tmp"`` and moved into place at the end, so
    an interrupted export leaves no half-written ``output_dir``.

    Returns:
        `dict` with ``output_dir`` and ``dequantized`` (bool).
    """
    from peft import PeftModel

    if not isinstance(model, PeftModel):
        raise TypeError(f"merge_and_export expects a PeftModel, got {type(model).__name__}.")
    dequantized = _is_quantized(model.get_base_model())
    if dequantized:
        logger.warning("The base model is quantised: dequantising it before merging; the export is full precision.")
        merged = _merge_dequantized(model)
    else:
        merged = model.merge_and_unload()
    output_dir = os.fspath(output_dir).rstrip("/\\")
    tmp = output_dir + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)  # left over from an interrupted export
    try:
        merged.save_pretrained(tmp, safe_serialization=safe_serialization)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if os.path.isdir(output_dir):
            shutil.rmtree(output_dir)
        os.replace(tmp, output_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"output_dir": output_dir, "dequantized": dequantized}


def _is_quantized(model) -> bool:
    if getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False):
        return True
    return any(_is_quantized_layer(m) for m in model.modules())


def _is_quantized_layer(module) -> bool:
    return type(module).__module__.startswith("bitsandbytes.")


@torch.no_grad()
def _merge_dequantized(model):
    """Rebuild every adapted quantised layer as a float `nn.Linear` holding its dequantised weight plus the active
    adapters' updates, each taken against that dequantised W0 (PEFT's own 4-bit merge would re-quantise the merged
    weight); let PEFT merge the rest (full-precision adapted layers, `modules_to_save`); dequantise the quantised
    layers that were not adapted. fp32 throughout."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    from ._quant import dequantized_weight

    def dense_from(base, weight):
        dense = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=base.bias is not None, device=weight.device)
        dense.weight.data = weight
        if base.bias is not None:
            dense.bias.data = base.bias.data.float()
        return dense

    def replace(root, select, build):
        for parent in list(root.modules()):
            for name, module in list(parent.named_children()):
                if select(module):
                    setattr(parent, name, build(module))

    def merged_dense(module):
        base = module.get_base_layer()
        w0 = dequantized_weight(base).float()
        weight = w0.clone()
        for adapter in module.active_adapters:
            if adapter not in module.lora_A:
                continue
            variant = module.lora_variant.get(adapter)
            if variant is None or hasattr(variant, "delta_weight"):  # plain LoRA, MAP: against the unmerged W0
                weight += module.get_delta_weight(adapter).float()
            else:  # other PEFT variants: what their merge adds to W0 alone
                weight += variant.merge_safe(module, adapter, w0.clone()).float() - w0
        return dense_from(base, weight)

    replace(model, lambda m: isinstance(m, BaseTunerLayer) and _is_quantized_layer(m.get_base_layer()), merged_dense)
    base_model = model.merge_and_unload()
    replace(base_model, _is_quantized_layer, lambda m: dense_from(m, dequantized_weight(m).float()))
    if hasattr(base_model.config, "quantization_config"):
        delattr(base_model.config, "quantization_config")
    for attr in ("hf_quantizer", "is_quantized", "is_loaded_in_4bit", "is_loaded_in_8bit", "quantization_method"):
        if attr in base_model.__dict__:
            delattr(base_model, attr)
    return base_model.float()
