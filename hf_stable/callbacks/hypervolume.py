"""Validation evaluations for the hypervolume-guided reward weighting of `StableGRPOTrainer` (arXiv 2509.11452)."""

from __future__ import annotations

import torch
from transformers import TrainerCallback
from trl.data_utils import is_conversational
from trl.models.utils import unwrap_model_for_generation


class HypervolumeCallback(TrainerCallback):
    """Evaluates the per-objective mean rewards of greedy completions on a fixed validation set before training (the
    hypervolume reference point) and every `drw_eval_every` steps, and feeds them to the trainer's controller (a
    `reward_weighting` method with ``needs_validation``: it reads ``val_size``, ``eval_every`` and
    ``validation_point``)."""

    def __init__(self, trainer):
        self.trainer = trainer
        source = trainer.eval_dataset if trainer.eval_dataset is not None else trainer.train_dataset
        if isinstance(source, dict):
            source = next(iter(source.values()))
        self.rows = [source[i] for i in range(min(trainer._controller.val_size, len(source)))]

    def on_train_begin(self, args, state, control, **kwargs):
        if self.trainer._controller.reference is None:
            self._evaluate()

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.trainer._controller.eval_every == 0:
            self._evaluate()

    @torch.no_grad()
    def _evaluate(self) -> None:
        trainer = self.trainer
        prompts = [row["prompt"] for row in self.rows]
        prompt_ids, _, _ = trainer._tokenize_prompts(prompts)
        pad = trainer.processing_class.pad_token_id
        width = max(map(len, prompt_ids))
        device = trainer.accelerator.device
        ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompt_ids], device=device)
        attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids], device=device)
        # every process evaluates the whole (small) set: no uneven gathers, and collective under ZeRO-3
        with unwrap_model_for_generation(trainer.model_wrapped, trainer.accelerator) as model:
            was_training = model.training
            model.eval()
            out = model.generate(
                input_ids=ids,
                attention_mask=attention,
                do_sample=False,
                pad_token_id=pad,
                max_new_tokens=trainer.max_completion_length,
                eos_token_id=trainer.eos_token_ids,
            )
            model.train(was_training)
        completion_ids = []
        for row in out[:, width:].tolist():
            ends = [i for i, t in enumerate(row) if t in trainer.eos_token_ids]
            completion_ids.append(row[: ends[0] + 1] if ends else row)
        texts = trainer.processing_class.batch_decode(completion_ids, skip_special_tokens=True)
        if is_conversational({"prompt": prompts[0]}):
            completions = [[{"role": "assistant", "content": t}] for t in texts]
        else:
            completions = texts
        rewards = self._rewards(prompts, completions, completion_ids)
        metrics = trainer._controller.validation_point(torch.nanmean(rewards.float(), dim=0).cpu())
        for key, value in metrics.items():
            trainer._metrics["train"][f"stable/grpo/{key}"].append(value)

    def _rewards(self, prompts, completions, completion_ids) -> torch.Tensor:
        """The trainer's own rewards (its reward transform included, e.g. the BRME fold), with the reward functions'
        `log_metric`/`log_extra` calls and the trainer's reward metrics kept out of the training logs."""
        trainer = self.trainer
        trainer._log_metric = trainer._log_completion_extra = _discard  # shadow the bound methods
        trainer._validating = True
        try:
            return trainer._calculate_rewards(self.rows, prompts, completions, completion_ids)
        finally:
            del trainer._log_metric, trainer._log_completion_extra
            trainer._validating = False


def _discard(*args, **kwargs) -> None:
    pass
