"""`UnlearningConfig`: `TrainingArguments` plus the unlearning fields (HfArgumentParser / TrlParser ready).

The methods' own fields are generated from their declarations (`methods.py`, and the forget losses' in
`hf_stable.losses.unlearning`); the fields written here are shared by every method.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, fields

from transformers import TrainingArguments

from ..._validation import check_bool, check_choice, check_int, check_number
from ...losses.unlearning import FORGET_LOSSES, RETAIN_LOSSES, number_or_auto
from ...registry import declare_fields
from ...stability.config import StabilityConfigMixin
from .._base import TokenFreeConfigMixin
from .methods import MULTI_GRAD_HOSTS, UNLEARNING_METHODS, forget_loss_name, read_fields, scheme


MLP_TARGETS = ["gate_proj", "up_proj", "down_proj"]
# (option, value that is not honoured, why): `TrainingArguments` options the unlearning losses cannot apply
HOST_REFUSALS = (
    ("label_smoothing_factor", lambda v: v != 0, "the unlearning losses are not label-smoothed"),
    (
        "include_num_input_tokens_seen",
        lambda v: v not in (False, "no"),
        "batches are nested forget/retain streams, which transformers' token counter does not read",
    ),
)


@dataclass
@declare_fields(UNLEARNING_METHODS, FORGET_LOSSES)
class UnlearningConfig(TokenFreeConfigMixin, StabilityConfigMixin, TrainingArguments):
    """[`~transformers.TrainingArguments`] for [`UnlearningTrainer`]. Every `TrainingArguments` flag works or is
    refused by name; `remove_unused_columns` is forced to `False` (batches hold a forget and a retain stream).

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

    Parameters (beyond `TrainingArguments` and the method fields listed below):
        unlearn_method (`str`, defaults to `"graddiff"`): one of the methods above.
        forget_weight (`float`, *optional*): weight of the forget term (γ); default per method (1, SimNPO 0.1375).
        retain_weight (`float`, defaults to `1.0`): weight of the retain term (α); PDU's is λ instead.
        retain_loss_type (`str`, *optional*): `"nll"`, `"kl"` (to the starting model) or `"none"`; default per method.
        anchor (`str`, defaults to `"forget"`): which set defines an epoch; the other one supplies random partners.
        bounded_lora (`bool`, defaults to `False`): bounded (sine) LoRA adapters on ``bounded_targets`` (the MLP
            projections), "Stable Forgetting" (arXiv 2509.24166); with bounded_omega (`200.0`), bounded_lora_r
            (`8`), bounded_lora_alpha (`16`).
        collapse_guard (`bool`, defaults to `True`), collapse_retain_factor (`3.0`), collapse_retain_floor (`1.0`),
            collapse_forget_floor (`1e-3`), collapse_check_steps (`10`), collapse_restore_best (`False`): stop when
            the retain NLL exceeds max(factor × its start, floor) (the floor keeps a memorised start, NLL ≈ 0.004,
            from tripping on noise) or the forget answer probability falls below forget_floor × the holdout
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
    anchor: str = field(default="forget", metadata={"help": "Which set defines an epoch: forget or retain."})
    bounded_lora: bool = field(default=False, metadata={"help": "Bounded (sine) LoRA on the MLP projections."})
    bounded_omega: float = field(default=200.0, metadata={"help": "Sine frequency ω of the bounded adapters."})
    bounded_lora_r: int = field(default=8, metadata={"help": "Rank of the bounded adapters."})
    bounded_lora_alpha: float = field(default=16.0, metadata={"help": "lora_alpha of the bounded adapters."})
    bounded_targets: list[str] = field(default_factory=lambda: list(MLP_TARGETS), metadata={"help": "Targets."})
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
        check_choice("unlearn_method", self.unlearn_method, UNLEARNING_METHODS.choices())
        method = UNLEARNING_METHODS.get(self.unlearn_method)
        if self.forget_weight is None:
            self.forget_weight = method.extra["forget_weight"]
        if self.retain_loss_type is None:
            self.retain_loss_type = method.extra["retain_loss"]
        self.sga_rate = number_or_auto("sga_rate", self.sga_rate)
        if self.pdu_eps is not None:
            self.pdu_eps = number_or_auto("pdu_eps", self.pdu_eps)
        UNLEARNING_METHODS.validate(self)  # the method fields and the method's host requirements
        for declared in FORGET_LOSSES.fields():
            declared.check(declared.name, getattr(self, declared.name))
        self.sga_rate_range = [float(v) for v in self.sga_rate_range]
        check_choice("retain_loss_type", self.retain_loss_type, RETAIN_LOSSES.choices())
        check_choice("anchor", self.anchor, ("forget", "retain"))
        for name in ("forget_weight", "retain_weight", "collapse_retain_floor"):
            check_number(name, getattr(self, name), low=0)
        for name in ("bounded_omega", "bounded_lora_alpha", "collapse_retain_factor", "collapse_forget_floor"):
            check_number(name, getattr(self, name), low=0, low_open=True)
        check_number("relearn_probe_lr", self.relearn_probe_lr, low=0, low_open=True)
        check_number(
            "relearn_probe_fraction", self.relearn_probe_fraction, low=0, high=1, low_open=True, high_open=True
        )
        for name in ("bounded_lora_r", "collapse_check_steps"):
            check_int(name, getattr(self, name), low=1)
        for name in ("relearn_probe_steps", "unlearn_eval_steps"):
            check_int(name, getattr(self, name), low=0)
        check_int("max_length", self.max_length, low=1, allow_none=True)
        for name in ("bounded_lora", "collapse_guard", "collapse_restore_best"):
            check_bool(name, getattr(self, name))
        if self.bounded_lora and not self.bounded_targets:
            raise ValueError("`bounded_lora=True` needs at least one module in `bounded_targets`.")
        self._refuse_unhonoured()
        self._warn_unread()

    def _refuse_unhonoured(self) -> None:
        """Settings that would silently do nothing, or something other than what they say."""
        for option, refused, why in HOST_REFUSALS:
            if refused(getattr(self, option)):
                raise ValueError(f"UnlearningConfig does not support {option}={getattr(self, option)!r}: {why}.")
        if self.world_size > 1 and not self.average_tokens_across_devices:
            raise ValueError(
                "UnlearningConfig does not support average_tokens_across_devices=False: every loss term is "
                "normalised over all processes' answer tokens (exact DDP invariance)."
            )
        if self.scheme == "auto_rate":
            problems = [
                f"{r.option}={getattr(self, r.option)!r} ({r.why})"
                for r in MULTI_GRAD_HOSTS
                if not r.ok(getattr(self, r.option))
            ]
            if problems:
                raise ValueError(f"sga_rate='auto' cannot be combined with: {'; '.join(problems)}.")
        elif "sga_rate_range" in read_fields(self) and self.sga_rate_range != _default("sga_rate_range"):
            raise ValueError("`sga_rate_range` clips the rate of sga_rate='auto' only; set sga_rate='auto'.")
        if self.scheme == "dual":
            if self.pdu_eps is None:
                raise ValueError("unlearn_method='pdu' needs `pdu_eps`: the retain-loss bound ε, or 'auto'.")
            if self.retain_loss_type == "none":
                raise ValueError(
                    "unlearn_method='pdu' constrains the retain loss: `retain_loss_type` cannot be 'none'."
                )
            if self.retain_weight != 1.0:
                raise ValueError(
                    f"`retain_weight`={self.retain_weight!r} is not used by unlearn_method='pdu': its retain weight "
                    "is the dual variable λ; set `pdu_lambda0` instead."
                )
        elif self.retain_loss_type == "none" and self.retain_weight != 1.0:
            raise ValueError(
                f"`retain_weight`={self.retain_weight!r} has no effect with retain_loss_type='none' "
                f"(unlearn_method={self.unlearn_method!r}); set retain_loss_type to 'nll' or 'kl'."
            )
        gauss = self.stableun_points == "sam+gauss"
        if "stableun_sigma" in read_fields(self) and gauss != (self.stableun_sigma > 0):
            raise ValueError(
                f"`stableun_sigma`={self.stableun_sigma!r} with stableun_points={self.stableun_points!r}: the "
                "Gaussian probe's std must be > 0 exactly when stableun_points='sam+gauss'."
            )

    def _warn_unread(self) -> None:
        """One warning for method fields set away from their default that the chosen method does not read."""
        declared = [f.name for registry in (UNLEARNING_METHODS, FORGET_LOSSES) for f in registry.fields()]
        unread = sorted(n for n in set(declared) - read_fields(self) if getattr(self, n) != _default(n))
        if unread:
            warnings.warn(
                f"unlearn_method={self.unlearn_method!r} does not read {', '.join(unread)}: they have no effect.",
                stacklevel=3,
            )
        forget_loss = FORGET_LOSSES.get(self.forget_loss_name)
        if forget_loss.extra.get("unbounded") and self.retain_loss_type != "none" and self.retain_weight == 0:
            warnings.warn(
                f"retain_weight=0 with {self.unlearn_method}: ascent without a retain term collapses.", stacklevel=3
            )
        if self.npo_beta > 1 and "npo_beta" in read_fields(self):
            warnings.warn(f"npo_beta={self.npo_beta} > 1 is unusually large (papers use 0.02-0.1).", stacklevel=3)
        if self.simnpo_beta < 0.1 and "simnpo_beta" in read_fields(self):
            warnings.warn(
                f"simnpo_beta={self.simnpo_beta} < 0.1 is unusually small (papers use 0.1-4.5).", stacklevel=3
            )

    @property
    def method(self):
        """The declaration of ``unlearn_method`` (`hf_stable.registry.Method`)."""
        return UNLEARNING_METHODS.get(self.unlearn_method)

    @property
    def forget_loss_name(self) -> str:
        return forget_loss_name(self)

    @property
    def scheme(self) -> str:
        return scheme(self)

    @property
    def needs_reference_logps(self) -> bool:
        return "ref_seq_logps" in FORGET_LOSSES.get(self.forget_loss_name).extra["needs"]


def _default(name: str):
    """The default of an `UnlearningConfig` field, as the config holds it after `__post_init__`."""
    spec = next(f for f in fields(UnlearningConfig) if f.name == name)
    value = spec.default_factory() if callable(spec.default_factory) else spec.default
    return number_or_auto(name, value) if name == "sga_rate" else value


__all__ = ["UNLEARNING_METHODS", "UnlearningConfig"]
