"""Regression tests of the unlearning defects found in review: each setting either takes effect or is refused at
construction with a message naming the field as the user spells it."""

import logging
from types import SimpleNamespace

import pytest
import torch
from unlearn_helpers import GLOBAL_BATCH, METHODS, STEP_ARGS, split_data, unlearn_update

from hf_stable import UnlearningConfig, UnlearningTrainer
from hf_stable.testing import build_tiny_model
from hf_stable.trainers.unlearning.checks import refuse_backend
from hf_stable.trainers.unlearning.methods import UNLEARNING_METHODS


def _config(tmp_path, **kwargs):
    return UnlearningConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", **kwargs)


def test_pdu_forget_weight_scales_the_forget_gradient(tmp_path):
    """PDU's primal step is `γ·L_forget + λ·L_retain`: one SGD step is affine in γ, so u(3) − u(1) = 2·(u(2) − u(1)),
    and γ = 7 moves the weights differently from γ = 1 (review: |Δθ| was 0)."""
    pdu = {**METHODS["pdu"], "learning_rate": 1e-2}
    updates = {
        g: unlearn_update(tmp_path / str(g), GLOBAL_BATCH, 1, forget_weight=float(g), **pdu)[0] for g in (1, 2, 3, 7)
    }
    scale = updates[1].abs().max().item()
    assert (updates[7] - updates[1]).abs().max().item() > 1e-2 * scale
    # the weights are fp32: differences of updates carry ~1e-7 of rounding, the γ effect is ~1e-2 of the update
    expected = 2 * (updates[2] - updates[1]).double()
    assert torch.allclose((updates[3] - updates[1]).double(), expected, rtol=0, atol=1e-4 * scale)


def test_pdu_refuses_retain_weight(tmp_path):
    """Under PDU the retain weight is the dual variable λ: `retain_weight` is refused, pointing to `pdu_lambda0`."""
    with pytest.raises(ValueError, match=r"`retain_weight`=9.0 is not used by unlearn_method='pdu'.*pdu_lambda0"):
        _config(tmp_path, unlearn_method="pdu", pdu_eps=1.0, retain_weight=9.0)


def test_retain_weight_without_a_retain_term_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"`retain_weight`=0.5 has no effect with retain_loss_type='none'"):
        _config(tmp_path, unlearn_method="ga", retain_weight=0.5)
    _config(tmp_path, unlearn_method="ga", retain_weight=0.5, retain_loss_type="nll")


@pytest.mark.parametrize(
    ("method", "extra"), [("stableun", {}), ("sga", {"sga_rate": "auto"})], ids=["stableun", "sga_auto"]
)
def test_multi_gradient_schemes_refuse_fp16_and_fsdp(tmp_path, method, extra):
    """The step's gradients are written into `p.grad` unscaled: a GradScaler would divide them by 2^16."""
    name = "unlearn_method='stableun'" if method == "stableun" else "sga_rate='auto'"
    with pytest.raises(ValueError, match=rf"{name} cannot be combined with: fp16=True"):
        _config(tmp_path, unlearn_method=method, fp16=True, **extra)
    with pytest.raises(ValueError, match=rf"{name} cannot be combined with: fsdp="):
        _config(tmp_path, unlearn_method=method, fsdp=True, fsdp_config={"version": 2}, **extra)
    _config(tmp_path, unlearn_method="sga", fp16=True)  # a fixed rate is one ordinary loss: fp16 is fine


def test_stableun_declares_its_deepspeed_refusal():
    """`deepspeed` is not installed here, so the declaration is checked on the option values a config would hold."""
    stableun = UNLEARNING_METHODS.get("stableun")
    host = SimpleNamespace(fp16=False, fsdp=[], deepspeed={"zero_optimization": {"stage": 2}})
    assert [p.split("=")[0] for p in stableun.host_problems(host)] == ["deepspeed"]
    assert stableun.host_problems(SimpleNamespace(fp16=False, fsdp=[], deepspeed=None)) == []


def _launched(method="graddiff", zero_stage=None, fsdp=False, mixed_precision="no", **config):
    """A trainer as `accelerate launch` would configure it (the parts `refuse_backend` reads)."""
    plugin = None if zero_stage is None else SimpleNamespace(zero_stage=zero_stage)
    args = SimpleNamespace(unlearn_method=method, scheme={"stableun": "multipoint"}.get(method, "joint"), **config)
    accelerator = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=plugin), mixed_precision=mixed_precision)
    return SimpleNamespace(args=args, accelerator=accelerator, is_fsdp_enabled=fsdp)


def test_backends_refused_as_launched():
    """`accelerate launch` configs (the shipped `--accelerate_config zero3`/`fsdp2`) are invisible to the config: the
    trainer refuses them at construction, by name."""
    refuse_backend(_launched())
    refuse_backend(_launched(zero_stage=2))
    refuse_backend(_launched(mixed_precision="fp16"))
    with pytest.raises(ValueError, match="does not support DeepSpeed ZeRO-3"):
        refuse_backend(_launched(zero_stage=3))
    with pytest.raises(ValueError, match="does not support FSDP"):
        refuse_backend(_launched(fsdp=True))
    with pytest.raises(ValueError, match="unlearn_method='stableun' does not support DeepSpeed"):
        refuse_backend(_launched("stableun", zero_stage=1))
    with pytest.raises(ValueError, match="unlearn_method='stableun' does not support fp16"):
        refuse_backend(_launched("stableun", mixed_precision="fp16"))


def test_launched_fp16_is_refused_for_stableun(tmp_path, monkeypatch):
    """fp16 set by the launcher only (``accelerate launch --mixed_precision fp16``), not in the config."""
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    forget, retain = split_data()
    model, tok = build_tiny_model(seed=0)
    args = _config(tmp_path, unlearn_method="stableun", collapse_guard=False)
    with pytest.raises(ValueError, match="unlearn_method='stableun' does not support fp16"):
        UnlearningTrainer(model=model, args=args, forget_dataset=forget, retain_dataset=retain, processing_class=tok)


def test_collapse_guard_needs_rows_to_watch(tmp_path, caplog):
    forget, retain = split_data()
    model, tok = build_tiny_model(seed=0)
    ga = _config(tmp_path, unlearn_method="ga")  # collapse_guard=True by default; GA has no retain term
    with pytest.raises(ValueError, match="collapse_guard=True has nothing to watch"):
        UnlearningTrainer(model=model, args=ga, forget_dataset=forget, processing_class=tok)
    UnlearningTrainer(model=model, args=ga, forget_dataset=forget, processing_class=tok, holdout_dataset=retain)
    with caplog.at_level(logging.WARNING):
        UnlearningTrainer(model=model, args=ga, forget_dataset=forget, retain_dataset=retain, processing_class=tok)
    assert sum("only the retain-loss criterion runs" in r.getMessage() for r in caplog.records) == 1


def test_stableun_gaussian_probe_needs_a_positive_sigma(tmp_path):
    with pytest.raises(ValueError, match=r"`stableun_sigma`=0.0 with stableun_points='sam\+gauss'"):
        _config(tmp_path, unlearn_method="stableun", stableun_points="sam+gauss")
    with pytest.raises(ValueError, match=r"`stableun_sigma`=0.1 with stableun_points='sam\+clean'"):
        _config(tmp_path, unlearn_method="stableun", stableun_sigma=0.1)
    _config(tmp_path, unlearn_method="stableun", stableun_points="sam+gauss", stableun_sigma=0.1)


def test_stableun_gaussian_probe_changes_the_update(tmp_path):
    stableun = {**METHODS["stableun"], "stableun_points": "sam+gauss"}
    small, _ = unlearn_update(tmp_path / "a", GLOBAL_BATCH, 1, stableun_sigma=0.01, **stableun)
    large, _ = unlearn_update(tmp_path / "b", GLOBAL_BATCH, 1, stableun_sigma=0.1, **stableun)
    clean, _ = unlearn_update(tmp_path / "c", GLOBAL_BATCH, 1, **{**stableun, "stableun_points": "sam+clean"})
    assert not torch.equal(small, large) and not torch.equal(small, clean)


def test_errors_name_the_field_as_the_user_spells_it(tmp_path):
    with pytest.raises(ValueError) as error:
        _config(tmp_path, unlearn_method="forgetall")
    assert "`unlearn_method`='forgetall'" in str(error.value) and "unlearning_method" not in str(error.value)
    with pytest.raises(ValueError, match=r"`retain_loss_type`='l2' is not valid\. Allowed values: 'nll', 'kl'"):
        _config(tmp_path, retain_loss_type="l2")
    with pytest.raises(ValueError, match=r"`pdu_forget_loss`='sga' is not valid\. Allowed values: 'ga', 'npo'"):
        _config(tmp_path, unlearn_method="pdu", pdu_eps=1.0, pdu_forget_loss="sga")


@pytest.mark.parametrize(
    ("option", "value"),
    [("label_smoothing_factor", 0.1), ("include_num_input_tokens_seen", "all")],
)
def test_training_arguments_the_losses_cannot_honour_are_refused(tmp_path, option, value):
    with pytest.raises(ValueError, match=f"does not support {option}="):
        _config(tmp_path, **{option: value})


def test_compute_loss_func_is_refused(tmp_path):
    forget, retain = split_data()
    model, tok = build_tiny_model(seed=0)
    args = UnlearningConfig(output_dir=str(tmp_path), **STEP_ARGS)
    with pytest.raises(ValueError, match="`compute_loss_func` is not supported"):
        UnlearningTrainer(
            model=model,
            args=args,
            forget_dataset=forget,
            retain_dataset=retain,
            processing_class=tok,
            compute_loss_func=lambda *a, **k: None,
        )


def test_sga_rate_range_is_refused_without_the_auto_rate(tmp_path):
    with pytest.raises(ValueError, match="`sga_rate_range` clips the rate of sga_rate='auto' only"):
        _config(tmp_path, unlearn_method="sga", sga_rate_range=[-1.0, 1.0])
    _config(tmp_path, unlearn_method="sga", sga_rate="auto", sga_rate_range=[-1.0, 1.0])


def test_fields_of_another_method_warn_once(tmp_path):
    with pytest.warns(UserWarning, match=r"unlearn_method='simnpo' does not read npo_beta, pdu_lambda0"):
        _config(tmp_path, unlearn_method="simnpo", npo_beta=0.3, pdu_lambda0=3.0)
