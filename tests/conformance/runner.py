"""Runs one conformance case with TRL's trainer and with ours: same model (built from config with a fixed seed),
same data, same seed; returns the parameter update and the logged metrics of each."""

from __future__ import annotations

import asyncio

import torch
from conformance_helpers import (
    TOOL_TEMPLATE,
    CountingEnv,
    add,
    build_family,
    build_tool_model,
    peft_configs,
    tool_reward,
    tool_rollout,
)
from grpo_helpers import GRPO_ARGS, deterministic_rollout, length_reward
from sft_helpers import STEP_ARGS, train_and_diff

from hf_stable.testing import arithmetic_dataset, arithmetic_reward, build_tiny_model


# metrics that measure time, not the update
TIMING = {
    f"{split}_{what}" for split in ("train", "eval") for what in ("runtime", "samples_per_second", "steps_per_second")
} | {"step_time"}


def _trainers(kind, ours):
    if kind == "grpo":
        if ours:
            from hf_stable import StableGRPOConfig, StableGRPOTrainer

            return StableGRPOTrainer, StableGRPOConfig
        from trl import GRPOConfig, GRPOTrainer

        return GRPOTrainer, GRPOConfig
    if ours:
        from hf_stable import StableSFTConfig, StableSFTTrainer

        return StableSFTTrainer, StableSFTConfig
    from trl import SFTConfig, SFTTrainer

    return SFTTrainer, SFTConfig


def _model(setup, model_dir):
    family = setup.get("model")
    if family == "saved":  # by name: TRL loads its reference model (`beta > 0`) from the model's path
        from transformers import AutoTokenizer

        return model_dir, AutoTokenizer.from_pretrained(model_dir)
    if family == "smollm2-tokenizer qwen3":
        return build_tool_model(seed=0)
    return build_family(family) if family else build_tiny_model(seed=0)


def digit_reward(completions, **kwargs):
    """How many digits a completion holds: varied on a random model's samples (the length is often the budget)."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [float(sum(ch.isdigit() for ch in t)) for t in texts]


async def async_length_reward(completions, **kwargs):
    await asyncio.sleep(0)
    return length_reward(completions)


def _reward_model(tokenizer):
    from transformers import AutoModelForSequenceClassification, LlamaConfig

    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, num_labels=1, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    state = torch.random.get_rng_state()
    torch.manual_seed(1)
    model = AutoModelForSequenceClassification.from_config(config)
    torch.random.set_rng_state(state)
    return model


def _grpo_kwargs(setup, tokenizer):
    rewards = setup.get("rewards", "funcs")
    kwargs = {"reward_funcs": [arithmetic_reward, length_reward]}
    if rewards == "digits":
        kwargs["reward_funcs"] = [digit_reward, length_reward]
    elif rewards == "async":
        kwargs["reward_funcs"] = [arithmetic_reward, async_length_reward]
    elif rewards == "model":
        kwargs["reward_funcs"] = [arithmetic_reward, _reward_model(tokenizer)]
        kwargs["reward_processing_classes"] = [None, tokenizer]
    elif rewards.startswith("environment"):
        CountingEnv.start()
        tokenizer.chat_template = TOOL_TEMPLATE
        kwargs["environment_factory"] = CountingEnv
        kwargs["reward_funcs"] = [length_reward] if rewards.endswith("+funcs") else None
    elif rewards == "tools":
        kwargs["reward_funcs"] = [tool_reward]
        kwargs["tools"] = [add]
    if setup.get("rollout", True):
        kwargs["rollout_func"] = tool_rollout if rewards == "tools" else deterministic_rollout
    conversational = setup.get("data") == "conversational" or rewards.startswith("environment") or rewards == "tools"
    kwargs["train_dataset"] = arithmetic_dataset(8, seed=0, max_operand=9, conversational=conversational)
    return kwargs


def _sft_data(setup):
    data = setup.get("data")
    rows = arithmetic_dataset(8, seed=1, max_operand=999, conversational=data in ("conversational", "messages"))
    if data == "text":
        return rows.map(lambda r: {"text": r["prompt"] + r["completion"]}, remove_columns=rows.column_names)
    if data == "messages":
        return rows.map(lambda r: {"messages": r["prompt"] + r["completion"]}, remove_columns=rows.column_names)
    return rows


def run(kind: str, case, out: str, ours: bool, model_dir: str | None = None):
    """`(update, logs, trainer)` of one side; ``model_dir``: the saved tiny model, for cases that load by name."""
    trainer_cls, config_cls = _trainers(kind, ours)
    model, tokenizer = _model(case.setup, model_dir)
    peft = case.setup.get("peft")
    config = dict(case.config)
    if kind == "grpo":
        batch = 8 // config.get("gradient_accumulation_steps", 1)
        base = {**GRPO_ARGS, "learning_rate": 1e-2, "max_completion_length": 4, "per_device_train_batch_size": batch}
        kwargs = _grpo_kwargs(case.setup, tokenizer)
    else:
        batch = 8 // config.get("gradient_accumulation_steps", 1)
        base = {**STEP_ARGS, "learning_rate": 1e-2, "logging_steps": 1, "per_device_train_batch_size": batch,
                "seed": 0}  # fmt: skip
        kwargs = {"train_dataset": _sft_data(case.setup)}
    if case.setup.get("eval"):
        kwargs["eval_dataset"] = kwargs["train_dataset"]
    args = config_cls(out, **{**base, **config})
    if peft:
        kwargs["peft_config"] = peft_configs()[peft]()
    torch.manual_seed(0)  # adapters are initialised inside the trainer, before it seeds
    trainer = trainer_cls(model=model, args=args, processing_class=tokenizer, **kwargs)
    update = train_and_diff(trainer)
    logs = [{k: v for k, v in entry.items() if k not in TIMING} for entry in trainer.state.log_history]
    return update, logs, trainer
