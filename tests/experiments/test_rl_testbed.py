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
    record = data["per_seed"]["0"]
    assert record["overlaps"] == {"heldout_sft": 0, "heldout_rl": 0, "sft_rl": 0}
    assert record["steps"] == rl.QUICK.rl_steps and [p[0] for p in record["heldout_curve"]] == [0, 3, 6]
    assert data["criteria"]["disjoint"]["passed"] and data["criteria"]["budget"]["passed"]
    assert (tmp_path / "grpo_rl_control.png").stat().st_size > 10_000
    assert "Control: " in (tmp_path / "grpo_rl_control.md").read_text()
