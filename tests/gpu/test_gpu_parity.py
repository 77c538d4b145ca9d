"""bf16 on CUDA: with every hf_stable flag at its default, StableSFTTrainer and StableGRPOTrainer make TRL's update;
an hf_stable objective runs in bf16 and changes the update."""

import pytest
from gpu_helpers import GPU, ON_GPU_BF16, close_updates


pytestmark = GPU


def test_sft_bf16_default_equals_trl(tmp_path):
    from sft_helpers import one_step_update
    from trl import SFTConfig, SFTTrainer

    ours, trainer = one_step_update(tmp_path / "ours", 8, 1, **ON_GPU_BF16)
    assert trainer.model.device.type == "cuda" and trainer.args.bf16
    theirs, _ = one_step_update(tmp_path / "trl", 8, 1, trainer_cls=SFTTrainer, config_cls=SFTConfig, **ON_GPU_BF16)
    close_updates(ours, theirs, rtol=1e-6)
    prob, _ = one_step_update(tmp_path / "p", 8, 1, sft_objective="prob_power", objective_alpha=1.0, **ON_GPU_BF16)
    assert prob.isfinite().all() and (prob - ours).abs().max() > 0


def test_grpo_bf16_default_equals_trl(tmp_path):
    from grpo_helpers import grpo_run
    from trl import GRPOConfig, GRPOTrainer

    ours, trainer = grpo_run(tmp_path / "ours", **ON_GPU_BF16)
    assert trainer.model.device.type == "cuda"
    theirs, _ = grpo_run(tmp_path / "trl", trainer_cls=GRPOTrainer, config_cls=GRPOConfig, **ON_GPU_BF16)
    close_updates(ours, theirs, rtol=1e-6)
    maxrl, _ = grpo_run(tmp_path / "s", advantage_estimator="maxrl", correctness_reward_index=0, **ON_GPU_BF16)
    assert maxrl.isfinite().all() and (maxrl - ours).abs().max() > 0


@pytest.mark.parametrize(
    "objective", [{"sft_objective": "threshold", "threshold": 0.012}, {"sequence_objective": "redi"}]
)
def test_sft_objectives_match_fp32_cpu_in_fp32_on_gpu(tmp_path, objective):
    """The same objective on CUDA (fp32) and on the CPU give the same update: no device-dependent branch."""
    from gpu_helpers import ON_GPU
    from sft_helpers import one_step_update

    gpu, _ = one_step_update(tmp_path / "gpu", 8, 1, **ON_GPU, **objective)
    cpu, _ = one_step_update(tmp_path / "cpu", 8, 1, **objective)
    close_updates(gpu, cpu, rtol=1e-4)
