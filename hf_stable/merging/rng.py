"""Counter-based random numbers for DARE masks: the value at an element depends only on its key, never on tiling.

`uniform(seed, model_index, tensor_name, start, n)` returns the uniforms of elements `start … start+n−1` of a
tensor. Any split of the tensor into tiles gives bitwise the same numbers, so the streaming engine reproduces the
in-memory merge exactly and a merge is reproducible from its seed.

Construction: every 32-bit word of the key (seed lo/hi, model index, CRC-32 of the tensor name, element index
lo/hi) is folded in with Chris Wellons' `lowbias32` integer hash (an avalanche mixer in the family of MurmurHash3's
`fmix32`). All arithmetic is on non-negative int64 values below 2^32: products are split into 16-bit halves so
nothing overflows int64, and right shifts of non-negative values are logical. The output is 32 bits; uniforms are
multiples of 2^-32 in [0, 1) and `keep_mask` compares integers, so P(keep) = round(p·2^32)/2^32 exactly.
"""

from __future__ import annotations

import zlib

import torch


_M32 = 0xFFFFFFFF
_C1 = 0x7FEB352D  # lowbias32 multipliers
_C2 = 0x846CA68B
_GOLDEN = 0x9E3779B9


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """`(x · c) mod 2^32` for int64 `x` in [0, 2^32) without int64 overflow (c split into 16-bit halves)."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on int64 tensors holding 32-bit values."""
    x = x ^ (x >> 16)
    x = _mul32(x, _C1)
    x = x ^ (x >> 15)
    x = _mul32(x, _C2)
    return x ^ (x >> 16)


def _hash32_int(x: int) -> int:
    x &= _M32
    x ^= x >> 16
    x = (x * _C1) & _M32
    x ^= x >> 15
    x = (x * _C2) & _M32
    return x ^ (x >> 16)


def name_key(tensor_name: str) -> int:
    """CRC-32 of the UTF-8 tensor name."""
    return zlib.crc32(tensor_name.encode("utf-8")) & _M32


def stream_key(seed: int, model_index: int, tensor_name: str) -> int:
    """32-bit key of the stream (seed, model, tensor)."""
    seed = int(seed) & 0xFFFFFFFFFFFFFFFF
    h = _hash32_int((seed & _M32) ^ _GOLDEN)
    h = _hash32_int(h ^ (seed >> 32))
    h = _hash32_int(h ^ (int(model_index) & _M32))
    return _hash32_int(h ^ name_key(tensor_name))


def random_bits(seed: int, model_index: int, tensor_name: str, start: int, n: int) -> torch.Tensor:
    """`(n,)` int64 in [0, 2^32): hash of (seed, model, tensor, element index start+j)."""
    key = stream_key(seed, model_index, tensor_name)
    idx = torch.arange(start, start + n, dtype=torch.int64)
    lo, hi = idx & _M32, idx >> 32
    x = _hash32(lo ^ key)
    # The high word of the index is folded in after a first round, so indices ≥ 2^32 get fresh streams.
    return _hash32(x ^ ((hi + _GOLDEN) & _M32))


def uniform(seed: int, model_index: int, tensor_name: str, start: int, n: int) -> torch.Tensor:
    """`(n,)` float64 uniforms in [0, 1) (multiples of 2^-32) for elements `start … start+n−1`."""
    return random_bits(seed, model_index, tensor_name, start, n).to(torch.float64) * (2.0**-32)


def keep_mask(seed: int, model_index: int, tensor_name: str, start: int, n: int, p: float) -> torch.Tensor:
    """`(n,)` bool Bernoulli(p) keep mask: `bits < round(p·2^32)` (p = 1 keeps everything, p = 0 nothing)."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"keep probability (density) must be in [0, 1], got {p}.")
    threshold = round(p * 2.0**32)
    return random_bits(seed, model_index, tensor_name, start, n) < threshold
