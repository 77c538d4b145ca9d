"""Datasets for the training scripts: TRL's sources (Hub name, `datasets` mixture) plus local files and folders and
hf_stable's synthetic tasks, so a config can train fully offline."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from trl import ScriptArguments

from ..hub_plan import HubDryRunArguments


SYNTHETIC_TASKS = ("arithmetic", "arithmetic_preference")
_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}


@dataclass
class StableScriptArguments(ScriptArguments, HubDryRunArguments):
    """TRL's `ScriptArguments` plus an offline synthetic dataset and `hub_dry_run` ([`HubDryRunArguments`]).

    Parameters:
        synthetic_dataset (`str`, *optional*):
            Build the training data in memory instead of loading `dataset_name`: `"arithmetic"` (prompt/completion)
            or `"arithmetic_preference"` (prompt/chosen/rejected, for REDI).
        synthetic_train_size (`int`, *optional*, defaults to `2000`):
            Rows of the synthetic training split.
        synthetic_test_size (`int`, *optional*, defaults to `200`):
            Rows of the synthetic test split (a different seed).
        synthetic_seed (`int`, *optional*, defaults to `0`):
            Seed of the synthetic training split.
        synthetic_conversational (`bool`, *optional*, defaults to `False`):
            Chat-message rows instead of plain strings.
    """

    synthetic_dataset: str | None = field(
        default=None, metadata={"help": f"Synthetic dataset built in memory: one of {', '.join(SYNTHETIC_TASKS)}."}
    )
    synthetic_train_size: int = field(default=2000, metadata={"help": "Rows of the synthetic training split."})
    synthetic_test_size: int = field(default=200, metadata={"help": "Rows of the synthetic test split."})
    synthetic_seed: int = field(default=0, metadata={"help": "Seed of the synthetic training split."})
    synthetic_conversational: bool = field(default=False, metadata={"help": "Chat-message rows instead of strings."})

    def __post_init__(self):
        if self.synthetic_dataset is not None and self.synthetic_dataset not in SYNTHETIC_TASKS:
            raise ValueError(
                f"`synthetic_dataset`={self.synthetic_dataset!r} is not valid. Allowed values: "
                f"{', '.join(SYNTHETIC_TASKS)}."
            )


def _synthetic(args: StableScriptArguments):
    from datasets import DatasetDict

    from ..testing import arithmetic_dataset, arithmetic_preference_dataset

    build = arithmetic_dataset if args.synthetic_dataset == "arithmetic" else arithmetic_preference_dataset
    kw = {"conversational": args.synthetic_conversational}
    return DatasetDict(
        {
            args.dataset_train_split: build(args.synthetic_train_size, seed=args.synthetic_seed, **kw),
            args.dataset_test_split: build(args.synthetic_test_size, seed=args.synthetic_seed + 10_000, **kw),
        }
    )


def _local_or_hub(name: str, config: str | None, streaming: bool):
    from datasets import DatasetDict, load_dataset, load_from_disk

    suffix = os.path.splitext(name)[1].lower()
    if os.path.isfile(name) and suffix in _FILE_BUILDERS:
        return load_dataset(_FILE_BUILDERS[suffix], data_files=name, streaming=streaming)
    if os.path.isdir(name) and any(
        os.path.isfile(os.path.join(name, f)) for f in ("dataset_dict.json", "state.json")
    ):  # written by `save_to_disk`
        loaded = load_from_disk(name)
        return loaded if isinstance(loaded, DatasetDict) else DatasetDict({"train": loaded})
    return load_dataset(name, name=config, streaming=streaming)


def load_script_dataset(script_args: StableScriptArguments, dataset_args=None):
    """A `DatasetDict` from, in order: `synthetic_dataset`, TRL's `datasets` mixture, `dataset_name` (a local data
    file, a `save_to_disk` folder, or a Hub dataset)."""
    if script_args.synthetic_dataset is not None:
        return _synthetic(script_args)
    if dataset_args is not None and dataset_args.datasets:
        from trl import get_dataset

        return get_dataset(dataset_args)
    if script_args.dataset_name:
        return _local_or_hub(script_args.dataset_name, script_args.dataset_config, script_args.dataset_streaming)
    raise ValueError("No training data: set `synthetic_dataset`, `datasets` or `dataset_name`.")
