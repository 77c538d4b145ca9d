"""The stability fields of the hf_stable configs, inherited by `StableSFTConfig`, `StableGRPOConfig` (which adds the
degenerate-run fields) and `UnlearningConfig`.

Four switches are written here (``stability_guard``, ``stable_spam``, ``no_gradient_check``,
``degenerate_run_warnings``); every option of a callback family is *generated* from its options class
(`hf_stable.stability.callback_configs`), so it is declared once: ``guard_<option>`` from `GuardConfig`,
``component_clip_<option>`` from `ComponentClipConfig` (the family is on when ``component_clip_max_norm`` is set),
``stable_spam_<option>`` from `StableSPAMConfig` and ``degenerate_<option>`` from `DegenerateRunConfig`. The
trainer adds the callbacks the config asks for at the end of its ``__init__``
(`hf_stable.callbacks.stability.add_stability_callbacks`). Everything is off by default except the two detectors,
which only raise (no gradient at all) or log (degenerate GRPO run), so a default config trains exactly like its TRL
parent.

``stability_guard_kwargs`` (a dict of guard options) is deprecated: still accepted for one release, with a
FutureWarning naming the ``guard_*`` fields it is mapped onto.

The mixins are dataclasses placed *before* the TRL/transformers config in the bases, so their fields come after the
parent's (``output_dir`` stays the first positional field) and their ``__post_init__`` runs the parent's first.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from dataclasses import dataclass, field
from typing import Any

from .._validation import check_bool
from .callback_configs import (
    CLIP_GROUPS,
    ComponentClipConfig,
    DegenerateRunConfig,
    GuardConfig,
    StableSPAMConfig,
    stable_spam_host_problems,
)
from .options import changed_fields, check_config_fields, config_field_name, config_fields, options_from


__all__ = [
    "CLIP_GROUPS",
    "CLIP_PREFIX",
    "DEGENERATE_PREFIX",
    "GRPO_GUARD_DEFAULTS",
    "GUARD_PREFIX",
    "SPAM_PREFIX",
    "GRPOStabilityConfigMixin",
    "StabilityConfigMixin",
    "guard_kwarg_names",
    "guard_kwargs_to_fields",
]

GUARD_PREFIX, CLIP_PREFIX, DEGENERATE_PREFIX, SPAM_PREFIX = "guard_", "component_clip_", "degenerate_", "stable_spam_"
# A GRPO loss sits around 0 whatever the policy does (group-centred advantages): it carries no spike information, so
# the guard watches the gradient norm only unless the config says otherwise (`guard_loss_z`).
GRPO_GUARD_DEFAULTS = {"loss_z": None}


def guard_kwarg_names() -> list[str]:
    """The options of `StabilityGuardCallback` (the keys the deprecated `stability_guard_kwargs` accepts)."""
    return [f.name for f in dataclasses.fields(GuardConfig)] + ["probe_dataset"]


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


def guard_kwargs_to_fields(kwargs: dict) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split deprecated ``stability_guard_kwargs`` into ``({config field: value}, {option without a field: value})``,
    refusing an unknown key by name."""
    allowed = guard_kwarg_names()
    flags = {f.name for f in GuardConfig.flags()}
    for key in kwargs:
        if key not in allowed:
            raise ValueError(
                f"`stability_guard_kwargs` has an unknown key {key!r}. Allowed keys: {', '.join(allowed)}."
            )
    mapped = {config_field_name(GUARD_PREFIX, k): v for k, v in kwargs.items() if k in flags}
    return mapped, {k: v for k, v in kwargs.items() if k not in flags}


def _warn_deprecated(mapped: dict[str, Any], extras: dict[str, Any]) -> None:
    new = ", ".join(f"{k}={v!r}" for k, v in mapped.items()) or "(no config field)"
    kept = f"; {', '.join(extras)} have no config field: pass them to StabilityGuardCallback" if extras else ""
    warnings.warn(
        f"`stability_guard_kwargs` is deprecated and will be removed in the next release: set the config fields "
        f"{new} instead{kept}.",
        FutureWarning,
        stacklevel=4,
    )


def _guard_options(config) -> dict[str, Any]:
    """The guard options of ``config``'s fields, checked together by `GuardConfig` (which names the option)."""
    options = options_from(config, GuardConfig, GUARD_PREFIX)
    try:
        GuardConfig(**options)
    except (ValueError, TypeError) as error:
        raise type(error)(f"stability_guard (fields {GUARD_PREFIX}*): {error}") from None
    return options


@dataclass
@config_fields(StableSPAMConfig, SPAM_PREFIX)
@config_fields(ComponentClipConfig, CLIP_PREFIX, defaults={"max_norm": None})
@config_fields(GuardConfig, GUARD_PREFIX)
class StabilityConfigMixin:
    """The stability fields every hf_stable config has (see `docs/stability.md`, "Config flags")."""

    stability_guard: bool = field(
        default=False,
        metadata={"help": "Attach StabilityGuardCallback (spike detection, skip, rollback); off by default."},
    )
    stability_guard_kwargs: dict | str | None = field(
        default=None,
        metadata={
            "help": "Deprecated (removed in the next release): a dict of StabilityGuardCallback options; set the "
            "guard_* fields instead."
        },
    )
    stable_spam: bool = field(
        default=False,
        metadata={
            "help": "Train with the Stable-SPAM optimizer (spike-aware clipping, gradient-norm normalisation, moment "
            "reset around AdamW; StableSPAMCallback); off by default."
        },
    )
    no_gradient_check: bool = field(
        default=True,
        metadata={
            "help": "Raise NoGradientError when no trainable parameter gets a gradient at the first step (or the "
            "model is frozen), naming the cause."
        },
    )

    def __post_init__(self):
        super().__post_init__()
        self._check_stability_fields()

    def _check_stability_fields(self) -> None:
        check_bool("stability_guard", self.stability_guard)
        check_bool("no_gradient_check", self.no_gradient_check)
        self.stability_guard_kwargs = _parse_kwargs(self.stability_guard_kwargs)
        if self.stability_guard_kwargs:
            if not self.stability_guard:
                raise ValueError(
                    "`stability_guard_kwargs` is set but `stability_guard` is False: they would be ignored. Set "
                    "stability_guard=True, or drop the kwargs."
                )
            self._map_guard_kwargs()
        check_config_fields(self, GuardConfig, GUARD_PREFIX)
        if self.stability_guard:
            _guard_options(self)
        else:
            self._refuse_when_off(GUARD_PREFIX, "`stability_guard` is False")
        check_config_fields(self, ComponentClipConfig, CLIP_PREFIX)
        if self.component_clip_max_norm is None:
            self._refuse_when_off(CLIP_PREFIX, "component clipping is off without `component_clip_max_norm`")
        self._check_stable_spam()

    def _check_stable_spam(self) -> None:
        check_bool("stable_spam", self.stable_spam)
        check_config_fields(self, StableSPAMConfig, SPAM_PREFIX)
        if not self.stable_spam:
            self._refuse_when_off(SPAM_PREFIX, "`stable_spam` is False")
            return
        try:
            StableSPAMConfig(**options_from(self, StableSPAMConfig, SPAM_PREFIX))
        except (ValueError, TypeError) as error:
            raise type(error)(f"stable_spam (fields {SPAM_PREFIX}*): {error}") from None
        problems = stable_spam_host_problems(self)
        if problems:
            raise ValueError(f"stable_spam=True cannot be combined with: {'; '.join(problems)}.")

    def _map_guard_kwargs(self) -> None:
        mapped, extras = guard_kwargs_to_fields(self.stability_guard_kwargs)
        defaults = {f.name: f.default for f in dataclasses.fields(type(self))}
        for name, value in mapped.items():
            current = getattr(self, name)
            if current != defaults[name] and current != value:
                raise ValueError(
                    f"`{name}`={current!r} and `stability_guard_kwargs` {{{name[len(GUARD_PREFIX):]!r}: {value!r}}} "
                    "disagree; set the field only (the kwargs are deprecated)."
                )
            setattr(self, name, value)
        _warn_deprecated(mapped, extras)

    def _refuse_when_off(self, prefix: str, why: str) -> None:
        changed = changed_fields(self, prefix)
        if changed:
            raise ValueError(f"`{changed[0]}` is set but {why}: it would be ignored.")

    def guard_options(self) -> dict[str, Any]:
        """The `StabilityGuardCallback` options these fields give (plus the deprecated kwargs without a field)."""
        extras = guard_kwargs_to_fields(self.stability_guard_kwargs or {})[1]
        return {**options_from(self, GuardConfig, GUARD_PREFIX), **extras}

    def stable_spam_options(self) -> dict[str, Any]:
        """The `StableSPAMCallback` options these fields give."""
        return options_from(self, StableSPAMConfig, SPAM_PREFIX)

    def component_clip_options(self) -> dict[str, Any]:
        """The `ComponentClipCallback` options these fields give."""
        return options_from(self, ComponentClipConfig, CLIP_PREFIX)


@dataclass
@config_fields(DegenerateRunConfig, DEGENERATE_PREFIX)
class GRPOStabilityConfigMixin(StabilityConfigMixin):
    """`StabilityConfigMixin` plus the degenerate-run warnings of GRPO (on by default: they only log). Thresholds
    follow Axolotl's training-stability guide (see `docs/stability.md`)."""

    guard_loss_z: float | None = field(
        default=GRPO_GUARD_DEFAULTS["loss_z"],
        metadata={
            "help": "Robust z threshold of a loss spike; None (GRPO's default: its loss sits around 0 and carries no "
            "spike information): the loss is not watched."
        },
    )
    degenerate_run_warnings: bool = field(
        default=True,
        metadata={"help": "Warn when a GRPO run cannot learn (GRPODegenerateRunCallback); it only logs."},
    )

    def _check_stability_fields(self) -> None:
        super()._check_stability_fields()
        check_bool("degenerate_run_warnings", self.degenerate_run_warnings)
        check_config_fields(self, DegenerateRunConfig, DEGENERATE_PREFIX)
        if not self.degenerate_run_warnings:
            self._refuse_when_off(DEGENERATE_PREFIX, "`degenerate_run_warnings` is False")

    def degenerate_kwargs(self) -> dict:
        """The `GRPODegenerateRunCallback` options these fields give."""
        return options_from(self, DegenerateRunConfig, DEGENERATE_PREFIX)
