"""One-optimizer-step parameter updates of the SFT trainers, shared by the in-process tests and the DDP script.

Plain SGD with lr = 1, no clipping, no weight decay: the update is minus the gradient of the step's loss, so two runs
agree exactly when they optimise the same objective over the same global batch.
"""

import torch

from hf_stable.testing import arithmetic_dataset, arithmetic_preference_dataset, build_tiny_model


STEP_ARGS = dict(
    max_steps=1,
    learning_rate=1.0,
    optim="sgd",
    max_grad_norm=0.0,
    lr_scheduler_type="constant",
    weight_decay=0.0,
    save_strategy="no",
    report_to="none",
    use_cpu=True,
    bf16=False,
    max_length=32,
    gradient_checkpointing=False,
    disable_tqdm=True,
    dataloader_num_workers=0,
    ddp_find_unused_parameters=False,
)

# Every objective family, with values that make each term matter on a random-init model (p ≈ 0.012).
OBJECTIVES = {
    "nll": {},
    "prob_power_0": {"sft_objective": "prob_power", "objective_alpha": 0.0},
    "prob_power_1": {"sft_objective": "prob_power", "objective_alpha": 1.0},
    "prob_power_half": {"sft_objective": "prob_power", "objective_alpha": 0.5},
    "threshold_active": {"sft_objective": "threshold", "threshold": 0.012},
    "threshold_supervised": {
        "sft_objective": "threshold",
        "threshold": 0.012,
        "threshold_normalization": "supervised",
    },
    "bottom_logp": {"sft_objective": "threshold", "threshold_kind": "bottom_logp", "threshold": 0.012},
    "redi": {"sequence_objective": "redi"},
    "feasible": {"sample_reweighting": "feasible"},
}

GLOBAL_BATCH = 8


def dataset_for(config: dict):
    """Exactly one global batch (8 sequences), so one step sees the same data in every layout."""
    if config.get("sequence_objective") == "redi":
        return arithmetic_preference_dataset(GLOBAL_BATCH // 2, seed=1, max_operand=999)
    return arithmetic_dataset(GLOBAL_BATCH, seed=1, max_operand=999)


def one_step_update(output_dir, batch_size, grad_accum, trainer_cls=None, config_cls=None, peft_config=None, **config):
    """Flattened update of the trainable parameters over one optimizer step (and the trainer)."""
    if trainer_cls is None:
        from hf_stable import StableSFTConfig, StableSFTTrainer

        trainer_cls, config_cls = StableSFTTrainer, StableSFTConfig
    model, tokenizer = build_tiny_model(seed=0)
    args = config_cls(
        output_dir=str(output_dir),
        per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=grad_accum,
        **{**STEP_ARGS, **config},
    )
    torch.manual_seed(0)  # adapters are initialised inside the trainer, before it seeds
    trainer = trainer_cls(
        model=model,
        args=args,
        train_dataset=dataset_for(config),
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    return train_and_diff(trainer), trainer


def train_and_diff(trainer):
    """Train and return the flattened change of the trainable parameters, in `named_parameters` order."""
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    after = dict(trainer.model.named_parameters())
    return torch.cat([(after[n].detach() - before[n]).flatten() for n in before])


def assert_same_update(actual, expected, rtol=1e-5):
    scale = expected.abs().max().item()
    assert scale > 0, "the reference update is zero: the comparison would prove nothing"
    diff = (actual - expected).abs().max().item()
    assert diff <= rtol * scale, f"updates differ by {diff:.3e} (scale {scale:.3e})"
