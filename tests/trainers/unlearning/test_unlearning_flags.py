"""The flag-effect matrix of `UnlearningConfig`: every field that `TrainingArguments` does not define, with a method
that reads it active, either changes what a short run produces (the parameter update, or for reporting fields the
report) or is refused at construction with a message naming it.

The field list is generated from the dataclass, so a new field without a case here fails
`test_every_field_is_covered`. The base of a case is the method that reads the field (from the declarations for the
generated fields; `BASES` for the shared ones) plus `OVERRIDES`; its alternative value is in `ALTERNATIVES`.
"""

import dataclasses

import pytest
import torch
from transformers import TrainingArguments
from unlearn_helpers import GLOBAL_BATCH, METHODS, split_data, unlearn_update

from hf_stable import UnlearningConfig
from hf_stable.losses.unlearning import FORGET_LOSSES
from hf_stable.stability.options import OPTIONS_KEY
from hf_stable.testing import build_tiny_model
from hf_stable.trainers.unlearning.methods import UNLEARNING_METHODS, forget_loss_name


FIELDS = sorted(
    {f.name for f in dataclasses.fields(UnlearningConfig)} - {f.name for f in dataclasses.fields(TrainingArguments)}
)

# the value each field takes in its case (its default, or the base's value, is the reference)
ALTERNATIVES = {
    "unlearn_method": "ga",
    "forget_weight": 0.5,
    "retain_weight": 0.5,
    "retain_loss_type": "kl",
    "anchor": "retain",
    "max_length": 10,  # rows are 11-13 tokens: truncates the answers, keeps some
    "bounded_lora": True,
    "bounded_omega": 50.0,
    "bounded_lora_r": 4,
    "bounded_lora_alpha": 8.0,
    "bounded_targets": ["gate_proj"],
    "collapse_guard": False,
    "collapse_retain_factor": 1e-9,
    "collapse_retain_floor": 1e9,
    "collapse_forget_floor": 1e9,
    "collapse_check_steps": 1,
    "collapse_restore_best": True,
    "forget_reduction": "sequence",
    "npo_beta": 0.5,
    "simnpo_beta": 1.0,
    "simnpo_margin": 1.0,
    "sga_rate": "0.5",
    "dmm_temperature": 2.0,
    "sga_num_normal": 1,
    "sga_rate_range": [-2.0, 2.0],
    "sga_normal_source": "retain_similar",
    "pdu_eps": 2.0,
    "pdu_lambda0": 5.0,
    "pdu_dual_lr": 1.0,
    "pdu_dual_update": "epoch",
    "pdu_warmup_steps": 1,
    "pdu_forget_loss": "ga",
    "stableun_rho": 0.5,
    "stableun_points": "sam",
    "stableun_sigma": 0.05,
    "stableun_project": False,
    "stableun_base_loss": "npo",
    "dmm_target": "prior",
    "dmm_retain_fraction": 0.2,
    # stability fields (hf_stable.stability.config): the guard clips globally itself, component clipping binds
    "stability_guard_kwargs": {"guard_clip_norm": 1e-4},
    "component_clip_max_norm": 1e-3,
    "component_clip_groups": "layer",
    "stable_spam": True,
}

# Fields whose effect is on a report or the logs, not on the weights: the case checks that observable instead.
REPORTED = {
    "relearn_probe_steps": (2, "relearning probe: fine-tunes a copy after training, reported in relearn_report"),
    "relearn_probe_lr": (1e-1, "relearning probe learning rate: relearn_report"),
    "relearn_probe_fraction": (0.25, "relearning probe split: relearn_report"),
    "unlearn_eval_steps": (1, "periodic evaluate_unlearning: metrics in the logs"),
    "stability_guard": (True, "StabilityGuardCallback attached: stable/guard/* metrics in the logs"),
}
# Fields that change neither: one reason each (and where their equivalence is tested).
ALLOWLIST = {
    "precompute_ref_logps": "a cache: S_ref of the same reference either way "
    "(test_unlearning_reference.py::test_precompute_ref_logps_is_only_a_cache)",
    "no_gradient_check": "a detector: raises NoGradientError when no parameter gets a gradient, else no effect "
    "(test_stability_config_flags.py::test_no_gradient_check_raises_naming_the_patched_forward, "
    "test_stability_own_forward.py)",
    # the options generated from the stability callbacks' options classes (the two component_clip_ cases above stay)
    **{
        name: "a generated stability option: its value reaches its callback "
        "(tests/stability/test_stability_options.py::test_each_generated_field_reaches_its_callback)"
        for name in getattr(UnlearningConfig, OPTIONS_KEY)
        if name not in ("component_clip_max_norm", "component_clip_groups")
    },
}

_TRIPS = {"collapse_guard": True, "learning_rate": 1e-3, "collapse_check_steps": 1, "collapse_retain_floor": 0.0}
# base configs of the shared (hand-written) fields
BASES = {
    "bounded_omega": {"bounded_lora": True, "learning_rate": 0.1},
    "bounded_lora_r": {"bounded_lora": True, "learning_rate": 0.1},
    "bounded_lora_alpha": {"bounded_lora": True, "learning_rate": 0.1},
    "bounded_targets": {"bounded_lora": True, "learning_rate": 0.1},
    "bounded_lora": {"learning_rate": 0.1},
    # the guard trips at its first check and restores the start: a zero update instead of a step
    "collapse_guard": {**_TRIPS, "collapse_retain_factor": 1e-9, "collapse_restore_best": True},
    "collapse_retain_factor": {**_TRIPS, "collapse_restore_best": True},
    "collapse_retain_floor": {**_TRIPS, "collapse_retain_factor": 1e-9, "collapse_restore_best": True},
    "collapse_forget_floor": {**_TRIPS, "collapse_retain_factor": 1e9, "collapse_restore_best": True},
    "collapse_check_steps": {
        **_TRIPS,
        "collapse_check_steps": 10,
        "collapse_retain_factor": 1e-9,
        "collapse_restore_best": True,
    },
    "collapse_restore_best": {**_TRIPS, "collapse_retain_factor": 1e-9},
    "relearn_probe_lr": {"relearn_probe_steps": 2},
    "stability_guard_kwargs": {"stability_guard": True},
    "stable_spam": {"optim": "adamw_torch", "learning_rate": 1e-3, "max_steps": 3},  # AdamW's first step is sign(g)
    "component_clip_groups": {"component_clip_max_norm": 1e-3},
    "relearn_probe_fraction": {"relearn_probe_steps": 2},
}
# settings a method's case needs beyond its name (the METHODS presets make every term matter on a random model)
METHOD_BASES = {
    "npo": {"max_steps": 2, "learning_rate": 0.1},  # at θ = θ_ref NPO's weight is 1 for every β: β acts from step 2
    "pdu": {**METHODS["pdu"], "learning_rate": 1e-2, "max_steps": 2},  # ε, η, warm-up act through the next step
    "simnpo": METHODS["simnpo"],
    "stableun": METHODS["stableun"],
    "sga": METHODS["sga"],
}
# the field's own preconditions within its method
OVERRIDES = {
    "sga_rate_range": {"sga_rate": "auto"},
    "stableun_sigma": {"stableun_points": "sam+gauss", "stableun_sigma": 0.01},
    "stableun_project": {"stableun_base_loss": "ga"},  # ascent against the retain NLL: the gradients conflict
    "collapse_forget_floor": {},
}
# fields every method reads: their case runs under every method
EVERY_METHOD = ("forget_weight", "retain_weight")
HOLDOUT = {"collapse_forget_floor", "unlearn_eval_steps"}


def _reader(field: str) -> str | None:
    """The first method that reads a declared field (directly, or through its forget loss)."""
    for method in UNLEARNING_METHODS:
        if any(f.name == field for f in method.fields):
            return method.name
    loss = next((loss.name for loss in FORGET_LOSSES if any(f.name == field for f in loss.fields)), None)
    if loss is None:
        return None
    for method in UNLEARNING_METHODS:
        config = type(
            "C",
            (),
            {
                **METHOD_BASES.get(method.name, {}),
                "unlearn_method": method.name,
                "pdu_forget_loss": "flatten",
                "stableun_base_loss": "simnpo",
            },
        )
        if forget_loss_name(config) == loss:
            return method.name
    raise AssertionError(f"no method uses forget loss {loss!r}")


def _cases():
    cases = []
    for field in FIELDS:
        if field in ALLOWLIST:
            continue
        methods = [m.name for m in UNLEARNING_METHODS] if field in EVERY_METHOD else [_reader(field) or "graddiff"]
        for method in methods:
            cases.append(pytest.param(field, method, id=f"{field}-{method}"))
    return cases


def test_every_field_is_covered():
    """A field without a case (or an allowlist entry with its reason) fails here."""
    uncovered = [f for f in FIELDS if f not in ALTERNATIVES and f not in REPORTED and f not in ALLOWLIST]
    assert not uncovered, f"UnlearningConfig fields without a flag-effect case: {uncovered}"
    assert not (set(ALTERNATIVES) | set(REPORTED) | set(ALLOWLIST)) - set(FIELDS)  # no stale entries
    assert all(reason for reason in ALLOWLIST.values())


def _run(tmp_path, method, config):
    kwargs = {}
    if method == "dmm":
        kwargs["oracle_model"] = build_tiny_model(seed=1)[0]
    if config.pop("_holdout", False):
        kwargs["holdout_dataset"] = split_data(seed=11)[1]
    update, trainer = unlearn_update(tmp_path, GLOBAL_BATCH, 1, trainer_kwargs=kwargs, **config)
    assert torch.isfinite(update).all()
    logged = sorted(
        {key for log in trainer.state.log_history for key in log if "/eval/" in key or key.startswith("stable/guard/")}
    )
    return update, trainer.relearn_report, logged


@pytest.mark.slow
@pytest.mark.parametrize(("field", "method"), _cases())
def test_changing_a_field_changes_the_run_or_is_refused(tmp_path, field, method):
    base = {
        "unlearn_method": method,
        **METHOD_BASES.get(method, {}),
        **BASES.get(field, {}),
        **OVERRIDES.get(field, {}),
    }
    if field in HOLDOUT:
        base["_holdout"] = True
    value = REPORTED[field][0] if field in REPORTED else ALTERNATIVES[field]
    assert base.get(field) != value
    reference = _run(tmp_path / "base", method, dict(base))
    try:
        changed = _run(tmp_path / "changed", method, {**base, field: value})
    except ValueError as error:
        assert f"`{field}`" in str(error) or f"{field}=" in str(error), str(error)
        return
    if field in REPORTED:
        assert changed[1:] != reference[1:], f"{field}={value!r} changed no report"
    else:
        assert not torch.equal(changed[0], reference[0]), f"{field}={value!r} left the update unchanged"
