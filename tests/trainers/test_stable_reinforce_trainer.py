"""StableReinforce in `StableGRPOTrainer`: the `stable_reinforce` loss mode is TRL's own update when the pre-clip
bound is out of reach (parity on TRL's options), changes it when the bound binds on off-policy tokens, and the
advantage filter's advantages equal the rule computed here by hand from the logged rewards and the completions'
lengths."""

import math
import statistics

import pytest
import torch
from grpo_helpers import G, grpo_run

from hf_stable import StableGRPOConfig, StableGRPOTrainer


_OFF_POLICY = {"max_steps": 2, "steps_per_generation": 2}  # the second step reuses the generation: π_old ≠ π
_METRIC = "stable/grpo/stable_reinforce/preclipped_frac"


@pytest.mark.parametrize(
    "options",
    [
        {"loss_type": "dapo"},
        {"loss_type": "grpo", "epsilon_high": 0.28},
        {"loss_type": "bnpo", "beta": 0.04, "use_bias_correction_kl": True, "_peft": True},
        {"loss_type": "dr_grpo", "delta": 1.5, "importance_sampling_level": "sequence"},
    ],
    ids=["dapo", "grpo-eps_high", "bnpo-beta-biascorr", "dr_grpo-delta-sequence"],
)
def test_out_of_reach_bound_gives_trls_update(tmp_path, options):
    options = dict(options)
    if options.pop("_peft", False):  # beta > 0: the reference is the adapter-free model (no checkpoint on disk)
        from peft import LoraConfig

        options["peft_config"] = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_alpha=8)
    trl, _ = grpo_run(tmp_path / "trl", **_OFF_POLICY, **options)
    ours, trainer = grpo_run(
        tmp_path / "sr", loss_mode="stable_reinforce", sr_ratio_bound=1e30, **_OFF_POLICY, **options
    )
    assert trl.abs().max() > 0
    torch.testing.assert_close(ours, trl, rtol=1e-5, atol=1e-6)
    assert all(log[_METRIC] == 0 for log in trainer.state.log_history if _METRIC in log)


def test_binding_bound_changes_the_off_policy_step_only(tmp_path):
    loose, _ = grpo_run(tmp_path / "loose", loss_mode="stable_reinforce", sr_ratio_bound=1e30, max_steps=1)
    tight, _ = grpo_run(tmp_path / "tight", loss_mode="stable_reinforce", sr_ratio_bound=1.05, max_steps=1)
    torch.testing.assert_close(tight, loose, rtol=0, atol=0)  # on-policy: every ratio is 1, nothing to clamp
    loose, _ = grpo_run(tmp_path / "loose2", loss_mode="stable_reinforce", sr_ratio_bound=1e30, **_OFF_POLICY)
    tight, trainer = grpo_run(tmp_path / "tight2", loss_mode="stable_reinforce", sr_ratio_bound=1.05, **_OFF_POLICY)
    fracs = [log[_METRIC] for log in trainer.state.log_history if _METRIC in log]
    assert fracs[0] == 0 and fracs[1] > 0, fracs
    assert not torch.equal(tight, loose)


class _Recording(StableGRPOTrainer):
    """Keeps each generation batch's completion lengths and the advantages the loss will read."""

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        self.recorded = (out["completion_mask"].sum(1).tolist(), out["advantages"].clone())
        return out


def test_advantage_filter_standardises_and_drops_by_hand(tmp_path):
    k = 1.0
    delta, trainer = grpo_run(tmp_path, trainer_cls=_Recording, config_cls=StableGRPOConfig, advantage_filter_sigma=k)
    lengths, used = trainer.recorded
    # TRL's advantages from the logged rewards: weighted sum, (r − group mean) / (group sample std + 1e-4)
    columns = [list(v) for v in trainer._logs["rewards"].values()]
    weights = trainer.reward_weights.tolist()
    total = [sum(w * col[i] for w, col in zip(weights, columns, strict=True)) for i in range(len(columns[0]))]
    trl = []
    for start in range(0, len(total), G):
        group = total[start : start + G]
        mean, std = statistics.fmean(group), statistics.stdev(group)
        trl.extend((r - mean) / (std + 1e-4) for r in group)
    # the filter: token-weighted mean and std over the batch, then zero beyond k sigma
    mu = sum(n * a for n, a in zip(lengths, trl, strict=True)) / sum(lengths)
    sd = math.sqrt(max(sum(n * (a - mu) ** 2 for n, a in zip(lengths, trl, strict=True)) / sum(lengths), 1e-8))
    z = [(a - mu) / sd for a in trl]
    want = [v if abs(v) <= k else 0.0 for v in z]
    dropped = sum(v == 0.0 and a != 0.0 for v, a in zip(want, trl, strict=True))
    assert 0 < dropped < len(want)  # k = 1 keeps and drops here
    torch.testing.assert_close(used, torch.tensor(want), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(
        torch.tensor(list(trainer._logs["advantages"])), torch.tensor(want), rtol=1e-4, atol=1e-5
    )
    assert delta.abs().max() > 0
    logged = [log for log in trainer.state.log_history if "stable/grpo/sigma_filter/filtered_frac" in log]
    assert logged and logged[0]["stable/grpo/sigma_filter/filtered_frac"] > 0


@pytest.mark.parametrize(
    "config",
    [{"loss_mode": "stable_reinforce"}, {"advantage_estimator": "maxrl", "correctness_reward_index": 0}],
    ids=["stable_reinforce", "maxrl"],
)
def test_advantage_filter_acts_on_the_loss_modes_and_estimators_advantages(tmp_path, config):
    """The filter composes: the advantages used are the filter of what the mode or estimator computed."""
    from hf_stable.losses.advantages import ADVANTAGE_ESTIMATORS
    from hf_stable.losses.stable_reinforce import sigma_filter

    _, trainer = grpo_run(
        tmp_path, trainer_cls=_Recording, config_cls=StableGRPOConfig, advantage_filter_sigma=1.0, **config
    )
    lengths, used = trainer.recorded
    rewards = torch.stack([torch.tensor(list(v)) for v in trainer._logs["rewards"].values()], dim=1)
    if "loss_mode" in config:
        raw, _, _ = trainer._loss_mode.advantages(rewards, trainer.reward_weights, None, None, G, 6)
    else:
        estimator = ADVANTAGE_ESTIMATORS.get("maxrl")
        raw, _ = estimator(
            rewards, torch.tensor(lengths), G, trainer.reward_weights, **estimator.params_from(trainer.args)
        )
    want, _ = sigma_filter(raw, torch.tensor(lengths, dtype=torch.float32), 1.0)
    assert (want == 0).any() and (raw != 0).sum() > (want != 0).sum()
    torch.testing.assert_close(used, want)
