"""Bounded (sine) LoRA adapters as a PEFT LoRA variant, for stable unlearning.

Gradient difference (descent on retained data, ascent on forgotten data) makes weights and gradients grow without
bound, and the growth sits in the MLP layers ("Stable Forgetting", arXiv 2509.24166). Passing the low-rank product
through a sine (Sine-LoRA, Ji et al., ICLR 2025; `samy-ji/Sine-Low-Rank: sinlora.py`) bounds every entry:

    ΔW = s · sin(ω · B A) / g,        |ΔW_ij| ≤ s / g,        s = lora_alpha / r,  g = √in_features

whatever A and B become, and the Jacobian `s (ω/g) cos(ω BA)` is bounded too. B = 0 at initialisation (ΔW = 0).
`ΔW` is formed densely in each forward (the cost: one weight-sized matrix per adapted layer).
"""

from __future__ import annotations

import math

import torch
from peft.tuners.lora.layer import LoraVariant
from peft.utils.other import transpose


def sine_delta(a: torch.Tensor, b: torch.Tensor, scaling: float, freq: float, gain: float) -> torch.Tensor:
    """`s · sin(ω B A) / g`, `(m, n)` fp32. The argument `ω·BA` is formed in fp32: a large ω amplifies round-off."""
    return scaling * torch.sin(freq * (b.float() @ a.float())) / gain


def sine_gain(config, in_features: int) -> float:
    g = getattr(config, "sine_g", "sqrt_in")
    return math.sqrt(in_features) if g == "sqrt_in" else float(g)


class SineLinearVariant(LoraVariant):
    """PEFT variant implementing the sine-bounded update on `nn.Linear` LoRA layers."""

    name = "sine"

    def supports_lora_conversion(self) -> bool:
        return False  # sin(ωBA) is not low rank

    @staticmethod
    def init(module, adapter_name: str, **kwargs) -> None:
        config = kwargs.get("config")
        if not hasattr(module, "_sine"):
            module._sine = {}
        module._sine[adapter_name] = (float(config.sine_freq), sine_gain(config, module.in_features))

    @staticmethod
    def delta_weight(module, adapter: str) -> torch.Tensor:
        """`ΔW` in the weight's layout (transposed for `fan_in_fan_out`), fp32; independent of the base weight."""
        freq, gain = module._sine[adapter]
        d = sine_delta(
            module.lora_A[adapter].weight, module.lora_B[adapter].weight, module.scaling[adapter], freq, gain
        )
        return transpose(d, module.fan_in_fan_out)

    @staticmethod
    def merge_safe(module, active_adapter: str, orig_weight: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return (orig_weight.float() + SineLinearVariant.delta_weight(module, active_adapter)).to(orig_weight.dtype)

    @staticmethod
    def merge_unsafe(module, active_adapter: str, orig_weight: torch.Tensor) -> None:
        orig_weight.data = SineLinearVariant.merge_safe(module, active_adapter, orig_weight.data)

    @staticmethod
    def unmerge(module, active_adapter: str, orig_weight: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return (orig_weight.float() - SineLinearVariant.delta_weight(module, active_adapter)).to(orig_weight.dtype)

    @staticmethod
    def forward(module, active_adapter: str, x: torch.Tensor, result: torch.Tensor, **kwargs) -> torch.Tensor:
        dropout = module.lora_dropout[active_adapter]
        freq, gain = module._sine[active_adapter]
        a, b = module.lora_A[active_adapter].weight, module.lora_B[active_adapter].weight
        delta = sine_delta(a, b, module.scaling[active_adapter], freq, gain).to(x.dtype)  # (out, in)
        return result + torch.nn.functional.linear(dropout(x), delta).to(result.dtype)
