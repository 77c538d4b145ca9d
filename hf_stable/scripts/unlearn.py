# /// script
# dependencies = ["hf-stable"]
# ///
"""`hf-stable unlearn`: unlearning with `UnlearningTrainer` from a YAML config or flags.

```bash
hf-stable unlearn --config examples/configs/unlearn_simnpo.yaml
hf-stable unlearn --model_name_or_path ./model --dataset_name ./my_data --forget_split forget --retain_split retain \
    --unlearn_method simnpo --output_dir out
hf-stable unlearn --tinytofu_seed 0 --unlearn_method simnpo --output_dir out      # the offline TinyTOFU benchmark
hf-stable unlearn --config examples/configs/unlearn_simnpo.yaml --push_to_hub me/model --hub_dry_run
hf-stable unlearn --model_name_or_path ./model --benchmark tofu --forget_split forget10 --data_dir TOFU --output_dir o
```
Every `TrainingArguments`/`ModelConfig` flag works; `UnlearningConfig` adds `unlearn_method`, `retain_loss_type`, ....
After training the script evaluates (forget / retain / holdout metrics), writes `unlearning_report.json` and a model
card with the metrics, and saves the model (adapters also merged into `output_dir/merged`).
"""

if __name__ == "__main__":  # first: a Ctrl-C while the libraries load ends the rank quietly (scripts/entry.py)
    from hf_stable.scripts.entry import quiet_interrupts

    quiet_interrupts()

import argparse
import json
import os
from dataclasses import dataclass, field

from hf_stable.hub_plan import HubDryRunArguments


@dataclass
class UnlearnScriptArguments(HubDryRunArguments):
    """Where the forget / retain / holdout rows come from.

    Parameters:
        dataset_name (`str`, *optional*): a Hub dataset id, a local path for `datasets.load_dataset`, or a
            `DatasetDict` saved with `save_to_disk`.
        dataset_config (`str`, *optional*): its configuration name.
        forget_split, retain_split (`str`): splits with prompt/completion rows (defaults `forget`, `retain`).
        holdout_split (`str`, *optional*): never-trained rows of the same form (evaluation, collapse guard).
        tinytofu_seed (`int`, *optional*): use the offline TinyTOFU benchmark of this seed instead: its data, and its
            full model (trained and cached on first use) unless `model_name_or_path` is given.
        benchmark (`str`, *optional*): `tofu`: forget `forget_split` (e.g. `forget10`) and keep its retain set
            (`retain90`), read from `data_dir` (a folder of the Hub's `<config>.json` files) or the Hub.
        data_dir (`str`, *optional*): that folder.
        benchmark_prompt_format (`str`, defaults to `"plain"`): `plain` ("Question: ...\nAnswer: ") or `chat`.
        evaluate (`bool`, defaults to `True`): run `evaluate_unlearning` after training.
        hub_dry_run (`bool`, defaults to `False`): with `push_to_hub`, print the planned commit instead of pushing.
    """

    dataset_name: str | None = field(default=None, metadata={"help": "Hub id or local path of the dataset."})
    dataset_config: str | None = field(default=None, metadata={"help": "Dataset configuration name."})
    forget_split: str = field(default="forget", metadata={"help": "Split with the rows to forget."})
    retain_split: str = field(default="retain", metadata={"help": "Split with the rows to keep."})
    holdout_split: str | None = field(default=None, metadata={"help": "Split with never-trained rows."})
    tinytofu_seed: int | None = field(default=None, metadata={"help": "Use TinyTOFU (offline) with this seed."})
    benchmark: str | None = field(default=None, metadata={"help": "A benchmark's data by name: `tofu`."})
    data_dir: str | None = field(default=None, metadata={"help": "Local folder of the benchmark files."})
    benchmark_prompt_format: str = field(default="plain", metadata={"help": "Benchmark rows: `plain` or `chat`."})
    evaluate: bool = field(default=True, metadata={"help": "Evaluate forgetting and utility after training."})

    def __post_init__(self):
        if self.benchmark is not None:  # names and local files checked here, before any process is launched
            from hf_stable.evaluation.benchmarks import check_unlearn_benchmark_args

            if self.dataset_name is not None or self.tinytofu_seed is not None:
                raise ValueError("Give `benchmark` or `dataset_name` / `tinytofu_seed`, not both.")

            retain = None if self.retain_split == "retain" else self.retain_split
            check_unlearn_benchmark_args(
                self.benchmark, self.forget_split, retain, self.data_dir, self.benchmark_prompt_format
            )
        elif self.tinytofu_seed is None and self.dataset_name is None:
            raise ValueError("Give `dataset_name` (with forget/retain splits) or `tinytofu_seed`.")


def _datasets(forget, retain, holdout) -> dict:
    """The rows, under the names `UnlearningTrainer` takes them by."""
    return {"forget_dataset": forget, "retain_dataset": retain, "holdout_dataset": holdout}


def _load(script_args, model_args):
    """(model or path, tokenizer or None, the trainer's datasets, extras for the evaluation, the TinyTOFU data)."""
    if script_args.tinytofu_seed is not None:
        from hf_stable.testing.tinytofu import make_tinytofu, train_tinytofu

        data = make_tinytofu(script_args.tinytofu_seed)
        if model_args.model_name_or_path:
            model, tokenizer = model_args.model_name_or_path, None
        else:  # trained once, then loaded from the cache
            model, tokenizer = train_tinytofu(data, "full", seed=script_args.tinytofu_seed)[0], data.tokenizer
        evaluation = {"world": data.world_eval, "relearn": data.relearn, "relearn_test": data.relearn_eval}
        return model, tokenizer, _datasets(data.forget, data.retain, data.holdout_eval), evaluation, data
    if script_args.benchmark is not None:
        from hf_stable.evaluation.benchmarks import unlearning_datasets

        forget, retain, holdout, _ = unlearning_datasets(
            script_args.benchmark,
            script_args.forget_split,
            data_dir=script_args.data_dir,
            retain_split=None if script_args.retain_split == "retain" else script_args.retain_split,
            prompt_format=script_args.benchmark_prompt_format,
        )
        return model_args.model_name_or_path, None, _datasets(forget, retain, holdout), {}, None
    from datasets import load_dataset, load_from_disk

    name = script_args.dataset_name
    if os.path.isfile(os.path.join(name, "dataset_dict.json")):  # a DatasetDict saved with save_to_disk
        dataset = load_from_disk(name)
    else:
        dataset = load_dataset(name, script_args.dataset_config)
    holdout = dataset[script_args.holdout_split] if script_args.holdout_split else None
    datasets = _datasets(dataset[script_args.forget_split], dataset[script_args.retain_split], holdout)
    return model_args.model_name_or_path, None, datasets, {}, None


def main(script_args, training_args, model_args):
    import copy

    from hf_stable import UnlearningTrainer
    from hf_stable.hub_plan import hub_dry_run_repo, push_or_plan
    from hf_stable.scripts.entry import resume_argument
    from hf_stable.scripts.model import get_stable_peft_config
    from hf_stable.scripts.teardown import finish

    dry_run_repo = hub_dry_run_repo(script_args, training_args)  # before the trainer: it creates the repo otherwise
    model, tokenizer, datasets, evaluation, data = _load(script_args, model_args)
    # a refused setting, backend or data set raises ValueError: `entry.run_script` prints it as one line
    trainer = UnlearningTrainer(
        model=model,
        args=training_args,
        processing_class=tokenizer,
        peft_config=get_stable_peft_config(model_args),
        **datasets,
    )
    trainer.train(resume_from_checkpoint=resume_argument(training_args.resume_from_checkpoint))
    report = None
    if script_args.evaluate:
        forget_eval = data.forget_eval if data is not None else None
        retain_eval = data.retain_eval if data is not None else None
        report = trainer.evaluate_unlearning(forget=forget_eval, retain=retain_eval, **evaluation)
        if trainer.is_world_process_zero():
            os.makedirs(training_args.output_dir, exist_ok=True)
            path = os.path.join(training_args.output_dir, "unlearning_report.json")
            with open(path + ".tmp", "w") as f:
                json.dump(report, f, indent=1)
            os.replace(path + ".tmp", path)
    if not training_args.push_to_hub:  # with it, `push_to_hub` below saves the model, then uploads everything once
        trainer.save_model(training_args.output_dir)
    if trainer._is_peft and trainer.is_world_process_zero():  # adapters (bounded or not): also a merged model
        from hf_stable.adapters import merge_and_export

        # merging consumes the PEFT model it is given: merge a copy, so the adapters saved (and pushed) stay whole
        adapted = copy.deepcopy(trainer.accelerator.unwrap_model(trainer.model))
        merged = os.path.join(training_args.output_dir, "merged")
        merge_and_export(adapted, merged, tokenizer=trainer.processing_class)
    name = script_args.dataset_name or ("locuslab/TOFU" if script_args.benchmark == "tofu" else "tinytofu")
    card = {"dataset_name": name, "metrics": report}
    # main process only; says what was unlearned and the metrics, never the forget rows or a token
    trainer.create_model_card(**card)
    trainer.accelerator.print(f"Model and card saved to {training_args.output_dir}.")
    # re-saves the model and rewrites the card: the same card, with the metrics
    push_or_plan(trainer, dry_run_repo, **card)
    finish(trainer)  # barrier, Trainer.end(), and no interpreter finalization under a launcher (scripts/teardown.py)


def make_parser(subparsers: argparse._SubParsersAction | None = None, prog: str | None = None):
    from trl import TrlParser

    from hf_stable import UnlearningConfig
    from hf_stable.scripts.model import StableModelConfig

    dataclass_types = (UnlearnScriptArguments, UnlearningConfig, StableModelConfig)
    if subparsers is not None:
        return subparsers.add_parser("unlearn", help="Unlearning (UnlearningTrainer)", dataclass_types=dataclass_types)
    return TrlParser(dataclass_types, prog=prog)


if __name__ == "__main__":
    from hf_stable.scripts.entry import run_script

    run_script("unlearn", make_parser, main)
