"""Two CPU processes give the advantages and the update of one process on the same global batch: every group
statistic is computed on the gathered batch."""

import os

import pytest
import torch
from grpo_ddp_script import VARIANTS
from grpo_helpers import G, grpo_run
from launch_helpers import launch_two_processes
from safetensors.torch import load_file
from sft_helpers import assert_same_update


pytestmark = [pytest.mark.slow, pytest.mark.distributed]
SCRIPT = os.path.join(os.path.dirname(__file__), "grpo_ddp_script.py")


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("grpo_ddp")
    launch_two_processes(SCRIPT, str(out), ",".join(VARIANTS), port=29651)
    return load_file(str(out / "grpo_updates.safetensors"))


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_two_processes_match_one(ddp_results, tmp_path, name):
    single, trainer = grpo_run(tmp_path, batch_size=2 * G, **VARIANTS[name])
    torch.testing.assert_close(
        ddp_results[f"{name}/advantages"], torch.tensor(list(trainer._logs["advantages"])), rtol=1e-6, atol=1e-7
    )
    assert_same_update(ddp_results[f"{name}/update"], single, rtol=1e-5)
    if name == "ctwa":
        torch.testing.assert_close(ddp_results["ctwa/log_weights"], trainer._controller.log_weights)
