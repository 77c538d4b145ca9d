"""Every unlearning method: two CPU processes (gloo DDP) × batch 4 give the update of one process × batch 8 —
including the multi-gradient methods, which reduce their gradients themselves."""

import os

import pytest
from launch_helpers import launch_two_processes
from safetensors.torch import load_file
from sft_helpers import assert_same_update
from unlearn_helpers import GLOBAL_BATCH, METHODS, unlearn_update


pytestmark = [pytest.mark.slow, pytest.mark.distributed]
SCRIPT = os.path.join(os.path.dirname(__file__), "unlearn_ddp_script.py")


@pytest.fixture(scope="module")
def ddp_updates(tmp_path_factory):
    out = tmp_path_factory.mktemp("unlearn_ddp")
    launch_two_processes(SCRIPT, str(out), ",".join(METHODS), port=29691)
    return load_file(str(out / "unlearn_updates.safetensors"))


@pytest.mark.parametrize("name", sorted(METHODS))
def test_two_processes_match_one(ddp_updates, tmp_path, name):
    single, _ = unlearn_update(tmp_path, GLOBAL_BATCH, 1, **METHODS[name])
    assert_same_update(ddp_updates[name], single, rtol=1e-5)
