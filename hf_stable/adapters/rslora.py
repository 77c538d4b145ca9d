"""rsLoRA tooling on top of PEFT's `use_rslora` (Kalajdzievski, "A Rank Stabilization Scaling Factor for Fine-Tuning
with LoRA", arXiv 2312.03732).

rsLoRA scales the adapter by `α/√r` instead of `α/r`: with `α/r` the update's outputs and gradients collapse as the
rank grows, so higher ranks stop helping. These helpers convert between the two at equal effective scale, generate
rank sweeps, and log the per-layer quantities the argument is about.
"""

from __future__ import annotations

import dataclasses
import math
import re

import torch
from transformers import TrainerCallback


def _check_rank(value, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be > 0, got {value!r}.")


def lora_scale(alpha: float, r: int, use_rslora: bool = False) -> float:
    """The adapter scale s PEFT applies (`LoraLayer.update_layer`): `α/√r` with rsLoRA (Kalajdzievski, arXiv
    2312.03732), `α/r` without. Scalars in, scalar out."""
    _check_rank(r, "r")
    return alpha / math.sqrt(r) if use_rslora else alpha / r


def rslora_alpha_from_lora(alpha: float, r_ref: int) -> float:
    """The rsLoRA α whose scale at rank ``r_ref`` equals that of a known-good LoRA (α, ``r_ref``):
    `α_rs / √r_ref = α / r_ref`, i.e. `α_rs = α √r_ref / r_ref = α / √r_ref` (e.g. LoRA r=16, α=32 → scale 2 →
    α_rs = 8). Kalajdzievski, arXiv 2312.03732. Scalars in, scalar out."""
    _check_rank(r_ref, "r_ref")
    return alpha / math.sqrt(r_ref)


def lora_alpha_from_rslora(alpha: float, r: int) -> float:
    """The LoRA α with the same scale as rsLoRA (α, ``r``): `α_lora / r = α / √r`, i.e. `α_lora = α √r`.
    Kalajdzievski, arXiv 2312.03732. Scalars in, scalar out."""
    _check_rank(r, "r")
    return alpha * math.sqrt(r)


def rank_sweep(base_config, ranks=(8, 16, 32, 64, 128, 256), scale: float | None = None) -> list:
    """Copies of ``base_config`` (a `peft.LoraConfig` or subclass) at each rank, with `use_rslora=True` and
    `lora_alpha = scale · √r`, so the rsLoRA scale `α/√r` is the same at every rank (``scale``, default: the base
    config's own, `lora_scale(base.lora_alpha, base.r, base.use_rslora)`). The point of rsLoRA (Kalajdzievski, arXiv
    2312.03732) is that one learning rate then fits every rank.

    Returns:
        `list` of configs, one per rank, in the order of ``ranks``.
    """
    if getattr(base_config, "rank_pattern", None) or getattr(base_config, "alpha_pattern", None):
        raise ValueError(
            "rank_sweep needs a base config without rank_pattern/alpha_pattern (per-layer ranks or alphas make the "
            "scale differ between layers)."
        )
    ranks = list(ranks)
    if not ranks:
        raise ValueError("ranks must not be empty.")
    for r in ranks:
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise ValueError(f"ranks must be ints >= 1, got {r!r}.")
    if scale is None:
        scale = lora_scale(base_config.lora_alpha, base_config.r, base_config.use_rslora)
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale}.")
    return [dataclasses.replace(base_config, r=r, lora_alpha=scale * math.sqrt(r), use_rslora=True) for r in ranks]


def _lora_layers(model, pattern: str | None):
    regex = re.compile(pattern) if pattern else None
    for name, module in model.named_modules():
        if hasattr(module, "lora_A") and hasattr(module, "scaling") and (regex is None or regex.search(name)):
            for adapter in module.lora_A:
                yield name, adapter, module


class AdapterScaleCallback(TrainerCallback):
    """Logs, per LoRA layer, the update-to-base ratio `‖s·BA‖_F / ‖W0‖_F` and the Frobenius norms of the gradients of
    A `(r, n)` and B `(m, r)` — the quantities whose rank dependence rsLoRA (Kalajdzievski, arXiv 2312.03732) is
    about — plus their mean and max over layers, under ``stable/adapters/...``.

    Every ``every`` optimizer steps: the gradients are read in `on_pre_optimizer_step` (after the Trainer's gradient
    clipping when `max_grad_norm > 0`, summed over gradient-accumulation micro-batches), the ratios in `on_step_end`
    (after the step). The values join the Trainer's next log and are kept in ``self.history``. Under the hf_stable
    trainers they reach every `report_to` integration (the trainer collects them with `pop_pending_metrics` before
    logging); under a plain `Trainer` they land in `state.log_history` and the ``logs`` of callbacks registered after
    this one, but the integrations, which run before user callbacks, miss them. Keys:
    ``stable/adapters/update_ratio_{mean,max}``, ``stable/adapters/grad_{A,B}_{mean,max}``, and per layer
    ``stable/adapters/{module name}.{adapter}/{update_ratio,grad_A,grad_B}``. The ratio is `s·BA` for plain LoRA
    layers (not the MAP/sine update).

    Args:
        every (`int`, defaults to `10`): steps between measurements, ≥ 1.
        per_layer (`bool`, defaults to `False`): also log every layer (many keys on a large model).
        pattern (`str`, *optional*): regex (searched in the module name) restricting the layers.
    """

    def __init__(self, every: int = 10, per_layer: bool = False, pattern: str | None = None):
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be an int >= 1, got {every!r}.")
        if pattern is not None:
            re.compile(pattern)
        self.every, self.per_layer, self.pattern = every, per_layer, pattern
        self._grads: dict[str, tuple[float, float]] = {}
        self._pending: dict[str, float] | None = None
        self.history: list[dict[str, float]] = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        # `global_step` is incremented after the optimizer step: this step ends as `global_step + 1`
        if model is None or (state.global_step + 1) % self.every:
            return
        self._grads = {}
        for name, adapter, module in _lora_layers(model, self.pattern):
            ga, gb = module.lora_A[adapter].weight.grad, module.lora_B[adapter].weight.grad
            self._grads[f"{name}.{adapter}"] = (
                ga.float().norm().item() if ga is not None else 0.0,
                gb.float().norm().item() if gb is not None else 0.0,
            )

    @torch.no_grad()
    def measure(self, model) -> dict[str, float]:
        """The metrics for ``model`` now (ratios) and for the last gradients read (see the class docstring)."""
        from ._quant import dequantized_weight

        ratios, out = [], {}
        for name, adapter, module in _lora_layers(model, self.pattern):
            a, b = module.lora_A[adapter].weight.float(), module.lora_B[adapter].weight.float()
            update = abs(module.scaling[adapter]) * (b @ a).norm().item()
            base = dequantized_weight(module.get_base_layer()).float().norm().item()
            ratio = update / max(base, 1e-12)
            ratios.append(ratio)
            if self.per_layer:
                key = f"stable/adapters/{name}.{adapter}"
                out[f"{key}/update_ratio"] = ratio
                if f"{name}.{adapter}" in self._grads:
                    out[f"{key}/grad_A"], out[f"{key}/grad_B"] = self._grads[f"{name}.{adapter}"]
        if ratios:
            out["stable/adapters/update_ratio_mean"] = sum(ratios) / len(ratios)
            out["stable/adapters/update_ratio_max"] = max(ratios)
        if self._grads:
            grads = list(self._grads.values())
            out["stable/adapters/grad_A_mean"] = sum(g[0] for g in grads) / len(grads)
            out["stable/adapters/grad_A_max"] = max(g[0] for g in grads)
            out["stable/adapters/grad_B_mean"] = sum(g[1] for g in grads) / len(grads)
            out["stable/adapters/grad_B_max"] = max(g[1] for g in grads)
        return out

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if model is None or state.global_step % self.every:
            return
        metrics = self.measure(model)
        self._grads = {}  # each measurement reports the gradients of its own step only
        self.history.append({"step": state.global_step, **metrics})
        self._pending = metrics

    def pop_pending_metrics(self) -> dict[str, float]:
        """The metrics not yet logged (and forget them): the hf_stable trainers call this from `log`."""
        pending, self._pending = self._pending or {}, None
        return pending

    def on_log(self, args, state, control, logs=None, **kwargs):
        # `Trainer.log` appends a copy of `logs` to the history just before this event: update both
        pending = self._pending
        if logs is not None and pending:
            logs.update(pending)
            if state.log_history:
                state.log_history[-1].update(pending)
            self._pending = None
