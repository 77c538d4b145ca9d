"""Synthetic tasks with verifiers, for tests, the demo, examples and experiments.

Every dataset is seeded and built in memory; nothing downloads.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence

import torch

# the verifier of these tasks is one of the library's rewards (the library may not import this module)
from ..rewards.exact_match import _completion_text, arithmetic_reward  # noqa: F401


_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def _problems(n: int, seed: int, ops: Sequence[str], max_operand: int) -> list[tuple[str, str]]:
    unknown = [op for op in ops if op not in _OPS]
    if unknown or not ops:
        raise ValueError(f"ops must be a non-empty subset of {sorted(_OPS)}, got {list(ops)}.")
    if n < 0 or max_operand < 0:
        raise ValueError(f"n and max_operand must be >= 0, got n={n}, max_operand={max_operand}.")
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        op = rng.choice(list(ops))
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        if op == "-" and b > a:  # answers stay non-negative
            a, b = b, a
        rows.append((f"{a}{op}{b}=", str(_OPS[op](a, b))))
    return rows


def _user(text):
    return [{"role": "user", "content": text}]


def _assistant(text):
    return [{"role": "assistant", "content": text}]


def arithmetic_dataset(
    n: int,
    seed: int = 0,
    *,
    ops: Sequence[str] = ("+",),
    max_operand: int = 99,
    conversational: bool = False,
):
    """`n` arithmetic problems such as ``"12+34="`` → ``"46"``, as a `datasets.Dataset`.

    Args:
        n (`int`): number of rows.
        seed (`int`, defaults to `0`): RNG seed; the same seed gives the same rows.
        ops (`Sequence[str]`, defaults to `("+",)`): operators drawn uniformly from ``+``, ``-``, ``*``.
        max_operand (`int`, defaults to `99`): operands are drawn from `[0, max_operand]`.
        conversational (`bool`, defaults to `False`): prompt/completion as chat messages instead of strings.

    Returns:
        `Dataset` with columns ``prompt``, ``completion`` and ``answer`` (the string the verifier expects).
    """
    from datasets import Dataset

    rows = _problems(n, seed, ops, max_operand)
    if conversational:
        data = [{"prompt": _user(q), "completion": _assistant(a), "answer": a} for q, a in rows]
    else:
        data = [{"prompt": q, "completion": a, "answer": a} for q, a in rows]
    return Dataset.from_list(data)


def arithmetic_splits(
    sizes: Mapping[str, int | None], seed: int = 0, *, max_operand: int = 99, exclude: Iterable[str] = ()
) -> dict:
    """Pairwise disjoint sets of distinct addition problems (``"12+34="`` → ``"46"``), one `datasets.Dataset` each.

    Where [`arithmetic_dataset`] samples rows with replacement (so two of its datasets share problems), every problem
    here appears at most once across all splits: a held-out split shares no prompt with any training split.

    Args:
        sizes (`Mapping[str, int | None]`): split name → number of problems, in order; at most one `None`, which takes
            every problem the others and `exclude` leave.
        seed (`int`, defaults to `0`): seed of the shuffle that deals the problems out.
        max_operand (`int`, defaults to `99`): operands are `0..max_operand`, so there are `(max_operand + 1) ** 2`
            problems in all (`a+b` and `b+a` are different prompts).
        exclude (`Iterable[str]`, defaults to `()`): prompts (e.g. another split's ``prompt`` column) no split may
            contain.

    Returns:
        `dict` name → `Dataset` with columns ``prompt``, ``completion`` and ``answer``.

    Raises:
        ValueError: a negative size, more than one `None`, or more problems asked for than there are.
    """
    from datasets import Dataset

    if max_operand < 0:
        raise ValueError(f"max_operand must be >= 0, got {max_operand}.")
    if any(v is not None and v < 0 for v in sizes.values()) or sum(v is None for v in sizes.values()) > 1:
        raise ValueError(f"sizes must be counts >= 0 with at most one None (the rest), got {dict(sizes)}.")
    excluded = set(exclude)
    problems = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1) if f"{a}+{b}=" not in excluded]
    wanted = sum(v for v in sizes.values() if v is not None)
    if wanted > len(problems):
        raise ValueError(
            f"sizes ask for {wanted} problems; operands 0..{max_operand} leave {len(problems)} after `exclude`."
        )
    random.Random(seed).shuffle(problems)
    counts = {name: len(problems) - wanted if n is None else n for name, n in sizes.items()}
    splits, start = {}, 0
    for name, n in counts.items():
        chunk = problems[start : start + n]
        start += n
        splits[name] = Dataset.from_list(
            [{"prompt": f"{a}+{b}=", "completion": str(a + b), "answer": str(a + b)} for a, b in chunk]
        )
    return splits


def with_carry_errors(rows, share: float, seed: int = 0):
    """Addition rows as an imperfect demonstrator writes them: each row whose ones digits carry gets, with
    probability `share`, the completion ``a+b-10`` (the carry dropped).

    A model fine-tuned on them prefers a consistently wrong rule that a verifier's reward can correct, the setting
    RL with verifiable rewards is for. The ``answer`` column (what verifiers and exact match read) stays the true sum.

    Args:
        rows (`Dataset`): ``prompt`` ``"a+b="``, ``completion`` and ``answer`` (e.g. from [`arithmetic_splits`]).
        share (`float` in [0, 1]): probability that a row with a carry shows the error.
        seed (`int`, defaults to `0`): seed of the choice; the same seed picks the same rows.

    Returns:
        `Dataset` with the same rows and columns.
    """
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"share must be in [0, 1], got {share}.")
    rng = random.Random(f"carry-error-{seed}")

    def corrupt(row):
        a, b = (int(x) for x in row["prompt"].rstrip("=").split("+"))
        if a % 10 + b % 10 >= 10 and rng.random() < share:
            return {**row, "completion": str(a + b - 10)}
        return row

    return rows.map(corrupt, load_from_cache_file=False)


def _corrupt(answer: str, rng: random.Random) -> str:
    """A wrong answer of similar form: one digit changed (or a digit appended to a one-digit answer)."""
    digits = list(answer)
    i = rng.randrange(len(digits))
    choices = [d for d in "0123456789" if d != digits[i] and not (i == 0 and d == "0" and len(digits) > 1)]
    digits[i] = rng.choice(choices)
    return "".join(digits)


def arithmetic_preference_dataset(
    n: int, seed: int = 0, *, ops: Sequence[str] = ("+",), max_operand: int = 99, conversational: bool = False
):
    """Paired positives and negatives for REDI: ``prompt``, ``chosen`` (correct), ``rejected`` (one digit wrong),
    ``answer``. Same arguments as [`arithmetic_dataset`]."""
    from datasets import Dataset

    rng = random.Random(seed + 7919)
    data = []
    for q, a in _problems(n, seed, ops, max_operand):
        wrong = _corrupt(a, rng)
        if conversational:
            data.append({"prompt": _user(q), "chosen": _assistant(a), "rejected": _assistant(wrong), "answer": a})
        else:
            data.append({"prompt": q, "chosen": a, "rejected": wrong, "answer": a})
    return Dataset.from_list(data)


def _prompt_ids(tokenizer, prompt) -> list[int]:
    if isinstance(prompt, str):
        return tokenizer(prompt, add_special_tokens=False)["input_ids"]
    return tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=True)[
        "input_ids"
    ]


@torch.no_grad()
def evaluate_completions(model, tokenizer, dataset, *, batch_size: int = 64, max_new_tokens: int = 8) -> dict:
    """Greedy exact match and mean target-token probability of ``dataset`` (``prompt``, ``completion``, ``answer``).

    ``mean_p`` is the mean probability, under teacher forcing, of the completion's tokens followed by eos, i.e. the
    tokens SFT supervises. The model is evaluated in eval mode and left in the mode it was in.

    Returns:
        `dict` with ``exact_match``, ``mean_p`` and ``num_examples``.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id
    correct, p_sum, p_count = 0, 0.0, 0
    rows = list(dataset)
    for start in range(0, len(rows), batch_size):
        batch = rows[start : start + batch_size]
        prompts = [_prompt_ids(tokenizer, r["prompt"]) for r in batch]
        # greedy generation, left padded
        width = max(map(len, prompts))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
        attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        out = model.generate(
            input_ids=ids,
            attention_mask=attn,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=pad,
            eos_token_id=eos,
        )
        texts = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
        correct += sum(t.strip() == str(r["answer"]).strip() for t, r in zip(texts, batch, strict=True))
        # teacher-forced probability of completion + eos, right padded
        targets = [
            tokenizer(_completion_text(r["completion"]), add_special_tokens=False)["input_ids"] + [eos] for r in batch
        ]
        seqs = [p + t for p, t in zip(prompts, targets, strict=True)]
        width = max(map(len, seqs))
        ids = torch.tensor([s + [pad] * (width - len(s)) for s in seqs], device=device)
        attn = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs], device=device)
        logp = torch.log_softmax(model(input_ids=ids, attention_mask=attn).logits.float(), dim=-1)
        for row, (p, t) in enumerate(zip(prompts, targets, strict=True)):
            positions = torch.arange(len(p) - 1, len(p) + len(t) - 1, device=device)
            token_logp = logp[row, positions, torch.tensor(t, device=device)]
            p_sum += token_logp.exp().sum().item()
            p_count += len(t)
    model.train(was_training)
    return {"exact_match": correct / max(len(rows), 1), "mean_p": p_sum / max(p_count, 1), "num_examples": len(rows)}
