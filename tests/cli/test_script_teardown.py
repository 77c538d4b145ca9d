"""`hf_stable.scripts.teardown.finish`, the last call of the sft/grpo/unlearn scripts: barrier, `Trainer.end()`, and
under a launcher (``WORLD_SIZE`` > 1) `os._exit(0)` after flushing, so no gloo worker thread frees a collective's work
object during interpreter finalization (`scripts/ddp_teardown_stress.py`; the 2-process CLI tests run it for real)."""

import os
import subprocess
import sys

import pytest


PROGRAM = """
import atexit, sys
from types import SimpleNamespace
from hf_stable.scripts.teardown import finish

trainer = SimpleNamespace(
    accelerator=SimpleNamespace(wait_for_everyone=lambda: print("barrier", end=" ")),
    end=lambda: print("end", end=" "),
)
atexit.register(lambda: print("finalized", flush=True))
print("buffered before finish", end=" ")  # no newline, no flush: finish must flush it
sys.stderr.write("stderr before finish")
finish(trainer)
print("returned")
"""


@pytest.mark.parametrize("world_size", ["1", "2"])
def test_finish_exits_without_finalization_only_under_a_launcher(world_size):
    env = {**os.environ, "WORLD_SIZE": world_size}
    result = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("buffered before finish barrier end")  # in this order, and flushed
    assert "stderr before finish" in result.stderr
    if world_size == "2":  # left at once: nothing after finish, no atexit handler, no finalization
        assert "returned" not in result.stdout and "finalized" not in result.stdout
    else:  # one process: finish returns and the interpreter ends normally
        assert "end returned" in result.stdout and "finalized" in result.stdout
