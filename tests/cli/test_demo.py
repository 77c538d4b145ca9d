"""`hf-stable demo` (what `make demo` runs): every stage at reduced size in a fresh process (so import-time library
messages are seen too), then its outputs: results.json, the summary table, the plots, the merged model reloaded with
plain transformers and generating, and no library warning on stderr."""

import json
import os
import subprocess
import sys

import pytest

from hf_stable.cli.demo import STAGE_NAMES, parse_stages
from hf_stable.cli.main import main


def test_parse_stages():
    assert parse_stages(None) == list(STAGE_NAMES) == parse_stages("all")
    assert parse_stages("merge, sft") == ["sft", "merge"]  # the demo's order, whatever the user's
    with pytest.raises(ValueError, match=r"unknown stage 'grpoo'\. Allowed values: sft, grpo, merge"):
        parse_stages("sft,grpoo")
    with pytest.raises(ValueError, match="unknown stage ''"):
        parse_stages("sft,")


def test_bad_stage_and_missing_input_stage(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--stages", "sft,fine-tune", "--output_dir", str(tmp_path)])
    assert exit_info.value.code == 2 and "unknown stage 'fine-tune'" in capsys.readouterr().err
    assert main(["demo", "--quick", "--stages", "merge", "--output_dir", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert "written by the 'sft' stage" in err and "--stages sft" in err


@pytest.mark.parametrize("quick", [True, False])
def test_heldout_set_is_disjoint_from_every_training_row(tmp_path, quick):
    """Every stage scores held-out problems that no training row contains: the SFT rows, GRPO's prompts and the
    stability run's rows all come from the problems left after the held-out ones."""
    from hf_stable.cli.demo import _Context

    ctx = _Context(str(tmp_path), quick)
    test = set(ctx.test["prompt"])
    assert len(test) == ctx.sizes.test_rows and len(ctx.sft_rows) == ctx.sizes.sft_problems
    assert not test & set(ctx.sft_rows["prompt"]) and not test & set(ctx.fresh_rows["prompt"])
    assert not set(ctx.sft_rows["prompt"]) & set(ctx.fresh_rows["prompt"])  # GRPO's prompts are fresh
    assert len(ctx.fresh_rows) >= ctx.sizes.grpo_steps * ctx.sizes.grpo_batch // 8 + 8 * ctx.sizes.guard_steps


@pytest.mark.slow
def test_demo_all_stages_quick(tmp_path):
    out = tmp_path / "demo_output"
    script = os.path.join(os.path.dirname(sys.executable), "hf-stable")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("HF_HUB_OFFLINE", None)  # as a user runs it: the demo itself must keep the libraries off the Hub
    result = subprocess.run([script, "demo", "--quick", "--output_dir", str(out)], capture_output=True, text=True,
                            env=env, timeout=1500)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Warning" not in result.stderr and "warnings.warn" not in result.stderr, result.stderr[-3000:]
    assert "kernels-community" not in result.stdout + result.stderr
    assert "not accepted" not in result.stderr  # the demo reports the TinyTOFU model's bar in results.json instead

    results = json.loads((out / "results.json").read_text())
    stages = results["stages"]
    assert list(stages) == list(STAGE_NAMES) and results["quick"] is True
    table = result.stdout[result.stdout.index("stage  ") :]
    for row in results["summary"]:  # one printed row per stage, with its wall time and artifacts folder
        assert row["wall_time_s"] >= 0 and os.path.exists(row["artifacts"])
        line = next(line for line in table.splitlines() if line.startswith(row["stage"] + " "))
        assert row["what"] in line and row["before"] in line and row["after"] in line

    sft = stages["sft"]
    assert set(sft["runs"]) == {"nll", "-p"} and all(0 <= r["exact_match"] <= 1 for r in sft["runs"].values())
    grpo = stages["grpo"]
    assert {r["advantage_estimator"] for r in grpo["runs"].values()} == {"grpo", "sgrpo", "maxrl"}
    for run in grpo["runs"].values():  # the gain over the SFT start, and the held-out curve at every checkpoint
        assert run["gain"] == pytest.approx(run["exact_match"] - grpo["exact_match_sft"], abs=1e-4)
        assert [p[0] for p in run["heldout_curve"]] == [0, *range(2, grpo["steps"] + 1, 2)]
    merge = stages["merge"]["exact_match"]
    assert {"s-grpo", "maxrl", "merge wsm", "merge fisher-rao"} <= set(merge) and stages["merge"]["wsm_inputs"] >= 2
    unlearning = stages["unlearn"]
    assert unlearning["before"]["forget_acc"] >= 0.95  # the TinyTOFU model memorised the authors to forget
    accuracy = unlearning["tinytofu_model_accuracy"]  # the bar is on the trained authors: forget and retain
    assert unlearning["tinytofu_model_accepted"] == (min(accuracy["forget"], accuracy["retain"]) >= 0.98)
    assert unlearning["after"]["forget_acc"] < unlearning["before"]["forget_acc"]
    guard = stages["stability"]["runs"]
    assert guard["unguarded"]["guard_decisions"] == [] and any(
        d[2] == "rollback" for d in guard["guarded"]["guard_decisions"]
    )
    assert guard["guarded"]["final_loss_last5"] < guard["unguarded"]["final_loss_last5"]
    assert guard["clean"]["guard_decisions"] == []
    push = stages["push"]
    folder = out / "merge" / "fisher-rao"
    assert set(push["files"]) == {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    assert "Planned Hub commit" in result.stdout and push["repo_id"] in result.stdout
    for png in ("sft/loss_curves.png", "grpo/reward_curves.png", "stability/spike.png"):
        assert (out / png).stat().st_size > 10_000, png

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder)  # the merged folder, with plain transformers
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer("12+34=", add_special_tokens=False, return_tensors="pt")["input_ids"]
    generated = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert generated.shape[1] > ids.shape[1] and torch.isfinite(model(generated).logits).all()
    assert set(stages["merge"]["generated_by_fisher_rao_merge"]) == {r["prompt"] for r in list(_test_rows())[:3]}

    # a subset run updates its stage and keeps the others' numbers
    assert main(["demo", "--quick", "--stages", "push", "--output_dir", str(out)]) == 0
    again = json.loads((out / "results.json").read_text())
    assert list(again["stages"]) == list(STAGE_NAMES) and again["stages"]["sft"] == stages["sft"]


def _test_rows():
    from hf_stable.cli.demo import _Context

    return _Context("unused", quick=True).test
