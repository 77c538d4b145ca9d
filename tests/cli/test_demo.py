"""`hf-stable demo` (what `make demo` runs) end to end, in its short form."""

import json

import pytest

from hf_stable.cli.main import main


@pytest.mark.slow
def test_demo_quick(tmp_path, capsys):
    assert main(["demo", "--output_dir", str(tmp_path), "--quick"]) == 0
    printed = capsys.readouterr().out
    assert "held-out exact match" in printed and "nll" in printed and "-p" in printed
    results = json.loads((tmp_path / "results.json").read_text())
    assert [r["objective"] for r in results["results"]] == ["nll", "-p"]
    for run in results["results"]:
        assert 0 <= run["exact_match"] <= 1 and 0 < run["mean_p"] < 1 and run["history"]
    assert (tmp_path / "loss_curves.png").stat().st_size > 10_000
    assert "fictitious authors on TinyTOFU" in printed and "forget accuracy" in printed
    unlearning = results["unlearning"]
    assert unlearning["before"]["forget_acc"] >= 0.95  # the TinyTOFU model memorised the authors to forget
    assert unlearning["after"]["forget_acc"] < unlearning["before"]["forget_acc"]
