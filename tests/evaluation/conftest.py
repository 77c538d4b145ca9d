"""Tiny local copies of TOFU and MUSE in their Hub schemas (a few rows each, same field names and file layout)."""

import json

import pytest


def _qa(i, prefix):
    return {"question": f"What is {prefix} fact {i}?", "answer": f"{prefix} fact {i} is {i * 7 % 10}."}


def _perturbed(i, prefix, paraphrase=True):
    row = _qa(i, prefix)
    if paraphrase:
        row["paraphrased_answer"] = f"The {prefix} fact {i} is {i * 7 % 10}."
    row["perturbed_answer"] = [f"{prefix} fact {i} is {(i * 7 + j) % 10}." for j in (1, 2, 3)]
    return row


def write_tofu(folder, n=4, json_array=False):
    """`<config>.json` files as on the Hub (JSON lines; a JSON array with ``json_array``)."""
    folder.mkdir(parents=True, exist_ok=True)
    configs = {
        "forget10": [_qa(i, "forget") for i in range(n)],
        "retain90": [_qa(i, "retain") for i in range(2 * n)],
        "holdout10": [_qa(i, "holdout") for i in range(n)],
        "forget10_perturbed": [_perturbed(i, "forget") for i in range(n)],
        "retain_perturbed": [_perturbed(i, "retain") for i in range(n)],
        "real_authors_perturbed": [_perturbed(i, "author", paraphrase=False) for i in range(n)],
        "world_facts_perturbed": [_perturbed(i, "world", paraphrase=False) for i in range(n)],
    }
    for name, rows in configs.items():
        with open(folder / f"{name}.json", "w") as f:
            if json_array:
                json.dump(rows, f)
            else:
                f.writelines(json.dumps(r) + "\n" for r in rows)
    return folder


def write_muse(folder, n=3):
    """`<config>/<split>.json` files with MUSE's fields."""
    splits = {
        ("knowmem", "forget_qa"): [_qa(i, "forget") for i in range(n)],
        ("knowmem", "retain_qa"): [_qa(i, "retain") for i in range(n)],
        ("knowmem", "forget_qa_icl"): [_qa(i, "shot") for i in range(2)],
        ("knowmem", "retain_qa_icl"): [_qa(i, "shot") for i in range(2)],
        ("verbmem", "forget"): [{"prompt": f"Once upon {i}", "gt": f"a time there were {i} bears."} for i in range(n)],
        ("privleak", "forget"): [{"text": f"forget text {i} about bears."} for i in range(n)],
        ("privleak", "retain"): [{"text": f"retain text {i} about cats."} for i in range(n)],
        ("privleak", "holdout"): [{"text": f"holdout text {i} about owls."} for i in range(n)],
    }
    for (config, split), rows in splits.items():
        (folder / config).mkdir(parents=True, exist_ok=True)
        with open(folder / config / f"{split}.json", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return folder


@pytest.fixture
def tofu_dir(tmp_path):
    return write_tofu(tmp_path / "tofu")


@pytest.fixture
def muse_dir(tmp_path):
    return write_muse(tmp_path / "muse")
