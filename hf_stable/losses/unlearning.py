"""Unlearning losses: forget losses, retain losses and the pieces of the multi-gradient methods.

Every forget or retain loss returns *contributions* and the unit they are averaged over, not a mean: the trainer
divides their sum by the number of units (answer tokens or sequences) in the whole optimizer step, over every
micro-batch and process, so gradient accumulation and data parallelism leave the update unchanged.

Shapes: `B` sequences, `T` positions after the causal shift (position `t` holds the log-probability of token `t+1`),
`V` vocabulary. `logps (B, T)` are label log-probabilities, `mask (B, T)` marks answer tokens (`labels[:, 1:] !=
-100`), `logits (B, T, V)` are the shifted logits (`logits[:, :-1]`). All statistics are fp32.

Papers: NPO (Zhang et al., arXiv 2404.05868), SimNPO (Fan et al., arXiv 2410.07163), label-smoothed gradient ascent
(SGA, arXiv 2510.22376, our reconstruction), logit-margin flattening with a primal-dual retain constraint (PDU,
Entesari et al., arXiv 2506.05314), StableUN (Wu et al., arXiv 2509.20230, our reconstruction), datamodel / oracle
matching (DMM, Georgiev et al., arXiv 2410.23232).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from .._validation import check_bool, choice, number
from ..papers import PAPERS
from ..registry import Field, Registry


# A trainer calls every loss the same way, ``loss(logps=, mask=, logits=, **inputs, **loss.params_from(args))``:
# its stream's tensors, the extra inputs named by the declaration's ``needs`` (the trainer provides them), and the
# config fields the loss declares. Each function takes what it uses and absorbs the rest with ``**_``.
FORGET_LOSSES = Registry("unlearning_forget_loss", "forget-set losses of the unlearning methods")
RETAIN_LOSSES = Registry(
    "unlearning_retain_loss",
    "retain-set losses (utility terms) of the unlearning methods",
    selector="retain_loss_type",
)


def number_or_auto(name: str, value: Any) -> float | str:
    """``value`` as a finite float (numbers and numeric strings, as a CLI or YAML gives them), or ``"auto"``; a
    ``ValueError`` naming field ``name`` otherwise."""
    if value == "auto":
        return "auto"
    try:
        parsed = float(value)
    except (TypeError, ValueError):
        parsed = math.nan
    if isinstance(value, bool) or not math.isfinite(parsed):
        raise ValueError(f"`{name}` must be a finite number or 'auto', got {value!r}.")
    return parsed


class Contribution(NamedTuple):
    """A loss before normalisation: ``values`` are summed and divided by the step's number of ``unit``s."""

    values: torch.Tensor  # (B, T) masked per-token values, or (B,) per-sequence values
    unit: str  # "token" or "sequence"
    stats: dict[str, torch.Tensor]  # detached 1-D diagnostics (per sequence or per answer token), averaged by element


def token_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Shifted label log-probabilities and answer mask.

    Args:
        logits (`torch.Tensor` of shape `(B, L, V)`): the model's logits.
        labels (`torch.Tensor` of shape `(B, L)`): token ids, `-100` on prompt and padding.

    Returns:
        `(logps (B, L-1) fp32, mask (B, L-1) bool)`: logits at `t` score label `t+1`; masked positions hold 0.
    """
    shifted = labels[:, 1:]
    mask = shifted != -100
    logprobs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    picked = logprobs.gather(-1, shifted.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return torch.where(mask, picked, torch.zeros_like(picked)), mask


def sequence_logps(logps: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(S (B,), lengths (B,))`: summed answer log-probability and number of answer tokens per sequence."""
    return torch.where(mask, logps, torch.zeros_like(logps)).sum(-1), mask.sum(-1)


def mean_nll(logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`ℓ̄ (B,)`: mean answer NLL per sequence; 0 for a sequence without answer tokens (no division by zero)."""
    total, length = sequence_logps(logps, mask)
    return -total / length.clamp(min=1)


def _has_answer(mask: torch.Tensor) -> torch.Tensor:
    return mask.any(-1)


def _kl(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """`KL(p ‖ q)` over the last dim from log-probabilities `(..., V)`, as `(...)`.

    Tokens with `p = 0` (log-probability `−inf`: top-k targets, masked vocabulary rows) contribute 0 by the convention
    `0 log 0 = 0`; the naive `exp(logp)·(logp − logq)` gives `0·(−inf) = NaN` there.
    """
    p = logp.exp()
    terms = p * (logp - logq)
    return torch.where(p > 0, terms, torch.zeros_like(terms)).sum(-1)


# ---------------------------------------------------------------------------------------------------------------------
# forget losses


@FORGET_LOSSES.register(
    "ga",
    paper=PAPERS["ga_unlearning"],
    description="gradient ascent on the forget NLL",
    fields=[
        Field(
            "forget_reduction",
            "token",
            "GA/GradDiff: average over answer tokens ('token') or over sequences ('sequence').",
            check=choice("token", "sequence"),
            param="reduction",
        )
    ],
    needs=(),
    unbounded=True,  # drives answers towards probability 0: collapses without a retain term
)
def ga_loss(logps: torch.Tensor, mask: torch.Tensor, reduction: str = "token", **_) -> Contribution:
    """Gradient ascent on the forget NLL: minimise `+log p`. ``reduction="token"`` averages over answer tokens (the
    HF loss, open-unlearning's parity), ``"sequence"`` over sequences of their mean log-probability."""
    if reduction == "token":
        return Contribution(torch.where(mask, logps, torch.zeros_like(logps)), "token", {})
    if reduction == "sequence":
        per_seq = -mean_nll(logps, mask)
        return Contribution(torch.where(_has_answer(mask), per_seq, torch.zeros_like(per_seq)), "sequence", {})
    raise ValueError(f"reduction must be 'token' or 'sequence', got {reduction!r}.")


@FORGET_LOSSES.register(
    "npo",
    paper=PAPERS["npo"],
    description="negative preference optimisation against the starting model",
    fields=[
        Field("npo_beta", 0.1, "NPO β (> 0).", check=number(low=0, low_open=True), param="beta"),
        Field(
            "precompute_ref_logps",
            True,
            "Cache the starting model's summed answer log-probs S_ref once (no reference model kept).",
            check=check_bool,
        ),
    ],
    needs=("ref_seq_logps",),
)
def npo_loss(logps: torch.Tensor, mask: torch.Tensor, ref_seq_logps: torch.Tensor, beta: float = 0.1, **_):
    """NPO: `(2/β) softplus(β (S_θ − S_ref))` per forget sequence, with `S` summed answer log-probabilities.

    Its gradient is `2σ(βΔ) ∇S_θ`: a weight in (0, 2) that vanishes once the sequence is far below the reference
    (which bounds the objective, unlike GA); at θ = θ_ref the loss is `(2/β) log 2`; as β → 0 it becomes GA on the
    summed NLL. ``ref_seq_logps (B,)`` are the reference's `S_ref`, usually cached before training.
    Stats: ``npo_weight`` `2σ(βΔ)` and ``log_ratio`` Δ per sequence.
    """
    total, _ = sequence_logps(logps, mask)
    has_answer = _has_answer(mask)
    # a sequence without answer tokens has no log-ratio; zeroing it keeps its stats neutral (weight 1, Δ 0)
    delta = torch.where(has_answer, total - ref_seq_logps.to(total.dtype), torch.zeros_like(total))
    values = (2.0 / beta) * F.softplus(beta * delta)
    values = torch.where(has_answer, values, torch.zeros_like(values))
    stats = {"npo_weight": (2 * torch.sigmoid(beta * delta)).detach(), "log_ratio": delta.detach()}
    return Contribution(values, "sequence", stats)


@FORGET_LOSSES.register(
    "simnpo",
    paper=PAPERS["simnpo"],
    description="reference-free, length-normalised NPO",
    fields=[
        Field("simnpo_beta", 2.5, "SimNPO β (> 0).", check=number(low=0, low_open=True), param="beta"),
        Field(
            "simnpo_margin",
            0.0,
            "SimNPO margin m (the paper's; m = β·δ for open-unlearning's δ).",
            check=number(),
            param="margin",
        ),
    ],
    needs=(),
)
def simnpo_loss(logps: torch.Tensor, mask: torch.Tensor, beta: float = 2.5, margin: float = 0.0, **_):
    """SimNPO: `(2/β) softplus(m − β ℓ̄)` per forget sequence, `ℓ̄` its mean answer NLL; no reference model.

    The margin ``m`` is the paper's; the official TOFU code and open-unlearning write `softplus(−β(ℓ̄ − δ))`, i.e.
    `m = β·δ`. The gradient weight on `−∇ℓ̄` is `2σ(m − βℓ̄)`: large while the answer is memorised (ℓ̄ small).
    Stats: ``simnpo_weight`` and ``mean_nll`` per sequence.
    """
    nll = mean_nll(logps, mask)
    values = (2.0 / beta) * F.softplus(margin - beta * nll)
    values = torch.where(_has_answer(mask), values, torch.zeros_like(values))
    stats = {"simnpo_weight": (2 * torch.sigmoid(margin - beta * nll)).detach(), "mean_nll": nll.detach()}
    return Contribution(values, "sequence", stats)


@FORGET_LOSSES.register(
    "flatten", paper=PAPERS["pdu"], description="logit-margin flattening at answer positions", needs=()
)
def flatten_loss(logits: torch.Tensor, mask: torch.Tensor, **_) -> Contribution:
    """Logit-margin flattening: `(max_v z_v − mean_v z_v)²` at every answer position (PDU's forget loss).

    Zero iff the next-token logits are all equal; its gradient `2(max − mean)(e_argmax − 1/V)` does not saturate,
    unlike entropy. ``logits (B, T, V)`` must be the *shifted* logits, so the position that predicts the first answer
    token is included (the reference code masks unshifted logits and misses it). Stats: ``logit_margin``, the gap
    `max − mean` at each answer position (1-D, one entry per answer token).
    """
    z = logits.float()
    gap = z.max(dim=-1).values - z.mean(dim=-1)
    values = torch.where(mask, gap.pow(2), torch.zeros_like(gap))
    return Contribution(values, "token", {"logit_margin": gap.detach()[mask]})


def sga_weights(rate: float, k: int) -> tuple[float, float]:
    """Generalised label-smoothing weights of a group of ``k`` (one forget example + k−1 normal ones): forget
    `1 − r(k−1)/k`, each normal `r/k`. `r = 0` is plain gradient ascent; `r < 0` descends on the normal examples."""
    if k < 1:
        raise ValueError(f"an SGA group needs k >= 1 members, got {k}.")
    return 1.0 - rate * (k - 1) / k, rate / k


@FORGET_LOSSES.register(
    "sga",
    paper=PAPERS["sga"],
    description="label-smoothed gradient ascent over a forget row and its normal rows",
    fields=[
        Field(
            "sga_rate",
            "-1.0",
            "SGA smoothing rate r (a number), or 'auto': the rate minimising the update norm, from the step's "
            "gradients.",
            check=lambda name, value: number_or_auto(name, value) and None,
            param="rate",
            type=str,
        )
    ],
    needs=("normal",),
    unbounded=True,
)
def sga_loss(
    logps: torch.Tensor,
    mask: torch.Tensor,
    normal_logps: torch.Tensor,
    normal_mask: torch.Tensor,
    rate: float = -1.0,
    **_,
) -> Contribution:
    """Smoothed gradient ascent (our reconstruction of arXiv 2510.22376): per forget example, with its ``K−1`` normal
    examples, minimise `−w_f ℓ̄_f − w_n Σ_k ℓ̄_{n_k}` (weights from `sga_weights`).

    Args:
        logps, mask (`(B, T)`): the forget batch.
        normal_logps, normal_mask (`(B, K−1, T')`): each forget example's normal examples.
        rate (`float`): the smoothing rate r.
    """
    k = normal_logps.shape[1] + 1
    w_f, w_n = sga_weights(rate, k)
    forget = mean_nll(logps, mask)
    normal = mean_nll(normal_logps.flatten(0, 1), normal_mask.flatten(0, 1)).view(normal_logps.shape[:2]).sum(1)
    values = -w_f * forget - w_n * normal
    return Contribution(torch.where(_has_answer(mask), values, torch.zeros_like(values)), "sequence", {})


def sga_auto_rate(g_forget: torch.Tensor, g_normal: torch.Tensor, k: int, low: float, high: float) -> float:
    """The rate minimising the update norm `‖g_f + r v‖`, `v = ((k−1)/k)(ḡ_n − g_f)`: `r* = −⟨g_f, v⟩/‖v‖²`, clipped to
    `[low, high]`. ``g_forget``, ``g_normal`` are flattened gradients `(P,)` of `ℓ̄_f` and the mean normal `ℓ̄`."""
    v = ((k - 1) / k) * (g_normal.double() - g_forget.double())
    norm = v.pow(2).sum()
    if norm <= 0:
        return min(max(0.0, low), high)
    rate = (-(g_forget.double() * v).sum() / norm).item()
    return min(max(rate, low), high)


@FORGET_LOSSES.register(
    "dmm",
    paper=PAPERS["dmm"],
    description="KL to target distributions (datamodel / oracle matching)",
    fields=[
        Field(
            "dmm_temperature",
            1.0,
            "Temperature dividing the model's logits in the matching KL (> 0).",
            check=number(low=0, low_open=True),
            param="temperature",
        )
    ],
    needs=("target_logprobs",),
)
def dmm_loss(
    logits: torch.Tensor, mask: torch.Tensor, target_logprobs: torch.Tensor, temperature: float = 1.0, **_
) -> Contribution:
    """Datamodel / oracle matching: `KL(p_target ‖ π_θ)` at every matched position.

    Args:
        logits (`(B, T, V)`): shifted logits of the model.
        mask (`(B, T)`): positions to match.
        target_logprobs (`(B, T, V)`): the target's next-token log-distribution (an oracle model, precomputed
            top-k targets expanded by the provider, or a prior).
        temperature (`float`): divides the model's logits.
    """
    logq = torch.log_softmax(logits.float() / temperature, dim=-1)
    kl = _kl(target_logprobs.float(), logq)
    return Contribution(torch.where(mask, kl, torch.zeros_like(kl)), "token", {})


# ---------------------------------------------------------------------------------------------------------------------
# retain losses


@RETAIN_LOSSES.register("nll", paper="Maximum likelihood on the retain set", needs=())
def retain_nll(logps: torch.Tensor, mask: torch.Tensor, **_) -> Contribution:
    """Mean NLL over retain answer tokens (the SFT loss)."""
    return Contribution(torch.where(mask, -logps, torch.zeros_like(logps)), "token", {})


@RETAIN_LOSSES.register("kl", paper="KL to the starting model on the retain set", needs=("ref_logits",))
def retain_kl(logits: torch.Tensor, mask: torch.Tensor, ref_logits: torch.Tensor, **_) -> Contribution:
    """`KL(π_ref ‖ π_θ)` per retain answer position (masked to answer tokens; open-unlearning also counts padding)."""
    logp_ref = torch.log_softmax(ref_logits.float(), dim=-1)
    logq = torch.log_softmax(logits.float(), dim=-1)
    kl = _kl(logp_ref, logq)
    return Contribution(torch.where(mask, kl, torch.zeros_like(kl)), "token", {})


@RETAIN_LOSSES.register("none", paper="No retain term", needs=())
def retain_none(logps: torch.Tensor, mask: torch.Tensor, **_) -> Contribution:
    """No retain term: zero per-sequence values `(B,)` without a graph (forget-only methods such as GA and SGA)."""
    return Contribution(torch.zeros(logps.shape[0], dtype=torch.float32, device=logps.device), "sequence", {})


# ---------------------------------------------------------------------------------------------------------------------
# primal-dual and multi-gradient pieces


def dual_update(lam: float, retain_loss: float, eps: float, lr: float) -> float:
    """Projected dual ascent on `E_r[ℓ_r] ≤ ε`: `λ ← max(0, λ + η (ℓ_r − ε))` (PDU)."""
    return max(0.0, lam + lr * (retain_loss - eps))


def auto_retain_eps(initial_retain_loss: float) -> float:
    """PDU's ``pdu_eps="auto"``: a little above the retain loss the starting model already has, `1.1·ℓ_r⁰ + 0.05`."""
    return 1.1 * initial_retain_loss + 0.05


def project_conflicting(g_forget: torch.Tensor, g_retain: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Gradient harmonisation (StableUN): when `⟨g_f, g_r⟩ < 0`, remove from `g_f` its component along `g_r`.

    Args:
        g_forget, g_retain (`(P,)`): flattened gradients.

    Returns:
        `(g_f', cos)`: the projected forgetting gradient and the cosine between the inputs (0 if either is zero).
    """
    gf, gr = g_forget.double(), g_retain.double()
    dot = (gf * gr).sum()
    norms = gf.norm() * gr.norm()
    cos = (dot / norms).item() if norms > 0 else 0.0
    if dot < 0 and gr.pow(2).sum() > 0:
        gf = gf - (dot / gr.pow(2).sum()) * gr
    return gf.to(g_forget.dtype), cos


def sam_direction(gradient: torch.Tensor, rho: float) -> torch.Tensor:
    """The sharpness-aware probe offset `ρ g/‖g‖` (zero for a zero gradient). ``gradient (P,)``."""
    norm = gradient.double().norm()
    if norm <= 0 or not math.isfinite(norm.item()):
        return torch.zeros_like(gradient)
    return (rho * gradient.double() / norm).to(gradient.dtype)
