"""Optimiser parameter groups for MAP adapters (used by the hf_stable trainers' `create_optimizer`)."""

from __future__ import annotations

import torch

from .map import MapLinearVariant


def map_parameter_names(model: torch.nn.Module) -> tuple[set[str], set[str]]:
    """Names of MAP parameters: `(scalars, factors)` — the `lora_map_a/b` scalars and the A, B of MAP layers."""
    scalars, factors = set(), set()
    for prefix, module in model.named_modules():
        variants = getattr(module, "lora_variant", None)
        if not isinstance(variants, dict):
            continue
        for adapter, variant in variants.items():
            if not isinstance(variant, MapLinearVariant):
                continue
            scalars.update(f"{prefix}.lora_map_{ab}.{adapter}" for ab in ("a", "b"))
            factors.update(f"{prefix}.lora_{ab}.{adapter}.weight" for ab in ("A", "B"))
    return scalars, factors


def map_scalar_lr(model: torch.nn.Module) -> float | None:
    """`map_scalar_lr` of the model's MAP adapter config(s), or None (use the trainer's learning rate)."""
    configs = getattr(model, "peft_config", {}) or {}
    rates = {c.map_scalar_lr for c in configs.values() if getattr(c, "use_map", False) and c.map_scalar_lr}
    if len(rates) > 1:
        raise ValueError(f"MAP adapters on one model disagree on `map_scalar_lr`: {sorted(rates)}.")
    return rates.pop() if rates else None


def split_map_scalar_group(optimizer: torch.optim.Optimizer, model: torch.nn.Module, lr: float) -> int:
    """Move the MAP scalars out of the optimiser's groups into their own group (learning rate `lr`, no weight
    decay). Call before the first step and before the LR scheduler is built. Returns how many were moved."""
    scalars, _ = map_parameter_names(model)
    wanted = {id(p) for name, p in model.named_parameters() if name in scalars and p.requires_grad}
    if not wanted:
        return 0
    moved = []
    for group in optimizer.param_groups:
        keep = [p for p in group["params"] if id(p) not in wanted]
        moved += [p for p in group["params"] if id(p) in wanted]
        group["params"] = keep
    optimizer.param_groups[:] = [g for g in optimizer.param_groups if g["params"]]
    optimizer.add_param_group({"params": moved, "lr": lr, "weight_decay": 0.0})
    return len(moved)
