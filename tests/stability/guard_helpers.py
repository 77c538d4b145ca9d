"""SFT runs on the tiny model with an optional stability guard and an injected fault (tests and the DDP script)."""

from __future__ import annotations

import math

from hf_stable.testing import arithmetic_dataset, build_tiny_model


SFT_ARGS = dict(
    per_device_train_batch_size=8,
    learning_rate=1e-3,
    lr_scheduler_type="constant",
    weight_decay=0.0,
    max_grad_norm=1.0,
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    use_cpu=True,
    bf16=False,
    max_length=32,
    gradient_checkpointing=False,
    disable_tqdm=True,
    dataloader_num_workers=0,
    ddp_find_unused_parameters=False,
    seed=0,
)


def datasets(n_train=1600, n_eval=32):
    return arithmetic_dataset(n_train, seed=0, max_operand=99), arithmetic_dataset(n_eval, seed=123, max_operand=99)


def pretrained_tiny(output_dir, steps=300):
    """The tiny model after `steps` SFT steps on other arithmetic rows, saved to `output_dir`: the starting point of
    the fine-tuning runs, past the steep initial descent of a random-init model."""
    from trl import SFTConfig, SFTTrainer

    model, tokenizer = build_tiny_model(seed=0)
    args = SFTConfig(output_dir=str(output_dir), max_steps=steps, **{**SFT_ARGS, "logging_steps": 50, "seed": 7})
    trainer = SFTTrainer(model=model, args=args, processing_class=tokenizer,
                         train_dataset=arithmetic_dataset(8 * steps, seed=7, max_operand=99))
    trainer.train()
    trainer.save_model(str(output_dir))
    tokenizer.save_pretrained(str(output_dir))
    return str(output_dir)


def sft_trainer(output_dir, steps, guard=None, inject=None, model_dir=None, train=None, eval_dataset=None, **config):
    """A plain TRL `SFTTrainer` on the tiny model (random init, or loaded from `model_dir`), with
    `StabilityGuardCallback.attach` (kwargs `guard`) and a `FaultInjectionCallback` (kwargs `inject`) when given.
    Returns `(trainer, guard_callback, injector)`."""
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig, SFTTrainer

    from hf_stable.callbacks import FaultInjectionCallback, StabilityGuardCallback

    if train is None:
        train, default_eval = datasets()
        eval_dataset = default_eval if eval_dataset is None else eval_dataset
    model, tokenizer = build_tiny_model(seed=0)
    if model_dir is not None:
        model = AutoModelForCausalLM.from_pretrained(model_dir)
    args = SFTConfig(output_dir=str(output_dir), max_steps=steps, **{**SFT_ARGS, **config})
    trainer = SFTTrainer(model=model, args=args, train_dataset=train, eval_dataset=eval_dataset,
                         processing_class=tokenizer)
    guard_cb = None if guard is None else StabilityGuardCallback.attach(trainer, **guard)
    injector = None if inject is None else FaultInjectionCallback.attach(trainer, **inject)
    return trainer, guard_cb, injector


def train_losses(trainer) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h and "step" in h}


def eval_loss(trainer) -> float:
    value = trainer.evaluate()["eval_loss"]
    return value if value is not None else math.nan


def has_nan(model) -> bool:
    return any(not p.detach().isfinite().all() for p in model.parameters())
