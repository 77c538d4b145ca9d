"""TRL's own GRPOConfig options under the hf_stable loss modes: each is applied (it changes the update, or its exact
value is checked) or refused by name when the config is built. The vLLM importance-sampling ratio and the MoE router
loss are applied by `_compute_loss` for every loss mode, checked against an independent computation."""

import pytest
import torch
from grpo_helpers import GRPO_ARGS, deterministic_rollout, grpo_run

from hf_stable import StableGRPOConfig, StableGRPOTrainer
from hf_stable.losses.policy import LOSS_MODES
from hf_stable.testing import arithmetic_dataset, arithmetic_reward, build_tiny_tokenizer


MODES = {
    "drpo": {"loss_mode": "drpo", "correctness_reward_index": 0},
    "onpolicy_sft": {"loss_mode": "onpolicy_sft", "correctness_reward_index": 0},
}
# TRL's PPO-surrogate options a loss mode replaces: refused by name unless left at TRL's default
REFUSED = {
    "loss_type": "grpo",
    "epsilon": 0.1,
    "epsilon_high": 0.28,
    "delta": 2.0,
    "importance_sampling_level": "sequence",
    "top_entropy_quantile": 0.2,
    "entropy_coef": 0.5,
    "use_adaptive_entropy": True,
    "scale_rewards": "batch",
    "multi_objective_aggregation": "normalize_then_sum",
    "off_policy_mask_threshold": 0.5,
    "beta": 0.04,
}


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("option", sorted(REFUSED))
def test_unhonoured_trl_option_is_refused_by_name(tmp_path, mode, option):
    with pytest.raises(ValueError) as error:
        StableGRPOConfig(
            output_dir=str(tmp_path), use_cpu=True, report_to="none", **MODES[mode], **{option: REFUSED[option]}
        )
    assert f"{option}=" in str(error.value) and "loss_mode" in str(error.value), str(error.value)


def test_every_trl_loss_option_is_honoured_or_refused():
    """The options the issue lists, each either in a loss mode's `honours` or refused by one of its `requires`."""
    listed = {*REFUSED, "mask_truncated_completions", "vllm_importance_sampling_correction", "router_aux_loss_coef"}
    by_the_trainer = {"vllm_importance_sampling_correction", "router_aux_loss_coef"}  # `_compute_loss`, every mode
    for mode in LOSS_MODES:
        covered = set(mode.honours) | {rule.option for rule in mode.requires} | by_the_trainer
        assert listed <= covered, (mode.name, listed - covered)


@pytest.mark.parametrize(
    ("mode", "extra"),
    [("drpo", {}), ("onpolicy_sft", {"osft_require_eos": False})],  # with require_eos the mask is redundant
)
def test_mask_truncated_completions_is_applied(tmp_path, mode, extra):
    config = {**MODES[mode], **extra}
    plain, _ = grpo_run(tmp_path / "a", **config)
    masked, _ = grpo_run(tmp_path / "b", mask_truncated_completions=True, **config)
    assert plain.abs().max() > 0 and not torch.equal(plain, masked)


def test_generation_reuse_activates_drpo_trust_region(tmp_path):
    """With `steps_per_generation=2` the second step is off-policy: DRPO's KL to π_old is logged non-zero."""
    _, trainer = grpo_run(tmp_path, max_steps=2, steps_per_generation=2, **MODES["drpo"])
    kls = [log["stable/grpo/drpo/kl"] for log in trainer.state.log_history if "stable/grpo/drpo/kl" in log]
    assert kls[0] == 0 and kls[1] != 0


# ---------------------------------------------------------------------------------------------------------------------
# `_compute_loss`: vLLM importance-sampling ratio and the MoE router loss, exact


def _trainer(tmp_path, model, tokenizer, mode):
    args = StableGRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=4, **{**GRPO_ARGS, **MODES[mode], "num_generations": 4}
    )
    trainer = StableGRPOTrainer(
        model=model,
        reward_funcs=[arithmetic_reward],
        args=args,
        train_dataset=arithmetic_dataset(8, seed=0, max_operand=9),
        processing_class=tokenizer,
        rollout_func=deterministic_rollout,
    )
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop
    return trainer


def _inputs(mode):
    g = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(5, 20, (4, 3), generator=g)
    completion_ids = torch.randint(5, 20, (4, 5), generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0]])
    advantages = torch.tensor([2.0, -1.0, 0.5, -1.5]) if mode == "drpo" else torch.tensor([1.0, 0.0, 1.0, 1.0])
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": torch.ones_like(prompt_ids),
        "completion_ids": completion_ids,
        "completion_mask": mask,
        "advantages": advantages,
        "num_items_in_batch": mask.sum(),
        "importance_sampling_ratio": torch.rand(4, 5, generator=g) + 0.5,
    }


def _grads(model, loss):
    model.zero_grad()
    loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize("mode", sorted(MODES))
def test_vllm_importance_sampling_ratio_weights_every_token(tmp_path, mode):
    """With vLLM's correction on, the gradient is that of TRL's ratio-weighted per-token loss: DRPO's
    `-mean_i a_i Σ_t ρ_t m_t log π_t / L_i`, on-policy SFT's `-Σ ρ_t m_t log π_t / tokens`."""
    from hf_stable.testing import build_tiny_model

    model, tokenizer = build_tiny_model(seed=0)
    trainer = _trainer(tmp_path, model, tokenizer, mode)
    trainer.model.train()
    inputs = _inputs(mode)
    trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, True
    got = _grads(trainer.model, trainer._compute_loss(trainer.model, dict(inputs)))

    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, attention, 5)
    m, rho = inputs["completion_mask"].float(), inputs["importance_sampling_ratio"]
    weighted = (rho * m * logps).sum(1)
    if mode == "drpo":
        expected_loss = -(inputs["advantages"] * weighted / m.sum(1)).mean()
    else:
        expected_loss = -weighted.sum() / m.sum()
    expected = _grads(trainer.model, expected_loss)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)

    trainer.use_vllm = False  # the ratio is ignored without vLLM (TRL's rule): a different update
    assert not torch.allclose(_grads(trainer.model, trainer._compute_loss(trainer.model, dict(inputs))), got)


def _moe_model(tokenizer, coef):
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        output_router_logits=True,
        router_aux_loss_coef=coef,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        tie_word_embeddings=True,
    )
    return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_moe_router_aux_loss_is_added(tmp_path, mode):
    """The loss is the mode's loss plus `router_aux_loss_coef · aux`, with `aux` from a plain forward of the model."""
    tokenizer = build_tiny_tokenizer()
    coef = 0.5
    trainer = _trainer(tmp_path, _moe_model(tokenizer, coef), tokenizer, mode)
    assert trainer.aux_loss_enabled
    trainer.model.train()
    inputs = _inputs(mode)
    with_aux = trainer._compute_loss(trainer.model, dict(inputs))
    trainer.aux_loss_enabled = False
    without = trainer._compute_loss(trainer.model, dict(inputs))
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    aux = trainer.model(input_ids=ids, attention_mask=attention, output_router_logits=True).aux_loss
    assert aux > 0
    torch.testing.assert_close(with_aux - without, coef * aux, rtol=1e-5, atol=1e-7)
    assert trainer._metrics["train"]["aux_loss"][-1] == pytest.approx(aux.item(), rel=1e-5)
