"""Group advantage estimators for GRPO-style training: pure torch functions of the rewards of a generation batch.

Every estimator has the signature

    estimator(rewards, lengths, num_generations, weights, **params) -> (advantages, metrics)

* ``rewards`` `(N, K)`: one column per reward function, `N = B·G` completions of `B` prompts in consecutive groups of
  `G = num_generations` (TRL's layout). NaN marks a reward function that did not apply; a row that is NaN everywhere
  is unscorable and gets advantage 0 (TRL's rule).
* ``lengths`` `(N,)`: completion lengths (tokens in the loss mask); 0 for empty or masked completions.
* ``weights`` `(K,)`: the reward weights (TRL's `reward_weights`, possibly adapted by a controller).
* returns ``advantages`` `(N,)` fp32, finite everywhere, and a dict of scalar metrics.

Edge cases every estimator handles: a group of one (`G = 1`), groups with equal rewards, NaN rewards, empty
completions. Statistics are computed in fp32 (fp64 where a product of many factors is formed).
"""

from __future__ import annotations

import math

import torch

from .._validation import boolean, choice, integer, number
from ..papers import PAPERS
from ..registry import Field, Registry, Requires


# "grpo" is TRL's own advantage, left untouched by the trainer ([`grpo_advantages`] is its pure equivalent).
ADVANTAGE_ESTIMATORS = Registry("advantage_estimator", "group advantage estimators (GRPO variants)", builtin=("grpo",))

# `correctness_reward_index="sum"`: successes from the weighted sum of every reward (format and length included)
SUM_OF_REWARDS = "sum"


def check_correctness_index(
    name: str, value, num_rewards: int | None = None, where: str | None = None, required: bool = True
) -> None:
    """``value`` is ``None``, ``"sum"`` or a reward column in ``[0, num_rewards - 1]``; with several reward functions
    (``num_rewards > 1``) and a method that counts successes (``required``), ``None`` is refused: success would
    silently mix every reward."""
    if value == SUM_OF_REWARDS:
        return
    high = None if num_rewards is None else num_rewards - 1
    if value is None and required and num_rewards is not None and num_rewards > 1:
        raise ValueError(
            f"`{name}` is required with {num_rewards} reward functions: give the column of the reward that decides "
            f"correctness (0..{high}), or {SUM_OF_REWARDS!r} to binarise the weighted sum of all rewards."
        )
    try:
        integer(low=0, high=high, allow_none=True)(name, value, where)
    except ValueError:
        raise ValueError(
            f"`{name}` must be a reward column in [0, {'inf' if high is None else high}], {SUM_OF_REWARDS!r} or "
            f"None, got {value!r}."
        ) from None


# Read by the estimators and loss modes that count successes (sgrpo, maxrl, drpo, onpolicy_sft).
CORRECTNESS_FIELDS = (
    Field(
        "correctness_reward_index",
        None,
        "Reward function that decides correctness (its column in `reward_funcs`); required with several reward "
        'functions, `"sum"` binarises the weighted sum of all rewards; `None` with one reward function uses it.',
        check=check_correctness_index,
        param="correctness_index",
        type=int | str | None,
    ),
    Field(
        "success_threshold",
        0.5,
        "A completion is correct when that reward exceeds this value.",
        check=number(),
        param="success_threshold",
    ),
)


def _own_aggregation(why: str) -> Requires:
    """GDPO's `normalize_then_sum` refused by an estimator whose maths it does not compose with, saying why."""
    return Requires(
        "multi_objective_aggregation",
        lambda value: value == "sum_then_normalize",
        f"{why}; keep multi_objective_aggregation='sum_then_normalize'",
        fix="sum_then_normalize",
    )


# for an estimator that aggregates the K rewards itself and has not said how it composes with GDPO
_OWN_AGGREGATION = _own_aggregation("the estimator aggregates the rewards itself")
# for an estimator that does not read TRL's `scale_rewards` (sgrpo does: its base is TRL's advantage)
_OWN_SCALE = Requires(
    "scale_rewards",
    lambda value: value == "group",
    "the estimator does not read scale_rewards; leave it at 'group'",
    fix="group",
)

# TRL's epsilon in (R - mean) / (std + eps) (`GRPOTrainer._generate_and_score_completions`)
TRL_STD_EPS = 1e-4


def nanstd(x: torch.Tensor, dim: int, keepdim: bool = False) -> torch.Tensor:
    """Bessel-corrected std ignoring NaNs; NaN where fewer than two values (`trl.trainer.utils.nanstd`)."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True)
    var = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True) * count / (count - 1).clamp(min=1)
    var = torch.where(count > 1, var, torch.full_like(var, math.nan))
    std = var.sqrt()
    return std if keepdim else std.squeeze(dim)


def scalar_rewards(rewards: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted sum over reward functions, NaN-aware; rows with no valid reward stay NaN. `(N, K) -> (N,)`."""
    rewards = rewards.float()
    total = (rewards * weights.to(rewards).unsqueeze(0)).nansum(dim=1)
    return torch.where(torch.isnan(rewards).all(dim=1), torch.full_like(total, math.nan), total)


def success_indicator(
    rewards: torch.Tensor, weights: torch.Tensor, correctness_index: int | str | None, threshold: float
) -> torch.Tensor:
    """Binary correctness `(N,)`: 1 where the chosen reward exceeds ``threshold``, 0 below, NaN where unscored.

    ``correctness_index`` selects one reward column (e.g. the verifier, not a format reward); ``"sum"`` uses the
    weighted sum of every column; ``None`` the only column (refused with several: a format or length reward would
    count towards correctness).
    """
    if correctness_index is None:
        check_correctness_index("correctness_reward_index", None, rewards.shape[1])
        correctness_index = 0
    if correctness_index == SUM_OF_REWARDS:
        score = scalar_rewards(rewards, weights)
    else:
        score = rewards[:, correctness_index].float()
    return torch.where(torch.isnan(score), score, (score > threshold).float())


def _groups(x: torch.Tensor, num_generations: int) -> torch.Tensor:
    if num_generations < 1 or x.shape[0] % num_generations:
        raise ValueError(f"{x.shape[0]} completions do not form groups of num_generations={num_generations}.")
    return x.reshape(-1, num_generations, *x.shape[1:])


def _finish(advantages: torch.Tensor) -> torch.Tensor:
    return torch.nan_to_num(advantages.float(), nan=0.0, posinf=0.0, neginf=0.0)


def _no_spread(grouped: torch.Tensor) -> torch.Tensor:
    """`(B, G) -> (B, 1)`: True where all scored entries of a group are equal (or there are fewer than two)."""
    low = torch.where(torch.isnan(grouped), torch.inf, grouped).amin(dim=1, keepdim=True)
    high = torch.where(torch.isnan(grouped), -torch.inf, grouped).amax(dim=1, keepdim=True)
    return ~(high > low)


def group_zscore(scores: torch.Tensor, num_generations: int, scale: str = "group") -> torch.Tensor:
    """TRL's advantage: `(R - group mean) / (std + 1e-4)`, std of the group (`"group"`), of the batch (`"batch"`) or
    none (`"none"`); NaN-aware, Bessel-corrected, 0 for groups of one. `(N,) -> (N,)`."""
    grouped = _groups(scores.float(), num_generations)
    centred = grouped - torch.nanmean(grouped, dim=1, keepdim=True)
    # a group without spread gets exactly 0: its fp32 mean can be an ulp off, which `/(std + 1e-4)` would blow up
    # (TRL's inline code keeps that roundoff; this is the one place we differ from it, on degenerate groups only)
    centred = torch.where(_no_spread(grouped), torch.zeros_like(centred), centred)
    if scale == "none":
        return _finish(centred.reshape(-1))
    if scale == "group":
        std = nanstd(grouped, dim=1, keepdim=True) if num_generations > 1 else torch.zeros_like(grouped[:, :1])
    elif scale == "batch":
        std = nanstd(scores.float(), dim=0) if scores.numel() > 1 else torch.zeros(())
    else:
        raise ValueError(f"scale must be 'group', 'batch' or 'none', got {scale!r}.")
    return _finish((centred / (std + TRL_STD_EPS)).reshape(-1))


def grpo_advantages(rewards, lengths, num_generations, weights, scale: str = "group"):
    """GRPO's group-normalised advantage of the weighted reward sum as TRL computes it
    (`multi_objective_aggregation="sum_then_normalize"`; Shao et al., DeepSeekMath, arXiv 2402.03300), except that a
    group whose rewards are all equal gets exactly 0 instead of TRL's amplified roundoff. The trainer's `grpo`
    estimator keeps TRL's own computation; this pure form serves tests and experiments."""
    del lengths
    advantages = group_zscore(scalar_rewards(rewards, weights), num_generations, scale)
    return advantages, {}


# TRL's `multi_objective_aggregation` values: GRPO's z-score of the weighted sum, or GDPO's decoupled normalisation
AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")


def decoupled_sum(rewards: torch.Tensor, weights: torch.Tensor, num_generations: int) -> torch.Tensor:
    """GDPO's reward-decoupled normalisation (Liu et al., arXiv 2601.05242; TRL's `normalize_then_sum`): each reward
    column z-scored within its group (`(r_k - mean_k) / (std_k + 1e-4)`, Bessel-corrected, NaN-aware), then the
    weighted sum `Σ_k w_k z_k`. A NaN entry contributes 0 to the sum; a row NaN in every column stays NaN
    (unscorable). A column without spread in a group gives exactly 0 there ([`group_zscore`]'s one deviation from
    TRL's inline roundoff). `(N, K), (K,) -> (N,)`."""
    rewards = rewards.float()
    z = torch.stack([group_zscore(rewards[:, k], num_generations, "group") for k in range(rewards.shape[1])], dim=1)
    total = (z * weights.to(z).unsqueeze(0)).sum(dim=1)
    return torch.where(torch.isnan(rewards).all(dim=1), torch.full_like(total, math.nan), total)


def batch_zscore(scores: torch.Tensor) -> torch.Tensor:
    """`(s - batch mean) / (batch std + 1e-4)` over the whole generation batch, NaN-aware (NaN rows get 0), as TRL's
    `normalize_then_sum` ends; a batch of one gets 0. `(N,) -> (N,)`."""
    scores = scores.float()
    centred = scores - torch.nanmean(scores)
    std = nanstd(scores, dim=0) if scores.numel() > 1 else torch.zeros(())
    return _finish(centred / (std + TRL_STD_EPS))


def gdpo_advantages(rewards, lengths, num_generations, weights):
    """GDPO's advantage as TRL computes it under `multi_objective_aggregation="normalize_then_sum"` (arXiv
    2601.05242): [`decoupled_sum`] then [`batch_zscore`]. TRL ignores `scale_rewards` there, and so does this.
    `(N, K) -> (N,)`."""
    del lengths
    return batch_zscore(decoupled_sum(rewards, weights, num_generations)), {}


def trl_advantages(rewards, lengths, num_generations, weights, scale="group", aggregation="sum_then_normalize"):
    """TRL's advantage for either `multi_objective_aggregation`: [`grpo_advantages`] (with ``scale``) or
    [`gdpo_advantages`]. `(N, K) -> (N,)`."""
    if aggregation == "normalize_then_sum":
        return gdpo_advantages(rewards, lengths, num_generations, weights)[0]
    if aggregation != "sum_then_normalize":
        raise ValueError(f"multi_objective_aggregation must be one of {AGGREGATIONS}, got {aggregation!r}.")
    return grpo_advantages(rewards, lengths, num_generations, weights, scale)[0]


def sgrpo_weights(successes: torch.Tensor, valid: torch.Tensor, noise_p: float, eps: float = 1e-8) -> torch.Tensor:
    """S-GRPO's optimal shrinkage `w*` per group (arXiv 2508.05928; `shenpeijun0212/S-GRPO: group_weight`).

    Args:
        successes (`torch.Tensor` of shape `(B,)`): observed successes k per group.
        valid (`torch.Tensor` of shape `(B,)`): scored completions per group (G without NaN rows).
        noise_p (`float` in [0, 0.5)): probability that a binary reward is flipped.

    Returns:
        `torch.Tensor` of shape `(B,)`: `(1-2p) t(1-t) / (sqrt(q(1-q)+ε) sqrt(t(1-t)+ε))` with `q = k/G` and
        `t = clip((q-p)/(1-2p), 0, 1)`; 0 for groups a flip could explain (q ≤ p or q ≥ 1-p) and for groups of one.
    """
    if not 0.0 <= noise_p < 0.5:
        raise ValueError(f"noise_p must be in [0, 0.5), got {noise_p}.")
    q = successes.double() / valid.double().clamp(min=1)
    t = ((q - noise_p) / (1 - 2 * noise_p)).clamp(0, 1)
    w = (1 - 2 * noise_p) * t * (1 - t) / (torch.sqrt(q * (1 - q) + eps) * torch.sqrt(t * (1 - t) + eps))
    return torch.where(valid > 1, w, torch.zeros_like(w)).float()


@ADVANTAGE_ESTIMATORS.register(
    "sgrpo",
    paper=PAPERS["sgrpo"],
    description="noise-aware shrinkage of GRPO's advantage",
    fields=[
        Field(
            "sgrpo_noise_p",
            0.1,
            "Assumed probability that a binary reward is flipped, in [0, 0.5). 0 gives back GRPO.",
            check=number(low=0, high=0.5, high_open=True),
            param="noise_p",
        ),
        *CORRECTNESS_FIELDS,
    ],
    reads={"scale": "scale_rewards", "aggregation": "multi_objective_aggregation"},
)
def sgrpo_advantages(
    rewards,
    lengths,
    num_generations,
    weights,
    noise_p: float = 0.1,
    correctness_index: int | str | None = None,
    success_threshold: float = 0.5,
    scale: str = "group",
    aggregation: str = "sum_then_normalize",
):
    """S-GRPO: TRL's advantage times the noise-aware weight `w*` of its group (arXiv 2508.05928).

    Successes are counted on the raw correctness reward (``correctness_index``, or ``"sum"``) binarised at
    ``success_threshold``; the advantage itself is TRL's for ``aggregation`` (the weighted reward's z-score, or
    GDPO's decoupled normalisation: `w*` is a per-group factor computed from the raw rewards, so it composes with
    either). ``noise_p = 0`` gives back GRPO
    (w* = 1 to 1e-8 on mixed groups). Metrics, over mixed groups (some but not all successes — the only ones with an
    advantage to weight): ``zero_weight_frac`` (ignored as explainable by noise) and ``mean_weight``.
    """
    del lengths
    base = trl_advantages(rewards, None, num_generations, weights, scale, aggregation)
    success = _groups(success_indicator(rewards, weights, correctness_index, success_threshold), num_generations)
    valid = (~torch.isnan(success)).sum(dim=1)
    w = sgrpo_weights(torch.nansum(success, dim=1), valid, noise_p)
    advantages = base * w.repeat_interleave(num_generations)
    k = torch.nansum(success, dim=1)
    mixed = (k > 0) & (k < valid)
    metrics = {
        "zero_weight_frac": (w[mixed] == 0).float().mean().item() if mixed.any() else 0.0,
        "mean_weight": w[mixed].mean().item() if mixed.any() else 0.0,
    }
    return _finish(advantages), metrics


def maxrl_coefficient(n: int, k: int, truncation: int | None = None) -> float:
    """`c_T(K) = Σ_{j=1..T} C(N-K, j-1) / C(N-1, j-1)`: the weight that makes `(1/N) Σ_i c_T r_i ∇log π(o_i)`
    unbiased for `∇ Σ_{j≤T} pass@j / j` (MaxRL, arXiv 2602.02710; derivation in `docs/grpo.md`).

    Computed as a running product `term_j = term_{j-1} (N-K-j+2)/(N-j+1)`, which stops at 0. `c_N(K) = N/K`,
    `c_1 = 1`; 0 when there is no success.
    """
    if k <= 0 or n <= 0:
        return 0.0
    t = n if truncation is None else min(truncation, n)
    total, term = 0.0, 1.0
    for j in range(1, t + 1):
        if j > 1:
            term *= (n - k - j + 2) / (n - j + 1)
        if term <= 0:
            break
        total += term
    return total


@ADVANTAGE_ESTIMATORS.register(
    "maxrl",
    paper=PAPERS["maxrl"],
    description="maximum likelihood RL on binary correctness",
    fields=[
        Field(
            "maxrl_truncation",
            None,
            "Compute index T of MaxRL (`None`: T = G, the maximum-likelihood end; 1: Dr. GRPO).",
            check=integer(low=1, allow_none=True),
            param="truncation",
            type=int | None,
        ),
        Field(
            "maxrl_baseline",
            "mean",
            '`"mean"` (group mean baseline) or `"none"`.',
            check=choice("mean", "none"),
            param="baseline",
        ),
        Field(
            "maxrl_adv_clip",
            None,
            "Bound on |A| (a lone success among G gets G-1).",
            check=number(low=0, low_open=True, allow_none=True),
            param="adv_clip",
            type=float | None,
        ),
        *CORRECTNESS_FIELDS,
    ],
    requires=[
        _own_aggregation(
            "MaxRL's advantage c_T(K)(r - mean r) reads only the 0/1 success on the correctness reward, and its "
            "pass@k weights c_T(K) are unbiased only for a 0/1 reward: a normalised sum of rewards is neither"
        ),
        _OWN_SCALE,
    ],
)
def maxrl_advantages(
    rewards,
    lengths,
    num_generations,
    weights,
    truncation: int | None = None,
    baseline: str = "mean",
    adv_clip: float | None = None,
    correctness_index: int | str | None = None,
    success_threshold: float = 0.5,
):
    """MaxRL: `A_i = c_T(K) (r_i - r̄)` on binary correctness (arXiv 2602.02710).

    With ``truncation=None`` (T = G) this is `(r_i - r̄)/r̄`, "divide by the mean instead of the std"; T = 1 is
    Dr. GRPO's `r_i - r̄`. ``baseline="none"`` drops the mean (unbiased for `∇J_T` without a baseline). Groups without
    a success get 0. ``adv_clip`` bounds |A| (a lone success among G gets G-1).
    """
    del lengths
    if baseline not in ("mean", "none"):
        raise ValueError(f"baseline must be 'mean' or 'none', got {baseline!r}.")
    if truncation is not None and truncation < 1:
        raise ValueError(f"truncation must be >= 1 or None, got {truncation}.")
    r = _groups(success_indicator(rewards, weights, correctness_index, success_threshold), num_generations)
    valid = (~torch.isnan(r)).sum(dim=1)
    k = torch.nansum(r, dim=1)
    c = torch.tensor(
        [maxrl_coefficient(int(n), int(s), truncation) for n, s in zip(valid.tolist(), k.tolist(), strict=True)],
        dtype=torch.float32,
        device=r.device,
    )
    centred = r - torch.nanmean(r, dim=1, keepdim=True) if baseline == "mean" else r
    advantages = c[:, None] * centred
    if adv_clip is not None:
        advantages = advantages.clamp(-adv_clip, adv_clip)
    has_success = k > 0
    metrics = {
        "mean_coefficient": c[has_success].mean().item() if has_success.any() else 0.0,
        "frac_groups_no_success": (~has_success).float().mean().item(),
    }
    return _finish(advantages.reshape(-1)), metrics


@ADVANTAGE_ESTIMATORS.register(
    "dvao",
    paper=PAPERS["dvao"],
    description="variance-adaptive multi-reward advantage",
    fields=[
        Field(
            "dvao_sigma_power",
            1.0,
            "Exponent γ of the per-objective std in DVAO's weights.",
            check=number(low=0),
            param="sigma_power",
        )
    ],
    requires=[
        _own_aggregation(
            "DVAO already normalises each reward within its group and weighs the z-scores by their spread (GDPO's "
            "decoupled sum is, up to a constant factor and the std convention, its dvao_sigma_power=0): the two "
            "normalisations would stack"
        ),
        _OWN_SCALE,
    ],
)
def dvao_advantages(rewards, lengths, num_generations, weights, sigma_power: float = 1.0, eps: float = 1e-6):
    """DVAO: per-objective z-scores combined with weights ∝ `b_k σ_k^γ` within each group (arXiv 2605.25604,
    formula reconstructed from the abstract; population std).

    Objectives that do not separate a group's completions (σ_k = 0) get no weight; for γ = 1 conflicting objectives
    damp the advantage (`mean A² ≤ 1`), and always `|A_i| ≤ sqrt(G-1)`. NaN entries contribute 0 to their
    objective; groups with fewer than two scored completions get 0.
    """
    del lengths
    r = _groups(rewards.float(), num_generations)  # (B, G, K)
    mu = torch.nanmean(r, dim=1, keepdim=True)
    sigma = torch.nanmean((r - mu) ** 2, dim=1, keepdim=True).sqrt()  # population std
    sigma = torch.nan_to_num(sigma, nan=0.0)
    b = weights.to(r).view(1, 1, -1)
    num = b.abs() * sigma.pow(sigma_power)  # a negative base weight flips its objective's direction, not the mixture
    den = num.sum(-1, keepdim=True)
    v = torch.where(den > eps, num / den.clamp(min=eps), torch.zeros_like(num))
    z = torch.where(sigma > eps, torch.sign(b) * (r - mu) / (sigma + eps), torch.zeros_like(r))
    advantages = torch.nan_to_num(v * z, nan=0.0).sum(-1)
    valid = (~torch.isnan(r).all(dim=-1)).sum(dim=1, keepdim=True)
    advantages = torch.where(valid > 1, advantages, torch.zeros_like(advantages))
    return _finish(advantages.reshape(-1)), {"mean_abs_advantage": advantages.abs().mean().item()}


@ADVANTAGE_ESTIMATORS.register(
    "oblr",
    paper=PAPERS["oblr"],
    description="gradient-norm-weighted baseline",
    fields=[
        Field(
            "oblr_norm_proxy",
            "length",
            'Proxy of the per-sample gradient norm in OBLR\'s baseline: `"length"` or `"uniform"` (plain mean).',
            check=choice("length", "uniform"),
            param="norm_proxy",
        ),
        Field("oblr_loo", True, "Leave-one-out baseline.", check=boolean(), param="leave_one_out"),
        Field(
            "oblr_scale",
            "none",
            '`"none"` or `"group"` (divide by the group std).',
            check=choice("none", "group"),
            param="scale",
        ),
    ],
    reads={"aggregation": "multi_objective_aggregation"},
    requires=[_OWN_SCALE],
)
def oblr_advantages(
    rewards,
    lengths,
    num_generations,
    weights,
    norm_proxy: str = "length",
    leave_one_out: bool = True,
    scale: str = "none",
    aggregation: str = "sum_then_normalize",
):
    """OBLR-PO's baseline: the variance-optimal `b = Σ w_i r_i / Σ w_i` with `w_i ≈ ||∇ log π(o_i)||²`
    (arXiv 2511.23310; a reconstruction from the abstract and classical theory).

    ``norm_proxy="length"`` uses `w_i = L_i` (per-token gradients roughly independent); ``"uniform"`` is the plain
    mean. With ``leave_one_out`` each sample's baseline excludes itself (unbiased). A group whose weights are all 0
    falls back to the plain mean. ``scale="group"`` divides by the group std as GRPO does.

    The scalar reward is the weighted sum of the rewards, or with ``aggregation="normalize_then_sum"`` GDPO's
    [`decoupled_sum`] of per-group z-scores (arXiv 2601.05242): the baseline is a function of any scalar reward, so
    OBLR's weighted baseline (and optional group std) takes the place of GDPO's batch z-score.
    """
    if norm_proxy not in ("length", "uniform"):
        raise ValueError(f"norm_proxy must be 'length' or 'uniform', got {norm_proxy!r}.")
    if aggregation == "normalize_then_sum":
        scalar = decoupled_sum(rewards, weights, num_generations)
    elif aggregation == "sum_then_normalize":
        scalar = scalar_rewards(rewards, weights)
    else:
        raise ValueError(f"multi_objective_aggregation must be one of {AGGREGATIONS}, got {aggregation!r}.")
    r = _groups(scalar, num_generations)
    valid = ~torch.isnan(r)
    w = _groups(lengths.float(), num_generations) if norm_proxy == "length" else torch.ones_like(r)
    w = torch.where(valid, w.clamp(min=0), torch.zeros_like(w))
    uniform = valid.float()
    if (w.sum(dim=1) <= 0).any():  # all-empty group: plain mean there
        w = torch.where((w.sum(dim=1, keepdim=True) > 0), w, uniform)
    wr = torch.where(valid, w * r, torch.zeros_like(r))
    if leave_one_out:
        num = wr.sum(dim=1, keepdim=True) - wr
        den = w.sum(dim=1, keepdim=True) - w
        fallback_num = torch.where(valid, r, 0.0).sum(dim=1, keepdim=True) - torch.where(valid, r, 0.0)
        fallback_den = uniform.sum(dim=1, keepdim=True) - uniform
        baseline = torch.where(
            den > 0,
            num / den.clamp(min=1e-12),
            torch.where(fallback_den > 0, fallback_num / fallback_den.clamp(min=1), r),
        )
    else:
        baseline = wr.sum(dim=1, keepdim=True) / w.sum(dim=1, keepdim=True).clamp(min=1e-12)
    advantages = torch.where(_no_spread(r), torch.zeros_like(r), r - baseline)
    if scale == "group" and num_generations > 1:
        advantages = advantages / (nanstd(r, dim=1, keepdim=True) + TRL_STD_EPS)
    elif scale not in ("group", "none"):
        raise ValueError(f"scale must be 'group' or 'none', got {scale!r}.")
    return _finish(advantages.reshape(-1)), {}
