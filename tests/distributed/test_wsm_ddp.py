"""WSMCallback under two CPU processes (gloo DDP): only rank 0 keeps the window and writes, merged evaluation is the
same on both ranks and restores their weights bit-exactly, both finish, and a resumed run equals an uninterrupted
one."""

import json
import os

import pytest
import torch
from launch_helpers import launch_two_processes
from safetensors.torch import load_file


pytestmark = [pytest.mark.slow, pytest.mark.distributed]
SCRIPT = os.path.join(os.path.dirname(__file__), "wsm_ddp_script.py")


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("wsm-ddp")
    launch_two_processes(SCRIPT, str(out), port=29711)
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    return out, reports


def test_only_rank0_holds_and_writes(ddp_run):
    out, (r0, r1) = ddp_run
    assert r0["holds_window"] and r0["stored"] == 3 and r0["prev"]  # base + k = 2 deltas
    assert not r1["holds_window"] and r1["stored"] == 0 and not r1["prev"]
    assert r0["steps"] == r1["steps"] == [4, 6, 8]
    full = out / "full"
    for folder in (full / "wsm-merged", full / "checkpoint-4" / "wsm-merged", full / "checkpoint-8" / "wsm-merged"):
        assert (folder / "model.safetensors").is_file(), folder
    state = full / "checkpoint-4" / "wsm_state"
    assert sorted(os.listdir(state)) == sorted(
        ["base.safetensors", "prev.safetensors", "delta-2.safetensors", "delta-4.safetensors", "wsm_state.json"]
    )
    leftovers = [p for p in full.rglob("*") if ".tmp" in p.name or p.name.startswith("wsm_window")]
    assert not leftovers, leftovers


def test_merged_eval_same_on_both_ranks(ddp_run):
    _, (r0, r1) = ddp_run
    assert r0["restored"] and r1["restored"]
    assert r0["eval_wsm_losses_all_ranks"][0] == pytest.approx(r0["eval_wsm_losses_all_ranks"][1], rel=1e-6)
    assert r0["eval_wsm_logged"] == [2, 4, 6, 8] == r1["eval_wsm_logged"]


def test_merge_matches_snapshots_and_resume(ddp_run):
    out, (r0, r1) = ddp_run
    expected = load_file(str(out / "expected.safetensors"))
    full = load_file(str(out / "full" / "wsm-merged" / "model.safetensors"))
    split = load_file(str(out / "split" / "wsm-merged" / "model.safetensors"))
    assert r0["resumed_steps"] == r1["resumed_steps"] == [4, 6, 8]
    for name, want in expected.items():
        torch.testing.assert_close(full[name], want, atol=1e-6, rtol=0, msg=name)
        torch.testing.assert_close(split[name], full[name], atol=1e-6, rtol=0, msg=name)
