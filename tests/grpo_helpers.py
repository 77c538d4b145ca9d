"""GRPO test fixtures: a deterministic rollout and one-call training runs.

`deterministic_rollout` replaces generation through TRL's own `rollout_func` seam: each completion depends only on
the prompt, its index within the group and the step, never on an RNG stream or on how the batch is split across
processes. One process with batch 2G and two processes with batch G each then see identical completions, rewards and
advantages, so their updates can be compared exactly.
"""

import random
from collections import Counter

import torch
from sft_helpers import train_and_diff

from hf_stable.testing import arithmetic_dataset, arithmetic_reward, build_tiny_model


G = 4


def deterministic_rollout(prompts, trainer):
    tokenizer = trainer.processing_class
    seen = Counter()
    prompt_ids, completion_ids = [], []
    for prompt in prompts:
        index = seen[prompt]
        seen[prompt] += 1
        rng = random.Random(f"{prompt}|{index}|{trainer.state.global_step}")
        answer = str(eval(prompt.rstrip("=")))
        text = answer if rng.random() < 0.5 else answer + "7" * rng.randint(0, 2) + str(rng.randint(0, 9))
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if rng.random() < 0.8:  # most completions end on eos, some are cut at the budget
            ids = [*ids, tokenizer.eos_token_id]
        prompt_ids.append(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        completion_ids.append(ids[: trainer.max_completion_length])
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}


def length_reward(completions, **kwargs):
    """A second objective that conflicts with correctness on long answers."""
    return [-0.1 * len(c) for c in completions]


GRPO_ARGS = dict(
    max_steps=1,
    num_generations=G,
    max_completion_length=6,
    learning_rate=1.0,
    optim="sgd",
    max_grad_norm=0.0,
    lr_scheduler_type="constant",
    weight_decay=0.0,
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    use_cpu=True,
    bf16=False,
    beta=0.0,
    gradient_checkpointing=False,
    disable_tqdm=True,
    ddp_find_unused_parameters=False,
    seed=0,
)


def grpo_trainer(
    output_dir,
    batch_size=2 * G,
    grad_accum=1,
    rollout=True,
    trainer_cls=None,
    config_cls=None,
    reward_funcs=(arithmetic_reward, length_reward),
    n_prompts=16,
    peft_config=None,
    **config,
):
    """The trainer of a tiny-model GRPO run (not trained yet: a resume test trains it from a checkpoint)."""
    if trainer_cls is None:
        from hf_stable import StableGRPOConfig, StableGRPOTrainer

        trainer_cls, config_cls = StableGRPOTrainer, StableGRPOConfig
    model, tokenizer = build_tiny_model(seed=0)
    args = config_cls(
        output_dir=str(output_dir),
        per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=grad_accum,
        **{**GRPO_ARGS, **config},
    )
    torch.manual_seed(0)  # adapters are initialised inside the trainer, before it seeds
    trainer = trainer_cls(
        model=model,
        reward_funcs=list(reward_funcs),
        args=args,
        train_dataset=arithmetic_dataset(n_prompts, seed=0, max_operand=9),
        processing_class=tokenizer,
        rollout_func=deterministic_rollout if rollout else None,
        peft_config=peft_config,
    )
    return trainer


def grpo_run(output_dir, batch_size=2 * G, grad_accum=1, **kwargs):
    """Train `grpo_trainer(...)` and return `(flattened parameter update, trainer)`."""
    trainer = grpo_trainer(output_dir, batch_size, grad_accum, **kwargs)
    return train_and_diff(trainer), trainer
