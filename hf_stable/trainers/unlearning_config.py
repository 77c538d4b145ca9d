"""`UnlearningConfig`: `TrainingArguments` plus the unlearning methods' fields (HfArgumentParser / TrlParser ready)."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

from transformers import TrainingArguments

from ._base import TokenFreeConfigMixin
from ._unlearn_methods import UNLEARNING_METHODS, method_spec


RETAIN_TYPES = ("nll", "kl", "none")
MLP_TARGETS = ["gate_proj", "up_proj", "down_proj"]


@dataclass
class UnlearningConfig(TokenFreeConfigMixin, TrainingArguments):
    """[`~transformers.TrainingArguments`] for [`UnlearningTrainer`]. Every `TrainingArguments` flag works;
    `remove_unused_columns` is forced to `False` (batches hold a forget and a retain stream).

    The method (``unlearn_method``) picks a forget loss, a retain term and an optimisation scheme:

    | method | forget term | retain term (default) | scheme |
    |---|---|---|---|
    | `ga` | gradient ascent on the forget NLL | none | one loss |
    | `graddiff` | gradient ascent | NLL | one loss |
    | `npo` | NPO, cached reference log-probs | NLL | one loss |
    | `simnpo` | SimNPO (reference-free, length-normalised) | NLL | one loss |
    | `sga` | label-smoothed ascent with normal examples | none | one loss, or the norm-minimising rate (`"auto"`) |
    | `pdu` | logit-margin flattening (or `pdu_forget_loss`) | NLL ≤ ε as a constraint | primal-dual |
    | `stableun` | SimNPO/NPO at a sharpness-aware probe point | NLL, projected | multi-point gradients |
    | `dmm` | KL to target distributions (oracle, precomputed, prior) | part of the matching | one loss |

    Parameters (beyond `TrainingArguments`):
        unlearn_method (`str`, defaults to `"graddiff"`): one of the methods above.
        forget_weight (`float`, *optional*): weight of the forget term (γ); default per method (1, SimNPO 0.1375).
        retain_weight (`float`, defaults to `1.0`): weight of the retain term (α).
        retain_loss_type (`str`, *optional*): `"nll"`, `"kl"` (to the starting model) or `"none"`; default per method.
        forget_reduction (`str`, defaults to `"token"`): GA/GradDiff average over answer tokens or over sequences.
        anchor (`str`, defaults to `"forget"`): which set defines an epoch; the other one supplies random partners.
        npo_beta (`float`, defaults to `0.1`), precompute_ref_logps (`bool`, defaults to `True`): NPO's β, and caching
            the starting model's sequence log-probs once (no reference model is then kept).
        simnpo_beta (`float`, defaults to `2.5`), simnpo_margin (`float`, defaults to `0.0`): SimNPO's β and margin
            `m` in the paper's convention (`m = β·δ` for open-unlearning's `delta`).
        sga_rate (`float` or `"auto"`, defaults to `-1.0`), sga_num_normal (`int`, defaults to `3`),
            sga_rate_range (`list[float]`, defaults to `[-2.0, 0.0]`), sga_normal_source (`str`, defaults to
            `"retain_random"`; or `"retain_similar"`, `"provided"`): SGA.
        pdu_eps (`float` or `"auto"`): the retain-loss bound ε (required for `pdu`; `"auto"` = 1.1 × the starting
            retain loss + 0.05). pdu_lambda0 (`100.0`), pdu_dual_lr (`5.0`), pdu_dual_update (`"step"`/`"epoch"`),
            pdu_warmup_steps (`0`), pdu_forget_loss (`"flatten"`, `"ga"`, `"npo"`, `"simnpo"`).
        stableun_rho (`0.05`), stableun_points (`"sam+clean"`, `"sam"`, `"sam+gauss"`), stableun_sigma (`0.0`),
            stableun_project (`True`), stableun_base_loss (`"simnpo"`, `"npo"`): StableUN.
        bounded_lora (`bool`, defaults to `False`): bounded (sine) LoRA adapters on ``bounded_targets`` (the MLP
            projections) — "Stable Forgetting" (arXiv 2509.24166); with bounded_omega (`200.0`), bounded_lora_r
            (`8`), bounded_lora_alpha (`16`).
        dmm_target (`"oracle_model"`, `"precomputed"`, `"prior"`), dmm_retain_fraction (`0.5`), dmm_temperature
            (`1.0`): datamodel / oracle matching.
        collapse_guard (`bool`, defaults to `True`), collapse_retain_factor (`3.0`), collapse_retain_floor (`1.0`),
            collapse_forget_floor (`1e-3`), collapse_check_steps (`10`), collapse_restore_best (`False`): stop when
            the retain NLL exceeds max(factor × its start, floor) — the floor keeps a memorised start (NLL ≈ 0.004)
            from tripping on noise — or the forget answer probability falls below forget_floor × the holdout
            probability at the start.
        relearn_probe_steps (`0`: off), relearn_probe_lr (`1e-5`), relearn_probe_fraction (`0.5`): after training,
            fine-tune a copy on part of the forget set and report how much comes back (the real weights are kept).
        unlearn_eval_steps (`int`, defaults to `0`): run `evaluate_unlearning` every N steps (needs eval sets).
        max_length (`int`, *optional*, defaults to `512`): truncation of tokenised rows.
    """

    unlearn_method: str = field(default="graddiff", metadata={"help": "Unlearning method (see the docs table)."})
    forget_weight: float | None = field(default=None, metadata={"help": "Weight of the forget term; method default."})
    retain_weight: float = field(default=1.0, metadata={"help": "Weight of the retain term."})
    retain_loss_type: str | None = field(default=None, metadata={"help": "Retain term: nll, kl or none."})
    forget_reduction: str = field(default="token", metadata={"help": "GA/GradDiff reduction: token or sequence."})
    anchor: str = field(default="forget", metadata={"help": "Which set defines an epoch: forget or retain."})
    npo_beta: float = field(default=0.1, metadata={"help": "NPO β."})
    precompute_ref_logps: bool = field(default=True, metadata={"help": "Cache NPO's reference log-probs once."})
    simnpo_beta: float = field(default=2.5, metadata={"help": "SimNPO β."})
    simnpo_margin: float = field(default=0.0, metadata={"help": "SimNPO margin m (paper convention)."})
    sga_rate: str = field(default="-1.0", metadata={"help": "SGA smoothing rate r, or 'auto'."})
    sga_num_normal: int = field(default=3, metadata={"help": "Normal examples per forget example (K-1)."})
    sga_rate_range: list[float] = field(default_factory=lambda: [-2.0, 0.0], metadata={"help": "Clip for 'auto'."})
    sga_normal_source: str = field(
        default="retain_random", metadata={"help": "retain_random, retain_similar, provided."}
    )
    pdu_eps: str | None = field(default=None, metadata={"help": "PDU retain bound ε (a number or 'auto')."})
    pdu_lambda0: float = field(default=100.0, metadata={"help": "PDU initial dual variable λ."})
    pdu_dual_lr: float = field(default=5.0, metadata={"help": "PDU dual step size η."})
    pdu_dual_update: str = field(default="step", metadata={"help": "PDU dual update per step or per epoch."})
    pdu_warmup_steps: int = field(default=0, metadata={"help": "Steps with λ held at its initial value."})
    pdu_forget_loss: str = field(default="flatten", metadata={"help": "PDU forget loss: flatten, ga, npo, simnpo."})
    stableun_rho: float = field(default=0.05, metadata={"help": "StableUN sharpness-aware radius ρ."})
    stableun_points: str = field(default="sam+clean", metadata={"help": "sam, sam+clean or sam+gauss."})
    stableun_sigma: float = field(default=0.0, metadata={"help": "StableUN Gaussian probe std (sam+gauss)."})
    stableun_project: bool = field(default=True, metadata={"help": "Project out conflicts with the retain gradient."})
    stableun_base_loss: str = field(default="simnpo", metadata={"help": "StableUN forget loss: simnpo or npo."})
    bounded_lora: bool = field(default=False, metadata={"help": "Bounded (sine) LoRA on the MLP projections."})
    bounded_omega: float = field(default=200.0, metadata={"help": "Sine frequency ω of the bounded adapters."})
    bounded_lora_r: int = field(default=8, metadata={"help": "Rank of the bounded adapters."})
    bounded_lora_alpha: float = field(default=16.0, metadata={"help": "lora_alpha of the bounded adapters."})
    bounded_targets: list[str] = field(default_factory=lambda: list(MLP_TARGETS), metadata={"help": "Targets."})
    dmm_target: str = field(default="oracle_model", metadata={"help": "oracle_model, precomputed or prior."})
    dmm_retain_fraction: float = field(default=0.5, metadata={"help": "Share of the matching loss on retain rows."})
    dmm_temperature: float = field(default=1.0, metadata={"help": "Temperature of the model in the matching KL."})
    collapse_guard: bool = field(default=True, metadata={"help": "Stop when retain loss explodes or over-forgetting."})
    collapse_retain_factor: float = field(default=3.0, metadata={"help": "Retain NLL limit, × its start."})
    collapse_retain_floor: float = field(default=1.0, metadata={"help": "Retain NLL limit, at least (nats/token)."})
    collapse_forget_floor: float = field(
        default=1e-3, metadata={"help": "Forget prob limit, × holdout prob at start."}
    )
    collapse_check_steps: int = field(default=10, metadata={"help": "Steps between collapse checks."})
    collapse_restore_best: bool = field(
        default=False, metadata={"help": "Restore the last healthy weights on a trip."}
    )
    relearn_probe_steps: int = field(default=0, metadata={"help": "Relearning probe steps after training (0: off)."})
    relearn_probe_lr: float = field(default=1e-5, metadata={"help": "Relearning probe learning rate."})
    relearn_probe_fraction: float = field(default=0.5, metadata={"help": "Share of the forget set the probe learns."})
    unlearn_eval_steps: int = field(default=0, metadata={"help": "evaluate_unlearning every N steps (0: off)."})
    max_length: int | None = field(default=512, metadata={"help": "Maximum tokenised length of a row."})

    def __post_init__(self):
        self.remove_unused_columns = False  # batches are nested forget/retain dicts
        super().__post_init__()
        spec = method_spec(self.unlearn_method)  # raises listing the valid methods
        if self.forget_weight is None:
            self.forget_weight = spec.forget_weight
        if self.retain_loss_type is None:
            self.retain_loss_type = spec.retain_loss
        _choice("retain_loss_type", self.retain_loss_type, RETAIN_TYPES)
        _choice("forget_reduction", self.forget_reduction, ("token", "sequence"))
        _choice("anchor", self.anchor, ("forget", "retain"))
        _choice("pdu_dual_update", self.pdu_dual_update, ("step", "epoch"))
        _choice("pdu_forget_loss", self.pdu_forget_loss, ("flatten", "ga", "npo", "simnpo"))
        _choice("stableun_points", self.stableun_points, ("sam", "sam+clean", "sam+gauss"))
        _choice("stableun_base_loss", self.stableun_base_loss, ("simnpo", "npo"))
        _choice("sga_normal_source", self.sga_normal_source, ("retain_random", "retain_similar", "provided"))
        _choice("dmm_target", self.dmm_target, ("oracle_model", "precomputed", "prior"))
        for name in ("forget_weight", "retain_weight", "pdu_lambda0", "pdu_dual_lr", "stableun_rho", "stableun_sigma"):
            _non_negative(name, getattr(self, name))
        for name in ("npo_beta", "simnpo_beta", "bounded_omega", "bounded_lora_alpha", "dmm_temperature"):
            _positive(name, getattr(self, name))
        for name in ("sga_num_normal", "bounded_lora_r", "collapse_check_steps"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"`{name}` must be >= 1, got {getattr(self, name)}.")
        for name in ("pdu_warmup_steps", "relearn_probe_steps", "unlearn_eval_steps"):
            if int(getattr(self, name)) < 0:
                raise ValueError(f"`{name}` must be >= 0, got {getattr(self, name)}.")
        if not 0.0 <= self.dmm_retain_fraction < 1.0:
            raise ValueError(f"`dmm_retain_fraction` must be in [0, 1), got {self.dmm_retain_fraction}.")
        if not 0.0 < self.relearn_probe_fraction < 1.0:
            raise ValueError(f"`relearn_probe_fraction` must be in (0, 1), got {self.relearn_probe_fraction}.")
        _positive("collapse_retain_factor", self.collapse_retain_factor)
        _positive("collapse_forget_floor", self.collapse_forget_floor)
        _non_negative("collapse_retain_floor", self.collapse_retain_floor)
        self.sga_rate = _rate(self.sga_rate)
        low, high = (float(v) for v in self.sga_rate_range)
        if low > high:
            raise ValueError(f"`sga_rate_range` must be [low, high] with low <= high, got {self.sga_rate_range}.")
        self.sga_rate_range = [low, high]
        if self.unlearn_method == "pdu":
            if self.pdu_eps is None:
                raise ValueError("unlearn_method='pdu' needs `pdu_eps`: the retain-loss bound ε, or 'auto'.")
            if self.pdu_eps != "auto":
                try:
                    self.pdu_eps = float(self.pdu_eps)
                except (TypeError, ValueError):
                    raise ValueError(f"`pdu_eps` must be a number or 'auto', got {self.pdu_eps!r}.") from None
                _non_negative("pdu_eps", self.pdu_eps)
            if self.retain_loss_type == "none":
                raise ValueError(
                    "unlearn_method='pdu' constrains the retain loss: `retain_loss_type` cannot be 'none'."
                )
        if self.bounded_lora and not self.bounded_targets:
            raise ValueError("`bounded_lora=True` needs at least one module in `bounded_targets`.")
        ascent = self.unlearn_method in ("ga", "graddiff", "sga")
        if ascent and self.retain_loss_type != "none" and self.retain_weight == 0:
            warnings.warn(
                f"retain_weight=0 with {self.unlearn_method}: ascent without a retain term collapses.", stacklevel=2
            )
        if self.npo_beta > 1:
            warnings.warn(f"npo_beta={self.npo_beta} > 1 is unusually large (papers use 0.02-0.1).", stacklevel=2)
        if self.simnpo_beta < 0.1:
            warnings.warn(
                f"simnpo_beta={self.simnpo_beta} < 0.1 is unusually small (papers use 0.1-4.5).", stacklevel=2
            )

    @property
    def method(self):
        return method_spec(self.unlearn_method)

    @property
    def forget_loss_name(self) -> str:
        spec = self.method
        if spec.forget_loss is not None:
            return spec.forget_loss
        return self.pdu_forget_loss if spec.scheme == "dual" else self.stableun_base_loss

    @property
    def needs_reference_logps(self) -> bool:
        return self.forget_loss_name == "npo"


def _choice(name, value, allowed):
    if value not in allowed:
        raise ValueError(f"`{name}`={value!r} is not valid. Allowed values: {', '.join(allowed)}.")


def _positive(name, value):
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"`{name}` must be a finite number > 0, got {value!r}.")


def _non_negative(name, value):
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
        raise ValueError(f"`{name}` must be a finite number >= 0, got {value!r}.")


def _rate(value):
    if value == "auto":
        return "auto"
    try:
        rate = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"`sga_rate` must be a number or 'auto', got {value!r}.") from None
    if not math.isfinite(rate):
        raise ValueError(f"`sga_rate` must be finite, got {value!r}.")
    return rate


__all__ = ["UNLEARNING_METHODS", "UnlearningConfig"]
