"""Session fixtures for the merging tests: pico checkpoints (helpers in `merge_helpers.py`).

`pico_models` is `{"base": path, "experts": [path, path, path], "root": path}`: a pico Llama base and three
fine-tunes (the base plus seeded relative perturbations of 5%, 20% and 60%, so task vectors differ in direction
and magnitude). Each folder has `config.json`, `generation_config.json`, `model.safetensors` (fp32, `lm_head`
untied so every kind of tensor is exercised) and the character-level tokenizer of `hf_stable.testing`.
`pico_bf16_models` is a bfloat16 base and two experts.
"""

from __future__ import annotations

import pytest
import torch
from merge_helpers import make_pico_model


@pytest.fixture(scope="session")
def pico_models(tmp_path_factory):
    """`{"base": path, "experts": [path, path, path]}`: a pico base and three perturbed fine-tunes."""
    root = tmp_path_factory.mktemp("pico")
    base = make_pico_model(root / "base", seed=0)
    experts = [
        make_pico_model(root / f"expert{i}", seed=i + 1, base=base, scale=s) for i, s in enumerate((0.05, 0.2, 0.6))
    ]
    return {"base": base, "experts": experts, "root": str(root)}


@pytest.fixture(scope="session")
def pico_bf16_models(tmp_path_factory):
    """The base and two experts re-saved in bfloat16 (output dtype defaults to the first input's)."""
    root = tmp_path_factory.mktemp("pico-bf16")
    base = make_pico_model(root / "base", seed=0, dtype=torch.bfloat16)
    experts = [
        make_pico_model(root / f"expert{i}", seed=i + 1, base=base, scale=0.1, dtype=torch.bfloat16) for i in range(2)
    ]
    return {"base": base, "experts": experts}
