"""The overhead benchmarks: each script runs end to end at its `--quick` size and writes the shared result schema; the
paired statistics match an independent recomputation from the per-repeat raw values; the committed results have the
same schema."""

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
SCRIPTS = ("sft_overhead", "grpo_overhead", "adapters_overhead")
BASELINES = {
    "sft_overhead": "trl",
    "grpo_overhead": "trl",
    "adapters_overhead": "lora",
    "grpo_overhead_default": "trl",
}
# the GRPO default arm alone against TRL, with more repeats, for its <= 1.02x claim
COMMITTED = (*SCRIPTS, "grpo_overhead_default")

sys.path.insert(0, str(BENCH))
import _paired  # noqa: E402


def check_schema(result: dict, name: str) -> None:
    keys = {
        "benchmark",
        "setup",
        "protocol",
        "baseline",
        "baseline_cpu_step_ms",
        "baseline_step_ge_100ms",
        "arms",
        "claims",
        "per_repeat",
        "wall_s",
        "git_commit",
    }
    assert keys <= result.keys()
    assert result["benchmark"] == name
    baseline = result["baseline"]
    assert baseline == BASELINES[name]
    arms = list(result["arms"])
    repeats = result["per_repeat"]
    assert len(repeats) == result["setup"]["repeats"] >= 2
    for rep in repeats:
        assert sorted(rep["order"]) == sorted(arms)
        assert set(rep["results"]) == set(arms)
        assert all(run["n_steps"] == result["setup"]["timed_steps"] for run in rep["results"].values())
    assert result["baseline_step_ge_100ms"] == (result["baseline_cpu_step_ms"] >= 100)
    for arm, row in result["arms"].items():
        for clock, key in _paired.CLOCKS:
            cell = row[clock]
            # recomputed from the raw per-repeat step times: pairing is within a repeat
            ratios = [rep["results"][arm][key] / rep["results"][baseline][key] for rep in repeats]
            assert cell["ratios"] == pytest.approx(ratios, rel=1e-12)
            assert cell["ratio_mean"] == pytest.approx(statistics.fmean(ratios), rel=1e-12)
            low, high = cell["ratio_ci95"]
            assert min(ratios) <= low <= high <= max(ratios)
            steps = [rep["results"][arm][key] for rep in repeats]
            assert cell["step_ms_mean"] == pytest.approx(1e3 * statistics.fmean(steps), rel=1e-12)
            if arm == baseline:
                assert ratios == [1.0] * len(ratios)
    for arm, claim in result["claims"].items():
        assert claim["clock"] == "cpu"
        assert claim["ratio_ci95"] == result["arms"][arm]["cpu"]["ratio_ci95"]
        assert claim["verdict"] == _paired.verdict(claim["ratio_ci95"], claim["target"])


@pytest.mark.slow
@pytest.mark.parametrize("name", SCRIPTS)
def test_quick_run_writes_the_schema(name, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(BENCH / f"{name}.py"), "--quick", "--output_dir", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / f"{name}.json").read_text())
    check_schema(result, name)
    assert result["setup"]["quick"] is True
    markdown = (tmp_path / f"{name}.md").read_text()
    for arm in result["arms"]:
        assert f"| {arm} |" in markdown
    if name == "grpo_overhead":  # lr 0: every arm generated the same completions
        assert result["equal_work"]["identical"] is True


@pytest.mark.parametrize("name", COMMITTED)
def test_committed_result_has_the_schema(name):
    path = BENCH / "results" / f"{name}.json"
    if not path.exists():
        pytest.fail(f"{path} is not committed")
    result = json.loads(path.read_text())
    check_schema(result, name)
    assert result["setup"]["quick"] is False
    assert result["baseline_step_ge_100ms"] is True


def test_bootstrap_interval_of_constant_and_of_spread_values():
    assert _paired.bootstrap_mean([1.5] * 6) == (1.5, 1.5)
    values = [0.9, 1.0, 1.1, 1.2, 1.3]
    low, high = _paired.bootstrap_mean(values)
    assert 0.9 < low < statistics.fmean(values) < high < 1.3


def test_verdict_and_describe_resolve_only_when_the_interval_is_one_sided():
    assert _paired.verdict([0.99, 1.015], 1.02) == "≤ 1.02× (resolved)"
    assert _paired.verdict([1.021, 1.05], 1.02) == "> 1.02× (resolved)"
    assert _paired.verdict([0.97, 1.03], 1.02) == "within ±3.0 % (does not resolve 1.02×)"
    assert _paired.describe([0.97, 1.03], 1.0) == "within ±3.0 %"
    assert _paired.describe([1.10, 1.20], 1.15) == "+15.0 % [+10.0, +20.0]"


def test_check_args_refuses_a_single_repeat():
    args = _paired.parser("x", repeats=1, steps=2, warmup=1).parse_args([])
    with pytest.raises(ValueError, match="--repeats"):
        _paired.check_args(args)


def test_step_clock_discards_the_warmup_steps():
    clock = _paired.StepClock()
    clock.wall, clock.cpu = [0.0, 5.0, 6.0, 8.0], [0.0, 4.0, 5.0, 7.0]
    assert clock.summary(1) == {"wall_step_s": 1.5, "cpu_step_s": 1.5, "n_steps": 2}


DOC_PAGES = {"sft_overhead": "docs/sft.md", "grpo_overhead": "docs/grpo.md", "adapters_overhead": "docs/adapters.md"}


@pytest.mark.parametrize("name", SCRIPTS)
def test_docs_quote_the_committed_numbers(name):
    """Every row of the page's overhead table that names an arm quotes that arm's committed CPU ratio and interval."""
    import re

    result = json.loads((BENCH / "results" / f"{name}.json").read_text())
    text = (ROOT / DOC_PAGES[name]).read_text()
    section = text[text.index("## Overhead") :]
    section = section[: section.index("\n## ", 1)]
    rows = re.findall(r"^\| `(\w+)`[^|]*\|.*?\| (\d\.\d{3}) \[(\d\.\d{3}), (\d\.\d{3})\] \| ([^|]+) \|", section, re.M)
    assert {arm for arm, *_ in rows} == set(result["arms"]) - {result["baseline"]}
    for arm, mean, low, high, overhead in rows:
        cpu = result["arms"][arm]["cpu"]
        assert (mean, low, high) == tuple(f"{v:.3f}" for v in (cpu["ratio_mean"], *cpu["ratio_ci95"])), arm
        assert overhead.strip() == _paired.describe(cpu["ratio_ci95"], cpu["ratio_mean"]), arm


def test_docs_quote_the_committed_default_claim():
    result = json.loads((BENCH / "results" / "grpo_overhead_default.json").read_text())
    assert list(result["arms"]) == ["trl", "default"]
    claim = result["claims"]["default"]
    assert claim["target"] == 1.02
    quoted = f"{claim['ratio_mean']:.3f} [{claim['ratio_ci95'][0]:.3f}, {claim['ratio_ci95'][1]:.3f}]"
    text = (ROOT / "docs/grpo.md").read_text()
    assert quoted in text
    assert f"{result['setup']['repeats']} paired repeats" in text


def test_select_arms_keeps_the_baseline_and_refuses_unknown_arms():
    p = _paired.parser("x", repeats=2, steps=1, warmup=1)
    assert _paired.select_arms(p.parse_args([]), ["trl", "a", "b"], "trl") == ["trl", "a", "b"]
    assert _paired.select_arms(p.parse_args(["--arms", "b"]), ["trl", "a", "b"], "trl") == ["trl", "b"]
    with pytest.raises(ValueError, match="--arms: unknown \\['c'\\]"):
        _paired.select_arms(p.parse_args(["--arms", "c"]), ["trl", "a", "b"], "trl")


def test_readme_quotes_the_committed_example_runtimes():
    """The README's example runtimes are the committed run's: every example ran, within its limit, and the quoted CPU
    range is that run's minimum and maximum."""
    result = json.loads((BENCH / "results" / "examples_runtime.json").read_text())
    examples = {p.stem for p in (ROOT / "examples").glob("*_smollm2*.py")}
    assert {r["example"] for r in result["runs"]} == examples
    assert all(r["returncode"] == 0 and r["within_limit"] and r["cpu_s"] <= result["limit_s"] for r in result["runs"])
    cpu = [r["cpu_s"] for r in result["runs"]]
    assert f"({min(cpu):.0f}–{max(cpu):.0f} s;" in (ROOT / "README.md").read_text()
