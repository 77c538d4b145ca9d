"""A tiny causal LM trained by a plain `transformers.Trainer` for the WSM / merge callback tests and the DDP script."""

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from hf_stable.testing import build_tiny_model


SEQ, ROWS = 8, 64


class TokenRows(torch.utils.data.Dataset):
    def __init__(self, vocab: int, rows: int = ROWS, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(7, vocab, (rows, SEQ), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i], "attention_mask": torch.ones(SEQ, dtype=torch.long)}


def tiny_model():
    model, tokenizer = build_tiny_model(
        seed=0, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1
    )
    return model, tokenizer


class Recorder(TrainerCallback):
    """Independent copy of the trainable weights after every optimiser step (step 0 = before training)."""

    def __init__(self):
        self.snapshots: dict[int, dict[str, torch.Tensor]] = {}

    def _take(self, step, model):
        self.snapshots[step] = {n: p.detach().clone().double() for n, p in model.named_parameters() if p.requires_grad}

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._take(state.global_step, model)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self._take(state.global_step, model)


class StopAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True


def make_trainer(output_dir, callbacks, *, max_steps=16, model=None, eval_dataset=False, **overrides):
    if model is None:
        model, _ = tiny_model()
    kwargs = dict(
        output_dir=str(output_dir),
        max_steps=max_steps,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=8,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        weight_decay=0.01,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    kwargs.update(overrides)
    vocab = model.config.vocab_size
    return Trainer(
        model=model,
        args=TrainingArguments(**kwargs),
        train_dataset=TokenRows(vocab),
        eval_dataset=TokenRows(vocab, rows=16, seed=1) if eval_dataset else None,
        callbacks=callbacks,
    )
