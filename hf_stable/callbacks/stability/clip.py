"""`ComponentClipCallback`: component-wise gradient clipping, fixed or adaptive (AdaGC)."""

from __future__ import annotations

import dataclasses
import math
import re

import torch
from transformers import TrainerCallback

from ...stability import clip as clip_math
from ...stability.callback_configs import ComponentClipConfig
from ._common import _Attachable, _backend, _SelfRestoring, _warn_once


class ComponentClipCallback(_Attachable, _SelfRestoring, TrainerCallback):
    """Clip each group of gradients to its own norm bound (arXiv 2210.10325), or adaptively against the EMA of its own
    past norms (AdaGC, arXiv 2502.11034), in ``on_pre_optimizer_step``.

    Args:
        max_norm: the bound ``c`` of ``mode="fixed"`` (no paper-wide default; the authors swept 0.01–5).
        groups: ``"param"`` (each tensor; the authors' choice), ``"module"``, ``"layer"`` or a list of regexes.
        overrides: ``{regex: max_norm}`` matched against group names (first match wins), fixed mode.
        then_global_max_norm: clip globally *after* the component clip (the authors' order); needs the trainer's
            ``max_grad_norm=0``, otherwise its global clip runs first.
        mode: ``"fixed"`` or ``"adaptive"`` (AdaGC: ``h = min(1, λ_rel·γ/‖g‖)``, ``γ ← β·γ + (1 − β)·h‖g‖``, and a
            global clip at ``adaptive_lambda_abs`` during the first ``adaptive_warmup_steps``; the trainer's global
            clip should then be off, ``max_grad_norm=0``).

    Metrics: ``stable/clip/frac_groups_clipped``, ``stable/clip/max_group_norm``, ``stable/clip/median_group_norm``
    (last step before the log, pre-clip). DeepSpeed is refused (gradients are partitioned inside the engine; use its
    ``gradient_clipping``), and so is FSDP (sharded gradients).
    """

    def __init__(self, config: ComponentClipConfig | None = None, **options):
        """``ComponentClipCallback(ComponentClipConfig(...))`` or ``ComponentClipCallback(max_norm=0.1, ...)``: the
        options of `hf_stable.stability.callback_configs.ComponentClipConfig` (keywords replace the config's)."""
        config = ComponentClipConfig(**options) if config is None else dataclasses.replace(config, **options)
        self.config = config
        self.name = config.name
        self.max_norm, self.groups, self.overrides = config.max_norm, config.groups, dict(config.overrides or {})
        self.then_global_max_norm, self.mode = config.then_global_max_norm, config.mode
        self._grouped: dict[str, list] | None = None
        self._bounds: torch.Tensor | None = None
        self._gamma: torch.Tensor | None = None
        self._gamma_payload: list | None = None
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None
        self.steps = 0
        self._trainer_ref = None

    def _init_args(self) -> dict:
        return dataclasses.asdict(self.config)

    def _export(self) -> dict:
        gamma = None if self._gamma is None else [None if math.isinf(g) else g for g in self._gamma.tolist()]
        return {"steps": self.steps, "gamma": gamma}

    def _import(self, payload: dict) -> None:
        self.steps = int(payload.get("steps", 0))
        self._gamma_payload = payload.get("gamma")

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        backend = _backend(args, model, optimizer)
        if backend != "plain":
            raise ValueError(
                f"ComponentClipCallback does not support {backend}: the gradients are "
                + (
                    "partitioned inside the DeepSpeed engine, which has already stepped when callbacks run; use "
                    "DeepSpeed's `gradient_clipping`."
                    if backend == "deepspeed"
                    else "sharded; use `max_grad_norm`."
                )
            )
        if self.then_global_max_norm is not None and args.max_grad_norm and args.max_grad_norm > 0:
            raise ValueError(
                f"`then_global_max_norm`={self.then_global_max_norm} reproduces the authors' order (component clip, "
                f"then global) and needs `max_grad_norm=0` in the TrainingArguments (got {args.max_grad_norm}); "
                "otherwise the trainer clips globally first and again afterwards."
            )
        if self.mode == "adaptive" and args.max_grad_norm and args.max_grad_norm > 0:
            _warn_once(
                self,
                "adaptive_global",
                (
                    f"ComponentClipCallback(mode='adaptive') with max_grad_norm={args.max_grad_norm}: the trainer's "
                    "global clip runs before AdaGC (the paper replaces it). Set max_grad_norm=0 to follow the paper."
                ),
                state,
            )
        self._self_restore(state)

    def _setup(self, model) -> None:
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self._grouped = clip_math.group_parameters(named, self.groups)
        bounds = []
        for group_name in self._grouped:
            bound = next((v for pat, v in self.overrides.items() if re.search(pat, group_name)), self.max_norm)
            bounds.append(bound)
        self._bounds = torch.tensor(bounds, dtype=torch.float32)
        self._gamma = torch.full((len(self._grouped),), math.inf)
        if self._gamma_payload is not None and len(self._gamma_payload) == len(self._grouped):
            self._gamma = torch.tensor([math.inf if g is None else g for g in self._gamma_payload])
        self._gamma_payload = None

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if self._grouped is None:
            self._setup(model)
        grouped = [[p.grad for _, p in members if p.grad is not None] for members in self._grouped.values()]
        if not any(grouped):  # the guard dropped this update
            return
        self.steps += 1
        norms = clip_math.group_norms(grouped)
        if self.mode == "fixed":
            coefs = clip_math.clip_coefficients(norms, self._bounds.to(norms.device))
        else:
            gamma = self._gamma.to(norms.device)
            coefs, gamma = clip_math.adagc_coefficients(
                norms,
                gamma,
                self.steps,
                warmup_steps=self.config.adaptive_warmup_steps,
                lambda_abs=self.config.adaptive_lambda_abs,
                lambda_rel=self.config.adaptive_lambda_rel,
                beta=self.config.adaptive_beta,
            )
            self._gamma = gamma.cpu()
        clip_math.apply_coefficients(grouped, coefs)
        if self.then_global_max_norm is not None:
            torch.nn.utils.clip_grad_norm_(
                [p for members in self._grouped.values() for _, p in members], self.then_global_max_norm
            )
        self._last = (norms.detach(), coefs.detach())

    def pop_pending_metrics(self) -> dict:
        if self._last is None:
            return {}
        norms, coefs = self._last
        self._last = None
        return {
            "stable/clip/frac_groups_clipped": float((coefs < 1.0).float().mean()),
            "stable/clip/max_group_norm": float(norms.max()),
            "stable/clip/median_group_norm": float(norms.median()),
        }


