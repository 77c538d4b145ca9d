"""TRL's GRPOTrainer and StableGRPOTrainer generating with colocated vLLM on a CPU, trained for real.

Every run checks the sampler/trainer log-prob gap that TRL logs: the policy moves at every step, so a sampler that
missed a weight sync is off by nats, not by rounding.
"""

import pytest
from vllm_helpers import (
    GAP_KEY,
    MAX_GAP,
    assert_sampler_in_sync,
    float32_sampler,
    short_answer_reward,
    step_logs,
    train_with_vllm,
)

from hf_stable import StableGRPOConfig, StableGRPOTrainer
from hf_stable._vllm_cpu import keep_unpacked_linear_weights, restore_packed_linear_weights


pytestmark = pytest.mark.slow


@pytest.fixture
def patched(monkeypatch):
    float32_sampler(monkeypatch)
    assert keep_unpacked_linear_weights()
    yield
    restore_packed_linear_weights()


def test_trl_and_stable_log_identical_metrics(vllm_model_dir, tmp_path, patched):
    from trl import GRPOConfig, GRPOTrainer

    trl_trainer = train_with_vllm(vllm_model_dir, tmp_path / "trl", GRPOTrainer, GRPOConfig)
    trl_logs = step_logs(trl_trainer)
    assert_sampler_in_sync(trl_trainer)
    del trl_trainer
    ours = train_with_vllm(vllm_model_dir, tmp_path / "ours", StableGRPOTrainer, StableGRPOConfig)
    assert_sampler_in_sync(ours)
    assert step_logs(ours) == trl_logs


def test_stable_trainer_applies_the_cpu_fix_itself(vllm_model_dir, tmp_path, monkeypatch):
    float32_sampler(monkeypatch)
    restore_packed_linear_weights()
    try:
        trainer = train_with_vllm(vllm_model_dir, tmp_path, StableGRPOTrainer, StableGRPOConfig)
    finally:
        restore_packed_linear_weights()
    assert_sampler_in_sync(trainer)


def test_without_the_cpu_fix_trl_sync_fails(vllm_model_dir, tmp_path, monkeypatch):
    """vLLM-CPU's packed linear layers have no `weight` to load into (float32 takes oneDNN's path on every x86 CPU)."""
    from trl import GRPOConfig, GRPOTrainer

    float32_sampler(monkeypatch)
    restore_packed_linear_weights()
    with pytest.raises(AttributeError, match="weight_loader"):
        train_with_vllm(vllm_model_dir, tmp_path, GRPOTrainer, GRPOConfig)


def test_a_stale_sampler_fails_the_gap_check(vllm_model_dir, tmp_path, patched, monkeypatch):
    """The check every test makes can fail: with the weight sync skipped, the gap grows past MAX_GAP by orders."""
    from trl import GRPOConfig, GRPOTrainer
    from trl.generation.vllm_generation import VLLMGeneration

    monkeypatch.setattr(VLLMGeneration, "sync_weights", lambda self: None)
    trainer = train_with_vllm(vllm_model_dir, tmp_path, GRPOTrainer, GRPOConfig)
    gaps = [h[GAP_KEY] for h in step_logs(trainer)]
    assert gaps[0] < MAX_GAP < 100 * MAX_GAP < max(gaps[1:]), gaps
    with pytest.raises(AssertionError):
        assert_sampler_in_sync(trainer)


@pytest.mark.parametrize(
    "config",
    [
        dict(advantage_estimator="sgrpo", correctness_reward_index=0),
        dict(loss_mode="ess"),
        dict(loss_mode="drpo", correctness_reward_index=0, reward_funcs=(short_answer_reward,)),
        dict(loss_mode="onpolicy_sft", correctness_reward_index=0, reward_funcs=(short_answer_reward,)),
        dict(stability_guard=True),
    ],
    ids=["sgrpo", "ess", "drpo", "onpolicy_sft", "stability_guard"],
)
def test_methods_train_with_vllm(vllm_model_dir, tmp_path, patched, config):
    trainer = train_with_vllm(vllm_model_dir, tmp_path, StableGRPOTrainer, StableGRPOConfig, **config)
    assert_sampler_in_sync(trainer)
