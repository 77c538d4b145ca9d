"""Label-free reward: agreement with the majority answer of the group (TTRL's pseudo-labels, arXiv 2504.16084)."""

from __future__ import annotations

from collections import Counter


def _text(completion) -> str:
    if isinstance(completion, str):
        return completion
    return completion[-1]["content"] if completion else ""


def _vote(group: list[str]) -> list[float]:
    """1.0 where the answer is the group's most common non-empty answer (ties: the first seen), else 0.0."""
    counts = Counter(a for a in group if a)
    majority = max(counts, key=lambda a: (counts[a], -group.index(a))) if counts else None
    return [1.0 if a and a == majority else 0.0 for a in group]


def majority_vote_reward(completions, num_generations: int, extract=None, **kwargs) -> list[float]:
    """1.0 for completions whose extracted answer equals the most common answer of their group, else 0.0.

    TRL passes the completions of a batch in consecutive groups of `num_generations`. Ties go to the answer seen
    first. Empty answers never count as the majority. Pseudo-labels are noisy: this pairs naturally with
    `advantage_estimator="sgrpo"`.

    Args:
        completions: TRL completions (strings or chat messages).
        num_generations (`int`): group size G (bind it with `functools.partial` or use [`MajorityVoteReward`]).
        extract (callable, *optional*): completion text -> answer (default: the stripped text).
    """
    extract = extract or (lambda text: text.strip())
    answers = [extract(_text(c)) for c in completions]
    if len(answers) % num_generations:
        raise ValueError(f"{len(answers)} completions do not form groups of {num_generations}.")
    rewards = []
    for start in range(0, len(answers), num_generations):
        rewards.extend(_vote(answers[start : start + num_generations]))
    return rewards


def last_boxed_or_text(text: str) -> str:
    r"""The content of the last ``\boxed{...}`` (braces matched) in ``text``; the stripped text when there is none or
    it is not closed."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return text.strip()
    depth, begin = 0, start + len("\\boxed{")
    for i in range(begin, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            if depth == 0:
                return text[begin:i].strip()
            depth -= 1
    return text.strip()


def majority_vote(prompts, completions, **kwargs) -> list[float]:
    r"""TTRL's majority-vote reward as TRL calls a reward function (the name ``majority_vote`` in configs).

    A group is a maximal run of consecutive completions with the same prompt: TRL's sampler repeats each prompt
    ``num_generations`` times in a row, so the runs are its groups (two adjacent groups of one prompt vote
    together: a larger sample of the same answer distribution). The answer is the last ``\boxed{...}`` of the
    completion, else its stripped text; 1.0 where it equals the group's most common non-empty answer (ties: the first
    seen).

    Under ``torch.distributed`` the vote is over the whole generation batch: TRL gives process ``p`` the ``p``-th
    slice of it and calls the reward functions on every process, so the (prompt, answer) lists are all-gathered in
    rank order, voted on, and this process's slice is returned; a group split across processes votes as one. Use
    [`MajorityVoteReward`] with your own ``extract`` for other answer formats.

    Args:
        prompts: one prompt per completion (strings or chat messages), length N.
        completions: N completions (strings or chat messages).

    Returns:
        N rewards in {0.0, 1.0}.
    """
    if len(prompts) != len(completions):
        raise ValueError(f"majority_vote: {len(prompts)} prompts for {len(completions)} completions.")
    answers = [last_boxed_or_text(_text(c)) for c in completions]
    parts, rank = _all_processes((list(prompts), answers))
    offset = sum(len(part[1]) for part in parts[:rank])
    prompts = [p for part in parts for p in part[0]]
    answers = [a for part in parts for a in part[1]]
    rewards, start = [], 0
    for end in range(1, len(answers) + 1):
        if end == len(answers) or prompts[end] != prompts[start]:
            rewards.extend(_vote(answers[start:end]))
            start = end
    return rewards[offset : offset + len(completions)]


def _all_processes(item) -> tuple[list, int]:
    """``item`` of every process in rank order, and this process's rank (``[item], 0`` without a process group)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [item], 0
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, item)
    return parts, dist.get_rank()


class MajorityVoteReward:
    """[`majority_vote_reward`] bound to a group size, usable directly in `reward_funcs`."""

    def __init__(self, num_generations: int, extract=None):
        self.num_generations, self.extract = num_generations, extract
        self.__name__ = "majority_vote"

    def __call__(self, completions, **kwargs) -> list[float]:
        return majority_vote_reward(completions, self.num_generations, self.extract)
