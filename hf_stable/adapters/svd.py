"""Singular-value fine-tuning (CLOVER; Meng, Tang, Jiang, Zhang, arXiv 2411.17426) as a PEFT LoRA variant.

Each target weight is decomposed once, in fp32, `W0 = U diag(S) Vᵀ`. The singular vectors U (out×r) and Vᵀ (r×in)
are frozen orthonormal bases and only a change of the singular values is trained:

    W' = W0 + U diag(δ) Vᵀ = U diag(S + δ) Vᵀ          (`svd_trainable="diagonal"`, δ ∈ ℝʳ, 0 at initialisation)
    W' = W0 + U M Vᵀ                                    (`svd_trainable="matrix"`, M ∈ ℝʳˣʳ, 0 at initialisation)

The update stays inside the span of the base weight's own singular vectors ("constraining learning within its
original latent space"), and with `r = min(out, in)` it is a full-rank update. The frozen bases are stored in PEFT's
`lora_B` (U) and `lora_A` (Vᵀ) and saved with the adapter, so a reload never recomputes an SVD whose signs or
round-off could differ; the trained part is `lora_svd_delta`. At initialisation the update is exactly 0, so the
model is bit-for-bit the base model; merge adds `U diag(δ) Vᵀ` (to fp32 round-off: `U diag(S+δ) Vᵀ`), unmerge
subtracts it.

What is reconstructed, and how it differs from the paper: the paper (and its public code, `GraphPKU/CLOVER:
utils/clover_finetuning.py`) decomposes *pairs* of layers per attention head — Q·Kᵀ and V·O absorbed, then SVD, or
a per-head QR for Q/K — and trains a head_dim×head_dim block per head initialised at the singular values (or R).
A PEFT layer variant sees one layer, not a pair (and rotary embeddings sit between Q and K), so here each target
layer is decomposed on its own; `svd_trainable="matrix"` is the code's full block (linear combinations of the
frozen vectors), `"diagonal"` is the abstract's "fine-tune only the singular values". The LoRA scale
`lora_alpha/r` is not applied (the paper has none): δ is in the units of the singular values.
"""

from __future__ import annotations

import torch
from peft.tuners.lora.layer import LoraVariant
from peft.utils.other import transpose

from ._quant import dequantized_weight


SVD_PARAMS = ("lora_svd_delta",)
SVD_TRAINABLE = ("diagonal", "matrix")


def svd_bases(weight: torch.Tensor, r: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(U (m, r), S (r,), Vᵀ (r, n))` of `weight (m, n)` in fp32, the leading `min(r, m, n)` singular triplets; rows
    or columns past `min(m, n)` are zero (they carry no direction, so their δ has no effect)."""
    u, s, vh = torch.linalg.svd(weight.detach().float(), full_matrices=False)
    k = min(r, s.shape[0])
    m, n = weight.shape
    big_u, big_s, big_vh = u.new_zeros(m, r), s.new_zeros(r), vh.new_zeros(r, n)
    big_u[:, :k], big_s[:k], big_vh[:k] = u[:, :k], s[:k], vh[:k]
    return big_u, big_s, big_vh


def svd_update(u: torch.Tensor, delta: torch.Tensor, vh: torch.Tensor) -> torch.Tensor:
    """`U diag(δ) Vᵀ` (δ of shape `(r,)`) or `U M Vᵀ` (M of shape `(r, r)`), `(m, n)` fp32."""
    u, delta, vh = u.float(), delta.float(), vh.float()
    middle = u * delta if delta.dim() == 1 else u @ delta
    return middle @ vh


class SvdLinearVariant(LoraVariant):
    """PEFT variant implementing singular-value fine-tuning (arXiv 2411.17426) on `nn.Linear` and GPT-2 `Conv1D`."""

    name = "svd"

    def supports_lora_conversion(self) -> bool:
        return False  # not exercised here; the frozen bases are not a trainable LoRA pair

    @staticmethod
    def init(module, adapter_name: str, **kwargs) -> None:
        config = kwargs.get("config")
        layer = kwargs.get("target_name") or "a target layer"
        if module.merged:
            raise ValueError(
                f"Cannot add an SVD adapter to {layer} while adapters {module.merged_adapters} are merged into it: "
                "the singular vectors must come from the base weight. Unmerge first."
            )
        if not hasattr(module, "lora_svd_delta"):
            module.lora_svd_delta = torch.nn.ParameterDict({})
            module.adapter_layer_names = (*module.adapter_layer_names, *SVD_PARAMS)
        lora_a, lora_b = module.lora_A[adapter_name].weight, module.lora_B[adapter_name].weight
        r = lora_a.shape[0]
        with torch.no_grad():
            weight = transpose(dequantized_weight(module.get_base_layer()).detach().float(), module.fan_in_fan_out)
            if not torch.isfinite(weight).all():
                raise ValueError(f"SVD adapters need a finite base weight, but {layer} has inf/NaN entries.")
            u, _, vh = svd_bases(weight, r)
            lora_a.copy_(vh.to(lora_a.dtype))
            lora_b.copy_(u.to(lora_b.dtype))
        mode = getattr(config, "svd_trainable", "diagonal")
        shape = (r,) if mode == "diagonal" else (r, r)
        module.lora_svd_delta[adapter_name] = torch.nn.Parameter(torch.zeros(shape, device=lora_a.device))
        freeze_bases(module, adapter_name)

    @staticmethod
    def delta_weight(module, adapter: str) -> torch.Tensor:
        """`U diag(δ) Vᵀ` (or `U M Vᵀ`) in the weight's layout (transposed for `fan_in_fan_out`), fp32; independent
        of the base weight."""
        update = svd_update(
            module.lora_B[adapter].weight, module.lora_svd_delta[adapter], module.lora_A[adapter].weight
        )
        return transpose(update, module.fan_in_fan_out)

    @staticmethod
    def merge_safe(module, active_adapter: str, orig_weight: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            merged = orig_weight.float() + SvdLinearVariant.delta_weight(module, active_adapter)
            return merged.to(orig_weight.dtype)

    @staticmethod
    def merge_unsafe(module, active_adapter: str, orig_weight: torch.Tensor) -> None:
        orig_weight.data = SvdLinearVariant.merge_safe(module, active_adapter, orig_weight.data)

    @staticmethod
    def unmerge(module, active_adapter: str, orig_weight: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            restored = orig_weight.float() - SvdLinearVariant.delta_weight(module, active_adapter)
            return restored.to(orig_weight.dtype)

    @staticmethod
    def forward(module, active_adapter: str, x: torch.Tensor, result: torch.Tensor, **kwargs) -> torch.Tensor:
        a, b = module.lora_A[active_adapter].weight, module.lora_B[active_adapter].weight
        delta = module.lora_svd_delta[active_adapter]
        dropout = module.lora_dropout[active_adapter]
        # the rank-r path, never the dense update: project on V, scale by δ (or mix by M), map back with U
        hidden = torch.nn.functional.linear(dropout(x).to(a.dtype), a)
        delta = delta.to(a.dtype)
        hidden = hidden * delta if delta.dim() == 1 else torch.nn.functional.linear(hidden, delta)
        return result + torch.nn.functional.linear(hidden, b).to(result.dtype)


def freeze_bases(module, adapter: str) -> None:
    """U and Vᵀ never train: PEFT's `set_adapter` marks every `lora_*` tensor of an active adapter trainable, so the
    layer calls this again after it."""
    module.lora_A[adapter].weight.requires_grad_(False)
    module.lora_B[adapter].weight.requires_grad_(False)
