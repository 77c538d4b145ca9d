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
