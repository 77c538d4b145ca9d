"""Two CPU processes (gloo DDP) give the update of one process on the same global batch, for every objective."""

import os
import subprocess
import sys

import pytest
from safetensors.torch import load_file
from sft_helpers import GLOBAL_BATCH, OBJECTIVES, assert_same_update, one_step_update


pytestmark = [pytest.mark.slow, pytest.mark.distributed]
SCRIPT = os.path.join(os.path.dirname(__file__), "sft_ddp_script.py")


def launch_two_processes(script, *args, port):
    """`accelerate launch --multi_gpu --num_processes 2` (on a CPU box `--cpu` would run ONE process)."""
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(port),
        script,
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def ddp_updates(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    launch_two_processes(SCRIPT, str(out), ",".join(OBJECTIVES), port=29631)
    return load_file(str(out / "updates.safetensors"))


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_two_processes_match_one(ddp_updates, tmp_path, name):
    single, trainer = one_step_update(tmp_path, GLOBAL_BATCH, 1, **OBJECTIVES[name])
    for accumulation in (1, 2):  # 2 x 4 and 2 x 2 x GA 2
        assert_same_update(ddp_updates[f"{name}/ga{accumulation}"], single)
    if trainer._multipliers is not None:
        assert_same_update(ddp_updates[f"{name}/ga1/multipliers"], trainer._multipliers)
