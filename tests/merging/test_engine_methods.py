"""The streaming engine on the mergekit methods: equal to the in-memory reference, and the same output whatever the
memory budget (chunking); plus layer-range slices (frankenmerges) and the buffers' bound."""

from __future__ import annotations

import json

import pytest
import torch
from merge_helpers import load_folder_state_dict, make_pico_model

from hf_stable.merging import MergeConfig, merge
from hf_stable.merging.reference import merge_state_dicts


TINY = 20_000

CASES = [
    ("multislerp", {}, 3, [0.5, 1.0, 2.0], True),
    ("nuslerp", {}, 2, [0.3, 0.7], True),
    ("nuslerp", {"nuslerp_flatten": False}, 2, [0.3, 0.7], False),
    ("nuslerp", {"nuslerp_flatten": False, "nuslerp_row_wise": True}, 2, [0.3, 0.7], True),
    ("model_stock", {}, 3, None, True),
    ("model_stock", {"filter_wise": True}, 3, None, True),
    ("della", {"density": 0.5}, 3, [0.5, 1.0, 2.0], True),
    ("della_linear", {"density": 0.4, "epsilon": 0.1}, 3, None, True),
    ("breadcrumbs", {"density": 0.8, "gamma": 0.05}, 3, [0.5, 1.0, 2.0], True),
    ("breadcrumbs_ties", {"density": 0.6, "rescale": True}, 3, None, True),
    ("ties", {"density": 0.5, "rescale": True}, 3, [0.5, 1.0, 2.0], True),
    ("dare_ties", {"density": 0.5}, 3, [0.5, 1.0, 2.0], True),
    ("dare_linear", {"density": 0.5, "rescale_norm": "inverse_density"}, 3, None, True),
    ("arcee_fusion", {}, 1, None, False),
    ("passthrough", {"scale": 0.5}, 1, None, False),
]


@pytest.fixture(scope="module")
def sds(pico_models):
    return {
        "base": load_folder_state_dict(pico_models["base"]),
        "experts": [load_folder_state_dict(p) for p in pico_models["experts"]],
    }


def _max_err(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


@pytest.mark.parametrize(
    ("method", "params", "n", "weights", "base"), CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)]
)
def test_engine_matches_reference_at_any_budget(pico_models, sds, tmp_path, method, params, n, weights, base):
    experts = pico_models["experts"][:n]
    if method == "arcee_fusion":  # the base is the first endpoint
        cfg = MergeConfig.build(method, experts, base_model=pico_models["base"], parameters=params)
        inputs, ref_base = [sds["base"], sds["experts"][0]], None
    else:
        kw = {"base_model": pico_models["base"]} if base else {}
        cfg = MergeConfig.build(method, experts, weights=weights, parameters=params, seed=4, **kw)
        inputs, ref_base = sds["experts"][:n], sds["base"] if base else None
    big = merge(cfg, tmp_path / "big", progress=False)
    tiny = merge(cfg, tmp_path / "tiny", memory_budget=TINY, progress=False)
    got_big, got_tiny = load_folder_state_dict(tmp_path / "big"), load_folder_state_dict(tmp_path / "tiny")
    ref = merge_state_dicts(method, inputs, base=ref_base, weights=weights, params=params, seed=4)
    assert _max_err(got_big, ref) <= 1e-6
    assert any(len(t.chunks) > 1 for t in tiny.plan.tensors)
    gram = any(t.needs_gram for t in big.plan.tensors) or method in ("model_stock", "nuslerp")
    err = _max_err(got_big, got_tiny)
    assert err == 0.0 if not gram else err <= 1e-6
    assert tiny.peak_tracked_bytes <= TINY


def test_frankenmerge_layer_slices(tmp_path):
    """Passthrough over layer-range slices (mergekit's orcamini-platy example): layers renumbered, embeddings from the
    first slice's model, final norm and lm_head from the last one's, config with the new layer count."""
    a = make_pico_model(tmp_path / "a", seed=1, num_hidden_layers=4)
    b = make_pico_model(tmp_path / "b", seed=2, num_hidden_layers=4)
    cfg = MergeConfig.from_dict(
        {
            "merge_method": "passthrough",
            "slices": [
                {"sources": [{"model": a, "layer_range": [0, 3]}]},
                {"sources": [{"model": b, "layer_range": [1, 4]}]},
            ],
            "dtype": "float32",
        }
    )
    res = merge(cfg, tmp_path / "out", progress=False)
    got = load_folder_state_dict(tmp_path / "out")
    sa, sb = load_folder_state_dict(a), load_folder_state_dict(b)
    assert sum(1 for k in got if ".layers." in k) == 6 * sum(1 for k in sa if ".layers.0." in k)
    name = "model.layers.{}.mlp.up_proj.weight"
    for out, (sd, src) in enumerate([(sa, 0), (sa, 1), (sa, 2), (sb, 1), (sb, 2), (sb, 3)]):
        assert torch.equal(got[name.format(out)], sd[name.format(src)])
    assert torch.equal(got["model.embed_tokens.weight"], sa["model.embed_tokens.weight"])
    assert torch.equal(got["lm_head.weight"], sb["lm_head.weight"]) and torch.equal(
        got["model.norm.weight"], sb["model.norm.weight"]
    )
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["num_hidden_layers"] == 6 and res.plan.config_overrides == {"num_hidden_layers": 6}
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert len(model.model.layers) == 6


def test_slices_gradient_restarts_per_slice_and_whole_model_slice_equals_models_form(pico_models, tmp_path):
    """A single slice spanning every layer is the `models:` form; `t` runs over the slice's layers."""
    base, (e0, e1, _) = pico_models["base"], pico_models["experts"]
    params = {"t": [{"filter": "self_attn", "value": [0, 0.5, 0.3, 0.7, 1]}, {"value": 0.5}]}
    sliced = MergeConfig.from_dict(
        {
            "merge_method": "slerp",
            "base_model": e0,
            "slices": [{"sources": [{"model": e0, "layer_range": [0, 2]}, {"model": e1, "layer_range": [0, 2]}]}],
            "parameters": params,
        }
    )
    models = MergeConfig.from_dict(
        {"merge_method": "slerp", "base_model": e0, "models": [{"model": e0}, {"model": e1}], "parameters": params}
    )
    merge(sliced, tmp_path / "s", progress=False)
    merge(models, tmp_path / "m", progress=False)
    assert _max_err(load_folder_state_dict(tmp_path / "s"), load_folder_state_dict(tmp_path / "m")) == 0.0
    del base


def test_buffers_do_not_grow_with_the_budget(pico_models, tmp_path):
    cfg = MergeConfig.build("karcher", pico_models["experts"])
    sizes = [merge(cfg, tmp_path / f"o{b}", memory_budget=b, dry_run=True).plan for b in ("256MB", "2GB", "64GB")]
    assert sizes[0].allocated_bytes == sizes[1].allocated_bytes == sizes[2].allocated_bytes
    assert sizes[0].chunk_elems == sizes[1].chunk_elems
    with pytest.raises(ValueError, match=r"too small for tensor .* at least \d+ bytes"):
        merge(cfg, tmp_path / "x", memory_budget=500, dry_run=True)


@pytest.mark.parametrize(
    ("method", "params", "base"),
    [
        ("karcher", {}, False),
        ("fisher_rao", {"space": "task_vector"}, True),
        ("nre", {}, False),
        ("multislerp", {}, True),
        ("slerp", {"t": 0.3}, True),
        ("ties", {"density": 0.5, "rescale": True}, True),
    ],
)
def test_chunk_and_piece_sizes_do_not_change_a_bit(pico_models, tmp_path, monkeypatch, method, params, base):
    """Bitwise tiling invariance: chunks and combine pieces of 64, 1000 elements or the default give the same bytes;
    the fp64 Gram is summed in fixed blocks whatever the chunking. (`fp32_arithmetic`: the streaming path; by default
    karcher, multislerp and slerp run mergekit's whole-tensor arithmetic on a tensor of one chunk.)"""
    import hf_stable.merging.plan as plan_mod

    experts = pico_models["experts"][:1] if method == "slerp" else pico_models["experts"]
    kw = {"base_model": pico_models["base"]} if base else {}
    cfg = MergeConfig.build(method, experts, parameters=params, fp32_arithmetic=True, **kw)
    outs = []
    for i, size in enumerate((None, 1000, 64)):
        if size is not None:
            monkeypatch.setattr(plan_mod, "MAX_CHUNK_ELEMS", size)
            monkeypatch.setattr(plan_mod, "PIECE_ELEMS", min(size, plan_mod.PIECE_ELEMS))
        res = merge(cfg, tmp_path / f"o{i}", progress=False)
        if size is not None:
            assert res.plan.chunk_elems == size and res.plan.gram_block == plan_mod.GRAM_BLOCK
            assert any(len(t.chunks) > 1 for t in res.plan.tensors)
        outs.append(load_folder_state_dict(tmp_path / f"o{i}"))
    for other in outs[1:]:
        assert all(torch.equal(outs[0][k], other[k]) for k in outs[0])
