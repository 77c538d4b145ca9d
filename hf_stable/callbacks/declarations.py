"""Declarations of the stability detectors, monitors, optimizers and evaluation callbacks that attach to any
transformers/TRL trainer, so that `hf-stable list` shows them with their papers. Their settings are callback arguments
(and, for the optimizers, the generated ``stable_spam_*`` config fields of `hf_stable.stability.config`), not registry
`Field`s; each entry's description names what turns it on."""

from __future__ import annotations

from ..evaluation.mmc import MMC_PAPER, certify_majority
from ..papers import PAPERS
from ..registry import Registry
from .map_eval import MAP_PAPER, MaPCallback
from .monitors import RepresentationDriftCallback
from .stability import StabilityGuardCallback, StableSPAMCallback


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

STABILITY_OPTIMIZERS = Registry(
    "stability_optimizer", "optimizers for stable training, attached to any Trainer (a config switch on ours)"
)

STABILITY_OPTIMIZERS.register(
    "stable_spam",
    paper=PAPERS["stable_spam"],
    description=(
        "stable_spam=True (stable_spam_* fields) or StableSPAMCallback.attach(trainer): the trainer builds the "
        "Stable-SPAM optimizer (AdamW with spike clipping at the historical max, gradient-norm rescaling, moment "
        "reset), the same update as the authors' optimizer on the same gradients."
    ),
)(StableSPAMCallback)

EVALUATION_METHODS = Registry(
    "evaluation", "evaluation during training (callback arguments) and of a folder of checkpoints (`hf-stable eval`)"
)

EVALUATION_METHODS.register(
    "map",
    paper=MAP_PAPER,
    description=(
        "MaPCallback(eval_dataset, num_checkpoints=N, interval_steps=s, ks=(1,), num_samples=n): at every evaluation "
        "the uniform mean of the last N snapshots (WSM's window, schedule 'uniform') is scored with the unbiased "
        "pass@k over n sampled answers, logged as eval/map/pass@k; offline: `hf-stable eval FOLDER`. Reconstructed "
        "from the paper's abstract (uniform mean and Chen et al.'s pass@k estimator are our reading)."
    ),
)(MaPCallback)

EVALUATION_METHODS.register(
    "mmc",
    paper=MMC_PAPER,
    description=(
        "certify_majority(sample_answer, alpha=0.05, max_samples=256) or certify_model_answer(model, tokenizer, "
        "prompt): draw answers until the Martingale Majority Certificate holds, P(certifying an answer that is not "
        "the unique mode) <= alpha at any stopping. Reconstructed from the paper's abstract (the statistic, a "
        "Uniform[1/2,1]-mixture leader-vs-runner-up e-process weighted by first appearance, is ours)."
    ),
)(certify_majority)

__all__ = ["EVALUATION_METHODS", "STABILITY_MONITORS", "STABILITY_OPTIMIZERS"]
