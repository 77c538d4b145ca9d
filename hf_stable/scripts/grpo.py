# /// script
# dependencies = ["hf-stable"]
# ///
"""`hf-stable grpo`: TRL's GRPO script with hf_stable's variants (`trl/scripts/grpo.py`, with `StableGRPOTrainer`).

```bash
hf-stable grpo --config examples/configs/grpo_sgrpo.yaml
hf-stable grpo --config examples/configs/grpo_sgrpo.yaml --accelerate_config ddp
hf-stable grpo --config examples/configs/grpo_sgrpo.yaml --push_to_hub me/model --hub_dry_run
```
Reward functions are named by registry name (`hf-stable list --family reward_function`, or TRL's `trl.rewards`) or
by dotted import path.
"""

if __name__ == "__main__":  # first: a Ctrl-C while the libraries load ends the rank quietly (scripts/entry.py)
    from hf_stable.scripts.entry import quiet_interrupts

    quiet_interrupts()

import argparse
from dataclasses import dataclass, field

from hf_stable.scripts.data import StableScriptArguments


@dataclass
class GRPOScriptArguments(StableScriptArguments):
    """[`StableScriptArguments`] plus the reward functions."""

    reward_funcs: list[str] | None = field(
        default=None,
        metadata={"help": "Reward functions: hf_stable or TRL registry names, or dotted import paths."},
    )
    reward_model_name_or_path: str | None = field(
        default=None, metadata={"help": "A sequence-classification reward model (Hub id or local path)."}
    )


def main(script_args, training_args, model_args, dataset_args):
    from hf_stable import StableGRPOTrainer
    from hf_stable.rewards.resolve import resolve_reward_function
    from hf_stable.scripts.train import train_and_publish

    reward_funcs = [script_args.reward_model_name_or_path] if script_args.reward_model_name_or_path else []
    reward_funcs += [resolve_reward_function(name) for name in script_args.reward_funcs or []]
    if not reward_funcs:
        raise ValueError("Set `reward_funcs` (and/or `reward_model_name_or_path`).")
    train_and_publish(
        StableGRPOTrainer, script_args, training_args, model_args, dataset_args, reward_funcs=reward_funcs
    )


def make_parser(subparsers: argparse._SubParsersAction | None = None, prog: str | None = None):
    from trl import DatasetMixtureConfig

    from hf_stable import StableGRPOConfig
    from hf_stable.scripts.model import StableModelConfig
    from hf_stable.scripts.train import script_parser

    types = (GRPOScriptArguments, StableGRPOConfig, StableModelConfig, DatasetMixtureConfig)
    return script_parser("grpo", "GRPO with hf_stable variants", types, subparsers, prog)


if __name__ == "__main__":
    from hf_stable.scripts.entry import run_script

    run_script("grpo", make_parser, main)
