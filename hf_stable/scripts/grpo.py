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
    from trl import get_quantization_config

    from hf_stable import StableGRPOTrainer
    from hf_stable.hub_plan import hub_dry_run_repo, push_or_plan
    from hf_stable.rewards.resolve import resolve_reward_function
    from hf_stable.scripts.data import load_script_dataset
    from hf_stable.scripts.entry import resume_argument
    from hf_stable.scripts.model import get_stable_peft_config
    from hf_stable.scripts.teardown import finish

    reward_funcs = [script_args.reward_model_name_or_path] if script_args.reward_model_name_or_path else []
    reward_funcs += [resolve_reward_function(name) for name in script_args.reward_funcs or []]
    if not reward_funcs:
        raise ValueError("Set `reward_funcs` (and/or `reward_model_name_or_path`).")
    training_args.model_init_kwargs = {
        "revision": model_args.model_revision,
        "trust_remote_code": training_args.trust_remote_code,
        "attn_implementation": model_args.attn_implementation,
        "dtype": model_args.dtype,
        **(training_args.model_init_kwargs or {}),
    }
    dry_run_repo = hub_dry_run_repo(script_args, training_args)  # before the trainer: it creates the repo otherwise
    dataset = load_script_dataset(script_args, dataset_args)
    eval_split = script_args.dataset_test_split
    trainer = StableGRPOTrainer(
        model=model_args.model_name_or_path,
        reward_funcs=reward_funcs,
        args=training_args,
        train_dataset=dataset[script_args.dataset_train_split],
        eval_dataset=dataset[eval_split] if training_args.eval_strategy != "no" and eval_split in dataset else None,
        quantization_config=get_quantization_config(model_args),
        peft_config=get_stable_peft_config(model_args),
    )
    trainer.train(resume_from_checkpoint=resume_argument(training_args.resume_from_checkpoint))
    trainer.save_model(training_args.output_dir)
    trainer.create_model_card(dataset_name=script_args.dataset_name or script_args.synthetic_dataset)
    trainer.accelerator.print(f"Model and card saved to {training_args.output_dir}.")
    push_or_plan(trainer, dry_run_repo, dataset_name=script_args.dataset_name)
    finish(trainer)  # barrier, Trainer.end(), and no interpreter finalization under a launcher (scripts/teardown.py)


def make_parser(subparsers: argparse._SubParsersAction | None = None, prog: str | None = None):
    from trl import DatasetMixtureConfig, TrlParser

    from hf_stable import StableGRPOConfig
    from hf_stable.scripts.model import StableModelConfig

    dataclass_types = (GRPOScriptArguments, StableGRPOConfig, StableModelConfig, DatasetMixtureConfig)
    if subparsers is not None:
        return subparsers.add_parser("grpo", help="GRPO with hf_stable variants", dataclass_types=dataclass_types)
    return TrlParser(dataclass_types, prog=prog)


if __name__ == "__main__":
    from hf_stable.scripts.entry import run_script

    run_script("grpo", make_parser, main)
