"""MAP on a bitsandbytes 4-bit (nf4) base: layer type, exact forward, refusals, dequantising export.

bitsandbytes on CPU repacks a 4-bit weight in place on the first no-grad eval forward and then computes in bf16
(~2e-3 error per layer), so exact comparisons run the model in train mode with `lora_dropout=0` (train mode takes the
exact dequantised fp32 path). The reference W0 is decoded with `bitsandbytes.functional.dequantize_4bit` before any
eval forward.
"""

import copy
import json
import logging
import os

import pytest
import torch


bnb = pytest.importorskip("bitsandbytes")

from peft import get_peft_model  # noqa: E402
from peft.tuners.lora.bnb import Linear4bit as PeftLinear4bit  # noqa: E402
from transformers import AutoModelForCausalLM, BitsAndBytesConfig  # noqa: E402

from hf_stable.adapters import StableLoraConfig, merge_and_export  # noqa: E402
from hf_stable.adapters._quant import dequantized_weight  # noqa: E402
from hf_stable.adapters.map import MapLinearVariant  # noqa: E402


MLP = ["gate_proj", "up_proj", "down_proj"]


def load_4bit(path, double_quant=False):
    config = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=torch.float32,
        bnb_4bit_use_double_quant=double_quant,
    )
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=config)


def reference_w0(linear4bit) -> torch.Tensor:
    """The canonical (not CPU-repacked) 4-bit weight decoded by bitsandbytes itself, float64 `(out, in)`."""
    weight = linear4bit.weight
    assert not getattr(weight.quant_state, "packing_format_for_cpu", False)
    return bnb.functional.dequantize_4bit(weight.data, weight.quant_state).double()


def map_config(**kwargs):
    return StableLoraConfig(r=4, target_modules=MLP, use_map=True, lora_dropout=0.0, **kwargs)


def randomise(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "lora_map_a") and "default" in module.lora_map_a:
                module.lora_map_a["default"].fill_(0.2 * torch.randn((), generator=g).item())
                module.lora_map_b["default"].fill_(0.5 * torch.randn((), generator=g).item())
                for w in (module.lora_A["default"].weight, module.lora_B["default"].weight):
                    w.copy_(torch.randn(w.shape, generator=g))


@pytest.fixture
def quantized(tiny_model_dir):
    return load_4bit(tiny_model_dir)


def test_map_layer_is_the_4bit_subclass(quantized):
    from hf_stable.adapters import layers

    model = get_peft_model(quantized, map_config())
    layer = model.base_model.model.model.layers[0].mlp.gate_proj
    assert type(layer) is layers.StableLinear4bit
    assert type(layer).__name__ == "StableLinear4bit" and isinstance(layer, PeftLinear4bit)
    assert isinstance(layer.get_base_layer(), bnb.nn.Linear4bit)
    assert isinstance(layer.lora_variant["default"], MapLinearVariant)


def test_forward_equals_dense_formula_on_dequantized_w0(quantized):
    base = quantized.model.layers[0].mlp.up_proj
    w0 = reference_w0(base)
    model = get_peft_model(quantized, map_config())
    randomise(model)
    model.train()
    layer = model.base_model.model.model.layers[0].mlp.up_proj
    assert layer._map_w0_norm["default"] == pytest.approx(torch.linalg.matrix_norm(w0).item(), rel=1e-6)
    a, b = layer.lora_map_a["default"].double(), layer.lora_map_b["default"].double()
    ba = layer.lora_B["default"].weight.double() @ layer.lora_A["default"].weight.double()
    weight = (1 + a) * w0 + torch.linalg.matrix_norm(w0) * b * ba / torch.linalg.matrix_norm(ba)
    x = torch.randn(3, 5, w0.shape[1])
    with torch.no_grad():
        out = layer(x)
    torch.testing.assert_close(out.double(), x.double() @ weight.T, atol=1e-5, rtol=0)


def test_sine_on_4bit_is_refused(quantized):
    with pytest.raises(ValueError, match="`use_sine` is not supported on a 4-bit"):
        get_peft_model(quantized, StableLoraConfig(r=4, target_modules=MLP, use_sine=True))


def test_in_place_merge_is_refused(quantized):
    model = get_peft_model(quantized, map_config())
    with pytest.raises(ValueError, match="merge_and_export"):
        model.merge_adapter()


def reference_w0_bf16_scales(linear4bit) -> torch.Tensor:
    """What the weight becomes once repacked for the CPU kernel: the same codes with the block scales (`absmax`,
    expanded if double-quantised) rounded to bf16, decoded by bitsandbytes."""
    weight = linear4bit.weight
    state = copy.copy(weight.quant_state)
    absmax = state.absmax
    if state.nested:
        absmax = bnb.functional.dequantize_blockwise(state.absmax, state.state2) + state.offset
    state.absmax, state.nested, state.offset, state.state2 = absmax.to(torch.bfloat16).float(), False, None, None
    return bnb.functional.dequantize_4bit(weight.data.clone(), state).double()


def repack(model):
    """One no-grad eval forward, which repacks the 4-bit weights for the CPU kernel (forced on CPUs without
    AVX512-BF16, where bitsandbytes would not)."""
    model.eval()
    with torch.no_grad():
        model(input_ids=torch.tensor([[8, 9, 10]]))
    for module in model.modules():
        if not isinstance(module, bnb.nn.Linear4bit):
            continue
        # bitsandbytes 0.50.2 sets the flag only on a packed state (reading it otherwise raises AttributeError)
        if not getattr(module.weight.quant_state, "packing_format_for_cpu", False):
            weight = module.weight
            weight.data, weight.quant_state = bnb.functional._convert_weight_packed_for_cpu(
                weight.data, weight.quant_state
            )


@pytest.mark.parametrize("double_quant", [False, True])
def test_w0_norm_survives_the_cpu_repacking(tiny_model_dir, double_quant):
    quantized = load_4bit(tiny_model_dir, double_quant=double_quant)
    layers = [quantized.model.layers[i].mlp.down_proj for i in range(2)]
    loaded = [reference_w0(layer) for layer in layers]
    repacked = [reference_w0_bf16_scales(layer) for layer in layers]
    ids = torch.tensor([[11, 12, 13, 14]])
    repack(quantized)
    assert all(layer.weight.quant_state.packing_format_for_cpu for layer in layers)
    with torch.no_grad():
        eval_logits = quantized(input_ids=ids).logits

    model = get_peft_model(quantized, map_config())
    for i in range(2):
        layer = model.base_model.model.model.layers[i].mlp.down_proj
        decoded = dequantized_weight(layer.get_base_layer()).double()
        torch.testing.assert_close(decoded, repacked[i], atol=0, rtol=0)
        norm = torch.linalg.matrix_norm(repacked[i]).item()
        assert layer._map_w0_norm["default"] == pytest.approx(norm, rel=1e-6)
        # the bf16 block scales move the weight by at most 2⁻⁹ relative: the loaded W0 is not recoverable exactly
        assert norm == pytest.approx(torch.linalg.matrix_norm(loaded[i]).item(), rel=2**-8)
        assert layer.get_base_layer().weight.quant_state.packing_format_for_cpu  # decoding left the layer alone
    with torch.no_grad(), model.disable_adapter():
        torch.testing.assert_close(model(input_ids=ids).logits, eval_logits, atol=0, rtol=0)


def test_unpack_restores_the_canonical_layout(tiny_model_dir):
    from hf_stable.adapters._quant import unpack_cpu_4bit_

    quantized = load_4bit(tiny_model_dir, double_quant=True)
    layer = quantized.model.layers[0].mlp.gate_proj
    repacked = reference_w0_bf16_scales(layer)
    ids = torch.tensor([[11, 12, 13, 14]])
    repack(quantized)
    with torch.no_grad():
        eval_logits = quantized(input_ids=ids).logits
    for module in quantized.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            unpack_cpu_4bit_(module)
    assert not layer.weight.quant_state.packing_format_for_cpu
    decoded = bnb.functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state).double()
    torch.testing.assert_close(decoded, repacked, atol=0, rtol=0)
    repack(quantized)  # and packs again to the same thing
    with torch.no_grad():
        torch.testing.assert_close(quantized(input_ids=ids).logits, eval_logits, atol=0, rtol=0)


def test_merge_and_export_dequantizes_and_reproduces_train_mode_logits(quantized, tmp_path, caplog):
    untouched = reference_w0(quantized.model.layers[1].self_attn.q_proj)  # quantised, not adapted
    model = get_peft_model(quantized, map_config())
    randomise(model, seed=1)
    model.train()  # the exact fp32 path (dropout is 0)
    ids = torch.randint(7, model.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    out = tmp_path / "export"
    with caplog.at_level(logging.WARNING, logger="hf_stable.adapters.loading"):
        result = merge_and_export(model, str(out))
    assert result == {"output_dir": str(out), "dequantized": True}
    assert any("dequantising" in r.getMessage() for r in caplog.records)
    assert sorted(os.listdir(tmp_path)) == ["export"]
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config

    exported = AutoModelForCausalLM.from_pretrained(out)
    assert not any(type(m).__module__.startswith("bitsandbytes") for m in exported.modules())
    assert all(p.dtype == torch.float32 for p in exported.parameters())
    torch.testing.assert_close(exported.model.layers[1].self_attn.q_proj.weight.double(), untouched, atol=0, rtol=0)
    exported.eval()
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=ids).logits, logits, atol=1e-5, rtol=0)
