"""`hf-stable eval-unlearning` and `hf-stable unlearn --benchmark tofu` on a local TOFU-format folder."""

import json
import os
import subprocess
import sys

import pytest

from hf_stable.cli.main import main
from hf_stable.evaluation.suites import MUSE_DEFAULT, TOFU_METRICS, UTILITY_PARTS


def _eval(*args):
    return main(["eval-unlearning", *args, "--max_new_tokens", "4", "--no_progress"])


def test_eval_unlearning_tofu_report(tmp_path, tiny_model_dir, tofu_dir, capsys):
    out = tmp_path / "report"
    rc = _eval("--model", tiny_model_dir, "--benchmark", "tofu", "--forget_split", "forget10", "--data_dir",
               str(tofu_dir), "--output_dir", str(out), "--metrics", "all",
               "--retain_model", tiny_model_dir)  # fmt: skip
    assert rc == 0, capsys.readouterr().err
    summary = json.loads((out / "TOFU_SUMMARY.json").read_text())
    assert list(summary) == [*(m for m in TOFU_METRICS if m != "mia_reference"), *UTILITY_PARTS]
    # the model is its own retain model: identical truth-ratio samples and Min-K AUCs
    assert summary["forget_quality"] == 1.0 and summary["privleak"] == 0.0
    logs = json.loads((out / "TOFU_EVAL.json").read_text())
    assert set(logs["forget_truth_ratio"]["value_by_index"]) == {"0", "1", "2", "3"}
    markdown = (out / "TOFU_SUMMARY.md").read_text()
    assert "| forget_quality | 1.0000 |" in markdown and "| prompt_format | chat |" in markdown
    assert (out / "retain_model" / "TOFU_EVAL.json").is_file()
    assert "report written to" in capsys.readouterr().out

    again = tmp_path / "again"  # the saved retain logs stand in for the retain model
    rc = _eval("--model", tiny_model_dir, "--benchmark", "tofu", "--data_dir", str(tofu_dir), "--output_dir",
               str(again), "--retain_logs_path", str(out / "retain_model" / "TOFU_EVAL.json"))  # fmt: skip
    assert rc == 0
    summary = json.loads((again / "TOFU_SUMMARY.json").read_text())
    assert summary["forget_quality"] == 1.0 and "mia_loss" not in summary


def test_eval_unlearning_muse_report(tmp_path, tiny_model_dir, muse_dir):
    out = tmp_path / "muse_report"
    rc = _eval("--model", tiny_model_dir, "--benchmark", "muse", "--corpus", "Books", "--data_dir", str(muse_dir),
               "--output_dir", str(out), "--prompt_format", "plain", "--max_length", "32")  # fmt: skip
    assert rc == 0
    assert list(json.loads((out / "MUSE_SUMMARY.json").read_text())) == list(MUSE_DEFAULT)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--data_dir", "/nonexistent/tofu"], "`data_dir` '/nonexistent/tofu' is not a folder"),
        (["--forget_split", "forget11"], "`forget_split`='forget11' is not valid. Allowed values: 'forget01'"),
        (["--metrics", "forget_quality,bogus"], "`metrics`='forget_quality,bogus' is not valid"),
        (["--metrics", "mia_reference"], "`mia_reference` needs `reference_model`"),
        (["--batch_size", "0"], "`batch_size` must be an integer in [1, inf), got 0"),
        (["--retain_model", "a", "--retain_logs_path", "b"], "not both"),
        (["--retain_logs_path", "/nonexistent.json"], "`retain_logs_path` '/nonexistent.json' is not a file"),
        (["--retain_model", "/nonexistent/retain"], "`retain_model` '/nonexistent/retain' is not a folder"),
    ],
)
def test_eval_unlearning_expected_failures_are_one_line(tmp_path, tiny_model_dir, tofu_dir, capsys, extra, message):
    args = ["--model", tiny_model_dir, "--benchmark", "tofu", "--output_dir", str(tmp_path / "o")]
    if "--data_dir" not in extra:
        args += ["--data_dir", str(tofu_dir)]
    assert _eval(*args, *extra) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1, err
    assert not (tmp_path / "o" / "TOFU_SUMMARY.json").exists()


def test_eval_unlearning_missing_tofu_file_is_one_line(tmp_path, tiny_model_dir, tofu_dir, capsys):
    (tofu_dir / "world_facts_perturbed.json").unlink()
    assert _eval("--model", tiny_model_dir, "--benchmark", "tofu", "--data_dir", str(tofu_dir), "--output_dir",
                 str(tmp_path / "o")) == 1  # fmt: skip
    err = capsys.readouterr().err
    assert "expected world_facts_perturbed.json" in err and err.count("\n") == 1


def test_unlearn_benchmark_bad_split_is_one_line(tmp_path, tiny_model_dir, tofu_dir, capsys):
    args = ["unlearn", "--model_name_or_path", tiny_model_dir, "--benchmark", "tofu", "--data_dir", str(tofu_dir),
            "--output_dir", str(tmp_path / "o")]  # fmt: skip
    assert main([*args, "--forget_split", "forget11"]) == 2
    err = capsys.readouterr().err
    assert "`forget_split`='forget11' is not valid" in err and "Traceback" not in err and err.count("\n") == 1
    assert main([*args[:-4], "--data_dir", str(tmp_path / "missing"), *args[-2:], "--forget_split", "forget10"]) == 2
    err = capsys.readouterr().err
    assert "is not a folder" in err and err.count("\n") == 1


@pytest.mark.slow
def test_unlearn_on_a_local_tofu_folder_end_to_end(tmp_path, tiny_model_dir, tofu_dir):
    """`hf-stable unlearn --benchmark tofu --forget_split forget10 --data_dir DIR` trains, evaluates and saves; the
    saved model then goes through `hf-stable eval-unlearning`."""
    out = tmp_path / "unlearned"
    command = [os.path.join(os.path.dirname(sys.executable), "hf-stable"), "unlearn", "--model_name_or_path",
               tiny_model_dir, "--benchmark", "tofu", "--forget_split", "forget10", "--data_dir", str(tofu_dir),
               "--unlearn_method", "graddiff", "--max_steps", "2", "--per_device_train_batch_size", "2",
               "--output_dir", str(out), "--use_cpu", "--report_to", "none", "--save_strategy", "no"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((out / "unlearning_report.json").read_text())
    assert {"forget_prob", "retain_prob", "holdout_prob", "mia_auc"} <= set(report)
    assert "locuslab/TOFU" in (out / "README.md").read_text()
    assert main(["eval-unlearning", "--model", str(out), "--benchmark", "tofu", "--data_dir", str(tofu_dir),
                 "--output_dir", str(tmp_path / "eval"), "--max_new_tokens", "4", "--no_progress"]) == 0  # fmt: skip
    assert (tmp_path / "eval" / "TOFU_SUMMARY.md").is_file()
