"""Merge recipes: mergekit YAML semantics (gradients, conditionals, precedence), hf_stable fields, early errors.

Expected values are worked by hand from mergekit 0.1.5's behaviour (`mergekit/config.py::evaluate_setting`,
`mergekit/plan.py::MergePlanner.plan_slice`: t = layer / (num_layers − 1); `plan_module`: t = 0 outside the layers).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hf_stable.merging.config import MergeConfig, evaluate_setting, layer_index, layer_position


MERGEKIT_TIES = """
models:
  - model: org/base
    # no parameters necessary for base model
  - model: org/expert-a@v1.0
    parameters:
      density: [1, 0.7, 0.1] # density gradient
      weight: 1.0
  - model: org/expert-b
    parameters:
      density: 0.5
      weight: [0, 0.3, 0.7, 1] # weight gradient
merge_method: ties
base_model: org/base
parameters:
  normalize: true
  int8_mask: true
dtype: float16
"""


def test_mergekit_ties_example_parses():
    cfg = MergeConfig.from_yaml(MERGEKIT_TIES)
    assert cfg.merge_method == "ties" and cfg.dtype == "float16"
    assert cfg.base_model.model == "org/base"
    assert cfg.models[1].model == "org/expert-a" and cfg.models[1].revision == "v1.0"
    # the base listed among the models is not an input of a task-vector method
    assert [m.spec for m in cfg.input_models(uses_base=True)] == ["org/expert-a@v1.0", "org/expert-b"]
    assert cfg.input_models(uses_base=False)[0].spec == "org/base"
    cfg.validate()
    inputs = cfg.input_models(uses_base=True)

    def params(name, i, layer):
        t = layer_position(name, layer, 4)
        return {**cfg.global_parameters(None, name, t), **cfg.own_parameters(inputs[i].parameters, name, t)}

    # layer 1 of 4 → t = 1/3: density [1, .7, .1] → scaled 2/3 → 1 − (2/3)(0.3) = 0.8; weight [0, .3, .7, 1] → 0.3
    p0 = params("model.layers.1.mlp.up_proj.weight", 0, 1)
    p1 = params("model.layers.1.mlp.up_proj.weight", 1, 1)
    assert p0["density"] == pytest.approx(0.8) and p0["weight"] == 1.0 and p0["normalize"] is True
    assert p1["density"] == 0.5 and p1["weight"] == pytest.approx(0.3)
    # every tensor outside the layers is at t = 0 (mergekit 0.1.5 plan_module): embeddings, final norm, lm_head
    assert params("model.embed_tokens.weight", 1, None)["weight"] == 0
    assert params("model.norm.weight", 1, None)["weight"] == 0
    assert params("lm_head.weight", 0, None)["density"] == 1


def test_evaluate_setting_gradients_and_conditionals():
    assert evaluate_setting([0.0, 1.0], "x", 0.5) == pytest.approx(0.5)
    assert evaluate_setting([1, 2, 3], "x", 0.25) == pytest.approx(1.5)
    assert evaluate_setting([1, 2, 3], "x", 1.0) == 3
    assert evaluate_setting(["a", "b", "c"], "x", 0.6) == "b"  # stepped: int(0.6 × 2) = 1
    conds = [{"filter": "self_attn", "value": [0, 1]}, {"filter": "mlp", "value": 0.5}]
    assert evaluate_setting(conds, "model.layers.0.self_attn.q_proj.weight", 0.5) == pytest.approx(0.5)
    assert evaluate_setting(conds, "model.layers.0.mlp.up_proj.weight", 0.5) == 0.5
    assert evaluate_setting(conds, "model.norm.weight", 0.5) is None  # falls through
    assert evaluate_setting([{"filter": "*.bias", "value": 2}], "a.bias", 0) == 2  # globs too
    assert evaluate_setting([{"value": 7}], "anything", 0) == 7


def test_conditional_miss_falls_through_to_global():
    cfg = MergeConfig.from_dict(
        {
            "merge_method": "linear",
            "models": [{"model": "a", "parameters": {"weight": [{"filter": "mlp", "value": 3.0}]}}, "b"],
            "parameters": {"weight": 0.5},
        }
    )
    from hf_stable.merging.methods import gather_params

    def weights(name):
        own = [cfg.own_parameters(m.parameters, name, 0.0) for m in cfg.models]
        glob = cfg.global_parameters(None, name, 0.0)
        return gather_params(glob, [{"weight": glob["weight"], **o} for o in own])[0]

    assert weights("model.layers.0.mlp.w") == [3.0, 0.5]
    assert weights("model.layers.0.attn.w") == [0.5, 0.5]  # the conditional misses: the global weight
    assert cfg.own_parameters(cfg.models[0].parameters, "model.layers.0.mlp.w", 0.0) == {"weight": 3.0}
    assert cfg.own_parameters(cfg.models[0].parameters, "model.layers.0.attn.w", 0.0) == {}


def test_layer_helpers():
    assert layer_index("model.layers.12.mlp.up_proj.weight") == 12
    assert layer_index("transformer.h.3.attn.c_attn.weight") == 3
    assert layer_index("model.norm.weight") is None
    assert layer_position("model.layers.1.w", 1, 4) == pytest.approx(1 / 3)
    assert layer_position("model.layers.0.w", 0, 1) == 1.0  # mergekit: t = 1 for a one-layer slice
    assert layer_position("lm_head.weight", None, 4) == 0.0  # mergekit 0.1.5: t = 0 outside the layers
    assert layer_position("model.norm.weight", None, 4) == 0.0
    assert layer_position("model.embed_tokens.weight", None, 4) == 0.0


def test_weights_field_and_round_trip(tmp_path):
    cfg = MergeConfig.from_dict(
        {
            "merge_method": "fisher_rao",
            "models": ["a", "b"],
            "weights": [0.25, 0.75],
            "parameters": {"solver": "nre", "filter_exclude": ["*.bias"]},
            "out_dtype": "bfloat16",
            "seed": 4,
            "memory_budget": "512MiB",
            "name": "my-merge",
        }
    )
    assert cfg.filter_exclude == ["*.bias"] and "filter_exclude" not in cfg.parameters
    assert [m.parameters["weight"] for m in cfg.models] == [0.25, 0.75]
    assert cfg.is_excluded("model.layers.0.mlp.bias") and not cfg.is_excluded("model.layers.0.mlp.weight")
    again = MergeConfig.from_yaml(cfg.to_yaml())
    assert again == cfg
    path = tmp_path / "r.yaml"
    path.write_text(cfg.to_yaml())
    assert MergeConfig.from_yaml(path) == cfg and MergeConfig.from_yaml(str(path)) == cfg
    with pytest.raises(FileNotFoundError, match="no such file"):
        MergeConfig.from_yaml(tmp_path / "missing.yaml")
    with pytest.raises(FileNotFoundError, match="no such file"):
        MergeConfig.from_yaml("missing.yaml")
    with pytest.raises(ValueError, match="YAML mapping"):
        MergeConfig.from_yaml("- a\n- b\n")


@pytest.mark.parametrize(
    ("recipe", "match"),
    [
        ({"merge_method": "linear", "models": ["a", "b"], "weights": [1]}, "weights has 1 entries"),
        (
            {"merge_method": "linear", "models": [{"model": "a", "parameters": {"weight": 1}}], "weights": [1]},
            "one of",
        ),
        ({"merge_method": "linear", "slices": [{"sources": []}], "models": ["a"]}, "exactly one of"),
        ({"merge_method": "linear", "slices": [{"sources": []}]}, "at least one source"),
        ({"merge_method": "linear", "slices": [{"sources": [{"model": "a"}]}]}, "layer_range"),
        ({"merge_method": "linear", "slices": [{"sources": [{"model": "a", "layer_range": [2, 1]}]}]}, "layer_range"),
        (
            {
                "merge_method": "linear",
                "slices": [
                    {"sources": [{"model": "a", "layer_range": [0, 2]}, {"model": "b", "layer_range": [0, 3]}]}
                ],
            },
            "same number of layers",
        ),
        (
            {
                "merge_method": "linear",
                "slices": [{"sources": [{"model": "a", "layer_range": [0, 2]}], "residual_weight": 0.5}],
            },
            "unsupported mergekit feature",
        ),
        ({"merge_method": "linear", "models": ["a"], "read_threads": 2}, "one I/O thread"),
        ({"merge_method": "linear", "models": ["a"], "modules": {"x": {}}}, "unsupported mergekit feature"),
        ({"merge_method": "linear", "models": ["a"], "tokenizer": {"added": ["x"]}}, r"tokenizer: expected \{source"),
        ({"merge_method": "linear", "models": ["a"], "tokenizer": {"tokens": {"x": {"source": {"kind": "mean"}}}}},
         r"tokens\['x'\]\.source: a model, \{kind: zero\}"),
        ({"merge_method": "linear", "models": ["a"],
          "tokenizer": {"tokens": {"x": {"source": {"kind": "model_token", "model": "a"}}}}}, "exactly one of token"),
        ({"merge_method": "linear", "models": ["a"], "tokenizer": {"tokens": {"x": {"force": "yes"}}}},
         r"tokens\['x'\]\.force must be true or false"),
        ({"merge_method": "linear", "models": ["a"], "tokenizer": {"pad_to_multiple_of": 2.5}}, "positive integer"),
        ({"merge_method": "linear", "models": ["a"], "tokenizer": {"source": "base"}, "tokenizer_source": "base"},
         "either tokenizer_source or tokenizer"),
        ({"merge_method": "linear", "models": ["a"], "chat_template": "chatml"}, "unsupported"),
        ({"merge_method": "linear", "models": ["a"], "bogus": 1}, "unknown recipe keys"),
        ({"merge_method": "linear", "models": []}, "at least one input model"),
        ({"models": ["a"]}, "merge_method is required"),
        ({"merge_method": "slerp", "models": ["a", "b", "c"], "parameters": {"t": 0.5}}, "exactly 2"),
        ({"merge_method": "slerp", "models": ["a", "b"], "base_model": "c", "parameters": {"t": 0.5}}, "exactly 2"),
        ({"merge_method": "linear", "models": ["a"], "dtype": "int8"}, "dtype='int8' is not supported"),
        ({"merge_method": "linear", "models": ["a"], "parameters": {"weight": [{"filter": "x"}]}}, "filter, value"),
        ({"merge_method": "linear", "models": [{"model": "a", "extra": 1}]}, "unknown keys"),
        ({"merge_method": "fw_merging", "base_model": "b", "pool": [{"model": "x"}], "tokenizer": {"source": "base"}},
         "not supported with merge_method 'fw_merging'"),  # was a TypeError from the constructor
    ],
)
def test_recipe_errors(recipe, match):
    with pytest.raises(ValueError, match=match):
        MergeConfig.from_dict(recipe)


def test_validate_method_and_base():
    with pytest.raises(ValueError, match=r"Valid names: .*linear"):
        MergeConfig.from_dict({"merge_method": "lineaar", "models": ["a"]}).validate()
    with pytest.raises(ValueError, match="needs base_model"):
        MergeConfig.from_dict({"merge_method": "ties", "models": ["a", "b"]}).validate()
    with pytest.raises(ValueError, match="density"):
        MergeConfig.from_dict(
            {"merge_method": "ties", "models": ["a", "b"], "base_model": "c", "parameters": {"density": 1.5}}
        ).validate()
    method = MergeConfig.from_dict({"merge_method": "karcher", "models": ["a", "b"]}).validate()
    assert method.kind == "gram"


def test_slerp_inputs_put_base_first():
    cfg = MergeConfig.from_dict(
        {"merge_method": "slerp", "models": ["b", "a"], "base_model": "a", "parameters": {"t": 0.5}}
    )
    assert [m.model for m in cfg.input_models()] == ["a", "b"]
    cfg = MergeConfig.from_dict({"merge_method": "slerp", "models": ["x"], "base_model": "a", "parameters": {"t": 0}})
    assert [m.model for m in cfg.input_models()] == ["a", "x"]


def test_local_path_with_at_sign_is_kept(tmp_path):
    d = tmp_path / "model@v2"
    d.mkdir()
    cfg = MergeConfig.from_dict({"merge_method": "linear", "models": [str(d)]})
    assert cfg.models[0].model == str(d) and cfg.models[0].revision is None


def test_data_driven_recipe_keeps_its_own_fields():
    cfg = MergeConfig.from_dict(
        {"merge_method": "fw_merging", "base_model": "b", "pool": [{"model": "x"}], "objective": {"kind": "entropy"}}
    )
    assert cfg.is_data_driven and cfg.extra["objective"] == {"kind": "entropy"}
    assert cfg.to_dict()["pool"] == [{"model": "x"}]


def test_empty_parameters_are_an_empty_mapping():
    """mergekit accepts `parameters:` left empty (YAML null), globally and per model."""
    cfg = MergeConfig.from_yaml(
        "merge_method: linear\nmodels:\n  - model: a\n    parameters:\n  - model: b\nparameters:\n"
    )
    assert cfg.parameters == {} and cfg.models[0].parameters == {}
    cfg.validate()


def test_slices_whole_model_and_frankenmerge_forms():
    whole = MergeConfig.from_dict(
        {
            "merge_method": "slerp",
            "base_model": "a",
            "slices": [{"sources": [{"model": "a", "layer_range": [0, 4]}, {"model": "b", "layer_range": [0, 4]}]}],
            "parameters": {"t": [{"filter": "self_attn", "value": [0, 1]}, {"value": 0.5}]},
        }
    )
    assert [m.model for m in whole.models] == ["a", "b"] and whole.slices[0].n_layers == 4
    whole.validate()
    again = MergeConfig.from_yaml(whole.to_yaml())
    assert again.to_dict() == whole.to_dict()
    franken = MergeConfig.from_dict(
        {
            "merge_method": "passthrough",
            "slices": [
                {"sources": [{"model": "a", "layer_range": [0, 3]}]},
                {"sources": [{"model": "b", "layer_range": [1, 4]}]},
            ],
        }
    )
    assert [m.model for m in franken.models] == ["a", "b"]
    franken.validate()
    with pytest.raises(ValueError, match="exactly 1 input model"):
        MergeConfig.from_dict(
            {
                "merge_method": "passthrough",
                "slices": [
                    {"sources": [{"model": "a", "layer_range": [0, 3]}, {"model": "b", "layer_range": [0, 3]}]}
                ],
            }
        ).validate()


def test_redacted_recipe_names_local_inputs_by_folder(tmp_path):
    local = tmp_path / "runs" / "expert-b"
    local.mkdir(parents=True)
    cfg = MergeConfig.from_dict(
        {"merge_method": "linear", "models": ["org/a@v1", str(local)], "tokenizer_source": str(local)}
    )
    red = cfg.to_dict(redact=True)
    assert [m["model"] for m in red["models"]] == ["org/a@v1", "expert-b"] and red["tokenizer_source"] == "expert-b"
    assert str(tmp_path) not in cfg.to_yaml(redact=True)


def test_import_is_torch_free():
    code = "import sys, hf_stable.merging as m; m.MergeConfig; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_numeric_parameters_written_as_strings_are_numbers(pico_models, tmp_path):
    """YAML reads `tol: 1e-5` as the string "1e-5"; mergekit's pydantic models read it as a number, and so do we: the
    merge equals the one with the float, while a string that is no number is refused naming the parameter."""
    from hf_stable.merging import merge

    recipe = "merge_method: karcher\nmodels: [{a}, {b}]\nparameters: {{tol: {tol}, max_iter: {it}}}\n"
    a, b = pico_models["experts"][:2]
    as_string = MergeConfig.from_yaml(recipe.format(a=a, b=b, tol="1e-5", it='"3"'))
    assert as_string.parameters["tol"] == "1e-5"
    resolved = as_string.method.resolve(as_string.parameters)
    assert resolved == as_string.method.resolve({"tol": 1e-5, "max_iter": 3})
    merge(as_string, tmp_path / "s", progress=False)
    merge(MergeConfig.from_yaml(recipe.format(a=a, b=b, tol=0.00001, it=3)), tmp_path / "f", progress=False)
    assert (tmp_path / "s" / "model.safetensors").read_bytes() == (tmp_path / "f" / "model.safetensors").read_bytes()
    with pytest.raises(ValueError, match="tol"):
        merge(MergeConfig.from_yaml(recipe.format(a=a, b=b, tol="small", it=3)), tmp_path / "x", progress=False)


def test_tokenizer_source_base_without_base_model_and_union(pico_models, tmp_path):
    """mergekit 0.1.5 (`tokenizer/build.py`): `base` without a base_model is the first model's tokenizer; `union`
    over one shared vocabulary is that vocabulary (identity permutations: the plain merge). A token a tokenizer lists
    past its model's `vocab_size` (added without resizing the embeddings) is not in the union: the merge is still the
    plain one (before union vocabularies were implemented, this was refused). Differing vocabularies:
    `test_mergekit_parity.py` (`union-*`)."""
    import shutil

    from transformers import AutoTokenizer

    from hf_stable.merging import merge

    a, b = pico_models["experts"][:2]
    plain = Path(merge(MergeConfig.build("linear", [a, b]), tmp_path / "plain", progress=False).output_dir)
    for source in ("base", "union"):
        out = merge(MergeConfig.build("linear", [a, b], tokenizer_source=source), tmp_path / source, progress=False)
        got = Path(out.output_dir)
        assert (got / "model.safetensors").read_bytes() == (plain / "model.safetensors").read_bytes()
        assert (got / "tokenizer.json").read_bytes() == (Path(a) / "tokenizer.json").read_bytes()
    other = tmp_path / "other-vocab"
    shutil.copytree(b, other)
    tok = AutoTokenizer.from_pretrained(str(other))
    tok.add_tokens(["<extra-token>"])
    tok.save_pretrained(str(other))
    got = Path(merge(MergeConfig.build("linear", [a, str(other)], tokenizer_source="union"), tmp_path / "u2",
                     progress=False).output_dir)  # fmt: skip
    assert (got / "model.safetensors").read_bytes() == (plain / "model.safetensors").read_bytes()
    assert "<extra-token>" not in AutoTokenizer.from_pretrained(str(got)).get_vocab()


def test_tokenizer_block_round_trips_and_is_redacted(tmp_path):
    """The `tokenizer:` block (mergekit 0.1.5 `TokenizerConfig`): no source is `union`; `tokens` and
    `pad_to_multiple_of` survive `to_yaml`/`from_yaml`; local model paths in token sources are redacted."""
    local = tmp_path / "expert-b"
    local.mkdir()
    block = {"pad_to_multiple_of": 64, "tokens": {
        "<|a|>": {"source": str(local), "force": True}, "<|b|>": {"source": {"kind": "zero"}},
        "<|c|>": {"source": {"kind": "model_token", "model": "org/a@v1", "token": "<s>"}},
        "<|d|>": {"source": {"kind": "model_token", "model": str(local), "token_id": 3}}}}  # fmt: skip
    cfg = MergeConfig.from_dict({"merge_method": "linear", "models": ["org/a@v1", str(local)], "tokenizer": block})
    assert cfg.tokenizer_source == "union" and cfg.pad_to_multiple_of == 64
    assert cfg.tokenizer_tokens["<|a|>"].force and cfg.tokenizer_tokens["<|a|>"].model.model == str(local)
    assert cfg.tokenizer_tokens["<|c|>"].model.revision == "v1" and cfg.tokenizer_tokens["<|d|>"].token_id == 3
    assert MergeConfig.from_yaml(cfg.to_yaml()) == cfg
    assert cfg.to_dict()["tokenizer"] == {"source": "union", **block}
    red = cfg.to_dict(redact=True)["tokenizer"]["tokens"]
    assert red["<|a|>"]["source"] == "expert-b" and red["<|d|>"]["source"]["model"] == "expert-b"
    assert str(tmp_path) not in cfg.to_yaml(redact=True)
