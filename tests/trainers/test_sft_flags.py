"""The flag-effect matrix of `StableSFTConfig`: every field that `trl.SFTConfig` does not define, with a method that
reads it active, either changes the parameter update of a short run or is refused at construction with a message
naming it.

The field list is generated from the dataclass, so a new field without a case here fails
`test_every_sft_field_is_covered`. A case's base is the reader's activation (`Registry.activation`) plus `BASES`; its
alternative value is in `ALTERNATIVES`. Values follow `sft_helpers.OBJECTIVES` (every term matters on a random model,
p ≈ 0.012).
"""

import dataclasses

import pytest
from flag_helpers import added_fields, assert_changes_or_refused, assert_covered, reader_activation
from sft_helpers import GLOBAL_BATCH, one_step_update
from trl import SFTConfig

from hf_stable import StableSFTConfig
from hf_stable.losses.sft import SFT_OBJECTIVES
from hf_stable.stability.config import StabilityConfigMixin
from hf_stable.trainers.sft_config import SFT_REGISTRIES


FIELDS = added_fields(StableSFTConfig, SFTConfig)

ALTERNATIVES = {
    "sft_objective": "prob_power",
    "sequence_objective": "redi",
    "sample_reweighting": "feasible",
    "objective_alpha": 0.5,
    "threshold": 0.02,
    "threshold_kind": "bottom_p",
    "threshold_normalization": "supervised",
    "threshold_quantile": 0.8,
    "auto_probe_batches": 1,
    "auto_rule": {"strong_median": 0.001},  # the random model's median p ≈ 0.012 becomes "model-strong"
    "redi_pos_weight": 0.5,
    "redi_neg_weight": 0.2,
    "redi_neg_weighting_gamma": 1.0,
    "redi_reduction": "sequence",
    "fl_epsilon": 10.0,
    "fl_target_prob": 0.01,
    "fl_dual_lr": 0.1,
    "fl_resilient_rho": None,
    "fl_init": 2.0,
}
# Fields that change neither the update nor a refusal: one reason each.
ALLOWLIST: dict[str, str] = {
    f.name: "a stability field: its effect is tested in tests/stability/test_stability_config_flags.py"
    for f in dataclasses.fields(StabilityConfigMixin)
}

_THRESHOLD = {"sft_objective": "threshold", "threshold": 0.012}
_QUANTILE = {"sft_objective": "threshold", "threshold": None, "threshold_quantile": 0.2}
_TWO_STEPS = {"max_steps": 2}  # Feasible Learning's multipliers move after the first step
BASES = {
    "threshold": _THRESHOLD,
    "threshold_kind": _THRESHOLD,
    "threshold_normalization": _THRESHOLD,
    "threshold_quantile": _QUANTILE,
    # four batches of two: one probe batch sees a quarter of the data
    "auto_probe_batches": {**_QUANTILE, "threshold_quantile": 0.5, "_batch_size": 2},
    "fl_epsilon": _TWO_STEPS,
    "fl_target_prob": _TWO_STEPS,
    "fl_dual_lr": _TWO_STEPS,
    "fl_resilient_rho": _TWO_STEPS,
}


def test_every_sft_field_is_covered():
    """A field without a case (or an allowlist entry with its reason) fails here."""
    assert_covered(FIELDS, ALTERNATIVES, ALLOWLIST, "StableSFTConfig")
    assert "threshold_kind" in {f.name for f in SFT_OBJECTIVES.get("threshold").fields}


def _update(tmp_path, config):
    config = dict(config)
    batch = config.pop("_batch_size", GLOBAL_BATCH)
    delta, _ = one_step_update(tmp_path, batch, GLOBAL_BATCH // batch, **config)
    return delta


@pytest.mark.slow
@pytest.mark.parametrize("field", [f for f in FIELDS if f not in ALLOWLIST])
def test_changing_an_sft_field_changes_the_update_or_is_refused(tmp_path, field):
    base = {**reader_activation(SFT_REGISTRIES, field), **BASES.get(field, {})}
    default = getattr(StableSFTConfig, field, None)
    assert_changes_or_refused(
        lambda name, config: _update(tmp_path / name, config), field, base, ALTERNATIVES[field], default
    )
