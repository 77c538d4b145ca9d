"""`FaultInjectionCallback`: inject a fault at chosen steps, to check a guard on your own setup."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from transformers import TrainerCallback

from ..._validation import check_choice, check_number
from ...stability.update import scale_lr
from ._common import _Attachable


class FaultInjectionCallback(_Attachable, TrainerCallback):
    """Inject a fault at chosen optimizer steps, to check a guard on your own setup (and in our tests/experiments).

    Kinds: ``"corrupt_batch"`` (``input_ids`` and the supervised ``labels`` of every micro-batch of the step replaced
    by uniform random tokens), ``"nan_loss"`` (the loss multiplied by NaN), ``"loss_scale"`` (the loss multiplied by
    ``factor``), ``"lr_scale"`` (every param group's LR multiplied by ``factor`` for that update only). ``ranks``:
    process indices that inject (default all). Use ``FaultInjectionCallback.attach(trainer, ...)`` (it wraps the
    trainer's ``compute_loss``).
    """

    KINDS = ("corrupt_batch", "nan_loss", "loss_scale", "lr_scale")

    def __init__(
        self, kind: str, steps: Sequence[int], factor: float = 100.0, ranks: Sequence[int] | None = None, seed: int = 0
    ):
        check_choice("kind", kind, self.KINDS)
        check_number("factor", factor)
        self.kind, self.steps, self.factor = kind, {int(s) for s in steps}, float(factor)
        self.ranks = None if ranks is None else {int(r) for r in ranks}
        self.seed = int(seed)
        self.injected: list[int] = []
        self._scaled = False
        self._trainer_ref = None

    @classmethod
    def attach(cls, trainer, **kwargs):
        callback = super().attach(trainer, **kwargs)
        compute_loss = trainer.compute_loss

        def _compute_loss(model, inputs, *args, **kw):
            step = trainer.state.global_step + 1
            if not callback._active(step, trainer.args.process_index) or callback.kind == "lr_scale":
                return compute_loss(model, inputs, *args, **kw)
            if callback.kind == "corrupt_batch":
                inputs = callback._corrupt(inputs, step, trainer.model)  # `model` may be DDP-wrapped
            out = compute_loss(model, inputs, *args, **kw)
            scale = {"nan_loss": math.nan, "loss_scale": callback.factor}.get(callback.kind, 1.0)
            if step not in callback.injected:
                callback.injected.append(step)
            if isinstance(out, tuple):
                return (out[0] * scale, *out[1:])
            return out * scale

        trainer.compute_loss = _compute_loss
        return callback

    def _active(self, step: int, rank: int) -> bool:
        return step in self.steps and (self.ranks is None or rank in self.ranks)

    def _corrupt(self, inputs: dict, step: int, model) -> dict:
        ids = inputs["input_ids"]
        vocab = model.config.get_text_config().vocab_size
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        random_ids = torch.randint(0, vocab, ids.shape, generator=g).to(ids.device)
        inputs = dict(inputs)
        inputs["input_ids"] = random_ids
        if "labels" in inputs:
            inputs["labels"] = torch.where(inputs["labels"] == -100, inputs["labels"], random_ids)
        return inputs

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        step = state.global_step + 1
        if self.kind == "lr_scale" and self._active(step, args.process_index) and optimizer is not None:
            scale_lr(optimizer, self.factor)
            self._scaled = True
            self.injected.append(step)

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        if self._scaled:
            scale_lr(optimizer, 1.0 / self.factor)
            self._scaled = False


