"""Launching several CPU processes for the distributed tests, and failing with every process's stack on a hang."""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest


# A hung multi-process test fails after this many seconds (the slowest launch takes about 3 minutes on 2 busy cores).
DEFAULT_TIMEOUT = int(os.environ.get("HF_STABLE_LAUNCH_TIMEOUT", "900"))


def arm_hang_dump():
    """In a launched script: dump every thread's stack and exit a minute before the launching test's timeout, so a
    hang inside one rank shows where it is even if the parent's SIGABRT does not reach it."""
    import faulthandler

    faulthandler.dump_traceback_later(max(60, DEFAULT_TIMEOUT - 60), exit=True)


def run_with_stacks(cmd, *, timeout=DEFAULT_TIMEOUT, env=None, check=True):
    """`subprocess.run(cmd)` that never hangs past ``timeout``: on expiry every process of the tree (the launcher, the
    torch elastic agent and the ranks, which torch starts in their own sessions) gets SIGABRT, which
    `PYTHONFAULTHANDLER=1` turns into a dump of all its threads' Python stacks on stderr; the test then fails with
    that output. ``check``: also fail on a non-zero exit status, with the output's tail.
    """
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1", **(env or {})}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stdout, stderr = _abort_tree(proc)
        pytest.fail(
            f"{' '.join(map(str, cmd[:6]))} ... hung for {timeout} s; the stacks of every process follow.\n"
            f"--- stdout (tail) ---\n{stdout[-4000:]}\n--- stderr (tail, with the stacks) ---\n{stderr[-20000:]}"
        )
    result = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    if check:
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def _abort_tree(proc):
    """SIGABRT to the ranks first (their stacks are the interesting ones), then to the launcher; collect output."""
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        children = []
    for child in reversed(children):  # deepest first
        try:
            child.send_signal(signal.SIGABRT)
        except psutil.NoSuchProcess:
            pass
    time.sleep(5)  # let the faulthandler dumps reach the pipes before the launcher goes
    proc.send_signal(signal.SIGABRT)
    try:
        return proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        for p in [*children, proc]:
            try:
                p.kill()
            except (psutil.NoSuchProcess, ProcessLookupError):
                pass
        return proc.communicate()


def end_rank():
    """Last call of a launched rank script, as the CLI scripts end (`hf_stable/scripts/teardown.py`): every rank
    waits, the process group goes, and the rank leaves without interpreter finalization, so no gloo worker thread frees
    a collective's work object while the interpreter finalizes (the abort docs/distributed.md shows)."""
    import torch.distributed as dist

    from hf_stable.scripts.teardown import leave_without_finalization

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    leave_without_finalization()


def launch_two_processes(script, *args, port, timeout=DEFAULT_TIMEOUT):
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
    return run_with_stacks(cmd, timeout=timeout)
