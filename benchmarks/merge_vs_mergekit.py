"""hf_stable's streaming merge against mergekit 0.1.5 and the read+write floor, side by side in one run.

    python benchmarks/merge_vs_mergekit.py [--size 350m|small] [--n 2 4 8] [--methods linear task_arithmetic ties
        karcher] [--repeats 3] [--cold linear:4] [--budgets 256MB 16GB] [--workdir DIR]
        [--mergekit-venv .venv-mergekit] [--output-name merge_vs_mergekit]

Protocol (pre-registered targets of issue 14; no timed assertion anywhere):

* Checkpoints, no download: θ0 is `LlamaForCausalLM` from a config (350m: hidden 1024, intermediate 2816, 22
  layers, vocab 32000, untied lm_head, ~348M parameters; small: ~31M), saved in bf16; the N inputs are θ0 + ε_i
  with ‖ε_i‖ = 1% ‖θ0‖ per tensor. Built once in `--workdir` and reused.
* One mergekit YAML per (method, N), given unchanged to both tools: `linear` (weight 1 each), `task_arithmetic`
  (base θ0, weight 1, λ 1/N), `ties`, `dare_ties` and `della` (base θ0, density 0.5, weight 1), `karcher`
  (mergekit's defaults on both sides), `sce` (base θ0, weight 1, select_topk 0.5), `model_stock` (base θ0),
  `slerp` (θ0 and the first copy, t 0.5), with `dtype: float32` (compute) and `out_dtype: bfloat16`. DARE/DELLA
  masks are random in both tools (different generators): their agreement columns measure the masks' disagreement,
  not an error.
* Each measurement is a fresh process with OMP_NUM_THREADS=MKL_NUM_THREADS=1 and no GPU, timed inside after its
  imports: mergekit's `run_merge` with its CLI defaults (no tokenizer copy) from its own venv (`--mergekit-venv`),
  hf_stable's `merge(..., progress=False)` at the default budget, and the floor: read every input file once
  (`readinto`, 64 MiB blocks) and write one output of the merged size with fsync.
* Repeats: repeat 0 is a warm-up and is discarded; in every repeat the three run in a random order. Warm cache:
  the inputs are read once before each repeat; cold (`--cold method:N`): `posix_fadvise(DONTNEED)` on every input
  before each run. Ratios are paired per repeat (ours/mergekit, ours/floor); the table gives their median and a
  bootstrap 95% interval (10⁴ resamples of the repeats).
* Memory: peak `RssAnon` of the process, sampled every 20 ms; the baseline is a process that imports torch and
  hf_stable's engine and does nothing. `--budgets`: hf_stable's linear N=4 at other budgets (memory must not follow
  the budget).
* Agreement: max |ours − mergekit| per cell and the fraction of elements more than one bf16 ulp apart.

Targets (issue 14), printed held/missed per row: linear and task_arithmetic time ≤ 0.5× mergekit and ≤ 2× the
floor; ties ≤ 0.3× mergekit; karcher ≤ 0.4× mergekit; dare_ties, della, sce, model_stock, slerp ≤ 0.6× mergekit
(issue 22); peak RssAnon ≤ baseline + 256 MiB and ≤ 0.5× mergekit's.

Results: `benchmarks/results/<--output-name>.{json,md}`, rewritten after every cell (`complete: false` until the
end). Disk: base + max(N) inputs + one output must fit in `--workdir`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import threading
from pathlib import Path


REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
GiB, MiB = 1 << 30, 1 << 20

SIZES = {  # Llama-architecture dimensions; untied lm_head so both large (vocab × hidden) tensors are merged
    "350m": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=22, num_attention_heads=16),
    "small": dict(hidden_size=320, intermediate_size=896, num_hidden_layers=8, num_attention_heads=5),
}
VOCAB = 32000
RELATIVE_NOISE = 0.01
METHODS = ("linear", "task_arithmetic", "ties", "karcher", "dare_ties", "della", "sce", "model_stock", "slerp")
# time ≤ this × mergekit's (issue 14's targets; issue 22: 0.6 for the methods it added)
TARGET_SPEED = {"linear": 0.5, "task_arithmetic": 0.5, "ties": 0.3, "karcher": 0.4, "dare_ties": 0.6, "della": 0.6,
                "sce": 0.6, "model_stock": 0.6, "slerp": 0.6}  # fmt: skip
BASED = ("ties", "task_arithmetic", "dare_ties", "della", "sce", "model_stock", "slerp")  # recipes with base_model θ0
FLOOR_FACTOR = {"linear": 2.0, "task_arithmetic": 2.0}  # time ≤ this × the read+write floor
RSS_HEADROOM = 256 * MiB
MERGEKIT_VERSION = "0.1.5"

# Each runner prints one line `BENCH_JSON {...}` with the seconds spent after its imports.
MERGEKIT_RUNNER = """
import json, sys, time, torch
torch.set_num_threads(1)
import yaml
from mergekit.config import MergeConfiguration
from mergekit.merge import run_merge
from mergekit.options import MergeOptions
config = MergeConfiguration.model_validate(yaml.safe_load(open(sys.argv[1])))
t0 = time.perf_counter()
run_merge(config, sys.argv[2], options=MergeOptions(copy_tokenizer=False, quiet=True))
print("BENCH_JSON " + json.dumps({"merge_s": time.perf_counter() - t0}), flush=True)
"""
OURS_RUNNER = """
import json, sys, time, torch
torch.set_num_threads(1)
from hf_stable.merging.config import MergeConfig
from hf_stable.merging.engine import merge
config = MergeConfig.from_yaml(sys.argv[1])
t0 = time.perf_counter()
result = merge(config, sys.argv[2], progress=False, memory_budget=sys.argv[3] if len(sys.argv) > 3 else None)
extra = {"buffers": result.peak_tracked_bytes, "timings": result.timings}
print("BENCH_JSON " + json.dumps({"merge_s": time.perf_counter() - t0, **extra}), flush=True)
"""
FLOOR_RUNNER = """
import json, os, sys, time
inputs, out, size = sys.argv[1].split(os.pathsep), sys.argv[2], int(sys.argv[3])
buf = bytearray(64 << 20)
t0 = time.perf_counter()
for path in inputs:
    with open(path, "rb", buffering=0) as fh:
        while fh.readinto(buf):
            pass
with open(out, "wb", buffering=0) as fh:
    left = size
    while left:
        n = fh.write(memoryview(buf)[: min(left, len(buf))])
        left -= n
    os.fsync(fh.fileno())
print("BENCH_JSON " + json.dumps({"merge_s": time.perf_counter() - t0}), flush=True)
"""
BASELINE_RUNNER = "import torch, time; import hf_stable.merging.engine; time.sleep(0.5)"


# ----------------------------------------------------------------------------------------------------- checkpoints
def n_params(size):
    d = SIZES[size]
    h, i, layers = d["hidden_size"], d["intermediate_size"], d["num_hidden_layers"]
    return 2 * VOCAB * h + layers * (4 * h * h + 3 * h * i + 2 * h) + h


def build_base(folder, size, seed):
    """θ0: a freshly initialised LlamaForCausalLM, saved as bf16 safetensors with its config."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    d = SIZES[size]
    config = LlamaConfig(
        vocab_size=VOCAB, num_key_value_heads=d["num_attention_heads"], max_position_embeddings=2048,
        tie_word_embeddings=False, **d,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    del model
    for path in Path(folder).glob("*.safetensors"):
        with open(path, "rb+") as fh:
            os.fsync(fh.fileno())  # clean pages, so posix_fadvise(DONTNEED) can drop them for cold-cache runs


def read_header(path):
    with open(path, "rb") as fh:
        prefix = fh.read(8)
        raw = fh.read(int.from_bytes(prefix, "little"))
    return prefix + raw, json.loads(raw)


def write_perturbed(base, folder, index, seed):
    """θ0 → θ0 + ε with ‖ε‖ = 1% ‖θ0‖ per tensor, tensor by tensor: same header bytes, same offsets."""
    import torch
    from safetensors import safe_open

    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed * 1000 + index)
    for src in sorted(base.glob("*.safetensors")):
        head, header = read_header(src)
        names = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
        tmp = folder / (src.name + ".part")
        with safe_open(src, framework="pt") as reader, open(tmp, "wb") as out:
            out.write(head)
            for name in names:
                t = reader.get_tensor(name)
                if t.is_floating_point():
                    x = t.float()
                    noise = torch.randn(x.shape, generator=gen)
                    x += noise * (RELATIVE_NOISE * x.norm().item() / max(noise.norm().item(), 1e-30))
                    t = x.to(t.dtype)
                out.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
            out.flush()
            os.fsync(out.fileno())
        tmp.rename(folder / src.name)
    for path in base.iterdir():
        if path.suffix != ".safetensors":
            shutil.copy2(path, folder / path.name)


def ensure_checkpoints(root, size, n_max, seed):
    """root/base + root/model_1..model_{n_max}; reused when the recorded (size, seed, noise) match."""
    meta_path = root / "bench_meta.json"
    want = {"size": size, "dims": SIZES[size], "vocab": VOCAB, "seed": seed, "relative_noise": RELATIVE_NOISE}
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    if {k: meta.get(k) for k in want} != want:
        shutil.rmtree(root, ignore_errors=True)
        meta = dict(want, copies=0)
    root.mkdir(parents=True, exist_ok=True)
    base = root / "base"
    if not list(base.glob("*.safetensors")):
        build_base(base, size, seed)
    for i in range(meta.get("copies", 0) + 1, n_max + 1):
        write_perturbed(base, root / f"model_{i}", i, seed)
        meta["copies"] = i
        meta_path.write_text(json.dumps(meta, indent=1))
        print(f"  wrote model_{i}", flush=True)
    meta_path.write_text(json.dumps(meta, indent=1))
    return base, [root / f"model_{i}" for i in range(1, n_max + 1)]


def recipe(method, base, models):
    """The mergekit YAML text given to both tools."""
    lines = [f"merge_method: {method}"]
    if method in BASED:
        lines.append(f"base_model: {base}")
    if method == "slerp":  # two inputs: θ0 (the t = 0 end) and the first perturbed copy
        models = [base, models[0]]
    lines.append("models:")
    for m in models:
        lines.append(f"  - model: {m}")
        if method in ("ties", "dare_ties", "della"):
            lines.append("    parameters: {weight: 1.0, density: 0.5}")
        elif method in ("linear", "task_arithmetic", "sce"):
            lines.append("    parameters: {weight: 1.0}")
    if method == "task_arithmetic":
        lines.append(f"parameters: {{lambda: {1 / len(models)}}}")
    if method == "ties":
        lines.append("parameters: {normalize: true}")
    if method == "slerp":
        lines.append("parameters: {t: 0.5}")
    if method == "sce":
        lines.append("parameters: {select_topk: 0.5}")
    lines += ["dtype: float32", "out_dtype: bfloat16", ""]
    return "\n".join(lines)


def inputs_of(method, base, models):
    if method == "slerp":
        models = models[:1]
    folders = ([base] if method in BASED else []) + list(models)
    return [p for f in folders for p in sorted(Path(f).glob("*.safetensors"))]


# ---------------------------------------------------------------------------------------------------- measurement
def drop_cache(files):
    """Evict our own (fsynced) files from the page cache: posix_fadvise(DONTNEED), no root needed."""
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm(files):
    buf = bytearray(64 * MiB)
    for path in files:
        with open(path, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass


def measure(cmd, env):
    """Run `cmd`; peak RssAnon sampled every 20 ms; the `BENCH_JSON` line it prints."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = [0]
    done = threading.Event()

    def sample():
        while not done.is_set():
            try:
                with open(f"/proc/{proc.pid}/status") as fh:
                    for line in fh:
                        if line.startswith("RssAnon:"):
                            peak[0] = max(peak[0], int(line.split()[1]) * 1024)
            except OSError:
                pass
            done.wait(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, err = proc.communicate()
    done.set()
    sampler.join()
    inner = {}
    for line in out.splitlines():
        if line.startswith("BENCH_JSON "):
            inner = json.loads(line[len("BENCH_JSON ") :])
    error = None if proc.returncode == 0 else f"exit {proc.returncode}: {err.strip().splitlines()[-1:]}"
    return {"peak_anon": peak[0], "error": error, **inner}


def compare_outputs(dir_a, dir_b):
    """max |a − b| over tensors (fp32) and the fraction of elements more than one bf16 ulp apart."""
    import torch
    from safetensors import safe_open

    def index(folder):
        idx = {}
        for path in sorted(Path(folder).glob("*.safetensors")):
            with safe_open(path, framework="pt") as f:
                idx.update({k: path for k in f.keys()})
        return idx

    a_idx, b_idx = index(dir_a), index(dir_b)
    worst, far, total = 0.0, 0, 0
    for name in sorted(set(a_idx) & set(b_idx)):
        with safe_open(a_idx[name], framework="pt") as fa, safe_open(b_idx[name], framework="pt") as fb:
            a, b = fa.get_tensor(name).float(), fb.get_tensor(name).float()
        d = (a - b).abs()
        _, exponent = torch.frexp(torch.maximum(a.abs(), b.abs()))
        far += int((d > torch.ldexp(torch.ones_like(a), exponent - 8)).sum())
        total += a.numel()
        worst = max(worst, float(d.max()) if d.numel() else 0.0)
    return {"max_abs_diff": worst, "frac_over_1_bf16_ulp": far / max(total, 1),
            "missing": sorted(set(a_idx) ^ set(b_idx))}  # fmt: skip


# ------------------------------------------------------------------------------------------------------ statistics
def bootstrap_ci(values, n=10_000, seed=0):
    """Median and 95% bootstrap interval of the median of `values`."""
    values = [v for v in values if v is not None]
    if not values:
        return None, None, None
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(n))
    return statistics.median(values), meds[int(0.025 * n)], meds[int(0.975 * n) - 1]


def summarise(cell, baseline):
    """One table row from a cell's runs (repeat 0 discarded)."""
    runs = [r for r in cell["runs"] if r["repeat"] > 0]
    tools = ("mergekit", "ours", "floor")
    by = {t: {r["repeat"]: r for r in runs if r["tool"] == t and not r["error"]} for t in tools}
    reps = sorted(set(by["ours"]))
    vs_mk = [by["ours"][i]["merge_s"] / by["mergekit"][i]["merge_s"] for i in reps if i in by["mergekit"]]
    vs_floor = [by["ours"][i]["merge_s"] / by["floor"][i]["merge_s"] for i in reps if i in by["floor"]]
    row = {k: cell[k] for k in ("method", "n", "cache", "budget")}
    for tool in ("mergekit", "ours", "floor"):
        times = [r["merge_s"] for r in by[tool].values()]
        row[f"{tool}_s"] = statistics.median(times) if times else None
        row[f"{tool}_anon"] = max((r["peak_anon"] for r in by[tool].values()), default=None)
    row["ours_vs_mk"] = bootstrap_ci(vs_mk)
    row["ours_vs_floor"] = bootstrap_ci(vs_floor)
    row["repeats"] = len(reps)
    row["errors"] = sorted({r["error"] for r in cell["runs"] if r["error"]})
    row["agreement"] = cell.get("agreement")
    mk_anon, ours_anon = row["mergekit_anon"], row["ours_anon"]
    row["anon_over_baseline"] = None if ours_anon is None else ours_anon - baseline
    row["anon_ratio"] = None if not mk_anon or ours_anon is None else ours_anon / mk_anon
    speed = TARGET_SPEED.get(row["method"])
    targets = {}
    if row["budget"] is None:
        if speed and row["ours_vs_mk"][0] is not None:
            targets[f"time ≤ {speed}× mergekit"] = row["ours_vs_mk"][0] <= speed
        if row["method"] in FLOOR_FACTOR and row["ours_vs_floor"][0] is not None:
            targets[f"time ≤ {FLOOR_FACTOR[row['method']]}× floor"] = (
                row["ours_vs_floor"][0] <= FLOOR_FACTOR[row["method"]]
            )
        if row["anon_ratio"] is not None:
            targets["RssAnon ≤ 0.5× mergekit"] = row["anon_ratio"] <= 0.5
    if row["anon_over_baseline"] is not None:
        targets["RssAnon ≤ baseline + 256 MiB"] = row["anon_over_baseline"] <= RSS_HEADROOM
    row["targets"] = targets
    return row


def fmt_s(x):
    return "-" if x is None else f"{x:.2f}"


def fmt_mib(x):
    return "-" if x is None else f"{x / MiB:.0f}"


def fmt_ci(ci):
    med, lo, hi = ci
    return "-" if med is None else f"{med:.2f} [{lo:.2f}, {hi:.2f}]"


def table(rows):
    head = (
        "| method | N | cache | budget | floor s | mergekit s | hf_stable s | hf_stable / mergekit [95% CI] "
        "| hf_stable / floor [95% CI] | mergekit RssAnon MiB | hf_stable RssAnon MiB | hf_stable − baseline MiB "
        "| RssAnon hf_stable / mergekit | max abs diff (> 1 bf16 ulp) | targets |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        agree = r["agreement"]
        agree_s = "-" if not agree else f"{agree['max_abs_diff']:.2e} ({100 * agree['frac_over_1_bf16_ulp']:.2g}%)"
        marks = " ".join(f"{'✓' if ok else '✗'} {name}" for name, ok in r["targets"].items()) or "-"
        lines.append(
            f"| {r['method']} | {r['n']} | {r['cache']} | {r['budget'] or 'default'} | {fmt_s(r['floor_s'])} "
            f"| {fmt_s(r['mergekit_s'])} | {fmt_s(r['ours_s'])} | {fmt_ci(r['ours_vs_mk'])} "
            f"| {fmt_ci(r['ours_vs_floor'])} | {fmt_mib(r['mergekit_anon'])} | {fmt_mib(r['ours_anon'])} "
            f"| {fmt_mib(r['anon_over_baseline'])} | "
            + ("-" if r["anon_ratio"] is None else f"{r['anon_ratio']:.2f}")
            + f" | {agree_s} | {marks} |"
        )
    return lines


# ----------------------------------------------------------------------------------------------------------- main
def ensure_mergekit(venv: Path) -> tuple[Path, str]:
    """mergekit 0.1.5 in its own venv, created on first use; torch is pinned in the same pip command (else pip pulls
    a multi-GB CUDA build)."""
    py = venv / "bin" / "python"
    code = "import mergekit, torch; from importlib.metadata import version; print(version('mergekit'))"
    probe = [str(py), "-c", code]
    if py.exists():
        ok = subprocess.run(probe, capture_output=True, text=True)
        if ok.returncode == 0:
            return py, ok.stdout.strip()
    print(f"creating {venv} with mergekit=={MERGEKIT_VERSION} (torch==2.13.0 pinned) ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(py), "-m", "pip", "install", "--quiet", f"mergekit=={MERGEKIT_VERSION}", "torch==2.13.0"]
    done = subprocess.run(pip, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"pip install mergekit failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    ok = subprocess.run(probe, capture_output=True, text=True)
    if ok.returncode != 0:
        sys.exit(f"mergekit installed but does not import:\n{ok.stderr[-2000:]}")
    return py, ok.stdout.strip()


def main(args):
    started = datetime.datetime.now(datetime.timezone.utc)
    workdir = Path(args.workdir)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1")
    mk_python, mk_version = ensure_mergekit(Path(args.mergekit_venv).resolve())
    base, models = ensure_checkpoints(workdir / args.size, args.size, max(args.n), args.seed)
    out_root = workdir / "out"
    baseline = max(measure([sys.executable, "-c", BASELINE_RUNNER], env)["peak_anon"] for _ in range(3))
    print(f"torch + engine import baseline RssAnon: {baseline / MiB:.0f} MiB", flush=True)

    cells = []
    for n in sorted(args.n):
        for method in args.methods:
            cells.append({"method": method, "n": n, "cache": "warm", "budget": None})
    for spec in args.cold:
        method, n = spec.split(":")
        cells.append({"method": method, "n": int(n), "cache": "cold", "budget": None})
    for budget in args.budgets:
        cells.append({"method": "linear", "n": 4, "cache": "warm", "budget": budget})

    rng = random.Random(args.seed)
    rows = []

    def write(final):
        meta = {
            "started_utc": started.isoformat(timespec="seconds"),
            "complete": final,
            "size": args.size,
            "params": n_params(args.size),
            "input_bytes": sum(p.stat().st_size for p in base.glob("*.safetensors")),
            "mergekit": mk_version,
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "load_avg_start": list(load_start),
            "threads": 1,
            "repeats": args.repeats,
            "baseline_anon": baseline,
            "command": " ".join(sys.argv),
        }
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / f"{args.output_name}.json").write_text(
            json.dumps({"meta": meta, "rows": rows, "cells": cells}, indent=1, default=str) + "\n"
        )
        md = [
            f"# hf_stable merge vs mergekit {mk_version}" + ("" if final else " (PARTIAL)"),
            "",
            f"{args.size}: {n_params(args.size) / 1e6:.0f}M parameters, {meta['input_bytes'] / MiB:.0f} MiB per bf16 "
            f"input; 1 thread per tool; {args.repeats} repeats after a discarded warm-up, order randomised per "
            f"repeat; medians, paired ratios with bootstrap 95% intervals. Baseline RssAnon (torch + hf_stable "
            f"engine imported): {baseline / MiB:.0f} MiB. {os.cpu_count()} CPUs shared with other jobs (load "
            f"average {load_start[0]:.1f} at the start). Produced by `benchmarks/merge_vs_mergekit.py`.",
            "",
            *table(rows),
            "",
        ]
        missed = [(r, k) for r in rows for k, ok in r["targets"].items() if not ok]
        md.append("Targets missed: " + ("none." if not missed else ""))
        md += [f"* {r['method']} N={r['n']} {r['cache']} {r['budget'] or ''}: {k}" for r, k in missed]
        (RESULTS / f"{args.output_name}.md").write_text("\n".join(md) + "\n")

    load_start = os.getloadavg()
    for cell in cells:
        method, n = cell["method"], cell["n"]
        rec = out_root / f"{method}-{n}.yaml"
        out_root.mkdir(parents=True, exist_ok=True)
        rec.write_text(recipe(method, base, models[:n]))
        files = inputs_of(method, base, models[:n])
        out_bytes = 2 * n_params(args.size)
        cell["runs"] = []
        tools = ["ours"] if cell["budget"] else ["mergekit", "ours", "floor"]
        commands = {
            "mergekit": [str(mk_python), "-c", MERGEKIT_RUNNER, str(rec)],
            "ours": [sys.executable, "-c", OURS_RUNNER, str(rec)],
            "floor": [sys.executable, "-c", FLOOR_RUNNER, os.pathsep.join(map(str, files))],
        }
        extra = {"mergekit": [], "ours": [cell["budget"]] if cell["budget"] else [], "floor": [str(out_bytes)]}
        for repeat in range(args.repeats + 1):
            order = rng.sample(tools, len(tools))
            for tool in order:
                out = out_root / f"{tool}-{method}-{n}"
                shutil.rmtree(out, ignore_errors=True)
                if out.is_file():
                    out.unlink()
                if cell["cache"] == "cold":
                    drop_cache(files)
                else:
                    warm(files)
                result = measure([*commands[tool], str(out), *extra[tool]], env)
                result.update(tool=tool, repeat=repeat)
                cell["runs"].append(result)
                print(f"{method} N={n} {cell['cache']} {cell['budget'] or ''} r{repeat} {tool}: "
                      f"{result.get('merge_s', float('nan')):.2f} s, RssAnon {result['peak_anon'] / MiB:.0f} MiB"
                      + (f" ERROR {result['error']}" if result["error"] else ""), flush=True)  # fmt: skip
            mk_out, ours_out = out_root / f"mergekit-{method}-{n}", out_root / f"ours-{method}-{n}"
            if "agreement" not in cell and mk_out.is_dir() and ours_out.is_dir():
                cell["agreement"] = compare_outputs(ours_out, mk_out)
        for tool in tools:
            out = out_root / f"{tool}-{method}-{n}"
            shutil.rmtree(out, ignore_errors=True) if out.is_dir() else out.unlink(missing_ok=True)
        rows.append(summarise(cell, baseline))
        write(False)
    write(True)
    print("\n".join(table(rows)))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="350m", choices=sorted(SIZES))
    p.add_argument("--n", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--repeats", type=int, default=3, help="measured repeats (one more warm-up is discarded)")
    p.add_argument("--cold", nargs="*", default=["linear:4"], help="method:N cells also run with a cold cache")
    p.add_argument("--budgets", nargs="*", default=["256MB", "16GB"], help="hf_stable linear N=4 at these budgets")
    p.add_argument("--workdir", default=str(Path.home() / ".cache" / "hf_stable-bench-merge"))
    p.add_argument("--mergekit-venv", default=str(REPO / ".venv-mergekit"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-name", default="merge_vs_mergekit")
    return p.parse_args(argv)


if __name__ == "__main__":
    main(parse_args())
