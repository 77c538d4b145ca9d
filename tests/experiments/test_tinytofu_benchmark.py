"""CI smoke of the TinyTOFU benchmark (spec `unlearning.md` §5.6): the reduced, one-seed configuration.

It runs the real runner end to end (reduced data, cached SFT, GA + GradDiff + SimNPO with the benchmark presets) and
checks what the spec asks CI to hold: the full model knows the forget set, the oracle does not, GA trips the collapse
signature, SimNPO passes Tier 1, and the starting model itself is not flagged as collapsed.
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _runner():
    spec = importlib.util.spec_from_file_location("tinytofu_runner", os.path.join(ROOT, "experiments", "tinytofu.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_quick_benchmark_separates_collapse_from_unlearning(tmp_path):
    result = _runner().main(["--quick", "--output_dir", str(tmp_path)])
    seed = result["per_seed"]["0"]
    full, oracle = seed["reference"]["full"], seed["reference"]["oracle"]
    assert full["metrics"]["forget_acc"] >= 0.95, full["metrics"]
    assert oracle["metrics"]["forget_acc"] <= 0.15, oracle["metrics"]
    assert not full["collapse"] and full["tier1"]["T2"] and full["tier1"]["T3"]

    ga, simnpo = seed["methods"]["ga"], seed["methods"]["simnpo"]
    assert ga["collapse"], (ga["ra_ratio"], ga["metrics"]["over_forgetting"])
    assert simnpo["tier1"]["passed"], simnpo["tier1"]
    assert not simnpo["collapse"]
    assert set(seed["methods"]) == {"ga", "graddiff", "simnpo"}

    saved = json.loads((tmp_path / "tinytofu.json").read_text())
    assert saved["criteria"]["a"]["passed"] and saved["criteria"]["b"]["passed"]
    assert (tmp_path / "tinytofu.png").stat().st_size > 10_000
    assert "| SimNPO |" in (tmp_path / "tinytofu.md").read_text()


def test_committed_results_cover_every_method_on_three_seeds():
    """The table the docs quote: every method of the runner on seeds 0-2, with the criteria recorded."""
    runner = _runner()
    data = json.loads(open(os.path.join(ROOT, "experiments", "results", "tinytofu.json")).read())
    assert data["config"]["seeds"] == [0, 1, 2]
    assert set(data["config"]["methods"]) == set(runner.METHODS)
    assert set(data["criteria"]) == {"a", "b", "c"}
    for seed in ("0", "1", "2"):
        assert set(data["per_seed"][seed]["methods"]) == set(runner.METHODS)
