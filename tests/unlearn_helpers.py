"""One-optimizer-step updates of `UnlearningTrainer`, shared by the in-process tests and the DDP script.

Plain SGD with lr = 1, no clipping: the update is minus the gradient of the step's loss. The forget set is exactly one
global batch, so every layout (batch 8 × accumulation 1, 4 × 2, two processes × 4) sees the same rows and partners.
"""

import torch

from hf_stable.testing import arithmetic_dataset, build_tiny_model


GLOBAL_BATCH = 8
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
    disable_tqdm=True,
    dataloader_num_workers=0,
    ddp_find_unused_parameters=False,
    logging_steps=1,
    collapse_guard=False,
    seed=0,
)

# Every method, with settings that make each term matter on a random-init model.
METHODS = {
    "ga": {"unlearn_method": "ga"},
    "ga_sequence": {"unlearn_method": "ga", "forget_reduction": "sequence"},
    "graddiff": {"unlearn_method": "graddiff"},
    "graddiff_kl": {"unlearn_method": "graddiff", "retain_loss_type": "kl"},
    "npo": {"unlearn_method": "npo"},
    "simnpo": {"unlearn_method": "simnpo", "simnpo_beta": 0.5},
    "sga": {"unlearn_method": "sga", "sga_num_normal": 2},
    "sga_auto": {"unlearn_method": "sga", "sga_num_normal": 2, "sga_rate": "auto", "sga_rate_range": [-2.0, 2.0]},
    "pdu": {"unlearn_method": "pdu", "pdu_eps": 1.0, "pdu_lambda0": 2.0},
    "stableun": {"unlearn_method": "stableun", "stableun_rho": 0.05, "simnpo_beta": 0.5},
    "dmm_prior": {"unlearn_method": "dmm", "dmm_target": "prior"},
}


def split_data(n_forget=GLOBAL_BATCH, n_retain=24, seed=3):
    data = arithmetic_dataset(4 * (n_forget + n_retain), seed=seed, max_operand=999)
    seen, rows = set(), []
    for row in data:
        if row["prompt"] not in seen:
            seen.add(row["prompt"])
            rows.append(row)
    from datasets import Dataset

    return Dataset.from_list(rows[:n_forget]), Dataset.from_list(rows[n_forget : n_forget + n_retain])


def unlearn_update(output_dir, batch_size, grad_accum, trainer_kwargs=None, train=True, **config):
    """Flattened change of the trainable parameters over the run, and the trainer."""
    from hf_stable import UnlearningConfig, UnlearningTrainer

    model, tokenizer = build_tiny_model(seed=0)
    forget, retain = split_data()
    args = UnlearningConfig(
        output_dir=str(output_dir),
        per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=grad_accum,
        **{**STEP_ARGS, **config},
    )
    torch.manual_seed(0)
    trainer = UnlearningTrainer(
        model=model,
        args=args,
        forget_dataset=forget,
        retain_dataset=retain,
        processing_class=tokenizer,
        **(trainer_kwargs or {}),
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    if train:
        trainer.train()
    after = dict(trainer.model.named_parameters())
    return torch.cat([(after[n].detach() - before[n]).flatten() for n in before]), trainer
