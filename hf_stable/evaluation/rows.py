"""Prompt/answer rows tokenised with answer-only labels, and their padding: the data of the unlearning trainer
(`hf_stable.trainers.unlearning.data`) and of the unlearning evaluation (`hf_stable.evaluation.unlearning`).

Rows are what TRL users already have: ``prompt`` + ``completion`` (or ``answer``) as strings, or as chat messages
(conversational). Labels are `-100` on the prompt; the completion is followed by EOS. The attention mask comes from
lengths, never from ``input_ids != pad_id`` (which would hide a real EOS when pad == eos).
"""

from __future__ import annotations

import torch


ANSWER_COLUMNS = ("completion", "answer")


def _answer_column(names) -> str:
    for name in ANSWER_COLUMNS:
        if name in names:
            return name
    raise ValueError(f"Unlearning data needs a 'prompt' and a 'completion' (or 'answer') column; got {list(names)}.")


def _is_conversational(value) -> bool:
    return isinstance(value, list) and bool(value) and isinstance(value[0], dict) and "role" in value[0]


def tokenize_row(tokenizer, prompt, completion, max_length: int | None = None) -> dict[str, list[int]]:
    """``input_ids``, ``attention_mask`` and completion-only ``labels`` for one row (EOS appended to the answer).

    Conversational rows go through the chat template: the answer ids are the template of prompt + completion minus the
    template of the prompt with a generation prompt (how TRL builds completion masks).
    """
    if _is_conversational(prompt):
        prompt_ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
        full = tokenizer.apply_chat_template(prompt + completion, tokenize=True)
        prompt_ids, full = _ids(prompt_ids), _ids(full)
        if full[: len(prompt_ids)] != prompt_ids:
            raise ValueError("The chat template does not render the prompt as a prefix of prompt + completion.")
        answer_ids = full[len(prompt_ids) :]
    else:
        prompt_ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
        answer_ids = tokenizer(completion, add_special_tokens=False)["input_ids"]
    if tokenizer.eos_token_id is not None and (not answer_ids or answer_ids[-1] != tokenizer.eos_token_id):
        answer_ids = [*answer_ids, tokenizer.eos_token_id]
    input_ids = list(prompt_ids) + list(answer_ids)
    labels = [-100] * len(prompt_ids) + list(answer_ids)
    if max_length is not None and len(input_ids) > max_length:
        input_ids, labels = input_ids[:max_length], labels[:max_length]
    return {"input_ids": input_ids, "attention_mask": [1] * len(input_ids), "labels": labels}


def _ids(value) -> list[int]:
    if isinstance(value, dict) or hasattr(value, "keys"):
        value = value["input_ids"]
    return list(value)


def tokenize_rows(dataset, tokenizer, max_length: int | None = None, name: str = "dataset") -> list[dict]:
    """Tokenise every row of a `datasets.Dataset` (or list of dicts); rows without answer tokens are an error."""
    rows = list(dataset) if not isinstance(dataset, list) else dataset
    if not rows:
        raise ValueError(f"`{name}` is empty.")
    answer = _answer_column(rows[0].keys())
    out = []
    for i, row in enumerate(rows):
        example = tokenize_row(tokenizer, row["prompt"], row[answer], max_length)
        n_answer = sum(label != -100 for label in example["labels"])
        if not n_answer:
            raise ValueError(f"`{name}` row {i} has no answer tokens left (max_length={max_length}).")
        if row.get("dmm_target_ids") is not None:  # precomputed matching targets, one top-k list per answer token
            ids, logps = row["dmm_target_ids"], row["dmm_target_logps"]
            if len(ids) < n_answer or len(ids) != len(logps):
                raise ValueError(f"`{name}` row {i}: dmm_target_ids/logps must cover every answer token.")
            example["target_ids"], example["target_logps"] = ids, logps
        out.append(example)
    return out


def pad_stream(examples: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad one stream: ``input_ids`` with ``pad_id``, ``labels`` with -100, ``attention_mask`` with 0."""
    width = max(len(e["input_ids"]) for e in examples)

    def padded(key, value):
        return torch.tensor([e[key] + [value] * (width - len(e[key])) for e in examples], dtype=torch.long)

    out = {
        "input_ids": padded("input_ids", pad_id),
        "attention_mask": padded("attention_mask", 0),
        "labels": padded("labels", -100),
    }
    if "target_ids" in examples[0]:
        answers, k = max(len(e["target_ids"]) for e in examples), len(examples[0]["target_ids"][0])
        ids = torch.zeros(len(examples), answers, k, dtype=torch.long)
        logps = torch.full((len(examples), answers, k), float("-inf"))
        for i, e in enumerate(examples):
            ids[i, : len(e["target_ids"])] = torch.tensor(e["target_ids"], dtype=torch.long)
            logps[i, : len(e["target_logps"])] = torch.tensor(e["target_logps"], dtype=torch.float)
        out["target_ids"], out["target_logps"] = ids, logps
    return out
