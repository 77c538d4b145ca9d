"""StableReinforce's loss and advantage filter (Zhang et al., *R1-Reward: Training Multimodal Reward Model Through
Stable Reinforcement Learning*, arXiv 2505.02835): ``loss_mode="stable_reinforce"`` and
``advantage_filter_sigma=3.0``. Its third part, the consistency reward, is
`hf_stable.rewards.stable_reinforce.StableReinforceReward`.

Followed from the authors' code (`yfzhang114/r1_reward`, read to match the behaviour, not copied):

* **Pre-clip** (``openrlhf/models/loss.py: PolicyLoss.forward``): the log-ratio ``ℓ − ℓ_old`` is clamped to
  ``[−log δ, log δ]`` *before* it is exponentiated, then PPO's clipped surrogate runs on ``r = exp(clamped)``; the
  code's bound is ``δ = 1e3``. A token whose log-ratio is clamped has no gradient through its ratio, so a huge ratio
  on a negative advantage (where PPO's ``min`` keeps the unclipped ``r·A``) can no longer blow the loss up.
* **Advantage filter** (``openrlhf/trainer/ppo_utils/replay_buffer.py: NaiveReplayBuffer.normalize``): the
  advantages of the whole batch are standardised with their token-weighted mean and standard deviation (each
  completion counts once per completion token; the variance floored at 1e-8) and every standardised value outside
  ``[−k, k]`` (the 3-sigma rule, ``k = 3``) or not finite is set to 0; the kept values are the standardised ones.
  The code compares the standardised value with ``μ ± 3`` (``μ`` the raw mean) and also zeroes ``|Â| > 10``; we
  keep ``|Â| ≤ k``, the 3-sigma rule on standardised advantages that the paper names (its text was not available to
  us, only its abstract and secondary summaries), which is the code's rule whenever ``μ = 0`` and ``k ≤ 10``, and we
  leave out the code's ``+1e-8`` offset.

Reconstructed (ours, not in the paper, which trains REINFORCE++ in OpenRLHF): the pre-clip is applied to TRL's
importance weight at its ``importance_sampling_level`` and composed with TRL's PPO options (``epsilon``,
``epsilon_high``, ``delta``, ``beta``, ``use_bias_correction_kl``, the vLLM importance-sampling ratio) and its
normalisers for ``loss_type`` in ``grpo``/``bnpo``/``dr_grpo``/``dapo``, exactly as TRL's ``_compute_loss``
(``trl/trainer/grpo_trainer.py``) applies them, so that with a bound no ratio reaches the loss equals TRL's; the
advantages are GRPO's (TRL's ``scale_rewards``). The filter acts on whatever advantages the trainer ends up with
(TRL's, an estimator's or a loss mode's), over the gathered generation batch.

Pure torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .._validation import number
from ..papers import PAPERS
from ..registry import Field, Registry, Requires
from .advantages import trl_advantages
from .loss_modes import LOSS_MODES


__all__ = [
    "ADVANTAGE_FILTERS",
    "PPO_LOSS_TYPES",
    "StableReinforceMode",
    "preclip_log_ratio",
    "preclip_ppo_loss",
    "reduce_token_loss",
    "sigma_filter",
]

PPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")  # TRL's loss types built on the PPO-clip surrogate
_VAR_FLOOR = 1e-8  # the reference code's floor on the variance before `rsqrt`


def preclip_log_ratio(log_ratio: torch.Tensor, bound: float) -> torch.Tensor:
    """StableReinforce's pre-clip: ``clamp(log_ratio, −log δ, log δ)`` with ``δ = bound > 1``. Any shape."""
    if not bound > 1.0:
        raise ValueError(f"bound must be > 1, got {bound}.")
    limit = math.log(bound)
    return log_ratio.clamp(-limit, limit)


def preclip_ppo_loss(
    per_token_logps: torch.Tensor,
    old_per_token_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    bound: float = 1e3,
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    level: str = "token",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate on the pre-clipped ratio, per token (no KL, no normaliser).

    ``r = exp(clamp(w, −log δ, log δ))`` with ``w = ℓ − ℓ_old`` (``level="token"``) or its masked mean over the
    completion (``"sequence"``, TRL's GSPO weight); then ``−min(r'·A, clamp(r, 1−ε_low, 1+ε_high)·A)`` with
    ``r' = min(r, delta)`` when ``delta`` is set (TRL's two-sided clipping), else ``r``.

    Args:
        per_token_logps (`torch.Tensor` of shape `(B, T)`): ``ℓ``, with grad.
        old_per_token_logps (`torch.Tensor` of shape `(B, T)`, *optional*): ``ℓ_old``; ``None``: ``ℓ`` detached.
        advantages (`torch.Tensor` of shape `(B,)` or `(B, T)`): ``A`` (detached).
        mask (`torch.Tensor` of shape `(B, T)`): completion tokens in the loss.
        bound (`float` > 1): ``δ``.

    Returns:
        `(per_token_loss (B, T), ratio, preclipped)`: the ratio ``r`` (`(B, T)`, or `(B, 1)` at sequence level) and a
        bool tensor of its shape, true where the pre-clip bound.
    """
    if level not in ("token", "sequence"):
        raise ValueError(f"level must be 'token' or 'sequence', got {level!r}.")
    logps = per_token_logps.float()
    old = logps.detach() if old_per_token_logps is None else old_per_token_logps.float()
    log_ratio = logps - old
    if level == "sequence":
        maskf = mask.float()
        log_ratio = ((log_ratio * maskf).sum(-1) / maskf.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    clipped = preclip_log_ratio(log_ratio, bound)
    ratio = torch.exp(clipped)
    high = epsilon_low if epsilon_high is None else epsilon_high
    adv = advantages.detach().float()
    adv = adv.unsqueeze(1) if adv.dim() == 1 else adv
    bounded = ratio.clamp(1 - epsilon_low, 1 + high)
    unclipped = ratio if delta is None else ratio.clamp(max=delta)
    per_token = -torch.min(unclipped * adv, bounded * adv)
    return per_token, ratio, (clipped != log_ratio).detach()


def reduce_token_loss(
    per_token_loss: torch.Tensor,
    mask: torch.Tensor,
    loss_type: str,
    accumulation: float,
    step_tokens: float | torch.Tensor,
    max_length: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's normaliser for ``loss_type`` (``trl/trainer/grpo_trainer.py: _compute_loss``), `(B, T) -> ()`.

    ``grpo``: mean over completions of each one's token mean; ``bnpo``: mean over the micro-batch's tokens;
    ``dr_grpo``: sum over ``B · max_length``; all three divided by ``accumulation``. ``dapo``: sum over
    ``step_tokens`` (the step's loss tokens per process and accumulation window). Returns `(loss, policy_loss)`, the
    second before the division by ``accumulation``, as TRL logs it.
    """
    maskf = mask.float()
    masked = per_token_loss * maskf
    if loss_type == "grpo":
        loss = (masked.sum(-1) / maskf.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = masked.sum() / maskf.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        loss = masked.sum() / (per_token_loss.size(0) * max_length)
    elif loss_type == "dapo":
        normalizer = torch.as_tensor(step_tokens, dtype=torch.float32, device=masked.device).clamp(min=1e-8)
        loss = masked.sum() / normalizer
        return loss, loss.detach()
    else:
        raise ValueError(f"loss_type must be one of {PPO_LOSS_TYPES}, got {loss_type!r}.")
    return loss / accumulation, loss.detach()


def _fixed(option: str, default, why: str, present_only: bool = False) -> Requires:
    when = (lambda args: hasattr(args, option)) if present_only else None
    return Requires(
        option, lambda value: value == default, f"{why}; leave {option}={default!r}", fix=default, when=when
    )


_SR_REQUIRES = (
    Requires(
        "loss_type",
        lambda value: value in PPO_LOSS_TYPES,
        f"the pre-clip applies to TRL's PPO-clip surrogate, whose loss types are {', '.join(PPO_LOSS_TYPES)}",
        fix="dapo",
    ),
    _fixed("top_entropy_quantile", 1.0, "the loss mode trains on every token (no entropy mask)"),
    _fixed("entropy_coef", 0.0, "the loss mode has no entropy bonus", present_only=True),
    _fixed("use_adaptive_entropy", False, "the loss mode has no entropy bonus", present_only=True),
    _fixed("off_policy_mask_threshold", None, "the loss mode has no off-policy sequence mask", present_only=True),
    _fixed("use_liger_kernel", False, "Liger's fused loss bypasses `_compute_loss`"),
    _fixed("advantage_estimator", "grpo", "the loss mode uses GRPO's advantages"),
)


@LOSS_MODES.register(
    "stable_reinforce",
    paper=PAPERS["r1_reward"],
    description="PPO-clip on the ratio pre-clipped to [1/δ, δ] before the exponential (StableReinforce)",
    fields=[
        Field(
            "sr_ratio_bound",
            1e3,
            "δ of StableReinforce's pre-clip: the log-ratio is clamped to [-log δ, log δ] before `exp` (the "
            "reference code's 1e3).",
            check=number(low=1, low_open=True),
            param="bound",
        )
    ],
    reads={
        "epsilon_low": "epsilon",
        "epsilon_high": "epsilon_high",
        "delta": "delta",
        "level": "importance_sampling_level",
        "loss_type": "loss_type",
        "beta": "beta",
        "bias_correction_kl": "use_bias_correction_kl",
        "scale": "scale_rewards",
        "aggregation": "multi_objective_aggregation",
    },
    requires=_SR_REQUIRES,
    honours=(
        "epsilon",
        "epsilon_high",
        "delta",
        "importance_sampling_level",
        "beta",
        "use_bias_correction_kl",
        "scale_rewards",
        "multi_objective_aggregation",
        "mask_truncated_completions",
        "num_iterations",
        "steps_per_generation",
        "vllm_importance_sampling_correction",
        "router_aux_loss_coef",
    ),
)
@dataclass
class StableReinforceMode:
    """StableReinforce's refined surrogate (arXiv 2505.02835) as a loss mode: TRL's advantages (either
    `multi_objective_aggregation`), then [`preclip_ppo_loss`] with TRL's reference KL, vLLM ratio and normaliser per
    micro-batch."""

    weights_sampling = True  # TRL's vLLM ratio multiplies the per-token loss here, before the KL, as in TRL
    bound: float = 1e3
    epsilon_low: float = 0.2
    epsilon_high: float | None = None
    delta: float | None = None
    level: str = "token"
    loss_type: str = "dapo"
    beta: float = 0.0
    bias_correction_kl: bool = False
    scale: str = "group"
    aggregation: str = "sum_then_normalize"
    _inputs: dict | None = None

    def needs_old_logps(self) -> bool:
        return False

    def bind_inputs(self, inputs: dict | None) -> None:
        self._inputs = inputs

    def pop_metrics(self) -> dict[str, torch.Tensor]:
        return {}  # logged through `loss`'s parts

    def advantages(self, rewards, weights, complete, lengths, num_generations, max_length, seq_logp_old=None):
        """`(N, K)` rewards -> `(GRPO advantages (N,), None, {})`."""
        advantages = trl_advantages(
            rewards, lengths, num_generations, weights.to(rewards), self.scale, self.aggregation
        )
        return advantages, None, {}

    def loss(self, per_token_logps, mask, advantages, old_per_token_logps, accumulation, step_tokens, max_length):
        """`(B, T)` log-probs/mask, `(B,)` advantages -> `(loss, policy loss, {"preclipped_frac"})`."""
        inputs = self._inputs or {}
        per_token, ratio, preclipped = preclip_ppo_loss(
            per_token_logps,
            old_per_token_logps,
            advantages,
            mask,
            self.bound,
            self.epsilon_low,
            self.epsilon_high,
            self.delta,
            self.level,
        )
        if inputs.get("importance_sampling_ratio") is not None:
            per_token = per_token * inputs["importance_sampling_ratio"].float()
        if self.beta != 0.0:
            ref = inputs.get("ref_per_token_logps")
            if ref is None:
                raise ValueError("beta != 0 needs the reference model's log-probs (`ref_per_token_logps`).")
            diff = ref.float() - per_token_logps.float()
            kl = torch.exp(diff) - diff - 1
            if self.bias_correction_kl:
                kl = kl * ratio
            per_token = per_token + self.beta * kl
        loss, policy_loss = reduce_token_loss(per_token, mask, self.loss_type, accumulation, step_tokens, max_length)
        valid = mask > 0 if preclipped.shape == mask.shape else (mask > 0).any(-1, keepdim=True)
        frac = (preclipped & valid).float().sum() / valid.float().sum().clamp(min=1.0)
        return loss, policy_loss, {"preclipped_frac": frac}


# ---------------------------------------------------------------------------------------------------------------------
# advantage filters: transforms of the final advantages of a generation batch

# A switch: setting `advantage_filter_sigma` (the k of the k-sigma rule, which the filter reads) turns it on.
ADVANTAGE_FILTERS = Registry(
    "advantage_filter",
    "transforms of the final advantages of a generation batch",
    selector="advantage_filter_sigma",
    enable=3.0,
    selector_check=number(low=0, low_open=True, allow_none=True),
)


@ADVANTAGE_FILTERS.register(
    "sigma_filter",
    paper=PAPERS["r1_reward"],
    description="standardise the batch's advantages and zero those beyond k sigma (StableReinforce's filter)",
    reads={"sigma": "advantage_filter_sigma"},
    requires=[
        Requires(
            "loss_mode",
            lambda value: value in ("ppo", "ess", "stable_reinforce"),
            "drpo's and onpolicy_sft's per-sample coefficients are not advantages to standardise; use loss_mode "
            "'ppo', 'ess' or 'stable_reinforce'",
            fix="ppo",
        )
    ],
)
def sigma_filter(
    advantages: torch.Tensor, lengths: torch.Tensor | None = None, sigma: float = 3.0
) -> tuple[torch.Tensor, dict[str, float]]:
    """StableReinforce's advantage filter (module docstring): ``Â = (A − μ)/σ``, 0 where ``|Â| > k`` or not finite.

    Args:
        advantages (`torch.Tensor` of shape `(N,)`): the generation batch's advantages (NaN rows are left out of the
            statistics and get 0).
        lengths (`torch.Tensor` of shape `(N,)`, *optional*): each completion's loss tokens, its weight in ``μ`` and
            ``σ`` (the reference code's token-level statistics); ``None``, or no token at all: one weight each.
        sigma (`float` > 0): ``k``.

    Returns:
        `(filtered (N,) float32, {"filtered_frac", "mean", "std"})` with ``σ = sqrt(max(var, 1e-8))``, in float64.
    """
    if not sigma > 0:
        raise ValueError(f"sigma must be > 0, got {sigma}.")
    a = advantages.double().reshape(-1)
    finite = torch.isfinite(a)
    w = torch.ones_like(a) if lengths is None else lengths.double().reshape(-1).clamp(min=0)
    w = torch.where(finite, w, 0.0)
    if w.sum() <= 0:
        w = finite.double()
    total = w.sum().clamp(min=1e-300)
    values = torch.where(finite, a, 0.0)
    mean = (w * values).sum() / total
    var = (w * (values - mean) ** 2).sum() / total
    std = var.clamp(min=_VAR_FLOOR).sqrt()
    z = (values - mean) / std
    keep = finite & (z.abs() <= sigma)
    out = torch.where(keep, z, 0.0).to(torch.float32)
    metrics = {"filtered_frac": 1.0 - keep.double().mean().item(), "mean": mean.item(), "std": std.item()}
    return out, metrics
