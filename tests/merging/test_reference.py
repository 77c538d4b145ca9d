"""In-memory reference merges of tensors and state dicts."""

import pytest
import torch

from hf_stable.merging.reference import merge_state_dicts, merge_tensors


def _state_dicts(n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    base = {
        "embed.weight": torch.randn(10, 8, generator=g),
        "layer.0.weight": torch.randn(8, 8, generator=g).to(torch.bfloat16),
        "layer.0.bias": torch.randn(8, generator=g),
        "position_ids": torch.arange(10),
    }
    models = []
    for _ in range(n):
        sd = {
            k: (v + 0.1 * torch.randn(v.shape, generator=g).to(v.dtype)) if v.is_floating_point() else v.clone()
            for k, v in base.items()
        }
        models.append(sd)
    return base, models


@pytest.mark.parametrize(
    "method,params",
    [
        ("linear", {}),
        ("ties", {"density": 0.5}),
        ("dare_ties", {"density": 0.5}),
        ("fisher_rao", {"space": "task_vector"}),
    ],
)
def test_state_dict_merge_is_tensorwise(method, params):
    base, models = _state_dicts()
    w = [1.0, 2.0, 0.5]
    out = merge_state_dicts(method, models, base=base, weights=w, params=params, seed=5)
    assert list(out) == list(models[0])
    for name, t in out.items():
        assert t.dtype == models[0][name].dtype and t.shape == models[0][name].shape
        if not t.is_floating_point():
            assert torch.equal(t, base[name])
            continue
        expected = merge_tensors(
            method, [m[name] for m in models], base=base[name], weights=w, params=params, tensor_name=name, seed=5
        )
        assert torch.equal(t, expected)


def test_non_float_copied_from_first_without_base():
    _, models = _state_dicts(2)
    models[0]["position_ids"] = torch.arange(10) * 2
    models[1]["position_ids"] = torch.arange(10) * 3
    out = merge_state_dicts("linear", models)
    assert torch.equal(out["position_ids"], models[0]["position_ids"])
    assert torch.allclose(out["embed.weight"], (models[0]["embed.weight"] + models[1]["embed.weight"]) / 2)


def test_dare_seed_and_name_key_the_mask():
    base, models = _state_dicts()
    xs = [m["embed.weight"] for m in models]
    b = base["embed.weight"]
    a1 = merge_tensors("dare_linear", xs, base=b, params={"density": 0.5}, seed=1, tensor_name="a")
    assert torch.equal(a1, merge_tensors("dare_linear", xs, base=b, params={"density": 0.5}, seed=1, tensor_name="a"))
    assert not torch.equal(
        a1, merge_tensors("dare_linear", xs, base=b, params={"density": 0.5}, seed=2, tensor_name="a")
    )
    assert not torch.equal(
        a1, merge_tensors("dare_linear", xs, base=b, params={"density": 0.5}, seed=1, tensor_name="b")
    )


def test_output_dtype_and_errors():
    _base, models = _state_dicts()
    xs = [m["layer.0.weight"] for m in models]
    assert merge_tensors("linear", xs).dtype == torch.bfloat16
    assert merge_tensors("linear", xs, out_dtype=torch.float32).dtype == torch.float32
    with pytest.raises(ValueError, match="base"):
        merge_tensors("ties", xs)
    with pytest.raises(ValueError, match="shape"):
        merge_tensors("linear", [xs[0], xs[1][:4]])
    with pytest.raises(ValueError, match="weights"):
        merge_tensors("linear", xs, weights=[1.0, 2.0])
    with pytest.raises(ValueError, match="missing"):
        merge_state_dicts("linear", [models[0], {"embed.weight": models[1]["embed.weight"]}])


def test_single_model_returns_input():
    _, models = _state_dicts(1)
    x = models[0]["embed.weight"]
    for method in ("linear", "fisher_rao", "karcher", "wsm"):
        assert torch.allclose(merge_tensors(method, [x]), x, atol=1e-6)
