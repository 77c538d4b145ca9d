"""An untrained `StableGRPOTrainer` on the tiny model, for the stability config tests."""

from grpo_helpers import GRPO_ARGS

from hf_stable.testing import arithmetic_dataset, build_tiny_model


def constant_reward(completions, **kwargs):
    return [1.0 for _ in completions]


def grpo_trainer(output_dir, **config):
    from hf_stable import StableGRPOConfig, StableGRPOTrainer

    model, tokenizer = build_tiny_model(seed=0)
    args = StableGRPOConfig(str(output_dir), per_device_train_batch_size=8, **{**GRPO_ARGS, **config})
    return StableGRPOTrainer(model=model, reward_funcs=[constant_reward], args=args, processing_class=tokenizer,
                             train_dataset=arithmetic_dataset(8, seed=0, max_operand=9))  # fmt: skip
