"""Every experiment result has the harness's schema; the harness writes it, caches seeds, reruns on code changes."""

import json
import sys
from pathlib import Path

import pytest


EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"
sys.path.insert(0, str(EXPERIMENTS))
import _harness  # noqa: E402


RESULT_FILES = sorted((EXPERIMENTS / "results").glob("*.json"))


def toy_experiment(calls: list, script: str) -> "_harness.Experiment":
    def run_seed(seed, sizes):
        calls.append(seed)
        return {"score": seed * sizes["scale"]}

    def aggregate(per_seed):
        return {"score": _harness.mean_std([r["score"] for r in per_seed.values()])}

    def criteria(per_seed, agg):
        return {
            "a": _harness.criterion(
                "mean score ≥ 1",
                agg["score"]["mean"] >= 1,
                {"mean": agg["score"]["mean"]},
                _harness.seeds_holding(per_seed, lambda r: r["score"] >= 1),
            )
        }

    def plot(result, path):
        path.write_bytes(b"png")

    return _harness.Experiment(
        name="toy",
        title="Toy",
        claim="a toy claim",
        sizes={"scale": 1.0},
        quick_sizes={"scale": 0.5},
        run_seed=run_seed,
        aggregate=aggregate,
        criteria=criteria,
        plot=plot,
        markdown=lambda r: f"score {_harness.fmt(r['aggregate']['score'])}",
        script=script,
    )


def test_harness_writes_schema_and_caches(tmp_path, monkeypatch):
    monkeypatch.setattr(_harness, "CACHE", tmp_path / "cache")
    script = tmp_path / "toy.py"
    script.write_text("x = 1\n")
    calls = []
    exp = toy_experiment(calls, str(script))
    result = _harness.run(exp, ["--out", str(tmp_path / "out"), "--seeds", "0", "1", "2"])
    assert calls == [0, 1, 2]
    data = json.loads((tmp_path / "out" / "toy.json").read_text())
    assert set(_harness.SCHEMA_KEYS) <= set(data)
    assert data["aggregate"]["score"]["mean"] == pytest.approx(1.0) and data["passed"] is True
    assert data["criteria"]["a"]["per_seed"] == "2/3 seeds"  # seeds 1 and 2
    md = (tmp_path / "out" / "toy.md").read_text()
    assert "PASS" in md and "a toy claim" in md and "--seeds 0 1 2" not in md  # default seeds are not repeated
    assert result["cached_seeds"] == []

    again = _harness.run(exp, ["--out", str(tmp_path / "out"), "--seeds", "0", "1", "2"])
    assert calls == [0, 1, 2] and again["cached_seeds"] == [0, 1, 2]
    assert again["per_seed"] == result["per_seed"]

    script.write_text("x = 2\n")  # a code change invalidates the cache
    _harness.run(exp, ["--out", str(tmp_path / "out"), "--seeds", "0"])
    assert calls == [0, 1, 2, 0]

    quick = _harness.run(exp, ["--out", str(tmp_path / "q"), "--quick", "--no_cache"])
    assert quick["config"]["seeds"] == [0] and quick["config"]["sizes"] == {"scale": 0.5}
    assert quick["passed"] is False and "--quick" in quick["command"]
