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

    Each process votes over the completions it holds: when a group is split across processes (a per-process
    generation batch that is not a multiple of ``num_generations``), each part votes alone. Use
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
    rewards, start = [], 0
    for end in range(1, len(answers) + 1):
        if end == len(answers) or prompts[end] != prompts[start]:
            rewards.extend(_vote(answers[start:end]))
            start = end
    return rewards


class MajorityVoteReward:
    """[`majority_vote_reward`] bound to a group size, usable directly in `reward_funcs`."""

    def __init__(self, num_generations: int, extract=None):
        self.num_generations, self.extract = num_generations, extract
        self.__name__ = "majority_vote"

    def __call__(self, completions, **kwargs) -> list[float]:
        return majority_vote_reward(completions, self.num_generations, self.extract)
