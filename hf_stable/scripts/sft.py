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
    from trl import get_quantization_config

    from hf_stable import StableSFTTrainer
    from hf_stable.hub_plan import hub_dry_run_repo, push_or_plan
    from hf_stable.scripts.data import load_script_dataset
    from hf_stable.scripts.entry import resume_argument
    from hf_stable.scripts.model import get_stable_peft_config
    from hf_stable.scripts.teardown import finish

    model_init_kwargs = dict(
        revision=model_args.model_revision,
        trust_remote_code=training_args.trust_remote_code,
        attn_implementation=model_args.attn_implementation,
        dtype=model_args.dtype,
    )
    model_init_kwargs.update(training_args.model_init_kwargs or {})
    training_args.model_init_kwargs = model_init_kwargs

    dry_run_repo = hub_dry_run_repo(script_args, training_args)  # before the trainer: it creates the repo otherwise
    dataset = load_script_dataset(script_args, dataset_args)
    eval_split = script_args.dataset_test_split
    trainer = StableSFTTrainer(
        model=model_args.model_name_or_path,
        args=training_args,
        train_dataset=dataset[script_args.dataset_train_split],
        eval_dataset=dataset[eval_split] if training_args.eval_strategy != "no" and eval_split in dataset else None,
        quantization_config=get_quantization_config(model_args),
        peft_config=get_stable_peft_config(model_args),
    )
    trainer.train(resume_from_checkpoint=resume_argument(training_args.resume_from_checkpoint))
    trainer.save_model(training_args.output_dir)
    # collective-free and main-process only: names hf_stable and the objective, never a token
    trainer.create_model_card(dataset_name=script_args.dataset_name or script_args.synthetic_dataset)
    trainer.accelerator.print(f"Model and card saved to {training_args.output_dir}.")
    push_or_plan(trainer, dry_run_repo, dataset_name=script_args.dataset_name)
    finish(trainer)  # barrier, Trainer.end(), and no interpreter finalization under a launcher (scripts/teardown.py)


def make_parser(subparsers: argparse._SubParsersAction | None = None, prog: str | None = None):
    from trl import DatasetMixtureConfig, TrlParser

    from hf_stable import StableSFTConfig
    from hf_stable.scripts.data import StableScriptArguments
    from hf_stable.scripts.model import StableModelConfig

    dataclass_types = (StableScriptArguments, StableSFTConfig, StableModelConfig, DatasetMixtureConfig)
    if subparsers is not None:
        return subparsers.add_parser("sft", help="SFT with hf_stable objectives", dataclass_types=dataclass_types)
    return TrlParser(dataclass_types, prog=prog)


if __name__ == "__main__":
    from hf_stable.scripts.entry import run_script

    run_script("sft", make_parser, main)
