"""Pico checkpoints for merge tests: tiny Llama models saved as safetensors folders.

`make_pico_model(path, seed=..., base=..., scale=...)` saves a fresh or perturbed pico Llama (+ tokenizer);
`load_folder_state_dict(path)` loads a single or sharded safetensors folder (stored dtypes kept); `PICO_CONFIG`
holds the `LlamaConfig` sizes. The session fixtures built from them are in `conftest.py` (`pico_models`,
`pico_bf16_models`). Import as `from merge_helpers import ...` (a unique module name: `conftest` is ambiguous).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch


PICO_CONFIG = {
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 32,
    "tie_word_embeddings": False,
}


def make_pico_model(
    path: str | Path,
    *,
    seed: int = 0,
    base: str | Path | None = None,
    scale: float = 0.05,
    dtype: torch.dtype = torch.float32,
    **config_overrides,
) -> str:
    """Save a pico Llama at `path`: a fresh random init (`seed`) or, with `base`, the base's weights plus
    `scale · ||W|| / sqrt(numel) · N(0, 1)` per float tensor (seeded), i.e. a relative perturbation of `scale`."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from hf_stable.testing import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    kwargs = {**PICO_CONFIG, **config_overrides}
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        **kwargs,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        if base is not None:
            base_sd = load_folder_state_dict(base)
            gen = torch.Generator().manual_seed(1000 + seed)
            with torch.no_grad():
                for name, p in model.named_parameters():
                    b = base_sd[name].float()
                    noise = torch.randn(b.shape, generator=gen)
                    p.copy_(b + scale * b.norm() / max(1, b.numel()) ** 0.5 * noise)
    model.to(dtype)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def load_folder_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors folder (single file or index + shards), stored dtypes."""
    from safetensors.torch import load_file

    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        out = {}
        for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
            out.update(load_file(path / shard))
        return out
    return load_file(path / "model.safetensors")
