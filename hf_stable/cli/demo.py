"""`hf-stable demo` (what `make demo` runs): the workflow end to end on the bundled tiny model, offline, on a CPU.

1. ``sft``: SFT from a random init on 2-digit addition (800 distinct problems) with NLL and with "-p" (Li et al.,
   arXiv 2510.00526).
2. ``grpo``: `StableGRPOTrainer` (full fine-tuning) from the SFT (NLL) model on fresh problems: TRL's default
   advantages vs S-GRPO (arXiv 2508.05928) vs MaxRL, with the stability guard and the degenerate-run warnings
   attached; reward and held-out curves. The recipe of the experiments' RL testbed (`experiments/testbeds/rl.py`).

Every stage's held-out exact match is measured on problems that no training row of any stage contains.
3. ``merge``: WSM (arXiv 2507.17634) over the S-GRPO checkpoints and a Fisher–Rao merge (arXiv 2603.04972) of the
   S-GRPO and MaxRL models; held-out exact match of every input and merge; the merged folder reloaded with
   `AutoModelForCausalLM.from_pretrained` and used to generate.
4. ``unlearn``: SimNPO (arXiv 2410.07163) on TinyTOFU: forget 20 fictitious authors, keep the others.
5. ``stability``: one injected LR blow-up, with and without `StabilityGuardCallback`; a plot.
6. ``push``: the Fisher–Rao merge's planned Hub commit, as `--push_to_hub ID --hub_dry_run` prints it (no network).

Each stage writes ``<output_dir>/<stage>/`` and one row of the summary table; every number goes into
``<output_dir>/results.json`` (a later run of a subset updates its stages and keeps the others).
"""

from __future__ import annotations

import json
import os
import time


STAGE_NAMES = ("sft", "grpo", "merge", "unlearn", "stability", "push")
TITLES = {
    "sft": "SFT from a random init on 2-digit addition: NLL vs -p",
    "grpo": "GRPO from the SFT model on fresh problems: TRL default vs S-GRPO vs MaxRL (guard, degenerate-run checks)",
    "merge": "merging: WSM over the S-GRPO checkpoints, Fisher-Rao of S-GRPO and MaxRL; reload and generate",
    "unlearn": "unlearning: SimNPO on TinyTOFU (forget 20 fictitious authors)",
    "stability": "stability: an injected LR spike, guard off vs on (and a clean run)",
    "push": "push, as a dry run: the planned Hub commit of the Fisher-Rao merge (no network)",
}
DEMO_REPO = "your-username/hf-stable-demo"


def parse_stages(text: str | None) -> list[str]:
    """``"sft,grpo"`` → ``["sft", "grpo"]`` in the demo's order; ``None`` or ``"all"`` → every stage.

    Raises:
        ValueError: an unknown or empty name, naming the allowed values.
    """
    if text is None or text.strip() == "all":
        return list(STAGE_NAMES)
    names = [n.strip() for n in text.split(",")]
    unknown = [n for n in names if n not in STAGE_NAMES]
    if unknown or not names:
        raise ValueError(
            f"`--stages` {text!r}: unknown stage {', '.join(map(repr, unknown)) or '(empty)'}. Allowed values: "
            f"{', '.join(STAGE_NAMES)} or all (comma-separated, e.g. --stages sft,grpo)."
        )
    return [n for n in STAGE_NAMES if n in names]


class _Context:
    """What the stages share: sizes, the held-out set, the output folder, and the artifacts of earlier stages."""

    def __init__(self, output_dir: str, quick: bool):
        from ..testing import arithmetic_splits, with_carry_errors
        from .demo_stages import FULL, QUICK

        self.output_dir, self.quick = output_dir, quick
        self.sizes = QUICK if quick else FULL
        # Held out: problems no training row of any stage contains. The SFT rows show an imperfect demonstrator's
        # carry errors (RL with the verifier's reward can correct them); GRPO and the stability run draw fresh problems
        # from the rest, with true answers.
        self.test = arithmetic_splits({"test": self.sizes.test_rows}, seed=1234)["test"]
        sizes = {"sft": self.sizes.sft_problems, "fresh": None}
        splits = arithmetic_splits(sizes, seed=0, exclude=self.test["prompt"])
        self.sft_rows = with_carry_errors(splits["sft"], self.sizes.carry_error, seed=0)
        self.fresh_rows = splits["fresh"]
        self.repo_id = DEMO_REPO

    def path(self, *parts: str) -> str:
        return os.path.join(self.output_dir, *parts)

    def require(self, stage: str, *parts: str) -> str:
        """An artifact of ``stage``: from this run, or from an earlier run into the same output folder."""
        path = self.path(stage, *parts)
        if not os.path.exists(path):
            raise FileNotFoundError(
                f"hf-stable demo: {path} is missing: it is written by the {stage!r} stage. Run that stage first "
                f"(e.g. --stages {stage},...) into the same --output_dir."
            )
        return path


def _table(rows: list[dict]) -> str:
    head = ("stage", "what ran", "metric", "before", "after", "wall", "artifacts")
    cells = [head] + [
        (r["stage"], r["what"], r["metric"], r["before"], r["after"], f"{r['wall_time_s']:.0f}s", r["artifacts"])
        for r in rows
    ]
    widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cells[0], widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in cells[1:]]
    return "\n".join(lines)


def run_demo(output_dir: str = "demo_output", quick: bool = False, stages: str | list[str] | None = None) -> dict:
    """Run ``stages`` (default all) into ``output_dir``; print the summary table; return the results dict."""
    from ._quiet import silence_known_warnings

    silence_known_warnings()
    names = parse_stages(stages) if stages is None or isinstance(stages, str) else parse_stages(",".join(stages))
    import datasets
    from transformers.utils import logging

    from .demo_stages import STAGES

    datasets.disable_progress_bars()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    os.makedirs(output_dir, exist_ok=True)
    ctx = _Context(output_dir, quick)
    results_path = os.path.join(output_dir, "results.json")
    results = {"stages": {}}
    if os.path.isfile(results_path):  # a subset run keeps the other stages' numbers
        with open(results_path, encoding="utf-8") as f:
            results = json.load(f)
    results["quick"] = quick
    mode = "quick" if quick else "full"
    print(f"hf_stable demo ({mode}): {', '.join(names)} into {output_dir}/", flush=True)
    started = time.perf_counter()
    for name in names:
        print(f"\n== {name}: {TITLES[name]}", flush=True)
        start = time.perf_counter()
        stage = STAGES[name](ctx)
        wall = round(time.perf_counter() - start, 1)
        what, metric, before, after, artifacts = stage.pop("row")
        stage["wall_time_s"] = wall
        stage["summary"] = {
            "stage": name,
            "what": what,
            "metric": metric,
            "before": before,
            "after": after,
            "wall_time_s": wall,
            "artifacts": artifacts,
        }
        stage["quick"] = quick
        results["stages"][name] = stage
        _write_json(results_path, results)
        print(f"   {metric}: {before} -> {after} ({wall:.0f}s)", flush=True)
    rows = [results["stages"][n]["summary"] for n in STAGE_NAMES if n in results["stages"]]
    results["summary"] = rows
    results["last_run"] = {"stages": names, "wall_time_s": round(time.perf_counter() - started, 1)}
    _write_json(results_path, results)
    print("\n" + _table(rows))
    print(f"\n{len(names)} stage(s) in {results['last_run']['wall_time_s']:.0f}s; all numbers: {results_path}")
    return results


def _write_json(path: str, data: dict) -> None:
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
    os.replace(path + ".tmp", path)
