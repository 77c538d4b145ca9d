"""MAP / LoMAP as a PEFT LoRA variant (Si et al., arXiv 2505.23094).

MAP writes the fine-tuned weight as a learned magnitude of the base direction plus a learned magnitude of the update
direction, with `ΔW = B A` the LoRA update:

    W' = α · W0/‖W0‖_F + β · ΔW/‖ΔW‖_F

Parameterised without units: `α = ‖W0‖_F (1 + a)`, `β = ‖W0‖_F · b` with trainable scalars `a`, `b` (both 0 at
initialisation, so `W' = W0` exactly), which lets one learning rate fit layers of any size. The forward never forms
`ΔW`: `‖BA‖_F² = tr((BᵀB)(AAᵀ))` needs two r×r Gram matrices. B starts small and random, not zero: with `B = 0`
the update direction is undefined and every gradient through it is 0, a deadlock. The LoRA scaling `lora_alpha/r`
(or `/√r`) cancels in `ΔW/‖ΔW‖`, so `lora_alpha` and `use_rslora` do nothing under MAP.
"""

from __future__ import annotations

import torch
from peft.tuners.lora.layer import LoraVariant
from peft.utils.other import transpose

from ._quant import dequantized_weight


MAP_PARAMS = ("lora_map_a", "lora_map_b")
NORM_FLOOR = 1e-12


def gram_frobenius_norm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`‖B A‖_F` from `A (r, n)` and `B (m, r)` without forming `BA`: `sqrt(Σ (BᵀB) ⊙ (AAᵀ))`, fp32, floored."""
    a, b = a.float(), b.float()
    trace = ((b.T @ b) * (a @ a.T)).sum()
    return trace.clamp(min=0).sqrt().clamp(min=NORM_FLOOR)


def map_weight(w0: torch.Tensor, a: torch.Tensor, b: torch.Tensor, map_a, map_b, w0_norm) -> torch.Tensor:
    """The dense MAP weight `(1 + a) W0 + ‖W0‖ b · BA/‖BA‖` (reference and merge). `W0 (m, n)`, `A (r, n)`,
    `B (m, r)`."""
    update = (b.float() @ a.float()) / gram_frobenius_norm(a, b)
    return (1 + map_a) * w0.float() + w0_norm * map_b * update


class MapLinearVariant(LoraVariant):
    """PEFT variant implementing MAP on `nn.Linear` (and bitsandbytes 4-bit) LoRA layers."""

    def supports_lora_conversion(self) -> bool:
        return False  # W' - W0 holds the full-rank term a·W0: only merged export

    @staticmethod
    def init(module, adapter_name: str, **kwargs) -> None:
        config = kwargs.get("config")
        if not hasattr(module, "lora_map_a"):
            module.lora_map_a = torch.nn.ParameterDict({})
            module.lora_map_b = torch.nn.ParameterDict({})
            module.adapter_layer_names = (*module.adapter_layer_names, *MAP_PARAMS)
            module._map_w0_norm = {}
        device = module.lora_A[adapter_name].weight.device
        module.lora_map_a[adapter_name] = torch.nn.Parameter(torch.zeros((), device=device))
        module.lora_map_b[adapter_name] = torch.nn.Parameter(torch.zeros((), device=device))
        with torch.no_grad():  # a constant of the layer: never part of the graph
            w0 = dequantized_weight(module.get_base_layer())
            module._map_w0_norm[adapter_name] = w0.detach().float().norm().item()
            std = getattr(config, "map_init_b_std", 1e-3)
            module.lora_B[adapter_name].weight.normal_(0.0, std)

    @staticmethod
    def _coefficients(module, adapter):
        a_w, b_w = module.lora_A[adapter].weight, module.lora_B[adapter].weight
        return module.lora_map_a[adapter], module._map_w0_norm[adapter] * module.lora_map_b[adapter] / (
            gram_frobenius_norm(a_w, b_w)
        )

    @staticmethod
    def _delta(module, adapter, w0: torch.Tensor) -> torch.Tensor:
        """`W' - W0` in the weight's layout (transposed for `fan_in_fan_out`), fp32."""
        map_a, coef = MapLinearVariant._coefficients(module, adapter)
        ba = module.lora_B[adapter].weight.float() @ module.lora_A[adapter].weight.float()
        return map_a * w0.float() + coef * transpose(ba, module.fan_in_fan_out)

    @staticmethod
    def merge_safe(module, active_adapter: str, orig_weight: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return (orig_weight.float() + MapLinearVariant._delta(module, active_adapter, orig_weight)).to(
                orig_weight.dtype
            )

    @staticmethod
    def merge_unsafe(module, active_adapter: str, orig_weight: torch.Tensor) -> None:
        orig_weight.data = MapLinearVariant.merge_safe(module, active_adapter, orig_weight.data)

    @staticmethod
    def unmerge(module, active_adapter: str, orig_weight: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            map_a, coef = MapLinearVariant._coefficients(module, active_adapter)
            ba = module.lora_B[active_adapter].weight.float() @ module.lora_A[active_adapter].weight.float()
            w0 = (orig_weight.float() - coef * transpose(ba, module.fan_in_fan_out)) / (1 + map_a)
            return w0.to(orig_weight.dtype)

    @staticmethod
    def forward(module, active_adapter: str, x: torch.Tensor, result: torch.Tensor, **kwargs) -> torch.Tensor:
        lora_a, lora_b = module.lora_A[active_adapter], module.lora_B[active_adapter]
        dropout = module.lora_dropout[active_adapter]
        map_a, coef = MapLinearVariant._coefficients(module, active_adapter)
        bias = getattr(module.get_base_layer(), "bias", None)
        base = result if bias is None else result - bias  # W0 x: only the weight term is rescaled
        update = lora_b(lora_a(dropout(x)))
        return result + map_a.to(result.dtype) * base + coef.to(result.dtype) * update.to(result.dtype)
