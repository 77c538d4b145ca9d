"""Exact k-th largest |x| over a tensor streamed in chunks (the magnitude thresholds of TIES and breadcrumbs).

For non-negative IEEE floats the order of the values equals the order of their bit patterns read as integers. So
the k-th largest |x| (as float32) is found by radix selection on the 31 value bits:

* pass 1: histogram of the high 15 bits (bits 30..16; 32768 bins), pick the bin holding the k-th largest;
* pass 2: histogram of the low 16 bits (65536 bins) of the elements in that bin, pick the exact pattern.

Two passes over the data, memory O(chunk + 65536 bins), any chunking gives the same answer, and it equals
`torch.topk(|x|.float(), k).values[-1]` (ties included). Inputs are compared as float32 (bf16/fp16 embed exactly).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch


_HIGH_BINS = 1 << 15
_LOW_BINS = 1 << 16


def _abs_bits(chunk: torch.Tensor) -> torch.Tensor:
    """int64 bit patterns of |chunk| as float32 (flattened); NaN raises."""
    a = chunk.detach().reshape(-1).to(torch.float32).abs()
    if torch.isnan(a).any():
        raise ValueError("kth_largest_abs: input contains NaN.")
    return a.view(torch.int32).to(torch.int64)


def _select(hist: torch.Tensor, k: int) -> tuple[int, int]:
    """Bin holding the k-th largest (1-based from the top) and how many elements lie in higher bins."""
    above = torch.flip(torch.cumsum(torch.flip(hist, [0]), 0), [0])  # above[b] = count in bins ≥ b
    b = int(torch.nonzero(above >= k).max())  # highest bin with ≥ k elements at or above it
    higher = int(above[b + 1]) if b + 1 < hist.numel() else 0
    return b, higher


def kth_largest_abs(chunks: Callable[[], Iterable[torch.Tensor]], k: int) -> float:
    """Exact k-th largest absolute value over all chunks.

    Args:
        chunks: a callable returning a fresh iterable of tensors (any shapes) each time it is called; it is called
            twice (one call per pass).
        k: 1-based rank. `k <= 0` returns `inf` (keep nothing); `k` larger than the element count raises.

    Returns:
        The k-th largest |x| as a Python float (a float32 value): keeping `|x| >= result` keeps at least k elements
        and exactly k when the values are distinct.
    """
    if k <= 0:
        return float("inf")
    hist = torch.zeros(_HIGH_BINS, dtype=torch.int64)
    total = 0
    for chunk in chunks():
        bits = _abs_bits(chunk)
        total += bits.numel()
        hist += torch.bincount(bits >> 16, minlength=_HIGH_BINS)
    if k > total:
        raise ValueError(f"kth_largest_abs: k={k} exceeds the number of elements ({total}).")
    high, above = _select(hist, k)
    hist = torch.zeros(_LOW_BINS, dtype=torch.int64)
    for chunk in chunks():
        bits = _abs_bits(chunk)
        sel = bits[(bits >> 16) == high]
        if sel.numel():
            hist += torch.bincount(sel & 0xFFFF, minlength=_LOW_BINS)
    low, _ = _select(hist, k - above)
    pattern = torch.tensor([(high << 16) | low], dtype=torch.int32)
    return float(pattern.view(torch.float32)[0])


class RadixSelect:
    """The k-th largest values (several ranks at once) of non-negative finite float32 scores streamed twice
    (for |x|, pass `x.abs()`).

    Usage: `add_high(chunk)` for every chunk, `finish_high()`, `add_low(chunk)` for every chunk (same chunks, any
    chunking), `result()` → one float per rank (`inf` for k ≤ 0). Same values as `kth_largest_abs`. The caller
    guarantees finite scores (the engine checks its inputs first); bins are counted with int32 arithmetic only.
    """

    def __init__(self, ks):
        self.ks = [int(k) for k in ks]
        self.hist = torch.zeros(_HIGH_BINS, dtype=torch.int64)
        self.total = 0
        self.high: dict[int, tuple[int, int]] = {}
        self.low: dict[int, torch.Tensor] = {}

    @staticmethod
    def _bits(scores: torch.Tensor) -> torch.Tensor:
        """int32 bit patterns of non-negative float32 scores (their order is the order of the values)."""
        return scores.detach().reshape(-1).to(torch.float32).view(torch.int32)

    def add_high(self, scores: torch.Tensor) -> None:
        bits = self._bits(scores)
        self.total += bits.numel()
        self.hist += torch.bincount(bits >> 16, minlength=_HIGH_BINS)

    def finish_high(self) -> None:
        for k in self.ks:
            if k > self.total:
                raise ValueError(f"kth_largest_abs: k={k} exceeds the number of elements ({self.total}).")
            if k > 0:
                self.high[k] = _select(self.hist, k)
        self.low = {b: torch.zeros(_LOW_BINS, dtype=torch.int64) for b, _ in self.high.values()}

    def add_low(self, scores: torch.Tensor) -> None:
        bits = self._bits(scores)
        for b, hist in self.low.items():
            # low 16 bits of the entries in high bin b, shifted by one; every other entry lands in bin 0 or
            # _LOW_BINS + 1 (dropped): one bincount, no boolean indexing
            idx = (bits - ((b << 16) - 1)).clamp_(0, _LOW_BINS + 1)
            hist += torch.bincount(idx, minlength=_LOW_BINS + 2)[1 : _LOW_BINS + 1]

    def result(self) -> list[float]:
        out = []
        for k in self.ks:
            if k <= 0:
                out.append(float("inf"))
                continue
            high, above = self.high[k]
            low, _ = _select(self.low[high], k - above)
            pattern = torch.tensor([(high << 16) | low], dtype=torch.int32)
            out.append(float(pattern.view(torch.float32)[0]))
        return out


def kth_largest_abs_tensor(x: torch.Tensor, k: int) -> float:
    """In-memory equivalent: `torch.topk(|x|, k).values[-1]` in float32 (`inf` for k ≤ 0)."""
    if k <= 0:
        return float("inf")
    a = x.detach().reshape(-1).to(torch.float32).abs()
    if k > a.numel():
        raise ValueError(f"kth_largest_abs_tensor: k={k} exceeds the number of elements ({a.numel()}).")
    # the k-th largest is the (n-k+1)-th smallest; kthvalue is ~3x faster than topk for k ~ n/2 and returns the same
    return float(torch.kthvalue(a, a.numel() - k + 1).values)
