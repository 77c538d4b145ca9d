"""GRPO with vLLM generating in the training process (`vllm_mode="colocate"`), when vllm is installed."""

import pytest
from gpu_helpers import GPU


pytestmark = GPU


def test_grpo_with_vllm_colocate(tiny_model_dir, tmp_path):
    pytest.importorskip("vllm")
    from hf_stable import StableGRPOConfig, StableGRPOTrainer
    from hf_stable.testing import arithmetic_dataset, arithmetic_reward

    args = StableGRPOConfig(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=6,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=False,
        bf16=True,
        beta=0.0,
        advantage_estimator="maxrl",
        correctness_reward_index=0,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.2,
        vllm_enable_sleep_mode=False,
    )
    trainer = StableGRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=[arithmetic_reward],
        args=args,
        train_dataset=arithmetic_dataset(32, seed=0, max_operand=9),
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    logged = [h for h in trainer.state.log_history if "reward" in h]
    assert len(logged) == 2 and all(0.0 <= h["reward"] <= 1.0 for h in logged)
    assert any(not p.detach().equal(before[n]) for n, p in trainer.model.named_parameters())
