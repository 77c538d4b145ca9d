"""rsLoRA tooling (`hf_stable.adapters.rslora`): scale conversions, rank sweeps and `AdapterScaleCallback`.

Kalajdzievski, "A Rank Stabilization Scaling Factor for Fine-Tuning with LoRA", arXiv 2312.03732.

Scales are checked against the `scaling` PEFT itself sets on layers built with `use_rslora=True/False`; the
callback's logged values against norms recomputed in float64 from the model's parameters (by parameter name, not
through the implementation's layer walk) and against gradients recorded by a separate callback.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from peft import LoraConfig, get_peft_model
from transformers import Trainer, TrainerCallback, TrainingArguments

from hf_stable.adapters import (
    AdapterScaleCallback,
    StableLoraConfig,
    lora_alpha_from_rslora,
    lora_scale,
    rank_sweep,
    rslora_alpha_from_lora,
)
from hf_stable.testing import build_tiny_model


HYPOTHESIS = settings(max_examples=100, deadline=None)
PREFIX = "stable/adapters/"


class _OneLinear(torch.nn.Module):
    def __init__(self, n: int = 8, m: int = 8):
        super().__init__()
        self.lin = torch.nn.Linear(n, m, bias=False)

    def forward(self, x):
        return self.lin(x)


def peft_scaling(config) -> float:
    """The scale PEFT applies for ``config`` (read off a layer it builds)."""
    model = get_peft_model(_OneLinear(), config)
    return model.base_model.model.lin.scaling["default"]


# ---------------------------------------------------------------------------------------------------------------------
# scale conversions


@pytest.mark.parametrize("alpha, r", [(32, 16), (16, 8), (8, 1), (1, 64), (7, 3)])
def test_lora_scale_is_peft_scaling(alpha, r):
    for use_rslora in (False, True):
        config = LoraConfig(r=r, lora_alpha=alpha, use_rslora=use_rslora, target_modules=["lin"])
        assert lora_scale(alpha, r, use_rslora) == pytest.approx(peft_scaling(config), rel=1e-12)
    assert lora_scale(alpha, r) == pytest.approx(alpha / r, rel=1e-15)
    assert lora_scale(alpha, r, use_rslora=True) == pytest.approx(alpha / math.sqrt(r), rel=1e-15)


@pytest.mark.parametrize("alpha, r_ref", [(32, 16), (16, 8), (8, 1), (2, 64), (7, 3)])
def test_rslora_alpha_from_lora_keeps_peft_scale(alpha, r_ref):
    """rsLoRA at rank r_ref with the converted α has the LoRA (α, r_ref) layer's PEFT scale."""
    alpha_rs = rslora_alpha_from_lora(alpha, r_ref)
    lora = peft_scaling(LoraConfig(r=r_ref, lora_alpha=alpha, target_modules=["lin"]))
    rslora = peft_scaling(LoraConfig(r=r_ref, lora_alpha=alpha_rs, use_rslora=True, target_modules=["lin"]))
    assert rslora == pytest.approx(lora, rel=1e-12)


def test_rslora_alpha_from_lora_worked_example():
    assert rslora_alpha_from_lora(32, 16) == 8.0  # LoRA r=16, α=32 → scale 2 → rsLoRA α = 8 (α/√r = 8/4 = 2)
    assert rslora_alpha_from_lora(alpha=32, r_ref=16) == 8.0


@pytest.mark.parametrize("alpha, r", [(8, 16), (16, 8), (8, 1), (2, 64), (7, 3)])
def test_lora_alpha_from_rslora_keeps_peft_scale(alpha, r):
    alpha_lora = lora_alpha_from_rslora(alpha, r)
    rslora = peft_scaling(LoraConfig(r=r, lora_alpha=alpha, use_rslora=True, target_modules=["lin"]))
    lora = peft_scaling(LoraConfig(r=r, lora_alpha=alpha_lora, target_modules=["lin"]))
    assert lora == pytest.approx(rslora, rel=1e-12)


@HYPOTHESIS
@given(alpha=st.floats(1e-3, 1e3), r=st.integers(1, 4096))
def test_conversions_property(alpha, r):
    """Equal scales (`α_rs/√r = α/r`, `α_lora/r = α/√r`) and the two conversions are inverse."""
    assert rslora_alpha_from_lora(alpha, r) / math.sqrt(r) == pytest.approx(alpha / r, rel=1e-12)
    assert lora_alpha_from_rslora(alpha, r) / r == pytest.approx(alpha / math.sqrt(r), rel=1e-12)
    assert lora_alpha_from_rslora(rslora_alpha_from_lora(alpha, r), r) == pytest.approx(alpha, rel=1e-12)


@pytest.mark.parametrize("bad", [0, -4, 0.0, True])
def test_bad_ranks_raise(bad):
    with pytest.raises(ValueError, match="r_ref"):
        rslora_alpha_from_lora(32, bad)
    with pytest.raises(ValueError, match=r"^r must"):
        lora_alpha_from_rslora(8, bad)
    with pytest.raises(ValueError, match=r"^r must"):
        lora_scale(8, bad)


# ---------------------------------------------------------------------------------------------------------------------
# rank sweeps


@pytest.mark.parametrize(
    "base, scale, expected",
    [
        (LoraConfig(r=16, lora_alpha=32, lora_dropout=0.1, target_modules=["lin"]), None, 2.0),
        (LoraConfig(r=16, lora_alpha=8, use_rslora=True, target_modules=["lin"]), None, 2.0),
        (LoraConfig(r=16, lora_alpha=32, target_modules=["lin"]), 0.5, 0.5),
        (StableLoraConfig(r=4, lora_alpha=4, target_modules=["lin"]), None, 1.0),
    ],
)
def test_rank_sweep_same_scale_at_every_rank(base, scale, expected):
    """Every config is rsLoRA at its rank and PEFT gives it the same scale; other fields are kept, the base is not
    modified."""
    ranks = (1, 4, 16, 64)
    configs = rank_sweep(base, ranks=ranks, scale=scale)
    assert [c.r for c in configs] == list(ranks)
    for config in configs:
        assert type(config) is type(base)
        assert config.use_rslora
        assert config.target_modules == base.target_modules and config.lora_dropout == base.lora_dropout
        assert peft_scaling(config) == pytest.approx(expected, rel=1e-12)
    assert base.r in (16, 4) and base.lora_alpha in (32, 8, 4)


def test_rank_sweep_default_ranks():
    configs = rank_sweep(LoraConfig(r=8, lora_alpha=16, target_modules=["lin"]))
    assert [c.r for c in configs] == [8, 16, 32, 64, 128, 256]
    assert {round(lora_scale(c.lora_alpha, c.r, c.use_rslora), 12) for c in configs} == {2.0}


@pytest.mark.parametrize(
    "base, kwargs, field",
    [
        (LoraConfig(r=8, rank_pattern={"lin": 4}, target_modules=["lin"]), {}, "rank_pattern"),
        (LoraConfig(r=8, alpha_pattern={"lin": 4}, target_modules=["lin"]), {}, "alpha_pattern"),
        (LoraConfig(r=8, target_modules=["lin"]), {"ranks": (8, 0)}, "ranks"),
        (LoraConfig(r=8, target_modules=["lin"]), {"ranks": ()}, "ranks"),
        (LoraConfig(r=8, target_modules=["lin"]), {"ranks": (8.5,)}, "ranks"),
        (LoraConfig(r=8, target_modules=["lin"]), {"scale": 0.0}, "scale"),
    ],
)
def test_rank_sweep_bad_inputs(base, kwargs, field):
    with pytest.raises(ValueError, match=field):
        rank_sweep(base, **kwargs)


# ---------------------------------------------------------------------------------------------------------------------
# AdapterScaleCallback in a real Trainer

ALPHA, RANK = 16, 4


class _GradRecorder(TrainerCallback):
    """Gradient norms of every LoRA parameter just before each optimizer step (after clipping), by parameter name."""

    def __init__(self):
        self.steps: dict[int, dict[str, float]] = {}

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.steps[state.global_step + 1] = {
            name: param.grad.double().norm().item()
            for name, param in model.named_parameters()
            if ".lora_" in name and param.grad is not None
        }


def _train(tmp_path, callback, max_steps=3):
    model, _ = build_tiny_model(seed=0)
    config = LoraConfig(
        r=RANK, lora_alpha=ALPHA, use_rslora=True, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0
    )
    model = get_peft_model(model, config)
    g = torch.Generator().manual_seed(0)
    data = []
    for _ in range(8):
        ids = torch.randint(7, 93, (12,), generator=g)
        data.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()})
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=max_steps,
        per_device_train_batch_size=2,
        learning_rate=5e-2,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    recorder = _GradRecorder()
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[recorder, callback])
    trainer.train()
    return trainer, recorder


def _step_log(trainer, step):
    return next(e for e in trainer.state.log_history if e.get("step") == step and "loss" in e)


def _expected_ratios(model) -> dict[str, float]:
    """`‖s·BA‖_F / ‖W0‖_F` per layer in float64 from the named parameters, with s = α/√r of the config."""
    params = dict(model.named_parameters())
    scale = ALPHA / math.sqrt(RANK)
    out = {}
    for name in params:
        if name.endswith(".lora_A.default.weight"):
            layer = name[: -len(".lora_A.default.weight")]
            a, b = params[name].double(), params[f"{layer}.lora_B.default.weight"].double()
            w0 = params[f"{layer}.base_layer.weight"].double()
            out[f"{PREFIX}{layer}.default/update_ratio"] = (scale * (b @ a)).norm().item() / w0.norm().item()
    return out


def _expected_grads(recorded: dict[str, float]) -> dict[str, float]:
    out = {}
    for name, norm in recorded.items():
        layer, kind = name.split(".lora_")
        out[f"{PREFIX}{layer}.default/grad_{kind[0]}"] = norm
    return out


def test_callback_logs_into_trainer_logs(tmp_path):
    """per_layer=True, every=1, 3 steps: each step's log carries the per-layer gradient norms of A and B (as read
    before the optimizer step) and, for the last step, update ratios equal to the final model's; the aggregates are
    the mean/max of the per-layer values."""
    callback = AdapterScaleCallback(every=1, per_layer=True)
    trainer, recorder = _train(tmp_path, callback)
    model = trainer.model

    for step in (1, 2, 3):
        log = _step_log(trainer, step)
        grads = _expected_grads(recorder.steps[step])
        assert len(grads) == 2 * 6  # A and B of 3 modules × 2 layers
        for key, value in grads.items():
            assert log[key] == pytest.approx(value, rel=1e-5), key
            assert value > 0 or (step == 1 and key.endswith("grad_A"))  # B starts at 0, so A's first gradient is 0
        for kind in ("A", "B"):
            values = [v for k, v in grads.items() if k.endswith(f"grad_{kind}")]
            assert log[f"{PREFIX}grad_{kind}_mean"] == pytest.approx(sum(values) / len(values), rel=1e-5)
            assert log[f"{PREFIX}grad_{kind}_max"] == pytest.approx(max(values), rel=1e-5)

    last = _step_log(trainer, 3)
    ratios = _expected_ratios(model)
    assert len(ratios) == 6
    for key, value in ratios.items():
        assert last[key] == pytest.approx(value, rel=1e-5), key
        assert value > 0
    assert last[f"{PREFIX}update_ratio_mean"] == pytest.approx(sum(ratios.values()) / 6, rel=1e-5)
    assert last[f"{PREFIX}update_ratio_max"] == pytest.approx(max(ratios.values()), rel=1e-5)
    assert _step_log(trainer, 1)[f"{PREFIX}update_ratio_mean"] != last[f"{PREFIX}update_ratio_mean"]  # B moved
    assert [h["step"] for h in callback.history] == [1, 2, 3]
    assert callback.history[-1][f"{PREFIX}update_ratio_max"] == last[f"{PREFIX}update_ratio_max"]


def test_callback_every_and_aggregates_only(tmp_path):
    """every=2 over 3 steps: only step 2 is measured; without per_layer only the aggregates are logged."""
    callback = AdapterScaleCallback(every=2)
    trainer, recorder = _train(tmp_path, callback)
    assert f"{PREFIX}update_ratio_mean" not in _step_log(trainer, 1)
    assert f"{PREFIX}update_ratio_mean" not in _step_log(trainer, 3)
    log = _step_log(trainer, 2)
    keys = {k for k in log if k.startswith(PREFIX)}
    assert keys == {
        f"{PREFIX}{name}" for name in ("update_ratio_mean", "update_ratio_max", "grad_A_mean", "grad_A_max")
    } | {f"{PREFIX}grad_B_mean", f"{PREFIX}grad_B_max"}
    grads = _expected_grads(recorder.steps[2])
    b_norms = [v for k, v in grads.items() if k.endswith("grad_B")]
    assert log[f"{PREFIX}grad_B_mean"] == pytest.approx(sum(b_norms) / len(b_norms), rel=1e-5)
    assert [h["step"] for h in callback.history] == [2]


def test_callback_measure_pattern():
    """`pattern` restricts the layers; the ratio uses the layer's own scale (here rsLoRA α/√r)."""
    model, _ = build_tiny_model(seed=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = get_peft_model(
            model,
            LoraConfig(
                r=RANK,
                lora_alpha=ALPHA,
                use_rslora=True,
                target_modules=["q_proj", "v_proj", "down_proj"],
                init_lora_weights=False,
            ),
        )
    metrics = AdapterScaleCallback(per_layer=True, pattern=r"q_proj$").measure(model)
    expected = {k: v for k, v in _expected_ratios(model).items() if "q_proj" in k}
    assert {k for k in metrics if k.endswith("/update_ratio")} == set(expected)
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value, rel=1e-5)
    assert metrics[f"{PREFIX}update_ratio_max"] == pytest.approx(max(expected.values()), rel=1e-5)


@pytest.mark.parametrize("every", [0, -1, 1.5])
def test_callback_bad_every(every):
    with pytest.raises(ValueError, match="every"):
        AdapterScaleCallback(every=every)


class _LogSpy(TrainerCallback):
    """Stands in for a `report_to` integration: registered ahead of the measuring callback."""

    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))


def test_hf_stable_trainer_hands_metrics_to_earlier_callbacks(tmp_path):
    """Under StableSFTTrainer a callback that runs before AdapterScaleCallback (as the integrations do) sees the
    adapter metrics of the step being logged."""
    from hf_stable import StableSFTConfig, StableSFTTrainer
    from hf_stable.testing import arithmetic_dataset

    model, tokenizer = build_tiny_model(seed=0)
    spy, callback = _LogSpy(), AdapterScaleCallback(every=1)
    args = StableSFTConfig(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        disable_tqdm=True,
    )
    trainer = StableSFTTrainer(
        model=model,
        args=args,
        train_dataset=arithmetic_dataset(8, seed=1),
        processing_class=tokenizer,
        peft_config=LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=["q_proj", "v_proj"]),
        callbacks=[spy, callback],
    )
    trainer.train()
    step_logs = [log for log in spy.logs if "loss" in log]
    assert len(step_logs) == 2
    for log, measured in zip(step_logs, callback.history, strict=True):
        assert log[f"{PREFIX}update_ratio_mean"] == measured[f"{PREFIX}update_ratio_mean"]
        assert log[f"{PREFIX}grad_B_max"] == measured[f"{PREFIX}grad_B_max"] > 0
