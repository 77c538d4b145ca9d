"""What `hf-stable sft` and `hf-stable grpo` share after parsing: the model's loading settings, the dataset, the
trainer, training with resume, saving with the card, the Hub push (or its dry-run plan) and a clean exit."""

from __future__ import annotations


def set_model_init_kwargs(training_args, model_args) -> None:
    """TRL's scripts pass `ModelConfig`'s loading settings through `model_init_kwargs`; the user's own
    `model_init_kwargs` win."""
    training_args.model_init_kwargs = {
        "revision": model_args.model_revision,
        "trust_remote_code": training_args.trust_remote_code,
        "attn_implementation": model_args.attn_implementation,
        "dtype": model_args.dtype,
        **(training_args.model_init_kwargs or {}),
    }


def train_and_publish(trainer_cls, script_args, training_args, model_args, dataset_args, **trainer_kwargs) -> None:
    """Build `trainer_cls` on the script's dataset, train (resuming as asked), save the model and its card, push or
    plan the push, and finish (barrier and `Trainer.end()`, see `scripts/teardown.py`)."""
    from trl import get_quantization_config

    from hf_stable.hub_plan import hub_dry_run_repo, push_or_plan
    from hf_stable.scripts.data import load_script_dataset
    from hf_stable.scripts.entry import resume_argument
    from hf_stable.scripts.model import get_stable_peft_config
    from hf_stable.scripts.teardown import finish

    set_model_init_kwargs(training_args, model_args)
    dry_run_repo = hub_dry_run_repo(script_args, training_args)  # before the trainer: it creates the repo otherwise
    dataset = load_script_dataset(script_args, dataset_args)
    eval_split = script_args.dataset_test_split
    trainer = trainer_cls(
        model=model_args.model_name_or_path,
        args=training_args,
        train_dataset=dataset[script_args.dataset_train_split],
        eval_dataset=dataset[eval_split] if training_args.eval_strategy != "no" and eval_split in dataset else None,
        quantization_config=get_quantization_config(model_args),
        peft_config=get_stable_peft_config(model_args),
        **trainer_kwargs,
    )
    trainer.train(resume_from_checkpoint=resume_argument(training_args.resume_from_checkpoint))
    trainer.save_model(training_args.output_dir)
    # collective-free and main-process only: names hf_stable and the objective, never a token
    trainer.create_model_card(dataset_name=script_args.dataset_name or script_args.synthetic_dataset)
    trainer.accelerator.print(f"Model and card saved to {training_args.output_dir}.")
    push_or_plan(trainer, dry_run_repo, dataset_name=script_args.dataset_name)
    finish(trainer)


def script_parser(command: str, help: str, dataclass_types: tuple, subparsers=None, prog: str | None = None):
    """The `hf-stable COMMAND` subparser, or a standalone `TrlParser` (`python -m hf_stable.scripts.COMMAND`)."""
    from trl import TrlParser

    if subparsers is not None:
        return subparsers.add_parser(command, help=help, dataclass_types=dataclass_types)
    return TrlParser(dataclass_types, prog=prog)


__all__ = ["script_parser", "set_model_init_kwargs", "train_and_publish"]
