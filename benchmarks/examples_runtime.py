"""How long each SmolLM2 example takes at its default ``--steps``, one after another, on this machine.

Issue target: each example runs in ≤ 10 minutes on a 2-core CPU. The examples are run as a user runs them
(``python examples/<name>.py``, default arguments, the converted SmolLM2 folder already cached) with
``OMP_NUM_THREADS=1``, and for each one the script records the wall time and the CPU time (user + system) of the
process tree. On a shared machine the wall time depends on the neighbours' load; the single-threaded CPU time does
not, and it is what the same run takes on one otherwise idle core, so the verdict uses it. The 1-minute load average
before and after each run is recorded so the wall times can be read. The JSON and Markdown land in
``benchmarks/results/examples_runtime.{json,md}``.

    OMP_NUM_THREADS=1 python benchmarks/examples_runtime.py [--only sft_smollm2_lora ...]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = (
    "sft_smollm2_lora",
    "grpo_smollm2_qlora",
    "grpo_smollm2",
    "unlearn_smollm2",
    "merge_smollm2",
    "map_adapters_smollm2",
)
LIMIT_S = 600.0


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_example(name: str, out: Path) -> dict:
    """One example at its defaults; CPU time counts every process it waited for (the fresh-process reload too)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    load_before = os.getloadavg()[0]
    cpu_before, start = _children_cpu(), time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / f"{name}.py"), "--output_dir", str(out / name)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )
    wall, cpu = time.perf_counter() - start, _children_cpu() - cpu_before
    return {
        "example": name,
        "returncode": proc.returncode,
        "wall_s": round(wall, 1),
        "cpu_s": round(cpu, 1),
        "load_1min_before": round(load_before, 2),
        "load_1min_after": round(os.getloadavg()[0], 2),
        "within_limit": proc.returncode == 0 and cpu <= LIMIT_S,
        "last_lines": proc.stdout.strip().splitlines()[-6:] if proc.returncode == 0 else proc.stderr[-2000:],
    }


def markdown(report: dict) -> str:
    lines = [
        "# SmolLM2 examples at their default `--steps`",
        "",
        f"{report['machine']}; `OMP_NUM_THREADS=1`; the converted model already cached. Verdict on CPU time (what the "
        f"run takes on one idle core), limit {LIMIT_S:.0f} s.",
        "",
        "| example | exit | CPU s | wall s | load (1 min) before → after | ≤ 10 min |",
        "|---|---|---|---|---|---|",
    ]
    for r in report["runs"]:
        lines.append(
            f"| `{r['example']}` | {r['returncode']} | {r['cpu_s']:.0f} | {r['wall_s']:.0f} | "
            f"{r['load_1min_before']:.1f} → {r['load_1min_after']:.1f} | {'yes' if r['within_limit'] else 'NO'} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="+", choices=EXAMPLES, default=list(EXAMPLES))
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args(argv)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only:
            runs.append(run_example(name, Path(tmp)))
            r = runs[-1]
            print(f"{name}: exit {r['returncode']}, CPU {r['cpu_s']:.0f} s, wall {r['wall_s']:.0f} s", flush=True)
    report = {"machine": f"{os.cpu_count()} CPUs", "limit_s": LIMIT_S, "runs": runs}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "examples_runtime.json").write_text(json.dumps(report, indent=1))
    (out / "examples_runtime.md").write_text(markdown(report))
    return 0 if all(r["within_limit"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
