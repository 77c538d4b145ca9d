"""The flag-effect matrix of `StableLoraConfig`: every field hf_stable adds to PEFT's `LoraConfig`, with the variant
that reads it switched on, changes what a short `StableSFTTrainer` run produces (the parameter update) or is refused
at construction with a message naming it; switched off, a variant's setting is refused by name.

The field list is generated from the dataclass, so a new field without a case here fails
`test_every_field_is_covered`. A field's variant is the one its name starts with (`map_...`, `sine_...`, the
convention `StableLoraConfig` itself enforces); the variant switches themselves are tried against plain LoRA.
"""

import dataclasses

import pytest
import torch
from peft import LoraConfig
from sft_helpers import GLOBAL_BATCH, one_step_update

from hf_stable._peft_hook import ADAPTER_VARIANTS
from hf_stable.adapters import StableLoraConfig


FIELDS = sorted(
    {f.name for f in dataclasses.fields(StableLoraConfig)} - {f.name for f in dataclasses.fields(LoraConfig)}
)

# the value each field takes in its case (its default is the reference)
ALTERNATIVES = {
    "use_map": True,
    "use_sine": True,
    "map_init_b_std": 0.1,
    "map_scalar_lr": 0.25,
    "sine_freq": 20.0,
    "sine_g": 2.0,
    "use_svd": True,
    "svd_trainable": "matrix",
}
# Fields that change neither, one reason each.
ALLOWLIST = {
    "hf_stable_version": "metadata: `to_dict` stamps the version that saved the adapter, `check_adapter` reports it; "
    "no computation reads it",
}
# Short runs longer than one step, with the reason.
STEPS = {
    # ‖W0‖·b·BA/‖BA‖ is invariant to B's scale and b = 0 at step 0: the first step is the same for every std (same
    # draw, scaled); the second step's gradient on A and B is ∝ 1/std.
    "map_init_b_std": 2,
}
# plain LoRA's settings under every case (the tiny model's linear layers, no dropout: the update is deterministic)
LORA = {"r": 4, "target_modules": ["q_proj", "v_proj", "gate_proj", "down_proj"], "lora_dropout": 0.0}


def _variant_of(field: str) -> str | None:
    return next((name for name in ADAPTER_VARIANTS if field.startswith(f"{name}_")), None)


def test_every_field_is_covered():
    """A field without a case (or an allowlist entry with its reason) fails here."""
    uncovered = [f for f in FIELDS if f not in ALTERNATIVES and f not in ALLOWLIST]
    assert not uncovered, f"StableLoraConfig fields without a flag-effect case: {uncovered}"
    assert not (set(ALTERNATIVES) | set(ALLOWLIST)) - set(FIELDS)  # no stale entries
    assert all(reason for reason in ALLOWLIST.values())
    switches = set(ADAPTER_VARIANTS.values())
    # every other field belongs to one variant by its name, so the inert-setting refusal below covers it
    assert all(f in switches or _variant_of(f) or f in ALLOWLIST for f in FIELDS)


def _base(field: str) -> dict:
    variant = _variant_of(field)
    return {ADAPTER_VARIANTS[variant]: True} if variant else {}


def _update(tmp_path, steps, **fields):
    config = StableLoraConfig(**LORA, **fields)
    update, trainer = one_step_update(tmp_path, GLOBAL_BATCH, 1, peft_config=config, max_steps=steps)
    assert torch.isfinite(update).all()
    names = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    return update, names


@pytest.mark.slow
@pytest.mark.parametrize("field", [f for f in FIELDS if f in ALTERNATIVES])
def test_changing_a_field_changes_the_update_or_is_refused(tmp_path, field):
    base, value, steps = _base(field), ALTERNATIVES[field], STEPS.get(field, 1)
    default = StableLoraConfig.__dataclass_fields__[field].default
    assert value != default and base.get(field, default) != value
    reference, reference_names = _update(tmp_path / "base", steps, **base)
    try:
        changed, changed_names = _update(tmp_path / "changed", steps, **{**base, field: value})
    except ValueError as error:
        assert f"`{field}`" in str(error), str(error)
        return
    if changed_names == reference_names:
        assert not torch.equal(changed, reference), f"{field}={value!r} does not change the update"
    else:  # a variant switch adds its own parameters: the update is another vector altogether
        assert field in ADAPTER_VARIANTS.values()
        assert changed.abs().max() > 0


@pytest.mark.parametrize(
    ("field", "switch"),
    [
        (f, s)
        for f in ALTERNATIVES
        if _variant_of(f)
        for s in [None, *ADAPTER_VARIANTS.values()]
        if s != ADAPTER_VARIANTS[_variant_of(f)]
    ],
)
def test_a_variant_setting_without_its_variant_is_refused_by_name(field, switch):
    """`sine_freq` under MAP (or plain LoRA) would do nothing: refused, naming the field and its switch."""
    own = ADAPTER_VARIANTS[_variant_of(field)]
    with pytest.raises(ValueError, match=rf"`{field}`=.* only acts with `{own}=True`"):
        StableLoraConfig(**LORA, **{field: ALTERNATIVES[field]}, **({switch: True} if switch else {}))
