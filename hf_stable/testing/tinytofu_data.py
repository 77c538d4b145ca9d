"""TinyTOFU data: the seeded authors, facts and splits ([`make_tinytofu`]), the word-level tokenizer and the 0.4M
Llama ([`build_tinytofu_model`]), and the embedding-reset control ([`reset_name_embeddings`]).

Imported through [`hf_stable.testing.tinytofu`], which documents the benchmark.
"""

from __future__ import annotations

import copy
import hashlib
import json
import random
from dataclasses import dataclass, field
from typing import Any

import torch


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
