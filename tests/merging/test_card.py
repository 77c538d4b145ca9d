"""The merged model's README.md: front matter round-trips through `huggingface_hub.ModelCard` offline."""

import re
from types import SimpleNamespace

import pytest
import yaml
from huggingface_hub import ModelCard

from hf_stable.merging.card import mask_tokens, merge_model_card, parent_name, write_merge_card
from hf_stable.merging.config import MergeConfig


def _config(tmp_path, **extra):
    local = tmp_path / "runs" / "expert-b"
    local.mkdir(parents=True)
    recipe = {
        "merge_method": "ties",
        "base_model": "org/base",
        "models": [
            {"model": "org/expert-a@0123abc", "parameters": {"weight": 0.7, "density": 0.5}},
            {"model": str(local), "parameters": {"weight": [0.1, 0.3], "density": 0.5}},
        ],
        "parameters": {"lambda": 1.0},
        "out_dtype": "bfloat16",
        **extra,
    }
    return MergeConfig.from_dict(recipe), local


def _yaml_block(body: str) -> dict:
    block = re.search(r"```yaml\n(.*?)\n```", body, re.S)
    assert block, body
    return yaml.safe_load(block.group(1))


def test_card_front_matter_round_trips(tmp_path):
    config, _ = _config(tmp_path)
    summary = {
        "n_tensors": 12,
        "norm_ratio_min": 0.61234,
        "norm_ratio_min_tensor": "model.layers.0.mlp.up_proj.weight",
        "norm_ratio_median": 0.83,
        "var_ratio_min": 0.5,
        "kl_mean": 0.0123,
        "erank_ratio_min": None,  # absent values are left out
        "pairwise_angle_histogram": {"75-90": 3, "90-105": 1},
    }
    result = SimpleNamespace(output_dir=str(tmp_path / "merged-model"))
    text = merge_model_card(config, result, summary)

    card = ModelCard(text)  # parses the YAML front matter; no network (validate() is not called)
    data = card.data.to_dict()
    assert data["base_model"] == ["org/base", "org/expert-a"]  # Hub ids only, without revision; no local parent
    assert data["base_model_relation"] == "merge"
    assert data["library_name"] == "transformers"
    assert data["tags"] == ["hf_stable", "merge", "ties"]
    assert data["model_name"] == "merged-model"
    # Rendering the parsed card again gives the same metadata.
    assert ModelCard(str(card)).data.to_dict() == data

    # No local path anywhere (metadata, body, embedded recipe): local inputs are named by their folder.
    assert str(tmp_path) not in text and "`expert-b` | per tensor" in text
    assert _yaml_block(card.text)["models"][1]["model"] == "expert-b"
    assert _yaml_block(card.text)["merge_method"] == "ties"
    assert _yaml_block(card.text)["models"][0] == config.to_dict()["models"][0]
    assert "`org/expert-a@0123abc` | 0.7" in card.text
    assert "per tensor" in card.text  # the gradient weight of expert-b
    assert "Base model: `org/base`" in card.text
    assert "norm ratio ρ, min | 0.6123" in card.text and "`model.layers.0.mlp.up_proj.weight`" in card.text
    assert "KL(expert ‖ merged), mean over experts | 0.0123" in card.text
    assert "histogram (° bin: count) | 75-90: 3 · 90-105: 1" in card.text
    assert "effective-rank ratio, min |" not in card.text
    assert "2306.01708" in card.text  # the TIES paper
    assert 'from_pretrained("merged-model")' in card.text


def test_card_without_diagnostics_and_with_hub_id(tmp_path):
    config = MergeConfig.from_dict({"merge_method": "linear", "models": ["org/a", "org/b"]})
    text = merge_model_card(config, None, None, hub_model_id="me/soup", base_models=["org/a-hub", "org/b-hub"])
    card = ModelCard(text)
    assert card.data.base_model == ["org/a-hub", "org/b-hub"]
    assert card.data.model_name == "soup"
    assert "## Diagnostics" not in card.text
    assert 'from_pretrained("me/soup")' in card.text
    assert "`org/a` | default" in card.text
    path = write_merge_card(tmp_path, text)
    assert open(path, encoding="utf-8").read() == text
    assert not (tmp_path / "README.md.tmp").exists()


def test_no_token_in_card(tmp_path, monkeypatch):
    token = "hf_" + "AbCdEf0123" * 4
    monkeypatch.setenv("HF_TOKEN", token)
    # Even a recipe carrying the token (here in its free-form `name`) cannot leak it.
    config, _ = _config(tmp_path, name=f"merge by {token}")
    text = merge_model_card(config, None, {"norm_ratio_min": 0.9})
    assert token not in text and "merge by hf_***" in text
    assert mask_tokens(f"x {token} y") == "x hf_*** y"
    assert mask_tokens("secret-value here", ("secret-value",)) == "*** here"


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        ("org/name", "org/name"),
        ("org/name@v1.0", "org/name"),
        ("gpt2", "gpt2"),
        ("/abs/path/to/expert-a/", "expert-a"),
        ("./runs/expert-b", "expert-b"),
        ("~/ckpt/c", "c"),
        ("a/b/c", "c"),
    ],
)
def test_parent_name(model, expected):
    assert parent_name(model) == expected


def test_card_of_a_data_driven_recipe_dict():
    recipe = {
        "merge_method": "fw_merging",
        "base_model": "org/base",
        "pool": [{"model": "org/a"}, "org/b"],
        "objective": {"kind": "kl_to_experts"},
        "parameters": {"iters": 3},
    }
    card = ModelCard(merge_model_card(recipe, {"output_dir": "/tmp/fw-out"}, None))
    assert card.data.base_model == ["org/base", "org/a", "org/b"]
    assert card.data.tags == ["hf_stable", "merge", "fw_merging"] and card.data.model_name == "fw-out"
    assert _yaml_block(card.text)["objective"] == {"kind": "kl_to_experts"}


def test_card_names_fp32_arithmetic(tmp_path):
    """`fp32_arithmetic: true` is named in the card's method section and kept in its recipe; the default is not."""
    plain, _ = _config(tmp_path / "a", dtype="bfloat16")
    upcast, _ = _config(tmp_path / "b", dtype="bfloat16", fp32_arithmetic=True)
    plain_text, upcast_text = merge_model_card(plain), merge_model_card(upcast)
    assert "fp32_arithmetic" not in plain_text
    assert "Arithmetic: float32 (`fp32_arithmetic: true`)" in upcast_text
    assert _yaml_block(ModelCard(upcast_text).text)["fp32_arithmetic"] is True
    with pytest.raises(ValueError, match="fp32_arithmetic"):
        MergeConfig.from_dict({"merge_method": "linear", "models": ["org/a"], "fp32_arithmetic": "yes"})
