"""The RL testbed's chosen recipe: the LR and step count picked on the tuning seed by `experiments/grpo_rl_control.py`
(its rule and grid are recorded in that result). Every experiment on the testbed starts from `CONTROL`.

Kept apart from `rl.py`: the values enter each run's cache key themselves, so a new choice keeps finished runs.
"""

from dataclasses import replace

from .rl import Recipe


CONTROL = replace(Recipe(), rl_lr=2e-4, rl_steps=1700)
