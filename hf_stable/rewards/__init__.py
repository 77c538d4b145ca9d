"""Reward functions that ship with hf_stable, usable in TRL's `reward_funcs` (and by name from `hf-stable grpo`)."""

from ..papers import PAPERS
from ..registry import Registry
from .exact_match import arithmetic_reward
from .majority import MajorityVoteReward, last_boxed_or_text, majority_vote, majority_vote_reward
from .noise import noisy_reward
from .stable_rank import StableRankReward, stable_rank
from .stable_reinforce import BY_NAME_REFUSAL, StableReinforceReward, consistency_reward


REWARD_FUNCTIONS = Registry("reward_function", "reward functions resolvable by name in configs")
REWARD_FUNCTIONS.register(
    "arithmetic_exact_match", paper="hf_stable.testing verifier", url="https://github.com/hf-stable/hf_stable"
)(arithmetic_reward)
REWARD_FUNCTIONS.register(
    "majority_vote",
    paper=PAPERS["ttrl"],
    description="1.0 where the answer (last \\boxed{...}, else the text) is its prompt group's majority (TTRL)",
)(majority_vote)
# the class, for the listing and the card; by name it is refused (the judge is the user's model)
REWARD_FUNCTIONS.register(
    "stable_reinforce_reward",
    paper=PAPERS["r1_reward"],
    description="StableReinforce's consistency reward: format + accuracy·(1 + consistency) with a user's judge",
    refused=BY_NAME_REFUSAL,
)(StableReinforceReward)

__all__ = [
    "REWARD_FUNCTIONS",
    "MajorityVoteReward",
    "StableRankReward",
    "StableReinforceReward",
    "arithmetic_reward",
    "consistency_reward",
    "last_boxed_or_text",
    "majority_vote",
    "majority_vote_reward",
    "noisy_reward",
    "stable_rank",
]
