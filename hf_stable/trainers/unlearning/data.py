"""Data for unlearning: prompt/completion rows tokenised with completion-only labels, forget examples paired with
retain (and normal) partners, and a collator that pads each stream on its own.

Rows are what TRL users already have: ``prompt`` + ``completion`` (or ``answer``) as strings, or as chat messages
(conversational). Labels are `-100` on the prompt; the completion is followed by EOS. The attention mask comes from
lengths, never from ``input_ids != pad_id`` (which would hide a real EOS when pad == eos).
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

import torch

# rows and their padding, shared with the unlearning evaluation (a lower layer, so they are defined there)
from ...evaluation.rows import (  # noqa: F401
    ANSWER_COLUMNS,
    _answer_column,
    _is_conversational,
    pad_stream,
    tokenize_row,
    tokenize_rows,
)


def row_keys(dataset) -> set[tuple[str, str]]:
    """`(prompt, answer)` text keys, to detect rows shared by the forget and retain sets."""
    rows = list(dataset)
    if not rows:
        return set()
    answer = _answer_column(rows[0].keys())
    return {(repr(r["prompt"]), repr(r[answer])) for r in rows}


def _rng(*parts) -> random.Random:
    # hashlib, not hash(): Python salts str hashes per process, and every DDP rank must draw the same partners
    digest = hashlib.sha256("|".join(map(str, parts)).encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "little"))


class ForgetRetainDataset(torch.utils.data.Dataset):
    """One item per anchor example (forget by default) with a partner from the other set, and optionally ``k``
    normal examples (SGA). Partners are drawn from ``(seed, epoch, index)`` with a stable hash, so every process and
    every batch layout sees the same pairs; call `set_epoch` to redraw them each epoch.
    """

    def __init__(
        self,
        forget: list[dict],
        retain: list[dict],
        anchor: str = "forget",
        seed: int = 0,
        normal=None,
        num_normal: int = 0,
        normal_index: list[list[int]] | None = None,
    ):
        if anchor not in ("forget", "retain"):
            raise ValueError(f"anchor must be 'forget' or 'retain', got {anchor!r}.")
        self.forget, self.retain, self.anchor, self.seed = forget, retain, anchor, seed
        self.normal, self.num_normal, self.normal_index = normal, num_normal, normal_index
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return len(self.forget if self.anchor == "forget" else self.retain)

    def _pair(self, index: int) -> tuple[int, int]:
        rng = _rng("pair", self.seed, self.epoch, index)
        if self.anchor == "forget":
            return index, rng.randrange(len(self.retain)) if self.retain else -1
        return rng.randrange(len(self.forget)), index

    def __getitem__(self, index: int) -> dict[str, Any]:
        f, r = self._pair(index)
        item = {"forget": self.forget[f], "forget_index": f}
        if r >= 0:
            item["retain"] = self.retain[r]
        if self.num_normal:
            if self.normal_index is not None:  # precomputed neighbours (e.g. similar retain rows)
                candidates = self.normal_index[f]
                rng = _rng("normal", self.seed, self.epoch, f)
                chosen = [candidates[rng.randrange(len(candidates))] for _ in range(self.num_normal)]
            else:
                rng = _rng("normal", self.seed, self.epoch, f)
                chosen = [rng.randrange(len(self.normal)) for _ in range(self.num_normal)]
            item["normal"] = [self.normal[j] for j in chosen]
        return item


class UnlearningCollator:
    """Collates `ForgetRetainDataset` items into ``{"forget": batch, "retain": batch, "normal": batch (B, K, L),
    "forget_index": (B,)}``; each stream is padded on its own."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, items: list[dict]) -> dict[str, Any]:
        if "forget" not in items[0]:  # plain rows (evaluation): one padded stream
            return pad_stream(items, self.pad_token_id)
        batch = {
            "forget": pad_stream([i["forget"] for i in items], self.pad_token_id),
            "forget_index": torch.tensor([i["forget_index"] for i in items], dtype=torch.long),
        }
        if "retain" in items[0]:
            batch["retain"] = pad_stream([i["retain"] for i in items], self.pad_token_id)
        if "normal" in items[0]:
            k = len(items[0]["normal"])
            flat = pad_stream([n for i in items for n in i["normal"]], self.pad_token_id)
            batch["normal"] = {key: value.view(len(items), k, -1) for key, value in flat.items()}
        return batch


def similar_rows(forget: list[dict], retain: list[dict], k: int) -> list[list[int]]:
    """For each forget example, the ``k`` retain examples whose prompt tokens overlap it most (Jaccard on token-id
    sets; SGA's ``sga_normal_source="retain_similar"``, a cheap stand-in for embedding similarity)."""

    def prompt_set(example):
        return {t for t, label in zip(example["input_ids"], example["labels"], strict=True) if label == -100}

    retain_sets = [prompt_set(r) for r in retain]
    out = []
    for f in forget:
        fs = prompt_set(f)
        scores = [len(fs & rs) / max(1, len(fs | rs)) for rs in retain_sets]
        out.append(sorted(range(len(retain)), key=lambda j: (-scores[j], j))[: max(k, 1)])
    return out


def training_pairs(args, tokenizer, forget, retain, holdout, normal, num_normal: int):
    """``(forget_rows, retain_rows, holdout_rows, ForgetRetainDataset)`` for an `UnlearningConfig` ``args``.

    Retain rows are tokenised even when the loss does not use them: the collapse guard and the evaluation read them.
    ``num_normal`` normal rows per forget row (SGA) come from ``normal`` or from the retain rows
    (``args.sga_normal_source``); ``"retain_similar"`` draws them among the ``4 · num_normal`` most similar.
    """
    forget_rows = tokenize_rows(forget, tokenizer, args.max_length, "forget_dataset")
    has_retain = retain is not None and len(retain) > 0
    retain_rows = tokenize_rows(retain, tokenizer, args.max_length, "retain_dataset") if has_retain else []
    holdout_rows = tokenize_rows(holdout, tokenizer, args.max_length, "holdout_dataset") if holdout else []
    normal_rows, normal_index = None, None
    if num_normal:
        if args.sga_normal_source == "provided":
            normal_rows = tokenize_rows(normal, tokenizer, args.max_length, "normal_dataset")
        else:
            normal_rows = retain_rows
            if args.sga_normal_source == "retain_similar":
                normal_index = similar_rows(forget_rows, retain_rows, 4 * num_normal)
    pairs = ForgetRetainDataset(
        forget_rows,
        retain_rows,
        anchor=args.anchor,
        seed=args.data_seed or args.seed,
        normal=normal_rows,
        num_normal=num_normal,
        normal_index=normal_index,
    )
    return forget_rows, retain_rows, holdout_rows, pairs
