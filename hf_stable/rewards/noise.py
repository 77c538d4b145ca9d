"""Synthetic reward noise, for experiments and tests of noise-robust estimators (S-GRPO)."""

from __future__ import annotations

import functools
import random


def noisy_reward(fn, flip_prob: float, seed: int = 0, name: str | None = None):
    """Wrap a binary reward function so each reward is flipped (1 ↔ 0) with probability ``flip_prob``.

    The clean (unflipped) mean is reported through TRL's ``log_metric`` hook as ``<name>/clean``, so a run logs the
    reward it could not see. Flips come from a private, seeded RNG: the global RNG (and thus generation) is untouched.

    Args:
        fn: a TRL reward function returning rewards in {0, 1} (None passes through).
        flip_prob (`float` in [0, 1]): flip probability.
        seed (`int`): seed of the flips.
        name (`str`, *optional*): reward column name (defaults to ``fn.__name__``).
    """
    if not 0.0 <= flip_prob <= 1.0:
        raise ValueError(f"flip_prob must be in [0, 1], got {flip_prob}.")
    rng = random.Random(seed)
    column = name or getattr(fn, "__name__", "reward")

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        clean = fn(*args, **kwargs)
        noisy = [r if r is None or rng.random() >= flip_prob else 1.0 - r for r in clean]
        log_metric = kwargs.get("log_metric")
        scored = [r for r in clean if r is not None]
        if log_metric is not None and scored:
            log_metric(f"{column}/clean", sum(scored) / len(scored))
        return noisy

    wrapped.__name__ = column
    return wrapped
