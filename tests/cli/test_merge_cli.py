"""`hf-stable merge`: driven in-process through the console script's `main` (no subprocess: the merge is tiny)."""

import glob
import json
import os

import pytest
import torch
from huggingface_hub import HfApi, ModelCard
from safetensors.torch import load_file

from hf_stable.cli.main import main as cli_main
from hf_stable.scripts.merge import main


RECIPE = """\
merge_method: linear
models:
  - model: {a}
    parameters: {{weight: 0.3}}
  - model: {b}
    parameters: {{weight: 0.7}}
"""
TENSOR = "model.layers.0.mlp.up_proj.weight"


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """Two pico Llama checkpoints (different seeds), a linear recipe over them and a probe file."""
    from hf_stable.testing import build_tiny_model

    root = tmp_path_factory.mktemp("merge-cli")
    kwargs = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    for seed, name in enumerate(("expert-a", "expert-b")):
        build_tiny_model(root / name, seed=seed, num_key_value_heads=1, **kwargs)
    recipe = root / "recipe.yaml"
    recipe.write_text(RECIPE.format(a=root / "expert-a", b=root / "expert-b"))
    probe = root / "probe.jsonl"
    probe.write_text("\n".join(json.dumps({"prompt": f"{i}+{i}=", "completion": str(2 * i)}) for i in range(12)))
    return root, recipe, probe


def test_dry_run_prints_the_plan_and_writes_nothing(workspace, tmp_path, capsys):
    _, recipe, _ = workspace
    out = tmp_path / "merged"
    assert cli_main(["merge", str(recipe), str(out), "--dry-run", "--memory-budget", "1MB"]) == 0
    printed = capsys.readouterr().out
    assert "merge_method: linear" in printed and TENSOR in printed and "chunks=" in printed
    assert "dry run: nothing was written" in printed
    assert os.listdir(tmp_path) == []


def test_merge_with_diagnostics_writes_card_and_json(workspace, tmp_path, capsys):
    root, recipe, probe = workspace
    out = tmp_path / "merged"
    rc = main(
        [str(recipe), str(out), "--diagnose", "--probe-data", str(probe), "--probe-tokens", "40", "--no-progress"]
    )
    assert rc == 0
    files = set(os.listdir(out))
    assert {"model.safetensors", "config.json", "README.md", "hf_stable_merge.yaml", "merge_diagnostics.json"} <= files
    assert not glob.glob(str(tmp_path / "*.tmp")) and not glob.glob(str(out / "*.tmp"))

    # Data-free diagnostics against an independent computation from the input weights.
    a, b = (load_file(str(root / name / "model.safetensors"))[TENSOR].double() for name in ("expert-a", "expert-b"))
    merged = 0.3 * a + 0.7 * b
    rho = float(merged.norm() / (0.3 * a.norm() + 0.7 * b.norm()))
    cos = float((a * b).sum() / (a.norm() * b.norm()))
    report = json.loads((out / "merge_diagnostics.json").read_text())
    tensor = report["weights"]["per_tensor"][TENSOR]
    assert tensor["norm_ratio"] == pytest.approx(rho, rel=1e-6)
    assert tensor["pairwise_angles_deg"][0][1] == pytest.approx(float(torch.rad2deg(torch.arccos(torch.tensor(cos)))))
    activations = report["activations"]
    assert activations["summary"]["n_tokens"] == 40 and len(activations["kl_to_experts"]) == 2
    assert len(activations["per_layer"]) == 2  # embeddings + one block

    card = ModelCard.load(out / "README.md")
    assert card.data.base_model is None  # base_model lists Hub ids only; these parents are local folders
    assert str(root) not in (out / "README.md").read_text() + (out / "hf_stable_merge.yaml").read_text()
    assert card.data.base_model_relation == "merge" and card.data.tags == ["hf_stable", "merge", "linear"]
    assert "norm ratio ρ, min" in card.text and "effective-rank ratio, min" in card.text
    printed = capsys.readouterr().out
    assert "Lowest norm ratios" in printed and "Per layer" in printed


def test_fw_merging_recipe_with_probe_data(workspace, tmp_path):
    """A data-driven recipe runs through the same command; only the data-based diagnostics apply to it."""
    root, _, probe = workspace
    recipe = tmp_path / "fw.yaml"
    recipe.write_text(
        f"merge_method: fw_merging\nbase_model: {root / 'expert-a'}\npool:\n  - model: {root / 'expert-b'}\n"
        f"objective: {{kind: proxy_ce, data: {probe}}}\nparameters: {{iters: 1}}\n"
    )
    out = tmp_path / "merged"
    assert main([str(recipe), str(out), "--probe-data", str(probe), "--probe-tokens", "20", "--no-progress"]) == 0
    report = json.loads((out / "merge_diagnostics.json").read_text())
    assert "weights" not in report and report["activations"]["summary"]["n_tokens"] == 20
    assert ModelCard.load(out / "README.md").data.tags == ["hf_stable", "merge", "fw_merging"]


def test_push_to_hub_uploads_the_folder_without_the_token(workspace, tmp_path, monkeypatch):
    _, recipe, _ = workspace
    token = "hf_" + "Qw3" * 12
    monkeypatch.setenv("HF_TOKEN", token)
    calls = []

    def create_repo(self, repo_id, **kwargs):
        calls.append(("create_repo", repo_id, kwargs))
        return type("Url", (), {"repo_id": repo_id})()

    def upload_folder(self, **kwargs):
        calls.append(("upload_folder", kwargs["repo_id"], kwargs))

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    out = tmp_path / "merged"
    assert main([str(recipe), str(out), "--push-to-hub", "me/soup", "--private", "--no-progress"]) == 0
    assert [c[0] for c in calls] == ["create_repo", "upload_folder"]
    assert calls[0][2]["private"] is True and calls[0][2]["exist_ok"] is True
    patterns = set(calls[1][2]["allow_patterns"])
    assert {"README.md", "model.safetensors", "config.json", "hf_stable_merge.yaml", "tokenizer.json"} <= patterns
    assert calls[1][2]["folder_path"] == str(out)
    assert 'from_pretrained("me/soup")' in (out / "README.md").read_text()
    for name in os.listdir(out):
        assert token.encode() not in (out / name).read_bytes()


def test_errors_are_reported_before_merging(workspace, tmp_path, monkeypatch, capsys):
    _, recipe, _ = workspace
    out = tmp_path / "merged"
    assert main([str(tmp_path / "missing.yaml"), str(out)]) == 1
    assert "recipe" in capsys.readouterr().err and not out.exists()

    bad = tmp_path / "bad.yaml"
    bad.write_text(recipe.read_text().replace("merge_method: linear", "merge_method: tiess"))
    assert main([str(bad), str(out)]) == 1
    err = capsys.readouterr().err
    assert "hf-stable merge: error:" in err and "tiess" in err and "ties" in err

    bad_probe = tmp_path / "probe.jsonl"
    bad_probe.write_text('{"label": 1}\n')
    assert main([str(recipe), str(out), "--probe-data", str(bad_probe)]) == 1
    assert "probe.jsonl:1: a row needs" in capsys.readouterr().err and not out.exists()

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # no saved login either
    assert main([str(recipe), str(out), "--push-to-hub", "me/soup"]) == 1
    assert "needs a Hub token" in capsys.readouterr().err and not out.exists()

    with pytest.raises(SystemExit):
        main([str(recipe), str(out), "--private"])
    assert "--private needs --push-to-hub" in capsys.readouterr().err

    out.mkdir()
    assert main([str(recipe), str(out), "--no-progress"]) == 1
    assert "--overwrite" in capsys.readouterr().err
    assert main([str(recipe), str(out), "--no-progress", "--overwrite"]) == 0
    assert (out / "README.md").is_file()


@pytest.mark.parametrize(
    "path",
    sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "..", "examples", "configs", "merge_*.yaml"))),
)
def test_example_merge_recipes_validate(path):
    from hf_stable.merging.config import MergeConfig

    config = MergeConfig.from_yaml(path)
    config.validate()
    assert len(config.models) >= 2


# ------------------------------------------------------------------------------------- push path and CLI edges


def test_python_api_writes_the_card_inside_the_output(workspace, tmp_path):
    """`merge(config, out)` alone leaves a complete folder: weights, recipe and README.md (written in OUT.tmp)."""
    from hf_stable.merging import merge

    _, recipe, _ = workspace
    merge(recipe, tmp_path / "api", progress=False)
    card = ModelCard.load(tmp_path / "api" / "README.md")
    assert card.data.base_model_relation == "merge" and card.data.tags == ["hf_stable", "merge", "linear"]
    assert not (tmp_path / "api.tmp").exists()


@pytest.mark.parametrize("where", ["weights", "card"])
def test_disk_full_is_one_line_and_nothing_is_published(workspace, tmp_path, monkeypatch, capsys, where):
    import errno

    import hf_stable.merging.engine as engine
    import hf_stable.merging.io.writer as writer

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    if where == "weights":
        monkeypatch.setattr(writer, "_pwrite_all", full)
    else:
        monkeypatch.setattr(engine, "write_merge_card", full)
    _, recipe, _ = workspace
    out = tmp_path / "merged"
    assert main([str(recipe), str(out), "--no-progress"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "No space left on device" in err[0] and "nothing was published" in err[0]
    assert not out.exists() and not (tmp_path / "merged.tmp").exists()


def test_sigint_exits_130_and_removes_the_temporary_folder(workspace, tmp_path):
    import signal
    import subprocess
    import sys
    import time

    _, recipe, _ = workspace
    out = tmp_path / "merged"
    env = {**os.environ, "HF_STABLE_MERGE_TEST_SLEEP": "0.3", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "hf_stable.scripts.merge", str(recipe), str(out), "--no-progress"]
    # a child inherits an ignored SIGINT (a shell's background job ignores it) and Python then installs no
    # KeyboardInterrupt handler: give the merge the default disposition a user's terminal gives it
    restore = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)  # noqa: E731
    proc = subprocess.Popen(
        [*cmd, "--memory-budget", "4KB"], env=env, stderr=subprocess.PIPE, text=True, preexec_fn=restore
    )
    try:
        deadline = time.time() + 60
        while not (tmp_path / "merged.tmp" / "model.safetensors").exists() and time.time() < deadline:
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.05)
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130
    lines = [line for line in err.strip().splitlines() if "gemm_4bit" not in line]
    assert len(lines) == 1 and "interrupted" in lines[0]
    assert not out.exists() and not (tmp_path / "merged.tmp").exists()


def test_mistyped_relative_path_names_the_model_and_the_hub_error(workspace, tmp_path, monkeypatch, capsys):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # no network in tests
    root, _, _ = workspace
    bad = tmp_path / "typo.yaml"
    bad.write_text(f"merge_method: linear\nmodels:\n  - model: typo/expert-a\n  - model: {root / 'expert-b'}\n")
    assert main([str(bad), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "no such local folder 'typo/expert-a'" in err and "Hub lookup failed" in err
    assert "LocalEntryNotFoundError" in err


def test_overwrite_refuses_to_delete_a_file(workspace, tmp_path, capsys):
    _, recipe, _ = workspace
    out = tmp_path / "notes.txt"
    out.write_text("precious")
    assert main([str(recipe), str(out), "--overwrite", "--no-progress"]) == 1
    assert "not a folder" in capsys.readouterr().err and out.read_text() == "precious"


def test_slerp_extrapolation_needs_the_explicit_flag(workspace, tmp_path, capsys):
    root, _, _ = workspace
    recipe = tmp_path / "slerp.yaml"
    recipe.write_text(
        f"merge_method: slerp\nbase_model: {root / 'expert-a'}\nmodels:\n  - model: {root / 'expert-b'}\n"
        "parameters: {t: 1.7}\n"
    )
    assert main([str(recipe), str(tmp_path / "out"), "--no-progress"]) == 1
    assert "allow_extrapolation" in capsys.readouterr().err and not (tmp_path / "out").exists()
    recipe.write_text(recipe.read_text().replace("{t: 1.7}", "{t: 1.7, allow_extrapolation: true}"))
    assert main([str(recipe), str(tmp_path / "out"), "--no-progress"]) == 0
