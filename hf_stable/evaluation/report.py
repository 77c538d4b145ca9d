"""Reports of a benchmark evaluation, in open-unlearning's file layout so each side can read the other's:
``<BENCH>_EVAL.json`` (every metric with its per-example values), ``<BENCH>_SUMMARY.json`` (one number per metric) and
``<BENCH>_SUMMARY.md`` (the same as a table, with the run's settings). Files are written to a temporary name and
renamed, so a crash never leaves half a report.
"""

from __future__ import annotations

import json
import math
import os

from .._files import write_text_atomic


def _clean(value):
    """JSON has no NaN or infinity: they become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def _cell(value) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.3g}" if value != 0 and abs(value) < 1e-2 else f"{value:.4f}"
    return str(value)


def summary_markdown(benchmark: str, summary: dict, settings: dict) -> str:
    """The summary as a Markdown table, followed by the settings of the run."""
    lines = [f"# {benchmark} unlearning evaluation", "", "| metric | value |", "|---|---|"]
    lines += [f"| {name} | {_cell(value)} |" for name, value in summary.items()]
    lines += ["", "| setting | value |", "|---|---|"]
    lines += [f"| {name} | {_cell(value)} |" for name, value in settings.items()]
    return "\n".join(lines) + "\n"


def write_report(output_dir: str, benchmark: str, logs: dict, summary: dict, settings: dict) -> dict[str, str]:
    """Write the three files; returns their paths by kind (``eval``, ``summary``, ``markdown``)."""
    name = benchmark.upper()
    paths = {
        "eval": os.path.join(output_dir, f"{name}_EVAL.json"),
        "summary": os.path.join(output_dir, f"{name}_SUMMARY.json"),
        "markdown": os.path.join(output_dir, f"{name}_SUMMARY.md"),
    }
    write_text_atomic(paths["eval"], json.dumps(_clean(logs), indent=1, sort_keys=True))
    write_text_atomic(paths["summary"], json.dumps(_clean(summary), indent=1))
    write_text_atomic(paths["markdown"], summary_markdown(name, _clean(summary), _clean(settings)))
    return paths


def read_logs(path: str) -> dict:
    """A retain model's logs: an ``*_EVAL.json`` of ``hf-stable eval-unlearning`` or of open-unlearning."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"`retain_logs_path` {path!r} is not a file.")
    try:
        with open(path, encoding="utf-8") as f:
            logs = json.load(f)
    except json.JSONDecodeError as err:
        raise ValueError(f"`retain_logs_path` {path!r} is not JSON ({err}).") from err
    if not isinstance(logs, dict):
        raise ValueError(f"`retain_logs_path` {path!r} does not hold a JSON object of metrics.")
    return logs
