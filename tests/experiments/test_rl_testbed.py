"""The RL testbed (`experiments/testbeds/rl.py`) and its control experiment: disjoint data, the interval the verdict
uses, the harness digest that follows the testbed's code, and the control's `--quick` run end to end."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest


EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"
sys.path.insert(0, str(EXPERIMENTS))
import _harness  # noqa: E402
from testbeds import rl  # noqa: E402


def test_seed_data_is_disjoint_and_the_heldout_set_is_shared():
    recipe = rl.QUICK
    a, b = rl.seed_data(0, recipe), rl.seed_data(1, recipe)
    assert a["heldout"]["prompt"] == b["heldout"]["prompt"] and len(a["heldout"]) == rl.HELDOUT
    assert a["sft"]["prompt"] != b["sft"]["prompt"]  # each seed its own SFT problems
    for data, seed in ((a, 0), (b, 1)):
        test, sft = set(data["heldout"]["prompt"]), set(data["sft"]["prompt"])
        stream = list(rl.rl_prompts(data, seed, recipe)["prompt"])
        assert len(sft) == recipe.sft_problems and len(stream) == recipe.rl_steps * recipe.rl_prompts
        assert len(set(stream)) == len(stream)  # fresh prompts, no repeats
        assert not (test & sft) and not (test & set(stream)) and not (sft & set(stream))


def _sum(prompt: str) -> int:
    a, b = prompt.rstrip("=").split("+")
    return int(a) + int(b)


def _carries(prompt: str) -> bool:
    a, b = (int(x) for x in prompt.rstrip("=").split("+"))
    return a % 10 + b % 10 >= 10


def test_imperfect_demonstrations_drop_the_carry_on_the_chosen_share_only():
    from hf_stable.testing import arithmetic_splits, with_carry_errors

    rows = arithmetic_splits({"sft": 2000}, seed=3)["sft"]
    for share in (0.0, 0.7, 1.0):
        out = with_carry_errors(rows, share, seed=5)
        assert out["prompt"] == rows["prompt"] and out["answer"] == rows["answer"]  # the verifier's labels stay true
        carry = [r for r in out if _carries(r["prompt"])]
        for r in out:
            if not _carries(r["prompt"]):
                assert int(r["completion"]) == _sum(r["prompt"])
            else:
                assert int(r["completion"]) in (_sum(r["prompt"]), _sum(r["prompt"]) - 10)
        dropped = sum(int(r["completion"]) == _sum(r["prompt"]) - 10 for r in carry)
        # binomial(n, share): 4 standard deviations; exact at 0 and 1
        assert abs(dropped - share * len(carry)) <= 4 * (share * (1 - share) * len(carry)) ** 0.5
    again = with_carry_errors(rows, 0.7, seed=5)["completion"]
    assert again == with_carry_errors(rows, 0.7, seed=5)["completion"]
    assert again != with_carry_errors(rows, 0.7, seed=6)["completion"]
    with pytest.raises(ValueError, match="share"):
        with_carry_errors(rows, 1.5)


def test_seed_data_applies_the_recipes_carry_error_to_the_sft_rows_only():
    from dataclasses import replace

    recipe = replace(rl.QUICK, sft_problems=400, sft_carry_error=1.0)
    data = rl.seed_data(2, recipe)
    assert all(int(r["completion"]) == _sum(r["prompt"]) - 10 for r in data["sft"] if _carries(r["prompt"]))
    assert all(r["completion"] == str(_sum(r["prompt"])) for r in data["heldout"])
    assert all(r["completion"] == str(_sum(r["prompt"])) for r in data["rl"])


def _completions(prompts, wrong_every=3):
    return [str(_sum(p) + (1 if i % wrong_every == 0 else 0)) for i, p in enumerate(prompts)]


def test_one_flip_per_group_flips_exactly_one_reward_in_every_group():
    from hf_stable.testing import arithmetic_reward

    recipe = rl.QUICK
    g = recipe.num_generations
    prompts = [p for p in rl.heldout()["prompt"][:4] for _ in range(g)]
    completions = _completions(prompts)
    answers = [str(_sum(p)) for p in prompts]
    clean = arithmetic_reward(prompts=prompts, completions=completions, answer=answers)
    logged = {}
    fn = rl.make_reward(7, recipe, noise="one_per_group")
    noisy = fn(prompts=prompts, completions=completions, answer=answers, log_metric=logged.__setitem__)
    flips = [sum(a != b for a, b in zip(clean[i : i + g], noisy[i : i + g], strict=True)) for i in range(0, 32, g)]
    assert flips == [1, 1, 1, 1] and fn.__name__ == rl.REWARD_NAME
    assert logged[f"{rl.REWARD_NAME}/clean"] == pytest.approx(sum(clean) / len(clean))
    with pytest.raises(RuntimeError, match="groups of"):
        fn(prompts=prompts[:5], completions=completions[:5], answer=answers[:5])
    with pytest.raises(ValueError, match="noise"):
        rl.make_reward(0, recipe, noise="bursty")


def test_majority_reward_rewards_agreement_and_logs_the_verifier():
    recipe = rl.QUICK
    g = recipe.num_generations
    prompt = rl.heldout()["prompt"][0]
    truth = str(_sum(prompt))
    completions = [truth + "9"] * (g - 3) + [truth] * 3  # the majority is wrong
    logged = {}
    fn = rl.make_reward(0, recipe, reward="majority_vote")
    rewards = fn(prompts=[prompt] * g, completions=completions, answer=[truth] * g, log_metric=logged.__setitem__)
    assert rewards == [1.0] * (g - 3) + [0.0] * 3
    assert logged[f"{rl.REWARD_NAME}/clean"] == pytest.approx(3 / g)


def test_grpo_config_overrides_replace_the_testbeds_settings(tmp_path):
    args = rl.grpo_config(
        str(tmp_path), 0, rl.QUICK, per_device_train_batch_size=16, gradient_accumulation_steps=2, learning_rate=1e-3
    )
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps, args.learning_rate) == (16, 2, 1e-3)
    assert args.num_generations == rl.QUICK.num_generations and args.beta == 0.0


def test_t_interval_matches_scipy():
    from scipy import stats

    values = [0.12, 0.08, 0.15, 0.11]
    ci = rl.t_interval(values)
    low, high = stats.t.interval(0.95, len(values) - 1, loc=stats.tmean(values), scale=stats.sem(values))
    assert ci["ci_low"] == pytest.approx(low, abs=1e-4) and ci["ci_high"] == pytest.approx(high, abs=1e-4)
    assert math.isinf(rl.t_interval([0.2])["ci_low"])


@pytest.mark.parametrize(
    "gains, passed",
    [([0.12, 0.11, 0.13], True), ([0.09, 0.10, 0.095], False), ([0.40, -0.05, 0.0], False)],  # low mean; CI holds 0
)
def test_control_verdict(gains, passed):
    assert rl.control_verdict(gains)["passed"] is passed


def test_digest_follows_the_testbeds_only_for_scripts_that_import_them(tmp_path, monkeypatch):
    beds = tmp_path / "testbeds"
    beds.mkdir()
    (beds / "bed.py").write_text("x = 1\n")
    monkeypatch.setattr(_harness, "TESTBEDS", beds)
    user, other = tmp_path / "user.py", tmp_path / "other.py"
    user.write_text("from testbeds import bed\n")
    other.write_text("import os\n")
    before = {p: _harness._sources_digest(str(p)) for p in (user, other)}
    (beds / "bed.py").write_text("x = 2\n")
    assert _harness._sources_digest(str(user)) != before[user]
    assert _harness._sources_digest(str(other)) == before[other]


def test_tuning_rule_picks_the_best_step_and_lr():
    from grpo_rl_control import tuning_choice

    grid = {
        "0.0001": {"heldout_curve": [[0, 0.3], [100, 0.35], [200, 0.41], [300, 0.41], [400, 0.41]]},
        # a lone high point is averaged with its neighbours: (0.30 + 0.50 + 0.30) / 3 = 0.367
        "0.0002": {"heldout_curve": [[0, 0.3], [100, 0.30], [200, 0.50], [300, 0.30]]},
    }
    choice = tuning_choice(grid)  # 200, 300 and 400 tie at 0.41 averaged; the earlier step wins
    assert (choice["lr"], choice["steps"]) == (1e-4, 300) and choice["heldout_em_smoothed"] == pytest.approx(0.41)


@pytest.mark.slow
def test_control_quick_run(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(EXPERIMENTS / "grpo_rl_control.py"), "--quick", "--out", str(tmp_path)]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = json.loads((tmp_path / "grpo_rl_control.json").read_text())
    assert set(_harness.SCHEMA_KEYS) <= set(data) and data["config"]["quick"] is True
    assert list(data["criteria"]) == ["control", "disjoint", "budget", "tuning"]
    record = data["per_seed"]["1"]  # the first control seed (seed 0 was looked at while design v4 was probed)
    assert record["overlaps"] == {"heldout_sft": 0, "heldout_rl": 0, "sft_rl": 0}
    assert record["steps"] == rl.QUICK.rl_steps and [p[0] for p in record["heldout_curve"]] == [0, 3, 6]
    assert data["criteria"]["disjoint"]["passed"] and data["criteria"]["budget"]["passed"]
    assert (tmp_path / "grpo_rl_control.png").stat().st_size > 10_000
    assert "Control: " in (tmp_path / "grpo_rl_control.md").read_text()
