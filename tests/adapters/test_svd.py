"""Singular-value fine-tuning (CLOVER, Meng et al., arXiv 2411.17426) as a PEFT LoRA variant.

`W0 = U diag(S) Vᵀ` once; U, V frozen; `W' = W0 + U diag(δ) Vᵀ` (or `W0 + U M Vᵀ`). References are float64
computations from an SVD taken here with `torch.linalg.svd`, independent of the layer code: `U diag(x) Vᵀ` does not
depend on the sign convention of the singular vectors (each `u_i v_iᵀ` is), so it can be compared across the two SVDs.
"""

import copy
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from peft import get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
from transformers.pytorch_utils import Conv1D

from hf_stable._peft_hook import SAVED_PEFT_TYPE
from hf_stable.adapters import StableLoraConfig, check_adapter
from hf_stable.adapters.svd import SvdLinearVariant
from hf_stable.testing import build_tiny_model


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
IN, OUT = 16, 10


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


def _w0(net, conv1d) -> torch.Tensor:
    w = net.proj.weight.detach().double()
    return w.T if conv1d else w  # (out, in)


def _layer(model):
    return model.base_model.model.proj


@pytest.mark.parametrize("conv1d", [False, True])
@pytest.mark.parametrize("r", [4, 10, 32])
def test_output_equals_base_exactly_at_init_and_bases_are_the_weights_svd(conv1d, r):
    net = Net(conv1d=conv1d)
    w0 = _w0(net, conv1d)
    x = torch.randn(3, 5, IN)
    expected = net(x).detach()
    model = get_peft_model(net, StableLoraConfig(r=r, target_modules=["proj"], use_svd=True, fan_in_fan_out=conv1d))
    layer = _layer(model)
    assert isinstance(layer.lora_variant["default"], SvdLinearVariant)
    assert torch.equal(model(x), expected)  # δ = 0: bit for bit the base model
    k = min(r, IN, OUT)
    u, vh = layer.lora_B["default"].weight.double(), layer.lora_A["default"].weight.double()
    assert u.shape == (OUT, r) and vh.shape == (r, IN)
    torch.testing.assert_close(u[:, :k].T @ u[:, :k], torch.eye(k, dtype=torch.double), atol=1e-6, rtol=0)
    torch.testing.assert_close(vh[:k] @ vh[:k].T, torch.eye(k, dtype=torch.double), atol=1e-6, rtol=0)
    assert not u[:, k:].any() and not vh[k:].any()  # past min(out, in): no direction
    ref_u, ref_s, ref_vh = torch.linalg.svd(w0, full_matrices=False)
    # the leading k triplets of W0: U diag(S) Vᵀ over them equals the reference's rank-k truncation
    torch.testing.assert_close(
        (u[:, :k] * ref_s[:k]) @ vh[:k], (ref_u[:, :k] * ref_s[:k]) @ ref_vh[:k], atol=1e-5, rtol=0
    )
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable == ["base_model.model.proj.lora_svd_delta.default"]


@pytest.mark.parametrize("conv1d", [False, True])
def test_forward_and_merge_equal_u_diag_s_plus_delta_vt(conv1d):
    """With every direction kept (r = min(out, in)), the adapted weight is `U diag(S + δ) Vᵀ` of the reference SVD."""
    net = Net(conv1d=conv1d)
    w0, b0 = _w0(net, conv1d), net.proj.bias.detach().double()
    model = get_peft_model(net, StableLoraConfig(r=OUT, target_modules=["proj"], use_svd=True, fan_in_fan_out=conv1d))
    layer = _layer(model)
    delta = torch.randn(OUT, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        layer.lora_svd_delta["default"].copy_(delta)
    ref_u, ref_s, ref_vh = torch.linalg.svd(w0, full_matrices=False)
    expected_w = (ref_u * (ref_s + delta.double())) @ ref_vh
    x = torch.randn(2, 3, IN)
    torch.testing.assert_close(model(x).double(), x.double() @ expected_w.T + b0, atol=1e-5, rtol=0)
    expected_delta = expected_w - w0
    torch.testing.assert_close(
        layer.get_delta_weight("default").double(), expected_delta.T if conv1d else expected_delta, atol=1e-5, rtol=0
    )
    weight_before = layer.base_layer.weight.detach().clone()
    merged = copy.deepcopy(model).merge_and_unload()
    merged_w = merged.proj.weight.detach().double()
    torch.testing.assert_close(merged_w.T if conv1d else merged_w, expected_w, atol=1e-5, rtol=0)
    model.merge_adapter()
    model.unmerge_adapter()
    torch.testing.assert_close(layer.base_layer.weight, weight_before, atol=1e-6, rtol=0)


def test_matrix_mode_mixes_the_frozen_vectors():
    """`svd_trainable="matrix"`: `W' = W0 + U M Vᵀ` with a full r×r M (the authors' code trains that block)."""
    net = Net()
    w0, b0 = _w0(net, False), net.proj.bias.detach().double()
    config = StableLoraConfig(r=6, target_modules=["proj"], use_svd=True, svd_trainable="matrix")
    model = get_peft_model(net, config)
    layer = _layer(model)
    assert layer.lora_svd_delta["default"].shape == (6, 6) and not layer.lora_svd_delta["default"].any()
    mix = torch.randn(6, 6, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        layer.lora_svd_delta["default"].copy_(mix)
    u, vh = layer.lora_B["default"].weight.double(), layer.lora_A["default"].weight.double()
    expected_w = w0 + u @ mix.double() @ vh
    x = torch.randn(4, IN)
    torch.testing.assert_close(model(x).double(), x.double() @ expected_w.T + b0, atol=1e-5, rtol=0)
    merged = copy.deepcopy(model).merge_and_unload()
    torch.testing.assert_close(merged.proj.weight.double(), expected_w, atol=1e-5, rtol=0)
    # a diagonal M is the diagonal mode
    diag_model = get_peft_model(Net(), StableLoraConfig(r=6, target_modules=["proj"], use_svd=True))
    with torch.no_grad():
        _layer(diag_model).lora_svd_delta["default"].copy_(mix.diagonal())
        layer.lora_svd_delta["default"].copy_(torch.diag(mix.diagonal()))
    torch.testing.assert_close(diag_model(x), model(x), atol=1e-6, rtol=0)


def test_set_adapter_keeps_the_bases_frozen():
    model = get_peft_model(Net(), StableLoraConfig(r=4, target_modules=["proj"], use_svd=True))
    model.base_model.set_adapter("default")  # PEFT marks every `lora_*` tensor of the adapter trainable here
    assert [n for n, p in model.named_parameters() if p.requires_grad] == [
        "base_model.model.proj.lora_svd_delta.default"
    ]


# --- a trained tiny causal LM ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained_svd():
    model, tokenizer = build_tiny_model(seed=0)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith("proj.weight")}
    config = StableLoraConfig(r=128, target_modules="all-linear", use_svd=True, lora_dropout=0.0)
    model = get_peft_model(model, config)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(7, len(tokenizer), (4, 16), generator=g)
    labels = torch.randint(7, len(tokenizer), (4, 16), generator=g)
    initial = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    for _ in range(20):
        model(input_ids=ids, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    return model, ids, initial, base


def _svd_layers(model):
    return {n: m for n, m in model.named_modules() if hasattr(m, "lora_svd_delta")}


def test_training_moves_only_the_singular_values(trained_svd):
    model, _, initial, _ = trained_svd
    layers = _svd_layers(model)
    assert len(layers) == 14  # 2 layers × (q, k, v, o, gate, up, down)
    for name, p in model.named_parameters():
        if name not in initial:
            continue
        if "lora_svd_delta" in name:
            assert (p.detach() - initial[name]).abs().max() > 1e-3, name
        else:  # U and Vᵀ: untouched, bit for bit
            assert not p.requires_grad and torch.equal(p, initial[name]), name
    for layer in layers.values():
        k = min(layer.in_features, layer.out_features)
        u, vh = layer.lora_B["default"].weight.double()[:, :k], layer.lora_A["default"].weight.double()[:k]
        torch.testing.assert_close(u.T @ u, torch.eye(k, dtype=torch.double), atol=1e-5, rtol=0)
        torch.testing.assert_close(vh @ vh.T, torch.eye(k, dtype=torch.double), atol=1e-5, rtol=0)


def test_merged_weights_are_u_diag_s_plus_delta_vt_of_the_base(trained_svd):
    model, _, _, base = trained_svd
    merged = copy.deepcopy(model).merge_and_unload()
    weights = dict(merged.named_parameters())
    for name, layer in _svd_layers(model).items():
        key = name.removeprefix("base_model.model.") + ".weight"
        w0 = base[key].double()
        k = min(w0.shape)
        ref_u, ref_s, ref_vh = torch.linalg.svd(w0, full_matrices=False)
        delta = layer.lora_svd_delta["default"].detach().double()[:k]
        expected = (ref_u * (ref_s + delta)) @ ref_vh
        torch.testing.assert_close(weights[key].double(), expected, atol=1e-5, rtol=0)


def test_merge_unmerge_and_merge_and_unload_reproduce_logits(trained_svd):
    model, ids, _, _ = trained_svd
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


def test_merges_next_to_a_map_adapter_on_the_same_layer():
    """MAP reads W0 back out of a merged weight: an SVD adapter merged beside it is an additive term it removes."""
    net = Net()
    model = get_peft_model(net, StableLoraConfig(r=4, target_modules=["proj"], use_map=True), adapter_name="m")
    model.add_adapter("s", StableLoraConfig(r=4, target_modules=["proj"], use_svd=True))
    layer = _layer(model)
    with torch.no_grad():
        layer.lora_map_a["m"].fill_(0.3)
        layer.lora_map_b["m"].fill_(0.2)
        layer.lora_svd_delta["s"].copy_(torch.tensor([0.5, -0.4, 0.3, 0.2]))
    model.base_model.set_adapter(["m", "s"])
    x = torch.randn(4, IN)
    with torch.no_grad():
        expected = model(x)
        weight = layer.base_layer.weight.detach().clone()
        for order in (["s", "m"], ["m", "s"]):
            layer.merge(adapter_names=order)
            merged = torch.nn.functional.linear(x, layer.base_layer.weight, layer.base_layer.bias)
            torch.testing.assert_close(merged, expected, atol=1e-5, rtol=0)
            layer.unmerge()
            torch.testing.assert_close(layer.base_layer.weight, weight, atol=1e-5, rtol=0)


# --- save, reload in a fresh process -------------------------------------------------------------------------------

FRESH = textwrap.dedent(
    """
    import json, sys
    import hf_stable
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM
    from hf_stable.adapters import load_adapter

    torch.set_num_threads(1)
    base, adapter, expected, out = sys.argv[1:]
    ids = load_file(expected)["ids"]
    logits = {}
    for how, load in (
        ("peft", lambda: PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter)),
        ("load_adapter", lambda: load_adapter(AutoModelForCausalLM.from_pretrained(base), adapter)),
    ):
        model = load().eval()
        with torch.no_grad():
            logits[how] = model(input_ids=ids).logits
            logits[how + "_merged"] = model.merge_and_unload()(input_ids=ids).logits
    layer = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter)
    layer = layer.base_model.model.model.layers[0].self_attn.q_proj
    save_file(logits, out + "/logits.safetensors")
    json.dump({"variant": type(layer.lora_variant["default"]).__name__}, open(out + "/meta.json", "w"))
    """
)


@pytest.mark.parametrize("mode", ["diagonal", "matrix"])
def test_save_and_reload_in_a_fresh_process_is_exact(tiny_model_dir, tmp_path, mode):
    import json

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    config = StableLoraConfig(r=16, target_modules="all-linear", use_svd=True, svd_trainable=mode, lora_dropout=0.0)
    model = get_peft_model(model, config)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(7, model.config.vocab_size, (2, 12), generator=g)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_svd_delta" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    adapter = tmp_path / "adapter"
    model.save_pretrained(adapter)
    saved = json.loads((adapter / "adapter_config.json").read_text())
    assert saved["use_svd"] is True and saved["svd_trainable"] == mode and saved["peft_type"] == SAVED_PEFT_TYPE
    assert check_adapter(str(adapter))["variants"] == ["svd"]
    save_file({"ids": ids}, str(tmp_path / "expected.safetensors"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    args = [tiny_model_dir, str(adapter), str(tmp_path / "expected.safetensors"), str(tmp_path)]
    proc = subprocess.run(
        [sys.executable, "-c", FRESH, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    fresh = load_file(str(tmp_path / "logits.safetensors"))
    assert json.loads((tmp_path / "meta.json").read_text()) == {"variant": "SvdLinearVariant"}
    assert torch.equal(fresh["peft"], logits) and torch.equal(fresh["load_adapter"], logits)
    torch.testing.assert_close(fresh["peft_merged"], logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(fresh["load_adapter_merged"], logits, atol=1e-5, rtol=0)


# --- refusals -------------------------------------------------------------------------------------------------------

BASE = {"r": 4, "target_modules": ["proj"]}


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"use_map": True}, r"`use_map` and `use_svd` cannot be combined"),
        ({"use_sine": True}, r"`use_sine` and `use_svd` cannot be combined"),
        ({"use_dora": True}, r"`use_dora` cannot be combined with `use_svd`"),
        ({"lora_bias": True}, r"`lora_bias=True` is not supported with `use_svd`"),
        ({"init_lora_weights": "pissa"}, r"`init_lora_weights`='pissa' cannot be used with `use_svd`"),
        ({"svd_trainable": "full"}, r"`svd_trainable` must be one of 'diagonal', 'matrix', got 'full'"),
    ],
)
def test_combinations_that_cannot_work_are_refused_by_name(extra, match):
    with pytest.raises(ValueError, match=match):
        StableLoraConfig(**BASE, use_svd=True, **extra)


def test_svd_setting_without_use_svd_is_refused():
    with pytest.raises(ValueError, match=r"`svd_trainable`='matrix' only acts with `use_svd=True`"):
        StableLoraConfig(**BASE, svd_trainable="matrix")


def test_lora_scale_settings_warn_that_they_do_nothing():
    with pytest.warns(UserWarning, match="have no effect under SVD"):
        StableLoraConfig(**BASE, use_svd=True, lora_alpha=16)
    net = Net()
    x = torch.randn(3, IN)
    outputs = []
    for alpha in (8, 32):
        model = get_peft_model(copy.deepcopy(net), StableLoraConfig(**BASE, use_svd=True, lora_alpha=alpha))
        with torch.no_grad():
            _layer(model).lora_svd_delta["default"].fill_(0.7)
        outputs.append(model(x))
    assert torch.equal(*outputs)


def test_embedding_target_is_refused():
    class Embed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(10, 8)

    with pytest.raises(ValueError, match=r"`use_svd`.* not embeddings"):
        get_peft_model(Embed(), StableLoraConfig(r=4, target_modules=["emb"], use_svd=True))


def test_non_finite_base_weight_is_refused():
    net = Net()
    with torch.no_grad():
        net.proj.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="finite base weight"):
        get_peft_model(net, StableLoraConfig(**BASE, use_svd=True))


def test_a_4bit_base_is_refused(tiny_model_dir):
    pytest.importorskip("bitsandbytes")
    from transformers import BitsAndBytesConfig

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, quantization_config=quant)
    with pytest.raises(ValueError, match=r"`use_svd` is not supported on a 4-bit"):
        get_peft_model(model, StableLoraConfig(r=4, target_modules=["q_proj"], use_svd=True))


def test_sft_step_trains_the_singular_values_and_matrix_mode_adds_the_mixing(tmp_path):
    """One `StableSFTTrainer` step (plain SGD): only δ (or M) moves; the gradient on M's diagonal is the gradient on δ,
    so M's diagonal moves exactly as δ does, and its off-diagonal entries (mixing the frozen vectors) move too."""
    from sft_helpers import GLOBAL_BATCH, one_step_update

    updates = {}
    for mode in ("diagonal", "matrix"):
        config = StableLoraConfig(r=64, target_modules=["q_proj", "down_proj"], use_svd=True, svd_trainable=mode)
        update, trainer = one_step_update(tmp_path / mode, GLOBAL_BATCH, 1, peft_config=config, optim="sgd")
        names = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
        assert names and all(".lora_svd_delta." in n for n in names)
        updates[mode] = update
    diagonal, matrix = updates["diagonal"].view(-1, 64), updates["matrix"].view(-1, 64, 64)
    assert diagonal.abs().min() > 0  # every singular value of every layer moved
    torch.testing.assert_close(matrix.diagonal(dim1=1, dim2=2), diagonal, atol=1e-7, rtol=1e-5)
    off = matrix - torch.diag_embed(matrix.diagonal(dim1=1, dim2=2))
    assert off.abs().max() > 0.1 * diagonal.abs().max()
