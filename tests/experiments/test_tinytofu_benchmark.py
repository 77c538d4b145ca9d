"""TinyTOFU v2 benchmark runner (`experiments/tinytofu.py`): the tier logic, the control, the committed table, and the
CI smoke on the reduced, one-seed configuration."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _runner():
    folder = os.path.join(ROOT, "experiments")
    if folder not in sys.path:  # the script imports `_harness` from its folder
        sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location("tinytofu_runner", os.path.join(ROOT, "experiments", "tinytofu.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass resolves string annotations through sys.modules
    spec.loader.exec_module(module)
    return module


FULL = {"retain_acc": 0.983, "world_acc": 1.0}


def _metrics(**overrides) -> dict:
    """An oracle-like row (the v1 seed-0 oracle's numbers) that passes every check, with ``overrides``."""
    base = {
        "forget_acc": 0.0625,
        "retain_acc": 0.983,
        "world_acc": 1.0,
        "over_forgetting": -0.1,
        "fq_holdout": 0.92,
        "fq_oracle": 1.0,
        "mia_auc": 0.54,
        "relearn_prob": 0.14,
        "relearn_acc": 0.10,
        "oracle_relearn_prob": 0.142,
        "oracle_relearn_acc": 0.10,
    }
    return {**base, **overrides}


def test_clean_row_passes_both_tiers():
    marks = _runner().marks(_metrics(), FULL)
    assert marks["tier1"]["passed"] and marks["tier2"]["passed"] and not marks["collapse"]


@pytest.mark.parametrize(
    "seed_values",
    [
        # v1 committed GA rows (seeds 0, 1, 2): collapsed, yet all four Q checks held under the one-sided Q4
        dict(retain_acc=0.05, world_acc=0.17, over_forgetting=-9.3, relearn_prob=3e-4, relearn_acc=0.03,
             oracle_relearn_prob=0.142, oracle_relearn_acc=0.10, fq_holdout=0.82, fq_oracle=0.24, mia_auc=0.53),
        dict(retain_acc=0.13, world_acc=0.0, over_forgetting=-10.1, relearn_prob=7e-7, relearn_acc=0.12,
             oracle_relearn_prob=0.124, oracle_relearn_acc=0.08, fq_holdout=0.92, fq_oracle=0.17, mia_auc=0.50),
        dict(retain_acc=0.19, world_acc=0.60, over_forgetting=-8.7, relearn_prob=3e-6, relearn_acc=0.05,
             oracle_relearn_prob=0.141, oracle_relearn_acc=0.10, fq_holdout=0.24, fq_oracle=0.44, mia_auc=0.54),
    ],
)  # fmt: skip
def test_collapsed_ga_fails_two_sided_q4_and_gated_tier2(seed_values):
    runner = _runner()
    m = _metrics(**seed_values)
    marks = runner.marks(m, FULL)
    assert marks["collapse"] and not marks["tier1"]["passed"]
    assert marks["tier2"]["Q1"] and marks["tier2"]["Q3"]  # the KS and MIA checks alone are fooled by collapse
    one_sided = (
        m["relearn_prob"] <= m["oracle_relearn_prob"] + 0.10 and m["relearn_acc"] <= m["oracle_relearn_acc"] + 0.15
    )
    assert one_sided and not marks["tier2"]["Q4"]  # v1's Q4 held; the two-sided one does not
    assert not marks["tier2"]["passed"]


def test_q4_bounds_on_both_sides():
    marks = _runner().marks
    assert marks(_metrics(relearn_prob=0.142 + 0.09), FULL)["tier2"]["Q4"]
    assert not marks(_metrics(relearn_prob=0.142 + 0.11), FULL)["tier2"]["Q4"]  # relearns: suppression (PDU in v1)
    assert marks(_metrics(relearn_prob=0.0143), FULL)["tier2"]["Q4"]
    assert not marks(_metrics(relearn_prob=0.0141), FULL)["tier2"]["Q4"]  # more than 10x below the oracle
    assert marks(_metrics(relearn_acc=0.25), FULL)["tier2"]["Q4"]  # |0.25 - 0.10| = 0.15, on the bound
    assert not marks(_metrics(relearn_acc=0.26), FULL)["tier2"]["Q4"]
    assert not marks(_metrics(relearn_acc=0.0, oracle_relearn_acc=0.2), FULL)["tier2"]["Q4"]  # below, two-sided


@pytest.mark.parametrize(
    "failing", [dict(forget_acc=0.1625), dict(retain_acc=0.88), dict(world_acc=0.59), dict(over_forgetting=-2.1)]
)
def test_tier2_requires_tier1(failing):
    """Each Tier-1 check alone blocks Tier 2, though every Q check holds."""
    marks = _runner().marks(_metrics(**failing), FULL)
    assert not marks["tier1"]["passed"]
    assert all(marks["tier2"][q] for q in ("Q1", "Q2", "Q3", "Q4")) and not marks["tier2"]["passed"]


@pytest.mark.slow
def test_quick_benchmark_separates_collapse_from_unlearning_and_the_control_fails(tmp_path):
    result = _runner().main(["--quick", "--out", str(tmp_path), "--no_cache"])
    seed = result["per_seed"]["0"]
    full, oracle, control = (seed["reference"][k] for k in ("full", "oracle", "control"))
    assert full["metrics"]["forget_acc"] >= 0.95, full["metrics"]
    assert oracle["metrics"]["forget_acc"] <= 0.15, oracle["metrics"]
    assert not full["collapse"] and full["tier1"]["T2"] and full["tier1"]["T3"]
    # the training-free reset of the forget names' token rows must not pass: the tokens are shared
    assert not (control["tier1"]["passed"] and control["tier2"]["passed"]), control
    assert control["ra_ratio"] < 0.9, control["ra_ratio"]

    ga, simnpo = seed["methods"]["ga"], seed["methods"]["simnpo"]
    assert ga["collapse"], (ga["ra_ratio"], ga["metrics"]["over_forgetting"])
    assert not ga["tier2"]["passed"]
    assert simnpo["tier1"]["passed"], simnpo["tier1"]
    assert not simnpo["collapse"]
    assert set(seed["methods"]) == {"ga", "graddiff", "simnpo"}

    saved = json.loads((tmp_path / "tinytofu.json").read_text())
    assert {"claim", "criteria", "passed", "per_seed", "aggregate", "wall_s", "git_commit"} <= set(saved)
    assert saved["criteria"]["a"]["passed"] and saved["criteria"]["b"]["passed"] and saved["criteria"]["d"]["passed"]
    assert (tmp_path / "tinytofu.png").stat().st_size > 10_000
    text = (tmp_path / "tinytofu.md").read_text()
    assert "| SimNPO |" in text and "| control: name-embedding reset |" in text


def test_committed_results_have_the_shared_schema_and_the_control():
    """The table the docs quote: the shared result keys, the control row and the v2 tier logic on every row."""
    runner = _runner()
    data = json.loads(open(os.path.join(ROOT, "experiments", "results", "tinytofu.json")).read())
    assert {"claim", "criteria", "passed", "per_seed", "aggregate", "wall_s", "git_commit"} <= set(data)
    assert data["config"]["seeds"] == [0, 1, 2] and data["config"]["tier2_requires_tier1"]
    assert set(data["criteria"]) == {"a", "b", "c", "d"}
    for seed in data["config"]["seeds"]:
        assert set(data["per_seed"][str(seed)]["methods"]) == set(runner.METHODS)
        rows = {**data["per_seed"][str(seed)]["reference"], **data["per_seed"][str(seed)]["methods"]}
        assert {"full", "oracle", "control"} <= set(rows)
        full = rows["full"]["metrics"]
        for name, row in rows.items():  # the stored marks are the ones the current rule gives
            recomputed = runner.marks(row["metrics"], full)
            assert recomputed["tier1"] == row["tier1"] and recomputed["tier2"] == row["tier2"], (seed, name)
