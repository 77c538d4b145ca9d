"""The unlearning methods, each declared once: its forget and retain losses, how their terms combine (the registered
callable), the scheme that optimises them, the config fields it reads, the host options it refuses, and its paper.

`UnlearningConfig` generates the declared fields (`hf_stable.registry.declare_fields`) and validates them here;
`UnlearningTrainer` dispatches on the declarations and keeps no per-method table. `hf-stable list` prints them.

Schemes: ``"joint"`` (one loss per step), ``"dual"`` (PDU: the retain weight is the dual variable λ, updated by
projected dual ascent after each step) and ``"multipoint"`` (StableUN: several gradients of the whole step, combined
non-linearly). SGA with ``sga_rate="auto"`` also needs the step's gradients (scheme ``"auto_rate"``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..._validation import check_bool, check_int, choice, number
from ...losses.unlearning import FORGET_LOSSES, RETAIN_LOSSES, number_or_auto
from ...papers import PAPERS
from ...registry import Field, Registry, Requires


UNLEARNING_METHODS = Registry(
    "unlearning_method", "unlearning methods (forget loss + retain term + scheme)", selector="unlearn_method"
)

# The multi-gradient schemes take gradients with `torch.autograd.grad` on the unwrapped model and write them into
# ``p.grad``: a GradScaler would divide them by its scale, DeepSpeed steps from its own buffers, FSDP holds shards.
MULTI_GRAD_HOSTS = (
    Requires("fp16", lambda v: not v, "the step's gradients are written unscaled; use bf16 or fp32"),
    Requires("deepspeed", lambda v: not v, "DeepSpeed steps from its own gradient buffers; use DDP"),
    Requires("fsdp", lambda v: not v, "FSDP holds parameter shards; use DDP"),
)


def standalone_forget_losses() -> list[str]:
    """The forget losses that need nothing but the forget rows (PDU's and StableUN's choices)."""
    return [loss.name for loss in FORGET_LOSSES if not set(loss.extra["needs"]) - {"ref_seq_logps"}]


def _standalone_loss(name: str, value: Any) -> None:
    choice(*standalone_forget_losses())(name, value)


def _int(low: int):
    def check(name: str, value: Any) -> None:
        check_int(name, value, low=low)

    return check


def _rate_range(name: str, value: Any) -> None:
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise ValueError(f"`{name}` must be [low, high], got {value!r}.")
    for v in value:
        number()(name, v)
    if value[0] > value[1]:
        raise ValueError(f"`{name}` must be [low, high] with low <= high, got {list(value)}.")


def _eps(name: str, value: Any) -> None:
    if value is not None and number_or_auto(name, value) != "auto":
        number(low=0)(name, float(value))


def weighted_sum(terms: Mapping[str, Any], *, forget_weight: float, retain_weight: float) -> Any:
    """`γ·forget + α·retain`. The terms are step losses (scalars) or flattened step gradients `(P,)`: the combination
    is linear, so the multi-gradient schemes apply it to gradients. Under PDU the retain weight is λ."""
    return forget_weight * terms["forget"] + retain_weight * terms["retain"]


def oracle_matching(
    terms: Mapping[str, Any], *, forget_weight: float, retain_weight: float, retain_fraction: float
) -> Any:
    """DMM on a mixed batch: `(1 − f)·γ·KL_forget + f·KL_retain (+ α·retain)`, `f` = ``dmm_retain_fraction``."""
    return (
        (1 - retain_fraction) * forget_weight * terms["forget"]
        + retain_fraction * terms["dmm_retain_kl"]
        + retain_weight * terms["retain"]
    )


def _method(name: str, paper: str, description: str, objective=weighted_sum, *, forget_weight: float = 1.0, **kw):
    """Register ``name``: ``forget_loss`` (a FORGET_LOSSES name) or ``forget_loss_from`` (the field choosing it),
    the default ``retain_loss`` and ``forget_weight``, the ``scheme``, ``fields``, ``requires``, and ``terms``: the
    objective's terms beyond forget and retain (the trainer computes each with its method ``_<term>``)."""
    fields, requires = kw.pop("fields", ()), kw.pop("requires", ())
    kw.setdefault("scheme", "joint")
    UNLEARNING_METHODS.register(
        name,
        paper=PAPERS[paper],
        description=description,
        fields=fields,
        requires=requires,
        forget_weight=forget_weight,
        **kw,
    )(objective)


_method("ga", "ga_unlearning", "gradient ascent on the forget set", forget_loss="ga", retain_loss="none")
_method("graddiff", "ga_unlearning", "gradient ascent + retain NLL", forget_loss="ga", retain_loss="nll")
_method("npo", "npo", "NPO against cached reference log-probs + retain NLL", forget_loss="npo", retain_loss="nll")
# γ = 0.1375: the authors' TOFU setting
_method("simnpo", "simnpo", "SimNPO + retain NLL", forget_loss="simnpo", retain_loss="nll", forget_weight=0.1375)
_method(
    "sga",
    "sga",
    "label-smoothed gradient ascent with normal rows",
    forget_loss="sga",
    retain_loss="none",
    fields=[
        Field("sga_num_normal", 3, "Normal rows per forget row (K − 1, >= 1).", check=_int(1)),
        Field(
            "sga_rate_range",
            [-2.0, 0.0],
            "Clip [low, high] of the 'auto' rate.",
            check=_rate_range,
            type=list[float],
        ),
        Field(
            "sga_normal_source",
            "retain_random",
            "Normal rows: random retain rows, the most similar retain rows, or a `normal_dataset`.",
            check=choice("retain_random", "retain_similar", "provided"),
        ),
    ],
)
_method(
    "pdu",
    "pdu",
    "flattening under a retain-loss constraint, primal-dual",
    forget_loss_from="pdu_forget_loss",
    retain_loss="nll",
    scheme="dual",
    fields=[
        Field(
            "pdu_eps",
            None,
            "Retain-loss bound ε (>= 0), or 'auto' (1.1 × the first step's + 0.05).",
            check=_eps,
            type=str | None,
        ),
        Field("pdu_lambda0", 100.0, "Initial dual variable λ (>= 0).", check=number(low=0)),
        Field("pdu_dual_lr", 5.0, "Dual step size η (>= 0).", check=number(low=0)),
        Field(
            "pdu_dual_update",
            "step",
            "Dual ascent after every step, or at each epoch's end from a full retain pass.",
            check=choice("step", "epoch"),
        ),
        Field("pdu_warmup_steps", 0, "Steps with λ held at pdu_lambda0.", check=_int(0)),
        Field("pdu_forget_loss", "flatten", "PDU's forget loss.", check=_standalone_loss),
    ],
)
_method(
    "stableun",
    "stableun",
    "forget gradients at sharpness-aware probe points, projected against the retain gradient",
    forget_loss_from="stableun_base_loss",
    retain_loss="nll",
    scheme="multipoint",
    requires=MULTI_GRAD_HOSTS,
    fields=[
        Field("stableun_rho", 0.05, "Sharpness-aware probe radius ρ (>= 0).", check=number(low=0)),
        Field(
            "stableun_points",
            "sam+clean",
            "Probe points: 'sam', 'sam+clean' (also θ) or 'sam+gauss' (also a Gaussian probe).",
            check=choice("sam", "sam+clean", "sam+gauss"),
        ),
        Field("stableun_sigma", 0.0, "Std of the Gaussian probe; > 0 exactly with 'sam+gauss'.", check=number(low=0)),
        Field(
            "stableun_project",
            True,
            "Project out the forget gradient's conflict with the retain gradient.",
            check=check_bool,
        ),
        Field("stableun_base_loss", "simnpo", "StableUN's forget loss.", check=_standalone_loss),
    ],
)
_method(
    "dmm",
    "dmm",
    "KL to target distributions on forget and retain rows",
    oracle_matching,
    forget_loss="dmm",
    retain_loss="none",
    terms=("dmm_retain_kl",),  # the matching KL on the retain rows, a term of the objective
    fields=[
        Field(
            "dmm_target",
            "oracle_model",
            "Targets: an `oracle_model`, top-k targets stored with the rows, or the starting model's prior.",
            check=choice("oracle_model", "precomputed", "prior"),
        ),
        Field(
            "dmm_retain_fraction",
            0.5,
            "Share f of the matching loss on retain rows, in [0, 1).",
            check=number(low=0, high=1, high_open=True),
            param="retain_fraction",
        ),
    ],
)


def forget_loss_name(args: Any) -> str:
    """The FORGET_LOSSES entry the config's method uses."""
    method = UNLEARNING_METHODS.get(args.unlearn_method)
    source = method.extra.get("forget_loss_from")
    return getattr(args, source) if source else method.extra["forget_loss"]


def scheme(args: Any) -> str:
    """``"joint"``, ``"dual"``, ``"multipoint"``, or ``"auto_rate"`` (SGA's rate from the step's gradients)."""
    if forget_loss_name(args) == "sga" and args.sga_rate == "auto":
        return "auto_rate"
    return UNLEARNING_METHODS.get(args.unlearn_method).extra["scheme"]


def read_fields(args: Any) -> set[str]:
    """The declared fields the config's active method and forget loss read."""
    method = UNLEARNING_METHODS.get(args.unlearn_method)
    return {f.name for f in (*method.fields, *FORGET_LOSSES.get(forget_loss_name(args)).fields)}


__all__ = [
    "FORGET_LOSSES",
    "MULTI_GRAD_HOSTS",
    "RETAIN_LOSSES",
    "UNLEARNING_METHODS",
    "forget_loss_name",
    "oracle_matching",
    "read_fields",
    "scheme",
    "standalone_forget_losses",
    "weighted_sum",
]
