"""Dequantising a (possibly bitsandbytes-quantised) base layer's weight.

bitsandbytes ≥ 0.48 repacks a 4-bit weight in place for its CPU kernel on the first no-grad eval forward
(`quant_state.packing_format_for_cpu`): the nibbles are reordered, the block scales (`absmax`) are transposed and
rounded to bf16, a double-quantised `absmax` is expanded. PEFT's `dequantize_module_weight` then decodes the repacked
bytes as if they were canonical and returns a wrong weight, and bitsandbytes' own inverse
(`_convert_weight_packed_for_cpu_inverse`, 0.50) leaves a single-quantised `absmax` transposed. The bf16 rounding
cannot be undone: after repacking, the layer's weight *is* the one with bf16 block scales (within ~2⁻⁹ relative of
the loaded one), and that is what is decoded here.
"""

from __future__ import annotations

import copy

import torch
from peft.utils.integrations import dequantize_module_weight


def _is_cpu_packed(weight) -> bool:
    return bool(getattr(getattr(weight, "quant_state", None), "packing_format_for_cpu", False))


def _canonical_4bit(weight) -> tuple[torch.Tensor, object]:
    """`(qweight, quant_state)` in bitsandbytes' canonical layout for a CPU-repacked 4-bit weight; the layer's own
    tensors and state are left untouched."""
    from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse

    state = weight.quant_state
    # the inverse writes into the state it is given: hand it a copy, and use it for the nibble layout only
    qweight, _ = _convert_weight_packed_for_cpu_inverse(weight.data, copy.copy(state))
    canonical = copy.copy(state)
    canonical.absmax = state.absmax.T.reshape(-1).float()  # (K/blocksize, N) bf16 after repacking
    canonical.nested, canonical.offset, canonical.state2 = False, None, None
    canonical.dtype = state.original_dtype
    canonical.packing_format_for_cpu = False
    return qweight, canonical


def dequantized_weight(base: torch.nn.Module) -> torch.Tensor:
    """The base layer's weight as a float tensor `(out, in)`, whatever its storage; never modifies the layer."""
    weight = getattr(base, "weight", None)
    if _is_cpu_packed(weight):
        from bitsandbytes.functional import dequantize_4bit

        return dequantize_4bit(*_canonical_4bit(weight))
    return dequantize_module_weight(base)


def unpack_cpu_4bit_(base: torch.nn.Module) -> None:
    """Put a CPU-repacked 4-bit weight back into the canonical layout, in place, so that code reading the canonical
    layout (PEFT's 4-bit merge) decodes it correctly; the next no-grad eval forward repacks it."""
    weight = getattr(base, "weight", None)
    if _is_cpu_packed(weight):
        weight.data, weight.quant_state = _canonical_4bit(weight)
