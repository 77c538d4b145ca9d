"""The paired protocol shared by the overhead benchmarks (`sft_overhead.py`, `grpo_overhead.py`,
`adapters_overhead.py`).

* One untimed run of the baseline first warms the process up (allocator, lazy imports, kernel selection); inside each
  run the first `--warmup` optimizer steps are discarded.
* Every repeat runs every arm once, in a fresh random order, so neither a fixed position nor drifting background
  load favours one arm.
* A run's value is its mean time per optimizer step on two clocks: the process's CPU time (`time.process_time`;
  with one thread it is the step's compute and barely moves when other processes share the cores) and wall time
  (`time.perf_counter`, which such processes inflate).
* The ratio arm / baseline is formed within each repeat (paired), and the table gives the mean ratio over repeats with
  a bootstrap 95 % interval (resampling repeats).

A claim ("≤ 1.02× the baseline") is resolved only when the whole interval lies on one side of the target; otherwise
the result is reported as "within ±x %" of the baseline, x the interval's farthest end.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import subprocess
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path


RESULTS = Path(__file__).resolve().parent / "results"
CLOCKS = (("cpu", "cpu_step_s"), ("wall", "wall_step_s"))
MIN_STEP_MS = 100.0  # below this the fixed per-step Python cost of a trainer dominates the ratio


def parser(description: str, *, repeats: int, steps: int, warmup: int) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--repeats", type=int, default=repeats, help="paired repeats (each runs every arm once)")
    p.add_argument("--steps", type=int, default=steps, help="timed optimizer steps per run")
    p.add_argument("--warmup", type=int, default=warmup, help="discarded optimizer steps at the start of each run")
    p.add_argument("--quick", action="store_true", help="minimal sizes (smoke test); writes only to --output_dir")
    p.add_argument("--output_dir", default=None, help=f"where the JSON and Markdown go (default {RESULTS})")
    p.add_argument("--seed", type=int, default=1234, help="seed of the arm order")
    p.add_argument("--arms", nargs="+", default=None, help="run only these arms (the baseline always runs)")
    p.add_argument("--name", default=None, help="stem of the result files (default: the script's name)")
    return p


def select_arms(cli: argparse.Namespace, arms: Sequence[str], baseline: str) -> list[str]:
    """The arms to run, in their declared order: all, or `--arms` plus the baseline."""
    if cli.arms is None:
        return list(arms)
    unknown = sorted(set(cli.arms) - set(arms))
    if unknown:
        raise ValueError(f"--arms: unknown {unknown}; allowed {list(arms)}.")
    return [a for a in arms if a in cli.arms or a == baseline]


def check_args(cli: argparse.Namespace) -> None:
    if cli.repeats < 2:
        raise ValueError(f"--repeats must be >= 2 (the interval resamples repeats), got {cli.repeats}.")
    if cli.steps < 1 or cli.warmup < 1:
        raise ValueError(f"--steps and --warmup must be >= 1, got --steps {cli.steps} --warmup {cli.warmup}.")


def quiet() -> int:
    """One thread, no progress bars or library logging; returns the thread count."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import datasets
    import torch
    from transformers.utils import logging as hf_logging

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    datasets.disable_progress_bars()
    hf_logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    return torch.get_num_threads()


class StepClock:
    """Both clocks stamped at the end of every optimizer step; `summary` gives the mean step after the warm-up.
    The trainer's logs are kept too (`logs`), to check that every arm did the same work.

    The interval between two stamps holds everything a step does (data, forward, backward, optimizer, callbacks,
    logging), and nothing of the trainer's construction or teardown.
    """

    def __init__(self):
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self.logs: list[dict] = []

    def stamp(self) -> None:
        self.wall.append(time.perf_counter())
        self.cpu.append(time.process_time())

    def callback(self):
        from transformers import TrainerCallback

        clock = self

        class _Stamp(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                clock.stamp()

            def on_step_end(self, args, state, control, **kwargs):
                clock.stamp()

            def on_log(self, args, state, control, logs=None, **kwargs):
                clock.logs.append(dict(logs or {}))

        return _Stamp()

    def summary(self, warmup: int) -> dict:
        """Mean wall and CPU seconds per step over the steps after the first `warmup` (stamp 0 is the start)."""
        wall = [b - a for a, b in zip(self.wall, self.wall[1:], strict=False)][warmup:]
        cpu = [b - a for a, b in zip(self.cpu, self.cpu[1:], strict=False)][warmup:]
        if not wall:
            raise RuntimeError(f"no timed steps: {len(self.wall) - 1} steps stamped, warm-up {warmup}.")
        return {"wall_step_s": statistics.fmean(wall), "cpu_step_s": statistics.fmean(cpu), "n_steps": len(wall)}


def trainer_args(output_dir: str, cli: argparse.Namespace, batch: int) -> dict:
    """The arguments every arm of a trainer benchmark shares (CPU, fp32, no checkpoints, no reporting)."""
    return dict(
        output_dir=output_dir,
        max_steps=cli.warmup + cli.steps,
        per_device_train_batch_size=batch,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=0,
    )


def time_trainer(make_trainer: Callable[[str], object], warmup: int) -> tuple[dict, StepClock]:
    """Builds a trainer with `make_trainer(output_dir)` in a temporary folder, trains it with a `StepClock`, and
    returns the clock's summary and the clock (its logs)."""
    from transformers import PrinterCallback

    clock = StepClock()
    with tempfile.TemporaryDirectory() as tmp:
        trainer = make_trainer(tmp)
        trainer.remove_callback(PrinterCallback)  # no printed log dict per logging step
        trainer.add_callback(clock.callback())
        trainer.train()
    return clock.summary(warmup), clock


def run_paired(
    arms: Sequence[str],
    run_arm: Callable[[str], dict],
    *,
    repeats: int,
    baseline: str,
    seed: int,
    warmup_run: Callable[[], object] | None = None,
) -> list[dict]:
    """Every repeat runs every arm once in a fresh random order; returns ``[{"order", "results": {arm: run}}]``.

    `run_arm(arm)` returns at least ``cpu_step_s`` and ``wall_step_s``. `warmup_run` (default: the baseline arm)
    runs once first and is discarded.
    """
    rng = random.Random(seed)
    (warmup_run or (lambda: run_arm(baseline)))()
    per_repeat = []
    for repeat in range(repeats):
        order = list(arms)
        rng.shuffle(order)
        results = {arm: run_arm(arm) for arm in order}
        per_repeat.append({"order": order, "results": results})
        base = results[baseline]["cpu_step_s"]
        print(
            f"repeat {repeat}: "
            + ", ".join(f"{a} {results[a]['cpu_step_s'] / base:.3f}" for a in arms)
            + f"  (CPU ratios; {baseline} {1e3 * base:.1f} ms/step)",
            flush=True,
        )
    return per_repeat


def bootstrap_mean(values: Sequence[float], n_boot: int = 4000, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap 95 % interval of the mean of `values`."""
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choice(values) for _ in values) for _ in range(n_boot))
    return means[int(0.025 * n_boot)], means[int(0.975 * n_boot) - 1]


def summarise(per_repeat: list[dict], arms: Sequence[str], baseline: str) -> dict:
    """Per arm and clock: mean ms per step, the paired ratios to `baseline`, their mean and bootstrap interval."""
    table = {}
    for arm in arms:
        row = {}
        for clock, key in CLOCKS:
            steps = [r["results"][arm][key] for r in per_repeat]
            ratios = [r["results"][arm][key] / r["results"][baseline][key] for r in per_repeat]
            row[clock] = {
                "step_ms_mean": 1e3 * statistics.fmean(steps),
                "ratio_mean": statistics.fmean(ratios),
                "ratio_ci95": list(bootstrap_mean(ratios)),
                "ratios": ratios,
            }
        table[arm] = row
    return table


def verdict(ci: Sequence[float], target: float) -> str:
    """Whether the interval resolves "ratio ≤ target", as words."""
    low, high = ci
    if high <= target:
        return f"≤ {target:.2f}× (resolved)"
    if low > target:
        return f"> {target:.2f}× (resolved)"
    return f"within ±{100 * max(abs(low - 1), abs(high - 1)):.1f} % (does not resolve {target:.2f}×)"


def describe(ci: Sequence[float], mean: float) -> str:
    """The overhead in words: a signed percentage when the interval excludes 1, else "within ±x %"."""
    low, high = ci
    if low > 1 or high < 1:
        return f"{100 * (mean - 1):+.1f} % [{100 * (low - 1):+.1f}, {100 * (high - 1):+.1f}]"
    return f"within ±{100 * max(abs(low - 1), abs(high - 1)):.1f} %"


def markdown_table(
    table: dict, arms: Sequence[str], baseline: str, extra: dict[str, Callable[[str], str]] | None = None
) -> str:
    extra = extra or {}
    head = [
        "arm",
        "CPU ms/step",
        f"CPU ratio vs {baseline} [95% CI]",
        "wall ms/step",
        f"wall ratio vs {baseline} [95% CI]",
        "CPU overhead",
        *extra,
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for arm in arms:
        c, w = table[arm]["cpu"], table[arm]["wall"]
        cells = [
            arm,
            f"{c['step_ms_mean']:.1f}",
            f"{c['ratio_mean']:.3f} [{c['ratio_ci95'][0]:.3f}, {c['ratio_ci95'][1]:.3f}]",
            f"{w['step_ms_mean']:.1f}",
            f"{w['ratio_mean']:.3f} [{w['ratio_ci95'][0]:.3f}, {w['ratio_ci95'][1]:.3f}]",
            "baseline" if arm == baseline else describe(c["ratio_ci95"], c["ratio_mean"]),
            *(fn(arm) for fn in extra.values()),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=10
        )
    except OSError:
        return None
    return out.stdout.strip() or None


def report(
    name: str,
    cli: argparse.Namespace,
    *,
    setup: dict,
    table: dict,
    per_repeat: list[dict],
    arms,
    baseline,
    targets: dict[str, float],
    started: float,
    notes: Sequence[str] = (),
    extra_columns=None,
    extra: dict | None = None,
) -> dict:
    """Builds the result (one schema for every overhead benchmark), prints the table, writes JSON and Markdown."""
    import torch

    name = cli.name or name
    base_ms = table[baseline]["cpu"]["step_ms_mean"]
    claims = {}
    for arm, target in targets.items():
        ci = table[arm]["cpu"]["ratio_ci95"]
        claims[arm] = {
            "target": target,
            "clock": "cpu",
            "ratio_mean": table[arm]["cpu"]["ratio_mean"],
            "ratio_ci95": ci,
            "verdict": verdict(ci, target),
        }
    result = {
        "benchmark": name,
        "setup": {
            **setup,
            "repeats": cli.repeats,
            "timed_steps": cli.steps,
            "warmup_steps": cli.warmup,
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "quick": cli.quick,
        },
        "protocol": "warm-up run and warm-up steps discarded; arm order shuffled per repeat; ratios paired per "
        "repeat; bootstrap 95% interval over repeats; claims judged on process CPU time",
        "baseline": baseline,
        "baseline_cpu_step_ms": base_ms,
        "baseline_step_ge_100ms": base_ms >= MIN_STEP_MS,
        "arms": table,
        "claims": claims,
        **(extra or {}),
        "per_repeat": per_repeat,
        "wall_s": time.time() - started,
        "git_commit": git_commit(),
    }
    lines = [
        f"# {name}",
        "",
        f"Baseline `{baseline}`: {base_ms:.1f} ms of CPU per optimizer step "
        f"({'≥' if base_ms >= MIN_STEP_MS else 'BELOW'} {MIN_STEP_MS:.0f} ms). "
        f"{cli.repeats} paired repeats × {cli.steps} timed steps (after {cli.warmup} discarded), "
        f"{result['setup']['threads']} thread.",
        "",
        markdown_table(table, arms, baseline, extra_columns),
        "",
    ]
    if claims:
        lines += ["Claims (CPU time):", ""]
        lines += [
            f"- `{arm}` ≤ {c['target']:.2f}× `{baseline}`: ratio {c['ratio_mean']:.3f} "
            f"[{c['ratio_ci95'][0]:.3f}, {c['ratio_ci95'][1]:.3f}] — {c['verdict']}"
            for arm, c in claims.items()
        ]
        lines.append("")
    lines += list(notes)
    text = "\n".join(lines).rstrip() + "\n"
    print(text)
    out = cli.output_dir or (None if cli.quick else RESULTS)
    if out is not None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        for path, content in ((out / f"{name}.json", json.dumps(result, indent=1)), (out / f"{name}.md", text)):
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(content, encoding="utf-8")
            os.replace(tmp, path)
    return result
