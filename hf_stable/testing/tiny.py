"""An offline tiny model kit: a character-level tokenizer and a Llama-architecture causal LM built from config.

Nothing downloads. Llama (not Qwen2) because transformers 5 swaps Qwen2's tokenizer class for its own regex/ByteLevel
pipeline, which silently drops spaces and newlines of a custom tokenizer.
"""

from __future__ import annotations

import os

import torch


SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>"]
CHARACTERS = list("0123456789+-*/=?!:;.,'\"()[]_ #%&@abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ\n")

# `{% generation %}` markers make `SFTConfig(assistant_only_loss=True)` work; the assistant's eos is inside them so the
# model learns to stop. The user turn is rendered identically with and without a generation prompt, so the tokenized
# prompt is a prefix of prompt + completion.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}{{ '<|assistant|>' }}"
    "{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}"
    "{% else %}{{ '<|' + message['role'] + '|>' + message['content'] }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def build_tiny_tokenizer():
    """A character-level `PreTrainedTokenizerFast` (one token per character, specials kept whole) with a chat template.

    The vocabulary is `SPECIAL_TOKENS + CHARACTERS`; unknown characters map to `<unk>`. No BOS is added.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")  # every character is a token
    backend.decoder = decoders.Fuse()  # and joins back without separators
    backend.add_special_tokens(SPECIAL_TOKENS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tiny_model(
    save_dir: str | os.PathLike | None = None,
    *,
    seed: int = 0,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    max_position_embeddings: int = 128,
    dtype: torch.dtype = torch.float32,
):
    """Build an offline `(model, tokenizer)` pair: a random-init `LlamaForCausalLM` and [`build_tiny_tokenizer`].

    The defaults give about 90k parameters (tied embeddings), which train at tens of steps per second on a CPU core.

    Args:
        save_dir (`str` or `os.PathLike`, *optional*):
            If given, the model (safetensors) and tokenizer are saved there, loadable with `AutoModelForCausalLM` and
            `AutoTokenizer.from_pretrained(save_dir)`.
        seed (`int`, defaults to `0`):
            Seed of the weight initialisation; the global RNG is left as it was.
        hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads,
        max_position_embeddings: `LlamaConfig` sizes.
        dtype (`torch.dtype`, defaults to `torch.float32`): parameter dtype.

    Returns:
        `(model, tokenizer)`.
    """
    from transformers import AutoModelForCausalLM, LlamaConfig

    tokenizer = build_tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    if save_dir is not None:
        model.save_pretrained(save_dir)
        tokenizer.save_pretrained(save_dir)
    return model, tokenizer
