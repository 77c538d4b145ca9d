"""The streaming merge engine against the in-memory reference, across budgets, and its failure semantics.

Oracles: `hf_stable.merging.reference.merge_state_dicts` (whole tensors resident, written by the methods helper),
`safetensors`/`transformers` loaders, and hand computations for the diagnostics statistics.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from merge_helpers import load_folder_state_dict, make_pico_model
from safetensors.torch import save_file

from hf_stable.merging import MergeConfig, merge
from hf_stable.merging.reference import merge_state_dicts


WEIGHTS = [0.5, 1.0, 2.0]
BIG = "1GB"
TINY = 20_000  # forces several chunks on every matrix, and small fp64 Gram blocks

CASES = [
    ("linear", {}),
    ("task_arithmetic", {"lambda": 0.7}),
    ("ties", {"density": 0.5}),
    ("dare_linear", {"density": 0.6}),
    ("dare_ties", {"density": 0.5}),
    ("fisher_rao", {}),
    ("fisher_rao", {"space": "task_vector", "solver": "karcher"}),
    ("karcher", {}),
    ("nre", {}),
    ("nre_unit", {}),
    ("wsm", {"schedule": "linear"}),
]


@pytest.fixture(scope="module")
def sds(pico_models):
    return {
        "base": load_folder_state_dict(pico_models["base"]),
        "experts": [load_folder_state_dict(p) for p in pico_models["experts"]],
    }


def _weights(method):
    return None if method == "wsm" else WEIGHTS  # the schedule sets WSM's coefficients: weights are refused


def _config(pico_models, method, params, **fields):
    return MergeConfig.build(
        method,
        pico_models["experts"],
        weights=_weights(method),
        base_model=pico_models["base"],
        parameters=params,
        **fields,
    )


def _max_err(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


@pytest.mark.parametrize(("method", "params"), CASES, ids=[f"{m}-{i}" for i, (m, _) in enumerate(CASES)])
def test_engine_matches_reference_and_is_tiling_invariant(pico_models, sds, tmp_path, method, params):
    cfg = _config(pico_models, method, params, seed=3)
    big = merge(cfg, tmp_path / "big", memory_budget=BIG, progress=False)
    tiny = merge(cfg, tmp_path / "tiny", memory_budget=TINY, progress=False)
    got_big, got_tiny = load_folder_state_dict(tmp_path / "big"), load_folder_state_dict(tmp_path / "tiny")

    uses_base = big.plan.tensors[0].space == "task_vector"
    experts, weights = sds["experts"], _weights(method)
    if method == "karcher":  # mergekit's karcher: the base is one more input, and every input has weight 1/N
        experts, weights = [sds["base"], *experts], None
    ref = merge_state_dicts(
        method,
        experts,
        base=sds["base"] if uses_base else None,
        weights=weights,
        params=params,
        seed=3,
    )
    assert _max_err(got_big, ref) <= 1e-6
    # The large matrices are cut into chunks under the tiny budget; methods needing the Gram or thresholds read twice.
    assert all(len(t.chunks) > 1 for t in tiny.plan.tensors if t.numel >= 512)
    if any(t.needs_gram for t in tiny.plan.tensors):
        assert tiny.plan.n_two_pass > 0
    if method == "ties":
        assert all(t.passes[:2] == ("kth_high", "kth_low") for t in tiny.plan.tensors)
    exact = big.plan.tensors[0].kind == "elementwise" or not any(t.needs_gram for t in big.plan.tensors)
    err = _max_err(got_big, got_tiny)
    assert err == 0.0 if exact else err <= 1e-6
    assert tiny.peak_tracked_bytes <= TINY
    assert 0 < big.peak_tracked_bytes <= 256 * 2**20  # the buffers do not grow with the budget
    assert tiny.bytes_written == big.bytes_written == sum(v.numel() * 4 for v in ref.values())


def test_weights_change_the_output(pico_models, tmp_path):
    a = merge(_config(pico_models, "fisher_rao", {}), tmp_path / "a", progress=False)
    cfg = MergeConfig.build("fisher_rao", pico_models["experts"], weights=[2.0, 1.0, 0.5])
    b = merge(cfg, tmp_path / "b", progress=False)
    assert _max_err(load_folder_state_dict(a.output_dir), load_folder_state_dict(b.output_dir)) > 1e-3


def test_slerp_two_endpoints_base_first(pico_models, sds, tmp_path):
    cfg = MergeConfig.from_dict(
        {
            "merge_method": "slerp",
            "base_model": pico_models["base"],
            "models": [{"model": pico_models["base"]}, {"model": pico_models["experts"][2]}],
            "parameters": {"t": 0.3},
        }
    )
    res = merge(cfg, tmp_path / "out", memory_budget=TINY, progress=False)
    ref = merge_state_dicts("slerp", [sds["base"], sds["experts"][2]], params={"t": 0.3})
    assert res.plan.inputs[0] == pico_models["base"]
    assert _max_err(load_folder_state_dict(tmp_path / "out"), ref) <= 1e-6


def test_gradient_and_filtered_parameters_per_tensor(pico_models, sds, tmp_path):
    """mergekit semantics: a weight gradient over layers and a filtered density, checked tensor by tensor."""
    from hf_stable.merging.reference import merge_tensors

    cfg = MergeConfig.from_dict(
        {
            "merge_method": "ties",
            "base_model": pico_models["base"],
            "models": [
                {"model": pico_models["experts"][0], "parameters": {"weight": [1.0, 3.0]}},
                {"model": pico_models["experts"][1], "parameters": {"weight": 1.0}},
            ],
            "parameters": {"density": [{"filter": "mlp", "value": 0.3}, {"value": 0.8}]},
        }
    )
    merge(cfg, tmp_path / "out", memory_budget=TINY, progress=False)
    got = load_folder_state_dict(tmp_path / "out")
    cases = {
        "model.layers.0.mlp.up_proj.weight": (1.0, 0.3),  # layer 0 → t = 0
        "model.layers.1.self_attn.q_proj.weight": (3.0, 0.8),  # layer 1 of 2 → t = 1
        "model.embed_tokens.weight": (1.0, 0.8),  # outside the layers → t = 0 (mergekit 0.1.5)
        "lm_head.weight": (1.0, 0.8),  # outside the layers, after them too → t = 0
    }
    for name, (w0, density) in cases.items():
        ref = merge_tensors(
            "ties",
            [sds["experts"][0][name], sds["experts"][1][name]],
            base=sds["base"][name],
            weights=[w0, 1.0],
            params={"density": density},
            tensor_name=name,
        )
        torch.testing.assert_close(got[name], ref, atol=1e-6, rtol=0)


def test_filter_exclude_merges_linearly(pico_models, sds, tmp_path):
    cfg = _config(pico_models, "ties", {"density": 0.3}, filter_exclude=["*norm*"])
    res = merge(cfg, tmp_path / "out", progress=False)
    got = load_folder_state_dict(tmp_path / "out")
    linear = merge_state_dicts("linear", sds["experts"], weights=WEIGHTS)
    actions = {t.name: t.action for t in res.plan.tensors}
    for name in got:
        if "norm" in name:
            assert actions[name] == "linear"
            torch.testing.assert_close(got[name], linear[name], atol=1e-6, rtol=0)
        else:
            assert actions[name] == "merge"


def test_output_loads_sharded_with_transformers(pico_models, tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = _config(pico_models, "fisher_rao", {}, max_shard_size=4096, out_dtype="bfloat16")
    res = merge(cfg, tmp_path / "out", progress=False)
    out = Path(res.output_dir)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    total = 0
    for shard in shards:
        with safe_open(out / shard, framework="pt") as f:
            for k in f.keys():
                assert index["weight_map"][k] == shard
                t = f.get_tensor(k)
                assert t.dtype == torch.bfloat16
                total += t.numel() * 2
    assert index["metadata"]["total_size"] == total
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok("2+2=", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()
    recipe = MergeConfig.from_yaml(out / "hf_stable_merge.yaml")  # local inputs by folder name: no local path
    assert recipe.merge_method == "fisher_rao" and [m.model for m in recipe.models] == [
        "expert0",
        "expert1",
        "expert2",
    ]
    assert str(Path(pico_models["root"]).parent) not in (out / "hf_stable_merge.yaml").read_text()
    assert not (tmp_path / "out.tmp").exists()


def test_bf16_inputs_keep_dtype_and_diagnostics(pico_bf16_models, tmp_path):
    cfg = MergeConfig.build("linear", pico_bf16_models["experts"], weights=[1.0, 3.0])
    res = merge(cfg, tmp_path / "out", diagnose=True, progress=False, memory_budget=20_000)
    got = load_folder_state_dict(tmp_path / "out")
    xs = [load_folder_state_dict(p) for p in pico_bf16_models["experts"]]
    name = "model.layers.1.mlp.down_proj.weight"
    assert got[name].dtype == torch.bfloat16
    expected = (xs[0][name].float() * 0.25 + xs[1][name].float() * 0.75).to(torch.bfloat16)
    torch.testing.assert_close(got[name], expected, atol=0, rtol=0)
    st = res.per_tensor_stats[name]
    x = torch.stack([xs[0][name].double().flatten(), xs[1][name].double().flatten()])
    # bf16 inputs and no `dtype`: the arithmetic is bf16's (as mergekit's), so the statistics see the rounded output
    out32 = got[name].float().flatten()
    torch.testing.assert_close(st["gram"], x @ x.T, rtol=1e-12, atol=0)
    torch.testing.assert_close(st["cross"], x @ out32.double(), rtol=1e-6, atol=0)
    assert st["out_sq"] == pytest.approx(float(out32.double() @ out32.double()), rel=1e-6)
    assert set(res.per_tensor_stats) == set(got)

    from hf_stable.merging.diagnostics import weight_diagnostics

    diag = weight_diagnostics(res.per_tensor_stats, [1.0, 3.0])
    assert diag  # consumable by the diagnostics helper


def test_dry_run_writes_nothing(pico_models, tmp_path):
    res = merge(_config(pico_models, "ties", {"density": 0.5}), tmp_path / "out", dry_run=True, memory_budget=TINY)
    assert res.output_dir is None and not (tmp_path / "out").exists() and not (tmp_path / "out.tmp").exists()
    plan = res.plan
    assert len(plan.tensors) == 21 and plan.n_tiles > 21 and plan.bytes_to_read > plan.bytes_to_write > 0
    text = plan.summary()
    assert "chunks" in text and "model.embed_tokens.weight" in text
    assert plan.to_dict()["n_tensors"] == 21


def test_overwrite_semantics(pico_models, tmp_path):
    cfg = _config(pico_models, "linear", {})
    out = tmp_path / "out"
    merge(cfg, out, progress=False)
    (out / "marker").write_text("old")
    with pytest.raises(FileExistsError, match="overwrite"):
        merge(cfg, out, progress=False)
    assert (out / "marker").exists()
    (tmp_path / "out.tmp").mkdir()  # stale leftovers of a killed run
    (tmp_path / "out.tmp" / "junk").write_text("x")
    merge(cfg, out, progress=False, overwrite=True)
    assert not (out / "marker").exists() and (out / "model.safetensors").exists()
    assert not (tmp_path / "out.tmp").exists() and not (tmp_path / "out.old").exists()
    with pytest.raises(ValueError, match="one of the input models"):
        merge(MergeConfig.build("linear", [out, pico_models["base"]]), out, progress=False, overwrite=True)
    assert (out / "model.safetensors").exists()


def test_progress_bar_and_tokenizer_source(pico_models, tmp_path, capsys):
    cfg = _config(pico_models, "ties", {"density": 0.5}, tokenizer_source=pico_models["experts"][1])
    merge(cfg, tmp_path / "a", progress=True, memory_budget=TINY)
    err = capsys.readouterr().err
    assert "merge" in err
    # throughput as a fraction of the read bandwidth measured by the I/O thread
    assert re.search(r"\d+\.\d\d GB/s = \d+% of the read bandwidth", err), err[-500:]
    merge(cfg, tmp_path / "b", progress=False)
    assert _max_err(load_folder_state_dict(tmp_path / "a"), load_folder_state_dict(tmp_path / "b")) == 0.0
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (
        Path(pico_models["experts"][1]) / "tokenizer.json"
    ).read_bytes()


# ------------------------------------------------------------------------------------------------------- errors


def _write_raw_model(path: Path, tensors: dict[str, torch.Tensor]) -> str:
    path.mkdir(parents=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps({"num_hidden_layers": 1}))
    return str(path)


def _raw(seed: int, **overrides) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    t = {
        "model.layers.0.w": torch.randn(6, 4, generator=g),
        "model.layers.0.b": torch.randn(4, generator=g),
        "model.pos_ids": torch.arange(5, dtype=torch.int64),
        "model.scale": torch.tensor(float(seed + 1)),  # 0-d
        "model.empty": torch.zeros(0, 4),
    }
    t.update(overrides)
    return {k: v for k, v in t.items() if v is not None}


def test_nonfloat_tensors_are_copied(tmp_path):
    a = _write_raw_model(tmp_path / "a", _raw(0))
    b = _write_raw_model(tmp_path / "b", _raw(1))
    res = merge(MergeConfig.build("linear", [a, b]), tmp_path / "out", progress=False)
    got = load_folder_state_dict(tmp_path / "out")
    assert torch.equal(got["model.pos_ids"], torch.arange(5))
    assert got["model.scale"].shape == () and got["model.scale"].item() == 1.5
    assert got["model.empty"].shape == (0, 4)
    assert {t.name: t.action for t in res.plan.tensors}["model.pos_ids"] == "copy"
    c = _write_raw_model(tmp_path / "c", _raw(2, **{"model.pos_ids": torch.arange(1, 6)}))
    with pytest.raises(ValueError, match="pos_ids"):
        merge(MergeConfig.build("linear", [a, c]), tmp_path / "bad", progress=False)
    assert not (tmp_path / "bad").exists() and not (tmp_path / "bad.tmp").exists()


@pytest.mark.parametrize(
    ("other", "match"),
    [
        ({"model.layers.0.w": torch.zeros(6, 5)}, "shape"),
        ({"model.layers.0.b": None}, "lacks"),
    ],
    ids=["shape", "missing"],
)
def test_incompatible_models_raise_before_output(tmp_path, other, match):
    a = _write_raw_model(tmp_path / "a", _raw(0))
    b = _write_raw_model(tmp_path / "b", _raw(1, **other))
    with pytest.raises(ValueError, match=match):
        merge(MergeConfig.build("linear", [a, b]), tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp").exists()


def test_recipe_errors_raise_before_output(pico_models, tmp_path):
    ex, base = pico_models["experts"], pico_models["base"]
    with pytest.raises(ValueError, match="Valid names"):
        merge({"merge_method": "not_a_method", "models": ex}, tmp_path / "o", progress=False)
    with pytest.raises(ValueError, match="weights has 2 entries"):
        merge({"merge_method": "linear", "models": ex, "weights": [1, 2]}, tmp_path / "o", progress=False)
    with pytest.raises(ValueError, match="base_model"):
        merge({"merge_method": "ties", "models": ex}, tmp_path / "o", progress=False)
    with pytest.raises(ValueError, match="density"):
        merge(
            {"merge_method": "ties", "models": ex, "base_model": base, "parameters": {"density": 2}},
            tmp_path / "o",
            progress=False,
        )
    with pytest.raises(ValueError, match="too small"):
        merge(MergeConfig.build("linear", ex), tmp_path / "o", memory_budget=1000, progress=False)
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.tmp").exists()


def test_pickle_inputs_refused_unless_allowed(tmp_path):
    a = _write_raw_model(tmp_path / "a", _raw(0))
    pk = tmp_path / "pk"
    pk.mkdir()
    torch.save(_raw(1), pk / "pytorch_model.bin")
    cfg = MergeConfig.build("linear", [a, str(pk)])
    with pytest.raises(ValueError, match="--allow-pickle"):
        merge(cfg, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    merge(cfg, tmp_path / "out", progress=False, allow_pickle=True)
    got = load_folder_state_dict(tmp_path / "out")
    torch.testing.assert_close(
        got["model.layers.0.w"], (_raw(0)["model.layers.0.w"] + _raw(1)["model.layers.0.w"]) / 2
    )


def test_non_finite_input_names_model_and_tensor(tmp_path):
    a = _write_raw_model(tmp_path / "a", _raw(0))
    bad = _raw(1)
    bad["model.layers.0.w"][4, 2] = float("nan")
    b = _write_raw_model(tmp_path / "b", bad)
    out = tmp_path / "out"
    for budget in (BIG, 400):  # whole tensor, and row tiles (the NaN is in a later tile)
        with pytest.raises(ValueError, match=r"b'?: tensor 'model\.layers\.0\.w' has 1 non-finite"):
            merge(MergeConfig.build("linear", [a, b]), out, memory_budget=budget, progress=False)
        assert not out.exists() and not (tmp_path / "out.tmp").exists()
    inf = _raw(1)
    inf["model.layers.0.b"][0] = float("-inf")
    c = _write_raw_model(tmp_path / "c", inf)
    with pytest.raises(ValueError, match=r"c'?: tensor 'model\.layers\.0\.b' has 1 non-finite"):
        merge(MergeConfig.build("linear", [a, c]), out, progress=False)
    # an existing output is left untouched by a failed overwrite
    merge(MergeConfig.build("linear", [a, a]), out, progress=False)
    with pytest.raises(ValueError, match="non-finite"):
        merge(MergeConfig.build("linear", [a, b]), out, progress=False, overwrite=True)
    assert (out / "model.safetensors").exists() and not (tmp_path / "out.tmp").exists()


def test_fw_merging_is_dispatched(tmp_path):
    with pytest.raises(ValueError, match="dry_run"):
        merge({"merge_method": "fw_merging", "models": ["x"]}, tmp_path / "o", dry_run=True, progress=False)
    assert not (tmp_path / "o").exists()


def test_killed_merge_leaves_no_output_and_rerun_succeeds(pico_models, tmp_path):
    out = tmp_path / "out"
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(_config(pico_models, "ties", {"density": 0.5}).to_yaml())
    script = (
        "import sys; from hf_stable.merging import merge; "
        f"merge(sys.argv[1], sys.argv[2], memory_budget={TINY}, progress=False)"
    )
    env = {**os.environ, "HF_STABLE_MERGE_TEST_SLEEP": "0.2", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", script, str(recipe), str(out)], env=env)
    try:
        shard = tmp_path / "out.tmp" / "model.safetensors"
        deadline = time.time() + 60
        while not shard.exists() and time.time() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert shard.exists(), "the merge never started writing"
        time.sleep(0.5)  # a few tiles in
        assert proc.poll() is None, "the merge finished before it could be killed"
        proc.kill()
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not out.exists()
    assert (tmp_path / "out.tmp").exists()  # the half-written temp folder, never the target
    res = merge(recipe, out, memory_budget=TINY, progress=False)
    assert not (tmp_path / "out.tmp").exists()
    assert len(load_folder_state_dict(res.output_dir)) == 21


def test_make_pico_model_fixture_is_reusable(tmp_path, pico_models):
    p = make_pico_model(tmp_path / "m", seed=5, base=pico_models["base"], scale=0.1)
    sd = load_folder_state_dict(p)
    assert "lm_head.weight" in sd and sd["model.embed_tokens.weight"].shape[1] == 16
