# /// script
# dependencies = ["hf-stable"]
# ///
"""`hf-stable sft`: TRL's SFT script with hf_stable's objectives (`trl/scripts/sft.py`, with `StableSFTTrainer`).

```bash
hf-stable sft --config examples/configs/sft_prob.yaml
hf-stable sft --config examples/configs/sft_prob.yaml --accelerate_config ddp --num_processes 2
hf-stable sft --config examples/configs/sft_prob.yaml --push_to_hub me/model --hub_dry_run   # the planned commit
python -m hf_stable.scripts.sft --model_name_or_path ./tiny --synthetic_dataset arithmetic --sft_objective prob_power \
    --output_dir out --use_cpu --bf16 false
```
Every `SFTConfig`/`ModelConfig` flag works; `StableSFTConfig` adds `sft_objective`, `objective_alpha`, ...
"""

if __name__ == "__main__":  # first: a Ctrl-C while the libraries load ends the rank quietly (scripts/entry.py)
    from hf_stable.scripts.entry import quiet_interrupts

    quiet_interrupts()

import argparse


def main(script_args, training_args, model_args, dataset_args):
    from hf_stable import StableSFTTrainer
    from hf_stable.scripts.train import train_and_publish

    train_and_publish(StableSFTTrainer, script_args, training_args, model_args, dataset_args)


def make_parser(subparsers: argparse._SubParsersAction | None = None, prog: str | None = None):
    from trl import DatasetMixtureConfig

    from hf_stable import StableSFTConfig
    from hf_stable.scripts.data import StableScriptArguments
    from hf_stable.scripts.model import StableModelConfig
    from hf_stable.scripts.train import script_parser

    types = (StableScriptArguments, StableSFTConfig, StableModelConfig, DatasetMixtureConfig)
    return script_parser("sft", "SFT with hf_stable objectives", types, subparsers, prog)


if __name__ == "__main__":
    from hf_stable.scripts.entry import run_script

    run_script("sft", make_parser, main)
