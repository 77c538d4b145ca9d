"""OBLR-PO's SNR-governed learning rate (arXiv 2511.23310; our reconstruction from the abstract).

For an L-smooth objective, one step `θ + η ĝ` improves `J` by at least `η ||∇J||² - (Lη²/2) E||ĝ||²`, maximised at
`η* ∝ SNR / (1 + SNR)` with `SNR = ||∇J||² / tr Cov(ĝ)`. The SNR is estimated from the micro-batch gradients of each
optimizer step (so it needs gradient accumulation or several processes), smoothed by an EMA, and the step's learning
rate is multiplied by `clip(SNR / (1 + SNR), min_ratio, 1)`. With Adam the derivation is heuristic.

The learning-rate scheduler is never touched: [`SNRLearningRateCallback`] scales each parameter group's `lr` just
before `optimizer.step()` and restores it right after.
"""

from __future__ import annotations

import re

import torch
from transformers import TrainerCallback

from .._validation import boolean, check_pattern, number
from ..papers import PAPERS
from ..registry import Field, Registry, Requires
from ..stability.update import scale_lr


# A switch: `oblr_adaptive_lr=True` scales each optimizer step's learning rate, whatever the estimator.
LR_SCALING = Registry(
    "lr_scaling",
    "per-step learning-rate factors estimated while training",
    selector="oblr_adaptive_lr",
    enable=True,
    selector_check=boolean(),
)


def snr_estimate(grad_sum: torch.Tensor, sq_norm_sum: float, count: int) -> float | None:
    """`max(||ḡ||² - S², 0) / S²` from `n` gradient samples: `ḡ = Σg/n`, `S² = (Σ||g||² - n||ḡ||²)/(n(n-1))` (the
    variance of ḡ). `None` with fewer than two samples; `inf` when the samples agree exactly."""
    if count < 2:
        return None
    mean = grad_sum.double() / count
    mean_sq = float((mean * mean).sum())
    var = (sq_norm_sum - count * mean_sq) / (count * (count - 1))
    if var <= 0:
        return float("inf")
    return max(mean_sq - var, 0.0) / var


@LR_SCALING.register(
    "snr",
    paper=PAPERS["oblr"],
    description="learning rate scaled by SNR/(1+SNR) of the micro-batch gradients (OBLR-PO)",
    fields=[
        Field(
            "oblr_lr_min_ratio",
            0.1,
            "Lower clip of the SNR learning-rate factor.",
            check=number(low=0, high=1),
            param="min_ratio",
        ),
        Field("oblr_snr_ema", 0.9, "EMA smoothing of the SNR.", check=number(low=0, high=1), param="ema"),
        Field(
            "oblr_snr_params",
            None,
            "Regex of the parameters whose gradients estimate the SNR (default: all trainable).",
            check=check_pattern,
            param="pattern",
            type=str | None,
        ),
    ],
    requires=[
        Requires(
            "gradient_accumulation_steps",
            lambda value: value >= 2,
            "the SNR is estimated from the micro-batch gradients of a step: set gradient_accumulation_steps >= 2",
            fix=2,
        )
    ],
)
class MicroBatchSNR:
    """Accumulates the micro-batch gradients of the tracked parameters during one optimizer step.

    Args:
        named_parameters: the model's `named_parameters()`.
        pattern (`str`, *optional*): regex selecting the tracked parameters (e.g. LoRA or the last block) to bound the
            extra memory (one gradient copy); default: every trainable parameter.
        ema (`float`): smoothing of the SNR across steps.
        min_ratio (`float`): lower clip of the learning-rate factor.
    """

    def __init__(self, named_parameters, pattern: str | None = None, ema: float = 0.9, min_ratio: float = 0.1):
        regex = re.compile(pattern) if pattern else None
        self.params = [p for n, p in named_parameters if p.requires_grad and (regex is None or regex.search(n))]
        if not self.params:
            raise ValueError(f"`oblr_snr_params`={pattern!r} matches no trainable parameter.")
        self.ema_decay, self.min_ratio = ema, min_ratio
        self.snr_ema: float | None = None
        self.factor = 1.0
        self._reset()

    def _flat_grad(self) -> torch.Tensor:
        return torch.cat(
            [(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).float() for p in self.params]
        )

    def _reset(self):
        self._sum, self._sq, self._count, self._before = None, 0.0, 0, None

    def before_backward(self):
        self._before = self._flat_grad()

    def after_backward(self, usable: bool):
        g = self._flat_grad() - self._before
        if usable:
            self._sum = g if self._sum is None else self._sum + g
            self._sq += float((g.double() ** 2).sum())
            self._count += 1

    def finish(self, accelerator) -> dict[str, float]:
        """Pool the samples of every process, update the EMA and the factor; returns metrics."""
        total = self._sum if self._sum is not None else torch.zeros(sum(p.numel() for p in self.params))
        total = total.to(accelerator.device)
        stats = torch.tensor([self._sq, float(self._count)], dtype=torch.float64, device=accelerator.device)
        if accelerator.num_processes > 1:
            total = accelerator.reduce(total, reduction="sum")
            stats = accelerator.reduce(stats, reduction="sum")
        snr = snr_estimate(total.cpu(), float(stats[0]), int(stats[1]))
        self._reset()
        if snr is None:
            return {}
        snr = min(snr, 1e6)
        self.snr_ema = snr if self.snr_ema is None else self.ema_decay * self.snr_ema + (1 - self.ema_decay) * snr
        self.factor = min(1.0, max(self.min_ratio, self.snr_ema / (1 + self.snr_ema)))
        return {"snr": snr, "snr_ema": self.snr_ema, "lr_factor": self.factor}

    def state_dict(self) -> dict:
        return {"snr_ema": self.snr_ema, "factor": self.factor}

    def load_state_dict(self, state: dict) -> None:
        self.snr_ema, self.factor = state.get("snr_ema"), state.get("factor", 1.0)


class SNRLearningRateCallback(TrainerCallback):
    """Multiplies every parameter group's learning rate by `tracker.factor` for the optimizer step only.

    Scaling and unscaling go through `hf_stable.stability.update.scale_lr` (multiply, then divide), never a saved copy
    written back: the stability guard's LR cooldown scales the same update, and either order then composes."""

    def __init__(self, tracker: MicroBatchSNR):
        self.tracker = tracker
        self._applied: float | None = None

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        if optimizer is None or self.tracker.factor == 1.0:
            return
        self._applied = self.tracker.factor
        scale_lr(optimizer, self._applied)

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        if optimizer is not None and self._applied is not None:
            scale_lr(optimizer, 1.0 / self._applied)
        self._applied = None
