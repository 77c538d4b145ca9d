"""Declarations of the stability detectors and monitors that attach to any transformers/TRL trainer, so that
`hf-stable list` shows them with their papers. They take their settings as callback arguments, not config fields,
so they declare no `Field`s; each entry's description names the arguments that turn it on."""

from __future__ import annotations

from ..papers import PAPERS
from ..registry import Registry
from .monitors import RepresentationDriftCallback
from .stability import StabilityGuardCallback


STABILITY_MONITORS = Registry(
    "stability_monitor", "detectors and monitors attached to any Trainer (callback arguments, not config fields)"
)

STABILITY_MONITORS.register(
    "innovation_probe",
    paper=PAPERS["innovation_probe"],
    description=(
        "StabilityGuardCallback(probe_dataset=..., probe_every=N): a held-out probe loss through a scalar "
        "local-level Kalman filter; a rise whose normalised innovation squared exceeds probe_nis_threshold rolls the "
        "update back. Reconstructed from the paper's abstract (the filter and threshold are our design)."
    ),
)(StabilityGuardCallback)

STABILITY_MONITORS.register(
    "representation_drift",
    paper=PAPERS["geometric_canary"],
    description=(
        "RepresentationDriftCallback(probe_dataset=...): drift = 1 - Spearman rho between the probe set's pairwise "
        "distances now and at the reference (the unsupervised geometric stability of the paper's abstract; pooling, "
        "layers and alarm rule are ours), with linear CKA alongside. Warns, never rolls back."
    ),
)(RepresentationDriftCallback)

__all__ = ["STABILITY_MONITORS"]
