"""Tiny synthetic Llama checkpoints for the mergekit parity suite, built with torch and safetensors only (no
transformers), so the fixture script (mergekit's venv) and the tests (hf_stable's venv) build the same bytes.

Two families: 40-layer models standing for the 13B models of mergekit's example recipes (whose `layer_range`s span
40 layers), 4-layer ones for the 7B examples and the method recipes. Weights are
float32 draws (no ties in |τ|, so magnitude thresholds and mergekit's argsort keep the same entries); each
fine-tune is its base plus a 30% relative perturbation per tensor.

A third family carries tokenizers with differing vocabularies (`VOCAB_FOLDERS`), for `tokenizer_source: union`,
written as plain JSON (`tokenizer.json`, `tokenizer_config.json`): a base vocabulary of 16 tokens, models that add
tokens (with embedding and `lm_head` rows for them), one that lacks two base tokens (its ids shift), and one whose
tokenizer lists tokens past its `vocab_size` (unused, as in padded tokenizers), and one saved with tied embeddings.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, VOCAB = 8, 16, 2, 1, 16

# Checkpoint folders: (layers, seed); seed 0 is the family's base.
FOLDERS = {
    "base40": (40, 0),
    "orca40": (40, 1),
    "platypus40": (40, 2),
    "wizardlm40": (40, 3),
    "wizardmath40": (40, 4),
    "base": (4, 0),
    "orca": (4, 1),
    "wizardlm": (4, 2),
    "platypus": (4, 3),
    "wizardmath": (4, 4),
    "mistral-instruct": (4, 5),
    "biomistral": (4, 6),
}
# Model names of mergekit's example recipes → folder (the 13B names are 40-layer models, as in the examples).
NAMES = {
    "TheBloke/Llama-2-13B-fp16": "base40",
    "psmathur/orca_mini_v3_13b": "orca40",
    "garage-bAInd/Platypus2-13B": "platypus40",
    "WizardLM/WizardLM-13B-V1.2": "wizardlm40",
    "WizardLM/WizardMath-13B-V1.0": "wizardmath40",
    "mistralai/Mistral-7B-v0.1": "base",
    "mistralai/Mistral-7B-Instruct-v0.2": "mistral-instruct",
    "BioMistral/BioMistral-7B": "biomistral",
    "model_a": "wizardmath",
    "model_b": "mistral-instruct",
    "model_c": "biomistral",
    **{name: name for name in FOLDERS},
}
# bfloat16 copies of three 4-layer checkpoints (the same weights rounded once), for recipes over bf16 inputs.
BF16_FOLDERS = {"model_a_bf16": "wizardmath", "model_b_bf16": "mistral-instruct", "model_c_bf16": "biomistral"}
NAMES.update({name: name for name in BF16_FOLDERS})

# Checkpoints with a tokenizer: (weights of FOLDERS[...], base tokens left out, added tokens, rows for added tokens).
BASE_TOKENS = ["<unk>", "<s>", "</s>"] + [f"_tok_{i}" for i in range(3, VOCAB)]
CHAT_TOKENS = ["<|im_start|>", "<|im_end|>"]
VOCAB_FOLDERS = {
    "tok_base": ("base", (), [], 0),
    "tok_chatml": ("orca", (), CHAT_TOKENS, 2),
    "tok_chatml2": ("wizardmath", (), CHAT_TOKENS, 2),
    "tok_tools": ("wizardlm", ("_tok_5", "_tok_9"), [*CHAT_TOKENS, "<|tool|>"], 3),
    "tok_padded": ("platypus", (), [f"<UNUSED_{i}>" for i in range(4)], 0),  # added tokens past vocab_size
    "tok_tied": ("biomistral", (), CHAT_TOKENS, 2),  # saved tied: no lm_head, tie_word_embeddings true
    "tok_tied_same": ("biomistral", (), [], 0),  # saved tied, with the base's vocabulary (no tokenizer_source needed)
}
TIED_FOLDERS = {"tok_tied", "tok_tied_same"}
NAMES.update({name: name for name in VOCAB_FOLDERS})


def config(layers: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": layers,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HIDDEN // HEADS,
        "vocab_size": VOCAB,
        "max_position_embeddings": 64,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def shapes(layers: int) -> dict[str, tuple[int, ...]]:
    h, i, d = HIDDEN, INTERMEDIATE, HIDDEN // HEADS
    out = {"model.embed_tokens.weight": (VOCAB, h)}
    for n in range(layers):
        p = f"model.layers.{n}."
        out.update({
            p + "self_attn.q_proj.weight": (HEADS * d, h), p + "self_attn.k_proj.weight": (KV_HEADS * d, h),
            p + "self_attn.v_proj.weight": (KV_HEADS * d, h), p + "self_attn.o_proj.weight": (h, HEADS * d),
            p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h), p + "mlp.down_proj.weight": (h, i),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
        })  # fmt: skip
    out.update({"model.norm.weight": (h,), "lm_head.weight": (VOCAB, h)})
    return out


def weights(layers: int, seed: int) -> dict[str, torch.Tensor]:
    """The base of a family (seed 0) or a fine-tune of it (base + 30% relative noise per tensor)."""
    gen = torch.Generator().manual_seed(1000 * layers)
    base = {name: torch.randn(shape, generator=gen) for name, shape in shapes(layers).items()}
    if seed == 0:
        return base
    gen = torch.Generator().manual_seed(1000 * layers + seed)
    out = {}
    for name, b in base.items():
        noise = torch.randn(b.shape, generator=gen)
        out[name] = b + 0.3 * (b.norm() / noise.norm()) * noise
    return out


def build(root: str | Path) -> dict[str, str]:
    """Write every checkpoint under `root` (once); returns `{name used in a recipe: folder}`."""
    root = Path(root)
    for folder, (layers, seed) in FOLDERS.items():
        path = root / folder
        if not (path / "model.safetensors").exists():
            path.mkdir(parents=True, exist_ok=True)
            save_file(weights(layers, seed), str(path / "model.safetensors"), metadata={"format": "pt"})
            (path / "config.json").write_text(json.dumps(config(layers), indent=1))
    for folder, source in BF16_FOLDERS.items():
        path = root / folder
        if not (path / "model.safetensors").exists():
            path.mkdir(parents=True, exist_ok=True)
            layers, seed = FOLDERS[source]
            tensors = {k: v.to(torch.bfloat16) for k, v in weights(layers, seed).items()}
            save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
            (path / "config.json").write_text(json.dumps({**config(layers), "torch_dtype": "bfloat16"}, indent=1))
    for folder, spec in VOCAB_FOLDERS.items():
        path = root / folder
        if not (path / "model.safetensors").exists():
            _build_vocab_model(path, *spec, tied=folder in TIED_FOLDERS)
    return {name: str(root / folder) for name, folder in NAMES.items()}


def _build_vocab_model(path: Path, source: str, left_out, added: list[str], new_rows: int, tied: bool) -> None:
    """A 4-layer checkpoint whose vocabulary is the base one without `left_out`, plus `added`: its embedding and
    `lm_head` rows are `source`'s for the tokens it keeps, then `new_rows` fresh draws. `tied`: saved with tied
    embeddings (no `lm_head`, `tie_word_embeddings: true`)."""
    layers, seed = FOLDERS[source]
    tensors = weights(layers, seed)
    keep = torch.tensor([i for i, t in enumerate(BASE_TOKENS) if t not in left_out])
    gen = torch.Generator().manual_seed(1000 * layers + 100 + seed)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        tensors[name] = torch.cat([tensors[name][keep], torch.randn(new_rows, HIDDEN, generator=gen)])
    rows = len(keep) + new_rows
    if tied:
        del tensors["lm_head.weight"]
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = {**config(layers), "vocab_size": rows, "tie_word_embeddings": tied}
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    write_tokenizer(path, [t for t in BASE_TOKENS if t not in left_out], added)


def write_tokenizer(path: Path, tokens: list[str], added: list[str]) -> None:
    """A BPE tokenizer with no merges over `tokens` (ids in order), `<unk>`/`<s>`/`</s>` special, and `added` as
    normal added tokens after them, as `tokenizer.json` + `tokenizer_config.json` (no transformers needed)."""
    flags = {"single_word": False, "lstrip": False, "rstrip": False}
    entries = [{"id": i, "content": t, **flags, "normalized": False, "special": True}
               for i, t in enumerate(tokens) if t in ("<unk>", "<s>", "</s>")]  # fmt: skip
    entries += [{"id": len(tokens) + i, "content": t, **flags, "normalized": True, "special": False}
                for i, t in enumerate(added)]  # fmt: skip
    model = {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
             "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
             "vocab": {t: i for i, t in enumerate(tokens)}, "merges": []}  # fmt: skip
    tok = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": entries, "normalizer": None,
           "pre_tokenizer": None, "post_processor": None, "decoder": None, "model": model}  # fmt: skip
    (path / "tokenizer.json").write_text(json.dumps(tok, indent=1))
    decoder = {str(e["id"]): {k: v for k, v in e.items() if k != "id"} for e in entries}
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
           "unk_token": "<unk>", "model_max_length": 64, "added_tokens_decoder": decoder}  # fmt: skip
    (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))


def prepare_recipe(recipe: dict, folders: dict[str, str]) -> dict:
    """A recipe as both tools run it in the parity suite: model names → local folders, nothing else changed (the
    recipe's `dtype` and `out_dtype` are run as written)."""
    import copy

    recipe = copy.deepcopy(recipe)

    def local(entry):
        if isinstance(entry, dict):
            return {**entry, "model": folders[entry["model"]]}
        return folders[entry]

    if recipe.get("base_model"):
        recipe["base_model"] = folders[recipe["base_model"]]
    if recipe.get("models"):
        recipe["models"] = [local(m) for m in recipe["models"]]
    for sl in recipe.get("slices") or []:
        sl["sources"] = [local(s) for s in sl["sources"]]
    if recipe.get("tokenizer_source") not in (None, "base", "union"):
        recipe["tokenizer_source"] = folders[recipe["tokenizer_source"]]
    block = recipe.get("tokenizer") or {}
    if block.get("source") not in (None, "base", "union"):
        block["source"] = folders[block["source"]]
    for entry in (block.get("tokens") or {}).values():  # a token's source: a model, or {kind: model_token, model}
        source = entry.get("source")
        if isinstance(source, str):
            entry["source"] = folders[source]
        elif isinstance(source, dict) and "model" in source:
            source["model"] = folders[source["model"]]
    return recipe
