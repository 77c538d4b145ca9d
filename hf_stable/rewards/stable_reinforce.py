"""StableReinforce's consistency reward (Zhang et al., *R1-Reward*, arXiv 2505.02835).

Rule-based rewards only score the final answer, so a policy can be rewarded for an answer its own reasoning argues
against. R1-Reward asks a judge model whether the reasoning and the answer agree and folds the verdict into the
reward. Followed from the authors' reward server (`yfzhang114/r1_reward`,
``openrlhf/models/remote_rm/math_verifier_mllm.py: get_reward``, read, not copied):

    reward = format_weight · format + accuracy · (1 + consistency_weight · consistency)

with ``format_weight = consistency_weight = 0.5``, ``format`` and ``accuracy`` in {0, 1}, and the judge's verdict
``consistency`` = 1 (consistent), −1 (inconsistent) or 0 (the judge gave no usable verdict). A correct answer
therefore earns 1.5 when the reasoning supports it and 0.5 when it contradicts it; a wrong one earns nothing either
way.

The judge is a model (their code queries Qwen2.5-VL through an OpenAI-compatible server) that hf_stable does not ship:
the user supplies it as a function with a TRL reward function's signature. Resolving the name
``stable_reinforce_reward`` in a config is refused, naming what is missing.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable

import torch


__all__ = ["BY_NAME_REFUSAL", "StableReinforceReward", "consistency_reward"]


def consistency_reward(
    accuracy: torch.Tensor,
    consistency: torch.Tensor,
    fmt: torch.Tensor | None = None,
    consistency_weight: float = 0.5,
    format_weight: float = 0.5,
) -> torch.Tensor:
    """``format_weight·fmt + accuracy·(1 + consistency_weight·consistency)``, NaN where ``accuracy`` is NaN.

    Args:
        accuracy (`torch.Tensor` of shape `(N,)`): the answer's reward (NaN: not scored).
        consistency (`torch.Tensor` of shape `(N,)`): the judge's verdict in [−1, 1] (NaN counts as 0: no verdict).
        fmt (`torch.Tensor` of shape `(N,)`, *optional*): the format reward (NaN counts as 0); ``None``: no term.

    Returns:
        `torch.Tensor` of shape `(N,)`, float64.
    """
    acc = accuracy.double()
    con = torch.nan_to_num(consistency.double(), nan=0.0)
    total = acc * (1.0 + consistency_weight * con)
    if fmt is not None:
        total = total + format_weight * torch.nan_to_num(fmt.double(), nan=0.0)
    return total


def _check_callable(name: str, fn) -> None:
    if not callable(fn):
        raise TypeError(f"`{name}` must be a reward function (prompts, completions, **kwargs) -> list, got {fn!r}.")
    call = getattr(fn, "__call__", None)  # noqa: B004 - instances' `__call__` too
    if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(call):
        raise TypeError(
            f"`{name}` is async: StableReinforceReward calls its parts synchronously; pass a sync function."
        )


def _column(name: str, values, n: int, low: float | None = None, high: float | None = None) -> torch.Tensor:
    values = list(values)
    if len(values) != n:
        raise ValueError(f"`{name}` returned {len(values)} values for {n} completions.")
    column = torch.tensor([math.nan if v is None else float(v) for v in values], dtype=torch.float64)
    finite = column[~torch.isnan(column)]
    if low is not None and ((finite < low) | (finite > high)).any():
        raise ValueError(f"`{name}` must return values in [{low}, {high}] (or None), got {values}.")
    return column


class StableReinforceReward:
    """StableReinforce's consistency reward as one TRL reward function (module docstring).

    Args:
        accuracy (callable): the answer's reward function, e.g. a verifier returning 1.0/0.0 (``None``: not scored,
            the combined reward is then ``None`` too).
        consistency (callable): the judge, a reward function returning, per completion, 1 where the reasoning supports
            the answer, −1 where it contradicts it, 0 (or ``None``) without a verdict; any value in [−1, 1].
        format_reward (callable, *optional*): the format reward (the paper's: one ``<think>…</think>`` then one
            ``<answer>…</answer>``), added times ``format_weight``.
        consistency_weight (`float`, defaults to `0.5`), format_weight (`float`, defaults to `0.5`): the code's
            weights.
        name (`str`, defaults to `"stable_reinforce_reward"`): the name TRL logs the reward under.

    Each part is called with the keyword arguments TRL passes (``prompts``, ``completions``, the dataset columns...).
    """

    def __init__(
        self,
        accuracy: Callable,
        consistency: Callable,
        format_reward: Callable | None = None,
        consistency_weight: float = 0.5,
        format_weight: float = 0.5,
        name: str = "stable_reinforce_reward",
    ):
        _check_callable("accuracy", accuracy)
        _check_callable("consistency", consistency)
        if format_reward is not None:
            _check_callable("format_reward", format_reward)
        for field, value in (("consistency_weight", consistency_weight), ("format_weight", format_weight)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"`{field}` must be a finite number, got {value!r}.")
        self.accuracy, self.consistency, self.format_reward = accuracy, consistency, format_reward
        self.consistency_weight, self.format_weight = float(consistency_weight), float(format_weight)
        self.__name__ = name

    def __call__(self, prompts=None, completions=None, **kwargs) -> list[float | None]:
        n = len(completions)
        parts = {"prompts": prompts, "completions": completions, **kwargs}
        acc = _column("accuracy", self.accuracy(**parts), n)
        con = _column("consistency", self.consistency(**parts), n, -1.0, 1.0)
        fmt = None if self.format_reward is None else _column("format_reward", self.format_reward(**parts), n)
        total = consistency_reward(acc, con, fmt, self.consistency_weight, self.format_weight)
        return [None if math.isnan(v) else v for v in total.tolist()]


# Why the name ``stable_reinforce_reward`` does not resolve in a config (`resolve_reward_function` raises it).
BY_NAME_REFUSAL = (
    "reward function 'stable_reinforce_reward' needs a consistency judge (a model that checks the reasoning against "
    "the answer), which hf_stable does not ship, so it cannot be resolved by name. Build "
    "`hf_stable.rewards.StableReinforceReward(accuracy=..., consistency=..., format_reward=...)` in Python, or name a "
    "module attribute holding one by its dotted import path (e.g. 'my_lib.rewards.r1_reward')."
)
