"""`--push_to_hub ID --hub_dry_run` on `hf-stable sft|grpo|unlearn|merge`: the planned commit is printed, no request
is made (sockets and every `HfApi` call used by a push raise), and the printed files are the folder's files."""

import importlib
import json
import os
import re
import socket

import pytest
from huggingface_hub import HfApi

from hf_stable.cli.main import main as cli_main
from hf_stable.hub_plan import expand_push_to_hub


FAKE_TOKEN = "hf_dryRunTestTokenNotARealOne0123456789"
COMMON = ["--max_steps", "2", "--save_strategy", "no", "--report_to", "none", "--use_cpu", "true", "--bf16", "false"]


@pytest.fixture
def offline(monkeypatch):
    """Any connection or push call is recorded and refused; a (fake) saved token makes the scan run."""
    calls = []

    def refuse(name):
        def call(*args, **kwargs):
            calls.append(name)
            raise OSError(f"network blocked by the test ({name})")

        return call

    for name in ("connect", "connect_ex"):
        monkeypatch.setattr(socket.socket, name, refuse(f"socket.{name}"))
    monkeypatch.setattr(socket, "create_connection", refuse("socket.create_connection"))
    for name in (
        "create_repo",
        "create_branch",
        "upload_folder",
        "create_commit",
        "whoami",
        "repo_info",
        "upload_file",
    ):
        monkeypatch.setattr(HfApi, name, refuse(f"HfApi.{name}"))
    monkeypatch.setenv("HF_TOKEN", FAKE_TOKEN)
    return calls


def _printed_files(text: str) -> list[str]:
    block = text.split("Planned Hub commit", 1)[1].split("card metadata", 1)[0]
    return re.findall(r"^  (\S+)\s+[\d,]+ B\s", block, flags=re.M)


def _folder_files(folder) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), folder).replace(os.sep, "/") for d, _, fs in os.walk(folder)
                  for f in fs)  # fmt: skip


def _check_plan(printed: str, folder, repo: str, calls: list) -> None:
    assert calls == []
    assert f"repo:        {repo}" in printed
    files = _printed_files(printed)
    assert files == _folder_files(folder) and "model.safetensors" in files and "README.md" in files
    for name in files:  # each with its exact size
        size = os.path.getsize(os.path.join(folder, name))
        assert re.search(rf"^  {re.escape(name)}\s+{size:,d} B", printed, flags=re.M)
    header = printed.split("card metadata (README.md header):\n", 1)[1].split("token scan:")[0]
    card = open(os.path.join(folder, "README.md"), encoding="utf-8").read()
    assert header.replace("\n  ", "\n").strip() == card[: card.index("\n---", 3) + 4].strip()
    assert "library_name: transformers" in header
    assert "token scan:  passed" in printed and FAKE_TOKEN not in printed


def _run_script(name: str, argv: list[str]) -> None:
    """The launched script in this process (as `accelerate launch` runs it, after the CLI's argument rewrite)."""
    module = importlib.import_module(f"hf_stable.scripts.{name}")
    module.main(*module.make_parser().parse_args_and_config(expand_push_to_hub(argv)))


def test_sft_dry_run(tmp_path, tiny_model_dir, offline, capsys):
    out = tmp_path / "out"
    argv = ["--model_name_or_path", tiny_model_dir, "--synthetic_dataset", "arithmetic", "--synthetic_train_size",
            "16", "--per_device_train_batch_size", "4", "--max_length", "32", "--output_dir", str(out), *COMMON,
            "--push_to_hub", "me/sft-dry", "--hub_dry_run"]  # fmt: skip
    _run_script("sft", argv)
    printed = capsys.readouterr().out
    _check_plan(printed, out, "me/sft-dry", offline)
    card = (out / "README.md").read_text()
    assert 'model="me/sft-dry"' in card  # the card a real push writes: it names the Hub id


def test_grpo_dry_run(tmp_path, tiny_model_dir, offline, capsys):
    out = tmp_path / "out"
    argv = ["--model_name_or_path", tiny_model_dir, "--synthetic_dataset", "arithmetic", "--synthetic_train_size",
            "16", "--reward_funcs", "arithmetic_exact_match", "--num_generations", "4",
            "--per_device_train_batch_size", "4", "--max_completion_length", "4", "--output_dir", str(out), *COMMON,
            "--push_to_hub", "true", "--hub_model_id", "me/grpo-dry", "--hub_dry_run", "true"]  # fmt: skip
    _run_script("grpo", argv)
    _check_plan(capsys.readouterr().out, out, "me/grpo-dry", offline)


def test_unlearn_dry_run_with_adapters_lists_the_merged_folder(tmp_path, tiny_model_dir, offline, capsys):
    from datasets import Dataset, DatasetDict

    from hf_stable.testing import arithmetic_dataset

    rows = list({r["prompt"]: r for r in arithmetic_dataset(60, seed=5, max_operand=999).to_list()}.values())
    data = tmp_path / "data"
    DatasetDict({"forget": Dataset.from_list(rows[:8]), "retain": Dataset.from_list(rows[8:32])}).save_to_disk(data)
    out = tmp_path / "out"
    argv = ["--model_name_or_path", tiny_model_dir, "--dataset_name", str(data), "--unlearn_method", "graddiff",
            "--per_device_train_batch_size", "4", "--use_peft", "--lora_r", "4", "--lora_target_modules", "q_proj",
            "v_proj", "--output_dir", str(out), *COMMON, "--push_to_hub", "me/unlearn-dry",
            "--hub_dry_run"]  # fmt: skip
    _run_script("unlearn", argv)
    printed = capsys.readouterr().out
    assert offline == []
    files = _printed_files(printed)
    assert files == _folder_files(out)
    assert {"adapter_model.safetensors", "merged/model.safetensors", "unlearning_report.json"} <= set(files)
    assert "forget_prob" in (out / "README.md").read_text()  # the card with the metrics, as the push writes it


def test_merge_dry_run(tmp_path, offline, capsys):
    from hf_stable.testing import build_tiny_model

    kwargs = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    for seed in (0, 1):
        build_tiny_model(tmp_path / f"m{seed}", seed=seed, num_key_value_heads=1, **kwargs)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"merge_method: linear\nmodels:\n  - model: {tmp_path / 'm0'}\n  - model: {tmp_path / 'm1'}\n")
    out = tmp_path / "merged"
    argv = ["merge", str(recipe), str(out), "--push_to_hub", "me/merge-dry", "--hub_dry_run", "--no-progress"]
    assert cli_main(argv) == 0
    _check_plan(capsys.readouterr().out, out, "me/merge-dry", offline)

    (out / "notes.json").write_text(json.dumps({"token": FAKE_TOKEN}))  # a leaked token: the push would be refused
    from hf_stable.hub_plan import plan_commit
    from hf_stable.merging.hub import upload_files

    plan = plan_commit(out, "me/merge-dry", upload_files(out))
    assert plan.token_found and "notes.json contains the Hub token" in plan.token_scan
    assert FAKE_TOKEN not in plan.render() and offline == []


def test_dry_run_refusals(tmp_path, tiny_model_dir, capsys, monkeypatch):
    monkeypatch.delenv("HF_STABLE_DEBUG", raising=False)
    base = ["--model_name_or_path", tiny_model_dir, "--synthetic_dataset", "arithmetic", "--output_dir",
            str(tmp_path / "o"), "--use_cpu", "true", "--bf16", "false"]  # fmt: skip
    assert cli_main(["sft", *base, "--hub_dry_run"]) == 2
    assert "`hub_dry_run` needs `push_to_hub`" in capsys.readouterr().err
    assert cli_main(["sft", *base, "--push_to_hub", "me/a", "--hub_model_id", "me/b", "--hub_dry_run"]) == 2
    assert "give one repository" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()  # nothing was launched
    with pytest.raises(SystemExit):
        cli_main(["merge", "r.yaml", str(tmp_path / "m"), "--hub-dry-run"])
    assert "--hub-dry-run needs --push-to-hub" in capsys.readouterr().err


def test_expand_push_to_hub():
    assert expand_push_to_hub(["--push_to_hub", "me/x"]) == ["--push_to_hub", "true", "--hub_model_id", "me/x"]
    assert expand_push_to_hub(["--push_to_hub=me/x", "--hub_model_id", "me/x"]) == [
        "--push_to_hub",
        "true",
        "--hub_model_id",
        "me/x",
    ]
    for kept in (["--push_to_hub"], ["--push_to_hub", "--hub_dry_run"], ["--push_to_hub", "False"]):
        assert expand_push_to_hub(kept) == kept


def test_trainer_push_files_match_upload_folder(tmp_path, offline):
    """The training commands' list is what `upload_folder` (called by `Trainer.push_to_hub`) would add."""
    from huggingface_hub.utils import DEFAULT_IGNORE_PATTERNS

    from hf_stable.hub_plan import TRAINER_IGNORE_PATTERNS, trainer_push_files

    for name in ("model.safetensors", "config.json", "merged/model.safetensors", "checkpoint-5/model.safetensors",
                 "_internal.json", ".git/config", "sub/_x.txt", "runs/events.out"):  # fmt: skip
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    files = trainer_push_files(tmp_path)
    assert files == ["config.json", "merged/model.safetensors", "model.safetensors", "runs/events.out", "sub/_x.txt"]
    ignore = [*TRAINER_IGNORE_PATTERNS, *DEFAULT_IGNORE_PATTERNS]
    additions = HfApi()._prepare_upload_folder_additions(tmp_path, "", ignore_patterns=ignore)  # no README: offline
    assert sorted(op.path_in_repo for op in additions) == files and offline == []
