"""`LOSS_MODES`, the registry of GRPO policy losses that replace PPO-clip (`loss_mode=...`).

It lives apart from the modes so that a module declaring one imports the registry and nothing else; importing
`hf_stable.losses.policy` imports every built-in mode module, so the `LOSS_MODES` read through it is complete.
"""

from __future__ import annotations

from ..registry import Registry


# "ppo" is TRL's own clipped surrogate for its `loss_type`.
LOSS_MODES = Registry("loss_mode", "policy losses that replace PPO-clip", builtin=("ppo",))
