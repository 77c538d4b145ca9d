"""The options classes of the stability callbacks (`hf_stable.stability.callback_configs`), the config fields they
generate (`hf_stable.stability.options.config_fields`), and the deprecated `stability_guard_kwargs`."""

import ast
import dataclasses
import pathlib
import warnings

import pytest

import hf_stable
from hf_stable.callbacks import (
    ComponentClipCallback,
    GRPODegenerateRunCallback,
    StabilityGuardCallback,
    StableSPAMCallback,
)
from hf_stable.stability.callback_configs import (
    ComponentClipConfig,
    DegenerateRunConfig,
    GuardConfig,
    StableSPAMConfig,
)
from hf_stable.stability.config import GRPOStabilityConfigMixin, StabilityConfigMixin
from hf_stable.stability.options import OPTIONS_KEY, config_fields, option


CPU = dict(use_cpu=True, bf16=False, report_to="none")
FAMILIES = {
    "guard_": (GuardConfig, StabilityGuardCallback, {"stability_guard": True}),
    "component_clip_": (ComponentClipConfig, ComponentClipCallback, {"component_clip_max_norm": 0.5}),
    "degenerate_": (DegenerateRunConfig, GRPODegenerateRunCallback, {}),
    "stable_spam_": (StableSPAMConfig, StableSPAMCallback, {"stable_spam": True, "optim": "adamw_torch"}),
}
# a valid value other than the default, for every generated field: a new option without one fails below
ALTERNATIVES = {
    "guard_loss_z": 4.0,
    "guard_loss_ratio": 1.5,
    "guard_grad_z": 3.0,
    "guard_grad_ratio": 2.0,
    "guard_window": 64,
    "guard_min_history": 7,
    "guard_action": "skip",
    "guard_skips_before_rollback": 2,
    "guard_snapshot_every": 9,
    "guard_confirm_steps": 3,
    "guard_snapshot_history": 2,
    "guard_snapshot_storage": "disk",
    "guard_snapshot_scope": "all",
    "guard_scheduler_policy": "restore",
    "guard_lr_cooldown_factor": 0.5,
    "guard_lr_cooldown_steps": 7,
    "guard_max_rollbacks": 2,
    "guard_on_exhausted": "raise",
    "guard_clip_norm": 1.0,
    "component_clip_max_norm": 0.25,
    "component_clip_groups": "layer",
    "component_clip_then_global_max_norm": 1.0,
    "component_clip_mode": "adaptive",
    "component_clip_adaptive_warmup_steps": 3,
    "component_clip_adaptive_lambda_abs": 2.0,
    "component_clip_adaptive_lambda_rel": 1.5,
    "component_clip_adaptive_beta": 0.5,
    "degenerate_patience": 5,
    "degenerate_zero_std_min": 0.5,
    "degenerate_clipped_ratio_min": 0.5,
    "degenerate_entropy_min": 0.1,
    "degenerate_kl_max": 1.0,
    "stable_spam_gamma1": 0.5,
    "stable_spam_gamma2": 0.99,
    "stable_spam_theta": 0.9,
    "stable_spam_reset_interval": 10,
    "stable_spam_decay_steps": 100,
    "stable_spam_eta_min": 0.2,
}
# what a field needs besides itself to be valid and reach its callback
NEEDS = {
    "guard_clip_norm": {"max_grad_norm": 0.0},
    "component_clip_then_global_max_norm": {"max_grad_norm": 0.0},
    "stable_spam_eta_min": {"stable_spam_decay_steps": 100},
}


def test_every_option_with_a_flag_has_one_generated_field_with_its_help_and_default():
    generated = getattr(hf_stable.StableGRPOConfig, OPTIONS_KEY)
    assert set(generated) == set(ALTERNATIVES)
    fields = {f.name: f for f in dataclasses.fields(hf_stable.StableGRPOConfig)}
    for name, (prefix, opt) in generated.items():
        options_cls = FAMILIES[prefix][0]
        declared = {f.name: f for f in dataclasses.fields(options_cls)}[opt]
        assert fields[name].metadata["help"] == declared.metadata["help"].replace("%", "%%") or name == "guard_loss_z"
        expected = {"component_clip_max_norm": None, "guard_loss_z": None}.get(name, declared.default)
        assert fields[name].default == expected, name
    # options a config file cannot carry have no field
    assert not {"guard_name", "guard_probe_every", "component_clip_overrides", "degenerate_name"} & set(fields)


def _callback(trainer, cls):
    (callback,) = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, cls)]
    return callback


@pytest.mark.parametrize("field", sorted(ALTERNATIVES))
def test_each_generated_field_reaches_its_callback(tmp_path, field):
    """The field's value is the attached callback's option (the callbacks' own tests show what each option does)."""
    from stability_config_helpers import grpo_trainer

    prefix = next(p for p in FAMILIES if field.startswith(p))
    _, callback_cls, switch = FAMILIES[prefix]
    opt = getattr(hf_stable.StableGRPOConfig, OPTIONS_KEY)[field][1]
    extra = {"guard_min_history": 7} if field == "guard_window" else {}  # min_history <= window
    trainer = grpo_trainer(tmp_path, **{**switch, **NEEDS.get(field, {}), **extra, field: ALTERNATIVES[field]})
    callback = _callback(trainer, callback_cls)
    assert getattr(callback.config, opt) == ALTERNATIVES[field]
    default = _callback(grpo_trainer(tmp_path / "default", **switch), callback_cls).config
    assert getattr(default, opt) != ALTERNATIVES[field]


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"guard_window": 1, "stability_guard": True}, "`guard_window` must be an integer in"),
        ({"guard_action": "skip"}, "`guard_action` is set but `stability_guard` is False"),
        ({"stability_guard": True, "guard_window": 8}, "`min_history` must be an integer in \\[2, 8\\]"),
        ({"component_clip_mode": "adaptive"}, "`component_clip_mode` is set but component clipping is off"),
        ({"component_clip_max_norm": 1.0, "component_clip_mode": "auto"}, "`component_clip_mode`='auto'"),
        ({"stability_guard": True, "guard_action": "log", "stability_guard_kwargs": {"action": "skip"}},
         "`guard_action`='log' and `stability_guard_kwargs` {'action': 'skip'} disagree"),
    ],
)  # fmt: skip
def test_generated_fields_are_refused_by_name(config, match):
    with pytest.raises((ValueError, TypeError), match=match):
        hf_stable.StableSFTConfig("out", **CPU, **config)


def test_stability_guard_kwargs_still_works_for_one_release_and_names_the_new_fields():
    with pytest.warns(FutureWarning, match="set the config fields guard_action='skip', guard_min_history=5 instead"):
        args = hf_stable.StableSFTConfig(
            "out", **CPU, stability_guard=True, stability_guard_kwargs={"action": "skip", "min_history": 5}
        )
    assert (args.guard_action, args.guard_min_history) == ("skip", 5)
    assert args.guard_options()["action"] == "skip"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hf_stable.StableSFTConfig("out", **CPU, stability_guard=True, guard_action="skip")  # the new way: silent
    assert not [w for w in caught if "stability_guard_kwargs" in str(w.message)]


def test_options_classes_are_frozen_and_validate_each_field_by_name():
    config = GuardConfig(action="skip")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.action = "log"
    with pytest.raises(ValueError, match="`snapshot_every` must be an integer"):
        GuardConfig(snapshot_every=0)
    with pytest.raises(ValueError, match="`overrides` sets fixed bounds"):
        ComponentClipConfig(mode="adaptive", overrides={"x": 1.0})
    assert ComponentClipConfig(groups=("a", "b")).groups == ["a", "b"]
    # a callback from a config, or from keywords: the same options; the keywords replace the config's
    assert StabilityGuardCallback(config).config == StabilityGuardCallback(action="skip").config
    assert StabilityGuardCallback(config, window=64).config == GuardConfig(action="skip", window=64)


def test_config_fields_generates_typed_fields_on_a_toy_config():
    @dataclasses.dataclass(frozen=True)
    class Toy(hf_stable.stability.options.Options):
        rate: float = option(0.5, "a rate", hf_stable._validation.number(low=0))
        tag: str = option("a", "a tag", flag=False)

    @dataclasses.dataclass
    @config_fields(Toy, "toy_", defaults={"rate": None})
    class Config:
        toy: bool = False

    (_, rate) = dataclasses.fields(Config)
    assert (rate.name, rate.type, rate.default, rate.metadata["help"]) == ("toy_rate", float | None, None, "a rate")
    assert getattr(Config, OPTIONS_KEY) == {"toy_rate": ("toy_", "rate")}
    with pytest.raises(TypeError, match=r"Twice\.toy_rate is generated from Toy"):

        @dataclasses.dataclass
        @config_fields(Toy, "toy_")
        class Twice:
            toy_rate: float = 1.0


def test_the_pure_stability_layer_imports_no_callback_or_trainer():
    """`hf_stable.stability` sits below the callbacks: no import of it reaches up (at module level or inside a
    function, where `stability/config.py` used to build a callback to validate its kwargs)."""
    root = pathlib.Path(hf_stable.__file__).parent / "stability"
    upward = []
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                target = "." * node.level + (node.module or "")
            elif isinstance(node, ast.Import):
                target = ",".join(a.name for a in node.names)
            else:
                continue
            if _upward(target):
                upward.append(f"{path.name}:{node.lineno} {target}")
    assert not upward
    # the control: the scan sees a relative upward import, and not a sibling whose name merely contains one
    assert _upward("..callbacks.stability") and _upward("hf_stable.trainers.sft") and not _upward(".clip")


def _upward(target: str) -> bool:
    return bool({"callbacks", "trainers", "scripts", "cli"} & set(target.replace(",", ".").split(".")))


def test_grpo_and_sft_share_the_generated_fields():
    sft = {f.name for f in dataclasses.fields(StabilityConfigMixin)}
    grpo = {f.name for f in dataclasses.fields(GRPOStabilityConfigMixin)}
    assert {n for n in ALTERNATIVES if not n.startswith("degenerate_")} <= sft
    assert set(ALTERNATIVES) <= grpo
