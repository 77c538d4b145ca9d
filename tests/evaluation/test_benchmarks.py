"""TOFU and MUSE loaders on local folders of the Hub schemas, and the Hub path on a local dataset repository."""

import json
import re

import pytest
from conftest import write_tofu

from hf_stable.evaluation.benchmarks import (
    TOFU_SCHEMAS,
    BenchmarkArgumentError,
    load_muse,
    load_tofu,
    tofu_holdout_of,
    unlearning_datasets,
)


def test_tofu_local_json_lines_and_array(tmp_path, tofu_dir):
    lines = load_tofu("forget10_perturbed", str(tofu_dir))
    array = load_tofu("forget10_perturbed", str(write_tofu(tmp_path / "array", json_array=True)))
    assert lines.to_list() == array.to_list()
    assert set(TOFU_SCHEMAS["forget10_perturbed"]) <= set(lines.column_names)
    assert lines[0]["perturbed_answer"] == ["forget fact 0 is 1.", "forget fact 0 is 2.", "forget fact 0 is 3."]
    assert load_tofu("retain90", str(tofu_dir)).num_rows == 8


def test_tofu_errors_name_the_problem(tmp_path, tofu_dir):
    with pytest.raises(ValueError, match=re.escape("`config`='forget11' is not valid. Allowed values: 'forget01'")):
        load_tofu("forget11", str(tofu_dir))
    with pytest.raises(FileNotFoundError, match=re.escape("expected forget05.json")):
        load_tofu("forget05", str(tofu_dir))
    with pytest.raises(FileNotFoundError, match=re.escape("is not a folder")):
        load_tofu("forget10", str(tmp_path / "missing"))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "retain_perturbed.json").write_text(json.dumps({"question": "q", "answer": "a"}) + "\n")
    with pytest.raises(ValueError, match=r"lacks the field.*paraphrased_answer, perturbed_answer"):
        load_tofu("retain_perturbed", str(tmp_path / "bad"))
    row = {"question": "q", "answer": "a", "perturbed_answer": "not a list"}
    (tmp_path / "bad" / "world_facts_perturbed.json").write_text(json.dumps(row) + "\n")
    with pytest.raises(ValueError, match=re.escape("row 0: `perturbed_answer` must be a non-empty list")):
        load_tofu("world_facts_perturbed", str(tmp_path / "bad"))


def test_tofu_hub_path_on_a_local_dataset_repository(tofu_dir):
    """`load_dataset(repo, config, split="train")`, the Hub branch, on a local copy with the Hub's README configs."""
    configs = "".join(f"- config_name: {c}\n  data_files: {c}.json\n" for c in ("forget10", "forget10_perturbed"))
    (tofu_dir / "README.md").write_text(f"---\nconfigs:\n{configs}---\n")
    hub = load_tofu("forget10_perturbed", repo_id=str(tofu_dir))
    assert hub.to_list() == load_tofu("forget10_perturbed", str(tofu_dir)).to_list()


def test_muse_local_and_parquet_shards(muse_dir):
    knowmem = load_muse("knowmem", "forget_qa", "Books", str(muse_dir))
    assert knowmem.column_names == ["question", "answer"] and knowmem.num_rows == 3
    verbmem = load_muse("verbmem", "forget", data_dir=str(muse_dir))
    assert verbmem[0] == {"prompt": "Once upon 0", "gt": "a time there were 0 bears."}
    # the Hub's file layout: <config>/<split>-00000-of-00001.parquet
    (muse_dir / "privleak" / "forget.json").unlink()
    verbmem.rename_column("gt", "text").remove_columns("prompt").to_parquet(
        str(muse_dir / "privleak" / "forget-00000-of-00001.parquet")
    )
    assert load_muse("privleak", "forget", data_dir=str(muse_dir))["text"][0] == "a time there were 0 bears."
    with pytest.raises(ValueError, match=re.escape("MUSE knowmem: `split`='retain2_qa' is not valid")):
        load_muse("knowmem", "retain2_qa", data_dir=str(muse_dir))
    with pytest.raises(ValueError, match=re.escape("`corpus`='Movies' is not valid")):
        load_muse("knowmem", "forget_qa", "Movies", str(muse_dir))
    with pytest.raises(FileNotFoundError, match=re.escape("expected raw/forget.json")):
        load_muse("raw", "forget", data_dir=str(muse_dir))


def test_unlearning_datasets_for_the_trainer(tofu_dir):
    forget, retain, holdout, name = unlearning_datasets("tofu", "forget10", data_dir=str(tofu_dir))
    assert name == "locuslab/TOFU" and (forget.num_rows, retain.num_rows, holdout.num_rows) == (4, 8, 4)
    assert forget[1] == {"prompt": "Question: What is forget fact 1?\nAnswer: ", "completion": "forget fact 1 is 7."}
    chat, _, _, _ = unlearning_datasets("tofu", "forget10", data_dir=str(tofu_dir), prompt_format="chat")
    assert chat[0]["prompt"] == [{"role": "user", "content": "What is forget fact 0?"}]
    assert chat[0]["completion"] == [{"role": "assistant", "content": "forget fact 0 is 0."}]
    (tofu_dir / "holdout10.json").unlink()  # older snapshots have no holdout files: optional here
    assert unlearning_datasets("tofu", "forget10", data_dir=str(tofu_dir))[2] is None
    with pytest.raises(BenchmarkArgumentError, match=re.escape("'retain95' not found")):
        unlearning_datasets("tofu", "forget10", data_dir=str(tofu_dir), retain_split="retain95")
    with pytest.raises(ValueError, match=re.escape("`forget_split`='forget20' is not valid")):
        unlearning_datasets("tofu", "forget20", data_dir=str(tofu_dir))
    with pytest.raises(
        ValueError, match=re.escape("hf-stable unlearn: `benchmark`='muse' is not valid. Allowed values: 'tofu'")
    ):
        unlearning_datasets("muse", "forget10", data_dir=str(tofu_dir))
    assert tofu_holdout_of("forget05") == "holdout05"
