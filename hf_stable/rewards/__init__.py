"""Reward functions that ship with hf_stable, usable in TRL's `reward_funcs` (and by name from `hf-stable grpo`)."""

from ..registry import Registry
from .exact_match import arithmetic_reward
from .majority import MajorityVoteReward, majority_vote_reward
from .noise import noisy_reward
from .stable_rank import StableRankReward, stable_rank


REWARD_FUNCTIONS = Registry("reward_function", "reward functions resolvable by name in configs")
REWARD_FUNCTIONS.register(
    "arithmetic_exact_match", paper="hf_stable.testing verifier", url="https://github.com/hf-stable/hf_stable"
)(arithmetic_reward)

__all__ = [
    "REWARD_FUNCTIONS",
    "MajorityVoteReward",
    "StableRankReward",
    "arithmetic_reward",
    "majority_vote_reward",
    "noisy_reward",
    "stable_rank",
]
