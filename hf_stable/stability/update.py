"""Dropping one optimizer update without side effects, and scaling the learning rate for one update.

A *true* skip sets ``p.grad = None`` for every parameter the optimizer holds: torch optimizers (AdamW, SGD, Adafactor,
bitsandbytes, ...) skip parameters without a gradient, so neither the weights, nor the moments, nor the step counters
change, and decoupled weight decay is not applied. Zeroing the gradients instead is *not* a skip: AdamW would still
move the weights through its momentum and weight decay and count the step.

Under fp16 with a ``GradScaler`` a ``None`` gradient is not enough: ``scaler.step`` asserts when no inf check was
recorded. [`force_scaler_skip`] marks the step as overflowed instead, so the scaler skips ``optimizer.step``; the
caller then undoes the scale back-off (``scaler.update(new_scale=scale_before)``).

Pure torch.
"""

from __future__ import annotations

import math

import torch


__all__ = ["drop_update", "force_scaler_skip", "inner_optimizer", "optimizer_params", "scale_lr"]


def inner_optimizer(optimizer):
    """The torch optimizer under accelerate's ``AcceleratedOptimizer`` (or the optimizer itself)."""
    return getattr(optimizer, "optimizer", optimizer)


def optimizer_params(optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def drop_update(optimizer) -> int:
    """Set ``p.grad = None`` for every parameter of ``optimizer``; returns how many had a gradient."""
    count = 0
    for p in optimizer_params(optimizer):
        if p.grad is not None:
            count += 1
            p.grad = None
    return count


def force_scaler_skip(scaler, optimizer) -> float:
    """Make ``scaler.step(optimizer)`` skip the update; returns the scale before, for ``scaler.update(new_scale=...)``.

    If the gradients were already unscaled (accelerate unscales inside ``clip_grad_norm_``, which the HF trainer always
    calls), the recorded per-device inf flags are set; otherwise an ``inf`` is written into one gradient so that the
    scaler's own check finds it.
    """
    from torch.amp.grad_scaler import OptState

    inner = inner_optimizer(optimizer)
    scale_before = float(scaler.get_scale())
    state = scaler._per_optimizer_states[id(inner)]
    if state["stage"] is OptState.UNSCALED and state["found_inf_per_device"]:
        for flag in state["found_inf_per_device"].values():
            flag.fill_(1.0)
        return scale_before
    for p in optimizer_params(inner):
        if p.grad is not None:
            p.grad.view(-1)[0] = math.inf
            return scale_before
    raise RuntimeError("force_scaler_skip: no parameter has a gradient to mark.")


def scale_lr(optimizer, factor: float) -> None:
    """Multiply every param group's ``lr`` by ``factor``. Undo with ``scale_lr(optimizer, 1 / factor)``: dividing
    (rather than writing back saved values) lets several callbacks scale the same update in any order."""
    if factor != 1.0:
        for group in optimizer.param_groups:
            group["lr"] = group["lr"] * factor
