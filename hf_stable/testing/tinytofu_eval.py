"""TinyTOFU tokenisation and evaluation: encoded splits, teacher-forced answer log-probs, NLLs and first-token
accuracies. Imported through [`hf_stable.testing.tinytofu`]."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .tinytofu_data import MAX_LENGTH


if TYPE_CHECKING:
    from .tinytofu_data import TinyTofu



def _rows(split) -> list[dict]:
    return split if isinstance(split, list) else list(split)


def encode_split(tok, split, max_length: int | None = MAX_LENGTH) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids``, ``attention_mask`` and completion-only ``labels`` (value + EOS) of a split.

    The same construction as the trainers' data path: prompt ids, completion ids, EOS; labels -100 elsewhere.
    """
    sequences, labels = [], []
    for row in _rows(split):
        prompt = tok(row["prompt"], add_special_tokens=False)["input_ids"]
        answer = tok(row["completion"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        sequences.append(prompt + answer)
        labels.append([-100] * len(prompt) + answer)
    width = max(map(len, sequences))
    if max_length is not None and width > max_length:
        raise ValueError(f"A sequence has {width} tokens, more than max_length={max_length}.")
    n = len(sequences)
    input_ids = torch.full((n, width), tok.pad_token_id, dtype=torch.long)
    label_ids = torch.full((n, width), -100, dtype=torch.long)
    attention = torch.zeros((n, width), dtype=torch.long)
    for i, (seq, lab) in enumerate(zip(sequences, labels, strict=True)):
        input_ids[i, : len(seq)] = torch.tensor(seq)
        label_ids[i, : len(lab)] = torch.tensor(lab)
        attention[i, : len(seq)] = 1
    return {"input_ids": input_ids, "attention_mask": attention, "labels": label_ids}


def _device(model) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def answer_token_logps(
    model, tok, prompts: list[str], completions: list[str], batch_size: int = 512
) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced log-probs of each completion's tokens followed by EOS.

    Returns:
        ``(logps, mask)``, float32 and bool tensors of shape ``(N, T)`` (``T`` = longest answer + 1), on the CPU.
    """
    rows = [{"prompt": p, "completion": c} for p, c in zip(prompts, completions, strict=True)]
    batch = encode_split(tok, rows, max_length=None)
    was_training = model.training
    model.eval()
    device = _device(model)
    out_logps, out_mask = [], []
    try:
        for start in range(0, len(rows), batch_size):
            ids = batch["input_ids"][start : start + batch_size].to(device)
            attn = batch["attention_mask"][start : start + batch_size].to(device)
            labels = batch["labels"][start : start + batch_size].to(device)
            logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
            targets = labels[:, 1:]
            mask = targets != -100
            logps = torch.log_softmax(logits, -1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
            out_logps.append((logps * mask).cpu())
            out_mask.append(mask.cpu())
    finally:
        model.train(was_training)
    logps, mask = torch.cat(out_logps), torch.cat(out_mask)
    # Answers are right-aligned after prompts of different lengths; left-align them into (N, T).
    width = int(mask.sum(-1).max())
    aligned = torch.zeros(len(rows), width)
    aligned_mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i in range(len(rows)):
        values = logps[i][mask[i]]
        aligned[i, : len(values)] = values
        aligned_mask[i, : len(values)] = True
    return aligned, aligned_mask


def answer_mean_nll(model, tok, prompts: list[str], completions: list[str], batch_size: int = 512) -> torch.Tensor:
    """Mean NLL per answer token (completion + EOS) for each ``(prompt, completion)``; float64 tensor ``(N,)``."""
    logps, mask = answer_token_logps(model, tok, prompts, completions, batch_size)
    return -(logps.double() * mask).sum(-1) / mask.sum(-1)


def answer_prob(model, tok, eval_split, completions: list[str] | None = None, batch_size: int = 512) -> torch.Tensor:
    """Length-normalised probability ``exp(-mean NLL)`` of answer + EOS per question; float64 tensor ``(N,)``.

    ``completions`` replaces the split's ``completion`` column (for instance one perturbed answer per question).
    """
    rows = _rows(eval_split)
    completions = [r["completion"] for r in rows] if completions is None else completions
    return torch.exp(-answer_mean_nll(model, tok, [r["prompt"] for r in rows], completions, batch_size))


def perturbed_mean_nll(model, tok, eval_split, batch_size: int = 512) -> torch.Tensor:
    """Mean NLL of each of the ``perturbed`` answers of every question; float64 tensor ``(N, 4)``.

    With ``answer_mean_nll`` of the true answers this gives [`hf_stable.evaluation.truth_ratio`].
    """
    rows = _rows(eval_split)
    k = len(rows[0]["perturbed"])
    prompts = [r["prompt"] for r in rows for _ in range(k)]
    completions = [c for r in rows for c in r["perturbed"]]
    return answer_mean_nll(model, tok, prompts, completions, batch_size).reshape(len(rows), k)


@torch.no_grad()
def first_token_correct(model, tok, eval_split, batch_size: int = 512) -> torch.Tensor:
    """Per question: is the argmax at the position predicting the first answer token that token? Bool ``(N,)``."""
    rows = _rows(eval_split)
    prompts = [tok(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows]
    firsts = torch.tensor([tok(r["completion"], add_special_tokens=False)["input_ids"][0] for r in rows])
    was_training = model.training
    model.eval()
    device = _device(model)
    predictions = []
    try:
        for start in range(0, len(rows), batch_size):
            chunk = prompts[start : start + batch_size]
            width = max(map(len, chunk))
            ids = torch.full((len(chunk), width), tok.pad_token_id, dtype=torch.long)
            attn = torch.zeros((len(chunk), width), dtype=torch.long)
            for i, p in enumerate(chunk):
                ids[i, : len(p)] = torch.tensor(p)
                attn[i, : len(p)] = 1
            logits = model(input_ids=ids.to(device), attention_mask=attn.to(device)).logits
            last = torch.tensor([len(p) - 1 for p in chunk], device=device)
            predictions.append(logits[torch.arange(len(chunk), device=device), last].argmax(-1).cpu())
    finally:
        model.train(was_training)
    return torch.cat(predictions) == firsts


def first_token_accuracy(model, tok, eval_split, batch_size: int = 512) -> float:
    """Accuracy: fraction of questions whose argmax at the position predicting the first answer token is right."""
    return first_token_correct(model, tok, eval_split, batch_size).double().mean().item()


def tinytofu_accuracies(model, data: TinyTofu) -> dict[str, float]:
    """First-token accuracies on the template-0 splits: ``forget``, ``retain``, ``world``, ``holdout``."""
    return {
        name: first_token_accuracy(model, data.tokenizer, data.splits[f"{name}_eval"])
        for name in ("forget", "retain", "world", "holdout")
    }
