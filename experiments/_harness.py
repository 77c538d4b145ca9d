"""The one entry point every experiment script runs through: CLI, per-seed caching, result schema and writers.

A script declares an `Experiment` (its claim, its sizes, how to run one seed, how to aggregate, its pre-registered
criteria, its plot and its Markdown body) and calls `run(experiment)`. The harness then

* parses `--quick` (tiny sizes, first seed only; its pass/fail means nothing), `--seeds`, `--out` (alias
  `--output_dir`), `--no_cache` and the script's own `size_flags` (each overrides one field of the sizes);
* runs each seed through `run_seed(seed, sizes)`, caching the per-seed JSON under `experiments/cache/<name>/` keyed
  by the script's source, the `hf_stable` library sources it loads (`library_sources`), the sizes and the seed, so a
  code change reruns it;
* writes `<out>/<name>.json` with the shared schema (`SCHEMA_KEYS`), `<out>/<name>.png` and `<out>/<name>.md`.

Result schema (every committed `experiments/results/*.json`, tested by `tests/experiments/test_results_schema.py`):
    claim      str   the claim under test, with the paper's arXiv id
    criteria   dict  name -> {"criterion": str, "passed": bool, "values": dict, "per_seed": str}
    passed     bool  every criterion passed
    per_seed   dict  str(seed) -> the script's per-seed record
    aggregate  dict  the script's aggregate over seeds
    wall_s     float wall time behind the result: this invocation plus the measured run time of every cached seed
    git_commit str   `git rev-parse HEAD` of the code that ran (read at the start), with `+dirty` when the tree had
                     changes
    code_digest str  the digest the seed cache is keyed by; `stale_results()` compares it with today's code
    library_files list  the `hf_stable` files the invocation that wrote it loaded (optional: older results lack it)
    config     dict  seeds, quick, sizes and the script's own settings
    command    str   the command that reproduces the file
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import hashlib
import json
import logging
import math
import os
import re
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


ROOT = Path(__file__).resolve().parent
REPO = ROOT.parent
RESULTS = ROOT / "results"
CACHE = ROOT / "cache"
DEFAULT_SEEDS = (0, 1, 2)
SCHEMA_KEYS = ("claim", "criteria", "passed", "per_seed", "aggregate", "wall_s", "git_commit", "code_digest")
CRITERION_KEYS = ("criterion", "passed")
QUICK_NOTE = " (quick run: sizes too small for the verdict to mean anything)"


@dataclass
class Experiment:
    """What a script declares; `run` does everything else.

    `run_seed(seed, sizes) -> dict` must return JSON-serialisable values (it is cached as JSON).
    `aggregate(per_seed, sizes) -> dict`, `criteria(per_seed, aggregate, sizes) -> {name: criterion dict}` (see
    `criterion`),
    `plot(result, path)` writes the PNG, `markdown(result) -> str` the body placed under the harness's header.
    `size_flags`: `{"--field": argparse keyword arguments}`, a flag that, when given, replaces that field of the sizes
    (so it enters the cache key and the reproducing command).
    `work_cache`: `run_seed(seed, sizes, folder)` gets a folder keyed like the seed's record (sizes, config, code), or
    None under `--no_cache`, for a seed long enough that an interrupted one must resume from its finished parts.
    """

    name: str
    title: str
    claim: str
    sizes: Any
    quick_sizes: Any
    run_seed: Callable[[int, Any], dict]
    aggregate: Callable[[dict, Any], dict]
    criteria: Callable[[dict, dict, Any], dict]
    plot: Callable[[dict, Path], None]
    markdown: Callable[[dict], str]
    config: dict = field(default_factory=dict)
    default_seeds: tuple[int, ...] = DEFAULT_SEEDS
    script: str = ""  # the script's __file__; its source is part of the cache key
    compact_json: bool = False  # 5 significant digits, no indentation (for results holding long trajectories)
    # the script and arguments that run this experiment, for the rerun command, when that is not
    # `experiments/<name>.py` (one script with several designs, e.g. "experiments/x.py --design v2")
    entry_point: str = ""
    size_flags: dict = field(default_factory=dict)
    work_cache: bool = False


# ---------------------------------------------------------------------------------------------------------------------
# small shared helpers


SCRIPT_PARTS = ("run_seed", "aggregate", "criteria", "plot", "markdown")


def declare(namespace: dict, **fields) -> Experiment:
    """The `Experiment` of the script whose module namespace (`globals()`) is given, taking what it does not say from
    the script's own names: `name` from `NAME`, `script` from `__file__`, `sizes` from `Sizes()`, `quick_sizes` from
    `QUICK`, and `run_seed`, `aggregate`, `criteria`, `plot`, `markdown` from the functions of those names. `fields`
    (title, claim, config, ...) add the rest or replace any of them."""
    found = {"name": namespace.get("NAME"), "script": namespace.get("__file__"), "quick_sizes": namespace.get("QUICK")}
    found.update({part: namespace.get(part) for part in SCRIPT_PARTS})
    if "sizes" not in fields and "Sizes" in namespace:
        found["sizes"] = namespace["Sizes"]()
    return Experiment(**{**{k: v for k, v in found.items() if v is not None}, **fields})


def result_sizes(cls, result: dict):
    """The sizes a result ran with, as the script's sizes dataclass `cls` (JSON lists back to tuples)."""
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in result["config"]["sizes"].items()})


def mean_std(values: list[float]) -> dict:
    """Mean, sample std (ddof 1; 0 for one value) and the values themselves."""
    values = [float(v) for v in values]
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "values": values,
    }


def fmt(ms: dict, digits: int = 3, sign: bool = False) -> str:
    """`mean ± std` of a `mean_std` dict."""
    return f"{ms['mean']:{'+' if sign else ''}.{digits}f} ± {ms['std']:.{digits}f}"


def finite(x: float, digits: int = 3) -> str:
    """`x` with `digits` decimals, or "nan" when it is not finite."""
    return "nan" if not math.isfinite(x) else f"{x:.{digits}f}"


def subplots(rows: int, cols: int, figsize: tuple[float, float], **kwargs):
    """`(figure, axes)` of a `rows × cols` grid drawn off-screen (the Agg backend: no display needed); `kwargs` go
    to `plt.subplots`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(rows, cols, figsize=figsize, **kwargs)


def save_figure(fig, path: Path, dpi: int = 110) -> None:
    """Lay out, write the PNG and free the figure."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def criterion(text: str, passed: bool, values: dict | None = None, per_seed: str = "") -> dict:
    """One pre-registered criterion as stored in the result (`per_seed`: e.g. "2/3 seeds")."""
    return {"criterion": text, "passed": bool(passed), "values": values or {}, "per_seed": per_seed}


def seeds_holding(per_seed: dict, rule: Callable[[dict], bool]) -> str:
    """`"k/n seeds"`: on how many seeds `rule(per_seed_record)` holds."""
    return f"{sum(bool(rule(r)) for r in per_seed.values())}/{len(per_seed)} seeds"


def quiet() -> None:
    """Silence progress bars, library warnings and the hf_stable logger so a run prints only its own lines."""
    warnings.filterwarnings("ignore")
    logging.getLogger("hf_stable").setLevel(logging.ERROR)
    try:
        import datasets
        import transformers
    except ImportError:  # the pure-torch scripts do not need them
        return
    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()


def git_commit() -> str:
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "hf_stable", "experiments/*.py"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


# The command-line layer: no library module and no experiment imports it (tests/experiments/test_harness_digest.py),
# so a change to the CLI or the demo must not mark hours of experiment results stale.
NOT_IN_DIGEST = ("hf_stable/cli/", "hf_stable/scripts/")


# script -> the `hf_stable` sources its `--quick` runs load, written by `python experiments/_deps.py` (which runs them
# in a copy of the repository with no cache) and checked by every quick run in tests/experiments: a run that loads a
# library file its entry lacks fails there.
DEPS = ROOT / "library_deps.json"


def _script_key(script: str) -> str | None:
    path = Path(script).resolve()
    return path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else None


def library_sources(script: str | None = None) -> list[Path]:
    """The `hf_stable` source files `script`'s results depend on: those its `DEPS` entry lists; for `script=None`,
    or a script without an entry, every source but `NOT_IN_DIGEST` (all an experiment could load).

    Why not always all of them: then a change to, say, the merge engine marks every RL result stale, and rerunning
    them all costs CPU-hours. The entry comes from the quick run, which runs the same arms as the full run at smaller
    sizes; a full run with an arm that loads more must list it (`_deps.py` reruns the quick runs)."""
    files = sorted((REPO / "hf_stable").rglob("*.py"))
    everything = [f for f in files if not f.relative_to(REPO).as_posix().startswith(NOT_IN_DIGEST)]
    key = _script_key(script) if script else None
    deps = json.loads(DEPS.read_text()) if DEPS.is_file() else {}
    if key not in deps:
        return everything
    return [REPO / name for name in deps[key]]


def loaded_library_files() -> list[str]:
    """The `hf_stable` source files this process has imported (repository-relative, `NOT_IN_DIGEST` left out)."""
    files = set()
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if name.partition(".")[0] != "hf_stable" or not path:
            continue
        path = Path(path).resolve()
        if path.is_relative_to(REPO) and not path.relative_to(REPO).as_posix().startswith(NOT_IN_DIGEST):
            files.add(path.relative_to(REPO).as_posix())
    return sorted(files)


TESTBEDS = ROOT / "testbeds"


def _testbed_imports(path: Path) -> set[Path]:
    """The testbed modules `path` imports (`from testbeds import rl`, `from testbeds.rl import X`, `import
    testbeds.rl`, and inside a testbed `from .rl import X`), at module level or in a function."""
    found = set()
    inside = path.parent == TESTBEDS
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = "testbeds" + (f".{node.module}" if node.module else "") if node.level and inside else node.module
            names = [module or "", *(f"{module}.{a.name}" for a in node.names)]
        for name in names:
            parts = name.split(".")
            if parts[0] == "testbeds":
                found.update(f for f in [TESTBEDS / "__init__.py"] if f.is_file())
                if len(parts) > 1 and (TESTBEDS / f"{parts[1]}.py").is_file():
                    found.add(TESTBEDS / f"{parts[1]}.py")
    return found


def testbed_sources(script: str) -> list[Path]:
    """The testbed modules (`experiments/testbeds/`) that `script`, or an experiment script it imports, imports, with
    the testbed modules those import and the package's `__init__`; none for a script that uses no testbed. So a
    change to one testbed, or a new one, leaves the results of scripts that do not use it fresh."""
    todo = [p for p in (Path(script), *sibling_sources(script)) if p.is_file()]
    seen: set[Path] = set()
    while todo:
        for found in _testbed_imports(todo.pop()) - seen:
            seen.add(found)
            todo.append(found)
    return sorted(seen)


def _imported_siblings(path: Path) -> set[Path]:
    names = re.findall(r"^(?:from|import)\s+(\w+)", path.read_text(), re.MULTILINE)
    return {ROOT / f"{n}.py" for n in names if n != "_harness" and (ROOT / f"{n}.py").is_file()}


def sibling_sources(script: str) -> list[Path]:
    """The other experiment scripts `script` imports at module level (`from grpo_methods import ...`), those they
    import, and so on: a script that reuses another's arms, base model or verdict rule depends on that code too."""
    path = Path(script)
    if not path.is_file():
        return []
    own = {path, path.resolve()}
    seen, todo = set(), [path]
    while todo:
        for found in _imported_siblings(todo.pop()) - seen - own:
            seen.add(found)
            todo.append(found)
    return sorted(seen)


def _sources_digest(script: str) -> str:
    """Digest of the code a per-seed record depends on: the script, the experiment scripts and testbeds it imports
    and the `hf_stable` library sources it loads (`library_sources(script)`; their names too, so a file that joins or
    leaves the list changes it).

    This file is left out on purpose: it only stores and aggregates records, so a change to its writers must not
    throw away hours of cached seeds.
    """
    h = hashlib.sha1()
    files = [Path(script), *sibling_sources(script), *testbed_sources(script), *library_sources(script)]
    for path in files:
        if path.is_file():
            h.update(str(path.relative_to(REPO) if path.is_relative_to(REPO) else path.name).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def _jsonable(obj):
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    if isinstance(obj, (tuple, set)):
        return list(obj)
    if hasattr(obj, "item"):  # torch / numpy scalars
        return obj.item()
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def dumps(obj) -> str:
    return json.dumps(obj, indent=1, default=_jsonable)


def _compact(value):
    if isinstance(value, float):
        return float(f"{value:.5g}")
    if isinstance(value, list):
        return [_compact(v) for v in value]
    if isinstance(value, dict):
        return {k: _compact(v) for k, v in value.items()}
    return value


# ---------------------------------------------------------------------------------------------------------------------
# caching


def cache_path(exp: Experiment, seed: int, sizes, digest: str) -> Path:
    key = json.dumps({"sizes": sizes, "config": exp.config, "code": digest}, sort_keys=True, default=_jsonable)
    return CACHE / exp.name / f"seed{seed}_{hashlib.sha1(key.encode()).hexdigest()[:12]}.json"


def cached_seed(exp: Experiment, seed: int, sizes, digest: str, use_cache: bool) -> tuple[dict, bool]:
    """(per-seed record, whether it came from the cache)."""
    path = cache_path(exp, seed, sizes, digest)
    if use_cache and path.exists():
        return json.loads(path.read_text()), True
    start = time.time()
    if exp.work_cache:
        record = exp.run_seed(seed, sizes, path.with_suffix("") if use_cache else None)
    else:
        record = exp.run_seed(seed, sizes)
    record = json.loads(dumps(record))  # what is stored is what is returned, cached or not
    record.setdefault("seed_wall_s", time.time() - start)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")  # a kill mid-write must not leave a record that cannot be read
    tmp.write_text(dumps(record))
    os.replace(tmp, path)
    return record, False


# ---------------------------------------------------------------------------------------------------------------------
# entry point and writers


def parser(description: str, parents: tuple[argparse.ArgumentParser, ...] = ()) -> argparse.ArgumentParser:
    """The shared command line; `parents` (built with `add_help=False`) add a script's own options, e.g. the one that
    selects which of its `Experiment`s runs, so `--help` lists them too."""
    p = argparse.ArgumentParser(description=description, parents=list(parents))
    p.add_argument("--out", "--output_dir", dest="out", default=str(RESULTS), help="folder for the JSON, PNG and MD")
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="seeds to run (default: the script's)")
    p.add_argument("--quick", action="store_true", help="tiny sizes and the first seed only (smoke test)")
    p.add_argument("--no_cache", action="store_true", help="rerun every seed even when a cached record exists")
    return p


def command_line(exp: Experiment, cli) -> str:
    cmd = f"OMP_NUM_THREADS=1 .venv/bin/python {exp.entry_point or f'experiments/{exp.name}.py'}"
    if cli.quick:
        cmd += " --quick"
    if cli.seeds is not None and tuple(cli.seeds) != tuple(exp.default_seeds):
        cmd += " --seeds " + " ".join(map(str, cli.seeds))
    for flag in exp.size_flags:
        value = getattr(cli, _dest(flag))
        if value is not None:
            cmd += f" {flag} " + (" ".join(map(str, value)) if isinstance(value, list) else str(value))
    return cmd


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def _size_overrides(exp: Experiment, cli) -> dict:
    values = {_dest(flag): getattr(cli, _dest(flag)) for flag in exp.size_flags}
    return {name: value for name, value in values.items() if value is not None}


def _with_overrides(sizes, overrides: dict):
    if not overrides:
        return sizes
    if dataclasses.is_dataclass(sizes):
        return dataclasses.replace(sizes, **overrides)
    return {**sizes, **overrides}


def header(result: dict) -> str:
    """Title, claim, criteria table and provenance: the part of every Markdown result the harness owns."""
    cfg = result["config"]
    lines = [
        f"# {result['title']}",
        "",
        f"**Claim.** {result['claim']}",
        "",
        f"Seeds {cfg['seeds']}{QUICK_NOTE if cfg['quick'] else ''}"
        f"; overall: **{'PASS' if result['passed'] else 'FAIL'}**.",
        "",
        "| criterion (pre-registered) | result | seeds where it holds |",
        "|---|---|---|",
    ]
    for name, check in result["criteria"].items():
        lines.append(
            f"| ({name}) {check['criterion'].replace('|', chr(92) + '|')} | {'PASS' if check['passed'] else 'FAIL'} | "
            f"{check.get('per_seed') or '—'} |"
        )
    return "\n".join(lines)


def footer(result: dict) -> str:
    cached = result["cached_seeds"]
    return "\n".join(
        [
            "## Rerun",
            "",
            f"    {result['command']}",
            "",
            f"Wall time behind this result: {result['wall_s']:.0f} s"
            + (f" (seeds {cached} from the cache; this invocation {result['invocation_s']:.0f} s)" if cached else "")
            + f"; code at `{result['git_commit']}`.",
            "",
        ]
    )


def write(result: dict, exp: Experiment, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    if exp.compact_json:
        text = json.dumps(_compact(result), separators=(",", ":"))
    else:
        text = dumps(result)
    (out / f"{exp.name}.json").write_text(text)
    exp.plot(result, out / f"{exp.name}.png")
    (out / f"{exp.name}.md").write_text("\n\n".join([header(result), exp.markdown(result).strip(), footer(result)]))


def run(exp: Experiment, argv: list[str] | None = None, parents: tuple[argparse.ArgumentParser, ...] = ()) -> dict:
    """Parse the command line, run (or load) every seed, aggregate, judge, and write JSON, PNG and MD.

    `parents`: the script's own options (see `parser`); the script reads them itself to choose `exp`."""
    p = parser(exp.title, parents)
    for flag, kwargs in exp.size_flags.items():
        p.add_argument(flag, default=None, **kwargs)
    cli = p.parse_args(argv)
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    quiet()
    sizes = _with_overrides(exp.quick_sizes if cli.quick else exp.sizes, _size_overrides(exp, cli))
    seeds = list(cli.seeds if cli.seeds is not None else exp.default_seeds)
    if cli.quick:
        seeds = seeds[:1]
    start = time.time()
    commit = git_commit()  # the code that runs is the code at the start, whatever is committed meanwhile
    digest = _sources_digest(exp.script or sys.argv[0])
    per_seed, cached = {}, []
    for seed in seeds:
        record, hit = cached_seed(exp, seed, sizes, digest, use_cache=not cli.no_cache)
        per_seed[str(seed)] = record
        if hit:
            cached.append(seed)
        print(f"[{exp.name}] seed {seed}: {'cached' if hit else 'done'} ({time.time() - start:.0f}s)", flush=True)
    cached_compute = sum(per_seed[str(s)].get("seed_wall_s", 0.0) for s in cached)
    agg = exp.aggregate(per_seed, sizes)
    checks = exp.criteria(per_seed, agg, sizes)
    result = {
        "claim": exp.claim,
        "criteria": checks,
        "passed": all(c["passed"] for c in checks.values()),
        "per_seed": per_seed,
        "aggregate": agg,
        "wall_s": time.time() - start + cached_compute,
        "invocation_s": time.time() - start,
        "git_commit": commit,
        "code_digest": digest,  # sha1 of the script and the hf_stable sources it loads: `stale_results()` compares it
        "library_files": loaded_library_files(),  # what this invocation loaded (cached seeds load nothing)
        "title": exp.title,
        "config": {"seeds": seeds, "quick": cli.quick, "sizes": sizes, **exp.config},
        "command": command_line(exp, cli),
        "cached_seeds": cached,
    }
    result = json.loads(dumps(result))
    write(result, exp, Path(cli.out))
    for name, check in checks.items():
        print(f"({name}) {'PASS' if check['passed'] else 'FAIL'}: {check['criterion']}  {check.get('per_seed', '')}")
    print(f"wall time {result['wall_s']:.0f}s -> {Path(cli.out) / exp.name}.{{json,png,md}}", flush=True)
    return result


def stale_results(results: Path = RESULTS) -> dict[str, str]:
    """Each committed result -> "fresh" (its `code_digest` equals the digest of today's script and library sources),
    "stale" (the code changed since it ran) or "no digest" (written before results recorded one)."""
    status = {}
    for path in sorted(results.glob("*.json")):
        if path.stem == "index":  # experiments/evidence.py's summary of the results, not a result
            continue
        result = json.loads(path.read_text())
        script = re.search(r"experiments/\w+\.py", result.get("command", ""))
        if "code_digest" not in result or script is None:
            status[path.stem] = "no digest"
            continue
        fresh = result["code_digest"] == _sources_digest(str(REPO / script.group(0)))
        status[path.stem] = "fresh" if fresh else "stale"
    return status


if __name__ == "__main__":  # `python experiments/_harness.py`: which committed results the current code would change
    report = stale_results()
    for name, state in report.items():
        print(f"{state:>9}  {name}")
    sys.exit(0 if all(state == "fresh" for state in report.values()) else 1)
