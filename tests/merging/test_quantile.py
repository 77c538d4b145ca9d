"""Exact streamed k-th largest |x| against torch.topk, for every chunking."""

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_stable.merging.quantile import kth_largest_abs, kth_largest_abs_tensor


def _chunker(x, cuts):
    flat = x.reshape(-1)
    bounds = [0, *sorted(set(cuts)), flat.numel()]

    def chunks():
        return (flat[a:b] for a, b in itertools.pairwise(bounds) if b > a)

    return chunks


def _topk(x, k):
    return float(torch.topk(x.reshape(-1).float().abs(), k).values[-1])


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 400),
    seed=st.integers(0, 2**31 - 1),
    data=st.data(),
    scale=st.sampled_from([1e-30, 1e-3, 1.0, 1e20]),
    duplicates=st.booleans(),
)
def test_equals_topk_for_any_chunking(n, seed, data, scale, duplicates):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * scale
    if duplicates:  # heavy ties and exact zeros / negative zeros
        x = torch.round(x / scale * 2) / 2 * scale
        x[: n // 3] = -0.0
    k = data.draw(st.integers(1, n))
    cuts = data.draw(st.lists(st.integers(0, n), max_size=6))
    got = kth_largest_abs(_chunker(x, cuts), k)
    assert got == _topk(x, k)
    assert got == kth_largest_abs_tensor(x, k)
    # Keeping |x| >= threshold keeps at least k (exactly k when the k-th value is unique).
    assert int((x.abs() >= got).sum()) >= k


def test_two_passes_and_low_precision_dtypes():
    calls = []
    x = torch.randn(3, 1000).to(torch.bfloat16)

    def chunks():
        calls.append(1)
        return iter(x.unbind(0))

    for k in (1, 17, 1500, 3000):
        calls.clear()
        assert kth_largest_abs(chunks, k) == _topk(x, k)
        assert len(calls) == 2
    xh = torch.randn(777).half()
    assert kth_largest_abs(lambda: [xh], 100) == _topk(xh, 100)


def test_edge_cases():
    x = torch.tensor([3.0, -5.0, 1.0, float("inf")])
    assert kth_largest_abs(lambda: [x], 0) == float("inf")
    assert kth_largest_abs(lambda: [x], 1) == float("inf")
    assert kth_largest_abs(lambda: [x], 2) == 5.0
    assert kth_largest_abs(lambda: [x], 4) == 1.0
    with pytest.raises(ValueError, match="exceeds"):
        kth_largest_abs(lambda: [x], 5)
    with pytest.raises(ValueError, match="NaN"):
        kth_largest_abs(lambda: [torch.tensor([float("nan")])], 1)
    # Subnormals and the smallest normal are ordered correctly.
    tiny = torch.tensor([1e-45, 1e-40, 1.2e-38, 0.0])
    assert kth_largest_abs(lambda: [tiny], 2) == _topk(tiny, 2)
