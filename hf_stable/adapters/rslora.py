"""rsLoRA tooling (Kalajdzievski, arXiv 2312.03732) on top of PEFT's `use_rslora`.

rsLoRA scales the adapter by `α/√r` instead of `α/r`: with `α/r` the update's outputs and gradients collapse as the
rank grows, so higher ranks stop helping. These helpers convert between the two at equal effective scale, generate
rank sweeps, and log the per-layer quantities the argument is about.
"""

from __future__ import annotations

import dataclasses
import math
import re

import torch
from transformers import TrainerCallback


def lora_scale(alpha: float, r: int, use_rslora: bool = False) -> float:
    """The adapter scale PEFT applies: `α/√r` with rsLoRA, `α/r` without."""
    return alpha / math.sqrt(r) if use_rslora else alpha / r


def rslora_alpha_from_lora(alpha: float, r: int) -> float:
    """rsLoRA α with the same effective scale as LoRA (α, r): `α/√r` (e.g. LoRA r=16, α=32 → scale 2 → α_rs = 8)."""
    return alpha / math.sqrt(r)


def lora_alpha_from_rslora(alpha: float, r: int) -> float:
    """LoRA α with the same effective scale as rsLoRA (α, r): `α·√r`."""
    return alpha * math.sqrt(r)


def rank_sweep(base_config, ranks=(8, 16, 32, 64, 128, 256), scale: float | None = None) -> list:
    """Copies of ``base_config`` at each rank with `use_rslora=True` and the same effective scale at every rank
    (``scale``, default: the base config's own). The point of rsLoRA is that one learning rate then fits every rank."""
    if scale is None:
        scale = lora_scale(base_config.lora_alpha, base_config.r, base_config.use_rslora)
    return [dataclasses.replace(base_config, r=r, lora_alpha=scale * math.sqrt(r), use_rslora=True) for r in ranks]


def _lora_layers(model, pattern: str | None):
    regex = re.compile(pattern) if pattern else None
    for name, module in model.named_modules():
        if hasattr(module, "lora_A") and hasattr(module, "scaling") and (regex is None or regex.search(name)):
            for adapter in module.lora_A:
                yield name, adapter, module


class AdapterScaleCallback(TrainerCallback):
    """Logs, per LoRA layer, the update-to-base ratio `‖s·BA‖_F / ‖W0‖_F` and the gradient norms of A and B, plus their
    mean and max over layers (`stable/adapters/...`). Gradients are read just before the optimizer step.

    Args:
        every (`int`, defaults to `10`): steps between measurements.
        per_layer (`bool`, defaults to `False`): also log every layer (many keys on a large model).
        pattern (`str`, *optional*): regex restricting the layers.
    """

    def __init__(self, every: int = 10, per_layer: bool = False, pattern: str | None = None):
        self.every, self.per_layer, self.pattern = every, per_layer, pattern
        self._grads: dict[str, tuple[float, float]] = {}
        self.history: list[dict[str, float]] = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if model is None or (state.global_step + 1) % self.every:
            return
        self._grads = {}
        for name, adapter, module in _lora_layers(model, self.pattern):
            ga, gb = module.lora_A[adapter].weight.grad, module.lora_B[adapter].weight.grad
            self._grads[f"{name}.{adapter}"] = (
                ga.float().norm().item() if ga is not None else 0.0,
                gb.float().norm().item() if gb is not None else 0.0,
            )

    @torch.no_grad()
    def measure(self, model) -> dict[str, float]:
        from ._quant import dequantized_weight

        ratios, out = [], {}
        for name, adapter, module in _lora_layers(model, self.pattern):
            a, b = module.lora_A[adapter].weight.float(), module.lora_B[adapter].weight.float()
            update = module.scaling[adapter] * (b @ a).norm().item()
            base = dequantized_weight(module.get_base_layer()).float().norm().item()
            ratio = update / max(base, 1e-12)
            ratios.append(ratio)
            if self.per_layer:
                key = f"stable/adapters/{name}.{adapter}"
                out[f"{key}/update_ratio"] = ratio
                if f"{name}.{adapter}" in self._grads:
                    out[f"{key}/grad_A"], out[f"{key}/grad_B"] = self._grads[f"{name}.{adapter}"]
        if ratios:
            out["stable/adapters/update_ratio_mean"] = sum(ratios) / len(ratios)
            out["stable/adapters/update_ratio_max"] = max(ratios)
        if self._grads:
            grads = list(self._grads.values())
            out["stable/adapters/grad_A_mean"] = sum(g[0] for g in grads) / len(grads)
            out["stable/adapters/grad_B_mean"] = sum(g[1] for g in grads) / len(grads)
        return out

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if model is None or state.global_step % self.every:
            return
        metrics = self.measure(model)
        self.history.append({"step": state.global_step, **metrics})
        self._pending = metrics

    def on_log(self, args, state, control, logs=None, **kwargs):
        # `Trainer.log` appends a copy of `logs` to the history just before this event: update both
        pending = getattr(self, "_pending", None)
        if logs is not None and pending:
            logs.update(pending)
            if state.log_history:
                state.log_history[-1].update(pending)
            self._pending = None
