"""Stress the end of a 2-process CPU (gloo) run: does tearing the process group down ever hang?

One clean-clone CI run once hung after "Model and card saved" in the 2-process `hf-stable sft` test, before the
scripts waited for every rank ahead of `Trainer.end()` (commit 65a3f3b). This script repeats the end of such a run
many times, in three orders, through the same launcher (`accelerate launch --multi_gpu`, torch elastic, gloo):

* ``barrier`` (what `hf_stable/scripts/{sft,grpo}.py` did from 65a3f3b on): a few DDP steps, main-process-only file
  writing, then `wait_for_everyone()` and `end_training()` (which destroys the process group) on every rank;
* ``no_barrier`` (the order before 65a3f3b): the other rank destroys the group and exits while the main process is
  still writing;
* ``finish`` (what the scripts do now): `hf_stable.scripts.teardown.finish`, i.e. ``barrier`` and then, under the
  launcher, ``os._exit(0)`` after flushing instead of interpreter finalization.

Each trial gets ``--timeout`` seconds; a trial that runs past it is a hang: every process of its tree gets SIGABRT,
which ``PYTHONFAULTHANDLER=1`` turns into a dump of every thread's Python stack, saved under ``--out``. The variants
alternate in a random order. A failure's log holds what the ranks printed; for native stacks run it with core dumps
on (``ulimit -c unlimited``) and read a core with ``gdb -batch -ex "thread apply all bt" python core``. The JSON
report (``--out``/ddp_teardown_stress.json) holds per-variant trial counts, hangs, failures and wall times.

    OMP_NUM_THREADS=1 python scripts/ddp_teardown_stress.py --trials 40 --out /tmp/teardown
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


VARIANTS = ("no_barrier", "barrier", "finish")


def worker(variant: str, out: str) -> None:
    """One rank: DDP steps on a tiny model, main-process-only writing, then the variant's teardown order."""
    import torch
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    for _ in range(5):  # gradient all-reduces over gloo
        loss = model(torch.randn(8, 64)).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    if accelerator.is_main_process:  # stands for save_model's tail, the model card and the push plan
        path = Path(out) / f"card_{os.getpid()}.bin"
        path.write_bytes(os.urandom(1 << 20))
        time.sleep(random.uniform(0.0, 0.5))
        path.unlink()
    if variant == "finish":
        from types import SimpleNamespace

        from hf_stable.scripts.teardown import finish

        finish(SimpleNamespace(accelerator=accelerator, end=accelerator.end_training))
    if variant == "barrier":
        accelerator.wait_for_everyone()
    accelerator.end_training()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _abort_tree(proc: subprocess.Popen) -> tuple[str, str]:
    import psutil

    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        children = []
    for p in [*reversed(children), psutil.Process(proc.pid)]:
        try:
            p.send_signal(signal.SIGABRT)
        except psutil.NoSuchProcess:
            pass
    time.sleep(3)
    for p in children:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    try:
        return proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.communicate()


def trial(variant: str, out: Path, timeout: float, one_core: bool = False) -> dict:
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", str(_free_port()), __file__, "--worker", variant, "--out", str(out),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    start = time.time()
    pin = (lambda: os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})) if one_core else None
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, preexec_fn=pin)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        hung = False
    except subprocess.TimeoutExpired:
        stdout, stderr = _abort_tree(proc)
        hung = True
    record = {"variant": variant, "hung": hung, "returncode": proc.returncode, "wall_s": time.time() - start}
    if proc.returncode != 0 and "terminate called without an active exception" in stderr:
        record["abort"] = "terminate called without an active exception"
    if hung or proc.returncode != 0:
        log = out / f"{variant}_{int(start)}_{'hang' if hung else 'fail'}.log"
        log.write_text(f"$ {' '.join(cmd)}\n--- stdout ---\n{stdout}\n--- stderr ---\n{stderr}")
        record["log"] = log.name
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=40, help="trials per variant")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds before a trial counts as hung")
    parser.add_argument("--out", default="ddp_teardown_stress")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--one_core",
        action="store_true",
        help="pin the launcher and both ranks to one CPU: the gloo threads wait longer for it (a wider window)",
    )
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.worker:
        worker(args.worker, str(out))
        return 0
    order = [v for v in args.variants for _ in range(args.trials)]
    random.Random(args.seed).shuffle(order)
    records = []
    for i, variant in enumerate(order, 1):
        records.append(trial(variant, out, args.timeout, args.one_core))
        r = records[-1]
        state = "HANG" if r["hung"] else r["returncode"]
        print(f"[{i}/{len(order)}] {variant}: {state} {r['wall_s']:.1f}s", flush=True)
    summary = {
        v: {
            "trials": sum(r["variant"] == v for r in records),
            "hangs": sum(r["variant"] == v and r["hung"] for r in records),
            "failures": sum(r["variant"] == v and not r["hung"] and r["returncode"] != 0 for r in records),
            "aborts": sum(r["variant"] == v and "abort" in r for r in records),
            "max_wall_s": max((r["wall_s"] for r in records if r["variant"] == v), default=0.0),
        }
        for v in args.variants
    }
    report = {
        "summary": summary,
        "timeout_s": args.timeout,
        "one_core": args.one_core,
        "cpus": len(os.sched_getaffinity(0)),
        "trials": records,
        "command": "python scripts/ddp_teardown_stress.py " + " ".join(sys.argv[1:]),
    }
    (out / "ddp_teardown_stress.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
