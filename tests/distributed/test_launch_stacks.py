"""A hung multi-process test fails at its timeout with the Python stack of every process, the ranks included (torch
starts them in their own sessions, so killing the launcher alone would leave them running)."""

import os
import sys

import psutil
import pytest
from launch_helpers import run_with_stacks


pytestmark = [pytest.mark.slow, pytest.mark.distributed]
SCRIPT = os.path.join(os.path.dirname(__file__), "hang_script.py")


def test_hang_fails_with_the_stacks_of_both_ranks():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29751", SCRIPT]
    before = {p.pid for p in psutil.process_iter()}
    with pytest.raises(pytest.fail.Exception) as failed:
        run_with_stacks(cmd, timeout=60)  # the ranks only import torch.distributed: they hang within seconds
    message = str(failed.value)
    assert "hung for 60 s" in message
    # Both ranks dump into the launcher's one stderr at the same moment, and faulthandler writes each frame in pieces
    # (file, line, " in ", function), so the two dumps can interleave mid-line; each piece arrives whole.
    assert "never_arrives" in message, message[-3000:]  # rank 1's stack
    assert "barrier" in message and "distributed_c10d.py" in message, message[-3000:]  # rank 0's, in torch.distributed
    leftovers = [
        p
        for p in psutil.process_iter(["pid", "cmdline"])
        if p.pid not in before and SCRIPT in " ".join(p.info["cmdline"] or [])
    ]
    assert not leftovers, f"processes left running: {[p.pid for p in leftovers]}"


def test_every_launched_rank_script_ends_with_end_rank():
    """A rank script that returns into interpreter finalization can abort in the gloo teardown race
    (docs/distributed.md); a clean-clone CI run lost tests/stability/ess_ddp_script.py to it. Every script the tests
    launch on several ranks ends its `__main__` block with `end_rank()`."""
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    scripts = sorted(
        os.path.join(root, name)
        for root, _, names in os.walk(tests)
        for name in names
        if name.endswith("_script.py") and name != "hang_script.py"
    )
    assert len(scripts) >= 9
    for path in scripts:
        source = open(path).read()
        main_block = source[source.index('if __name__ == "__main__":') :]
        assert main_block.rstrip().endswith("end_rank()"), f"{os.path.relpath(path, tests)} lacks end_rank()"
