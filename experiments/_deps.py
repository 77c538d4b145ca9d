"""Rewrites `experiments/library_deps.json`: for each script with a committed result, the `hf_stable` source files its
quick runs load, which is what its code digest covers (`_harness.library_sources`).

    OMP_NUM_THREADS=1 .venv/bin/python experiments/_deps.py [script stem ...]   # none: every script

Every committed result's command runs once with `--quick`, in a copy of the repository's files with no
`experiments/cache/` (a cached seed, warm start or RL run loads nothing, so its modules would be missed), two at a
time. Each run records what it loaded (`library_files` in its JSON); a script's entry is the union over its results
(`stability_guard_spike.py` has two designs). A run that fails stops the rewrite and leaves the file as it was.

A quick run runs every arm of its full run at smaller sizes, except where `ALL_ARMS` says otherwise: there the quick
run gets the flag that selects every arm, so an arm the quick form skips still counts.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from _harness import DEPS, REPO, RESULTS


# script -> (its arm-selecting flag, the attribute listing every arm); `tinytofu.py --quick` runs 3 methods of 10
ALL_ARMS = {"experiments/tinytofu.py": ("--methods", "METHODS")}


def all_arms(script: str) -> list[str]:
    if script not in ALL_ARMS:
        return []
    flag, attribute = ALL_ARMS[script]
    module = importlib.import_module(Path(script).stem)
    return [flag, *getattr(module, attribute)]


def commands() -> list[tuple[str, list[str]]]:
    """(script, its arguments) of every committed result, as its `command` field states them, plus `all_arms`."""
    jobs = []
    for path in sorted(RESULTS.glob("*.json")):
        command = json.loads(path.read_text()).get("command")
        if not command:  # index.json: evidence.py's summary, not a result
            continue
        match = re.search(r"(experiments/\w+\.py)(.*)$", command)
        jobs.append((match.group(1), [*match.group(2).split(), *all_arms(match.group(1))]))
    return jobs


def copy_repository(dest: Path) -> None:
    """The tracked and untracked-but-not-ignored files, so no cache, build output or venv comes along."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True, check=True, text=True
    ).stdout.split("\0")
    for name in filter(None, listed):
        source = REPO / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)


def quick_run(copy: Path, script: str, args: list[str], out: Path) -> list[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(copy)}  # the copy's hf_stable, not the install
    cmd = [sys.executable, str(copy / script), *args, "--quick", "--out", str(out)]
    done = subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    files = []
    for result in out.glob("*.json"):
        files += json.loads(result.read_text())["library_files"]
    print(f"{script} {' '.join(args)}: {len(set(files))} library files", flush=True)
    return files


def main(only: list[str]) -> None:
    jobs = [job for job in commands() if not only or Path(job[0]).stem in only]
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "repo"
        copy_repository(copy)
        with ThreadPoolExecutor(max_workers=2) as pool:
            found = list(
                pool.map(lambda job: quick_run(copy, job[0], job[1], Path(tmp) / f"out{jobs.index(job)}"), jobs)
            )
    old = json.loads(DEPS.read_text()) if DEPS.is_file() else {}
    deps: dict[str, set[str]] = {s: set(f) for s, f in old.items() if only and Path(s).stem not in only}
    for (script, _), files in zip(jobs, found, strict=True):
        deps.setdefault(script, set()).update(files)
    DEPS.write_text(json.dumps({s: sorted(f) for s, f in sorted(deps.items())}, indent=1) + "\n")
    print(f"wrote {DEPS.relative_to(REPO)}: {len(deps)} scripts")


if __name__ == "__main__":
    main(sys.argv[1:])
