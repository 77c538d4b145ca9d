"""Detectors that only raise or log: no gradient at all (`NoGradientCallback`), a GRPO run that cannot learn
(`GRPODegenerateRunCallback`)."""

from __future__ import annotations

import dataclasses

from transformers import TrainerCallback

from ...stability.callback_configs import DegenerateRunConfig
from ...stability.degenerate import DegenerateRunMonitor
from ...stability.nograd import NoGradientError, diagnose_no_gradient
from ...stability.update import optimizer_params
from ._common import _Attachable, _backend, _SelfRestoring, _warn_once, logger


class NoGradientCallback(_Attachable, TrainerCallback):
    """Raise `NoGradientError` when training cannot change the model.

    * ``on_train_begin``: no parameter has ``requires_grad`` (a frozen model) — before the first forward.
    * first ``on_pre_optimizer_step`` (after the first backward, before the first update): every parameter the
      optimizer holds still has ``grad is None``; the message names the cause (e.g. a deep-copied model whose
      ``forward`` TRL patched: the closure still calls the original model).

    Gradients that exist but are exactly zero are fine (equal rewards in every GRPO group give a zero gradient).
    Cost: one pass over the parameters at the first step. Under DeepSpeed the gradients are not in ``p.grad``: the
    gradient check is skipped (warned once); the frozen-model check still runs.
    """

    def __init__(self):
        self._checked = False
        self._deepspeed = False

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self._checked = False
        self._deepspeed = _backend(args, model, optimizer) == "deepspeed"
        if model is not None and not any(p.requires_grad for p in model.parameters()):
            raise NoGradientError(
                f"no trainable parameter: every parameter of {type(model).__name__} has requires_grad=False (a frozen "
                "model), so training would change nothing. Unfreeze the parameters to train, or pass a `peft_config`."
            )
        if self._deepspeed:
            _warn_once(
                self,
                "deepspeed",
                "NoGradientCallback: gradients live inside the DeepSpeed engine, not in "
                "`p.grad`; the no-gradient check after the first backward is skipped.",
                state,
            )

    def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kwargs):
        if self._checked or self._deepspeed or optimizer is None:
            return
        self._checked = True
        params = optimizer_params(optimizer)
        if params and all(p.grad is None for p in params):
            raise NoGradientError(
                f"after the first backward no trainable parameter of {type(model).__name__} has a gradient "
                f"({len(params)} tensors in the optimizer, all `.grad is None`): {diagnose_no_gradient(model)}"
            )


class GRPODegenerateRunCallback(_Attachable, _SelfRestoring, TrainerCallback):
    """Warn, from TRL's logged GRPO metrics, when a run cannot learn, saying what it means and which knob to turn.

    Conditions (each must hold for ``patience`` consecutive logs; then it is reported once per ``patience`` logs):
    ``completions/clipped_ratio ≥ clipped_ratio_min``, ``frac_reward_zero_std ≥ zero_std_min``, constant rewards
    (``reward_std`` and every ``rewards/<fn>/std`` are 0), ``entropy < entropy_min``, ``kl > kl_max``, ``loss == 0``
    with ``grad_norm == 0``; a non-finite ``grad_norm`` on first sight. ``loss == 0`` with ``grad_norm > 0`` under an
    on-policy ``grpo``/``dr_grpo`` run without KL is explained once at INFO (it is expected). Defaults follow
    Axolotl's training-stability guide (see ``docs/stability.md``). Warnings on the main process only; it only logs.
    """

    def __init__(self, config: DegenerateRunConfig | None = None, **options):
        config = DegenerateRunConfig(**options) if config is None else dataclasses.replace(config, **options)
        self.config = config
        self.name = config.name
        self.monitor = DegenerateRunMonitor(**config.kwargs_for(DegenerateRunMonitor))
        self.findings: list = []
        self._trainer_ref = None

    def _init_args(self) -> dict:
        return dataclasses.asdict(self.config)

    def _export(self) -> dict:
        return self.monitor.state()

    def _import(self, payload: dict) -> None:
        self.monitor.load_state(payload)

    def on_train_begin(self, args, state, control, **kwargs):
        self._self_restore(state)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or not state.is_world_process_zero:
            return
        cfg = {
            k: getattr(args, k, None)
            for k in (
                "loss_type",
                "num_iterations",
                "beta",
                "num_generations",
                "max_completion_length",
                "mask_truncated_completions",
                "steps_per_generation",
                "gradient_accumulation_steps",
                "loss_mode",
            )
        }
        for finding in self.monitor.observe(logs, cfg):
            self.findings.append((state.global_step, finding))
            emit = logger.info if finding.level == "info" else logger.warning
            emit(f"step {state.global_step}: {finding.message}")


