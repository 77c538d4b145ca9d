"""Model passes behind the benchmark metrics: tokenisation in open-unlearning's layout, batched teacher-forced
statistics, greedy generation for ROUGE, and per-example gradient norms; with tqdm progress bars.

Tokenisation follows open-unlearning's `src/data/utils.py` (``preprocess_chat_instance``,
``preprocess_pretraining_instance``): a QA pair is rendered with the chat template (or the plain
``Question: ...\\nAnswer: `` template of its base-model configs), tokenised *whole*, and the labels start after the
tokens of the rendered prompt; EOS is appended to QA answers. A text completion (MUSE) is tokenised as prefix + text
with no EOS and no loss on the first token. The math on the model outputs lives in [`metrics`].
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence

import torch

from .metrics import (
    answer_token_stats,
    exact_memorization,
    extraction_strength,
    mean_nll,
    min_k_scores,
    tokenwise_mask,
)


PLAIN_TEMPLATE = {"user_start": "Question: ", "user_end": "\n", "assistant_start": "Answer: ", "assistant_end": "\n\n"}


def progress_bar(iterable: Iterable, *, desc: str, total: int | None = None, enabled: bool = True, file=None):
    """tqdm over ``iterable`` (transformers' progress-bar library), shown only when ``enabled`` and the stream is a
    terminal, so logs and CI output stay clean."""
    from tqdm.auto import tqdm

    stream = file if file is not None else sys.stderr
    show = enabled and hasattr(stream, "isatty") and stream.isatty()
    return tqdm(iterable, desc=desc, total=total, disable=not show, file=stream, leave=False, dynamic_ncols=True)


def _ids(value) -> list[int]:
    if hasattr(value, "keys"):  # transformers 5 returns a BatchEncoding from apply_chat_template(tokenize=True)
        value = value["input_ids"]
    return list(value)


def encode_qa(
    tokenizer,
    question: str,
    answer: str,
    *,
    chat: bool,
    fewshot: Sequence[tuple[str, str]] = (),
    system_prompt: str | None = None,
    chat_kwargs: dict | None = None,
    max_length: int = 512,
) -> dict:
    """One QA example: ``input_ids``, ``labels`` (-100 on the prompt) and ``prompt_ids`` (the generation input).

    ``fewshot`` (question, answer) pairs come first as in-context examples (MUSE's knowmem). With ``chat`` the
    conversation goes through ``tokenizer.apply_chat_template`` (``system_prompt`` and ``chat_kwargs`` are passed on);
    otherwise through the plain template, truncated to ``max_length`` tokens before EOS is appended.
    """
    if chat:
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        for q, a in [*fewshot, (question, answer)]:
            messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        kwargs = dict(chat_kwargs or {})
        full = _ids(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=False, **kwargs))
        prompt = _ids(
            tokenizer.apply_chat_template(messages[:-1], tokenize=True, add_generation_prompt=True, **kwargs)
        )
    else:
        t = PLAIN_TEMPLATE
        shots = "".join(
            f"{t['user_start']}{q}{t['user_end']}{t['assistant_start']}{a}{t['assistant_end']}" for q, a in fewshot
        )
        wrapped = f"{shots}{t['user_start']}{question}{t['user_end']}{t['assistant_start']}"
        encode = dict(add_special_tokens=True, max_length=max_length, truncation=True)
        full = list(tokenizer(wrapped + answer, **encode)["input_ids"])
        prompt = list(tokenizer(wrapped, **encode)["input_ids"])
    eos = tokenizer.eos_token_id
    if eos is not None and (not full or full[-1] != eos):
        full.append(eos)
    labels = [-100] * len(prompt) + full[len(prompt) :]
    return {"input_ids": full, "labels": labels[: len(full)], "prompt_ids": prompt}


def encode_completion(tokenizer, prefix: str, text: str, *, max_length: int = 2048, insert_space: bool = False):
    """One text-completion example (MUSE verbmem / privleak): ``prefix`` + ``text`` tokenised together, loss on the
    text (truncated to ``max_length`` tokens), never on the first token; no EOS appended."""
    joined = prefix + (" " if insert_space else "") + text
    full = list(tokenizer(joined, add_special_tokens=True)["input_ids"])
    prompt = list(tokenizer(prefix, add_special_tokens=True)["input_ids"])
    full = full[: len(prompt) + max_length]
    start = max(len(prompt), 1)
    return {"input_ids": full, "labels": [-100] * start + full[start:], "prompt_ids": prompt}


def pad_id(tokenizer) -> int:
    value = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if value is None:
        raise ValueError("The tokenizer has neither a pad token nor an EOS token to pad with.")
    return value


def _pad(rows: list[list[int]], value: int, left: bool = False) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([[value] * (width - len(r)) + r if left else r + [value] * (width - len(r)) for r in rows])


def _batch(examples: list[dict], pad: int, device) -> dict:
    ids = _pad([e["input_ids"] for e in examples], pad)
    labels = _pad([e["labels"] for e in examples], -100)
    attention = _pad([[1] * len(e["input_ids"]) for e in examples], 0)
    return {"input_ids": ids.to(device), "labels": labels.to(device), "attention_mask": attention.to(device)}


def _device(model):
    return next(model.parameters()).device


@torch.no_grad()
def score_examples(
    model,
    examples: list[dict],
    *,
    pad: int,
    batch_size: int = 32,
    k: float = 0.4,
    min_k_plus_plus: bool = False,
    desc: str = "scoring",
    progress: bool = True,
) -> dict[str, torch.Tensor]:
    """Teacher-forced statistics per example, each an fp32 ``(N,)`` tensor: ``avg_loss`` (all answer tokens),
    ``exact_memorization``, ``extraction_strength``, ``min_k`` and, when asked, ``min_k_plus_plus`` (on every answer
    token but the last, as open-unlearning)."""
    was_training = model.training
    model.eval()
    out: dict[str, list] = {"avg_loss": [], "exact_memorization": [], "extraction_strength": [], "min_k": []}
    if min_k_plus_plus:
        out["min_k_plus_plus"] = []
    starts = range(0, len(examples), batch_size)
    try:
        for start in progress_bar(starts, desc=desc, total=len(starts), enabled=progress):
            batch = _batch(examples[start : start + batch_size], pad, _device(model))
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            stats = answer_token_stats(logits, batch["labels"], min_k_plus_plus=min_k_plus_plus)
            scored = tokenwise_mask(stats["mask"])
            out["avg_loss"].append(mean_nll(stats["logp"], stats["mask"]).cpu())
            out["exact_memorization"].append(exact_memorization(stats["correct"], scored).cpu())
            out["extraction_strength"].append(extraction_strength(stats["correct"], scored).cpu())
            out["min_k"].append(min_k_scores(stats["logp"], scored, k).cpu())
            if min_k_plus_plus:
                out["min_k_plus_plus"].append(min_k_scores(stats["z"], scored, k).cpu())
    finally:
        model.train(was_training)
    return {key: torch.cat(values) if values else torch.empty(0) for key, values in out.items()}


def gradient_norms(model, examples: list[dict], *, pad: int, p: float = 2, desc: str = "gradnorm", progress=True):
    """GradNorm attack statistic per example, fp32 ``(N,)``: backpropagate the mean NLL of the answer tokens but
    the last, take each parameter gradient's ``p``-norm and average them over the parameters that get a gradient
    (open-unlearning's ``GradNormAttack``; it switches dropout on, we keep ``eval()`` so the number is deterministic).
    Gradients are cleared afterwards."""
    from .._validation import check_choice

    check_choice("p", p, (1, 2, float("inf")))
    params = [q for q in model.parameters() if q.requires_grad]
    if not params:
        raise ValueError("mia_gradnorm needs parameters that require gradients; the model has none.")
    was_training = model.training
    model.eval()
    norms = []
    try:
        for example in progress_bar(examples, desc=desc, total=len(examples), enabled=progress):
            batch = _batch([example], pad, _device(model))
            model.zero_grad(set_to_none=True)
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            stats = answer_token_stats(logits, batch["labels"])
            scored = tokenwise_mask(stats["mask"])
            if not scored.any():
                norms.append(float("nan"))
                continue
            mean_nll(stats["logp"], scored).sum().backward()
            per_param = [q.grad.detach().float().norm(p) for q in params if q.grad is not None]
            norms.append(torch.stack(per_param).mean().item())
    finally:
        model.zero_grad(set_to_none=True)
        model.train(was_training)
    return torch.tensor(norms, dtype=torch.float32)


def _cut(text: str, stopwords: Sequence[str]) -> str:
    for word in stopwords:
        if word and word in text:
            text = text.split(word)[0]
    return text.strip()


@torch.no_grad()
def generate_answers(
    model,
    tokenizer,
    examples: list[dict],
    *,
    max_new_tokens: int,
    batch_size: int = 32,
    stopwords: Sequence[str] = (),
    desc: str = "generating",
    progress: bool = True,
) -> list[str]:
    """Greedy continuations of each example's ``prompt_ids`` (left-padded batches), cut at EOS and at the first
    ``stopwords`` match and stripped (open-unlearning's ``eval_text_similarity``)."""
    from transformers import GenerationConfig

    pad = pad_id(tokenizer)
    eos = model.generation_config.eos_token_id if model.generation_config.eos_token_id is not None else None
    eos = eos if eos is not None else tokenizer.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
    config = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad, eos_token_id=sorted(eos_ids) or None
    )
    was_training = model.training
    model.eval()
    texts: list[str] = []
    starts = range(0, len(examples), batch_size)
    try:
        for start in progress_bar(starts, desc=desc, total=len(starts), enabled=progress):
            chunk = examples[start : start + batch_size]
            ids = _pad([e["prompt_ids"] for e in chunk], pad, left=True).to(_device(model))
            attention = _pad([[1] * len(e["prompt_ids"]) for e in chunk], 0, left=True).to(_device(model))
            output = model.generate(input_ids=ids, attention_mask=attention, generation_config=config)
            for row in output[:, ids.shape[1] :].tolist():
                end = next((i for i, t in enumerate(row) if t in eos_ids), len(row))
                texts.append(_cut(tokenizer.decode(row[:end], skip_special_tokens=True), stopwords))
    finally:
        model.train(was_training)
    return texts


def answer_texts(tokenizer, examples: list[dict]) -> list[str]:
    """The decoded label tokens of each example (special tokens skipped): the text the ZLib attack compresses."""
    return [tokenizer.decode([t for t in e["labels"] if t != -100], skip_special_tokens=True) for e in examples]
