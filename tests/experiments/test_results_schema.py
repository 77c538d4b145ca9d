"""Every experiment result has the harness's schema; the harness writes it, caches seeds, reruns on code changes."""

import dataclasses
import json
import re
import sys
from pathlib import Path

import pytest


EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"
sys.path.insert(0, str(EXPERIMENTS))
import _harness  # noqa: E402


RESULT_FILES = sorted(p for p in (EXPERIMENTS / "results").glob("*.json") if p.stem != "index")  # index: evidence.py


def toy_experiment(calls: list, script: str) -> "_harness.Experiment":
    def run_seed(seed, sizes):
        calls.append(seed)
        return {"score": seed * sizes["scale"]}

    def aggregate(per_seed, sizes):
        return {"score": _harness.mean_std([r["score"] for r in per_seed.values()])}

    def criteria(per_seed, agg, sizes):
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

    script.write_text("x = 2\n")  # a change to the script invalidates its cache
    _harness.run(exp, ["--out", str(tmp_path / "out"), "--seeds", "0"])
    assert calls == [0, 1, 2, 0]

    quick = _harness.run(exp, ["--out", str(tmp_path / "q"), "--quick", "--no_cache"])
    assert quick["config"]["seeds"] == [0] and quick["config"]["sizes"] == {"scale": 0.5}
    assert quick["passed"] is False and "--quick" in quick["command"]


def test_size_flags_and_work_cache(tmp_path, monkeypatch):
    """A script's size flag overrides its sizes (cache key and command included); a `work_cache` seed gets a folder
    keyed like its record, so a code change gives a new one, and none under `--no_cache`."""
    monkeypatch.setattr(_harness, "CACHE", tmp_path / "cache")
    script = tmp_path / "toy.py"
    script.write_text("x = 1\n")
    calls, folders = [], []
    exp = toy_experiment(calls, str(script))
    seed_fn = exp.run_seed

    def run_seed(seed, sizes, folder):
        folders.append(folder)
        return seed_fn(seed, sizes)

    exp = dataclasses.replace(exp, run_seed=run_seed, work_cache=True, size_flags={"--scale": dict(type=float)})
    out = ["--out", str(tmp_path / "out"), "--seeds", "2"]
    base = _harness.run(exp, out)
    scaled = _harness.run(exp, [*out, "--scale", "3"])
    assert base["per_seed"]["2"]["score"] == 2.0 and scaled["per_seed"]["2"]["score"] == 6.0
    assert scaled["config"]["sizes"] == {"scale": 3.0} and scaled["command"].endswith("--seeds 2 --scale 3.0")
    assert "--scale" not in base["command"]
    assert folders[0] != folders[1] and folders[0].parent == tmp_path / "cache" / "toy"
    assert folders[0].with_suffix(".json").exists()  # the folder sits next to the seed's record, same key
    script.write_text("x = 2\n")
    _harness.run(exp, out)
    _harness.run(exp, [*out, "--no_cache"])
    assert folders[2] not in (folders[0], None) and folders[3] is None and len(calls) == 4


@pytest.mark.parametrize("path", RESULT_FILES, ids=lambda p: p.name)
def test_committed_result_has_the_shared_schema(path):
    """Every committed result (every stream's) carries the harness's keys, a verdict that agrees with its criteria,
    and the commit of the clean code that produced it."""
    data = json.loads(path.read_text())
    missing = [key for key in _harness.SCHEMA_KEYS if key not in data]
    assert not missing, f"{path.name} lacks {missing}"
    assert isinstance(data["claim"], str) and data["claim"].strip()
    assert isinstance(data["criteria"], dict) and data["criteria"]
    assert all(isinstance(c, dict) and isinstance(c.get("passed"), bool) for c in data["criteria"].values())
    assert data["passed"] is all(c["passed"] for c in data["criteria"].values())
    assert isinstance(data["per_seed"], dict) and data["per_seed"]
    assert isinstance(data["aggregate"], dict) and data["aggregate"]
    assert isinstance(data["wall_s"], (int, float)) and data["wall_s"] >= 0
    assert re.fullmatch(r"[0-9a-f]{7,40}", data["git_commit"]), f"not from committed code: {data['git_commit']}"
    assert re.fullmatch(r"[0-9a-f]{40}", data["code_digest"])
    assert not data.get("config", {}).get("quick"), "a --quick smoke result is committed"


def test_every_script_writes_its_committed_result():
    """Each experiment script has its committed JSON, and no committed JSON lacks a script."""
    not_experiments = {"evidence"}  # writes results/index.json from the results
    scripts = {p.stem for p in EXPERIMENTS.glob("*.py") if not p.name.startswith("_")} - not_experiments
    results = {p.stem for p in RESULT_FILES}
    assert scripts - results == set(), f"scripts without a committed result: {sorted(scripts - results)}"
    extra = {r for r in results if not any(r == s or r.startswith(f"{s}_") for s in scripts)}
    assert extra == set(), f"results without a script: {sorted(extra)}"
