"""Step signals: the step's training loss and pre-clip global gradient norm, handed to the stability callbacks.

A `transformers.Trainer` computes both inside its loop but gives neither to callbacks (``grad_norm`` is a loop-local
variable). The producers below record them, as device tensors (no host sync), on a plain attribute of the
``TrainerState``, which is never serialised and survives the callback re-instantiation transformers does when it
restores callback state:

* [`StabilitySignalsMixin`]: mixed into a trainer class (before the TRL/transformers trainer in the bases); overrides
  ``training_step`` (adds each micro-batch's detached loss) and ``_get_grad_norm`` (records the returned norm, which is
  the *pre*-clip global norm: ``_clip_grad_norm`` returns the norm before clipping, and with ``max_grad_norm=0`` the
  unclipped norm is computed for logging).
* [`install_signals`]: the same two wrappers installed on one trainer *instance* (plain ``Trainer``, ``SFTTrainer``,
  ``GRPOTrainer``, ``DPOTrainer`` ...), plus a ``log`` wrapper that merges the callbacks' pending metrics into the
  logs before the ``report_to`` integrations see them.

Loss bookkeeping: ``training_step`` returns the micro-batch loss already divided by the gradient-accumulation steps
(or normalised by the global token count), so the step loss is the *sum* over micro-batches; under DDP each rank's
sum is all-reduced and divided by the world size by the consumer.

Private transformers hook used: ``Trainer._get_grad_norm(model, grad_norm=None)`` (transformers ≥ 5.19); the contract
test in ``tests/stability/test_contract.py`` fails loudly if it disappears.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import Any

import torch


__all__ = [
    "SIGNALS_ATTR",
    "StabilitySignalsMixin",
    "StepSignals",
    "get_signals",
    "install_metrics_hook",
    "install_signals",
    "record_grad_norm",
    "record_loss",
    "signals_installed",
]

SIGNALS_ATTR = "_hf_stable_signals"
_INSTALLED_ATTR = "_hf_stable_signals_installed"
_METRICS_ATTR = "_hf_stable_metrics_hook"


@dataclass
class StepSignals:
    """Signals of the optimizer step whose ``global_step`` (before the increment) is ``step``, on this rank."""

    step: int = -1
    loss_sum: torch.Tensor | None = None  # sum over micro-batches of the detached (GA-scaled) loss
    n_micro: int = 0
    grad_norm: torch.Tensor | float | None = None  # pre-clip global norm (already global under DDP/FSDP/DeepSpeed)
    trainer_ref: Any = None  # weakref to the trainer that produced them

    @property
    def trainer(self):
        return None if self.trainer_ref is None else self.trainer_ref()


def get_signals(state, create: bool = False, trainer=None) -> StepSignals | None:
    signals = getattr(state, SIGNALS_ATTR, None)
    if signals is None and create:
        signals = StepSignals()
        setattr(state, SIGNALS_ATTR, signals)
    if signals is not None and trainer is not None and signals.trainer is not trainer:
        signals.trainer_ref = weakref.ref(trainer)
    return signals


def _current(state, trainer) -> StepSignals:
    signals = get_signals(state, create=True, trainer=trainer)
    if signals.step != state.global_step:
        signals.step, signals.loss_sum, signals.n_micro, signals.grad_norm = state.global_step, None, 0, None
    return signals


def record_loss(state, loss: torch.Tensor, trainer=None) -> None:
    """Add one micro-batch's loss (a tensor; no ``.item()``) to the current step's signals."""
    signals = _current(state, trainer)
    loss = loss.detach()
    signals.loss_sum = loss.clone() if signals.loss_sum is None else signals.loss_sum + loss
    signals.n_micro += 1


def record_grad_norm(state, grad_norm, trainer=None) -> None:
    """Record the step's pre-clip global gradient norm (tensor or float)."""
    _current(state, trainer).grad_norm = grad_norm


class StabilitySignalsMixin:
    """Mix into a `transformers.Trainer` subclass, before the parent trainer in the bases:
    hf_stable's trainers get it through ``StableTrainerBase``. Costs two tensor additions per micro-batch."""

    def training_step(self, model, inputs, num_items_in_batch=None, *args, **kwargs):
        loss = super().training_step(model, inputs, num_items_in_batch, *args, **kwargs)
        record_loss(self.state, loss, trainer=self)
        return loss

    def _get_grad_norm(self, model, grad_norm=None):
        norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        record_grad_norm(self.state, norm, trainer=self)
        return norm


def signals_installed(trainer) -> bool:
    return isinstance(trainer, StabilitySignalsMixin) or getattr(trainer, _INSTALLED_ATTR, False)


def install_signals(trainer) -> None:
    """Install the step-signal producers on ``trainer`` (idempotent; a no-op for a `StabilitySignalsMixin` trainer)."""
    if not hasattr(type(trainer), "_get_grad_norm"):
        raise TypeError(
            f"{type(trainer).__name__} has no `_get_grad_norm`: the stability callbacks need transformers' Trainer "
            "(>= 5.19) to read the step's gradient norm."
        )
    get_signals(trainer.state, create=True, trainer=trainer)
    if signals_installed(trainer):
        return
    training_step = trainer.training_step
    get_grad_norm = trainer._get_grad_norm

    @functools.wraps(training_step)
    def _training_step(model, inputs, *args, **kwargs):
        loss = training_step(model, inputs, *args, **kwargs)
        record_loss(trainer.state, loss, trainer=trainer)
        return loss

    @functools.wraps(get_grad_norm)
    def _get_grad_norm(model, grad_norm=None):
        norm = get_grad_norm(model, grad_norm=grad_norm)
        record_grad_norm(trainer.state, norm, trainer=trainer)
        return norm

    trainer.training_step = _training_step
    trainer._get_grad_norm = _get_grad_norm
    setattr(trainer, _INSTALLED_ATTR, True)


def _pops_pending_metrics(trainer) -> bool:
    # hf_stable trainers (StableStateMixin) already merge `pop_pending_metrics()` of every callback in `log`
    return any(cls.__name__ == "StableStateMixin" for cls in type(trainer).__mro__)


def install_metrics_hook(trainer) -> None:
    """Wrap ``trainer.log`` so each callback's ``pop_pending_metrics()`` lands in the logs before ``Trainer.log``
    records them and calls the ``report_to`` integrations (which run ahead of user callbacks' ``on_log``)."""
    if _pops_pending_metrics(trainer) or getattr(trainer, _METRICS_ATTR, False):
        return
    log = trainer.log

    @functools.wraps(log)
    def _log(logs, *args, **kwargs):
        for callback in trainer.callback_handler.callbacks:
            pop = getattr(callback, "pop_pending_metrics", None)
            if pop is not None:
                logs.update(pop())
        return log(logs, *args, **kwargs)

    trainer.log = _log
    setattr(trainer, _METRICS_ATTR, True)
