"""2-process gloo DDP with anomalies on rank 1 only: both ranks skip and roll back together, no hang."""

import json
import os

import pytest
from launch_helpers import launch_two_processes
from stability.guard_helpers import pretrained_tiny


pytestmark = [pytest.mark.slow, pytest.mark.distributed]
SCRIPT = os.path.join(os.path.dirname(__file__), "guard_ddp_script.py")


def test_anomaly_on_rank_1_only_makes_both_ranks_act_together(tmp_path):
    model_dir = pretrained_tiny(tmp_path / "pretrained", steps=300)
    out = tmp_path / "ddp"
    out.mkdir()
    launch_two_processes(SCRIPT, model_dir, str(out), port=29773)  # the script dumps its stacks and exits on a hang
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world"] for r in ranks] == [2, 2]
    assert ranks[0]["nan_injected"] == [] and ranks[1]["nan_injected"] == [56]
    decisions = ranks[0]["decisions"]
    assert decisions == ranks[1]["decisions"]
    assert [(s, k, a) for s, k, a, _ in decisions] == [
        (40, "loss", "skip"), (50, "loss", "skip"), (51, "loss", "rollback"), (56, "nonfinite", "skip")]
    assert decisions[2][3] <= 49  # a confirmed snapshot from before the faults
    assert ranks[0]["state"] == ranks[1]["state"]
    assert ranks[0]["checksum"] == ranks[1]["checksum"]
    assert not ranks[0]["has_nan"] and not ranks[1]["has_nan"]
