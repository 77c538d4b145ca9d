"""TOFU and MUSE data in their Hub schemas, from the Hub or from a local folder of the same files.

* **TOFU** (`locuslab/TOFU`, Maini et al., arXiv 2401.06121): one configuration per file, one ``train`` split.
  ``forget01/05/10``, ``retain90/95/99``, ``full`` and ``holdout01/05/10`` hold ``question``, ``answer``;
  ``forget01/05/10_perturbed`` and ``retain_perturbed`` add ``paraphrased_answer`` and ``perturbed_answer`` (a list
  of wrong answers); ``real_authors_perturbed`` and ``world_facts_perturbed`` hold ``question``, ``answer``,
  ``perturbed_answer``; ``real_authors`` and ``world_facts`` hold ``question``, ``option1`` .. ``option4``,
  ``answer``. A local folder holds ``<config>.json`` (JSON lines or a JSON array; ``.jsonl`` and ``.parquet`` work
  too), which is also the layout of a snapshot of the Hub repository.
* **MUSE** (`muse-bench/MUSE-News`, `muse-bench/MUSE-Books`, Shi et al., arXiv 2407.06460): configurations with
  several splits: ``knowmem`` (``question``, ``answer``; ``forget_qa``, ``retain_qa``, ``forget_qa_icl``,
  ``retain_qa_icl``), ``verbmem`` (``prompt``, ``gt``; ``forget``), ``privleak`` (``text``; ``forget``,
  ``retain``, ``holdout``) and ``raw`` (``text``; ``forget``, ``retain1``, ``retain2``, ``holdout``). A local
  folder holds ``<config>/<split>.json`` (or ``.jsonl``, ``.parquet``, or the Hub's ``<split>-*.parquet``).

Which splits open-unlearning evaluates on follows its `configs/data/datasets/{TOFU,MUSE}_*.yaml`.
"""

from __future__ import annotations

import glob
import json
import os
import re

from .._validation import check_choice


TOFU_REPO = "locuslab/TOFU"
MUSE_REPOS = {"News": "muse-bench/MUSE-News", "Books": "muse-bench/MUSE-Books"}
BENCHMARKS = ("tofu", "muse")

_QA = ("question", "answer")
_PERTURBED = (*_QA, "paraphrased_answer", "perturbed_answer")
TOFU_SCHEMAS: dict[str, tuple[str, ...]] = {
    **{f"forget{n}": _QA for n in ("01", "05", "10")},
    **{f"holdout{n}": _QA for n in ("01", "05", "10")},
    **{f"retain{n}": _QA for n in ("90", "95", "99")},
    "full": _QA,
    **{f"forget{n}_perturbed": _PERTURBED for n in ("01", "05", "10")},
    "retain_perturbed": _PERTURBED,
    "real_authors_perturbed": (*_QA, "perturbed_answer"),
    "world_facts_perturbed": (*_QA, "perturbed_answer"),
    "real_authors": ("question", "option1", "option2", "option3", "option4", "answer"),
    "world_facts": ("question", "option1", "option2", "option3", "option4", "answer"),
}
TOFU_FORGET_SPLITS = ("forget01", "forget05", "forget10")
# the retain set of each forget split: together they make `full`
TOFU_RETAIN_OF = {"forget01": "retain99", "forget05": "retain95", "forget10": "retain90"}

MUSE_SCHEMAS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {  # config -> (splits, fields)
    "knowmem": (("forget_qa", "retain_qa", "forget_qa_icl", "retain_qa_icl"), _QA),
    "verbmem": (("forget",), ("prompt", "gt")),
    "privleak": (("forget", "retain", "holdout"), ("text",)),
    "raw": (("forget", "retain1", "retain2", "holdout"), ("text",)),
}
_EXTENSIONS = (".json", ".jsonl", ".parquet")


def _read_file(path: str):
    """A `datasets.Dataset` from a JSON-lines / JSON-array / parquet file."""
    from datasets import Dataset

    if path.endswith(".parquet"):
        return Dataset.from_parquet(path)
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        rows = json.loads(text)
        rows = rows if isinstance(rows, list) else [rows]
    except json.JSONDecodeError:
        try:
            rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} is neither JSON lines nor a JSON array ({err}).") from err
    return Dataset.from_list(rows)


def _find(folder: str, stem: str) -> str | None:
    for ext in _EXTENSIONS:
        if os.path.isfile(os.path.join(folder, stem + ext)):
            return os.path.join(folder, stem + ext)
    shards = sorted(glob.glob(os.path.join(glob.escape(folder), f"{glob.escape(stem)}-*.parquet")))
    return shards[0] if len(shards) == 1 else None


def _from_hub(repo_id: str, config: str, split: str):
    """The Hub path: ``datasets.load_dataset(repo_id, config, split=split)`` (works on a local dataset repo too)."""
    from datasets import load_dataset

    return load_dataset(repo_id, config, split=split)


def _check_fields(dataset, fields, where: str):
    missing = [f for f in fields if f not in dataset.column_names]
    if missing:
        raise ValueError(f"{where} lacks the field(s) {', '.join(missing)}; it has {', '.join(dataset.column_names)}.")
    if len(dataset) == 0:
        raise ValueError(f"{where} is empty.")
    if "perturbed_answer" in fields:
        for i, value in enumerate(dataset["perturbed_answer"]):
            if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
                raise ValueError(f"{where} row {i}: `perturbed_answer` must be a non-empty list of strings.")
    return dataset


def _local_dir(data_dir: str) -> str:
    if not os.path.isdir(data_dir):
        raise FileNotFoundError(f"`data_dir` {data_dir!r} is not a folder.")
    return data_dir


def load_tofu(config: str, data_dir: str | None = None, repo_id: str = TOFU_REPO):
    """One TOFU configuration as a `datasets.Dataset`, checked against its schema (see the module docstring).

    Args:
        config (`str`): a configuration name, e.g. ``"forget10"``, ``"forget10_perturbed"``, ``"retain90"``.
        data_dir (`str`, *optional*): a local folder with ``<config>.json``; without it, the Hub (``repo_id``).
    """
    check_choice("config", config, TOFU_SCHEMAS)
    if data_dir is None:
        return _check_fields(_from_hub(repo_id, config, "train"), TOFU_SCHEMAS[config], f"{repo_id} {config}")
    path = _find(_local_dir(data_dir), config)
    if path is None:
        raise FileNotFoundError(f"TOFU configuration {config!r} not found in {data_dir}: expected {config}.json.")
    return _check_fields(_read_file(path), TOFU_SCHEMAS[config], path)


def load_muse(config: str, split: str, corpus: str = "News", data_dir: str | None = None, repo_id: str | None = None):
    """One MUSE split as a `datasets.Dataset`, checked against its schema.

    Args:
        config (`str`): ``knowmem``, ``verbmem``, ``privleak`` or ``raw``.
        split (`str`): one of that configuration's splits, e.g. ``"forget_qa"``.
        corpus (`str`): ``News`` or ``Books`` (picks the Hub repository).
        data_dir (`str`, *optional*): a local folder with ``<config>/<split>.json``; without it, the Hub.
    """
    check_choice("corpus", corpus, MUSE_REPOS)
    check_choice("config", config, MUSE_SCHEMAS)
    splits, fields = MUSE_SCHEMAS[config]
    check_choice("split", split, splits, where=f"MUSE {config}")
    if data_dir is None:
        repo = repo_id or MUSE_REPOS[corpus]
        return _check_fields(_from_hub(repo, config, split), fields, f"{repo} {config}/{split}")
    path = _find(os.path.join(_local_dir(data_dir), config), split)
    if path is None:
        raise FileNotFoundError(f"MUSE {config}/{split} not found in {data_dir}: expected {config}/{split}.json.")
    return _check_fields(_read_file(path), fields, path)


def tofu_holdout_of(forget_split: str) -> str:
    """``forget10 -> holdout10``: the never-trained questions of the same size (TOFU's MIA / privleak set)."""
    check_choice("forget_split", forget_split, TOFU_FORGET_SPLITS)
    return "holdout" + re.sub(r"\D", "", forget_split)


class BenchmarkArgumentError(ValueError):
    """A bad ``--benchmark`` / ``--forget_split`` / ``--data_dir`` of ``hf-stable unlearn``: the CLI prints it as one
    line, before launching any process."""


def check_unlearn_benchmark_args(benchmark, forget_split, retain_split=None, data_dir=None, prompt_format="plain"):
    """Early checks for ``hf-stable unlearn --benchmark``: names and the local files, so a typo fails at parse time
    with one line instead of inside the launched training processes. Raises [`BenchmarkArgumentError`]."""
    try:
        check_choice("benchmark", benchmark, ("tofu",), where="hf-stable unlearn")
        check_choice("forget_split", forget_split, TOFU_FORGET_SPLITS)
        check_choice("benchmark_prompt_format", prompt_format, ("plain", "chat"))
        if retain_split is not None:
            check_choice("retain_split", retain_split, [c for c in TOFU_SCHEMAS if c.startswith("retain")])
        if data_dir is not None:
            for config in (forget_split, retain_split or TOFU_RETAIN_OF[forget_split]):
                if _find(_local_dir(data_dir), config) is None:
                    raise FileNotFoundError(f"TOFU configuration {config!r} not found in {data_dir}: expected "
                                            f"{config}.json.")  # fmt: skip
    except (ValueError, FileNotFoundError) as err:
        raise BenchmarkArgumentError(str(err)) from err


def _qa_row(question: str, answer: str, prompt_format: str) -> dict:
    if prompt_format == "chat":
        return {
            "prompt": [{"role": "user", "content": question}],
            "completion": [{"role": "assistant", "content": answer}],
        }
    return {"prompt": f"Question: {question}\nAnswer: ", "completion": answer}


def unlearning_datasets(
    benchmark: str,
    forget_split: str,
    *,
    data_dir: str | None = None,
    retain_split: str | None = None,
    holdout: bool = True,
    prompt_format: str = "plain",
):
    """Forget / retain / holdout rows for `UnlearningTrainer` from a benchmark: TOFU's ``forget_split`` (e.g.
    ``forget10``), its retain set (``retain90``, or ``retain_split``) and, with ``holdout``, its never-trained
    ``holdout10`` when present. Rows are prompt/completion: ``plain`` uses open-unlearning's base-model template
    ``"Question: {question}\\nAnswer: "``, ``chat`` gives conversational rows for the tokenizer's chat template.

    Returns:
        ``(forget, retain, holdout or None, dataset_name)`` with `datasets.Dataset` rows.
    """
    from datasets import Dataset

    check_unlearn_benchmark_args(benchmark, forget_split, retain_split, data_dir, prompt_format)
    retain_split = retain_split or TOFU_RETAIN_OF[forget_split]

    def rows(config):
        data = load_tofu(config, data_dir)
        return Dataset.from_list(
            [_qa_row(q, a, prompt_format) for q, a in zip(data["question"], data["answer"], strict=True)]
        )

    held = None
    if holdout:
        name = tofu_holdout_of(forget_split)
        try:
            held = rows(name)
        except FileNotFoundError:  # older snapshots of the repository have no holdout files; they are optional here
            held = None
    return rows(forget_split), rows(retain_split), held, TOFU_REPO
