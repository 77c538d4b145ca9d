"""DELLA's integer keep thresholds draw exactly the mask of its float64 definition: keep an entry when the uniform
`bits · 2^-32` is below `(density − ε) + r · 2ε / (n − 1)`, `r` its ascending |τ| rank in its row (ties by position,
a stable float argsort), as `della_probabilities` computed it before the thresholds replaced it."""

import pytest
import torch

from hf_stable.merging import rng
from hf_stable.merging.methods.dare import della_thresholds


def _float_mask(magnitude, row_len, density, epsilon, bits):
    rows = magnitude.double().reshape(-1, row_len)  # ranks of the float values themselves
    order = torch.argsort(rows, dim=1, stable=True)
    ranks = torch.empty_like(order)
    ranks.scatter_(1, order, torch.arange(row_len).expand_as(order))
    scale = 1.0 / (row_len - 1) if row_len > 1 else 0.0
    p = ((density - epsilon) + ranks.to(torch.float64) * scale * 2 * epsilon).reshape(-1)
    return bits.to(torch.float64) * 2.0**-32 < p


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("row_len,density,epsilon", [(1, 0.5, 0.1), (7, 0.3, 0.2), (64, 0.5, 0.15), (33, 0.9, 0.05)])
def test_thresholds_give_the_float_definitions_mask(dtype, row_len, density, epsilon):
    g = torch.Generator().manual_seed(row_len)
    tau = torch.randn(row_len * 40, generator=g).to(dtype)
    tau[::5] = tau[1::5][: len(tau[::5])]  # repeated magnitudes: ties broken by position
    tau[::11] = 0.0
    magnitude = tau.abs()
    bits = rng.random_bits(3, 1, "w", 0, magnitude.numel())
    ours = bits < della_thresholds(magnitude, row_len, density, epsilon)
    theirs = _float_mask(magnitude, row_len, density, epsilon, bits)
    assert torch.equal(ours, theirs)
    if row_len > 1:  # the control: a mask drawn from unranked probabilities differs
        flat = bits.to(torch.float64) * 2.0**-32 < density
        assert not torch.equal(flat, theirs)


def test_threshold_is_the_ceiling_of_p_times_2_to_32():
    """A uniform exactly at p is not kept (u < p), and one just below is."""
    t = della_thresholds(torch.tensor([1.0, 2.0]), 2, 0.5, 0.25)  # p = 0.25, 0.75: p·2^32 are integers
    assert t.tolist() == [2**30, 3 * 2**30]
    assert not (torch.tensor([2**30]) < t[:1]).item() and (torch.tensor([2**30 - 1]) < t[:1]).item()
