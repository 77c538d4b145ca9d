"""Monitors on transformers' plain Trainer: stable rank, MSign correction, representation drift."""

import numpy as np
import pytest
import torch
from transformers import Trainer, TrainingArguments

from hf_stable.callbacks import MSignCallback, RepresentationDriftCallback, StableRankMonitorCallback
from hf_stable.callbacks.monitors import DEFAULT_TARGETS, _targets
from hf_stable.testing import build_tiny_model


def _trainer(model, tmp_path, steps, lr=1e-3, **kw):
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": ids, "labels": ids} for ids in torch.randint(10, 60, (8 * steps, 12), generator=g)]
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=8,
                             learning_rate=lr, use_cpu=True, report_to="none", save_strategy="no", disable_tqdm=True,
                             logging_steps=1, **kw)
    return Trainer(model=model, args=args, train_dataset=rows)


def _numpy_srank(w):
    s = np.linalg.svd(w.detach().double().numpy(), compute_uv=False)
    return (s**2).sum() / s[0] ** 2


def test_stable_rank_logged_at_the_right_steps_and_matches_svd(tmp_path):
    model, _ = build_tiny_model(seed=0)
    trainer = _trainer(model, tmp_path, steps=6)
    monitor = StableRankMonitorCallback.attach(trainer, every=2, log_per_matrix=True)
    trainer.train()
    assert monitor.measured_steps == [0, 2, 4, 6]
    logged = {h["step"]: h for h in trainer.state.log_history if "stable/srank/min" in h and "loss" in h}
    assert sorted(logged) == [1, 2, 4, 6]  # step 0's measurement is logged with the first log
    expected = {name: _numpy_srank(m.weight) for name, m in _targets(model, DEFAULT_TARGETS)}
    assert len(expected) == 14
    assert logged[6]["stable/srank/min"] == pytest.approx(min(expected.values()), rel=1e-4)
    assert logged[6]["stable/srank/median"] == pytest.approx(float(np.median(list(expected.values()))), rel=1e-4)
    for name, value in expected.items():
        assert logged[6][f"stable/srank/{name}"] == pytest.approx(value, rel=1e-4)
    assert logged[6]["stable/srank/collapse"] == 0.0


def test_stable_rank_of_lora_layers_is_the_merged_weights(tmp_path):
    from peft import LoraConfig, get_peft_model

    model, _ = build_tiny_model(seed=0)
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    monitor = StableRankMonitorCallback(targets=r"layers\.\d+\.self_attn\.(q|v)_proj$")
    values = monitor.measure(peft_model)
    assert len(values) == 4
    for name, module in _targets(peft_model, monitor.targets):
        merged = module.base_layer.weight + module.get_delta_weight("default")
        assert values[name] == pytest.approx(_numpy_srank(merged), rel=1e-4)
        assert values[name] != pytest.approx(_numpy_srank(module.base_layer.weight), rel=1e-4)


def test_msign_at_period_sets_every_target_to_full_stable_rank(tmp_path):
    model, _ = build_tiny_model(seed=0)
    trainer = _trainer(model, tmp_path, steps=4)
    msign = MSignCallback.attach(trainer, period=2, method="svd")
    trainer.train()
    assert msign.corrections == 2 * 14
    for _, module in _targets(model, DEFAULT_TARGETS):  # the last correction ran at step 4, the last step
        w = module.weight
        assert _numpy_srank(w) == pytest.approx(min(w.shape), rel=1e-5)
    logged = [h for h in trainer.state.log_history if "stable/msign/corrected" in h]
    assert [h["stable/msign/corrected"] for h in logged] == [14.0, 14.0]
    assert logged[-1]["stable/msign/min_srank"] == pytest.approx(32.0, rel=1e-5)  # k/v projections are 32 x 64


def test_msign_refuses_inconsistent_trigger_options():
    with pytest.raises(ValueError, match="needs `sr_threshold`"):
        MSignCallback(trigger="stable_rank")
    with pytest.raises(ValueError, match="only read with"):
        MSignCallback(sr_threshold=3.0)


@pytest.mark.parametrize(("lr", "moves"), [(0.0, False), (3e-3, True)])
def test_drift_is_zero_without_updates_and_positive_with_them(tmp_path, lr, moves):
    model, _ = build_tiny_model(seed=0)
    trainer = _trainer(model, tmp_path, steps=6, lr=lr)
    g = torch.Generator().manual_seed(1)
    probe = {"input_ids": torch.randint(10, 60, (12, 10), generator=g),
             "attention_mask": torch.ones(12, 10, dtype=torch.long)}
    drift = RepresentationDriftCallback.attach(trainer, probe_dataset=probe, every=3, name=f"drift-{lr}")
    trainer.train()
    assert [h[0] for h in drift.history] == [3, 6]
    rho, cka = drift.history[-1][1], drift.history[-1][2]
    if moves:
        assert rho < 1.0 - 1e-4 and cka < 1.0
    else:
        assert rho == pytest.approx(1.0, abs=1e-12) and cka == pytest.approx(1.0, abs=1e-12)
    assert (tmp_path / "stable_drift" / f"drift-{lr}" / "reference.safetensors").is_file()
    logged = [h for h in trainer.state.log_history if "stable/drift/rdm_spearman" in h]
    assert logged[-1]["stable/drift/rdm_spearman"] == pytest.approx(rho)


@pytest.mark.parametrize("restore_flag", [True, False])
def test_every_stateful_callback_round_trips_like_transformers_restores_it(restore_flag):
    """`restore_callback_states_from_checkpoint=True`: transformers builds `type(cb)(**args)` and sets the attributes;
    False: the callback reads its entry from `TrainerState.stateful_callbacks` itself."""
    import json
    from types import SimpleNamespace

    from hf_stable.callbacks import ComponentClipCallback, GRPODegenerateRunCallback, StabilityGuardCallback

    probe = {"input_ids": torch.zeros(4, 3, dtype=int)}
    callbacks = [StabilityGuardCallback(window=16, min_history=4), ComponentClipCallback(mode="adaptive"),
                 GRPODegenerateRunCallback(patience=2), StableRankMonitorCallback(every=7),
                 MSignCallback(period=5), RepresentationDriftCallback(probe_dataset=probe, name="rt")]
    guard = callbacks[0]
    for i in range(6):
        guard.policy.decide(i + 1, 2.0 + 0.01 * i, 1.0)
    callbacks[1]._import({"steps": 3, "gamma": [0.5, None]})
    callbacks[2].monitor.observe({"loss": 0.0, "grad_norm": 0.0}, {})
    callbacks[3].first, callbacks[3].recent = {"a": 3.0}, {"a": [3.0, 2.5]}
    callbacks[4].corrections = 9
    callbacks[5].history = [(3, 0.9, 0.8)]
    for cb in callbacks:
        saved = json.loads(json.dumps(cb.state()))
        if restore_flag:
            new = type(cb)(**saved["args"])
            for attribute, value in saved["attributes"].items():
                setattr(new, attribute, value)
            state = SimpleNamespace(global_step=0, stateful_callbacks={})
        else:
            new = type(cb)(**saved["args"])
            state = SimpleNamespace(global_step=10, stateful_callbacks={type(cb).__name__: saved})
        assert new._self_restore(state)
        got, want = json.loads(json.dumps(new._export())), json.loads(json.dumps(cb._export()))
        if cb is guard:  # in-memory snapshots do not survive a restart: a fresh one is taken at the next healthy step
            assert want["confirmed_steps"] == [4] and got["confirmed_steps"] == []
            assert got["last_candidate_step"] is None
            for key in ("confirmed_steps", "last_candidate_step", "candidate_healthy"):
                got.pop(key), want.pop(key)
        assert got == want, type(cb).__name__
