"""Launching several CPU processes for the distributed tests."""

import os
import subprocess
import sys


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
