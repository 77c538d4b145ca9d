"""The reward-weight controllers' registry (`reward_weighting`), the step context they read, and `static`, the base
class every controller extends. The controllers themselves: `reward_control` (CTWA, gradient, hypervolume),
`lagrangian` (the Lagrangian and its threshold search), `pama`; `reward_control` imports them all, so importing it
registers every one."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .._validation import check_length
from ..registry import Registry


REWARD_WEIGHTINGS = Registry("reward_weighting", "controllers of the reward weights")



@dataclass
class StepContext:
    """What a controller may read about the step besides the rewards: the optimizer step, the learning rate, and
    ``influence()``, the `(K,)` influence scores of the batch (costs a forward and K backwards; only called when
    needed)."""

    step: int
    learning_rate: float
    influence: Callable[[], torch.Tensor]


def _per_reward(name: str, value, k: int) -> None:
    check_length(name, value, k, of="reward function")


@REWARD_WEIGHTINGS.register(
    "static", paper="Linear scalarisation (TRL `reward_weights`)", url="https://huggingface.co/docs/trl/grpo_trainer"
)
class RewardWeightController:
    """`static`: the user's weights, unchanged. Subclasses adapt them; `weights` is what scalarises the next batch.

    Attributes read by the trainer: ``adaptive`` (whether weights change), ``needs_validation`` (greedy validation
    means are fed to [`validation_point`]), ``advantage_multiplier``.
    """

    adaptive = False
    needs_validation = False

    def __init__(self, base_weights: torch.Tensor):
        self.base = base_weights.float().clone()

    @property
    def weights(self) -> torch.Tensor:
        return self.base

    @property
    def advantage_multiplier(self) -> float:
        return 1.0

    def observe(self, rewards: torch.Tensor, advantages: torch.Tensor, num_generations: int, context: StepContext):
        """Update from a generation batch: raw rewards `(N, K)` and the advantages used `(N,)`; returns metrics."""
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
