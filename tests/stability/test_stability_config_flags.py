"""The stability fields of `StableSFTConfig` and `StableGRPOConfig` (`hf_stable.stability.config`): each one changes
what the trainer does, or is refused at construction naming it.

The SFT/GRPO flag-effect matrices allowlist these fields and point here; the unlearning matrix runs its own cases
(`tests/trainers/unlearning/test_unlearning_flags.py`).
"""

import copy
import dataclasses
import logging

import pytest
import torch
from sft_helpers import STEP_ARGS, dataset_for

from hf_stable.callbacks import (
    ComponentClipCallback,
    FaultInjectionCallback,
    GRPODegenerateRunCallback,
    NoGradientCallback,
    NoGradientError,
    StabilityGuardCallback,
)
from hf_stable.stability.config import GRPOStabilityConfigMixin, StabilityConfigMixin
from hf_stable.testing import build_tiny_model


SFT_FIELDS = {f.name for f in dataclasses.fields(StabilityConfigMixin)}
GRPO_FIELDS = {f.name for f in dataclasses.fields(GRPOStabilityConfigMixin)}
CPU = dict(use_cpu=True, bf16=False, report_to="none")


def _sft(tmp_path, model=None, steps=1, **config):
    from hf_stable import StableSFTConfig, StableSFTTrainer

    tokenizer = build_tiny_model(seed=0)[1]
    model = build_tiny_model(seed=0)[0] if model is None else model
    args = StableSFTConfig(output_dir=str(tmp_path), **{**STEP_ARGS, "max_steps": steps, "logging_steps": 1, **config})
    return StableSFTTrainer(model=model, args=args, train_dataset=dataset_for({}), processing_class=tokenizer)


def _update(trainer) -> torch.Tensor:
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    return torch.cat([(p.detach() - before[n]).flatten() for n, p in trainer.model.named_parameters()])


def _callbacks(trainer, cls):
    return [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, cls)]


def test_the_fields_are_declared_once_and_shared():
    from hf_stable import StableGRPOConfig, StableSFTConfig, UnlearningConfig

    for config in (StableSFTConfig, StableGRPOConfig, UnlearningConfig):
        assert issubclass(config, StabilityConfigMixin)
        names = {f.name for f in dataclasses.fields(config)}
        assert names >= SFT_FIELDS
    assert issubclass(StableGRPOConfig, GRPOStabilityConfigMixin)
    assert GRPO_FIELDS - SFT_FIELDS == {
        "degenerate_run_warnings",
        "degenerate_patience",
        "degenerate_zero_std_min",
        "degenerate_clipped_ratio_min",
        "degenerate_entropy_min",
        "degenerate_kl_max",
    }
    for name in ("stability_guard", "stability_guard_kwargs", "no_gradient_check", "component_clip_max_norm"):
        assert name not in {f.name for f in dataclasses.fields(StableSFTConfig.__mro__[-2])}  # not TrainingArguments'


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"stability_guard": True, "stability_guard_kwargs": {"snapshot_evry": 5}}, "unknown key 'snapshot_evry'"),
        ({"stability_guard": True, "stability_guard_kwargs": {"action": "undo"}}, "`guard_action`='undo'"),
        ({"stability_guard": True, "stability_guard_kwargs": "{not json"}, "`stability_guard_kwargs` is not a JSON"),
        ({"stability_guard_kwargs": {"action": "skip"}}, "`stability_guard_kwargs` is set but `stability_guard`"),
        ({"stability_guard": "yes"}, "`stability_guard` must be true or false"),
        ({"no_gradient_check": 1}, "`no_gradient_check` must be true or false"),
        ({"component_clip_max_norm": 0.0}, "`component_clip_max_norm` must be"),
        ({"component_clip_max_norm": 1.0, "component_clip_groups": "tensor"}, "`component_clip_groups`='tensor'"),
        ({"component_clip_groups": "layer"}, "`component_clip_groups` is set but component clipping is off"),
    ],
)
def test_sft_config_refuses_by_name(config, match):
    from hf_stable import StableSFTConfig

    with pytest.raises((ValueError, TypeError), match=match):
        StableSFTConfig("out", **CPU, **config)


def test_guard_kwargs_as_a_json_string_like_trl_dict_fields():
    from hf_stable import StableSFTConfig

    args = StableSFTConfig("out", **CPU, stability_guard=True, stability_guard_kwargs='{"action": "skip"}')
    assert args.stability_guard_kwargs == {"action": "skip"}


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"degenerate_run_warnings": False, "degenerate_kl_max": 3.0}, "`degenerate_kl_max` is set but"),
        ({"degenerate_patience": 0}, "`degenerate_patience` must be an integer"),
        ({"degenerate_zero_std_min": 1.5}, "`degenerate_zero_std_min` must be"),
        # GRPO's guard watches the gradient norm only by default: disabling it too leaves nothing to detect
        ({"stability_guard": True, "stability_guard_kwargs": {"grad_z": None}}, "`loss_z` and `grad_z` are both"),
    ],
)
def test_grpo_config_refuses_by_name(config, match):
    from hf_stable import StableGRPOConfig

    with pytest.raises((ValueError, TypeError), match=match):
        StableGRPOConfig("out", **CPU, **config)


# -- each field changes the run --------------------------------------------------------------------------------------
def test_stability_guard_skips_a_nan_step_and_its_kwargs_act(tmp_path):
    """stability_guard=True: the NaN step is skipped (weights stay finite); off, or with action='log', they are NaN."""
    results = {}
    for name, config in {
        "off": {},
        "guard": {"stability_guard": True, "guard_action": "skip"},
        "log": {"stability_guard": True, "guard_action": "log"},
    }.items():
        trainer = _sft(tmp_path / name, steps=3, **config)
        FaultInjectionCallback.attach(trainer, kind="nan_loss", steps=[2])
        update = _update(trainer)
        guards = _callbacks(trainer, StabilityGuardCallback)
        results[name] = (torch.isfinite(update).all().item(), guards[0].policy.skips if guards else None)
    assert results == {"off": (False, None), "guard": (True, 1), "log": (False, 0)}


def test_component_clip_fields_change_the_update(tmp_path):
    base = _update(_sft(tmp_path / "base"))
    clipped_trainer = _sft(tmp_path / "param", component_clip_max_norm=1e-3)
    clipped = _update(clipped_trainer)
    layer = _update(_sft(tmp_path / "layer", component_clip_max_norm=1e-3, component_clip_groups="layer"))
    (callback,) = _callbacks(clipped_trainer, ComponentClipCallback)
    assert callback.max_norm == 1e-3 and callback.groups == "param"
    # SGD with lr 1: the update of each parameter is minus its clipped gradient, so each tensor moves ≤ 1e-3
    offset = 0
    for p in clipped_trainer.model.parameters():
        assert clipped[offset : offset + p.numel()].norm() <= 1e-3 * (1 + 1e-5)
        offset += p.numel()
    assert base.norm() > 10 * clipped.norm()
    assert not torch.equal(clipped, layer) and not torch.equal(base, layer)


def _foreign_backbone(model):
    """A copy of ``model`` whose backbone forward is ``model``'s (bound to the original), with its LM head frozen:
    the loss depends only on the original's weights, so none of the copy's trainable parameters gets a gradient."""
    copied = copy.deepcopy(model)
    copied.model.forward = model.model.forward
    copied.lm_head.requires_grad_(False)
    return copied


def test_no_gradient_check_raises_naming_the_patched_forward(tmp_path):
    model = build_tiny_model(seed=0)[0]
    copied = _foreign_backbone(model)
    with pytest.raises(NoGradientError, match="the forward of `model`"):
        _sft(tmp_path / "on", model=copied).train()
    # off: the same run is silent and changes nothing
    copied = _foreign_backbone(model)
    trainer = _sft(tmp_path / "off", model=copied, no_gradient_check=False)
    assert not _callbacks(trainer, NoGradientCallback)
    assert not _update(trainer).any()


def test_frozen_model_refused_by_default(tmp_path):
    model = build_tiny_model(seed=0)[0].requires_grad_(False)
    with pytest.raises(NoGradientError, match="frozen model"):
        _sft(tmp_path, model=model).train()


# -- GRPO ------------------------------------------------------------------------------------------------------------
def constant_reward(completions, **kwargs):
    return [1.0 for _ in completions]


def _grpo(tmp_path, steps=2, **config):
    from grpo_helpers import grpo_run

    return grpo_run(tmp_path, reward_funcs=[constant_reward], max_steps=steps, **config)[1]


def _grpo_trainer(tmp_path, **config):
    """A `StableGRPOTrainer`, not trained."""
    from grpo_helpers import GRPO_ARGS

    from hf_stable import StableGRPOConfig, StableGRPOTrainer
    from hf_stable.testing import arithmetic_dataset

    model, tokenizer = build_tiny_model(seed=0)
    args = StableGRPOConfig(str(tmp_path), per_device_train_batch_size=8, **{**GRPO_ARGS, **config})
    return StableGRPOTrainer(
        model=model,
        reward_funcs=[constant_reward],
        args=args,
        processing_class=tokenizer,
        train_dataset=arithmetic_dataset(8, seed=0, max_operand=9),
    )


def test_grpo_guard_watches_the_grad_norm_unless_told_otherwise(tmp_path):
    def guard_of(fields):
        trainer = _grpo_trainer(tmp_path, stability_guard=True, **fields)
        (guard,) = _callbacks(trainer, StabilityGuardCallback)
        return guard.policy

    assert guard_of({}).loss_rule is None and guard_of({}).grad_rule is not None
    assert guard_of({"guard_loss_z": 4.0}).loss_rule.z_threshold == 4.0


def test_degenerate_run_warnings_and_thresholds(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="hf_stable.callbacks.stability"):
        on = _grpo(tmp_path / "on", degenerate_patience=1)
    (callback,) = _callbacks(on, GRPODegenerateRunCallback)
    assert [step for step, f in callback.findings if f.kind == "zero_std"] == [1, 2]  # patience 1: every log
    assert "num_generations" in caplog.text

    off = _grpo(tmp_path / "off", steps=1, degenerate_run_warnings=False)
    assert not _callbacks(off, GRPODegenerateRunCallback)

    # every threshold reaches the attached callback: the same logs trip it or not
    logs = {"loss": 0.5, "grad_norm": 1.0, "entropy": 0.5, "kl": 1.0, "frac_reward_zero_std": 0.5,
            "completions/clipped_ratio": 0.5, "reward_std": 1.0}  # fmt: skip
    cases = {
        "degenerate_entropy_min": (1.0, "entropy_collapse"),
        "degenerate_kl_max": (0.5, "kl_divergence"),
        "degenerate_zero_std_min": (0.4, "zero_std"),
        "degenerate_clipped_ratio_min": (0.4, "truncated"),
    }
    for field, (value, kind) in cases.items():
        kinds = {}
        for label, config in (("default", {}), ("changed", {field: value})):
            trainer = _grpo_trainer(tmp_path / f"{field}-{label}", degenerate_patience=1, **config)
            (cb,) = _callbacks(trainer, GRPODegenerateRunCallback)
            cb.on_log(trainer.args, trainer.state, trainer.control, logs=dict(logs))
            kinds[label] = {f.kind for _, f in cb.findings}
        assert kind not in kinds["default"] and kind in kinds["changed"], (field, kinds)
