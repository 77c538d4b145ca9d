"""The options of each stability callback family, declared once (`hf_stable.stability.options`).

- `GuardConfig` → `StabilityGuardCallback` (config fields ``guard_*``, switched on by ``stability_guard``);
- `ComponentClipConfig` → `ComponentClipCallback` (``component_clip_*``, on when ``component_clip_max_norm`` is set);
- `DegenerateRunConfig` → `GRPODegenerateRunCallback` (``degenerate_*``, on with ``degenerate_run_warnings``);
- `StableSPAMConfig` → `StableSPAMCallback` (``stable_spam_*``, on with ``stable_spam``), which makes the trainer build
  the `hf_stable.stability.spam.StableSPAM` optimizer.

What each option does is documented on the callback (`hf_stable.callbacks.stability`) and in ``docs/stability.md``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from .._validation import check_int, check_number, choice, integer, number
from .guard import ACTIONS, ON_EXHAUSTED
from .options import Options, option


__all__ = [
    "ADAM_OPTIMS",
    "CLIP_GROUPS",
    "ComponentClipConfig",
    "DegenerateRunConfig",
    "GuardConfig",
    "StableSPAMConfig",
    "stable_spam_host_problems",
]

CLIP_GROUPS = ("param", "module", "layer")


def _name(name: str, value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"`{name}` must be a non-empty string, got {value!r}.")


@dataclass(frozen=True)
class GuardConfig(Options):
    """Options of `StabilityGuardCallback` (see its docstring for the algorithm)."""

    loss_z: float | None = option(
        6.0, "Robust z threshold of a loss spike; None: the loss is not watched.", number(low=0, low_open=True,
                                                                                           allow_none=True)
    )
    loss_ratio: float = option(1.25, "A loss spike must also exceed the window's median by this ratio.", number(low=1))
    grad_z: float | None = option(
        6.0, "Robust z threshold of a gradient-norm spike (log space); None: not watched.",
        number(low=0, low_open=True, allow_none=True),
    )
    grad_ratio: float = option(5.0, "A gradient-norm spike must also exceed the median norm by this ratio.",
                               number(low=1))
    window: int = option(128, "Accepted steps in the median/MAD window.", integer(low=2))
    min_history: int = option(20, "Scored steps the window needs before anything is flagged.", integer(low=2))
    action: str = option(
        "skip_then_rollback", "On an anomaly: 'skip_then_rollback', 'skip', 'rollback' or 'log'.", choice(*ACTIONS)
    )
    skips_before_rollback: int = option(1, "Consecutive anomalies skipped before a rollback.", integer(low=0))
    snapshot_every: int = option(50, "Healthy steps between candidate snapshots.", integer(low=1))
    confirm_steps: int = option(2, "Healthy steps that confirm a candidate snapshot.", integer(low=0))
    snapshot_history: int = option(1, "Confirmed snapshots kept.", integer(low=1))
    snapshot_storage: str = option("cpu", "Where snapshots live: 'cpu' or 'disk' (under output_dir).",
                                   choice("cpu", "disk"))
    snapshot_scope: str = option("trainable", "Weights a snapshot holds: 'trainable' or 'all' (with buffers).",
                                 choice("trainable", "all"))
    scheduler_policy: str = option("keep", "On rollback: 'keep' the schedule, or 'restore' it with the weights.",
                                   choice("keep", "restore"))
    lr_cooldown_factor: float = option(
        0.25, "LR multiplier right after a rollback, rising linearly to 1.", number(low=0, high=1, low_open=True)
    )
    lr_cooldown_steps: int = option(50, "Updates of the LR cooldown after a rollback.", integer(low=0))
    max_rollbacks: int = option(5, "Rollbacks before `on_exhausted` decides.", integer(low=0))
    on_exhausted: str = option(
        "stop", "Once max_rollbacks are spent: 'stop' (save, stop), 'raise' or 'continue' (only log).",
        choice(*ON_EXHAUSTED),
    )
    guard_clip_norm: float | None = option(
        None, "With max_grad_norm=0: clip globally to this norm after deciding, on the true pre-clip norm.",
        number(low=0, low_open=True, allow_none=True),
    )
    probe_every: int = option(0, "Steps between held-out probe losses (needs probe_dataset).", integer(low=0),
                              flag=False)
    probe_nis_threshold: float = option(10.83, "Normalised innovation squared that flags the probe loss.",
                                        number(low=0, low_open=True), flag=False)
    probe_batch_size: int = option(16, "Batch size of the probe forward.", integer(low=1), flag=False)
    name: str = option("guard", "Instance name (state in checkpoints, disk snapshots).", _name, flag=False)

    def _check(self) -> None:
        check_int("min_history", self.min_history, low=2, high=self.window)
        if self.loss_z is None and self.grad_z is None:
            raise ValueError(
                "`loss_z` and `grad_z` are both None: the guard would detect only non-finite steps. "
                "Set at least one of them (defaults 6.0)."
            )


def _groups(name: str, value: Any) -> None:
    if isinstance(value, str):
        choice(*CLIP_GROUPS)(name, value)
        return
    groups = list(value) if isinstance(value, (list, tuple)) else None
    if not groups or not all(isinstance(g, str) for g in groups):
        raise ValueError(f"`{name}` must be 'param', 'module', 'layer' or a non-empty list of regexes, got {value!r}.")
    for pattern in groups:
        re.compile(pattern)


def _overrides(name: str, value: Any) -> None:
    for pattern, bound in (value or {}).items():
        re.compile(pattern)
        check_number(f"{name}[{pattern!r}]", bound, low=0, low_open=True)


@dataclass(frozen=True)
class ComponentClipConfig(Options):
    """Options of `ComponentClipCallback` (arXiv 2210.10325; AdaGC, arXiv 2502.11034)."""

    max_norm: float = option(0.1, "Component-wise gradient clipping bound (fixed mode).", number(low=0, low_open=True))
    # `option` returns a dataclasses.Field (ruff cannot tell: RUF009)
    groups: str | list[str] = option(  # noqa: RUF009
        "param", "Groups of component-wise clipping: 'param', 'module' or 'layer' (Python: also a list of regexes).",
        _groups, config_type=str, config_check=choice(*CLIP_GROUPS),
    )
    overrides: dict | None = option(  # noqa: RUF009
        None, "{regex: max_norm} per group name, fixed mode.", _overrides, flag=False
    )
    then_global_max_norm: float | None = option(
        None, "Clip globally after the component clip (the authors' order; needs max_grad_norm=0).",
        number(low=0, low_open=True, allow_none=True),
    )
    mode: str = option("fixed", "'fixed' bounds, or 'adaptive' (AdaGC, against an EMA of each group's norm).",
                       choice("fixed", "adaptive"))
    adaptive_warmup_steps: int = option(100, "AdaGC: steps of global clipping before the adaptive bound.",
                                        integer(low=0))
    adaptive_lambda_abs: float = option(1.0, "AdaGC: the global bound of the warm-up.", number(low=0, low_open=True))
    adaptive_lambda_rel: float = option(1.05, "AdaGC: the bound relative to the group's EMA norm.",
                                        number(low=0, low_open=True))
    adaptive_beta: float = option(0.98, "AdaGC: EMA coefficient of the group norms.",
                                  number(low=0, high=1, high_open=True))
    name: str = option("clip", "Instance name (state in checkpoints).", _name, flag=False)

    def __post_init__(self):
        if not isinstance(self.groups, str) and self.groups is not None:
            object.__setattr__(self, "groups", list(self.groups))
        super().__post_init__()

    def _check(self) -> None:
        if self.mode == "adaptive" and self.overrides:
            raise ValueError("`overrides` sets fixed bounds and has no effect with mode='adaptive'.")


@dataclass(frozen=True)
class DegenerateRunConfig(Options):
    """Options of `GRPODegenerateRunCallback` (defaults follow Axolotl's training-stability guide)."""

    patience: int = option(3, "Consecutive logs a degenerate condition must hold before it is reported.",
                           integer(low=1))
    zero_std_min: float = option(0.99, "frac_reward_zero_std at or above which groups carry no signal.",
                                 number(low=0, high=1))
    clipped_ratio_min: float = option(
        0.99, "completions/clipped_ratio at or above which completions are all truncated.", number(low=0, high=1)
    )
    entropy_min: float = option(0.01, "Entropy below which the policy collapsed.", number(low=0))
    kl_max: float = option(2.0, "KL above which the policy has drifted away.", number(low=0))
    name: str = option("degenerate", "Instance name (state in checkpoints).", _name, flag=False)


@dataclass(frozen=True)
class StableSPAMConfig(Options):
    """Options of `StableSPAMCallback` (Stable-SPAM, arXiv 2502.17055; defaults: the authors' optimizer's)."""

    gamma1: float = option(0.7, "EMA coefficient of the gradient norm's first moment.",
                           number(low=0, high=1, high_open=True))
    gamma2: float = option(0.9, "EMA coefficient of the gradient norm's second moment.",
                           number(low=0, high=1, high_open=True))
    theta: float = option(0.999, "EMA coefficient of the historical max |g| (the clipping threshold).",
                          number(low=0, high=1, high_open=True))
    reset_interval: int = option(1000, "Zero Adam's moments every this many optimizer steps; 0: never.",
                                 integer(low=0))
    decay_steps: int | None = option(
        None, "Cosine decay of beta1 and gamma1 to eta_min over this many steps (the authors set the run's length); "
        "None: no decay.", integer(low=1, allow_none=True),
    )
    eta_min: float = option(0.5, "Momentum scale at the end of decay_steps.", number(low=0, high=1))

    def _check(self) -> None:
        if self.decay_steps is None and self.eta_min != 0.5:
            raise ValueError("`eta_min` is the end of the momentum decay and has no effect without `decay_steps`.")


# the TrainingArguments `optim` values Stable-SPAM stands in for (the default AdamW, fused or not)
ADAM_OPTIMS = ("adamw_torch", "adamw_torch_fused")


def stable_spam_host_problems(args: Any) -> list[str]:
    """The TrainingArguments settings Stable-SPAM cannot honour, each with the reason (empty: none)."""
    problems = []
    optim = getattr(args, "optim", "adamw_torch")
    optim = getattr(optim, "value", optim)
    if optim not in ADAM_OPTIMS:
        problems.append(
            f"`optim`={optim!r} would be ignored: Stable-SPAM is the optimizer (an AdamW variant reading "
            f"learning_rate, adam_beta1, adam_beta2, adam_epsilon and weight_decay); allowed: {', '.join(ADAM_OPTIMS)}"
        )
    if getattr(args, "optim_args", None):
        problems.append("`optim_args` would be ignored: set the stable_spam_* options instead")
    if getattr(args, "deepspeed", None):
        problems.append(
            "`deepspeed`: ZeRO hands the optimizer flattened partitions, so the per-matrix maximum and norm would be "
            "taken over shards"
        )
    if getattr(args, "fsdp", None):
        problems.append("`fsdp`: the per-matrix maximum and norm would be taken over each rank's shard")
    return problems
