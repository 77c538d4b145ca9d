"""Bounded sine adapter (Sine-LoRA, Ji et al. ICLR 2025; "Stable Forgetting", arXiv 2509.24166).

`ΔW = s · sin(ω · BA) / g` with `s = lora_alpha / r` and `g = √in_features` or a number: every entry within `s/g`.
References are dense float64 computations written from that formula, independent of the layer code.
"""

import copy
import math

import pytest
import torch
from peft import get_peft_model
from transformers.pytorch_utils import Conv1D

from hf_stable.adapters import StableLoraConfig
from hf_stable.adapters.bounded import SineLinearVariant
from hf_stable.testing import build_tiny_model


IN, OUT = 16, 10
MLP = ["gate_proj", "up_proj", "down_proj"]


class Net(torch.nn.Module):
    def __init__(self, conv1d=False):
        super().__init__()
        torch.manual_seed(0)
        self.proj = Conv1D(OUT, IN) if conv1d else torch.nn.Linear(IN, OUT)
        if conv1d:
            torch.nn.init.normal_(self.proj.weight, std=0.3)
            torch.nn.init.normal_(self.proj.bias, std=0.3)

    def forward(self, x):
        return self.proj(x)


def dense_sine(layer, adapter="default", freq=None, gain=None) -> torch.Tensor:
    """`s · sin(ω BA) / g`, float64, `(out, in)`."""
    ba = layer.lora_B[adapter].weight.detach().double() @ layer.lora_A[adapter].weight.detach().double()
    return layer.scaling[adapter] * torch.sin(freq * ba) / gain


@pytest.mark.parametrize(
    ("conv1d", "sine_g", "gain"), [(False, "sqrt_in", math.sqrt(IN)), (False, 2.5, 2.5), (True, "sqrt_in", 4.0)]
)
def test_forward_equals_dense_formula(conv1d, sine_g, gain):
    net = Net(conv1d=conv1d)
    w0 = net.proj.weight.detach().double()
    w0 = w0.T if conv1d else w0
    b0 = net.proj.bias.detach().double()
    config = StableLoraConfig(
        r=4,
        lora_alpha=12,
        target_modules=["proj"],
        use_sine=True,
        sine_freq=30.0,
        sine_g=sine_g,
        fan_in_fan_out=conv1d,
    )
    model = get_peft_model(net, config)
    layer = model.base_model.model.proj
    assert isinstance(layer.lora_variant["default"], SineLinearVariant)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for w in (layer.lora_A["default"].weight, layer.lora_B["default"].weight):
            w.copy_(0.3 * torch.randn(w.shape, generator=g))
    delta = dense_sine(layer, freq=30.0, gain=gain)
    assert layer.scaling["default"] == 3.0
    x = torch.randn(2, 3, IN)
    expected = x.double() @ (w0 + delta).T + b0
    torch.testing.assert_close(model(x).double(), expected, atol=1e-5, rtol=0)
    # ω amplifies the fp32 round-off of BA: ~ω·1e-7 in the sine's argument
    expected_delta = delta.T if conv1d else delta
    torch.testing.assert_close(layer.get_delta_weight("default").double(), expected_delta, atol=1e-5, rtol=0)


def test_zero_at_init_and_gradient_reaches_b():
    net = Net()
    x = torch.randn(5, IN)
    expected = net(x).detach()
    model = get_peft_model(net, StableLoraConfig(r=4, target_modules=["proj"], use_sine=True))
    layer = model.base_model.model.proj
    assert not layer.lora_B["default"].weight.any()  # B = 0: sin(0) = 0
    out = model(x)
    assert torch.equal(out, expected)
    (out**2).sum().backward()
    assert layer.lora_B["default"].weight.grad.abs().sum() > 0


def test_lora_conversion_is_unsupported():
    model = get_peft_model(Net(), StableLoraConfig(r=4, target_modules=["proj"], use_sine=True))
    assert model.base_model.model.proj.supports_lora_conversion("default") is False


# --- gradient ascent on a tiny causal LM: the bound holds where plain LoRA runs away ------------------------------


def ascend(use_sine: bool, steps: int = 200):
    """Gradient *ascent* on next-token cross-entropy (the forget half of gradient difference) with adapters on the MLP
    projections; a learning rate that makes plain LoRA's update grow far past the sine bound."""
    model, tokenizer = build_tiny_model(seed=0)
    config = StableLoraConfig(r=4, lora_alpha=8, target_modules=MLP, use_sine=use_sine, sine_freq=100.0)
    model = get_peft_model(model, config)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(7, len(tokenizer), (4, 16), generator=g)
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=5e-2)
    model.train()
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        (-loss).backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    model.eval()
    return model, ids, losses


@pytest.fixture(scope="module")
def ascended():
    return {"sine": ascend(use_sine=True), "lora": ascend(use_sine=False)}


def _mlp_layers(model):
    return [m for n, m in model.named_modules() if n.split(".")[-1] in MLP and hasattr(m, "lora_A")]


def test_sine_update_stays_within_the_analytic_bound(ascended):
    model, _, losses = ascended["sine"]
    assert max(losses) > losses[0] + 0.5  # the ascent did work
    layers = _mlp_layers(model)
    assert len(layers) == 6
    for layer in layers:
        bound = layer.scaling["default"] / math.sqrt(layer.in_features)  # s / g
        delta = layer.get_delta_weight("default")  # what the forward and merge use, fp32
        reference = dense_sine(layer, freq=100.0, gain=math.sqrt(layer.in_features))
        # |BA| has grown, and ω = 100 amplifies its fp32 round-off in the sine's argument
        torch.testing.assert_close(delta.double(), reference, atol=1e-2 * bound, rtol=0)
        assert delta.abs().max().item() <= bound * (1 + 1e-6)  # every entry, up to fp32 rounding of s·sin/g
        assert delta.abs().max().item() > 0.5 * bound  # the adapter did move: the bound is what holds it


def test_plain_lora_update_grows_past_that_bound(ascended):
    model, _, losses = ascended["lora"]
    assert max(losses) > losses[0] + 0.5
    for layer in _mlp_layers(model):
        bound = layer.scaling["default"] / math.sqrt(layer.in_features)
        assert layer.get_delta_weight("default").abs().max().item() > 5 * bound  # 7× to 26× here


def test_merge_unmerge_and_merge_and_unload_are_exact(ascended):
    model, ids, _ = ascended["sine"]
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        weights = {n: p.detach().clone() for n, p in model.named_parameters() if "base_layer.weight" in n}
        model.merge_adapter()
        merged_logits = model(input_ids=ids).logits
        model.unmerge_adapter()
        for n, p in model.named_parameters():
            if n in weights:
                torch.testing.assert_close(p, weights[n], atol=1e-6, rtol=0)
        unloaded_logits = copy.deepcopy(model).merge_and_unload()(input_ids=ids).logits
    torch.testing.assert_close(merged_logits, logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(unloaded_logits, logits, atol=1e-5, rtol=0)
