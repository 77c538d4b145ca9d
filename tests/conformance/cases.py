"""The conformance cases: each TRL option family that TRL's own GRPO and SFT trainer tests exercise on a CPU, as a
config for TRL's trainer and ours (the same config, every hf_stable flag at its default), and each TRL option an
hf_stable method cannot honour, as a refusal case.

Enumerated from `tests/test_grpo_trainer.py` and `tests/test_sft_trainer.py` of TRL's repository (read at commit
f2cd577 of its main branch, which is newer than the TRL 1.16 the tests run against; every option used here exists in
1.16); the cases are written for this repository's tiny models and tasks. `docs/compatibility.md` is generated from
these lists (`test_compatibility_page_is_generated`).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Case:
    """One side-by-side run. ``config``: `GRPOConfig`/`SFTConfig` values on top of the shared step arguments;
    ``setup``: what else the run uses (a dataset kind, reward sources, a PEFT method, a model family), read by the
    runner; ``family``: the TRL option family the table groups it under."""

    name: str
    family: str
    config: dict = field(default_factory=dict)
    setup: dict = field(default_factory=dict)


def _grpo() -> list[Case]:
    cases = [
        Case("default, TRL's sampling", "defaults", {"max_steps": 2}, {"rollout": False}),
        Case("default, fixed rollouts", "defaults"),
        Case("conversational prompts", "datasets", {},
             {"data": "conversational", "rollout": False, "rewards": "digits"}),
    ]  # fmt: skip
    for loss_type in ("grpo", "bnpo", "dr_grpo", "cispo", "sapo", "luspo", "vespo"):  # dapo: the default
        cases.append(Case(f"loss_type={loss_type}", "loss_type", {"loss_type": loss_type}))
    cases += [
        Case("scale_rewards=batch", "scale_rewards", {"scale_rewards": "batch"}),
        Case("scale_rewards=none", "scale_rewards", {"scale_rewards": "none"}),
        Case("importance_sampling_level=sequence, num_iterations=2", "importance_sampling_level",
             {"importance_sampling_level": "sequence", "num_iterations": 2, "max_steps": 2}),
        Case("mask_truncated_completions", "mask_truncated_completions", {"mask_truncated_completions": True}),
        Case("beta=0.04 (reference model, bias-corrected KL)", "beta", {"beta": 0.04, "max_steps": 2},
             {"model": "saved"}),
        Case("beta=0.04, use_bias_correction_kl=False, sync_ref_model", "beta",
             {"beta": 0.04, "use_bias_correction_kl": False, "sync_ref_model": True, "ref_model_sync_steps": 1,
              "max_steps": 2}, {"model": "saved"}),
        Case("top_entropy_quantile=0.5", "entropy", {"top_entropy_quantile": 0.5}),
        Case("entropy_coef=0.01", "entropy", {"entropy_coef": 0.01}),
        Case("use_adaptive_entropy", "entropy", {"use_adaptive_entropy": True, "max_steps": 2}),
        Case("steps_per_generation=2", "steps_per_generation", {"steps_per_generation": 2, "max_steps": 2}),
        Case("num_iterations=2, epsilon_high, delta", "num_iterations",
             {"num_iterations": 2, "max_steps": 2, "epsilon_high": 0.28, "delta": 1.5}),
        Case("num_iterations=2, off_policy_mask_threshold", "num_iterations",
             {"num_iterations": 2, "max_steps": 2, "off_policy_mask_threshold": 0.01}),
        Case("gradient_accumulation_steps=2", "batching", {"gradient_accumulation_steps": 2}),
        Case("temperature, top_k, top_p, repetition_penalty", "generation",
             {"temperature": 0.7, "top_k": 20, "top_p": 0.9, "repetition_penalty": 1.1}, {"rollout": False}),
        Case("cast_lm_head_to_fp32", "precision", {"cast_lm_head_to_fp32": True}),
        Case("evaluation, num_generations_eval=2", "evaluation",
             {"eval_strategy": "steps", "eval_steps": 1, "num_generations_eval": 2, "per_device_eval_batch_size": 4},
             {"eval": True}),
        Case("reward_weights=[1, 0.5]", "multiple rewards", {"reward_weights": [1.0, 0.5]}),
        Case("multi_objective_aggregation=normalize_then_sum", "multiple rewards",
             {"multi_objective_aggregation": "normalize_then_sum"}),
        Case("sync and async reward functions", "multiple rewards", {}, {"rewards": "async"}),
        Case("reward model + reward_processing_classes", "reward models", {}, {"rewards": "model"}),
        Case("environment_factory, reward_funcs=None", "environment_factory", {},
             {"rewards": "environment", "rollout": False}),
        Case("environment_factory and reward_funcs", "environment_factory", {},
             {"rewards": "environment+funcs", "rollout": False}),
        # First turns from `rollout_func` (a call, a failing call, a wrong call, a plain answer); TRL parses them,
        # runs the tool and samples the turn after the tool result. SmolLM2's tokenizer, TRL's Qwen3 template.
        Case("tools=[add], Qwen3 chat template", "tool calling",
             {"max_completion_length": 72, "per_device_train_batch_size": 4},
             {"model": "smollm2-tokenizer qwen3", "rewards": "tools"}),
    ]  # fmt: skip
    return cases


def _sft() -> list[Case]:
    return [
        Case("default (prompt-completion, completion-only loss)", "defaults"),
        Case("completion_only_loss=False", "completion_only_loss", {"completion_only_loss": False}),
        Case("language modeling (text)", "datasets", {}, {"data": "text"}),
        Case("conversational prompt-completion", "datasets", {}, {"data": "conversational"}),
        Case("messages, assistant_only_loss", "assistant_only_loss", {"assistant_only_loss": True},
             {"data": "messages"}),
        Case("loss_type=dft", "loss_type", {"loss_type": "dft"}),
        Case("padding_free", "padding_free", {"padding_free": True, "max_length": None}),
        Case("packing (bfd)", "packing", {"packing": True, "max_length": 24}),
        Case("packing_strategy=wrapped", "packing",
             {"packing": True, "packing_strategy": "wrapped", "max_length": 24}),
        Case("pad_to_multiple_of=8, max_length=8", "padding", {"pad_to_multiple_of": 8, "max_length": 8}),
        Case("gradient_accumulation_steps=2", "batching", {"gradient_accumulation_steps": 2}),
        Case("evaluation", "evaluation", {"eval_strategy": "steps", "eval_steps": 1}, {"eval": True}),
    ]  # fmt: skip


PEFT_METHODS = ("lora", "loha", "lokr", "ia3", "oft", "vera", "ln_tuning", "prompt_tuning", "prefix_tuning",
                "p_tuning")  # fmt: skip
MODEL_FAMILIES = ("llama", "qwen3", "gemma", "gemma2", "mistral", "phi3", "qwen3_moe")


def parity_cases() -> dict[str, list[Case]]:
    """``{"grpo": [...], "sft": [...]}``: every side-by-side case."""
    out = {}
    for trainer, cases in (("grpo", _grpo()), ("sft", _sft())):
        cases += [Case(f"peft: {m}", "PEFT", {}, {"peft": m}) for m in PEFT_METHODS]
        cases += [Case(f"model: {f}", "model families", {}, {"model": f}) for f in MODEL_FAMILIES]
        out[trainer] = cases
    return out


# For each trainer, a value of each TRL option that an hf_stable method's `requires` rule rejects.
_COMMON_UNHONOURED = {
    "beta": 0.04,
    "epsilon": 0.1,
    "epsilon_high": 0.28,
    "delta": 2.0,
    "importance_sampling_level": "sequence",
    "top_entropy_quantile": 0.5,
    "entropy_coef": 0.01,
    "use_adaptive_entropy": True,
    "scale_rewards": "batch",
    "multi_objective_aggregation": "normalize_then_sum",
    "off_policy_mask_threshold": 0.5,
    "use_liger_kernel": True,
    "gradient_accumulation_steps": 1,
    "packing": True,
}
UNHONOURED_VALUES = {
    "grpo": {**_COMMON_UNHONOURED, "loss_type": "cispo"},  # every loss-type rule refuses it, the PPO ones too
    "sft": {**_COMMON_UNHONOURED, "loss_type": "dft"},
}
