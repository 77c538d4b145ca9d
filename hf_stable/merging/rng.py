"""Counter-based random numbers for DARE masks: the value at an element depends only on its key, never on tiling.

`uniform(seed, model_index, tensor_name, start, n)` returns the uniforms of elements `start … start+n−1` of a
tensor. Any split of the tensor into tiles gives bitwise the same numbers, so the streaming engine reproduces the
in-memory merge exactly and a merge is reproducible from its seed.

Construction: the stream key (seed lo/hi, model index, CRC-32 of the tensor name) is folded with Chris Wellons'
`lowbias32` integer hash into 64 bits; element j of the stream is SplitMix64's output function (Steele, Lea, Flood
2014: two xor-shift-multiply rounds and a final xor-shift) of the Weyl state `key + j · 0x9E3779B97F4A7C15`, computed
on whole int64 tensors (torch's int64 products wrap modulo 2^64; right shifts are made logical by masking). That is
six vectorised passes per element, about the cost of `torch.bernoulli`. The output is the top 32 bits; uniforms are
multiples of 2^-32 in [0, 1) and `keep_mask` compares integers, so P(keep) = round(p·2^32)/2^32 exactly. Streams of
different keys are offsets of one Weyl sequence by a pseudo-random 64-bit amount, so two tensors of n elements share
an element's state with probability about n²/2^64.
"""

from __future__ import annotations

import zlib

import torch


_M32 = 0xFFFFFFFF
_C1 = 0x7FEB352D  # lowbias32 multipliers
_C2 = 0x846CA68B
_GOLDEN = 0x9E3779B9


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


_SM_MUL1 = 0xBF58476D1CE4E5B9 - (1 << 64)  # SplitMix64 multipliers, as signed int64
_SM_MUL2 = 0x94D049BB133111EB - (1 << 64)
_WEYL = 0x9E3779B97F4A7C15 - (1 << 64)


def _signed64(x: int) -> int:
    x &= 0xFFFFFFFFFFFFFFFF
    return x - (1 << 64) if x >= 1 << 63 else x


def _xorshift_(x: torch.Tensor, k: int) -> torch.Tensor:
    """`x ^= x >>> k` (logical shift of the 64-bit pattern) in place."""
    return x.bitwise_xor_(x.bitwise_right_shift(k).bitwise_and_((1 << (64 - k)) - 1))


def random_bits(seed: int, model_index: int, tensor_name: str, start: int, n: int) -> torch.Tensor:
    """`(n,)` int64 in [0, 2^32): SplitMix64 of the (seed, model, tensor) stream at element index start+j."""
    key = stream_key(seed, model_index, tensor_name)
    key64 = _signed64((key << 32) | _hash32_int(key ^ _GOLDEN))
    x = torch.arange(start, start + n, dtype=torch.int64)
    x.mul_(_WEYL).add_(key64)
    _xorshift_(x, 30).mul_(_SM_MUL1)
    _xorshift_(x, 27).mul_(_SM_MUL2)
    _xorshift_(x, 31)
    return x.bitwise_right_shift_(32).bitwise_and_(_M32)


def uniform(seed: int, model_index: int, tensor_name: str, start: int, n: int) -> torch.Tensor:
    """`(n,)` float64 uniforms in [0, 1) (multiples of 2^-32) for elements `start … start+n−1`."""
    return random_bits(seed, model_index, tensor_name, start, n).to(torch.float64) * (2.0**-32)


def keep_mask(seed: int, model_index: int, tensor_name: str, start: int, n: int, p: float) -> torch.Tensor:
    """`(n,)` bool Bernoulli(p) keep mask: `bits < round(p·2^32)` (p = 1 keeps everything, p = 0 nothing)."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"keep probability (density) must be in [0, 1], got {p}.")
    threshold = round(p * 2.0**32)
    return random_bits(seed, model_index, tensor_name, start, n) < threshold
