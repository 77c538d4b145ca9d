"""Wall time and peak memory of hf_stable's streaming merge against mergekit on the same recipe, in one run.

    python benchmarks/merge_vs_mergekit.py [--size 350m|small] [--n 2 4 8] [--methods linear ties karcher]
        [--repeats 2] [--cache warm|cold|both] [--memory-budget 2GB] [--threads 1] [--workdir DIR]

Protocol (spec `merging.md` §8.1, §8.5; experiment E of §9):
* Synthetic Llama-architecture checkpoints, no downloads: θ0 is `LlamaForCausalLM` built from a config (350m: hidden
  1024, intermediate 2816, 22 layers, vocab 32000, untied lm_head, ~348M parameters; small: hidden 320, 8 layers,
  ~31M) and saved in bf16 safetensors. The N inputs are perturbed copies θ0 + ε_i with ‖ε_i‖ = 1% ‖θ0‖ per tensor,
  written tensor by tensor (one tensor in memory at a time). Kept in `--workdir` and reused by later runs.
* One mergekit YAML per (method, N), given unchanged to both tools: `linear` (weight 1 each), `ties` (base θ0,
  density 0.5, weight 1), `karcher` (equal weights; mergekit's Karcher mean, hf_stable's alias of `fisher_rao`), with
  `dtype: float32` (compute) and `out_dtype: bfloat16`. Each tool keeps its own defaults for everything else (notably
  Karcher `max_iter`/`tol`, mergekit's 5B-byte output shard buffer, hf_stable's reader/writer threads).
* Both tools run as subprocesses with the same environment (`OMP_NUM_THREADS=MKL_NUM_THREADS=--threads`, no GPU):
  mergekit through its `mergekit-yaml` click command (`mergekit.scripts.run_yaml.main`, called by a 6-line wrapper
  that also times the merge after imports; `--no-copy-tokenizer --quiet`, otherwise defaults) from its own venv
  (`--mergekit-venv`, created on first use with `pip install "torch==2.13.0" mergekit` in one command), hf_stable
  through `merge(MergeConfig.from_yaml(recipe), out, memory_budget=..., progress=False)`. Runs are interleaved and
  the order alternates per repeat (mergekit, ours; ours, mergekit; ...), so background load hits both alike.
  Warm cache: inputs read once before; cold cache: `posix_fadvise(DONTNEED)` on every input before each run.
* Measured per run: wall time of the process (python start-up and imports included), of the merge call alone
  (timed inside the process after imports) and CPU seconds (user + sys, `wait4`); peak `RssAnon`/`RssFile`/`VmRSS`
  summed over the process tree (sampled from `/proc/<pid>/status` every 50 ms) and the kernel's `ru_maxrss`. mmap'd
  input pages (mergekit reads through `safe_open`) show up in RssFile; `pread` traffic (hf_stable) does not. Memory
  targets use RssAnon.
* Read lower bound: one plain sequential read (`readinto` of 64 MiB blocks) of every input file the recipe uses, in
  the same cache state. Output agreement, tensor by tensor in fp32: max |ours − mergekit|, the fraction of elements
  that differ, and the fraction that differ by more than one bf16 ulp (more than a rounding flip).
* Targets (§8.5), each printed as held / missed: peak RssAnon ≤ budget + 10% and ≤ 0.5 × mergekit's; merge time ≤
  mergekit's and ≤ 1.5 × the read time. No timed assertions: the machine is shared, numbers are what they are.

Results: the table is printed and written to `benchmarks/results/<--output-name>.{json,md}` (default
`merge_vs_mergekit`), rewritten after every (N, method) cell so a long run that is stopped keeps what it measured
(`meta.complete` false). N is the outer loop, so the largest N runs last. `--prepare-only` only builds the
checkpoints. Disk: inputs + two outputs + 2 GiB must fit in `--workdir`, else the largest N (then the size) is
dropped with a note. mergekit runs whose §8.1 memory estimate exceeds `--max-rss` are skipped, and any run whose
RssAnon passes it is killed (noted in the table).
"""

import argparse
import contextlib
import datetime
import hashlib
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path


REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
GiB = 1 << 30
MiB = 1 << 20

SIZES = {  # Llama-architecture dimensions; untied lm_head so both large (vocab × hidden) tensors are merged
    "350m": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=22, num_attention_heads=16),
    "small": dict(hidden_size=320, intermediate_size=896, num_hidden_layers=8, num_attention_heads=5),
}
VOCAB = 32000
RELATIVE_NOISE = 0.01
METHODS = ("linear", "ties", "karcher")
MERGEKIT_FLAGS = ["--no-copy-tokenizer", "--quiet"]  # mergekit-yaml options; everything else at its defaults

READING = [
    "* wall = whole process (python start-up and imports included); merge = inside the process after imports; cpu ="
    " user + sys seconds of the process (imports included; less sensitive than wall to other jobs on the machine)."
    " Time ratios and targets use merge time; times are medians and RSS the maximum over repeats.",
    "* RssAnon is the memory a merge really holds; RssFile counts mmap'd input pages (mergekit reads through"
    " safe_open) plus mapped shared libraries (torch alone is ~80-200 MiB of it); it is reclaimable page cache.",
    "* ties: the task vectors τ = (θ0+ε) − θ0 of bf16 inputs take few distinct values, so many |τ| tie at the"
    " density threshold. mergekit keeps exactly k = density·numel entries (argsort, ties broken arbitrarily);"
    " hf_stable keeps every |τ| ≥ the k-th largest (PEFT `magnitude_based_pruning`). An entry kept by one tool and"
    " trimmed by the other moves by its |τ|: that, not arithmetic, is why 17-30% of ties outputs differ (6-11% by"
    " more than one bf16 ulp) at 1% noise.",
    "* karcher: mergekit's iterative mean (max_iter 10, tol 1e-5, in fp32 on whole tensors) vs hf_stable's"
    " coefficient-space solver on the fp64 Gram (max_iter 50, tol 1e-7); each at its defaults. Checked once against"
    " an fp64 Karcher mean (350m, N=2): hf_stable is within 4e-8 relative on every tensor checked; mergekit's fp32"
    " arccos/dot products lose ~1e-4 relative on 1M-element tensors and ~4e-4 on the 32.8M-element embed_tokens and"
    " lm_head, where ~49% of its bf16 outputs round differently. The karcher differences are mergekit's error.",
    "* small size: the models (58 MiB) are far below the 2GB budget, so memory there is per-process overhead and how"
    " much each tool keeps resident by choice; the 350m rows are the memory comparison that matters.",
]

# Run inside each tool's own interpreter. Both print one line `BENCH_JSON {...}` with the in-process timings.
MERGEKIT_RUNNER = """
import json, sys, time
t0 = time.perf_counter()
from mergekit.scripts.run_yaml import main
t1 = time.perf_counter()
main.main(sys.argv[1:], standalone_mode=False)
t2 = time.perf_counter()
print("BENCH_JSON " + json.dumps({"import_s": t1 - t0, "merge_s": t2 - t1}), flush=True)
"""
OURS_RUNNER = """
import json, sys, time
t0 = time.perf_counter()
from hf_stable.merging import MergeConfig, merge
t1 = time.perf_counter()
result = merge(MergeConfig.from_yaml(sys.argv[1]), sys.argv[2], memory_budget=sys.argv[3], progress=False)
t2 = time.perf_counter()
extra = {k: getattr(result, k, None) for k in ("bytes_read", "bytes_written", "peak_tracked_bytes")}
timings = getattr(result, "timings", None)
extra["timings"] = {k: v for k, v in dict(timings or {}).items() if isinstance(v, (int, float))}
print("BENCH_JSON " + json.dumps({"import_s": t1 - t0, "merge_s": t2 - t1, **extra}, default=str), flush=True)
"""
STARTUP_RUNNERS = {  # imports only: the fixed cost each tool pays per process
    "mergekit": "import mergekit.scripts.run_yaml",
    "hf_stable": "import hf_stable.merging.engine, hf_stable.merging.config",
}


# ----------------------------------------------------------------------------------------------------------- sizes
def parse_size(text):
    """'2GB' / '512MiB' / '1.5G' / int → bytes (decimal GB/MB, binary GiB/MiB, bare G/M binary)."""
    s = str(text).strip().replace(" ", "")
    units = {"KIB": 1 << 10, "MIB": MiB, "GIB": GiB, "TIB": 1 << 40, "KB": 10**3, "MB": 10**6, "GB": 10**9}
    units.update({"TB": 10**12, "K": 1 << 10, "M": MiB, "G": GiB, "T": 1 << 40, "B": 1})
    for unit in sorted(units, key=len, reverse=True):
        if s.upper().endswith(unit):
            return int(float(s[: -len(unit)]) * units[unit])
    return int(float(s))


def fmt_bytes(n):
    return "-" if n is None else f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.0f} MiB"


def n_params(size):
    """Parameter count of the synthetic model (q, k, v, o full-rank heads; gate/up/down MLP; two norms per layer)."""
    d = SIZES[size]
    h, i, layers = d["hidden_size"], d["intermediate_size"], d["num_hidden_layers"]
    return 2 * VOCAB * h + layers * (4 * h * h + 3 * h * i + 2 * h) + h


# ----------------------------------------------------------------------------------------------------- checkpoints
def build_base(folder, size, seed):
    """θ0: a freshly initialised LlamaForCausalLM (transformers' init), saved as bf16 safetensors with its config."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    d = SIZES[size]
    config = LlamaConfig(
        vocab_size=VOCAB,
        num_key_value_heads=d["num_attention_heads"],
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        **d,
    )
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
        header_len = int.from_bytes(prefix, "little")
        raw = fh.read(header_len)
    return prefix + raw, json.loads(raw)


def write_perturbed(base, folder, index, seed):
    """Copy θ0 → θ0 + ε with ‖ε‖ = 1% ‖θ0‖ per tensor, tensor by tensor: same header bytes, same offsets.

    Returns (‖ε‖², ‖θ0‖²) summed over float tensors, for the printed check.
    """
    import torch
    from safetensors import safe_open

    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed * 1000 + index)
    eps_sq = theta_sq = 0.0
    for src in sorted(base.glob("*.safetensors")):
        head, header = read_header(src)
        names = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
        tmp = folder / (src.name + ".part")
        with safe_open(src, framework="pt") as reader, open(tmp, "wb") as out:
            out.write(head)
            for name in names:
                assert out.tell() == len(head) + header[name]["data_offsets"][0], name
                t = reader.get_tensor(name)
                if t.is_floating_point():
                    x = t.float()
                    norm = x.norm().item()
                    noise = torch.randn(x.shape, generator=gen)
                    noise *= RELATIVE_NOISE * norm / max(noise.norm().item(), 1e-30)
                    x += noise
                    eps_sq += (x.to(t.dtype).float() - t.float()).square().sum().item()
                    theta_sq += norm * norm
                    t = x.to(t.dtype)
                out.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
            out.flush()
            os.fsync(out.fileno())
        tmp.rename(folder / src.name)
    for path in base.iterdir():
        if path.suffix != ".safetensors":
            shutil.copy2(path, folder / path.name)
    return eps_sq, theta_sq


def checkpoint_bytes(folder):
    return sum(p.stat().st_size for p in Path(folder).glob("*.safetensors"))


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
        t0 = time.perf_counter()
        build_base(base, size, seed)
        print(f"  built θ0 ({fmt_bytes(checkpoint_bytes(base))}) in {time.perf_counter() - t0:.0f} s", flush=True)
    for i in range(meta.get("copies", 0) + 1, n_max + 1):
        t0 = time.perf_counter()
        eps_sq, theta_sq = write_perturbed(base, root / f"model_{i}", i, seed)
        meta["copies"] = i
        meta_path.write_text(json.dumps(meta, indent=1))
        print(
            f"  wrote model_{i}: ‖ε‖/‖θ0‖ = {math.sqrt(eps_sq / theta_sq):.4f} (after bf16 rounding) "
            f"in {time.perf_counter() - t0:.0f} s",
            flush=True,
        )
    meta_path.write_text(json.dumps(meta, indent=1))
    return base, [root / f"model_{i}" for i in range(1, n_max + 1)]


def plan_disk(workdir, size, n_values, seed):
    """Drop the largest N (then the size) until inputs + two outputs + 2 GiB margin fit in the free space."""
    workdir.mkdir(parents=True, exist_ok=True)
    notes = []
    sizes = [size] + (["small"] if size != "small" else [])
    for s in sizes:
        root = workdir / s
        per_model = 2 * n_params(s) + MiB
        meta = json.loads((root / "bench_meta.json").read_text()) if (root / "bench_meta.json").exists() else {}
        have = meta.get("copies", 0) if meta.get("seed") == seed else 0
        have_base = meta.get("seed") == seed and any((root / "base").glob("*.safetensors"))
        free = shutil.disk_usage(workdir).free
        ns = sorted(n_values)
        while ns:
            need = (max(0, max(ns) - have) + (0 if have_base else 1) + 2) * per_model + 2 * GiB
            if need <= free:
                if ns != sorted(n_values) or s != size:
                    notes.append(
                        f"disk: {fmt_bytes(free)} free in {workdir}; scaled down to size {s}, N ∈ {ns} "
                        f"(needs {fmt_bytes(need)} incl. 2 GiB margin)"
                    )
                    print("NOTE " + notes[-1], flush=True)
                return s, ns, notes
            ns = ns[:-1]
    sys.exit(f"not enough disk space in {workdir} ({fmt_bytes(shutil.disk_usage(workdir).free)} free) even for N=2")


# -------------------------------------------------------------------------------------------------------- recipes
def recipe(method, base, models):
    """The mergekit YAML text used by both tools (paths are absolute)."""
    lines = [f"merge_method: {method}"]
    if method == "ties":
        lines.append(f"base_model: {base}")
    lines.append("models:")
    for m in models:
        lines.append(f"  - model: {m}")
        if method == "linear":
            lines.append("    parameters: {weight: 1.0}")
        elif method == "ties":
            lines.append("    parameters: {weight: 1.0, density: 0.5}")
    if method == "ties":
        lines.append("parameters: {normalize: true}")
    lines += ["dtype: float32", "out_dtype: bfloat16", ""]
    return "\n".join(lines)


def recipe_inputs(method, base, models):
    folders = ([base] if method == "ties" else []) + list(models)
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


def sequential_read(files):
    """Seconds to read every byte once, 64 MiB at a time (the read lower bound of §8.1)."""
    buf = bytearray(64 * MiB)
    total = 0
    t0 = time.perf_counter()
    for path in files:
        with open(path, "rb", buffering=0) as fh:
            os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
            while n := fh.readinto(buf):
                total += n
    return time.perf_counter() - t0, total


def _tree(pid):
    pids, stack = [], [pid]
    while stack:
        p = stack.pop()
        pids.append(p)
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as fh:
                    stack += [int(c) for c in fh.read().split()]
    return pids


def _rss_kb(pids):
    out = {"VmRSS": 0, "RssAnon": 0, "RssFile": 0}
    for p in pids:
        with contextlib.suppress(OSError):
            with open(f"/proc/{p}/status") as fh:
                for line in fh:
                    key = line.split(":", 1)[0]
                    if key in out:
                        out[key] += int(line.split()[1])
    return out


def measure(cmd, env, *, kill_above_anon=None, log_path=None):
    """Run `cmd`, sampling the process tree's memory every 50 ms; kill it if RssAnon passes `kill_above_anon`."""
    log = open(log_path, "w") if log_path else subprocess.DEVNULL  # closed below
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
    peak = {"VmRSS": 0, "RssAnon": 0, "RssFile": 0}
    state = {"killed": None}
    done = threading.Event()

    def sample():
        while not done.is_set():
            rss = _rss_kb(_tree(proc.pid))
            for k, v in rss.items():
                peak[k] = max(peak[k], v)
            if kill_above_anon and rss["RssAnon"] * 1024 > kill_above_anon and state["killed"] is None:
                state["killed"] = rss["RssAnon"] * 1024
                with contextlib.suppress(OSError):
                    os.kill(proc.pid, signal.SIGKILL)
            done.wait(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    stdout = proc.stdout.read()  # until the child closes it (exit)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    done.set()
    sampler.join()
    proc.returncode = os.waitstatus_to_exitcode(status)
    proc.stdout.close()
    if log_path:
        log.close()
    inner = {}
    for line in stdout.splitlines():
        if line.startswith("BENCH_JSON "):
            inner = json.loads(line[len("BENCH_JSON ") :])
    error = None
    if state["killed"]:
        error = f"killed: RssAnon {fmt_bytes(state['killed'])} passed --max-rss"
    elif proc.returncode != 0:
        tail = Path(log_path).read_text().strip().splitlines()[-3:] if log_path else []
        error = f"exit {proc.returncode}: " + " | ".join(tail)[-400:]
    return {
        "wall_s": wall,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "peak_anon": peak["RssAnon"] * 1024,
        "peak_file": peak["RssFile"] * 1024,
        "peak_rss": peak["VmRSS"] * 1024,
        "ru_maxrss": usage.ru_maxrss * 1024,
        "error": error,
        **inner,
    }


def compare_outputs(dir_a, dir_b):
    """Tensor by tensor in fp32: max |a − b|, the worst tensor, max |a − b| / max |a|, the fraction of elements that
    differ, the fraction that differ by more than one bf16 spacing (ulp) at max(|a|, |b|) (a rounding flip is one
    ulp), and the largest difference in ulps (large for entries near zero)."""
    import torch
    from safetensors import safe_open

    def index(folder):
        idx = {}
        for path in sorted(Path(folder).glob("*.safetensors")):
            with safe_open(path, framework="pt") as f:
                idx.update({k: path for k in f.keys()})
        return idx

    a_idx, b_idx = index(dir_a), index(dir_b)
    missing = sorted(set(a_idx) ^ set(b_idx))
    worst, worst_name, worst_rel, worst_ulps, n_diff, n_far, n_total = 0.0, None, 0.0, 0.0, 0, 0, 0
    for name in sorted(set(a_idx) & set(b_idx)):
        with safe_open(a_idx[name], framework="pt") as fa, safe_open(b_idx[name], framework="pt") as fb:
            a, b = fa.get_tensor(name).float(), fb.get_tensor(name).float()
        if a.shape != b.shape:
            missing.append(f"{name} (shape {tuple(a.shape)} vs {tuple(b.shape)})")
            continue
        if not a.numel():
            continue
        diff = (a - b).abs()
        d = diff.max().item()
        n_diff += int((diff > 0).sum())
        n_total += a.numel()
        _, exponent = torch.frexp(torch.maximum(a.abs(), b.abs()))
        ulp = torch.ldexp(torch.ones_like(a), exponent - 8)  # bf16 keeps 8 significant bits
        ulps = diff / ulp
        n_far += int((ulps > 1).sum())  # more than one rounding step apart
        worst_ulps = max(worst_ulps, ulps.max().item())
        worst_rel = max(worst_rel, d / max(a.abs().max().item(), 1e-30))
        if d > worst or worst_name is None:
            worst, worst_name = d, name
    return {
        "max_abs_diff": worst,
        "worst_tensor": worst_name,
        "max_rel_diff": worst_rel,
        "max_diff_bf16_ulps": worst_ulps,
        "frac_elements_differing": n_diff / max(n_total, 1),
        "frac_elements_over_1_ulp": n_far / max(n_total, 1),
        "mismatched": missing,
    }


# ------------------------------------------------------------------------------------------------------- mergekit
def ensure_mergekit(venv):
    """Create the venv on first use; torch pinned in the same pip command (else pip pulls a multi-GB CUDA build)."""
    py = venv / "bin" / "python"
    probe = [
        str(py),
        "-c",
        "import mergekit, torch; from importlib.metadata import version; print(version('mergekit'))",
    ]
    if py.exists():
        ok = subprocess.run(probe, capture_output=True, text=True)
        if ok.returncode == 0:
            return py, ok.stdout.strip()
    print(f"creating {venv} and installing mergekit (torch==2.13.0 pinned) ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = subprocess.run(
        [str(py), "-m", "pip", "install", "--quiet", "torch==2.13.0", "mergekit"], capture_output=True, text=True
    )
    if pip.returncode != 0:
        sys.exit(f"pip install mergekit failed (exit {pip.returncode}):\n{pip.stdout[-2000:]}\n{pip.stderr[-4000:]}")
    ok = subprocess.run(probe, capture_output=True, text=True)
    if ok.returncode != 0:
        sys.exit(f"mergekit installed but does not import:\n{ok.stderr[-2000:]}")
    return py, ok.stdout.strip()


def mergekit_rss_estimate(method, n, max_tensor_numel, out_bytes):
    """§8.1 estimate of mergekit's anonymous peak: ~(3-5)·N fp32 copies of the largest tensor + one output shard."""
    factor = 5 if method == "ties" else 4
    return factor * (n + (method == "ties")) * 4 * max_tensor_numel + out_bytes + GiB  # + interpreter and imports


# ---------------------------------------------------------------------------------------------------------- table
def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def ratio(a, b):
    return None if a is None or not b else a / b


def fmt(x, spec=".2f", suffix=""):
    return "-" if x is None else f"{x:{spec}}{suffix}"


def summarise(runs, reads, diffs, budget):
    rows = []
    for key in sorted({(r["method"], r["n"], r["cache"]) for r in runs}, key=lambda k: (METHODS.index(k[0]), k[1:])):
        method, n, cache = key
        mine = {t: [r for r in runs if (r["method"], r["n"], r["cache"]) == key and r["tool"] == t and not r["error"]]
                for t in ("mergekit", "hf_stable")}  # fmt: skip
        errors = {t: [r["error"] for r in runs if (r["method"], r["n"], r["cache"]) == key and r["tool"] == t
                      and r["error"]] for t in ("mergekit", "hf_stable")}  # fmt: skip
        row = {"method": method, "n": n, "cache": cache, "read_s": median(reads.get(key, []))}
        for t, short in (("mergekit", "mk"), ("hf_stable", "ours")):
            row[f"{short}_wall_s"] = median([r["wall_s"] for r in mine[t]])
            row[f"{short}_merge_s"] = median([r.get("merge_s") for r in mine[t]])
            row[f"{short}_cpu_s"] = median([r["cpu_s"] for r in mine[t]])
            row[f"{short}_anon"] = max([r["peak_anon"] for r in mine[t]], default=None)
            row[f"{short}_file"] = max([r["peak_file"] for r in mine[t]], default=None)
            row[f"{short}_maxrss"] = max([r["ru_maxrss"] for r in mine[t]], default=None)
            row[f"{short}_runs"] = len(mine[t])
            row[f"{short}_errors"] = errors[t]
        row["wall_ratio"] = ratio(row["ours_wall_s"], row["mk_wall_s"])
        row["merge_ratio"] = ratio(row["ours_merge_s"], row["mk_merge_s"])
        row["cpu_ratio"] = ratio(row["ours_cpu_s"], row["mk_cpu_s"])
        row["ours_over_read"] = ratio(row["ours_merge_s"], row["read_s"])
        row["mk_over_read"] = ratio(row["mk_merge_s"], row["read_s"])
        row["anon_ratio"] = ratio(row["ours_anon"], row["mk_anon"])
        row["ours_anon_over_budget"] = ratio(row["ours_anon"], budget)
        row.update(diffs.get((method, n), {}))
        row["targets"] = {
            "rss_le_budget_plus_10pct": None if row["ours_anon"] is None else row["ours_anon"] <= 1.1 * budget,
            "rss_le_half_mergekit": None if row["anon_ratio"] is None else row["anon_ratio"] <= 0.5,
            "merge_time_le_mergekit": None if row["merge_ratio"] is None else row["merge_ratio"] <= 1.0,
            "merge_time_le_1.5x_read": None if row["ours_over_read"] is None else row["ours_over_read"] <= 1.5,
        }
        rows.append(row)
    return rows


HEADER = (
    "| method | N | cache | read s | mk wall / merge / cpu s | ours wall / merge / cpu s | merge ours/mk "
    "| cpu ours/mk | ours/read | mk RssAnon | ours RssAnon | anon ours/mk | ours/budget | mk RssFile | ours RssFile "
    "| max abs diff (% elems differing, % > 1 bf16 ulp) | targets |"
)


def pct(x):
    return "-" if x is None else f"{100 * x:.3g}%"


def yes_no(targets):
    marks = {True: "✓", False: "✗", None: "?"}
    return " ".join(marks[targets[k]] for k in targets)


def table_lines(rows):
    lines = [HEADER, "|" + "---|" * (HEADER.count("|") - 1)]
    for r in rows:
        lines.append(
            f"| {r['method']} | {r['n']} | {r['cache']} | {fmt(r['read_s'])} "
            f"| {fmt(r['mk_wall_s'], '.1f')} / {fmt(r['mk_merge_s'], '.1f')} / {fmt(r['mk_cpu_s'], '.1f')} "
            f"| {fmt(r['ours_wall_s'], '.1f')} / {fmt(r['ours_merge_s'], '.1f')} / {fmt(r['ours_cpu_s'], '.1f')} "
            f"| {fmt(r['merge_ratio'], '.2f', 'x')} | {fmt(r['cpu_ratio'], '.2f', 'x')} "
            f"| {fmt(r['ours_over_read'], '.2f', 'x')} "
            f"| {fmt_bytes(r['mk_anon'])} | {fmt_bytes(r['ours_anon'])} | {fmt(r['anon_ratio'], '.2f', 'x')} "
            f"| {fmt(r['ours_anon_over_budget'], '.2f', 'x')} "
            f"| {fmt_bytes(r['mk_file'])} | {fmt_bytes(r['ours_file'])} "
            f"| {fmt(r.get('max_abs_diff'), '.2e')} ({pct(r.get('frac_elements_differing'))}, "
            f"{pct(r.get('frac_elements_over_1_ulp'))}) "
            f"| {yes_no(r['targets'])} |"
        )
    return lines


def notes_lines(rows):
    out = []
    for r in rows:
        for t, short in (("mergekit", "mk"), ("hf_stable", "ours")):
            for e in sorted(set(r[f"{short}_errors"])):
                out.append(f"* {r['method']} N={r['n']} {r['cache']}: {t} failed: {e}")
        if r.get("mismatched"):
            out.append(f"* {r['method']} N={r['n']}: tensors differing in name/shape: {r['mismatched'][:5]}")
    return out


# ----------------------------------------------------------------------------------------------------------- main
def main(args):
    budget = parse_size(args.memory_budget)
    started = datetime.datetime.now(datetime.timezone.utc)
    workdir = Path(args.workdir)
    notes = []
    size, n_values, disk_notes = plan_disk(workdir, args.size, args.n, args.seed)
    notes += disk_notes
    threads = str(args.threads)
    env = dict(os.environ, OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1")

    tools = []
    mk_python = mk_version = None
    if not args.skip_mergekit:
        mk_python, mk_version = ensure_mergekit(Path(args.mergekit_venv).resolve())
        tools.append("mergekit")
    ours_ok = None
    if not args.skip_ours:
        probe = subprocess.run(
            [sys.executable, "-c", "from hf_stable.merging import MergeConfig, merge"],
            env=env, capture_output=True, text=True,
        )  # fmt: skip
        ours_ok = probe.returncode == 0
        if ours_ok:
            tools.append("hf_stable")
        else:
            notes.append("hf_stable engine not importable: " + probe.stderr.strip().splitlines()[-1][-300:])
            print("NOTE " + notes[-1], flush=True)
    if not tools:
        sys.exit("nothing to run (both tools skipped or unavailable)")

    print(f"checkpoints: size {size} ({n_params(size) / 1e6:.0f}M params), N ∈ {n_values}, in {workdir / size}")
    base, models = ensure_checkpoints(workdir / size, size, max(n_values), args.seed)
    if args.prepare_only:
        return
    model_bytes = checkpoint_bytes(base)
    _, header = read_header(next(iter(sorted(base.glob("*.safetensors")))))
    max_numel = max(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")
    out_root = workdir / "out"
    logs = workdir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    mem_available = next(
        int(line.split()[1]) * 1024 for line in open("/proc/meminfo") if line.startswith("MemAvailable")
    )
    max_rss = parse_size(args.max_rss) if args.max_rss else int(0.7 * mem_available)
    commands = {
        "mergekit": lambda rec, out: [str(mk_python), "-c", MERGEKIT_RUNNER, str(rec), str(out), *MERGEKIT_FLAGS],
        "hf_stable": lambda rec, out: [sys.executable, "-c", OURS_RUNNER, str(rec), str(out), args.memory_budget],
    }

    startup = {}
    for tool in tools:  # fixed per-process cost (python + imports), in the same environment
        py = str(mk_python) if tool == "mergekit" else sys.executable
        startup[tool] = measure([py, "-c", STARTUP_RUNNERS[tool]], env)
        print(
            f"start-up {tool}: {startup[tool]['wall_s']:.1f} s, RssAnon {fmt_bytes(startup[tool]['peak_anon'])}",
            flush=True,
        )

    # which engine code was measured (it may change between runs): sha256 and mtime of every hf_stable/merging file
    sources = {
        str(p.relative_to(REPO)): [hashlib.sha256(p.read_bytes()).hexdigest()[:12], int(p.stat().st_mtime)]
        for p in sorted((REPO / "hf_stable" / "merging").rglob("*.py"))
    }
    caches = ["warm", "cold"] if args.cache == "both" else [args.cache]
    runs, reads, diffs = [], {}, {}

    def report(final):
        rows = summarise(runs, reads, diffs, budget)
        title = (
            f"hf_stable merge vs mergekit {mk_version or '(not run)'}: size {size} "
            f"({n_params(size) / 1e6:.0f}M params, "
            f"{fmt_bytes(model_bytes)} per bf16 input), budget {args.memory_budget}, {args.threads} thread(s) each "
            f"(OMP/MKL), {args.repeats} interleaved repeat(s), {os.cpu_count()} CPUs, "
            f"{fmt_bytes(mem_available)} RAM available at start" + ("" if final else " (PARTIAL: run still going)")
        )
        lines = table_lines(rows)
        target_names = "targets (✓ held, ✗ missed, ? not measured): RssAnon ≤ budget+10%, RssAnon ≤ 0.5× mergekit, "
        target_names += "merge time ≤ mergekit, merge time ≤ 1.5× read time"
        start_line = "start-up (python + imports, included in wall, excluded from merge): " + ", ".join(
            f"{t} {s['wall_s']:.1f} s / RssAnon {fmt_bytes(s['peak_anon'])}" for t, s in startup.items()
        )
        held = {}
        for r in rows:
            for k, v in r["targets"].items():
                held.setdefault(k, []).append(v)
        summary = [
            f"{k}: held in {sum(v is True for v in vs)}/{sum(v is not None for v in vs)} rows"
            for k, vs in held.items()
        ]
        extra = notes_lines(rows)
        if final:
            print("\n" + title + "\n")
            print("\n".join(lines))
            print("\n" + target_names + "\n" + start_line)
            print("\n".join(summary))
            for line in notes + extra:
                print("NOTE " + line.lstrip("* "))
            print("\n".join(READING))

        RESULTS.mkdir(parents=True, exist_ok=True)
        meta = {
            "started_utc": started.isoformat(timespec="seconds"),
            "complete": final,
            "finished_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "size": size,
            "dims": SIZES[size],
            "vocab": VOCAB,
            "params": n_params(size),
            "bytes_per_input": model_bytes,
            "largest_tensor_numel": max_numel,
            "relative_noise": RELATIVE_NOISE,
            "n_values": n_values,
            "methods": list(args.methods),
            "caches": caches,
            "repeats": args.repeats,
            "memory_budget": args.memory_budget,
            "memory_budget_bytes": budget,
            "threads": args.threads,
            "mergekit_version": mk_version,
            "mergekit_flags": MERGEKIT_FLAGS,
            "hf_stable_merging_sources": sources,
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "mem_available_at_start": mem_available,
            "max_rss_guard": max_rss,
            "startup": startup,
            "notes": notes + [x.lstrip("* ") for x in extra],
        }
        (RESULTS / f"{args.output_name}.json").write_text(
            json.dumps({"meta": meta, "rows": rows, "runs": runs, "summary": summary}, indent=1, default=str)
        )
        md = [f"# {title}", "", f"Command: `python benchmarks/merge_vs_mergekit.py {' '.join(sys.argv[1:])}`", ""]
        md += [*lines, "", target_names + ".", "", start_line + ".", ""]
        md += [f"* {s}" for s in summary] + [""] + [f"* {x}" for x in notes] + extra
        md += ["", "How to read it:", *READING]
        (RESULTS / f"{args.output_name}.md").write_text("\n".join(md) + "\n")
        if final:
            print(f"\nwrote {RESULTS / args.output_name}.json and .md", flush=True)

    for n in n_values:  # N outer: the long N=8 runs come last, and results are written after every cell
        for method in args.methods:
            rec_path = workdir / f"recipe_{method}_{n}.yaml"
            rec_path.write_text(recipe(method, base, models[:n]))
            inputs = recipe_inputs(method, base, models[:n])
            skip_mk = None
            estimate = mergekit_rss_estimate(method, n, max_numel, model_bytes)
            if "mergekit" in tools and estimate > max_rss:
                skip_mk = f"skipped: estimated RssAnon {fmt_bytes(estimate)} > --max-rss {fmt_bytes(max_rss)}"
                notes.append(f"{method} N={n}: mergekit {skip_mk}")
                print("NOTE " + notes[-1], flush=True)
            for cache in caches:
                key = (method, n, cache)
                if cache == "warm":
                    sequential_read(inputs)  # bring the inputs into the page cache
                for rep in range(args.repeats):
                    if cache == "cold":
                        drop_cache(inputs)
                    seconds, nbytes = sequential_read(inputs)
                    reads.setdefault(key, []).append(seconds)
                    order = tools if rep % 2 == 0 else tools[::-1]
                    for tool in order:
                        if tool == "mergekit" and skip_mk:
                            continue
                        out = out_root / tool
                        shutil.rmtree(out, ignore_errors=True)
                        shutil.rmtree(str(out) + ".tmp", ignore_errors=True)
                        if cache == "cold":
                            drop_cache(inputs)
                        load = os.getloadavg()[0]
                        r = measure(
                            commands[tool](rec_path, out),
                            env,
                            kill_above_anon=max_rss,
                            log_path=logs / f"{tool}_{method}_{n}_{cache}_{rep}.log",
                        )
                        r.update(tool=tool, method=method, n=n, cache=cache, repeat=rep, loadavg=load)
                        runs.append(r)
                        print(
                            f"  {method:<7} N={n} {cache} #{rep} {tool:<9} wall {r['wall_s']:6.1f} s "
                            f"merge {fmt(r.get('merge_s'), '6.1f')} s  RssAnon {fmt_bytes(r['peak_anon']):>9}  "
                            f"RssFile {fmt_bytes(r['peak_file']):>9}  read {seconds:.1f} s ({fmt_bytes(nbytes)})  "
                            f"load {load:.1f}" + (f"  ERROR {r['error']}" if r["error"] else ""),
                            flush=True,
                        )
            if all((out_root / t).exists() for t in ("mergekit", "hf_stable")):
                diffs[(method, n)] = compare_outputs(out_root / "mergekit", out_root / "hf_stable")
            for t in ("mergekit", "hf_stable"):
                shutil.rmtree(out_root / t, ignore_errors=True)
            report(final=False)

    report(final=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="350m")
    parser.add_argument("--n", type=int, nargs="+", default=[2, 4, 8], help="numbers of merged models")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--cache", choices=["warm", "cold", "both"], default="warm")
    parser.add_argument("--memory-budget", default="2GB", help="hf_stable's memory_budget")
    parser.add_argument("--threads", type=int, default=1, help="OMP/MKL threads for both tools")
    parser.add_argument("--workdir", default="/tmp/hf_stable_merge_bench")
    parser.add_argument("--mergekit-venv", default=str(REPO / ".venv-mergekit"))
    parser.add_argument("--max-rss", default=None, help="skip/kill a run above this RssAnon (default 70%% of free)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-mergekit", action="store_true")
    parser.add_argument("--skip-ours", action="store_true")
    parser.add_argument("--prepare-only", action="store_true", help="build the checkpoints (and venv) and exit")
    parser.add_argument("--output-name", default="merge_vs_mergekit", help="results file stem in benchmarks/results")
    main(parser.parse_args())
