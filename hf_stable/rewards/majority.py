"""Label-free reward: agreement with the majority answer of the group (TTRL-style pseudo-labels)."""

from __future__ import annotations

from collections import Counter


def _text(completion) -> str:
    if isinstance(completion, str):
        return completion
    return completion[-1]["content"] if completion else ""


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
        group = answers[start : start + num_generations]
        counts = Counter(a for a in group if a)
        majority = max(counts, key=lambda a: (counts[a], -group.index(a))) if counts else None
        rewards.extend(1.0 if a and a == majority else 0.0 for a in group)
    return rewards


class MajorityVoteReward:
    """[`majority_vote_reward`] bound to a group size, usable directly in `reward_funcs`."""

    def __init__(self, num_generations: int, extract=None):
        self.num_generations, self.extract = num_generations, extract
        self.__name__ = "majority_vote"

    def __call__(self, completions, **kwargs) -> list[float]:
        return majority_vote_reward(completions, self.num_generations, self.extract)
