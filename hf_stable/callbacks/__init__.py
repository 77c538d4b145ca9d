"""Trainer callbacks (learning-rate control, and later merging, stability guards and monitors)."""

import importlib


# name -> submodule; imported on first access so `import hf_stable.callbacks` stays cheap
_LAZY = {
    "WSMCallback": "wsm",
    "MergeOnTrainEndCallback": "merge",
    "PushMergedToHubCallback": "merge",
    "StabilityGuardCallback": "stability",
    "ComponentClipCallback": "stability",
    "NoGradientCallback": "stability",
    "NoGradientError": "stability",
    "GRPODegenerateRunCallback": "stability",
    "FaultInjectionCallback": "stability",
    "TrainingDivergedError": "stability",
    "add_stability_callbacks": "stability",
    "GuardConfig": "stability",
    "ComponentClipConfig": "stability",
    "DegenerateRunConfig": "stability",
    "StableSPAMCallback": "stability",
    "StableSPAMConfig": "stability",
    "StableRankMonitorCallback": "monitors",
    "MSignCallback": "monitors",
    "RepresentationDriftCallback": "monitors",
}

__all__ = sorted(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
