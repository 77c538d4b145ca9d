"""The guard on sparse 0/1 rewards: steps with a gradient of exactly zero carry no information about the scale of a
real update (`hf_stable.stability.guard`, "Idle steps"), and a window that is mostly one value does not give z-scores
in the hundreds (`hf_stable.stability.stats`, the MeanAD fallback).

Before the rule, a GRPO run where most groups get equal rewards filled the window with log(0 + eps): median -27.6,
MAD 0, and every step that learned scored z ≈ 570 and was skipped or rolled back.
"""

import math
import random

import numpy as np
import pytest
import torch
from grpo_helpers import GRPO_ARGS
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_stable.callbacks import FaultInjectionCallback, StabilityGuardCallback
from hf_stable.stability.guard import GuardPolicy
from hf_stable.stability.stats import GRAD_RULE, RobustWindow
from hf_stable.testing import arithmetic_dataset, arithmetic_reward, build_tiny_model


# -- the pure statistics ---------------------------------------------------------------------------------------------
finite = st.floats(min_value=-1e3, max_value=1e3, allow_nan=False, allow_infinity=False)


@given(st.lists(finite, min_size=1, max_size=120), st.floats(min_value=0.0, max_value=1.0))
@settings(max_examples=200, deadline=None)
def test_scale_is_the_mad_or_else_the_mean_absolute_deviation(values, floor):
    window = RobustWindow(size=128, min_history=1)
    for v in values:
        window.push(v)
    x = np.asarray(values, dtype=np.float64)
    dev = np.abs(x - np.median(x))
    mad = np.median(dev)
    expected = max(1.4826 * mad if mad > 0 else math.sqrt(math.pi / 2) * dev.mean(), floor)
    assert window.scale(floor) == pytest.approx(expected, rel=1e-9, abs=1e-12)


def test_a_window_that_is_mostly_one_value_gives_a_moderate_z():
    # 100 equal values and 28 spread ones: MAD 0, but the spread is known (the old scale was the 0.05 floor)
    rng = np.random.default_rng(0)
    window = RobustWindow(size=128, min_history=20)
    spread = rng.normal(1.0, 0.3, 28)
    for v in [0.0] * 100 + list(spread):
        window.push(float(v))
    assert window.mad() == 0.0
    mean_ad = np.abs(np.r_[np.zeros(100), spread]).mean()
    assert window.z(1.0, floor=0.05) == pytest.approx(1.0 / (math.sqrt(math.pi / 2) * mean_ad))
    assert window.z(1.0, floor=0.05) < 6.0


def _signals(norms):
    return [(None, n) for n in norms]


@given(
    st.lists(st.floats(min_value=0.1, max_value=50.0), min_size=1, max_size=60),
    st.lists(st.integers(min_value=0, max_value=3), min_size=1, max_size=60),
)
@settings(max_examples=100, deadline=None)
def test_zero_gradient_steps_neither_enter_the_window_nor_get_scored(norms, gaps):
    """The nonzero steps of a run with zero-gradient steps interleaved are judged exactly as the same steps alone."""
    alone = GuardPolicy(loss_rule=None, window=32, min_history=5, action="log")
    mixed = GuardPolicy(loss_rule=None, window=32, min_history=5, action="log")
    step = 0
    for i, norm in enumerate(norms):
        for _ in range(gaps[i % len(gaps)]):
            step += 1
            idle = mixed.decide(step, None, 0.0)
            assert (idle.kind, idle.action) == ("idle", "accept") and math.isnan(idle.grad_z)
        step += 1
        a, m = alone.decide(i + 1, None, norm), mixed.decide(step, None, norm)
        assert (a.kind, a.action) == (m.kind, m.action)
        assert a.grad_z == m.grad_z or (math.isnan(a.grad_z) and math.isnan(m.grad_z))
    assert mixed.grad_window.values() == alone.grad_window.values()
    assert mixed.idle == step - len(norms) and mixed.anomalies == alone.anomalies


def test_a_zero_gradient_step_with_a_nan_loss_is_still_nonfinite():
    policy = GuardPolicy(window=8, min_history=2)
    assert policy.decide(1, math.nan, 0.0).kind == "nonfinite"
    assert policy.decide(2, 0.5, 0.0).kind == "idle" and policy.idle == 1


def test_idle_count_survives_the_state_round_trip():
    policy = GuardPolicy(window=8, min_history=2)
    for step, norm in enumerate([0.0, 1.0, 0.0, 0.0, 1.1], start=1):
        policy.decide(step, None, norm)
    other = GuardPolicy(window=8, min_history=2)
    other.load_state(policy.state())
    assert other.idle == 3 and other.grad_window.values() == [GRAD_RULE.transform(1.0), GRAD_RULE.transform(1.1)]


# -- a sparse-reward GRPO run ---------------------------------------------------------------------------------------
P_CORRECT = 0.07  # per completion: with 4 completions per step, about 1 step in 4 has a group with unequal rewards
STEPS = 48
GUARD = {"guard_min_history": 5, "guard_snapshot_every": 5}


def sparse_rollout(prompts, trainer):
    """Completions that depend only on (prompt, index, step): the right answer with probability `P_CORRECT`, else a
    wrong three-digit number, so `arithmetic_reward` is 0 for most groups."""
    tokenizer = trainer.processing_class
    prompt_ids, completion_ids = [], []
    for index, prompt in enumerate(prompts):
        rng = random.Random(f"{prompt}|{index}|{trainer.state.global_step}")
        answer = str(eval(prompt.rstrip("=")))
        text = answer if rng.random() < P_CORRECT else str(rng.randint(100, 999))
        ids = [*tokenizer(text, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
        prompt_ids.append(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        completion_ids.append(ids[: trainer.max_completion_length])
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}


def _sparse_grpo(output_dir, guard: bool, inject=None):
    from hf_stable import StableGRPOConfig, StableGRPOTrainer

    model, tokenizer = build_tiny_model(seed=0)
    config = {**GRPO_ARGS, "max_steps": STEPS, "learning_rate": 0.05}
    if guard:
        config.update(stability_guard=True, **GUARD)
    args = StableGRPOConfig(output_dir=str(output_dir), per_device_train_batch_size=4, **config)
    torch.manual_seed(0)
    trainer = StableGRPOTrainer(model=model, reward_funcs=[arithmetic_reward], args=args, processing_class=tokenizer,
                                train_dataset=arithmetic_dataset(64, seed=0, max_operand=9),
                                rollout_func=sparse_rollout)  # fmt: skip
    if inject is not None:
        FaultInjectionCallback.attach(trainer, **inject)
    trainer.train()
    (callback,) = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, StabilityGuardCallback)] or [None]
    grad_norms = {h["step"]: h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h}
    return trainer, callback, grad_norms


@pytest.fixture(scope="module")
def clean_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sparse")
    return _sparse_grpo(root / "guarded", guard=True), _sparse_grpo(root / "plain", guard=False)


def test_the_guard_takes_no_action_on_a_sparse_reward_run(clean_runs):
    (guarded, callback, grad_norms), (plain, _, plain_norms) = clean_runs
    learning = [s for s, g in grad_norms.items() if g > 0]
    # the premise: most steps have a zero gradient, and enough of them learn to fill the window
    assert len(grad_norms) == STEPS and GUARD["guard_min_history"] + 3 <= len(learning) <= STEPS // 2
    policy = callback.policy
    assert callback.decisions == []
    assert (policy.anomalies, policy.skips, policy.rollbacks) == (0, 0, 0)
    assert policy.idle == STEPS - len(learning) and len(policy.grad_window) == len(learning)
    assert policy.confirmed_steps  # snapshots were taken: the guard was armed
    for (name, p), q in zip(guarded.model.named_parameters(), plain.model.parameters(), strict=True):
        assert torch.equal(p, q), name  # bitwise the run without a guard
    assert grad_norms == plain_norms


@pytest.mark.parametrize(("kind", "expected"), [("loss_scale", "grad"), ("nan_loss", "nonfinite")])
def test_the_same_run_still_catches_an_injected_fault(clean_runs, tmp_path, kind, expected):
    (_, _, grad_norms), _ = clean_runs
    learning = [s for s, g in grad_norms.items() if g > 0]
    fault = learning[GUARD["guard_min_history"] + 1]  # a step that learns, once the window has its history
    _, callback, _ = _sparse_grpo(tmp_path, guard=True, inject={"kind": kind, "steps": [fault], "factor": 100.0})
    assert [(d.step, d.kind, d.action) for d in callback.decisions] == [(fault, expected, "skip")]
    if kind == "loss_scale":
        assert callback.decisions[0].grad_z > 6.0
