"""safetensors dtype strings: their sizes (torch-free) and their torch dtypes (torch imported on use).

Shared by the header parser (no torch), the reader and the writer, so neither has to import the other for it.
"""

from __future__ import annotations

import functools
from typing import Any


# Bytes per element for every byte-aligned safetensors dtype that torch can hold. Sub-byte dtypes (F4, F6_*) are
# refused: a row of them need not start on a byte boundary, and torch has no general dtype for them.
DTYPE_ITEMSIZE: dict[str, int] = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "F8_E4M3": 1,
    "F8_E4M3FNUZ": 1,
    "F8_E5M2": 1,
    "F8_E5M2FNUZ": 1,
    "F8_E8M0": 1,
    "C64": 8,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U64": 8,
    "U32": 4,
    "U16": 2,
    "U8": 1,
    "BOOL": 1,
}

# safetensors dtype string → torch dtype attribute name.
TORCH_NAMES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",  # safetensors' F8_E4M3 is the "fn" variant (no inf), as in safetensors.torch
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2": "float8_e5m2",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F8_E8M0": "float8_e8m0fnu",
    "C64": "complex64",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U64": "uint64",
    "U32": "uint32",
    "U16": "uint16",
    "U8": "uint8",
    "BOOL": "bool",
}


@functools.cache
def torch_dtypes() -> dict[str, Any]:
    """safetensors dtype string → torch dtype, for the dtypes this torch build has (each torch dtype once)."""
    import torch

    return {k: getattr(torch, v) for k, v in TORCH_NAMES.items() if hasattr(torch, v) and k in DTYPE_ITEMSIZE}


def torch_dtype(dtype: str) -> Any:
    """The torch dtype for a safetensors dtype string; `ValueError` naming the supported ones otherwise."""
    table = torch_dtypes()
    try:
        return table[dtype]
    except KeyError:
        raise ValueError(f"safetensors dtype {dtype!r} has no torch dtype here (supported: {sorted(table)})") from None
