"""Shared by the GPU suite (tests/gpu/, marker `gpu`): the skip without CUDA, the CPU suite's helpers on the path."""

import os
import sys

import pytest
import torch


HERE = os.path.dirname(os.path.abspath(__file__))
for folder in ("..", "../distributed", "../adapters", "../callbacks"):
    path = os.path.normpath(os.path.join(HERE, folder))
    if path not in sys.path:
        sys.path.insert(0, path)

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device (the GPU suite: scripts/gpu_check.sh)")
GPU = [pytest.mark.gpu, needs_cuda]

# A run on the GPU in bf16 autocast (fp32 master weights), or in fp32 for exact comparisons.
ON_GPU = dict(use_cpu=False, bf16=False)
ON_GPU_BF16 = dict(use_cpu=False, bf16=True)


def close_updates(actual, expected, rtol):
    """Updates agree up to ``rtol`` of the reference's largest entry (which must be non-zero)."""
    actual, expected = actual.float().cpu(), expected.float().cpu()
    scale = expected.abs().max().item()
    assert scale > 0, "the reference update is zero: the comparison would prove nothing"
    diff = (actual - expected).abs().max().item()
    assert diff <= rtol * scale, f"updates differ by {diff:.3e} (scale {scale:.3e})"
