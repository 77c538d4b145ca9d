"""The trainer plumbing the tiny-model experiments share: CPU training arguments, the SFT and GRPO configs built on
them, a cached one-epoch SFT warm start, and a callback that measures the model along training.

A script imports it as `from testbeds import tiny_trl`; what a run computes is decided here for every script that
uses it, so these sources are part of those scripts' code digest.
"""

from __future__ import annotations

import hashlib
import json
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch


EXPERIMENTS = Path(__file__).resolve().parent.parent


# single process on the CPU in fp32, no checkpoints, reports or progress bars
CPU_ARGS = {
    "use_cpu": True,
    "bf16": False,
    "gradient_checkpointing": False,
    "report_to": "none",
    "save_strategy": "no",
    "disable_tqdm": True,
    "dataloader_num_workers": 0,
}


def sft_config(output_dir: str, seed: int, **fields):
    """`StableSFTConfig` on the CPU (`CPU_ARGS`) with the script's own `fields`."""
    from hf_stable import StableSFTConfig

    return StableSFTConfig(output_dir=output_dir, seed=seed, **fields, **CPU_ARGS)


def linear_sft_config(
    output_dir: str, seed: int, lr: float, batch: int, epochs: int, logging_steps: int, max_length: int, **extra
):
    """The epoch-based SFT recipe: linear decay after a 10% warmup, weight decay 1e-4."""
    return sft_config(
        output_dir,
        seed,
        learning_rate=lr,
        per_device_train_batch_size=batch,
        num_train_epochs=epochs,
        lr_scheduler_type="linear",
        warmup_steps=0.1,
        weight_decay=1e-4,
        logging_steps=logging_steps,
        max_length=max_length,
        **extra,
    )


def grpo_config(output_dir: str, seed: int, sizes, max_completion_length: int, **extra):
    """`StableGRPOConfig` for a tiny-model GRPO arm: constant LR, `sizes.prompts_per_step` prompts of
    `sizes.num_generations` completions per step, plain sampling (temperature 1, no top-p/top-k), no KL term.
    `sizes` has `learning_rate`, `steps`, `prompts_per_step`, `num_generations` and `logging_steps`."""
    from hf_stable import StableGRPOConfig

    return StableGRPOConfig(
        output_dir=output_dir,
        seed=seed,
        learning_rate=sizes.learning_rate,
        lr_scheduler_type="constant",
        max_steps=sizes.steps,
        per_device_train_batch_size=sizes.prompts_per_step * sizes.num_generations,
        num_generations=sizes.num_generations,
        max_completion_length=max_completion_length,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        logging_steps=sizes.logging_steps,
        **CPU_ARGS,
        **extra,
    )


def sum_split(max_operand: int, split_seed: int, num_test: int, num_sampled: int) -> tuple[list, list, list]:
    """Every `(a, b)` with operands up to `max_operand`, shuffled once by `split_seed` (independent of the run seed):
    the first `num_test` are the test prompts, the rest the training pool, and `num_sampled` drawn from the pool
    (same RNG, after the shuffle) a fixed subset of it. Returns (test, pool, subset)."""
    problems = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    rng = random.Random(split_seed)
    rng.shuffle(problems)
    test, pool = problems[:num_test], problems[num_test:]
    return test, pool, rng.sample(pool, num_sampled)


@torch.no_grad()
def generate_ids(model, tokenizer, prompts: list[str], sample: bool, seed: int, max_new_tokens: int) -> list[list]:
    """The new token ids of each prompt's completion, eos and padding included (one left-padded batch; sampled at
    temperature 1 without top-k/top-p, or greedy), with the torch RNG seeded by `seed` inside a fork of it so the
    caller's RNG stream is untouched."""
    was_training = model.training
    model.eval()
    encoded = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    width, pad = max(map(len, encoded)), tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(e)) + e for e in encoded])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        out = model.generate(
            input_ids=ids,
            attention_mask=(ids != pad).long(),
            max_new_tokens=max_new_tokens,
            do_sample=sample,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            pad_token_id=pad,
            eos_token_id=tokenizer.eos_token_id,
        )
    model.train(was_training)
    return out[:, width:].tolist()


def fit(trainer):
    """Train without the console printer (the script prints its own lines); returns the trainer."""
    from transformers import PrinterCallback

    trainer.remove_callback(PrinterCallback)
    trainer.train()
    return trainer


def sft_warm_start(path: Path, seed: int, rows: Callable[[], list[dict]], lr: float, batch: int) -> tuple[Path, bool]:
    """`(path, cached)`: the checkpoint under `path` when it is finished, else one epoch of SFT on `rows()` from the
    tiny model seeded by `seed` (`linear_sft_config`, sequences up to 32 tokens), saved there with its tokenizer and a
    `done.json`."""
    if (path / "done.json").exists():
        return path, True
    from datasets import Dataset

    from hf_stable import StableSFTTrainer
    from hf_stable.testing import build_tiny_model

    start = time.time()
    model, tokenizer = build_tiny_model(seed=seed, max_position_embeddings=64)
    with tempfile.TemporaryDirectory() as tmp:
        args = linear_sft_config(tmp, seed, lr, batch, epochs=1, logging_steps=50, max_length=32)
        trainer = StableSFTTrainer(
            model=model, args=args, train_dataset=Dataset.from_list(rows()), processing_class=tokenizer
        )
        fit(trainer)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    (path / "done.json").write_text(json.dumps({"steps": trainer.state.global_step, "seconds": time.time() - start}))
    print(f"[seed {seed}] warm start: {trainer.state.global_step} steps in {time.time() - start:.0f}s", flush=True)
    return path, False


def cache_dir(name: str, kind: str, seed: int, spec: dict) -> Path:
    """`experiments/cache/<name>/<kind>_seed<seed>_<key>`: a checkpoint's folder keyed by what it was trained with."""
    key = hashlib.sha1(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:10]
    return EXPERIMENTS / "cache" / name / f"{kind}_seed{seed}_{key}"


def cached(path: Path, seed: int, label: str) -> bool:
    """Whether `path` holds a finished checkpoint (its `done.json`); says so when it does."""
    if (path / "done.json").exists():
        print(f"[seed {seed}] {label}: cached {path.relative_to(EXPERIMENTS)}", flush=True)
        return True
    return False


def tiny_llama(seed: int, hidden_size: int, max_position_embeddings: int):
    """`(model, tokenizer)`: `hf_stable.testing`'s tiny Llama, random init seeded by `seed`, MLP width 2 × hidden."""
    from hf_stable.testing import build_tiny_model

    return build_tiny_model(
        seed=seed,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        max_position_embeddings=max_position_embeddings,
    )


def curve_callback(measure: Callable[[int, object], dict], every: int):
    """A `TrainerCallback` whose `points` hold `{"step": step, **measure(step, model)}` at step 0, every `every`
    steps and at the end (once per step)."""
    from transformers import TrainerCallback

    class Curve(TrainerCallback):
        def __init__(self):
            self.points: list[dict] = []

        def record(self, step: int, model) -> None:
            if self.points and self.points[-1]["step"] == step:
                return
            self.points.append({"step": step, **measure(step, model)})

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            self.record(0, model)

        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step % every == 0:
                self.record(state.global_step, model)

        def on_train_end(self, args, state, control, model=None, **kwargs):
            self.record(state.global_step, model)

    return Curve()
