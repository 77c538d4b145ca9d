"""`gradient_aggregation` in `StableGRPOTrainer` (Jacobian descent over the per-reward policy gradients): the
Jacobian path with a plain weighted sum reproduces TRL's update, UPGrad removes a real conflict between two rewards,
gradient accumulation does not change the update, and what cannot run is refused by name."""

import pytest
import torch
from grpo_helpers import G, grpo_run

import hf_stable.trainers._jacobian as glue
from hf_stable import StableGRPOConfig
from hf_stable.losses import jacobian
from hf_stable.testing import arithmetic_reward


def long_reward(completions, **kwargs):
    """Rewards length; the correct answers are the rollout's shortest, so it pulls against correctness."""
    return [0.1 * len(c) for c in completions]


CONFLICT = (arithmetic_reward, long_reward)
CPU = {"use_cpu": True, "bf16": False, "report_to": "none"}


@pytest.fixture
def captured(monkeypatch):
    """Records each step's Jacobian and lets a test swap the aggregator."""
    seen = {"jacobians": [], "method": None}

    def spy(j, w, method):
        seen["jacobians"].append(j.clone())
        return jacobian.aggregate(j, w, seen["method"] or method)

    monkeypatch.setattr(glue, "aggregate", spy)
    return seen


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_the_jacobian_with_a_weighted_sum_is_todays_update(tmp_path, captured, grad_accum):
    """Rows = gradients of TRL's loss with each reward's part of the advantage; `Σ_k w_k row_k` is the gradient of the
    scalarised loss, so the whole path (parts, K backwards, accumulation, `.grad`) must give TRL's update."""
    batch = 2 * G // grad_accum
    weights = [1.0, 0.5]
    today, _ = grpo_run(tmp_path / "sum", batch_size=batch, grad_accum=grad_accum, reward_weights=weights)
    captured["method"] = "sum"
    through, trainer = grpo_run(
        tmp_path / "jd", batch_size=batch, grad_accum=grad_accum, reward_weights=weights, gradient_aggregation="upgrad"
    )
    assert len(captured["jacobians"]) == 1 and trainer._jacobian is not None
    assert today.abs().max() > 0
    torch.testing.assert_close(through, today, rtol=1e-5, atol=1e-6)  # fp32: K backwards summed vs one


def test_upgrad_removes_a_conflict_between_two_rewards(tmp_path, captured):
    summed, _ = grpo_run(tmp_path / "sum", reward_funcs=CONFLICT)
    upgrad, _ = grpo_run(tmp_path / "upgrad", reward_funcs=CONFLICT, gradient_aggregation="upgrad")
    (j,) = captured["jacobians"]
    j = j.double()
    assert float(j[0] @ j[1]) < 0, "the two rewards' gradients should conflict on this task"
    assert not torch.allclose(upgrad, summed)
    # SGD with lr 1: the update is minus the aggregated gradient
    step = -upgrad.double()
    trace = float(j.pow(2).sum())
    assert (j @ step >= -1e-3 * trace * step.norm() / j.norm(dim=1).max()).all(), j @ step
    assert (j @ -summed.double()).min() < 0  # the plain sum opposes one of them


@pytest.mark.parametrize("method", ["upgrad", "aligned_mtl"])
def test_parameters_change(tmp_path, method):
    delta, trainer = grpo_run(tmp_path, reward_funcs=CONFLICT, gradient_aggregation=method)
    assert torch.isfinite(delta).all() and delta.abs().max() > 0
    assert not trainer._jacobian.any()  # emptied after the step


@pytest.mark.parametrize("method", ["upgrad", "aligned_mtl"])
def test_gradient_accumulation_does_not_change_the_update(tmp_path, method):
    one, _ = grpo_run(tmp_path / "one", reward_funcs=CONFLICT, gradient_aggregation=method)
    two, _ = grpo_run(
        tmp_path / "two", batch_size=G, grad_accum=2, reward_funcs=CONFLICT, gradient_aggregation=method
    )
    torch.testing.assert_close(two, one, rtol=1e-4, atol=1e-6)


def test_aligned_mtl_differs_from_upgrad(tmp_path):
    a, _ = grpo_run(tmp_path / "a", reward_funcs=CONFLICT, gradient_aggregation="aligned_mtl")
    b, _ = grpo_run(tmp_path / "b", reward_funcs=CONFLICT, gradient_aggregation="upgrad")
    assert not torch.allclose(a, b)


def test_one_reward_is_refused(tmp_path):
    message = r"gradient_aggregation='upgrad'.*at least 2 reward functions.*`reward_funcs`"
    with pytest.raises(ValueError, match=message):
        grpo_run(tmp_path, reward_funcs=(arithmetic_reward,), gradient_aggregation="upgrad")


def test_a_jacobian_above_the_limit_is_refused_with_its_size(tmp_path):
    from hf_stable.testing import build_tiny_model

    model, _ = build_tiny_model(seed=0)
    n = sum(p.numel() for p in model.parameters())
    message = rf"needs {2 * n * 4} bytes \(2 reward functions × {n} trainable.*`jacobian_max_bytes`=1000"
    with pytest.raises(ValueError, match=message):
        grpo_run(tmp_path, gradient_aggregation="aligned_mtl", jacobian_max_bytes=1000)


def test_negative_reward_weights_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"`reward_weights`=\[1.0, -1.0\] must be >= 0"):
        grpo_run(tmp_path, gradient_aggregation="upgrad", reward_weights=[1.0, -1.0])


@pytest.mark.parametrize(
    ("option", "value"),
    [("beta", 0.04), ("loss_mode", "drpo"), ("reward_weighting", "ctwa"), ("entropy_coef", 0.01),
     ("multi_objective_aggregation", "normalize_then_sum"), ("advantage_estimator", "maxrl")],
)
def test_a_loss_that_is_no_sum_of_reward_terms_is_refused(tmp_path, option, value):
    with pytest.raises(ValueError, match=rf"gradient_aggregation='upgrad' cannot be combined with: {option}="):
        StableGRPOConfig(output_dir=str(tmp_path), gradient_aggregation="upgrad", **CPU, **{option: value})


def test_an_unknown_aggregator_is_refused(tmp_path):
    with pytest.raises(ValueError, match="gradient_aggregation"):
        StableGRPOConfig(output_dir=str(tmp_path), gradient_aggregation="mgda", **CPU)


def test_gradient_checkpointing_gives_the_same_update(tmp_path):
    """The K backwards share one forward; under checkpointing each recomputes its segments."""
    plain, _ = grpo_run(tmp_path / "plain", reward_funcs=CONFLICT, gradient_aggregation="upgrad")
    checkpointed, _ = grpo_run(
        tmp_path / "ckpt", reward_funcs=CONFLICT, gradient_aggregation="upgrad", gradient_checkpointing=True
    )
    torch.testing.assert_close(checkpointed, plain, rtol=1e-4, atol=1e-6)


def test_lora_rows_cover_the_adapter_only(tmp_path, captured):
    """Under LoRA the Jacobian spans the trainable adapter weights; the weighted sum still gives TRL's update."""
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    today, _ = grpo_run(tmp_path / "sum", reward_funcs=CONFLICT, peft_config=lora)
    captured["method"] = "sum"
    through, trainer = grpo_run(
        tmp_path / "jd", reward_funcs=CONFLICT, peft_config=lora, gradient_aggregation="upgrad"
    )
    n = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    assert captured["jacobians"][0].shape == (2, n) and n < sum(p.numel() for p in trainer.model.parameters()) / 10
    assert today.abs().max() > 0
    torch.testing.assert_close(through, today, rtol=1e-5, atol=1e-6)


def test_distributed_and_sharded_setups_are_refused_by_name():
    """The checks themselves, on a stand-in trainer (launching DDP, DeepSpeed or FSDP is the distributed suite's)."""
    from types import SimpleNamespace

    def fake(processes=1, n_gpu=1, deepspeed=False, fsdp=False):
        plugin = SimpleNamespace(zero_stage=3)
        return SimpleNamespace(
            accelerator=SimpleNamespace(num_processes=processes, state=SimpleNamespace(deepspeed_plugin=plugin)),
            args=SimpleNamespace(n_gpu=n_gpu, fp16=False, jacobian_max_bytes=2 << 30),
            is_deepspeed_enabled=deepspeed,
            is_fsdp_enabled=fsdp,
            reward_weights=torch.ones(2),
            aux_loss_enabled=False,
        )

    glue.JacobianDescentMixin._refuse_jacobian(fake(), "upgrad", 2, 10)  # one process: runs
    for setup, message in [
        ({"processes": 2}, r"2 processes \(DDP\)"),
        ({"n_gpu": 2}, r"n_gpu=2 \(DataParallel\)"),
        ({"deepspeed": True}, r"DeepSpeed ZeRO-3 \(`deepspeed`\)"),
        ({"fsdp": True}, r"FSDP \(`fsdp`\)"),
    ]:
        with pytest.raises(ValueError, match=rf"gradient_aggregation='upgrad' cannot run: {message}"):
            glue.JacobianDescentMixin._refuse_jacobian(fake(**setup), "upgrad", 2, 10)
