"""The stability fields of the hf_stable configs, declared once and inherited by `StableSFTConfig`,
`StableGRPOConfig` (which adds the degenerate-run fields) and `UnlearningConfig`.

Each field shadows a callback of `hf_stable.callbacks.stability`; the trainer adds the callbacks the config asks for
at the end of its ``__init__`` (`add_stability_callbacks`). Everything is off by default except the two detectors,
which only raise (no gradient at all) or log (degenerate GRPO run), so a default config trains exactly like its TRL
parent.

The mixins are dataclasses placed *before* the TRL/transformers config in the bases, so their fields come after the
parent's (``output_dir`` stays the first positional field) and their ``__post_init__`` runs the parent's first.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass, field, fields
from typing import Any

from .._validation import check_bool, check_choice, check_int, check_number


__all__ = [
    "CLIP_GROUPS",
    "GRPO_GUARD_DEFAULTS",
    "GRPOStabilityConfigMixin",
    "StabilityConfigMixin",
    "guard_kwarg_names",
]

CLIP_GROUPS = ("param", "module", "layer")
# A GRPO loss sits around 0 whatever the policy does (group-centred advantages): it carries no spike information, so
# the guard watches the gradient norm only unless the user's `stability_guard_kwargs` say otherwise.
GRPO_GUARD_DEFAULTS = {"loss_z": None}


def guard_kwarg_names() -> list[str]:
    """The keyword arguments `StabilityGuardCallback` takes (the keys `stability_guard_kwargs` accepts)."""
    from ..callbacks.stability import StabilityGuardCallback

    params = inspect.signature(StabilityGuardCallback.__init__).parameters
    return [name for name in params if name != "self"]


def _parse_kwargs(value: Any) -> dict | None:
    """``stability_guard_kwargs`` as a dict: a JSON object string (CLI, like TRL's dict fields) is decoded."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"`stability_guard_kwargs` is not a JSON object: {error}.") from None
    if value is not None and not isinstance(value, dict):
        raise TypeError(f"`stability_guard_kwargs` must be a dict (or a JSON object string), got {value!r}.")
    return value


def _check_guard_kwargs(kwargs: dict, defaults: dict) -> None:
    from ..callbacks.stability import StabilityGuardCallback

    allowed = guard_kwarg_names()
    for key in kwargs:
        if key not in allowed:
            raise ValueError(
                f"`stability_guard_kwargs` has an unknown key {key!r}. Allowed keys: {', '.join(allowed)}."
            )
    try:  # the callback's own checks, which name the key; it is built for real by the trainer
        StabilityGuardCallback(**{**defaults, **kwargs})
    except (ValueError, TypeError) as error:
        raise type(error)(f"`stability_guard_kwargs`: {error}") from None


@dataclass
class StabilityConfigMixin:
    """The stability fields every hf_stable config has (see `docs/stability.md`, "Config flags")."""

    _guard_defaults = {}  # a trainer's own guard defaults, which `stability_guard_kwargs` override

    stability_guard: bool = field(
        default=False,
        metadata={"help": "Attach StabilityGuardCallback (spike detection, skip, rollback); off by default."},
    )
    stability_guard_kwargs: dict | str | None = field(
        default=None,
        metadata={
            "help": 'Arguments of StabilityGuardCallback, e.g. {"action": "skip", "snapshot_every": 20} (a JSON '
            "string on the command line). Needs stability_guard=True."
        },
    )
    no_gradient_check: bool = field(
        default=True,
        metadata={
            "help": "Raise NoGradientError when no trainable parameter gets a gradient at the first step (or the "
            "model is frozen), naming the cause."
        },
    )
    component_clip_max_norm: float | None = field(
        default=None,
        metadata={"help": "Component-wise gradient clipping bound (arXiv 2210.10325); None: off."},
    )
    component_clip_groups: str = field(
        default="param",
        metadata={"help": "Groups of component-wise clipping: 'param', 'module' or 'layer'."},
    )

    def __post_init__(self):
        super().__post_init__()
        self._check_stability_fields()

    def _check_stability_fields(self) -> None:
        check_bool("stability_guard", self.stability_guard)
        check_bool("no_gradient_check", self.no_gradient_check)
        self.stability_guard_kwargs = _parse_kwargs(self.stability_guard_kwargs)
        if self.stability_guard:
            _check_guard_kwargs(self.stability_guard_kwargs or {}, self._guard_defaults)
        elif self.stability_guard_kwargs:
            raise ValueError(
                "`stability_guard_kwargs` is set but `stability_guard` is False: they would be ignored. Set "
                "stability_guard=True, or drop the kwargs."
            )
        check_number("component_clip_max_norm", self.component_clip_max_norm, low=0, low_open=True, allow_none=True)
        check_choice("component_clip_groups", self.component_clip_groups, CLIP_GROUPS)
        if self.component_clip_max_norm is None and self.component_clip_groups != "param":
            raise ValueError(
                f"`component_clip_groups`={self.component_clip_groups!r} needs `component_clip_max_norm` (component "
                "clipping is off without it)."
            )


# config field -> (GRPODegenerateRunCallback argument, bounds of its check)
_DEGENERATE_THRESHOLDS = {
    "degenerate_patience": ("patience", dict(low=1)),
    "degenerate_zero_std_min": ("zero_std_min", dict(low=0, high=1)),
    "degenerate_clipped_ratio_min": ("clipped_ratio_min", dict(low=0, high=1)),
    "degenerate_entropy_min": ("entropy_min", dict(low=0)),
    "degenerate_kl_max": ("kl_max", dict(low=0)),
}


@dataclass
class GRPOStabilityConfigMixin(StabilityConfigMixin):
    """`StabilityConfigMixin` plus the degenerate-run warnings of GRPO (on by default: they only log). Thresholds
    follow Axolotl's training-stability guide (see `docs/stability.md`)."""

    _guard_defaults = GRPO_GUARD_DEFAULTS

    degenerate_run_warnings: bool = field(
        default=True,
        metadata={"help": "Warn when a GRPO run cannot learn (GRPODegenerateRunCallback); it only logs."},
    )
    degenerate_patience: int = field(
        default=3, metadata={"help": "Consecutive logs a degenerate condition must hold before it is reported."}
    )
    degenerate_zero_std_min: float = field(
        default=0.99, metadata={"help": "frac_reward_zero_std at or above which groups carry no signal."}
    )
    degenerate_clipped_ratio_min: float = field(
        default=0.99, metadata={"help": "completions/clipped_ratio at or above which completions are all truncated."}
    )
    degenerate_entropy_min: float = field(default=0.01, metadata={"help": "Entropy below which the policy collapsed."})
    degenerate_kl_max: float = field(default=2.0, metadata={"help": "KL above which the policy has drifted away."})

    def _check_stability_fields(self) -> None:
        super()._check_stability_fields()
        check_bool("degenerate_run_warnings", self.degenerate_run_warnings)
        check_int("degenerate_patience", self.degenerate_patience, low=1)
        for name, (_, bounds) in _DEGENERATE_THRESHOLDS.items():
            if name != "degenerate_patience":
                check_number(name, getattr(self, name), **bounds)
        if not self.degenerate_run_warnings:
            defaults = {f.name: f.default for f in fields(GRPOStabilityConfigMixin)}
            changed = [n for n in _DEGENERATE_THRESHOLDS if getattr(self, n) != defaults[n]]
            if changed:
                raise ValueError(f"`{changed[0]}` is set but `degenerate_run_warnings` is False: it would be ignored.")

    def degenerate_kwargs(self) -> dict:
        """The `GRPODegenerateRunCallback` arguments these fields give."""
        return {param: getattr(self, name) for name, (param, _) in _DEGENERATE_THRESHOLDS.items()}
