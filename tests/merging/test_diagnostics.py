"""Collapse diagnostics (spec merging.md §3.5) against independent numpy / torch computations."""

import io
import json
import math

import numpy as np
import pytest
import torch

from hf_stable.merging.diagnostics import (
    activation_diagnostics,
    activation_variance,
    effective_rank,
    normalized_weights,
    print_table,
    summary,
    to_json,
    weight_diagnostics,
)


def _stats(vectors: np.ndarray, out: np.ndarray) -> dict:
    """What the engine accumulates for one tensor: Gram, cross products, ||out||² (fp64)."""
    return {
        "gram": torch.from_numpy(vectors @ vectors.T),
        "cross": torch.from_numpy(vectors @ out),
        "out_sq": float(out @ out),
    }


def _angle_deg(a, b):
    return math.degrees(math.acos(np.clip(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)), -1, 1)))


@pytest.mark.parametrize("n", [2, 3, 4])
def test_orthogonal_equal_norm_uniform_gives_one_over_sqrt_n(n):
    q, _ = np.linalg.qr(np.random.default_rng(n).normal(size=(16, n)))
    vectors = 3.0 * q.T  # n orthogonal rows of norm 3
    out = vectors.mean(0)
    d = weight_diagnostics({"w": _stats(vectors, out)})
    t = d["per_tensor"]["w"]
    assert t["norm_ratio"] == pytest.approx(1 / math.sqrt(n), rel=1e-12)
    angles = np.array(t["pairwise_angles_deg"])
    assert np.allclose(angles[~np.eye(n, dtype=bool)], 90.0) and np.allclose(np.diag(angles), 0.0)
    # cos ∠(x_i, mean) = (r²/n) / (r · r/√n) = 1/√n
    assert np.allclose(t["angle_to_merge_deg"], math.degrees(math.acos(1 / math.sqrt(n))))
    histogram = d["summary"]["pairwise_angle_histogram"]  # 90° sits on a bin edge: either side, up to rounding
    assert list(histogram.values()) == [n * (n - 1) // 2] and set(histogram) <= {"75-90", "90-105"}


def test_random_weighted_matches_numpy_and_summary():
    rng = np.random.default_rng(0)
    weights = np.array([0.5, 1.5, 2.0])  # unnormalised: α = w / Σ w
    alpha = weights / weights.sum()
    stats, expected = {}, {}
    for k, name in enumerate(["a.weight", "b.weight", "c.bias"]):
        vectors = rng.normal(size=(3, 20)) + (k + 1) * rng.normal(size=20)  # shared component: partial alignment
        out = alpha @ vectors
        stats[name] = _stats(vectors, out)
        expected[name] = np.linalg.norm(out) / (alpha @ np.linalg.norm(vectors, axis=1))
        d = weight_diagnostics({name: stats[name]}, weights)["per_tensor"][name]
        assert d["norm_ratio"] == pytest.approx(expected[name], rel=1e-12)
        for i in range(3):
            assert d["angle_to_merge_deg"][i] == pytest.approx(_angle_deg(vectors[i], out), abs=1e-9)
            for j in range(3):
                if i != j:
                    assert d["pairwise_angles_deg"][i][j] == pytest.approx(
                        _angle_deg(vectors[i], vectors[j]), abs=1e-9
                    )
    full = weight_diagnostics(stats, weights)
    s = full["summary"]
    assert s["n_tensors"] == 3
    assert s["norm_ratio_min"] == pytest.approx(min(expected.values()))
    assert s["norm_ratio_min_tensor"] == min(expected, key=expected.get)
    assert s["norm_ratio_median"] == pytest.approx(np.median(list(expected.values())))
    assert 0 < s["pairwise_angle_median_deg"] <= s["pairwise_angle_max_deg"] < 180
    assert sum(s["pairwise_angle_histogram"].values()) == 3 * 3  # 3 tensors × 3 pairs
    assert summary({"weights": full}) == s


def test_per_tensor_weights_override_and_small_angles_resolved():
    base = np.zeros(8)
    base[0] = 1.0
    theta = 1e-6  # from fp64 Gram entries the relative error is about eps / θ² ≈ 1e-4
    other = np.zeros(8)
    other[0], other[1] = math.cos(theta), math.sin(theta)
    vectors = np.stack([base, other])
    stats = _stats(vectors, vectors[0])
    stats["weights"] = [1.0, 0.0]  # the merge is input 0
    d = weight_diagnostics({"t": stats}, weights=[0.5, 0.5])["per_tensor"]["t"]
    assert d["norm_ratio"] == pytest.approx(1.0)
    assert math.radians(d["pairwise_angles_deg"][0][1]) == pytest.approx(theta, rel=1e-3)
    assert d["angle_to_merge_deg"][0] == pytest.approx(0.0, abs=1e-12)


def test_weights_and_stats_validation():
    with pytest.raises(ValueError, match="3 entries but there are 2"):
        normalized_weights([1, 2, 3], 2)
    assert normalized_weights([1.0, -1.0, 2.0], 3).tolist() == pytest.approx([0.5, -0.5, 1.0])
    assert normalized_weights([-1.0, -3.0], 2).tolist() == pytest.approx([0.25, 0.75])
    with pytest.raises(ValueError, match="diagnose=True"):
        weight_diagnostics({"t": {"gram": torch.eye(2)}})
    zero = weight_diagnostics({"z": _stats(np.zeros((2, 4)), np.zeros(4))})
    assert zero["per_tensor"]["z"]["norm_ratio"] is None and "norm_ratio_min" not in zero["summary"]


def test_effective_rank_of_known_spectrum():
    rng = np.random.default_rng(1)
    m, d = 12, 5
    # Left singular vectors orthogonal to the all-ones vector, so centring leaves the spectrum unchanged.
    q, _ = np.linalg.qr(np.column_stack([np.ones(m), rng.normal(size=(m, d))]))
    u = q[:, 1 : d + 1]
    v, _ = np.linalg.qr(rng.normal(size=(d, d)))
    sigma = np.array([5.0, 3.0, 1.0, 0.5, 0.0])
    h = u @ np.diag(sigma) @ v.T + 7.0  # an offset the centring removes
    p = sigma[sigma > 0] / sigma.sum()
    assert effective_rank(torch.from_numpy(h)) == pytest.approx(math.exp(-(p * np.log(p)).sum()), rel=1e-9)
    flat = u[:, :3] @ np.diag([2.0, 2.0, 2.0]) @ v[:, :3].T
    assert effective_rank(torch.from_numpy(flat)) == pytest.approx(3.0, rel=1e-9)
    assert effective_rank(torch.ones(4, 3)) == 0.0
    assert activation_variance(torch.from_numpy(h)) == pytest.approx(h.var(axis=0).mean(), rel=1e-12)


@pytest.fixture(scope="module")
def pico_models():
    from hf_stable.testing import build_tiny_model

    kwargs = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    a, _ = build_tiny_model(seed=0, num_key_value_heads=1, **kwargs)
    b, _ = build_tiny_model(seed=1, num_key_value_heads=1, **kwargs)
    merged, _ = build_tiny_model(seed=0, num_key_value_heads=1, **kwargs)
    merged.load_state_dict({k: 0.5 * (v + b.state_dict()[k]) for k, v in a.state_dict().items()})
    for model in (a, b, merged):
        model.eval()
    return a, b, merged


def test_activation_diagnostics_matches_independent_computation(pico_models):
    a, b, merged = pico_models
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(7, 60, (3, 6), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 4:] = 0  # padding positions are ignored
    weights = [1.0, 3.0]
    got = activation_diagnostics(merged, [a, b], ids, weights, attention_mask=mask, batch_size=2)

    keep = mask.bool()
    with torch.no_grad():
        outs = [m(input_ids=ids, attention_mask=mask, output_hidden_states=True) for m in (merged, a, b)]
    n_layers = len(outs[0].hidden_states)
    assert [row["layer"] for row in got["per_layer"]] == list(range(n_layers))
    for layer in range(n_layers):
        hs = [o.hidden_states[layer][keep].double().numpy() for o in outs]
        var = [h.var(axis=0).mean() for h in hs]
        eranks = []
        for h in hs:
            s = np.linalg.svd(h - h.mean(0), compute_uv=False)
            p = s / s.sum()
            p = p[p > 0]
            eranks.append(math.exp(-(p * np.log(p)).sum()))
        row = got["per_layer"][layer]
        assert row["var_ratio"] == pytest.approx(var[0] / (0.25 * var[1] + 0.75 * var[2]), rel=1e-5)
        assert row["erank_ratio"] == pytest.approx(eranks[0] / np.mean(eranks[1:]), rel=1e-5)
    log_q = torch.log_softmax(outs[0].logits, -1)[keep]
    for i, o in enumerate(outs[1:]):
        log_p = torch.log_softmax(o.logits, -1)[keep]
        expected = torch.nn.functional.kl_div(log_q, log_p, log_target=True, reduction="batchmean")
        assert got["kl_to_experts"][i] == pytest.approx(float(expected), rel=1e-5)
    entropy = float(-(log_q.exp() * log_q).sum(-1).mean())
    assert got["entropy_merged"] == pytest.approx(entropy, rel=1e-5)
    s = got["summary"]
    assert s["n_tokens"] == int(keep.sum())
    assert s["var_ratio_min"] == pytest.approx(min(r["var_ratio"] for r in got["per_layer"]))
    assert s["kl_mean"] == pytest.approx(np.mean(got["kl_to_experts"]))


def test_activation_diagnostics_of_an_input_against_itself(pico_models, tmp_path):
    a, _, _ = pico_models
    a.save_pretrained(tmp_path / "a")  # inputs may be paths, loaded one at a time
    ids = torch.arange(7, 19).reshape(2, 6)
    got = activation_diagnostics(a, [str(tmp_path / "a")], ids, layers=[0, -1])
    assert [row["layer"] for row in got["per_layer"]] == [0, -1]
    for row in got["per_layer"]:
        assert row["var_ratio"] == pytest.approx(1.0, rel=1e-5) and row["erank_ratio"] == pytest.approx(1.0, rel=1e-5)
    assert got["kl_to_experts"][0] == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ValueError, match="at least 2"):
        activation_diagnostics(a, [a], ids[:1, :1])
    with pytest.raises(ValueError, match=r"\(batch, length\)"):
        activation_diagnostics(a, [a], ids[0])


def test_print_table_and_json(tmp_path):
    vectors = np.eye(3, 6)
    diagnostics = {
        "weights": weight_diagnostics({"model.layers.0.mlp.up_proj.weight": _stats(vectors, vectors.mean(0))}),
        "activations": {
            "per_layer": [{"layer": 0, "var_ratio": 0.5, "erank_ratio": float("nan"), "erank_merged": 2.0}],
            "kl_to_experts": [0.1, 0.2, 0.3],
            "summary": {"var_ratio_min": 0.5, "kl_mean": 0.2},
        },
    }
    buffer = io.StringIO()
    print_table(diagnostics, file=buffer)
    text = buffer.getvalue()
    assert "model.layers.0.mlp.up_proj.weight" in text and "0.5774" in text  # 1/√3
    assert "var_ratio_min" in text and "kl_mean" in text
    path = to_json(diagnostics, tmp_path / "merge_diagnostics.json")
    loaded = json.loads(open(path).read())
    assert loaded["weights"]["summary"]["norm_ratio_min"] == pytest.approx(1 / math.sqrt(3))
    assert loaded["activations"]["per_layer"][0]["erank_ratio"] is None  # NaN → null: strict JSON


def test_probe_texts_and_batch(tmp_path):
    from hf_stable.merging.diagnostics import probe_batch, read_probe_texts
    from hf_stable.testing import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    rows = [
        {"text": "1+1=2"},
        {"prompt": "2+2=", "completion": "4"},
        {"messages": [{"role": "user", "content": "3+3="}, {"role": "assistant", "content": "6"}]},
    ]
    jsonl = tmp_path / "probe.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    texts = read_probe_texts(jsonl, tokenizer)
    assert texts[:2] == ["1+1=2", "2+2=4"]
    assert texts[2] == tokenizer.apply_chat_template(rows[2]["messages"], tokenize=False)
    assert read_probe_texts(jsonl)[2] == "3+3=\n6"  # no tokenizer: contents joined
    txt = tmp_path / "probe.txt"
    txt.write_text("abc\n\ndefgh\n")
    assert read_probe_texts(txt) == ["abc", "defgh"]
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"label": 1}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: a row needs a `text`"):
        read_probe_texts(tmp_path / "bad.jsonl")

    ids, mask = probe_batch(["abc", "defgh", "ij"], tokenizer, max_tokens=7, max_length=4)
    assert ids.shape == (2, 4) and mask.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]  # 3 + 4 tokens = max_tokens
    assert tokenizer.decode(ids[1]) == "defg" and ids[0, 3] == tokenizer.pad_token_id
    with pytest.raises(ValueError, match="at least 2"):
        probe_batch(["a"], tokenizer)
