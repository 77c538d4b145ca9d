"""`StableLoraConfig`: refused combinations, value checks, warnings, serialisation."""

import json
import math
import warnings

import pytest
import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora.layer import Linear as LoraLinear

from hf_stable.adapters import StableLoraConfig, check_adapter
from hf_stable.adapters.layers import StableLinear


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 6)

    def forward(self, x):
        return self.proj(x)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"use_map": True, "use_dora": True}, r"`use_dora` cannot be combined with `use_map`"),
        ({"use_sine": True, "use_dora": True}, r"`use_dora` cannot be combined with `use_sine`"),
        ({"use_map": True, "use_sine": True}, r"`use_map` and `use_sine` cannot be combined"),
        ({"use_map": True, "lora_bias": True}, r"`lora_bias=True` is not supported with `use_map`"),
        ({"use_sine": True, "lora_bias": True}, r"`lora_bias=True` is not supported with `use_sine`"),
        (
            {"use_map": True, "alora_invocation_tokens": [1, 2], "task_type": "CAUSAL_LM"},
            r"`use_map` cannot be combined with .*alora",
        ),
        (
            {"use_sine": True, "init_lora_weights": "mica"},
            r"`init_lora_weights`='mica' cannot be used with `use_sine`",
        ),
    ],
)
def test_refused_combinations(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StableLoraConfig(r=2, target_modules=["proj"], **kwargs)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("map_init_b_std", 0.0),
        ("map_init_b_std", -1e-3),
        ("map_init_b_std", math.nan),
        ("map_scalar_lr", 0.0),
        ("map_scalar_lr", -1.0),
        ("sine_freq", 0.0),
        ("sine_freq", -3.0),
        ("sine_freq", math.inf),
        ("sine_g", "foo"),
        ("sine_g", 0.0),
        ("sine_g", -2.0),
        ("sine_g", "-1"),
        ("sine_g", math.nan),
    ],
)
def test_bad_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"`{field}`"):
        StableLoraConfig(r=2, target_modules=["proj"], **{field: value})


def test_numeric_sine_g_string_becomes_float():
    assert StableLoraConfig(r=2, use_sine=True, sine_g="2.5").sine_g == 2.5


@pytest.mark.parametrize("kwargs", [{"lora_alpha": 16}, {"use_rslora": True}, {"alpha_pattern": {"proj": 4}}])
def test_scale_settings_warn_under_map(kwargs):
    with pytest.warns(UserWarning, match="no effect under MAP"):
        StableLoraConfig(r=2, use_map=True, **kwargs)


def test_no_warning_by_default_or_without_map():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        StableLoraConfig(r=2, use_map=True)
        StableLoraConfig(r=2, use_sine=True, lora_alpha=16)
        StableLoraConfig(r=2, lora_alpha=16, use_rslora=True)


def test_variant_registers_stable_layers_plain_config_does_not():
    model = get_peft_model(Tiny(), StableLoraConfig(r=2, target_modules=["proj"], use_map=True))
    assert type(model.base_model.model.proj) is StableLinear
    model = get_peft_model(Tiny(), StableLoraConfig(r=2, target_modules=["proj"]))
    assert type(model.base_model.model.proj) is LoraLinear  # no variant: exactly PEFT's LoRA


def test_to_dict_stamps_version_and_round_trips():
    from hf_stable import __version__

    config = StableLoraConfig(r=4, target_modules=["proj"], use_sine=True, sine_freq=30.0, sine_g=3.0)
    values = json.loads(json.dumps(config.to_dict(), default=list))
    assert values["hf_stable_version"] == __version__ and values["use_sine"] is True
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no unknown keys, no MAP warning
        again = StableLoraConfig.from_saved_dict(values)
    assert (again.use_sine, again.sine_freq, again.sine_g, again.r) == (True, 30.0, 3.0, 4)
    assert again._custom_modules  # the layers are registered again on load
    assert "hf_stable_version" not in LoraConfig(r=2).to_dict()


def test_saved_map_config_loads_without_repeating_the_scale_warning():
    with pytest.warns(UserWarning):
        values = StableLoraConfig(r=2, use_map=True, lora_alpha=32).to_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert StableLoraConfig.from_saved_dict(values).use_map


def test_from_saved_dict_drops_unknown_keys_with_warning():
    values = {**StableLoraConfig(r=2, use_map=True).to_dict(), "from_the_future": 1}
    with pytest.warns(UserWarning, match="from_the_future"):
        assert StableLoraConfig.from_saved_dict(values).use_map


def test_check_adapter_plain_lora(tmp_path):
    model = get_peft_model(Tiny(), LoraConfig(r=2, target_modules=["proj"]))
    model.save_pretrained(tmp_path)
    report = check_adapter(str(tmp_path))
    assert report["variants"] == [] and report["needs_hf_stable"] is False and report["peft_type"] == "LORA"
    with pytest.raises(FileNotFoundError, match=r"adapter_config\.json"):
        check_adapter(str(tmp_path / "missing"))


def test_8bit_base_is_refused():
    bnb = pytest.importorskip("bitsandbytes")

    class Tiny8(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = bnb.nn.Linear8bitLt(8, 6, has_fp16_weights=False)

    with pytest.raises(ValueError, match="not 8-bit"):
        get_peft_model(Tiny8(), StableLoraConfig(r=2, target_modules=["proj"], use_map=True))


def test_embedding_target_is_refused_clearly():
    class WithEmbedding(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(10, 8)

    with pytest.raises(ValueError, match="not embeddings"):
        get_peft_model(WithEmbedding(), StableLoraConfig(r=2, target_modules=["embed"], use_sine=True))


def _peft_init_values():
    """Every `init_lora_weights` value PEFT declares (its type annotation), plus the ones its dispatcher reads by
    prefix or documents outside the annotation: a new PEFT init shows up here and must be classified."""
    import typing

    hint = typing.get_type_hints(LoraConfig)["init_lora_weights"]
    values = [True, False]
    for arg in typing.get_args(hint):
        values += [v.replace("[number of iters]", "4") for v in typing.get_args(arg)]
    return [*dict.fromkeys([*values, "lora_ga", "corda_kpm"])]


BASE_MODIFYING = {"pissa", "pissa_niter_4", "olora", "corda", "corda_kpm", "lora_ga", "loftq"}


def test_every_peft_init_is_classified():
    from hf_stable.adapters.config import BASE_PRESERVING_INITS, REFUSED_INITS

    for value in _peft_init_values():
        assert value in BASE_PRESERVING_INITS or any(str(value).startswith(k) for k in REFUSED_INITS), value
    assert BASE_MODIFYING <= set(_peft_init_values())


@pytest.mark.parametrize("variant", ["use_map", "use_sine"])
@pytest.mark.parametrize("init", [v for v in _peft_init_values() if v not in (True, False, "gaussian", "orthogonal")])
def test_inits_other_than_base_preserving_are_refused_by_name(variant, init):
    extra = {"loftq_config": {"loftq_bits": 4}} if init == "loftq" else {}
    with pytest.raises(ValueError, match=rf"`init_lora_weights`={init!r} cannot be used with `{variant}`") as error:
        StableLoraConfig(r=2, target_modules=["proj"], init_lora_weights=init, **{variant: True}, **extra)
    if init in BASE_MODIFYING:
        assert "step 0 would not be the base model" in str(error.value)
    # plain LoRA keeps PEFT's behaviour
    StableLoraConfig(r=2, target_modules=["proj"], init_lora_weights=init, **extra)


@pytest.mark.parametrize("variant", ["use_map", "use_sine"])
@pytest.mark.parametrize("init", [True, False, "gaussian", "orthogonal"])
def test_base_preserving_inits_give_the_base_model_at_step_0(variant, init):
    torch.manual_seed(0)
    model = Tiny()
    x = torch.randn(5, 8)
    with torch.no_grad():
        expected = model(x)
        adapted = get_peft_model(
            model, StableLoraConfig(r=2, target_modules=["proj"], init_lora_weights=init, **{variant: True})
        )(x)
    if init is False and variant == "use_sine":  # PEFT's debugging init: random A and B, not a no-op by design
        assert not torch.equal(adapted, expected)
    elif init == "orthogonal" and variant == "use_sine":  # B A = 0 up to round-off, then sin(ω·BA)·s/g
        torch.testing.assert_close(adapted, expected, rtol=0, atol=1e-6)
    else:
        assert torch.equal(adapted, expected)


def test_pissa_would_have_moved_the_step_0_model():
    """The reason for the refusal, measured on the same layer: plain LoRA with PiSSA rewrites W0."""
    torch.manual_seed(0)
    model = Tiny()
    w0 = model.proj.weight.detach().clone()
    get_peft_model(model, LoraConfig(r=2, target_modules=["proj"], init_lora_weights="pissa"))
    assert not torch.equal(model.proj.base_layer.weight, w0)
