"""What `hf-stable sft|grpo|unlearn` check before `accelerate launch`, so a mistake costs seconds, not a launch.

Each check raises `ValueError` naming the field, the value and what to change (the launcher prints it as one line):
the model folder (it exists, has a config, every safetensors header is readable) or Hub id (cached, or found on the
Hub); the output folder (a folder, writable); ``resume_from_checkpoint``; batch sizes and options whose requirements
are known before launch; the adapter settings (`StableLoraConfig` validation); the reward functions; and a local
dataset (readable, the split exists and has rows, the columns the trainer reads). What only a rank can see (a Hub
dataset, a setting a trainer refuses) is reported by the rank, in one line too (`entry.run_script`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import tempfile

from hf_stable.scripts.entry import one_line, resume_argument


def check_before_launch(command: str, parsed: tuple) -> None:
    """Run every check for ``command`` on the parsed dataclasses (``parse_args_and_config``'s order)."""
    script_args, training_args, model_args = parsed[:3]
    dataset_args = parsed[3] if len(parsed) > 3 and hasattr(parsed[3], "datasets") else None
    check_options(command, training_args)
    check_output_dir(training_args.output_dir)
    check_resume(training_args)
    model = model_args.model_name_or_path
    if model is None and (command != "unlearn" or script_args.tinytofu_seed is None):
        raise ValueError("`model_name_or_path` is not set: give a model folder or a Hub id.")
    if model is not None:
        check_model(model, "model_name_or_path", model_args.model_revision)
    if model_args.use_peft:
        from hf_stable.scripts.model import get_stable_peft_config

        get_stable_peft_config(model_args)  # e.g. MAP with DoRA is refused here, by `StableLoraConfig`
    if command == "grpo":
        check_rewards(script_args)
    check_data(command, script_args, training_args, dataset_args)


# -- options -----------------------------------------------------------------------------------------------------
def check_options(command: str, args) -> None:
    for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"):
        value = getattr(args, name, 1)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"`{name}`={value!r} is not valid: it must be a positive integer.")
    if getattr(args, "use_liger_kernel", False) and importlib.util.find_spec("liger_kernel") is None:
        raise ValueError(
            "`use_liger_kernel`=True needs the liger-kernel package, which is not installed: pip install "
            "liger-kernel, or set use_liger_kernel=False."
        )
    # TRL's own rule (trl/trainer/sft_trainer.py, `SFTTrainer.__init__`), checked here rather than after the launch
    if command == "sft" and args.padding_free and not args.packing and args.max_length is not None:
        raise ValueError(
            f"`padding_free`=True without packing does not enforce `max_length`={args.max_length}: set "
            "packing=True, or max_length=None (with already truncated data), or padding_free=False."
        )


# -- paths -------------------------------------------------------------------------------------------------------
def check_output_dir(output_dir: str | None) -> None:
    """``output_dir`` is a folder, or can be created, and is writable (a probe folder is created and removed)."""
    if not output_dir:
        return
    path = os.path.abspath(os.path.expanduser(output_dir))
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"`output_dir`={output_dir!r} is a file, not a folder: choose another output_dir.")
    parent = path
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ValueError(f"`output_dir`={output_dir!r} cannot be created: {parent} is a file.")
    try:
        with tempfile.TemporaryDirectory(dir=parent, prefix=".hf-stable-write-check-"):
            pass
    except OSError as error:
        raise ValueError(
            f"`output_dir`={output_dir!r} is not writable ({parent}: {error.strerror or one_line(error)})."
        ) from error


def check_resume(args) -> None:
    value = resume_argument(args.resume_from_checkpoint)
    if value is True:
        from transformers.trainer_utils import get_last_checkpoint

        if not os.path.isdir(args.output_dir) or get_last_checkpoint(args.output_dir) is None:
            raise ValueError(
                f"`resume_from_checkpoint`=true but `output_dir`={args.output_dir!r} has no checkpoint-* folder "
                "to resume from."
            )
    elif isinstance(value, str) and not os.path.isdir(value):
        raise ValueError(f"`resume_from_checkpoint`={value!r}: no such checkpoint folder.")


def _is_repo_id(name: str) -> bool:
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def check_model(name: str, field: str, revision: str | None = None) -> None:
    """A local model folder (readable config and weights), else a Hub id the rank can load."""
    if os.path.isdir(name):
        return check_model_folder(name, field)
    if os.path.exists(name):
        raise ValueError(f"`{field}`={name!r} is a file: give the model's folder or a Hub id.")
    if not _is_repo_id(name):
        raise ValueError(f"`{field}`={name!r}: no such folder (and not a Hub id).")
    from huggingface_hub import try_to_load_from_cache

    if isinstance(try_to_load_from_cache(name, "config.json", revision=revision), str):
        return
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        raise ValueError(
            f"`{field}`={name!r}: no such folder, and no such model in the Hub cache (HF_HUB_OFFLINE is set)."
        )
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    try:
        HfApi().model_info(name, revision=revision, timeout=15)
    except RevisionNotFoundError as error:
        raise ValueError(f"`{field}`={name!r}: the Hub has no revision {revision!r} of it.") from error
    except RepositoryNotFoundError as error:  # gated and private repositories without access included
        raise ValueError(
            f"`{field}`={name!r}: no such folder, and no Hub model you can access ({type(error).__name__})."
        ) from error
    except Exception as error:  # no connection, a timeout, a server error: the rank could not load it either
        raise ValueError(
            f"`{field}`={name!r}: no such folder, and the Hub could not be reached to find it "
            f"({type(error).__name__}: {one_line(error)[:200]})."
        ) from error


def check_model_folder(path: str, field: str) -> None:
    names = set(os.listdir(path))
    configs = [name for name in ("config.json", "adapter_config.json") if name in names]
    if not configs:
        raise ValueError(f"`{field}`={path!r} has no config.json: not a saved model folder.")
    for name in configs + sorted(n for n in names if n.endswith(".safetensors.index.json")):
        try:
            with open(os.path.join(path, name)) as f:
                content = json.load(f)
        except (OSError, ValueError) as error:
            raise ValueError(
                f"`{field}`: {os.path.join(path, name)} is not readable JSON ({one_line(error)})."
            ) from error
        if name.endswith(".index.json"):
            for shard in sorted(set(content.get("weight_map", {}).values())):
                if shard not in names:
                    raise ValueError(f"`{field}`: {os.path.join(path, name)} lists {shard}, which is missing.")
    for name in sorted(n for n in names if n.endswith(".safetensors")):
        check_safetensors(os.path.join(path, name), field)


def check_safetensors(path: str, field: str) -> None:
    """The header parses and the data it describes fits the file (what `safe_open` checks; it reads no tensor)."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as f:
            f.keys()
    except Exception as error:  # safetensors raises its own SafetensorError, or OSError
        raise ValueError(
            f"`{field}`: {path} is not a valid safetensors file ({one_line(error)}): re-save or re-download it."
        ) from error


# -- rewards and data --------------------------------------------------------------------------------------------
def check_rewards(script_args) -> None:
    from hf_stable.rewards.resolve import resolve_reward_function

    for name in script_args.reward_funcs or []:
        resolve_reward_function(name)  # an unknown name: ValueError with the valid ones
    if not script_args.reward_funcs and not script_args.reward_model_name_or_path:
        raise ValueError("Set `reward_funcs` (and/or `reward_model_name_or_path`).")
    if script_args.reward_model_name_or_path:
        check_model(script_args.reward_model_name_or_path, "reward_model_name_or_path")


def _local_name(field: str, name: str) -> bool:
    """Whether ``name`` is a local dataset (True), a Hub id (False), or a missing path (raises)."""
    if os.path.exists(name):
        if os.path.isfile(name) and os.path.getsize(name) == 0:
            raise ValueError(f"`{field}`={name!r} is an empty file: no rows to train on.")
        return True
    suffix = os.path.splitext(name)[1].lower()
    if not _is_repo_id(name) or name.startswith(".") or suffix in (".json", ".jsonl", ".csv", ".parquet", ".txt"):
        raise ValueError(f"`{field}`={name!r}: no such file or folder (and not a Hub id).")
    return False


def _load(field: str, name: str, load):
    try:
        return load()
    except Exception as error:  # the `datasets` library's own errors (a malformed file, a wrong builder)
        raise ValueError(
            f"`{field}`={name!r} could not be read ({type(error).__name__}: {one_line(error)})."
        ) from error


def _split(dataset, field: str, name: str, split: str, split_field: str):
    if split not in dataset:
        raise ValueError(
            f"`{split_field}`={split!r} is not a split of `{field}`={name!r}; its splits: {', '.join(dataset)}."
        )
    part = dataset[split]
    if getattr(part, "num_rows", None) == 0:
        raise ValueError(f"`{field}`={name!r}: split {split!r} has no rows.")
    return part


def check_data(command: str, script_args, training_args, dataset_args=None) -> None:
    if command == "unlearn":
        return _check_unlearning_data(script_args)
    if script_args.synthetic_dataset is not None:
        if getattr(training_args, "assistant_only_loss", False) and not script_args.synthetic_conversational:
            raise ValueError("`assistant_only_loss`=True needs conversational data: set synthetic_conversational.")
        return
    if dataset_args is not None and dataset_args.datasets:
        return  # a mixture of Hub datasets: the rank loads and checks it
    name = script_args.dataset_name
    if not name:
        raise ValueError("No training data: set `synthetic_dataset`, `datasets` or `dataset_name`.")
    if not _local_name("dataset_name", name) or script_args.dataset_streaming:
        return
    from hf_stable.scripts.data import load_script_dataset

    dataset = _load("dataset_name", name, lambda: load_script_dataset(script_args, dataset_args))
    train = _split(dataset, "dataset_name", name, script_args.dataset_train_split, "dataset_train_split")
    columns = set(train.column_names)
    if command == "grpo" and "prompt" not in columns:
        raise ValueError(
            f"`dataset_name`={name!r} has no 'prompt' column (GRPO needs one); columns: {sorted(columns)}."
        )
    if command == "sft":
        _check_sft_columns(name, columns, training_args, train)


def _check_sft_columns(name: str, columns: set, args, train) -> None:
    if args.sequence_objective is not None:
        return  # the trainer checks its pair or sign columns, with its own message
    text = args.dataset_text_field
    usable = {"input_ids", "messages", "conversations", text} & columns or {"prompt", "completion"} <= columns
    if not usable:
        raise ValueError(
            f"`dataset_name`={name!r} has columns {sorted(columns)}; SFT reads '{text}' (`dataset_text_field`), "
            "'messages', or 'prompt' and 'completion'."
        )
    if args.assistant_only_loss:
        from trl.data_utils import is_conversational

        if not is_conversational(train[0]):
            raise ValueError(
                f"`assistant_only_loss`=True needs conversational rows (chat messages); `dataset_name`={name!r} "
                "has plain text."
            )


def _check_unlearning_data(script_args) -> None:
    name = script_args.dataset_name
    if name is None or not _local_name("dataset_name", name):
        return  # TinyTOFU, a benchmark (checked when parsed) or a Hub dataset
    from datasets import load_dataset, load_from_disk

    if os.path.isfile(os.path.join(name, "dataset_dict.json")):  # what `scripts/unlearn.py` loads, the same way
        dataset = _load("dataset_name", name, lambda: load_from_disk(name))
    else:
        dataset = _load("dataset_name", name, lambda: load_dataset(name, script_args.dataset_config))
    splits = [("forget_split", script_args.forget_split), ("retain_split", script_args.retain_split)]
    if script_args.holdout_split:
        splits.append(("holdout_split", script_args.holdout_split))
    for split_field, split in splits:
        columns = set(_split(dataset, "dataset_name", name, split, split_field).column_names)
        if "prompt" not in columns or not {"completion", "answer"} & columns:
            raise ValueError(
                f"`dataset_name`={name!r}: split {split!r} has columns {sorted(columns)}; unlearning reads 'prompt' "
                "and 'completion' (or 'answer')."
            )
