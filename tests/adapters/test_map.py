"""MAP / LoMAP (arXiv 2505.23094): forward, initialisation, gradients, merging, several adapters, dtypes.

References are dense float64 computations written from the formula `W' = (1 + a) W0 + ‖W0‖_F b · BA/‖BA‖_F`
(α = ‖W0‖(1 + a), β = ‖W0‖ b), independent of the layer code.
"""

import copy
import json
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from peft import get_peft_model
from transformers.pytorch_utils import Conv1D

from hf_stable.adapters import StableLoraConfig, merge_and_export
from hf_stable.adapters.map import MapLinearVariant, gram_frobenius_norm
from hf_stable.testing import build_tiny_model


IN, OUT, R = 12, 10, 3


class Net(torch.nn.Module):
    def __init__(self, bias=True, conv1d=False, dtype=torch.float32, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.proj = Conv1D(OUT, IN) if conv1d else torch.nn.Linear(IN, OUT, bias=bias)
        if conv1d:
            torch.nn.init.normal_(self.proj.weight, std=0.3)
            torch.nn.init.normal_(self.proj.bias, std=0.3)
        self.to(dtype)

    def forward(self, x):
        return self.proj(x)


def w0_of(net) -> torch.Tensor:
    """The base weight as `(out, in)` float64 (Conv1D stores it transposed)."""
    w = net.proj.weight.detach().double()
    return w.T if isinstance(net.proj, Conv1D) else w


def bias_of(net):
    return None if net.proj.bias is None else net.proj.bias.detach().double()


def wrap(net, adapter_name="default", **kwargs):
    kwargs = {"r": R, "target_modules": ["proj"], "use_map": True, **kwargs}
    return get_peft_model(net, StableLoraConfig(**kwargs), adapter_name=adapter_name)


def randomise(layer, adapter, a, b, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        layer.lora_map_a[adapter].fill_(a)
        layer.lora_map_b[adapter].fill_(b)
        for w in (layer.lora_A[adapter].weight, layer.lora_B[adapter].weight):
            w.copy_(torch.randn(w.shape, generator=g, dtype=torch.float64).to(w.dtype))


def dense_delta(w0, layer, adapter) -> torch.Tensor:
    """`W' - W0 = a W0 + ‖W0‖ b · BA/‖BA‖` in float64, `(out, in)`."""
    a = layer.lora_map_a[adapter].detach().double()
    b = layer.lora_map_b[adapter].detach().double()
    ba = layer.lora_B[adapter].weight.detach().double() @ layer.lora_A[adapter].weight.detach().double()
    return a * w0 + torch.linalg.matrix_norm(w0) * b * ba / torch.linalg.matrix_norm(ba)


def dense_forward(x, weight, bias):
    y = x.double() @ weight.T
    return y if bias is None else y + bias


@pytest.mark.parametrize(("bias", "conv1d"), [(True, False), (False, False), (True, True)])
def test_forward_equals_dense_formula(bias, conv1d):
    net = Net(bias=bias, conv1d=conv1d)
    w0, b0 = w0_of(net), bias_of(net)
    model = wrap(net, fan_in_fan_out=conv1d)
    layer = model.base_model.model.proj
    assert layer.fan_in_fan_out is conv1d
    randomise(layer, "default", a=0.3, b=-0.7, seed=1)
    x = torch.randn(4, 5, IN)
    expected = dense_forward(x, w0 + dense_delta(w0, layer, "default"), b0)  # the bias is not rescaled
    torch.testing.assert_close(model(x).double(), expected, atol=1e-6, rtol=0)
    # the same with α, β written out as in the paper: α·W0/‖W0‖ + β·BA/‖BA‖ (+ bias)
    n0 = torch.linalg.matrix_norm(w0)
    alpha, beta = n0 * 1.3, n0 * -0.7
    ba = layer.lora_B["default"].weight.double() @ layer.lora_A["default"].weight.double()
    paper = alpha * w0 / n0 + beta * ba / torch.linalg.matrix_norm(ba)
    torch.testing.assert_close(model(x).double(), dense_forward(x, paper, b0), atol=1e-6, rtol=0)


def test_nn_linear_with_fan_in_fan_out_is_corrected():
    with pytest.warns(UserWarning, match="fan_in_fan_out=True does not match"):
        model = wrap(Net(), fan_in_fan_out=True)
    assert model.base_model.model.proj.fan_in_fan_out is False


def test_output_equals_base_at_init_and_b_is_random():
    net = Net()
    x = torch.randn(6, IN)
    expected = net(x).detach()
    model = wrap(net, map_init_b_std=0.05)
    layer = model.base_model.model.proj
    assert isinstance(layer.lora_variant["default"], MapLinearVariant)
    assert layer.lora_map_a["default"].item() == 0 and layer.lora_map_b["default"].item() == 0
    b = layer.lora_B["default"].weight
    assert (b != 0).all() and 0.02 < b.std().item() < 0.1  # N(0, map_init_b_std²), never zero
    assert torch.equal(model(x), expected)
    assert layer._map_w0_norm["default"] == pytest.approx(torch.linalg.matrix_norm(w0_of(net)).item(), rel=1e-6)


def _grads(layer):
    return {
        "a": layer.lora_map_a["default"].grad,
        "b": layer.lora_map_b["default"].grad,
        "A": layer.lora_A["default"].weight.grad,
        "B": layer.lora_B["default"].weight.grad,
    }


def test_gradients_reach_all_parameters_no_deadlock():
    torch.manual_seed(0)
    model = wrap(Net())
    layer = model.base_model.model.proj
    x, target = torch.randn(8, IN), torch.randn(8, OUT)
    params = [p for p in model.parameters() if p.requires_grad]
    assert len(params) == 4
    optimizer = torch.optim.Adam(params, lr=1e-2)

    ((model(x) - target) ** 2).sum().backward()
    grads = _grads(layer)
    # step 0: the scalars get gradient; A, B get exactly b = 0 times it (as LoRA's A does with B = 0)
    assert grads["a"].abs() > 0 and grads["b"].abs() > 0
    assert not grads["A"].any() and not grads["B"].any()
    optimizer.step()
    optimizer.zero_grad()
    assert layer.lora_map_b["default"].item() != 0

    ((model(x) - target) ** 2).sum().backward()
    assert all(g.abs().sum() > 0 for g in _grads(layer).values())  # one step later everything moves

    # why B starts random: with B = 0 the direction BA/‖BA‖ is 0 and b gets no gradient, ever
    optimizer.zero_grad()
    with torch.no_grad():
        layer.lora_B["default"].weight.zero_()
        layer.lora_map_b["default"].zero_()
    ((model(x) - target) ** 2).sum().backward()
    grads = _grads(layer)
    assert grads["b"] == 0 and not grads["A"].any() and not grads["B"].any()


@settings(max_examples=60, deadline=None)
@given(
    m=st.integers(1, 16),
    n=st.integers(1, 16),
    r=st.integers(1, 6),
    seed=st.integers(0, 2**16),
    log_scale=st.floats(-3, 3),
)
def test_gram_trace_norm_equals_dense_frobenius_norm(m, n, r, seed, log_scale):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(r, n, generator=g) * 10**log_scale
    b = torch.randn(m, r, generator=g)
    dense = torch.linalg.matrix_norm(b.double() @ a.double())
    assert gram_frobenius_norm(a, b).item() == pytest.approx(dense.item(), rel=1e-4)


def test_forward_is_invariant_to_the_scale_of_a_and_b():
    model = wrap(Net())
    layer = model.base_model.model.proj
    randomise(layer, "default", a=0.1, b=0.4, seed=2)
    x = torch.randn(3, IN)
    before = model(x)
    with torch.no_grad():
        layer.lora_A["default"].weight.mul_(7.0)
        layer.lora_B["default"].weight.mul_(0.01)  # positive: the sign is the direction
    torch.testing.assert_close(model(x), before, atol=1e-6, rtol=0)


def test_lora_conversion_is_unsupported():
    from peft.tuners.lora.conversion import convert_to_lora

    model = wrap(Net())
    assert model.base_model.model.proj.supports_lora_conversion("default") is False
    with pytest.raises(TypeError, match="do not support LoRA conversion"):
        convert_to_lora(model, rank=2)


def test_unmerge_refuses_when_the_base_direction_was_scaled_to_zero():
    """Training can drive 1 + a through 0; W0 is then not recoverable from the merged weight, so unmerge says so."""
    model = wrap(Net())
    layer = model.base_model.model.proj
    randomise(layer, "default", a=-1.0 + 1e-5, b=0.3, seed=0)
    model.merge_adapter()
    with pytest.raises(ValueError, match="Cannot unmerge this MAP adapter"):
        model.unmerge_adapter()


@pytest.mark.filterwarnings("ignore:Already following adapters were merged")
def test_several_adapters_add_up_in_any_order_and_merge_exactly():
    net = Net()
    w0, b0 = w0_of(net), bias_of(net)
    model = wrap(net, adapter_name="one")
    model.add_adapter("two", StableLoraConfig(r=2, target_modules=["proj"], use_map=True))
    model.add_adapter("plain", StableLoraConfig(r=2, target_modules=["proj"], init_lora_weights=False))
    layer = model.base_model.model.proj
    randomise(layer, "one", a=0.2, b=0.5, seed=3)
    randomise(layer, "two", a=-0.3, b=0.8, seed=4)
    plain = layer.scaling["plain"] * (layer.lora_B["plain"].weight.double() @ layer.lora_A["plain"].weight.double())
    weight = w0 + dense_delta(w0, layer, "one") + dense_delta(w0, layer, "two") + plain  # each against W0
    x = torch.randn(5, IN)
    expected = dense_forward(x, weight, b0)
    for order in (["one", "two", "plain"], ["plain", "two", "one"], ["two", "plain", "one"]):
        model.base_model.set_adapter(order)
        torch.testing.assert_close(model(x).double(), expected, atol=1e-6, rtol=0)

    for safe_merge in (False, True):
        model.merge_adapter(safe_merge=safe_merge)
        torch.testing.assert_close(layer.base_layer.weight.double(), weight, atol=1e-6, rtol=0)
        torch.testing.assert_close(model(x).double(), expected, atol=1e-5, rtol=0)
        model.unmerge_adapter()
        torch.testing.assert_close(layer.base_layer.weight.double(), w0, atol=1e-6, rtol=0)

    # merged one at a time (each merge sees the others already in the weight), unmerged in reverse
    for name in ("two", "plain", "one"):
        model.merge_adapter([name])
    torch.testing.assert_close(layer.base_layer.weight.double(), weight, atol=1e-6, rtol=0)
    model.unmerge_adapter()
    torch.testing.assert_close(layer.base_layer.weight.double(), w0, atol=1e-6, rtol=0)

    # an adapter added while others are merged still takes ‖W0‖ of the unmerged weight (PEFT unmerges only after
    # the new adapter's variant is initialised)
    model.merge_adapter()
    with pytest.warns(UserWarning, match="Unmerging the model first"):
        model.add_adapter("three", StableLoraConfig(r=2, target_modules=["proj"], use_map=True))
    assert layer._map_w0_norm["three"] == pytest.approx(torch.linalg.matrix_norm(w0).item(), rel=1e-6)


def test_mixed_batch_adapter_names():
    net = Net()
    w0, b0 = w0_of(net), bias_of(net)
    model = wrap(net, adapter_name="one")
    model.add_adapter("two", StableLoraConfig(r=2, target_modules=["proj"], use_map=True))
    layer = model.base_model.model.proj
    randomise(layer, "one", a=0.2, b=0.5, seed=5)
    randomise(layer, "two", a=-0.3, b=0.8, seed=6)
    model.eval()
    x = torch.randn(3, IN)
    out = model(x, adapter_names=["two", "__base__", "one"])
    for row, weight in enumerate([w0 + dense_delta(w0, layer, "two"), w0, w0 + dense_delta(w0, layer, "one")]):
        torch.testing.assert_close(out[row].double(), dense_forward(x[row], weight, b0), atol=1e-6, rtol=0)


@pytest.mark.parametrize("autocast_adapter_dtype", [True, False])
def test_bf16_base_keeps_fp32_coefficients(autocast_adapter_dtype):
    net = Net(dtype=torch.bfloat16)
    w0, b0 = w0_of(net), bias_of(net)
    model = get_peft_model(
        net,
        StableLoraConfig(r=R, target_modules=["proj"], use_map=True),
        autocast_adapter_dtype=autocast_adapter_dtype,
    )
    layer = model.base_model.model.proj
    assert layer.lora_map_a["default"].dtype == torch.float32 == layer.lora_map_b["default"].dtype
    expected_factor_dtype = torch.float32 if autocast_adapter_dtype else torch.bfloat16
    assert layer.lora_A["default"].weight.dtype == expected_factor_dtype
    randomise(layer, "default", a=0.0123, b=0.3, seed=7)
    map_a, coef = MapLinearVariant._coefficients(layer, "default")
    assert map_a.dtype == coef.dtype == torch.float32
    x = torch.randn(4, IN).to(torch.bfloat16)
    out = model(x)
    assert out.dtype == torch.bfloat16
    expected = dense_forward(x, w0 + dense_delta(w0, layer, "default"), b0)
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=1e-2)
    model.merge_adapter()  # bf16 weight, fp32 arithmetic
    assert layer.base_layer.weight.dtype == torch.bfloat16
    torch.testing.assert_close(
        layer.base_layer.weight.double(), w0 + dense_delta(w0, layer, "default"), atol=1e-2, rtol=1e-2
    )


def test_zero_base_weight_is_refused():
    net = Net()
    with torch.no_grad():
        net.proj.weight.zero_()
    with pytest.raises(ValueError, match="nonzero base weight"):
        wrap(net)


# --- a tiny causal LM trained for a few steps -------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained_map():
    """Tiny Llama with MAP on every linear layer, 20 Adam steps on random next-token targets."""
    model, tokenizer = build_tiny_model(seed=0)
    config = StableLoraConfig(r=4, target_modules="all-linear", use_map=True, lora_dropout=0.0)
    model = get_peft_model(model, config)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(7, len(tokenizer), (4, 16), generator=g)
    labels = torch.randint(7, len(tokenizer), (4, 16), generator=g)
    params = [p for p in model.parameters() if p.requires_grad]
    initial = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    optimizer = torch.optim.Adam(params, lr=1e-2)
    model.train()
    for _ in range(20):
        model(input_ids=ids, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    return model, tokenizer, ids, initial


def test_training_moves_every_map_parameter(trained_map):
    model, _, _, initial = trained_map
    moved = {n: (p.detach() - initial[n]).abs().max().item() for n, p in model.named_parameters() if n in initial}
    assert len(moved) == 14 * 4  # 14 adapted layers × (A, B, a, b)
    assert min(moved.values()) > 1e-3


def test_merge_unmerge_and_merge_and_unload_reproduce_logits(trained_map):
    model, _, ids, _ = trained_map
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        weights = {n: p.detach().clone() for n, p in model.named_parameters() if "base_layer.weight" in n}
        model.merge_adapter()
        merged_logits = model(input_ids=ids).logits
        assert any(
            (p - weights[n]).abs().max() > 1e-3 for n, p in model.named_parameters() if "base_layer.weight" in n
        )
        model.unmerge_adapter()
        for n, p in model.named_parameters():
            if n in weights:
                torch.testing.assert_close(p, weights[n], atol=1e-6, rtol=0)
        unloaded = copy.deepcopy(model).merge_and_unload()
        assert not any("lora" in n for n, _ in unloaded.named_parameters())
        unloaded_logits = unloaded(input_ids=ids).logits
        torch.testing.assert_close(model(input_ids=ids).logits, logits, atol=1e-5, rtol=0)  # W0 back to ~1e-7
    torch.testing.assert_close(merged_logits, logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(unloaded_logits, logits, atol=1e-5, rtol=0)


def test_merge_and_export_writes_a_plain_model(trained_map, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer, ids, _ = trained_map
    model = copy.deepcopy(model)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    out = tmp_path / "export"
    os.makedirs(str(out) + ".tmp")  # a leftover of an interrupted export is cleaned up
    result = merge_and_export(model, str(out), tokenizer=tokenizer)
    assert result == {"output_dir": str(out), "dequantized": False}
    assert sorted(os.listdir(tmp_path)) == ["export"]
    assert not os.path.exists(out / "adapter_config.json")
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    exported = AutoModelForCausalLM.from_pretrained(out)
    assert not any("lora" in n for n, _ in exported.named_parameters())
    assert AutoTokenizer.from_pretrained(out).get_vocab() == tokenizer.get_vocab()
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=ids).logits, logits, atol=1e-5, rtol=0)
