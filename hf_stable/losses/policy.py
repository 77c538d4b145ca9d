"""Policy losses beyond TRL's `loss_type`s: DRPO and on-policy SFT. Pure torch functions, and the loss modes that
the trainer dispatches to.

TRL shuffles a generation batch before splitting it into micro-batches, so a micro-batch never holds whole groups:
everything group-coupled (DRPO's per-sample coefficients, on-policy SFT's kept mask) is computed once per generation
batch by the `*_coefficients` / `*_keep` functions and travels with each sample; the losses below only need the
per-token tensors of one micro-batch.

A loss mode (registered in `LOSS_MODES`) is a class built from its declared fields, with two stages:

* ``advantages(rewards, weights, complete, lengths, num_generations, max_length, seq_logp_old)`` once per generation
  batch, on the gathered `(N, K)` rewards: returns the per-sample "advantages" `(N,)` the loss reads, an optional kept
  mask `(N,)` (completions left out of the loss) and metrics;
* ``loss(per_token_logps, mask, advantages, old_per_token_logps, accumulation, step_tokens, max_length)`` per
  micro-batch: returns `(loss, policy_loss, metrics)`, the loss already divided for gradient accumulation.

``needs_old_logps()`` says whether the first stage needs `s_old` (a no-grad forward when TRL kept no old log-probs).
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import version

import torch

from .._validation import boolean, choice, number
from ..papers import PAPERS
from ..registry import Field, Requires
from .advantages import CORRECTNESS_FIELDS, success_indicator
from .loss_modes import LOSS_MODES


# TRL < 1.16 let Liger's fused loss replace `_compute_loss`; from 1.16 on it applies only Liger's layer kernels
# (`GRPOTrainer.__init__` refuses the fused linear cross-entropy), so the loss modes see every forward.
_LIGER_REPLACES_LOSS = tuple(int(x) for x in version("trl").split(".")[:2]) < (1, 16)


def _trl_default(option: str, default, why: str) -> Requires:
    """A TRL option the loss modes do not read: refused unless left at TRL's default."""
    return Requires(option, lambda value: value == default, f"{why}; leave {option}={default!r}", fix=default)


# What every loss mode here needs from the host: no reference model, TRL's advantages left alone, and none of the
# options of TRL's PPO surrogate, which a loss mode replaces (each refused by name rather than silently ignored).
_MODE_REQUIRES = (
    Requires("beta", lambda value: value == 0.0, "set beta=0: no reference model", fix=0.0),
    Requires(
        "use_liger_kernel",
        lambda value: not value,
        "Liger's fused loss bypasses `_compute_loss` in this TRL version",
        fix=False,
        when=lambda args: _LIGER_REPLACES_LOSS,
    ),
    Requires("advantage_estimator", lambda value: value == "grpo", "the loss mode sets its own", fix="grpo"),
    Requires("delta_l_alpha", lambda value: value is None, "the loss mode has its own normalisation", fix=None),
    _trl_default("loss_type", "dapo", "the loss mode has its own objective and normalisation"),
    _trl_default("epsilon", 0.2, "the loss mode has no ratio clipping"),
    _trl_default("epsilon_high", None, "the loss mode has no ratio clipping"),
    _trl_default("delta", None, "the loss mode has no ratio clipping"),
    _trl_default("importance_sampling_level", "token", "the loss mode has no policy ratio"),
    _trl_default("top_entropy_quantile", 1.0, "the loss mode trains on every kept token"),
    _trl_default("entropy_coef", 0.0, "the loss mode has no entropy bonus"),
    _trl_default("use_adaptive_entropy", False, "the loss mode has no entropy bonus"),
    _trl_default("scale_rewards", "group", "the loss mode computes its coefficients from the raw rewards"),
    _trl_default(
        "multi_objective_aggregation",
        "sum_then_normalize",
        "the loss mode's coefficients come from the 0/1 success on the raw correctness reward (DRPO's signs and "
        "weights, on-policy SFT's kept samples), and a normalised sum of rewards has no pass/fail to count",
    ),
    _trl_default("off_policy_mask_threshold", None, "the loss mode has no off-policy sequence mask"),
)
# TRL options the loss modes apply: TRL's truncation mask (before the coefficients), its vLLM importance-sampling
# ratio and the MoE router loss (in `StableGRPOTrainer._compute_loss`, for every mode), and generation reuse (DRPO's
# trust region acts off-policy).
_MODE_HONOURS = (
    "mask_truncated_completions",
    "vllm_importance_sampling_correction",
    "router_aux_loss_coef",
    "num_iterations",
    "steps_per_generation",
)


def importance_weighted(per_token_logps: torch.Tensor, ratio: torch.Tensor) -> torch.Tensor:
    """``per_token_logps`` with the gradient of each token scaled by the detached importance ratio ``ratio``
    (`π_train/π_sampler`, TRL's ``importance_sampling_ratio`` from vLLM); the values are unchanged.

    TRL multiplies each per-token loss by the ratio. For a loss built from the log-probs with detached coefficients
    (every mode here: a weighted sum, a hinge with a detached strength), scaling the gradient of each log-prob
    gives the same update, whatever the mode. `(B, T), (B, T) or (B, 1) -> (B, T)`.
    """
    ratio = ratio.detach().to(per_token_logps.dtype)
    return per_token_logps + (ratio - 1) * (per_token_logps - per_token_logps.detach())


def sequence_logp(per_token_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Length-normalised log-likelihood `s(o) = (1/L) Σ_t log π(o_t)`, 0 for empty completions. `(B, T) -> (B,)`."""
    mask = mask.float()
    return (torch.where(mask > 0, per_token_logps.float(), 0.0)).sum(-1) / mask.sum(-1).clamp(min=1)


def drpo_coefficients(
    correct: torch.Tensor,
    lengths: torch.Tensor,
    num_generations: int,
    max_length: int,
    lam: float = 0.1,
    tau: float = 10.0,
    seq_logp_old: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """DRPO's per-sample coefficients `c_i` (Li et al., arXiv 2510.04474; `Optimization-AI/DRPO:
    compute_policy_loss_drpo`).

    In a group with at least one correct and one incorrect completion: correct ones get `+softmax_P(r_len/λ)` with
    `r_len = 1 - L/L_max` (weights summing to 1 over the positives: shorter is preferred *among correct answers*, never
    at the cost of a negative sign), incorrect ones `-softmax_N(s_old/τ)` (or `-1/|N|` without ``seq_logp_old``).
    Other groups, empty completions and unscored (NaN) ones get 0.

    Args:
        correct (`torch.Tensor` of shape `(N,)`): 1 correct, 0 incorrect, NaN unscored.
        lengths (`torch.Tensor` of shape `(N,)`): completion lengths.
        num_generations (`int`): G.
        max_length (`int`): L_max of the length reward (`max_completion_length`, not the padded width).
        lam (`float`, defaults to `0.1`): temperature λ of the length preference.
        tau (`float`, defaults to `10.0`): temperature τ of the negatives' soft-max.
        seq_logp_old (`torch.Tensor` of shape `(N,)`, *optional*): `s_old(o)` of each completion.

    Returns:
        `(coefficients (N,), metrics)`; the trainer uses `G·c_i` as the "advantage" so that a mean over samples is
        `(1/#prompts) Σ_i c_i s(o_i)`.
    """
    if lam <= 0 or tau <= 0:
        raise ValueError(f"lam and tau must be > 0, got lam={lam}, tau={tau}.")
    c = _groups(correct.float(), num_generations)
    length = _groups(lengths.float(), num_generations)
    nonempty = length > 0
    pos = (c == 1) & nonempty
    neg = (c == 0) & nonempty
    valid_group = pos.any(1, keepdim=True) & neg.any(1, keepdim=True)
    neg_inf = torch.full_like(length, -torch.inf)
    r_len = 1.0 - length / max_length
    w_pos = torch.softmax(torch.where(pos, r_len / lam, neg_inf), dim=1)  # fp32: small λ overflows in bf16
    score = _groups(seq_logp_old.float(), num_generations) / tau if seq_logp_old is not None else torch.zeros_like(c)
    w_neg = torch.softmax(torch.where(neg, score, neg_inf), dim=1)
    coef = torch.where(pos, w_pos, torch.where(neg, -w_neg, torch.zeros_like(c)))
    coef = torch.where(valid_group, torch.nan_to_num(coef, nan=0.0), torch.zeros_like(coef))
    metrics = {"frac_valid_groups": valid_group.float().mean().item()}
    return coef.reshape(-1), metrics


def drpo_loss(
    per_token_logps: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    old_per_token_logps: torch.Tensor | None = None,
    delta: float = 1e-4,
    beta: float = 1e3,
    kl_type: str = "kl",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DRPO loss of one micro-batch: `-mean_i a_i s(o_i) + [max(β(KL - δ), 0)]_sg · KL`.

    `KL` is the masked token mean of `log π_old - log π` (``kl_type="kl"``) or of the k3 estimator
    `exp(d) - d - 1`, `d = log π_old - log π` (``"k3"``): a trust region around the sampling policy, with no ratio
    clipping. On-policy (no ``old_per_token_logps``) the KL and its gradient are 0.

    Args:
        per_token_logps (`torch.Tensor` of shape `(B, T)`): log π of the completion tokens (with grad).
        mask (`torch.Tensor` of shape `(B, T)`): completion tokens in the loss.
        advantages (`torch.Tensor` of shape `(B,)`): `G·c_i` from [`drpo_coefficients`] (detached).

    Returns:
        `(loss, {"policy_loss", "kl", "penalty"})`; divide the loss for gradient accumulation in the caller.
    """
    s = sequence_logp(per_token_logps, mask)
    policy = -(advantages.detach().float() * s).mean()
    if old_per_token_logps is None:
        kl = (per_token_logps * 0.0).sum()
    else:
        d = torch.where(mask > 0, old_per_token_logps.float() - per_token_logps.float(), 0.0)
        if kl_type == "k3":
            d = torch.where(mask > 0, torch.exp(d) - d - 1, 0.0)
        elif kl_type != "kl":
            raise ValueError(f"kl_type must be 'kl' or 'k3', got {kl_type!r}.")
        kl = d.sum() / mask.float().sum().clamp(min=1)
    penalty = torch.relu(beta * (kl - delta)).detach() * kl
    return policy + penalty, {"policy_loss": policy.detach(), "kl": kl.detach(), "penalty": penalty.detach()}


@LOSS_MODES.register(
    "drpo",
    paper=PAPERS["drpo"],
    description="decoupled reward policy optimisation",
    fields=[
        Field(
            "drpo_lambda",
            0.1,
            "λ of DRPO's length preference among correct answers (smaller: stronger).",
            check=number(low=0, low_open=True),
            param="lam",
        ),
        Field(
            "drpo_tau",
            10.0,
            "τ of the soft-max over incorrect answers.",
            check=number(low=0, low_open=True),
            param="tau",
        ),
        Field("drpo_delta", 1e-4, "KL budget δ of the trust-region hinge.", check=number(low=0), param="delta"),
        Field("drpo_beta", 1e3, "Hinge strength β.", check=number(low=0, low_open=True), param="beta"),
        Field(
            "drpo_kl_type",
            "kl",
            '`"kl"` or `"k3"` estimator of the KL to the sampling policy.',
            check=choice("kl", "k3"),
            param="kl_type",
        ),
        Field(
            "drpo_neg_weighting",
            "softmax_old",
            '`"softmax_old"` (negatives weighted by `softmax(s_old/τ)`; one extra no-grad forward when TRL has no '
            'old log-probs) or `"uniform"`.',
            check=choice("softmax_old", "uniform"),
            param="neg_weighting",
        ),
        *CORRECTNESS_FIELDS,
    ],
    requires=_MODE_REQUIRES,
    honours=_MODE_HONOURS,
)
@dataclass
class DRPOMode:
    """DRPO (arXiv 2510.04474) as a loss mode: [`drpo_coefficients`] on binary correctness (a completion cut at the
    length budget counts as incorrect), then [`drpo_loss`] per micro-batch."""

    # the trainer scales each token's gradient by TRL's vLLM importance-sampling ratio (a mode that weighs its
    # tokens by the ratio itself sets this True)
    weights_sampling = False
    lam: float = 0.1
    tau: float = 10.0
    delta: float = 1e-4
    beta: float = 1e3
    kl_type: str = "kl"
    neg_weighting: str = "softmax_old"
    correctness_index: int | str | None = None
    success_threshold: float = 0.5

    def needs_old_logps(self) -> bool:
        return self.neg_weighting == "softmax_old"

    def advantages(self, rewards, weights, complete, lengths, num_generations, max_length, seq_logp_old=None):
        """`(N, K)` rewards, `(K,)` weights, `(N,)` complete/lengths/s_old -> `(G·c (N,), None, metrics)`."""
        correct = success_indicator(rewards, weights, self.correctness_index, self.success_threshold)
        correct = torch.where(complete | torch.isnan(correct), correct, torch.zeros_like(correct))  # cut: incorrect
        coef, metrics = drpo_coefficients(
            correct, lengths, num_generations, max_length, self.lam, self.tau, seq_logp_old
        )
        return coef * num_generations, None, metrics

    def loss(self, per_token_logps, mask, advantages, old_per_token_logps, accumulation, step_tokens, max_length):
        """`(B, T)` log-probs/mask, `(B,)` advantages -> `(loss / accumulation, policy loss, {"kl", "penalty"})`."""
        loss, parts = drpo_loss(
            per_token_logps, mask, advantages, old_per_token_logps, self.delta, self.beta, self.kl_type
        )
        return loss / accumulation, parts["policy_loss"], {"kl": parts["kl"], "penalty": parts["penalty"]}


def onpolicy_sft_keep(correct: torch.Tensor, eos_present: torch.Tensor, require_eos: bool = True) -> torch.Tensor:
    """Kept completions of on-policy SFT: correct and (with ``require_eos``) not cut off at the length budget.
    `(N,), (N,) -> (N,)` bool; NaN correctness is not kept."""
    keep = correct == 1
    return keep & eos_present.bool() if require_eos else keep


def onpolicy_sft_loss(
    per_token_logps: torch.Tensor, mask: torch.Tensor, normalizer: torch.Tensor | float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """On-policy SFT (arXiv 2602.13407): NLL of the kept self-generated tokens, `-Σ_t m_t log π(o_t) / normalizer`.

    ``mask`` is already zero on dropped completions; ``normalizer`` is the kept-token count of the step (global, per
    process) or a constant. A micro-batch with nothing kept gives a finite 0 that still reaches every parameter (so
    every DDP/ZeRO rank runs a backward).
    """
    nll = -(torch.where(mask > 0, per_token_logps.float(), 0.0)).sum()
    loss = nll / torch.as_tensor(normalizer, dtype=torch.float32, device=nll.device).clamp(min=1)
    return loss, {"policy_loss": loss.detach(), "kept_tokens": mask.float().sum().detach()}


@LOSS_MODES.register(
    "onpolicy_sft",
    paper=PAPERS["onpolicy_sft"],
    description="SFT on the model's own correct, complete samples",
    fields=[
        Field(
            "osft_require_eos",
            True,
            "On-policy SFT drops completions cut off at `max_completion_length` (the length budget).",
            check=boolean(),
            param="require_eos",
        ),
        Field(
            "osft_norm",
            "tokens",
            '`"tokens"` (mean over kept tokens of the step) or `"constant"` (per sample and `max_completion_length`).',
            check=choice("tokens", "constant"),
            param="norm",
        ),
        *CORRECTNESS_FIELDS,
    ],
    requires=_MODE_REQUIRES,
    honours=_MODE_HONOURS,
)
@dataclass
class OnPolicySFTMode:
    """On-policy SFT (arXiv 2602.13407) as a loss mode: keep the correct (and, with ``require_eos``, complete)
    completions, then [`onpolicy_sft_loss`] over their tokens."""

    weights_sampling = False  # see `DRPOMode`
    require_eos: bool = True
    norm: str = "tokens"
    correctness_index: int | str | None = None
    success_threshold: float = 0.5

    def needs_old_logps(self) -> bool:
        return False

    def advantages(self, rewards, weights, complete, lengths, num_generations, max_length, seq_logp_old=None):
        """`(N, K)` rewards -> `(kept as 0/1 (N,), kept (N,) bool, metrics)`."""
        correct = success_indicator(rewards, weights, self.correctness_index, self.success_threshold)
        keep = onpolicy_sft_keep(correct, complete, self.require_eos)
        return keep.float(), keep, {"kept_frac": keep.float().mean().item()}

    def loss(self, per_token_logps, mask, advantages, old_per_token_logps, accumulation, step_tokens, max_length):
        """``step_tokens``: kept tokens of the optimizer step per process (TRL's `dapo` normaliser)."""
        normalizer = step_tokens if self.norm == "tokens" else mask.shape[0] * max_length * accumulation
        loss, parts = onpolicy_sft_loss(per_token_logps, mask, normalizer)
        return loss, parts["policy_loss"], {}


def _groups(x: torch.Tensor, num_generations: int) -> torch.Tensor:
    if num_generations < 1 or x.shape[0] % num_generations:
        raise ValueError(f"{x.shape[0]} completions do not form groups of num_generations={num_generations}.")
    return x.reshape(-1, num_generations)


# Loss modes in their own modules register when this one is imported, after the modes above (the order of the
# choices): the registry never depends on the order in which users import modules.
from . import ess as _ess  # noqa: E402, F401
from . import stable_reinforce as _stable_reinforce  # noqa: E402, F401
