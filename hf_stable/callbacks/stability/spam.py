"""`StableSPAMCallback`: train with the Stable-SPAM optimizer on any transformers/TRL trainer."""

from __future__ import annotations

import dataclasses

from transformers import TrainerCallback

from ...stability.callback_configs import StableSPAMConfig, stable_spam_host_problems
from ...stability.spam import StableSPAM
from ._common import _Attachable, _backend


def _unwrap(optimizer):
    """The optimizer inside accelerate's ``AcceleratedOptimizer`` (or the optimizer itself)."""
    return getattr(optimizer, "optimizer", optimizer)


class StableSPAMCallback(_Attachable, TrainerCallback):
    """Stable-SPAM (Huang et al., arXiv 2502.17055) as the trainer's optimizer.

    Stable-SPAM is an AdamW variant (`hf_stable.stability.spam.StableSPAM`): it clips spiked gradient entries at the
    bias-corrected EMA of their historical maximum, rescales each gradient matrix by its own ℓ2-norm moments and zeroes
    Adam's moments every ``reset_interval`` steps. The clip needs the optimizer's step count and the reset needs its
    moments, so it is the optimizer, not a gradient hook beside another one: ``attach`` sets the trainer's
    ``optimizer_cls_and_kwargs`` (transformers' own slot for a custom optimizer class), so the trainer still builds
    its weight-decay / no-decay parameter groups and its learning-rate schedule around it, and Stable-SPAM reads
    ``learning_rate``, ``adam_beta1``, ``adam_beta2``, ``adam_epsilon`` and ``weight_decay``. Its state (per-parameter
    moments, historical maximum, norm moments, step counts) is the optimizer's state dict, saved in every checkpoint's
    ``optimizer.pt`` and restored by ``resume_from_checkpoint``.

    The trainer's global clip (``max_grad_norm``) runs before the optimizer, as the authors' ``--grad_clipping`` does
    (off in their runs: set ``max_grad_norm=0`` to follow them). Refused by name: a trainer given ``optimizers=`` or
    ``optimizer_cls_and_kwargs``, an ``optim`` other than AdamW's, ``optim_args``, DeepSpeed and FSDP (the maximum and
    the norm of each matrix would be taken over shards).

    Args: the options of `hf_stable.stability.callback_configs.StableSPAMConfig` (``gamma1``, ``gamma2``, ``theta``,
    ``reset_interval``, ``decay_steps``, ``eta_min``), or a ``StableSPAMConfig``.

    Metrics: ``stable/spam/clip_fraction`` (fraction of gradient entries clipped at the last step before the log) and
    ``stable/spam/resets`` (moment resets so far).
    """

    def __init__(self, config: StableSPAMConfig | None = None, **options):
        config = StableSPAMConfig(**options) if config is None else dataclasses.replace(config, **options)
        self.config = config
        self.optimizer: StableSPAM | None = None
        self._trainer_ref = None

    @classmethod
    def attach(cls, trainer, **options):
        """Make ``trainer`` build a `StableSPAM` optimizer with these options, and add the callback."""
        if trainer.optimizer is not None:
            raise ValueError(
                "StableSPAMCallback builds the optimizer, but the trainer was given one (`optimizers=`); drop it, or "
                "pass hf_stable.stability.StableSPAM there instead of attaching."
            )
        if trainer.optimizer_cls_and_kwargs is not None:
            raise ValueError(
                "StableSPAMCallback sets the trainer's `optimizer_cls_and_kwargs`, which is already set to "
                f"{trainer.optimizer_cls_and_kwargs[0].__name__}."
            )
        problems = stable_spam_host_problems(trainer.args)
        if problems:
            raise ValueError(f"Stable-SPAM cannot be combined with: {'; '.join(problems)}.")
        callback = super().attach(trainer, **options)
        trainer.optimizer_cls_and_kwargs = (StableSPAM, callback.optimizer_kwargs(trainer.args))
        return callback

    def optimizer_kwargs(self, args) -> dict:
        """The `StableSPAM` keyword arguments from the TrainingArguments and this callback's options (the trainer
        passes its param groups, which carry each group's weight decay)."""
        return {
            "lr": args.learning_rate,
            "betas": (args.adam_beta1, args.adam_beta2),
            "eps": args.adam_epsilon,
            **dataclasses.asdict(self.config),
        }

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        backend = _backend(args, model, optimizer)
        if backend != "plain":
            raise ValueError(
                f"StableSPAMCallback does not support {backend}: the per-matrix maximum and norm would be taken over "
                "each rank's shard."
            )
        inner = _unwrap(optimizer)
        if not isinstance(inner, StableSPAM):
            raise ValueError(
                f"StableSPAMCallback is attached but the trainer's optimizer is {type(inner).__name__}: something "
                "replaced the optimizer after `attach` (e.g. an overridden `create_optimizer`)."
            )
        self.optimizer = inner

    def pop_pending_metrics(self) -> dict:
        if self.optimizer is None or self.optimizer.last_clip_fraction is None:
            return {}
        fraction = float(self.optimizer.last_clip_fraction)
        self.optimizer.last_clip_fraction = None
        return {"stable/spam/clip_fraction": fraction, "stable/spam/resets": self.optimizer.resets}
