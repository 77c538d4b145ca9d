"""`add_stability_callbacks`: the one line an hf_stable trainer runs to attach what its config asks for."""

from __future__ import annotations

import warnings

from ..._validation import check_bool
from ...stability.callback_configs import ComponentClipConfig, DegenerateRunConfig, GuardConfig, StableSPAMConfig
from ...stability.config import CLIP_PREFIX, DEGENERATE_PREFIX, GUARD_PREFIX, SPAM_PREFIX, guard_kwargs_to_fields
from ...stability.options import generated_fields, options_from
from .clip import ComponentClipCallback
from .detectors import GRPODegenerateRunCallback, NoGradientCallback
from .guard import StabilityGuardCallback
from .spam import StableSPAMCallback


def add_stability_callbacks(trainer, args, guard_defaults: dict | None = None) -> None:
    """Add the callbacks a config asks for (read with ``getattr``, so configs without the fields behave like TRL's):

    * ``stability_guard`` (bool, default False) → `StabilityGuardCallback` with the options of the ``guard_*`` fields
      over ``guard_defaults`` (a trainer's defaults for configs that lack a field, e.g. ``{"loss_z": None}`` for GRPO,
      whose loss sits around 0 and carries no spike information); the deprecated ``stability_guard_kwargs`` (a dict
      of options) still overrides them for one release;
    * ``component_clip_max_norm`` (float or None) → `ComponentClipCallback` with the ``component_clip_*`` fields;
    * ``stable_spam`` (bool, default False) → `StableSPAMCallback` (the Stable-SPAM optimizer) with the
      ``stable_spam_*`` fields;
    * ``no_gradient_check`` (bool, default True) → `NoGradientCallback`;
    * ``degenerate_run_warnings`` (bool, default True; GRPO configs only) → `GRPODegenerateRunCallback` with the
      ``degenerate_*`` fields.

    The fields are generated from the options classes (`hf_stable.stability.callback_configs`) and validated by the
    config (`hf_stable.stability.config`).
    """
    if getattr(args, "no_gradient_check", False):
        NoGradientCallback.attach(trainer)
    kwargs = getattr(args, "stability_guard_kwargs", None) or {}
    if not isinstance(kwargs, dict):
        raise TypeError(f"`stability_guard_kwargs` must be a dict, got {kwargs!r}.")
    if getattr(args, "stability_guard", False):
        options = {**(guard_defaults or {}), **options_from(args, GuardConfig, GUARD_PREFIX)}
        if kwargs:
            mapped = guard_kwargs_to_fields(kwargs)[0]
            if not generated_fields(args, GUARD_PREFIX):  # an hf_stable config warned (and mapped) when it was built
                warnings.warn(
                    "`stability_guard_kwargs` is deprecated and will be removed in the next release: set "
                    f"{', '.join(mapped) or 'the guard_* fields'} instead.",
                    FutureWarning,
                    stacklevel=2,
                )
            options.update(kwargs)
        StabilityGuardCallback.attach(trainer, **options)
    elif kwargs:
        raise ValueError("`stability_guard_kwargs` is set but `stability_guard` is False: they would be ignored.")
    if getattr(args, "component_clip_max_norm", None) is not None:
        ComponentClipCallback.attach(trainer, **options_from(args, ComponentClipConfig, CLIP_PREFIX))
    if getattr(args, "stable_spam", False):
        check_bool("stable_spam", args.stable_spam)
        StableSPAMCallback.attach(trainer, **options_from(args, StableSPAMConfig, SPAM_PREFIX))
    if getattr(args, "degenerate_run_warnings", False):
        check_bool("degenerate_run_warnings", args.degenerate_run_warnings)
        GRPODegenerateRunCallback.attach(trainer, **options_from(args, DegenerateRunConfig, DEGENERATE_PREFIX))
