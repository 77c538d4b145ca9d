"""ESS-adaptive policy loss (``loss_mode="ess"``): a policy gradient whose importance weights are capped at the
effective sample size of the batch, plus a KL to the behaviour policy weighted by how far the batch is off-policy.

Fakoor, Chaudhari and Smola, *P3O: Policy-on Policy-off Policy Optimization* (arXiv 1905.01756), as the FeynRL
project implements it for LLMs (``algs/P3O/p3o.py``: ``calculate_ess``, ``compute_policy_loss``; read to match the
behaviour, not copied). With valid-token mask ``m``, current log-probs ``ℓ``, behaviour log-probs ``ℓ_b`` and
advantages ``A``:

* ``w = exp(ℓ − ℓ_b)`` on valid tokens (masked positions get log-ratio 0 and are left out of every sum);
* ``ESS = (Σw)² / (n·Σw²) ∈ [1/n, 1]`` over the valid tokens of the micro-batch on every process (one all-reduce of
  ``[Σw, Σw², n]`` in float64; 1 when ``n = 0`` or a sum is not finite), or per sequence with ``level="sequence"``;
* ``ρ = clamp(w, 0, ESS)``, detached;
* per-token loss ``−ρ·A·ℓ + (1 − ESS)·KL_k3``, ``KL_k3 = (ℓ − ℓ_b) + exp(clamp(ℓ_b − ℓ, −10, 10)) − 1``, in fp32;
* times TRL's vLLM importance-sampling ratio when the trainer has one, plus ``β·KL_k3(π_θ‖π_ref)`` (TRL's reference
  KL, times ``exp(ℓ − ℓ_old)`` under TRL's ``use_bias_correction_kl``), summed over valid tokens and divided by
  the step's token count (TRL's ``dapo`` normaliser).

On-policy (``w ≡ 1``) ESS is 1, ``ρ = 1`` and the loss is REINFORCE ``−A·ℓ``, whose gradient is GRPO's at ratio 1.
The loss only differs from GRPO's when the data is stale (``num_iterations > 1``, a generation batch spread over
several optimizer steps, a vLLM sampler).

Behaviour policy: with TRL's vLLM importance-sampling correction on, ``old_per_token_logps`` (the trainer's own
recomputation; the sampler mismatch is TRL's ratio's job); otherwise the sampler's ``sampling_per_token_logps`` when
present (ESS then absorbs the mismatch), else ``old_per_token_logps``, else ``ℓ`` detached (on-policy).

Pure torch. The trainer seam that hands the mode the batch's extra tensors (reference and sampler log-probs, TRL's
IS ratio) and logs its metrics ``stable/ess/{value,kl_behavior,capped_frac}`` is
`hf_stable.trainers.loss_inputs.LossModeInputsMixin`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .._validation import choice
from ..papers import PAPERS
from ..registry import Field, Requires
from .advantages import trl_advantages
from .loss_modes import LOSS_MODES


__all__ = [
    "ESSMode",
    "effective_sample_size",
    "ess_policy_loss",
    "ess_sums",
    "k3_kl",
    "sequence_ess",
]

_KL_CLAMP = 10.0


def _log_ratio(per_token_logps: torch.Tensor, behavior_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask > 0, per_token_logps.float() - behavior_logps.float(), 0.0)


def ess_sums(per_token_logps: torch.Tensor, behavior_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[Σw, Σw², n]`` over the valid tokens, float64. `(B, T) x3 -> (3,)`."""
    valid = mask > 0
    w = torch.exp(_log_ratio(per_token_logps, behavior_logps, mask).detach().double())
    w = torch.where(valid, w, 0.0)
    return torch.stack([w.sum(), (w * w).sum(), valid.sum().double()])


def effective_sample_size(sums: torch.Tensor) -> float:
    """``(Σw)² / (n·Σw²)`` from ``[Σw, Σw², n]``; 1.0 when ``n = 0`` or a sum is not finite."""
    total, squares, n = (float(x) for x in sums)
    if n <= 0 or squares <= 0 or not all(math.isfinite(x) for x in (total, squares, n)):
        return 1.0
    return min(1.0, total * total / (n * squares))


def sequence_ess(per_token_logps: torch.Tensor, behavior_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence ESS ``(Σ_t w)² / (n_i·Σ_t w²)``, 1 for sequences without valid tokens or non-finite sums.
    `(B, T) x3 -> (B, 1)`."""
    valid = mask > 0
    w = torch.where(valid, torch.exp(_log_ratio(per_token_logps, behavior_logps, mask).detach().double()), 0.0)
    total, squares, n = w.sum(-1), (w * w).sum(-1), valid.sum(-1).double()
    ess = total * total / (n * squares)
    ok = (n > 0) & torch.isfinite(ess) & (squares > 0)
    return torch.where(ok, ess.clamp(max=1.0), 1.0).float().unsqueeze(-1)


def k3_kl(logps: torch.Tensor, other_logps: torch.Tensor) -> torch.Tensor:
    """``KL_k3(π‖π_other)`` per token: ``(ℓ − ℓ_o) + exp(clamp(ℓ_o − ℓ, −10, 10)) − 1``, fp32. `(B, T) -> (B, T)`."""
    diff = other_logps.float() - logps.float()
    return -diff + torch.exp(diff.clamp(-_KL_CLAMP, _KL_CLAMP)) - 1.0


def ess_policy_loss(
    per_token_logps: torch.Tensor,
    behavior_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ess: float | torch.Tensor,
    normalizer: float | torch.Tensor,
    ref_per_token_logps: torch.Tensor | None = None,
    beta: float = 0.0,
    is_weights: torch.Tensor | None = None,
    ref_kl_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The ESS-adaptive loss of one micro-batch (module docstring).

    Args:
        per_token_logps (`torch.Tensor` of shape `(B, T)`): ``ℓ``, with grad.
        behavior_logps (`torch.Tensor` of shape `(B, T)`): ``ℓ_b``.
        advantages (`torch.Tensor` of shape `(B,)` or `(B, T)`): ``A`` (detached).
        mask (`torch.Tensor` of shape `(B, T)`): valid completion tokens.
        ess (`float` or `torch.Tensor` of shape `(B, 1)`): the batch ESS, or per-sequence values.
        normalizer: the step's token count (per process and accumulation window).
        ref_per_token_logps (`torch.Tensor` of shape `(B, T)`, *optional*): the reference model's, for ``beta > 0``.
        is_weights (`torch.Tensor` of shape `(B, T)`, *optional*): TRL's vLLM importance-sampling ratio.
        ref_kl_weights (`torch.Tensor` of shape `(B, T)`, *optional*): weights of the reference KL per token (TRL's
            ``use_bias_correction_kl``: ``exp(ℓ − ℓ_old)``, with its gradient).

    Returns:
        `(loss, {"policy_loss", "kl_behavior", "capped_frac", "value"})`, the metrics detached (means over valid
        tokens; ``value`` the mean ESS).
    """
    valid = mask > 0
    maskf = valid.float()
    logps = per_token_logps.float()
    w = torch.exp(_log_ratio(per_token_logps, behavior_logps, mask)).detach()
    ess_t = torch.as_tensor(ess, dtype=torch.float32, device=logps.device)
    rho = torch.minimum(w, ess_t).clamp(min=0.0)
    adv = advantages.detach().float()
    adv = adv.unsqueeze(1) if adv.dim() == 1 else adv
    kl_behavior = torch.where(valid, k3_kl(logps, behavior_logps), 0.0)
    per_token = -rho * adv * logps + (1.0 - ess_t) * kl_behavior
    if is_weights is not None:
        per_token = per_token * is_weights.float()
    normalizer = torch.as_tensor(normalizer, dtype=torch.float32, device=logps.device).clamp(min=1.0)
    policy = (per_token * maskf).sum() / normalizer
    loss = policy
    if beta != 0.0:
        if ref_per_token_logps is None:
            raise ValueError("beta != 0 needs the reference model's log-probs (`ref_per_token_logps`).")
        kl_ref = k3_kl(logps, ref_per_token_logps)
        if ref_kl_weights is not None:
            kl_ref = kl_ref * ref_kl_weights
        loss = loss + beta * (kl_ref * maskf).sum() / normalizer
    count = maskf.sum().clamp(min=1.0)
    metrics = {
        "policy_loss": policy.detach(),
        "kl_behavior": (kl_behavior.detach() * maskf).sum() / count,
        "capped_frac": ((w > ess_t) & valid).float().sum() / count,
        "value": ess_t.mean(),
    }
    return loss, metrics


def _all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def _fixed(option: str, default, why: str, present_only: bool = False) -> Requires:
    """``option`` must keep its TRL default (``present_only``: only where the installed TRL has it)."""
    when = (lambda args: hasattr(args, option)) if present_only else None
    return Requires(option, lambda value: value == default, why, fix=default, when=when)


_ESS_REQUIRES = (
    _fixed("loss_type", "dapo", "the ESS loss is normalised by the step's token count, TRL's dapo normaliser"),
    _fixed("epsilon", 0.2, "no ratio clipping: ESS caps the weights"),
    _fixed("epsilon_high", None, "no ratio clipping: ESS caps the weights"),
    _fixed("delta", None, "no two-sided clipping: ESS caps the weights"),
    _fixed("importance_sampling_level", "token", "ESS weights are per token"),
    _fixed("top_entropy_quantile", 1.0, "the entropy mask is not applied by the ESS loss"),
    _fixed("entropy_coef", 0.0, "the entropy bonus is not applied by the ESS loss", present_only=True),
    _fixed("use_adaptive_entropy", False, "the entropy bonus is not applied by the ESS loss", present_only=True),
    _fixed("off_policy_mask_threshold", None, "off-policy masking is not applied: ESS caps instead", True),
    _fixed("use_liger_kernel", False, "Liger bypasses `_compute_loss`"),
    _fixed("advantage_estimator", "grpo", "the ESS loss uses GRPO's advantages"),
    _fixed("delta_l_alpha", None, "the ESS loss has its own normalisation"),
)


@LOSS_MODES.register(
    "ess",
    paper=PAPERS["p3o"],
    description="ESS-adaptive policy loss (P3O)",
    fields=[
        Field(
            "ess_level",
            "batch",
            '`"batch"` (one ESS over the micro-batch on every process) or `"sequence"` (one per completion).',
            check=choice("batch", "sequence"),
            param="level",
        )
    ],
    reads={
        "beta": "beta",
        "scale": "scale_rewards",
        "aggregation": "multi_objective_aggregation",
        "bias_correction_kl": "use_bias_correction_kl",
    },
    requires=_ESS_REQUIRES,
    honours=(
        "beta",
        "scale_rewards",
        "multi_objective_aggregation",
        "mask_truncated_completions",
        "num_iterations",
        "vllm_importance_sampling_correction",
        "use_bias_correction_kl",
    ),
)
@dataclass
class ESSMode:
    """ESS-adaptive policy loss (P3O, arXiv 1905.01756) as a loss mode: TRL's advantages (``sum_then_normalize``
    with ``scale_rewards``, or GDPO's ``normalize_then_sum``), then [`ess_policy_loss`] per micro-batch."""

    weights_sampling = True  # `ess_policy_loss` applies TRL's vLLM ratio itself (`is_weights`)
    level: str = "batch"
    beta: float = 0.0
    scale: str = "group"
    aggregation: str = "sum_then_normalize"
    bias_correction_kl: bool = False
    # the batch's extra tensors, handed over by `LossModeInputsMixin` for the duration of one `compute_loss`
    _inputs: dict | None = None
    _metrics: dict | None = None

    def needs_old_logps(self) -> bool:
        return False

    def bind_inputs(self, inputs: dict | None) -> None:
        self._inputs = inputs

    def pop_metrics(self) -> dict[str, torch.Tensor]:
        metrics, self._metrics = self._metrics or {}, None
        return {f"stable/ess/{k}": v for k, v in metrics.items() if k != "policy_loss"}

    def advantages(self, rewards, weights, complete, lengths, num_generations, max_length, seq_logp_old=None):
        """`(N, K)` rewards -> `(GRPO advantages (N,), None, {})`."""
        advantages = trl_advantages(
            rewards, lengths, num_generations, weights.to(rewards), self.scale, self.aggregation
        )
        return advantages, None, {}

    def loss(self, per_token_logps, mask, advantages, old_per_token_logps, accumulation, step_tokens, max_length):
        """``step_tokens``: the step's loss tokens per process and accumulation window (TRL's `dapo` normaliser)."""
        inputs = self._inputs or {}
        is_weights = inputs.get("importance_sampling_ratio")
        behavior = old_per_token_logps
        if is_weights is None and inputs.get("sampling_per_token_logps") is not None:
            behavior = inputs["sampling_per_token_logps"]
        if behavior is None:
            behavior = per_token_logps.detach()
        if self.level == "batch":
            ess = effective_sample_size(_all_reduce_sum(ess_sums(per_token_logps, behavior, mask)))
        else:
            ess = sequence_ess(per_token_logps, behavior, mask)
        loss, metrics = ess_policy_loss(
            per_token_logps,
            behavior,
            advantages,
            mask,
            ess,
            step_tokens,
            ref_per_token_logps=inputs.get("ref_per_token_logps"),
            beta=self.beta,
            is_weights=is_weights,
            ref_kl_weights=self._ref_kl_weights(per_token_logps, old_per_token_logps),
        )
        self._metrics = metrics
        return loss, metrics["policy_loss"], {}

    def _ref_kl_weights(self, per_token_logps, old_per_token_logps):
        """TRL's ``use_bias_correction_kl``: the reference KL times ``exp(ℓ − ℓ_old)`` (with its gradient)."""
        if not self.bias_correction_kl or self.beta == 0.0:
            return None
        old = per_token_logps.detach() if old_per_token_logps is None else old_per_token_logps
        return torch.exp(per_token_logps.float() - old.float())

