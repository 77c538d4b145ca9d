"""MAP and sine adapters: two CPU processes (gloo DDP) give the update of one process on the same global batch,
under both trainers."""

import os

import pytest
from adapters_ddp_script import RUNS, run
from launch_helpers import launch_two_processes
from safetensors.torch import load_file
from sft_helpers import assert_same_update


pytestmark = [pytest.mark.slow, pytest.mark.distributed]
SCRIPT = os.path.join(os.path.dirname(__file__), "adapters_ddp_script.py")


@pytest.fixture(scope="module")
def ddp_updates(tmp_path_factory):
    out = tmp_path_factory.mktemp("adapters_ddp")
    launch_two_processes(SCRIPT, str(out), ",".join(RUNS), port=29671)
    return load_file(str(out / "adapter_updates.safetensors"))


@pytest.mark.parametrize("name", sorted(RUNS))
def test_two_processes_match_one(ddp_updates, tmp_path, name):
    single, _ = run(name, str(tmp_path), processes=1)
    assert_same_update(ddp_updates[name], single, rtol=1e-5)
