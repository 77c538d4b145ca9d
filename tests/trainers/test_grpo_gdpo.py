"""GDPO (TRL's `multi_objective_aggregation="normalize_then_sum"`, arXiv 2601.05242) through `StableGRPOTrainer`, and
the length-conditional reward mask (BalCapRL, arXiv 2605.07394) in a run.

Plain `grpo` under `normalize_then_sum` is TRL's own update bit for bit (the conformance case
`multi_objective_aggregation=normalize_then_sum` in tests/conformance). Here: the methods that compose use GDPO's
advantages, checked against TRL's formula written out from the logged rewards, and the mask withholds exactly the
rewards the rule says, from the completions' own token counts."""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from grpo_helpers import G, grpo_run

from hf_stable import StableGRPOConfig, StableGRPOTrainer


_GDPO = {"multi_objective_aggregation": "normalize_then_sum"}


def _gdpo_by_hand(columns: list[list[float]], weights: list[float]) -> list[float]:
    """TRL's normalize_then_sum from the logged reward columns: per column `(r - group mean) / (group sample std +
    1e-4)`, weighted sum, then `(s - batch mean) / (batch sample std + 1e-4)`. No NaN in these runs."""
    n = len(columns[0])
    total = [0.0] * n
    for w, column in zip(weights, columns, strict=True):
        for start in range(0, n, G):
            group = column[start : start + G]
            mean, std = statistics.fmean(group), statistics.stdev(group)
            for i, r in enumerate(group):
                total[start + i] += w * (r - mean) / (std + 1e-4)
    mean, std = statistics.fmean(total), statistics.stdev(total)
    return [(s - mean) / (std + 1e-4) for s in total]


def _logged(trainer):
    columns = [list(v) for v in trainer._logs["rewards"].values()]
    return columns, trainer.reward_weights.tolist(), torch.tensor(list(trainer._logs["advantages"]))


def test_plain_grpo_uses_gdpo_advantages(tmp_path):
    delta, trainer = grpo_run(tmp_path / "gdpo", **_GDPO)
    columns, weights, used = _logged(trainer)
    torch.testing.assert_close(used, torch.tensor(_gdpo_by_hand(columns, weights)), rtol=1e-4, atol=1e-4)
    plain, _ = grpo_run(tmp_path / "grpo")
    assert delta.abs().max() > 0 and not torch.equal(delta, plain)


def test_stable_reinforce_under_gdpo_is_trls_gdpo_update(tmp_path):
    """Out of reach, the pre-clip leaves TRL's surrogate; its advantages are then GDPO's, so the update is TRL's."""
    off_policy = {"max_steps": 2, "steps_per_generation": 2}
    trl, _ = grpo_run(tmp_path / "trl", **_GDPO, **off_policy)
    ours, _ = grpo_run(tmp_path / "sr", loss_mode="stable_reinforce", sr_ratio_bound=1e30, **_GDPO, **off_policy)
    assert trl.abs().max() > 0
    torch.testing.assert_close(ours, trl, rtol=1e-5, atol=1e-6)


def _sgrpo_weight(q: float, p: float) -> float:
    t = min(max((q - p) / (1 - 2 * p), 0.0), 1.0)
    return (1 - 2 * p) * t * (1 - t) / (math.sqrt(q * (1 - q) + 1e-8) * math.sqrt(t * (1 - t) + 1e-8))


def test_sgrpo_under_gdpo_scales_gdpos_advantages_by_the_groups_weight(tmp_path):
    p = 0.2
    _, trainer = grpo_run(
        tmp_path, advantage_estimator="sgrpo", sgrpo_noise_p=p, correctness_reward_index=0, **_GDPO
    )
    columns, weights, used = _logged(trainer)
    base = _gdpo_by_hand(columns, weights)
    want = []
    for start in range(0, len(base), G):
        q = sum(r > 0.5 for r in columns[0][start : start + G]) / G
        want += [a * _sgrpo_weight(q, p) for a in base[start : start + G]]
    torch.testing.assert_close(used, torch.tensor(want), rtol=1e-4, atol=1e-4)
    assert any(w != 0 for w in want)


class _Recording(StableGRPOTrainer):
    """Keeps the rewards before and after the length mask, and the completions' token counts."""

    def _apply_length_mask(self, rewards, inputs, completion_ids_list):
        out = super()._apply_length_mask(rewards, inputs, completion_ids_list)
        self.recorded = (rewards.clone(), [len(ids) for ids in completion_ids_list], out[0].clone())
        return out


@pytest.mark.parametrize("aggregation", ["sum_then_normalize", "normalize_then_sum"])
def test_length_mask_withholds_the_rule_s_rewards_in_a_run(tmp_path, aggregation):
    reference, fill = 2, -1.0
    delta, trainer = grpo_run(
        tmp_path / "mask",
        trainer_cls=_Recording,
        config_cls=StableGRPOConfig,
        length_mask_rewards=[0],
        length_mask_reference=reference,
        length_mask_min_ratio=0.75,
        length_mask_fill=fill,
        multi_objective_aggregation=aggregation,
    )
    raw, lengths, masked = trainer.recorded
    want = raw.clone()
    for i, n in enumerate(lengths):
        if not 0.75 <= n / reference <= 1.0:
            want[i, 0] = fill
    assert torch.equal(masked, want)
    outside = sum(not 0.75 <= n / reference <= 1.0 for n in lengths)
    assert 0 < outside < len(lengths)  # some kept, some withheld
    columns, weights, used = _logged(trainer)
    assert torch.equal(torch.tensor(columns, dtype=torch.float32).T, masked)  # TRL scored the masked rewards
    logged = [log["stable/grpo/length_mask/masked_frac"] for log in trainer.state.log_history if "loss" in log]
    assert logged == [pytest.approx(outside / len(lengths))]
    if aggregation == "normalize_then_sum":
        torch.testing.assert_close(used, torch.tensor(_gdpo_by_hand(columns, weights)), rtol=1e-4, atol=1e-4)
    unmasked, _ = grpo_run(tmp_path / "plain", multi_objective_aggregation=aggregation)
    assert not torch.equal(delta, unmasked)


def test_a_reference_column_the_data_lacks_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="length_mask_reference"):
        grpo_run(tmp_path, length_mask_rewards=[0], length_mask_reference="reference_caption")
    with pytest.raises(ValueError, match="length_mask_rewards"):
        grpo_run(tmp_path, length_mask_rewards=[2], length_mask_reference=3)


def test_the_reference_column_is_checked_in_the_evaluation_data_too():
    from datasets import Dataset

    from hf_stable.losses.length_mask import check_length_mask

    args = StableGRPOConfig("out", use_cpu=True, length_mask_rewards=[0], length_mask_reference="ref")
    with_ref, without = Dataset.from_dict({"prompt": ["1+1="], "ref": [3]}), Dataset.from_dict({"prompt": ["1+1="]})
    check_length_mask(args, 1, with_ref, {"a": with_ref}, None)
    with pytest.raises(ValueError, match="length_mask_reference"):
        check_length_mask(args, 1, with_ref, {"a": with_ref, "b": without})
