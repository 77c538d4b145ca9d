"""Two CPU processes (gloo DDP) give the update of one process on the same global batch, for every objective."""

import os

import pytest
from launch_helpers import launch_two_processes
from safetensors.torch import load_file
from sft_helpers import GLOBAL_BATCH, OBJECTIVES, assert_same_update, one_step_update


pytestmark = [pytest.mark.slow, pytest.mark.distributed]
SCRIPT = os.path.join(os.path.dirname(__file__), "sft_ddp_script.py")


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
