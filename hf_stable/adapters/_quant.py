"""Dequantising a (possibly bitsandbytes-quantised) base layer's weight."""

from __future__ import annotations

import torch
from peft.utils.integrations import dequantize_module_weight


def dequantized_weight(base: torch.nn.Module) -> torch.Tensor:
    """The base layer's weight as a float tensor `(out, in)`, whatever its storage.

    bitsandbytes ≥ 0.48 repacks a 4-bit weight in place for its CPU kernel on the first no-grad eval forward
    (`quant_state.packing_format_for_cpu`); PEFT's `dequantize_module_weight` then decodes the repacked bytes as if
    they were canonical and returns a wrong weight. Undo the packing first, as bitsandbytes' own
    `Linear4bit._save_to_state_dict` does; the next eval forward repacks.
    """
    weight = getattr(base, "weight", None)
    state = getattr(weight, "quant_state", None)
    if state is not None and getattr(state, "packing_format_for_cpu", False):
        from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse

        weight.data, weight.quant_state = _convert_weight_packed_for_cpu_inverse(weight.data, state)
    return dequantize_module_weight(base)
