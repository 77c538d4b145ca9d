"""MAP / LoMAP as a PEFT LoRA variant (Si, Shi, Wang, Yang, Rahardja, Shen; arXiv 2505.23094).

MAP writes the fine-tuned weight as a learned magnitude of the base direction plus a learned magnitude of the update
direction, with `ΔW = B A` the LoRA update:

    W' = α · W0/‖W0‖_F + β · ΔW/‖ΔW‖_F

Parameterised without units: `α = ‖W0‖_F (1 + a)`, `β = ‖W0‖_F · b` with trainable scalars `a`, `b` (both 0 at
initialisation, so `W' = W0` exactly), which lets one learning rate fit layers of any size. The forward never forms
`ΔW`: `‖BA‖_F² = tr((BᵀB)(AAᵀ))` needs two r×r Gram matrices. B starts small and random, not zero: with `B = 0`
the update direction is undefined and every gradient through it is 0, a deadlock. The LoRA scaling `lora_alpha/r`
(or `/√r`) cancels in `ΔW/‖ΔW‖`, so `lora_alpha` and `use_rslora` do nothing under MAP.

Several adapters on one layer add up, as LoRA adapters do: each MAP adapter contributes `a·W0 + β·BA/‖BA‖` against
the *unmerged* base weight W0, whatever else is active or merged. Forward, merge and unmerge all follow that rule, so
the order of the active adapters does not matter and merging reproduces the forward.
"""

from __future__ import annotations

import torch
from peft.tuners.lora.layer import LoraVariant
from peft.utils.other import transpose

from ._quant import dequantized_weight
from .bounded import SineLinearVariant
from .svd import SvdLinearVariant


MAP_PARAMS = ("lora_map_a", "lora_map_b")
NORM_FLOOR = 1e-12


def gram_frobenius_norm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`‖B A‖_F` from `A (r, n)` and `B (m, r)` without forming `BA`: `sqrt(Σ (BᵀB) ⊙ (AAᵀ))`, fp32, floored."""
    a, b = a.float(), b.float()
    trace = ((b.T @ b) * (a @ a.T)).sum()
    # Floor before the sqrt: round-off can push the trace of a near-zero product below 0, and at BA = 0 the sqrt's
    # infinite derivative times the floor's zero one would turn every gradient into NaN.
    return trace.clamp(min=NORM_FLOOR**2).sqrt()


def _merged_decomposition(module, adapters) -> tuple[float | torch.Tensor, torch.Tensor | float]:
    """`(scale, offset)` with `weight = scale · W0 + offset` for the base weight holding `adapters` merged, fp32 and in
    the weight's layout. MAP adapters scale W0; plain LoRA, sine and SVD adapters only add a term independent of W0."""
    scale, offset = 1.0, 0.0
    for name in adapters:
        if name not in module.lora_A:
            continue
        variant = module.lora_variant.get(name)
        if variant is None:
            offset = offset + module.get_delta_weight(name).float()
        elif isinstance(variant, MapLinearVariant):
            map_a, _ = MapLinearVariant._coefficients(module, name)
            scale = scale + map_a
            offset = offset + MapLinearVariant._update(module, name)
        elif isinstance(variant, (SineLinearVariant, SvdLinearVariant)):
            offset = offset + variant.delta_weight(module, name)
        else:
            raise NotImplementedError(
                f"Cannot merge or unmerge a MAP adapter while adapter {name!r} ({type(variant).__name__}) is merged "
                "into the same layer: its update depends on the base weight in a way MAP cannot invert. Unmerge it "
                "first."
            )
    return scale, offset


UNMERGE_MIN_SCALE = 1e-3


def _solve_base(weight: torch.Tensor, scale, offset) -> torch.Tensor:
    if isinstance(offset, float) and isinstance(scale, float) and scale == 1.0:
        return weight  # nothing merged: the common case stays bit-exact
    if abs(float(scale)) < UNMERGE_MIN_SCALE:
        # training can drive 1 + a through 0 (the base direction flipped); W0 is then not recoverable
        raise ValueError(
            f"Cannot unmerge this MAP adapter: the merged weight holds W0 scaled by (1 + a) = {float(scale):.2e}, "
            "too close to 0 to solve for W0. Reload the base weights instead, or use `merge_and_unload` / "
            "`hf_stable.adapters.merge_and_export`, which never unmerge."
        )
    return (weight - offset) / scale


class MapLinearVariant(LoraVariant):
    """PEFT variant implementing MAP (arXiv 2505.23094) on `nn.Linear`, GPT-2 `Conv1D` and bitsandbytes 4-bit LoRA
    layers."""

    name = "map"

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
        # A constant of the layer, never part of the graph. Taken from the unmerged weight so that a reload (which
        # always sees the unmerged weight) gets the same value.
        with torch.no_grad():
            weight = dequantized_weight(module.get_base_layer()).detach().float()
            if module.merged:
                weight = _solve_base(weight, *_merged_decomposition(module, module.merged_adapters))
            norm = weight.norm().item()
            if not norm > 0 or norm == float("inf"):
                layer = kwargs.get("target_name") or "a target layer"
                raise ValueError(
                    f"MAP needs a finite, nonzero base weight, but {layer} has ‖W0‖_F = {norm}: the update term "
                    "β = ‖W0‖·b would stay 0."
                )
            module._map_w0_norm[adapter_name] = norm
            std = getattr(config, "map_init_b_std", 1e-3)
            module.lora_B[adapter_name].weight.normal_(0.0, std)

    @staticmethod
    def _coefficients(module, adapter):
        """`(a, β/‖BA‖)` as fp32 scalars: the base-weight gain and the coefficient of `BA`."""
        a_w, b_w = module.lora_A[adapter].weight, module.lora_B[adapter].weight
        map_a, map_b = module.lora_map_a[adapter].float(), module.lora_map_b[adapter].float()
        return map_a, module._map_w0_norm[adapter] * map_b / gram_frobenius_norm(a_w, b_w)

    @staticmethod
    def _update(module, adapter) -> torch.Tensor:
        """`β · BA/‖BA‖_F` in the weight's layout (transposed for `fan_in_fan_out`), fp32."""
        _, coef = MapLinearVariant._coefficients(module, adapter)
        ba = module.lora_B[adapter].weight.float() @ module.lora_A[adapter].weight.float()
        return coef * transpose(ba, module.fan_in_fan_out)

    @staticmethod
    def delta_weight(module, adapter: str) -> torch.Tensor:
        """`W' - W0 = a·W0 + β·BA/‖BA‖` against the unmerged base weight, in the weight's layout, fp32."""
        weight = dequantized_weight(module.get_base_layer()).detach().float()
        w0 = _solve_base(weight, *_merged_decomposition(module, module.merged_adapters))
        map_a, _ = MapLinearVariant._coefficients(module, adapter)
        return map_a * w0 + MapLinearVariant._update(module, adapter)

    @staticmethod
    def merge_safe(module, active_adapter: str, orig_weight: torch.Tensor) -> torch.Tensor:
        # `merge` appends the adapter to `merged_adapters` only afterwards, so the list holds exactly what is in
        # `orig_weight` already
        with torch.no_grad():
            weight = orig_weight.float()
            w0 = _solve_base(weight, *_merged_decomposition(module, module.merged_adapters))
            map_a, _ = MapLinearVariant._coefficients(module, active_adapter)
            merged = weight + map_a * w0 + MapLinearVariant._update(module, active_adapter)
            return merged.to(orig_weight.dtype)

    @staticmethod
    def merge_unsafe(module, active_adapter: str, orig_weight: torch.Tensor) -> None:
        orig_weight.data = MapLinearVariant.merge_safe(module, active_adapter, orig_weight.data)

    @staticmethod
    def unmerge(module, active_adapter: str, orig_weight: torch.Tensor) -> torch.Tensor:
        # `unmerge` has already popped the adapter from `merged_adapters`: the weight holds those plus this one.
        # Solving for W0 divides by (1 + Σa): exact to round-off in fp32, lossy in bf16.
        with torch.no_grad():
            rest = list(module.merged_adapters)
            w0 = _solve_base(orig_weight.float(), *_merged_decomposition(module, [*rest, active_adapter]))
            if rest:
                scale, offset = _merged_decomposition(module, rest)
                w0 = scale * w0 + offset
            return w0.to(orig_weight.dtype)

    @staticmethod
    def forward(module, active_adapter: str, x: torch.Tensor, result: torch.Tensor, **kwargs) -> torch.Tensor:
        lora_a, lora_b = module.lora_A[active_adapter], module.lora_B[active_adapter]
        dropout = module.lora_dropout[active_adapter]
        map_a, coef = MapLinearVariant._coefficients(module, active_adapter)
        base_layer = module.get_base_layer()
        first = next((name for name in module.active_adapters if name in module.lora_A), None)
        if first == active_adapter:
            # `result` is still the base layer's output: reuse it (only the weight term is rescaled, not the bias)
            bias = getattr(base_layer, "bias", None)
            base = result if bias is None else result - bias
        else:
            # earlier adapters already changed `result`; MAP scales W0 x alone, so recompute it (the rare case)
            weight = transpose(dequantized_weight(base_layer), module.fan_in_fan_out)
            base = torch.nn.functional.linear(x, weight.to(x.dtype))
        # β/‖BA‖ scales the rank-r activation, not B's output: autograd then keeps an r-wide tensor for it instead
        # of an out_features-wide one (MAP's activation memory is then LoRA's plus one output-sized tensor, for a)
        hidden = lora_a(dropout(x))
        update = lora_b((hidden.float() * coef).to(hidden.dtype))
        # coefficients are fp32; the extra output is formed in fp32 and cast once, as with a bf16 base
        extra = map_a * base.float() + update.float()
        return result + extra.to(result.dtype)
