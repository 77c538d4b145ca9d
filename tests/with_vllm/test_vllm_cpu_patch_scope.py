"""The CPU weight-sync patch is applied only for colocated vLLM (no vLLM needed to run this)."""

import importlib.util
from types import SimpleNamespace

import pytest

from hf_stable._vllm_cpu import maybe_keep_unpacked_linear_weights, vllm_on_cpu


@pytest.mark.parametrize(
    "args",
    [
        SimpleNamespace(),
        SimpleNamespace(use_vllm=False, vllm_mode="colocate"),
        SimpleNamespace(use_vllm=True, vllm_mode="server"),
    ],
    ids=["no-vllm-fields", "use_vllm-off", "server-mode"],
)
def test_not_applied_without_colocated_vllm(args):
    assert maybe_keep_unpacked_linear_weights(args) is False


def test_not_applied_without_vllm_installed():
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here (tests/with_vllm/test_grpo_vllm.py covers that case)")
    assert vllm_on_cpu() is False
    assert maybe_keep_unpacked_linear_weights(SimpleNamespace(use_vllm=True, vllm_mode="colocate")) is False
