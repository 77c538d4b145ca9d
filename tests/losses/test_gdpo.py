"""GDPO's reward-decoupled normalisation (TRL's `multi_objective_aggregation="normalize_then_sum"`, Liu et al., arXiv
2601.05242) and how each hf_stable method composes with it.

The reference is TRL 1.16's inline `normalize_then_sum` branch of `GRPOTrainer._generate_and_score_completions`,
written out literally below with TRL's own `nanstd`, and float64 numpy by hand for the composed estimators. Methods
whose maths does not compose keep refusing the option, with a message that says why (checked here per method).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from trl.trainer.utils import nanstd as trl_nanstd

from hf_stable import StableGRPOConfig
from hf_stable.losses.advantages import (
    batch_zscore,
    decoupled_sum,
    gdpo_advantages,
    oblr_advantages,
    sgrpo_advantages,
    trl_advantages,
)
from hf_stable.losses.policy import LOSS_MODES


def _trl_normalize_then_sum(rewards_per_func, reward_weights, num_generations):
    """TRL 1.16's inline advantage under `multi_objective_aggregation="normalize_then_sum"`, written out literally."""
    k = rewards_per_func.shape[1]
    unscorable_mask = torch.isnan(rewards_per_func).all(dim=1)
    grouped = rewards_per_func.view(-1, num_generations, k)
    mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
    std_k = trl_nanstd(grouped, dim=1, keepdim=True) if num_generations > 1 else torch.zeros_like(mean_k)
    reward_k = ((grouped - mean_k) / (std_k + 1e-4)).view(-1, k)
    rewards = (reward_k * reward_weights.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable_mask] = torch.nan
    std_rewards = trl_nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    advantages = (rewards - torch.nanmean(rewards)) / (std_rewards + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


def _batch(g: int, seed: int, k: int = 3):
    gen = torch.Generator().manual_seed(seed)
    n = 6 * g
    rewards = torch.randn(n, k, generator=gen) * 2.0
    rewards[torch.rand(n, k, generator=gen) < 0.25] = math.nan  # a reward that did not apply
    rewards[torch.randperm(n, generator=gen)[:2]] = math.nan  # unscorable rows
    if g > 1:
        rewards[:g] = math.nan  # a whole unscorable group
        rewards[g : 2 * g - 1] = math.nan  # a group with a single scored completion
    weights = torch.rand(k, generator=gen) * 2 - 0.5
    return rewards, weights


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("g", [1, 2, 3, 8])
def test_gdpo_matches_trl_normalize_then_sum(g, seed):
    rewards, weights = _batch(g, seed)
    ours, metrics = gdpo_advantages(rewards, None, g, weights)
    ref = _trl_normalize_then_sum(rewards.clone(), weights, g)
    assert ours.shape == (rewards.shape[0],) and ours.dtype == torch.float32 and metrics == {}
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(ours).all()
    if g > 1:
        assert ours.abs().max() > 0.1
    # TRL ignores scale_rewards under normalize_then_sum, and so does the dispatcher
    for scale in ("group", "batch", "none"):
        assert torch.equal(trl_advantages(rewards, None, g, weights, scale, "normalize_then_sum"), ours)


def test_gdpo_by_hand_float64():
    """Two groups of three, two rewards of very different scales: each column z-scored in its group (Bessel), summed
    with the weights, then z-scored over the batch."""
    r = np.array([[1.0, 10.0], [0.0, 30.0], [1.0, 20.0], [0.0, 5.0], [0.0, 25.0], [1.0, 15.0]])
    w = np.array([1.0, 0.5])
    z = np.zeros_like(r)
    for s in (0, 3):
        block = r[s : s + 3]
        z[s : s + 3] = (block - block.mean(0)) / (block.std(0, ddof=1) + 1e-4)
    total = z @ w
    want = (total - total.mean()) / (total.std(ddof=1) + 1e-4)
    ours, _ = gdpo_advantages(torch.tensor(r, dtype=torch.float32), None, 3, torch.tensor(w, dtype=torch.float32))
    np.testing.assert_allclose(ours.double().numpy(), want, atol=1e-5)
    # the point of GDPO: GRPO's sum lets the large-scale reward decide, GDPO weighs both at their z-scores
    grpo = trl_advantages(torch.tensor(r, dtype=torch.float32), None, 3, torch.tensor(w, dtype=torch.float32))
    assert not torch.allclose(grpo, ours, atol=1e-2)


def test_decoupled_sum_and_batch_zscore_edge_cases():
    rewards = torch.tensor([[math.nan, math.nan], [1.0, math.nan], [0.0, 2.0], [0.0, 4.0]])
    s = decoupled_sum(rewards, torch.ones(2), 2)
    assert math.isnan(s[0]) and s[1] == 0  # unscorable stays NaN; a lone scored entry has no spread
    torch.testing.assert_close(s[2:], torch.tensor([-1.0, 1.0]) / (math.sqrt(2) + 1e-4))  # column 0 has no spread
    a = batch_zscore(s)
    assert a[0] == 0 and torch.isfinite(a).all()
    assert torch.equal(batch_zscore(torch.tensor([3.0])), torch.zeros(1))
    # equal rewards in every group: exactly 0 (no fp32 roundoff amplified by 1/(0 + 1e-4))
    equal = torch.tensor([0.3, 0.3, 0.3, 2.9, 2.9, 2.9])[:, None].expand(-1, 2).contiguous()
    assert torch.equal(gdpo_advantages(equal, None, 3, torch.ones(2))[0], torch.zeros(6))
    with pytest.raises(ValueError, match="multi_objective_aggregation"):
        trl_advantages(rewards, None, 2, torch.ones(2), aggregation="sum")


def _sgrpo_weight(q: float, p: float) -> float:
    """S-GRPO's w* (arXiv 2508.05928) in float64, from the formula."""
    t = min(max((q - p) / (1 - 2 * p), 0.0), 1.0)
    return (1 - 2 * p) * t * (1 - t) / (math.sqrt(q * (1 - q) + 1e-8) * math.sqrt(t * (1 - t) + 1e-8))


def test_sgrpo_under_gdpo_is_gdpo_times_the_groups_weight():
    """Successes counted on the raw correctness column; the base advantage is GDPO's, not the weighted sum's."""
    gen = torch.Generator().manual_seed(3)
    g, p = 4, 0.1
    correct = torch.tensor([1, 0, 0, 0, 1, 1, 0, 0, 1, 1, 1, 0, 1, 1, 1, 1], dtype=torch.float32)
    rewards = torch.stack([correct, torch.randn(16, generator=gen) * 5], dim=1)
    weights = torch.tensor([1.0, 0.3])
    ours, _ = sgrpo_advantages(
        rewards, None, g, weights, noise_p=p, correctness_index=0, aggregation="normalize_then_sum"
    )
    base = _trl_normalize_then_sum(rewards.clone(), weights, g)
    w = torch.tensor([_sgrpo_weight(q, p) for q in (0.25, 0.5, 0.75, 1.0)], dtype=torch.float64)
    torch.testing.assert_close(ours.double(), base.double() * w.repeat_interleave(g), atol=1e-5, rtol=1e-5)
    assert ours[12:].abs().max() == 0 and base[12:].abs().max() > 0.1  # all-correct group: w* = 0
    plain, _ = sgrpo_advantages(rewards, None, g, weights, noise_p=p, correctness_index=0)
    assert not torch.allclose(plain, ours, atol=1e-2)


def test_oblr_under_gdpo_takes_the_decoupled_sum_as_its_reward():
    r = np.array([[1.0, 10.0], [0.0, 30.0], [1.0, 20.0], [0.0, 5.0], [0.0, 25.0], [1.0, 15.0], [1.0, 1.0], [0, 2]])
    w = np.array([1.0, 0.5])
    lengths = np.array([3, 5, 2, 4, 1, 6, 2, 2])
    z = np.zeros_like(r)
    for s in (0, 4):
        block = r[s : s + 4]
        z[s : s + 4] = (block - block.mean(0)) / (block.std(0, ddof=1) + 1e-4)
    scalar = z @ w
    want = np.zeros(8)
    for s in (0, 4):
        x, n = scalar[s : s + 4], lengths[s : s + 4]
        for i in range(4):  # leave-one-out, length-weighted baseline
            others = [j for j in range(4) if j != i]
            want[s + i] = x[i] - (n[others] * x[others]).sum() / n[others].sum()
    ours, _ = oblr_advantages(
        torch.tensor(r, dtype=torch.float32),
        torch.tensor(lengths),
        4,
        torch.tensor(w, dtype=torch.float32),
        aggregation="normalize_then_sum",
    )
    np.testing.assert_allclose(ours.double().numpy(), want, atol=1e-5)


@pytest.mark.parametrize("mode", ["ess", "stable_reinforce"])
def test_ppo_like_loss_modes_use_trls_gdpo_advantages(mode):
    rewards, weights = _batch(4, 7)
    method = LOSS_MODES.get(mode)
    instance = method.fn(**{**method.defaults, "aggregation": "normalize_then_sum"})
    complete = torch.ones(rewards.shape[0], dtype=torch.bool)
    lengths = torch.ones(rewards.shape[0])
    adv, keep, _ = instance.advantages(rewards, weights, complete, lengths, 4, 8)
    assert keep is None
    torch.testing.assert_close(adv, _trl_normalize_then_sum(rewards.clone(), weights, 4), rtol=1e-5, atol=1e-5)


_CPU = {"use_cpu": True, "report_to": "none"}
COMPOSES = {
    "sgrpo": {"advantage_estimator": "sgrpo", "correctness_reward_index": 0},
    "oblr": {"advantage_estimator": "oblr"},
    "ess": {"loss_mode": "ess"},
    "stable_reinforce": {"loss_mode": "stable_reinforce"},
    "ctwa": {"reward_weighting": "ctwa"},
    "lagrangian": {"reward_weighting": "lagrangian", "lagrange_thresholds": [None, 0.5]},
    "gradient": {"reward_weighting": "gradient"},
    "hypervolume": {"reward_weighting": "hypervolume"},
}
# each refusal names the reason the maths does not compose
REFUSED = {
    "maxrl": ({"advantage_estimator": "maxrl", "correctness_reward_index": 0}, "only the 0/1 success"),
    "dvao": ({"advantage_estimator": "dvao"}, "already normalises each reward within its group"),
    "drpo": ({"loss_mode": "drpo"}, "no pass/fail to count"),
    "onpolicy_sft": ({"loss_mode": "onpolicy_sft"}, "no pass/fail to count"),
}


@pytest.mark.parametrize("name", sorted(COMPOSES))
def test_composing_methods_accept_normalize_then_sum(tmp_path, name):
    args = StableGRPOConfig(str(tmp_path), multi_objective_aggregation="normalize_then_sum", **_CPU, **COMPOSES[name])
    assert args.multi_objective_aggregation == "normalize_then_sum"


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_non_composing_methods_refuse_normalize_then_sum_and_say_why(tmp_path, name):
    config, reason = REFUSED[name]
    with pytest.raises(ValueError) as error:
        StableGRPOConfig(str(tmp_path), multi_objective_aggregation="normalize_then_sum", **_CPU, **config)
    message = str(error.value)
    assert "multi_objective_aggregation='normalize_then_sum'" in message and reason in message, message
