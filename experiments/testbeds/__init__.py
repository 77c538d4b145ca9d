"""Shared testbeds for the experiments: the task, the warm start and the control that must pass, in one place.

`rl`: the RL testbed (tiny model, `a+b=`, a limited-data SFT warm start, fresh RL prompts, a held-out set disjoint
from every training row); its control is plain GRPO raising held-out exact match (`experiments/grpo_rl_control.py`).

A script imports it as `from testbeds import rl` (scripts run with `experiments/` on `sys.path`); the harness adds
these sources to the code digest of every script that imports them.
"""
