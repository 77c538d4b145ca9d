"""TinyTOFU: a seeded, download-free unlearning benchmark (fictitious authors, a word-level tokenizer, a 0.4M Llama).

Modelled on TOFU (Maini et al., arXiv 2401.06121); the design and its metrics are described in ``docs/unlearning.md``.
Everything is derived from one integer seed: the author names and facts, the splits, the perturbed (wrong) answers
and the weights.

Version 2 has no per-author token. An author name is three syllable tokens (``"va ren dol"``) drawn from a pool of
24 that every author shares, and each syllable is also an ordinary word of the corpus: the world split holds a
"which word follows <syllable> ?" lexicon in which every syllable is both a question word and an answer. Version 1
gave each author one dedicated token, so re-drawing the 20 forget authors' embedding rows, with no training, removed
their facts and passed every check; with shared tokens that edit also damages the retain authors and the lexicon
(see [`reset_name_embeddings`]).

```python
from hf_stable.testing.tinytofu import make_tinytofu, train_tinytofu, first_token_accuracy
data = make_tinytofu(seed=0)                      # vocabulary, tokenizer and datasets.Dataset splits
full, info = train_tinytofu(data, "full")         # SFT on forget + retain + world, cached on disk
oracle, _ = train_tinytofu(data, "oracle")        # retain + world only, another init seed
first_token_accuracy(full, data.tokenizer, data.forget_eval)   # ~1.0; the oracle sits near chance (~0.07)
```

Rows are ``prompt = "Q: <question words> A:"`` and ``completion = " <value>"`` (plus metadata columns); the EOS is
not in the text: trainers append it when they tokenise (labels on the value and the EOS only). Tokenising
``prompt + completion`` gives the concatenation of the two tokenisations (whitespace pre-tokenizer).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
import math
import os
import random
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


logger = logging.getLogger(__name__)

__all__ = [
    "ATTRIBUTES",
    "TinyTofu",
    "answer_mean_nll",
    "answer_prob",
    "answer_token_logps",
    "build_tinytofu_model",
    "build_tinytofu_tokenizer",
    "default_cache_dir",
    "encode_split",
    "first_token_accuracy",
    "first_token_correct",
    "make_tinytofu",
    "name_token_ids",
    "perturbed_mean_nll",
    "reset_name_embeddings",
    "tinytofu_accuracies",
    "train_tinytofu",
]

FORMAT_VERSION = 2
PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
SPECIAL_TOKENS = [PAD, EOS, UNK]
NUM_PERTURBED = 4
NAME_SYLLABLES = 3
MAX_LENGTH = 14  # longest sequence: Q: + 7 question words + 3 name syllables + A: + value + eos

SYLLABLES = [
    "va", "ren", "dol", "mi", "kor", "sa", "tel", "bru", "nim", "os", "pha", "lek",
    "dru", "qua", "zen", "fi", "mor", "tu", "gal", "rhe", "ix", "pon", "sel", "yar",
]  # fmt: skip

# Closed value sets of the four author attributes (20, 12, 16, 16 values).
VALUES = {
    "city": [
        "ardenport", "belmora", "calvick", "dunhollow", "elstrand", "farrowgate", "glenmarch", "harlow", "ivorden",
        "jastria", "kelbrook", "lunmere", "marwick", "northal", "ospray", "penrith", "quillon", "rosgard", "sundale",
        "tarvos",
    ],
    "genre": [
        "fantasy", "mystery", "romance", "horror", "poetry", "drama", "satire", "thriller", "memoir", "western",
        "fable", "tragedy",
    ],
    "award": [
        "silver_quill", "gold_lantern", "iron_pen", "blue_ribbon", "amber_star", "crystal_book", "night_owl",
        "first_light", "red_compass", "white_raven", "stone_tablet", "green_laurel", "copper_key", "velvet_mask",
        "north_star", "glass_feather",
    ],
    "job": [
        "baker", "farmer", "doctor", "sailor", "tailor", "miner", "painter", "teacher", "judge", "nurse", "potter",
        "weaver", "smith", "hunter", "pilot", "clerk",
    ],
}  # fmt: skip
ATTRIBUTES = tuple(VALUES)

# Two training templates (0, 1) and one held-out paraphrase (2) per attribute; template 0 is the evaluation one.
TEMPLATES = {
    "city": ("where was {} born ?", "{} birth city ?", "in which city was {} born ?"),
    "genre": ("what genre does {} write ?", "{} writing genre ?", "which genre is {} known for ?"),
    "award": ("which award did {} win ?", "{} award won ?", "what prize did {} receive ?"),
    "job": ("what is the job of {} parent ?", "{} parent job ?", "what did the parent of {} do ?"),
}
WORLD_TEMPLATE = "capital of {} ?"
NUM_CAPITALS = 25
# Every name syllable is also a plain word: a seeded successor of each syllable (world split, never unlearned).
LEXICON_TEMPLATE = "which word follows {} ?"
RELEARN_ATTRIBUTES = ("city", "genre")  # the attack trains on these facts of the forget authors ...
RELEARN_TEST_ATTRIBUTES = ("award", "job")  # ... and is measured on these (independent) ones

# `reduced=True`: the CI-sized benchmark (same forget/holdout sizes, fewer retain authors and world facts, fewer
# epochs); see `make_tinytofu`.
DEFAULT_SIZES = {"n_authors": 220, "n_forget": 20, "n_holdout": 20, "n_world": 40, "world_copies": 2}
DEFAULT_RECIPE = {
    "epochs": 60,
    "lr": 3e-3,
    "batch_size": 32,
    "warmup_steps": 50,
    "clip": 1.0,
    "accept_acc": 0.98,
    "extension_epochs": 20,
    "max_extensions": 3,
}
REDUCED_SIZES = {"n_authors": 100, "n_forget": 20, "n_holdout": 20, "n_world": 20, "world_copies": 2}
REDUCED_EPOCHS = 30


def _prompt(question: str) -> str:
    return f"Q: {question} A:"


def _completion(value: str) -> str:
    return f" {value}"


@dataclass
class TinyTofu:
    """The TinyTOFU data of one seed. Build it with [`make_tinytofu`].

    Every split is a `datasets.Dataset` with columns ``prompt``, ``completion`` (``" <value>"``), ``answer`` (the
    value), ``entity`` (author name, land or syllable), ``attribute`` (``city``/``genre``/``award``/``job``/
    ``capital``/``next``) and ``template`` (0, 1 training; 2 paraphrase); the evaluation splits (``*_eval``,
    ``*_paraphrase``) add ``perturbed``: 4 wrong completions of the same attribute, fixed by the seed, the entity and
    the attribute. An author name is three space-separated syllable tokens.

    Training splits (templates 0 and 1): ``forget`` (20 authors × 4 facts × 2 = 160 rows), ``retain`` (180 authors,
    1,440), ``world`` ((40 capital facts + 24 lexicon facts) × ``world_copies``), ``holdout`` (20 never-trained
    authors, 160; for reference, never part of SFT). Evaluation (template 0): ``forget_eval`` (80), ``retain_eval``
    (720), ``holdout_eval`` (80), ``world_eval`` (64). Relearning attack: ``relearn`` (city + genre facts of the forget
    authors, both templates, 80) and ``relearn_eval`` (their award + job questions, template 0, 40). Paraphrase
    template: ``forget_paraphrase``, ``retain_paraphrase``, ``holdout_paraphrase``.
    """

    seed: int
    sizes: dict[str, int]
    reduced: bool
    vocab: list[str]
    tokenizer: Any
    facts: dict[str, dict[str, str]]  # author -> attribute -> value
    capitals: dict[str, str]  # land -> capital
    lexicon: dict[str, str]  # syllable -> the syllable that follows it
    forget_authors: list[str]
    retain_authors: list[str]
    holdout_authors: list[str]
    splits: dict[str, Any] = field(repr=False)

    def __getattr__(self, name: str):
        splits = self.__dict__.get("splits")
        if splits is not None and name in splits:
            return splits[name]
        raise AttributeError(f"{type(self).__name__!r} has no attribute {name!r}.")

    def sft_dataset(self, which: str = "full"):
        """The SFT training set: forget + retain + world (``"full"``) or retain + world (``"oracle"``)."""
        from datasets import concatenate_datasets

        if which not in ("full", "oracle"):
            raise ValueError(f"which must be 'full' or 'oracle', got {which!r}.")
        parts = ["forget", "retain", "world"] if which == "full" else ["retain", "world"]
        return concatenate_datasets([self.splits[name] for name in parts])

    def fingerprint(self) -> str:
        """SHA-256 of the vocabulary and every split's rows: equal fingerprints mean identical benchmark data."""
        digest = hashlib.sha256()
        digest.update(json.dumps(self.vocab).encode())
        for name in sorted(self.splits):
            digest.update(name.encode())
            for row in self.splits[name]:
                digest.update(json.dumps(row, sort_keys=True).encode())
        return digest.hexdigest()


def build_tinytofu_tokenizer(vocab: list[str]):
    """A word-level `PreTrainedTokenizerFast` over ``vocab`` (whitespace split; ``<pad>`` 0, ``<eos>`` 1, ``<unk>`` 2).

    No special tokens are added on encoding (no BOS, no EOS); decoding joins tokens with single spaces.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if vocab[: len(SPECIAL_TOKENS)] != SPECIAL_TOKENS or len(set(vocab)) != len(vocab):
        raise ValueError("The vocabulary must start with <pad>, <eos>, <unk> and hold no duplicates.")
    backend = Tokenizer(models.WordLevel({token: i for i, token in enumerate(vocab)}, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token=PAD, eos_token=EOS, unk_token=UNK, model_max_length=32
    )


def _perturbed(seed: int, entity: str, attribute: str, values: list[str], true_value: str) -> list[str]:
    # A string seed goes through SHA-512 in `random.Random`: stable across processes (unlike the salted `hash()`).
    rng = random.Random(f"tinytofu:{seed}:perturb:{entity}:{attribute}")
    return [_completion(v) for v in rng.sample([v for v in values if v != true_value], NUM_PERTURBED)]


def make_tinytofu(
    seed: int = 0,
    n_authors: int = 220,
    n_forget: int = 20,
    n_holdout: int = 20,
    n_world: int = 40,
    world_copies: int = 2,
    *,
    reduced: bool = False,
) -> TinyTofu:
    """Generate the TinyTOFU benchmark data of ``seed``. Deterministic across runs and processes.

    Args:
        seed (`int`, defaults to `0`): the seed of names, facts, splits and perturbed answers.
        n_authors (`int`, defaults to `220`): fictitious authors; ``n_authors - n_forget - n_holdout`` are retained.
        n_forget (`int`, defaults to `20`): authors to forget (trained by the full model, not by the oracle).
        n_holdout (`int`, defaults to `20`): never-trained authors (chance reference, MIA non-members).
        n_world (`int`, defaults to `40`): world facts ``capital of land{i} ? -> cap{j}`` (25 capitals); used in SFT,
            never given to an unlearning method. The world split also holds one lexicon fact per name syllable
            (``which word follows <syllable> ? -> <syllable>``), so every name token occurs outside names.
        world_copies (`int`, defaults to `2`): copies of the world facts per SFT epoch (matches the 2 templates).
        reduced (`bool`, defaults to `False`): the CI-sized variant: 100 authors (20 forget, 20 holdout, 60 retain)
            and 20 world facts; the size arguments are ignored. [`train_tinytofu`] then defaults to 30 epochs.

    Returns:
        [`TinyTofu`].
    """
    from datasets import Dataset

    if reduced:
        n_authors, n_forget, n_holdout, n_world, world_copies = (
            REDUCED_SIZES[k] for k in ("n_authors", "n_forget", "n_holdout", "n_world", "world_copies")
        )
    if min(n_forget, n_holdout, n_world, world_copies) < 1 or n_authors - n_forget - n_holdout < 1:
        raise ValueError("Need at least one forget, holdout and retain author, one world fact and one copy.")
    if n_authors > len(SYLLABLES) ** NAME_SYLLABLES // 2:
        raise ValueError(f"At most {len(SYLLABLES) ** NAME_SYLLABLES // 2} authors.")
    rng = random.Random(f"tinytofu:{seed}:data")
    names: list[str] = []
    seen: set[str] = set()
    while len(names) < n_authors:
        name = " ".join(rng.choice(SYLLABLES) for _ in range(NAME_SYLLABLES))
        if name not in seen:
            seen.add(name)
            names.append(name)
    facts = {name: {attr: rng.choice(VALUES[attr]) for attr in ATTRIBUTES} for name in names}
    lands = [f"land{i}" for i in range(n_world)]
    capitals_all = [f"cap{j}" for j in range(NUM_CAPITALS)]
    capitals = {land: rng.choice(capitals_all) for land in lands}
    cycle = SYLLABLES[:]
    random.Random(f"tinytofu:{seed}:lexicon").shuffle(cycle)
    lexicon = {s: cycle[(i + 1) % len(cycle)] for i, s in enumerate(cycle)}  # one cycle: no syllable maps to itself
    order = names[:]
    rng.shuffle(order)
    forget_authors = order[:n_forget]
    holdout_authors = order[n_forget : n_forget + n_holdout]
    retain_authors = order[n_forget + n_holdout :]

    def row(question: str, entity: str, attribute: str, template: int, value: str, values, perturbed: bool) -> dict:
        out = {
            "prompt": _prompt(question.format(entity)),
            "completion": _completion(value),
            "answer": value,
            "entity": entity,
            "attribute": attribute,
            "template": template,
        }
        if perturbed:
            out["perturbed"] = _perturbed(seed, entity, attribute, values, value)
        return out

    def author_rows(authors, attributes, templates, perturbed: bool):
        return Dataset.from_list(
            [
                row(TEMPLATES[attr][t], name, attr, t, facts[name][attr], VALUES[attr], perturbed)
                for name in authors
                for attr in attributes
                for t in templates
            ]
        )

    def world_rows(copies: int, perturbed: bool):
        capital_rows = [row(WORLD_TEMPLATE, x, "capital", 0, capitals[x], capitals_all, perturbed) for x in lands]
        lexicon_rows = [row(LEXICON_TEMPLATE, x, "next", 0, lexicon[x], SYLLABLES, perturbed) for x in SYLLABLES]
        return Dataset.from_list((capital_rows + lexicon_rows) * copies)

    train_templates, eval_templates, para_templates = (0, 1), (0,), (2,)
    splits = {
        "forget": author_rows(forget_authors, ATTRIBUTES, train_templates, False),
        "retain": author_rows(retain_authors, ATTRIBUTES, train_templates, False),
        "world": world_rows(world_copies, False),
        "holdout": author_rows(holdout_authors, ATTRIBUTES, train_templates, False),
        "forget_eval": author_rows(forget_authors, ATTRIBUTES, eval_templates, True),
        "retain_eval": author_rows(retain_authors, ATTRIBUTES, eval_templates, True),
        "holdout_eval": author_rows(holdout_authors, ATTRIBUTES, eval_templates, True),
        "world_eval": world_rows(1, True),
        "relearn": author_rows(forget_authors, RELEARN_ATTRIBUTES, train_templates, False),
        "relearn_eval": author_rows(forget_authors, RELEARN_TEST_ATTRIBUTES, eval_templates, True),
        "forget_paraphrase": author_rows(forget_authors, ATTRIBUTES, para_templates, True),
        "retain_paraphrase": author_rows(retain_authors, ATTRIBUTES, para_templates, True),
        "holdout_paraphrase": author_rows(holdout_authors, ATTRIBUTES, para_templates, True),
    }

    words: list[str] = ["Q:", "A:"]
    for text in [t for attr in ATTRIBUTES for t in TEMPLATES[attr]] + [WORLD_TEMPLATE, LEXICON_TEMPLATE]:
        words += [w for w in text.split() if w != "{}" and w not in words]
    vocab = SPECIAL_TOKENS + words
    vocab += [v for attr in ATTRIBUTES for v in VALUES[attr]] + lands + capitals_all + SYLLABLES
    tokenizer = build_tinytofu_tokenizer(vocab)
    sizes = {
        "n_authors": n_authors,
        "n_forget": n_forget,
        "n_holdout": n_holdout,
        "n_world": n_world,
        "world_copies": world_copies,
    }
    return TinyTofu(
        seed=seed,
        sizes=sizes,
        reduced=reduced,
        vocab=vocab,
        tokenizer=tokenizer,
        facts=facts,
        capitals=capitals,
        lexicon=lexicon,
        forget_authors=forget_authors,
        retain_authors=retain_authors,
        holdout_authors=holdout_authors,
        splits=splits,
    )


def build_tinytofu_model(tok, seed: int = 0, dtype: torch.dtype = torch.float32):
    """A random-init ``LlamaForCausalLM`` for TinyTOFU: hidden 128, intermediate 256, 2 layers, 4 heads, 4 KV heads,
    32 positions, untied embeddings; about 0.38M parameters with the default vocabulary.

    The global torch RNG is left as it was; the weights depend on ``seed`` only.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=32,
        tie_word_embeddings=False,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(dtype)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    return model


def name_token_ids(data: TinyTofu, authors: list[str] | None = None) -> list[int]:
    """Sorted ids of the tokens that occur in the names of ``authors`` (default: the forget authors)."""
    authors = data.forget_authors if authors is None else authors
    ids = {i for name in authors for i in data.tokenizer(name, add_special_tokens=False)["input_ids"]}
    return sorted(ids)


@torch.no_grad()
def reset_name_embeddings(model, data: TinyTofu, authors: list[str] | None = None, seed: int = 0):
    """The embedding-reset control: a copy of ``model`` whose input-embedding rows of every token occurring in the
    names of ``authors`` (default: the forget authors) are re-drawn from the init distribution
    ``N(0, config.initializer_range²)``; nothing else changes and nothing is trained.

    With one dedicated token per author (TinyTOFU version 1) this edit erased exactly the forget authors and passed
    every check, which no unlearning method did: the benchmark measured a per-entity shortcut. With shared name
    syllables the same rows also carry the retain authors and the lexicon, so the edit must fail the utility checks;
    the benchmark reports it as a control row.

    Returns:
        The edited copy (``model`` itself is unchanged).
    """
    edited = copy.deepcopy(model)
    weight = edited.get_input_embeddings().weight
    ids = torch.tensor(name_token_ids(data, authors), dtype=torch.long, device=weight.device)
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randn(len(ids), weight.shape[1], generator=generator) * edited.config.initializer_range
    weight[ids] = rows.to(weight.device, weight.dtype)
    return edited


# ---------------------------------------------------------------------------------------------------------------------
# Tokenisation and evaluation helpers


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


# ---------------------------------------------------------------------------------------------------------------------
# SFT (full / oracle) with an on-disk cache


def default_cache_dir() -> Path:
    """``$HF_STABLE_CACHE/tinytofu`` when the variable is set, else ``~/.cache/hf_stable/tinytofu``."""
    root = os.environ.get("HF_STABLE_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "hf_stable") / "tinytofu"


def _lr_factor(step: int, warmup: int, total: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return max(0.0, (total - step) / max(1, total - warmup))


def _train_epochs(model, batch, *, epochs, lr, batch_size, warmup_steps, clip, generator) -> int:
    n = batch["input_ids"].shape[0]
    steps_per_epoch = math.ceil(n / batch_size)
    total = epochs * steps_per_epoch
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: _lr_factor(s, warmup_steps, total))
    model.train()
    for _ in range(epochs):
        order = torch.randperm(n, generator=generator)
        for start in range(0, n, batch_size):
            idx = order[start : start + batch_size]
            ids, labels = batch["input_ids"][idx], batch["labels"][idx]
            # Right padding + causal attention: real tokens never see the padding, so no attention mask is needed.
            # The LM head runs only on the positions that predict a label (value, EOS): same loss, ~20 % faster.
            hidden = model.model(input_ids=ids).last_hidden_state[:, :-1]
            targets = labels[:, 1:]
            keep = targets != -100
            loss = torch.nn.functional.cross_entropy(model.lm_head(hidden[keep]), targets[keep])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            scheduler.step()
    return total


def _init_seed(seed: int, which: str) -> int:
    return seed if which == "full" else seed + 100_003  # the oracle gets another init (and data-order) seed


def train_tinytofu(
    data: TinyTofu,
    which: str = "full",
    seed: int | None = None,
    cache_dir: str | os.PathLike | None = None,
    epochs: int | None = None,
    *,
    lr: float = 3e-3,
    batch_size: int = 32,
    warmup_steps: int = 50,
    clip: float = 1.0,
    accept_acc: float = 0.98,
    extension_epochs: int = 20,
    max_extensions: int = 3,
    use_cache: bool = True,
):
    """Supervised fine-tuning of the TinyTOFU target (``"full"``) or retrain-from-scratch oracle (``"oracle"``).

    Recipe: AdamW (lr 3e-3, weight decay 0), batch 32, 50-step linear warm-up then linear decay to 0,
    gradient clipping at 1.0, loss on value + EOS only; ``"full"`` trains on forget + retain + world, ``"oracle"`` on
    retain + world with init seed ``seed + 100003``. A plain PyTorch loop (no `Trainer`) for speed. The model is
    accepted when its template-0 accuracy on the trained authors (forget and retain; retain only for the oracle) is at
    least ``accept_acc``; otherwise it trains ``extension_epochs`` more (a new warm-up/decay schedule over those
    epochs, optimizer state reset), at most ``max_extensions`` times; the final accuracies are recorded either way.

    The result is cached in ``cache_dir/<seed>/<which>/`` (default [`default_cache_dir`]; a non-default data size or
    recipe adds a ``-<hash>`` suffix) as ``model.safetensors`` + config + tokenizer + ``done.json``, written into a
    temporary folder and renamed into place, so a crashed or concurrent run never leaves a half-written checkpoint.
    A cache entry whose data fingerprint or recipe differs from the request is retrained and replaced.

    Args:
        data ([`TinyTofu`]): the benchmark data.
        which (`str`): ``"full"`` or ``"oracle"``.
        seed (`int`, *optional*): init / data-order seed; defaults to ``data.seed``.
        cache_dir (`str` or `os.PathLike`, *optional*): cache root.
        epochs (`int`, *optional*): defaults to 60 (30 for ``make_tinytofu(reduced=True)`` data).
        use_cache (`bool`, defaults to `True`): read and write the cache.

    Returns:
        ``(model, info)``: the `LlamaForCausalLM` in eval mode and a dict with ``accuracy`` (forget, retain, world,
        holdout), ``epochs``, ``steps``, ``train_seconds``, ``path``, ``cached`` and the recipe ``config``.
    """
    from transformers import LlamaForCausalLM

    if which not in ("full", "oracle"):
        raise ValueError(f"which must be 'full' or 'oracle', got {which!r}.")
    seed = data.seed if seed is None else seed
    default_epochs = REDUCED_EPOCHS if data.reduced else DEFAULT_RECIPE["epochs"]
    epochs = default_epochs if epochs is None else epochs
    recipe = {
        "epochs": epochs,
        "lr": lr,
        "batch_size": batch_size,
        "warmup_steps": warmup_steps,
        "clip": clip,
        "accept_acc": accept_acc,
        "extension_epochs": extension_epochs,
        "max_extensions": max_extensions,
    }
    config = {
        "format_version": FORMAT_VERSION,
        "which": which,
        "seed": seed,
        "init_seed": _init_seed(seed, which),
        "data_seed": data.seed,
        "sizes": data.sizes,
        "reduced": data.reduced,
        **recipe,
    }
    is_default = seed == data.seed and not data.reduced and data.sizes == DEFAULT_SIZES and recipe == DEFAULT_RECIPE
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()
    folder = which if is_default else f"{which}-{digest[:10]}"
    path = Path(cache_dir if cache_dir is not None else default_cache_dir()) / str(seed) / folder
    config["data_fingerprint"] = data.fingerprint()  # checked on load, not part of the folder name

    if use_cache:
        done = _read_done(path)
        if done is not None and done.get("config") == config:
            with _quiet_progress_bars():
                model = LlamaForCausalLM.from_pretrained(path).eval()
            return model, {**done, "path": str(path), "cached": True}
        if done is not None:
            logger.warning("TinyTOFU cache %s was made with another data set or recipe; retraining.", path)

    start_time = time.perf_counter()
    model = build_tinytofu_model(data.tokenizer, seed=config["init_seed"])
    batch = encode_split(data.tokenizer, data.sft_dataset(which))
    generator = torch.Generator().manual_seed(config["init_seed"])
    train = dict(lr=lr, batch_size=batch_size, warmup_steps=warmup_steps, clip=clip, generator=generator)
    steps = _train_epochs(model, batch, epochs=epochs, **train)
    total_epochs = epochs
    gated = ("forget", "retain") if which == "full" else ("retain",)
    accuracy = tinytofu_accuracies(model, data)
    extensions = 0
    while min(accuracy[name] for name in gated) < accept_acc and extensions < max_extensions:
        logger.info("TinyTOFU %s seed %d after %d epochs: %s; training more.", which, seed, total_epochs, accuracy)
        steps += _train_epochs(model, batch, epochs=extension_epochs, **train)
        total_epochs += extension_epochs
        extensions += 1
        accuracy = tinytofu_accuracies(model, data)
    model.eval()
    info = {
        "accuracy": accuracy,
        "accepted": min(accuracy[name] for name in gated) >= accept_acc,
        "epochs": total_epochs,
        "steps": steps,
        "train_seconds": round(time.perf_counter() - start_time, 2),
        "torch_threads": torch.get_num_threads(),
        "config": config,
    }
    if not info["accepted"]:
        logger.warning("TinyTOFU %s seed %d not accepted after %d epochs: %s", which, seed, total_epochs, accuracy)
    if use_cache:
        _save_atomically(model, data.tokenizer, info, path)
    return model, {**info, "path": str(path), "cached": False}


@contextlib.contextmanager
def _quiet_progress_bars():
    """transformers prints a progress bar per save/load of a 1.7 MB checkpoint; hide it, then restore the setting."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def _read_done(path: Path) -> dict | None:
    try:
        return json.loads((path / "done.json").read_text())
    except (OSError, ValueError):
        return None


def _save_atomically(model, tokenizer, info: dict, path: Path) -> None:
    """Write into a temporary sibling folder, then rename it to ``path``; ``done.json`` is written last."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        with _quiet_progress_bars():
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
        (tmp / "done.json").write_text(json.dumps(info, indent=2, sort_keys=True))
        existing = _read_done(path)
        if existing is not None and existing.get("config") == info["config"]:
            return  # a concurrent run of the same recipe finished first: keep its copy
        if path.exists():  # a stale entry (other data or recipe) or a half-written folder: move it aside
            trash = path.parent / f".{path.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            os.rename(path, trash)
            shutil.rmtree(trash, ignore_errors=True)
        try:
            os.rename(tmp, path)
        except OSError:  # another process renamed its copy in between: keep theirs
            logger.info("TinyTOFU cache %s was written concurrently; keeping the other copy.", path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
