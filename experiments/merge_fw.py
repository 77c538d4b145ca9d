"""FW-Merging stays stable as irrelevant models are added (Chen et al. 2025, arXiv 2503.12649).

Claim (FW-Merging, arXiv 2503.12649). Frank–Wolfe merging over the layer-wise convex hull of a pool, driven by a small
labelled proxy objective, picks the relevant candidates per tensor, so its accuracy on the target tasks does not move
as irrelevant models are added to the pool, while data-free merges of the whole pool (average, task arithmetic,
TIES) lose accuracy. Streaming the candidates one tensor at a time keeps resident memory flat in the pool size
(load-all baselines grow linearly); the price is I/O, about T·(N + 1) model reads.

Design (scaled down to fit ≈ 2 CPU-minutes per seed on one thread; the data and model are those of
`merge_fisher_rao.py` except where noted).
* Data: x ∈ R³², 8 domains, domain j: x ∼ N(μ_j, I) with ‖μ_j‖ = 4 in a random direction; labels in a shared
  10-class space from a domain-specific random linear teacher, y = argmax(A_j x). Base task: a generic teacher A_0
  on the mixture of all 8 domains.
* Model: MLP 32→256→256→10, GELU, LayerNorm (77,834 parameters). Base: 3,000 Adam steps, lr 1e-3, batch 128.
  Experts: fine-tuned from the base on domain j with teacher A_j, h = 800 steps (one heterogeneity level of
  `merge_fisher_rao.py`, not the sweep), lr 1e-3, batch 128; data drawn fresh every step.
* Targets: domains 1–4, their 4 experts are the relevant pool members. Proxy set: 64 labelled examples per target
  domain (256 in all); test: 2,000 fresh examples per target domain.
* Pool: the 4 relevant experts + M ∈ {0, 4, 8, 16} irrelevant ones: M = 4 experts for domains 5–8 under NEW teachers
  (not A_5..A_8); M = 8 adds a second set (other new teachers, other seed); M = 16 adds 8 noisy copies θ_0 + ε of
  random task vectors, each tensor's ε Gaussian with the norm of an irrelevant expert's task vector on that tensor.
  Every pool member is written to its own safetensors folder on disk; FW streams them from there.
* Relevance arm: R ∈ {0, 4, 8} extra relevant experts (domains 1–4, same teachers, new fine-tuning seeds) at M = 0.
* Methods: average of the pool; task arithmetic θ_0 + λΣτ_i (λ tuned on the proxy CE over {0.05, 0.1, 0.15, 0.2,
  0.3, 0.4, 0.5, 0.7, 1.0}); TIES (density 0.3, λ tuned on the proxy CE over {0.2, 0.4, 0.6, 0.8, 1.0, 1.2});
  FW-hard layer-wise LMO (`lmo_score: gap`, init base, TA local merge λ = 1, T = 10, η = 1); FW task-wise LMO; FW
  with the reference's LMO (`lmo_score: ref_cosine`, layer-wise). FW objective = the proxy CE (sum over target
  domains of the per-domain mean CE), the same data TA/TIES use to tune λ. FW-soft (v1.1) is not run.
* Metrics: mean test accuracy over the 4 target domains; peak resident candidate bytes (fp32 working copies counted
  by `hf_stable.merging.fw.ResidentTracker`, which follows each candidate tensor with a weak reference) for FW
  streaming from disk vs a load-all baseline that holds the whole pool (as average/TA/TIES here and AdaMerging-style
  methods do); bytes read. Process RSS is not reported: at 0.3 MB per model it is noise next to torch's own
  footprint.
* Seeds 0-4 (data, teachers, init, fine-tuning, noise; 0-2 first, then 3 and 4 added with nothing else changed, as
  a seed runs in about a minute); criteria on seed means, with per-seed counts.

Pass criteria (pre-registered before any run; printed PASS/FAIL as measured):
  (a) FW layer-wise: |acc(M) − acc(0)| ≤ 1 pp for every M ∈ {4, 8, 16} (mean over seeds);
  (b) TA and TIES degrade: acc(16) ≤ acc(0) − 1 pp for each of them (mean over seeds);
  (c) memory: FW's peak resident candidate bytes are the same for every pool size, while the load-all baseline's
      grow linearly (peak at N = 20 equals 5× the peak at N = 4).
Reported, not gated: FW task-wise and ref_cosine, the relevance arm (does FW improve with R?), bytes read.

Run history: seed 0 was first run alone as a timing check (same code and numbers as in the results); nothing in the
design, sizes or criteria was changed after seeing any result.

Command (measured 378 s wall for seeds 0-2 on 2 CPU cores shared with other jobs, about 1 CPU-minute per seed):
    OMP_NUM_THREADS=1 .venv/bin/python experiments/merge_fw.py
Quick smoke run (< 60 s, 1 seed, tiny sizes; its pass/fail means nothing):
    OMP_NUM_THREADS=1 .venv/bin/python experiments/merge_fw.py --quick --out /tmp/merge_fw_quick
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from _harness import declare, mean_std, result_sizes, run, save_figure, subplots
from _harness import fmt as harness_fmt
from safetensors.torch import load_file, save_file
from torch import nn
from torch.func import functional_call

from hf_stable.merging.fw import ResidentTracker, fw_merge, local_merge_all


NAME = "merge_fw"
ROOT = Path(__file__).resolve().parent
TA_GRID = (0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.7, 1.0)
TIES_GRID = (0.2, 0.4, 0.6, 0.8, 1.0, 1.2)
TIES_DENSITY = 0.3
TOL_PP = 1.0  # (a), (b): one percentage point
METHODS = ("average", "ta", "ties", "fw_layer", "fw_task", "fw_ref_cosine")
LABELS = {
    "average": "average",
    "ta": "task arithmetic (λ tuned)",
    "ties": "TIES (ρ 0.3, λ tuned)",
    "fw_layer": "FW layer-wise LMO",
    "fw_task": "FW task-wise LMO",
    "fw_ref_cosine": "FW ref_cosine LMO",
}
COLORS = {
    "average": "tab:gray",
    "ta": "tab:blue",
    "ties": "tab:purple",
    "fw_layer": "tab:red",
    "fw_task": "tab:orange",
    "fw_ref_cosine": "tab:brown",
}


@dataclass(frozen=True)
class Sizes:
    dim: int = 32
    classes: int = 10
    domains: int = 8
    targets: int = 4
    mu_norm: float = 4.0
    hidden: int = 256
    base_steps: int = 3000
    expert_steps: int = 800
    batch: int = 128
    lr: float = 1e-3
    proxy_per_domain: int = 64
    test_per_domain: int = 2000
    pool_sizes: tuple = (0, 4, 8, 16)
    extra_relevant: tuple = (0, 4, 8)
    fw_iters: int = 10


QUICK = Sizes(hidden=64, base_steps=400, expert_steps=150, test_per_domain=500, extra_relevant=(0, 4), fw_iters=5)


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int, classes: int):
        super().__init__()
        self.fc1, self.ln1 = nn.Linear(dim, hidden), nn.LayerNorm(hidden)
        self.fc2, self.ln2 = nn.Linear(hidden, hidden), nn.LayerNorm(hidden)
        self.out = nn.Linear(hidden, classes)

    def forward(self, x):
        h = F.gelu(self.ln1(self.fc1(x)))
        return self.out(F.gelu(self.ln2(self.fc2(h))))


class World:
    """Domains (means), teachers and samplers for one seed."""

    def __init__(self, seed: int, s: Sizes):
        g = torch.Generator().manual_seed(10_000 + seed)
        self.s = s
        mu = torch.randn(s.domains, s.dim, generator=g)
        self.mu = s.mu_norm * mu / mu.norm(dim=1, keepdim=True)
        self.base_teacher = torch.randn(s.classes, s.dim, generator=g)
        self.teachers = torch.randn(s.domains, s.classes, s.dim, generator=g)
        # irrelevant experts: domains targets..domains-1 under NEW teachers, two sets
        n_irr = s.domains - s.targets
        self.irr_teachers = torch.randn(2, n_irr, s.classes, s.dim, generator=g)

    def sample(self, domain, teacher: torch.Tensor, n: int, g: torch.Generator):
        """domain: int or LongTensor (n,) of domain ids; teacher (C, D) or (n, C, D)."""
        dom = torch.full((n,), domain) if isinstance(domain, int) else domain
        x = self.mu[dom] + torch.randn(n, self.s.dim, generator=g)
        logits = torch.einsum("ncd,nd->nc", teacher, x) if teacher.dim() == 3 else x @ teacher.T
        return x, logits.argmax(1)


def train(model: nn.Module, batches, steps: int, lr: float) -> nn.Module:
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(steps):
        x, y = batches()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return model


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def accuracy(model: nn.Module, params: dict, data) -> float:
    with torch.no_grad():
        return statistics.mean(
            float((functional_call(model, params, (x,)).argmax(1) == y).float().mean()) for x, y in data
        )


def proxy_ce(model: nn.Module, params: dict, proxy) -> torch.Tensor:
    """Σ_k mean CE on proxy domain k (the FW objective and the λ-tuning criterion)."""
    return sum(F.cross_entropy(functional_call(model, params, (x,)), y) for x, y in proxy)


def build_pool(seed: int, s: Sizes, folder: Path) -> dict:
    """Train base + experts for one seed; write every candidate to `folder/<name>/model.safetensors`."""
    world = World(seed, s)
    torch.manual_seed(seed)
    model = MLP(s.dim, s.hidden, s.classes)
    g = torch.Generator().manual_seed(20_000 + seed)

    def mixture():
        dom = torch.randint(0, s.domains, (s.batch,), generator=g)
        return world.sample(dom, world.base_teacher, s.batch, g)

    t0 = time.time()
    train(model, mixture, s.base_steps, s.lr)
    base = state(model)

    def expert(domain: int, teacher: torch.Tensor, tag: int) -> dict:
        m = MLP(s.dim, s.hidden, s.classes)
        m.load_state_dict(base)
        ge = torch.Generator().manual_seed(30_000 + 1000 * seed + 100 * tag + domain)
        train(m, lambda: world.sample(domain, teacher, s.batch, ge), s.expert_steps, s.lr)
        return state(m)

    relevant = [expert(j, world.teachers[j], 0) for j in range(s.targets)]
    extra = [expert(j, world.teachers[j], 1 + r) for r in range(2) for j in range(s.targets)]
    irrelevant = [
        expert(s.targets + j, world.irr_teachers[r, j], 5 + r) for r in range(2) for j in range(s.domains - s.targets)
    ]
    gn = torch.Generator().manual_seed(40_000 + seed)
    noisy = []
    for k in range(8):
        ref = irrelevant[k % len(irrelevant)]
        cand = {}
        for n, b in base.items():
            eps = torch.randn(b.shape, generator=gn)
            tau_norm = (ref[n] - b).norm()
            cand[n] = b + eps * tau_norm / eps.norm().clamp(min=1e-12)
        noisy.append(cand)
    paths = {}
    for tag, group in (("relevant", relevant), ("extra", extra), ("irrelevant", irrelevant), ("noisy", noisy)):
        paths[tag] = []
        for i, sd in enumerate(group):
            d = folder / f"{tag}{i}"
            d.mkdir(parents=True)
            save_file({k: v.contiguous() for k, v in sd.items()}, str(d / "model.safetensors"))
            paths[tag].append(str(d))
    gp = torch.Generator().manual_seed(50_000 + seed)
    proxy = [world.sample(j, world.teachers[j], s.proxy_per_domain, gp) for j in range(s.targets)]
    gt = torch.Generator().manual_seed(60_000 + seed)
    test = [world.sample(j, world.teachers[j], s.test_per_domain, gt) for j in range(s.targets)]
    return {
        "model": model,
        "base": base,
        "paths": paths,
        "proxy": proxy,
        "test": test,
        "train_seconds": time.time() - t0,
        "relevant": relevant,
    }


def pool_for(paths: dict, m: int, r: int = 0) -> list[str]:
    irr = (paths["irrelevant"] + paths["noisy"])[:m]
    return paths["relevant"] + paths["extra"][:r] + irr


def load_all(pool: list[str], tracker: ResidentTracker) -> list[dict]:
    """The load-all baseline: every pool member resident at once (fp32), counted by the same tracker."""
    out = []
    for p in pool:
        sd = load_file(str(Path(p) / "model.safetensors"))
        out.append({k: tracker.track(v.float(), v.numel() * v.element_size()) for k, v in sd.items()})
    return out


def tuned(model, base, loaded, proxy, method: str, grid) -> tuple[dict, float]:
    best = None
    for lam in grid:
        kw = {"density": TIES_DENSITY} if method == "ties" else {}
        merged = local_merge_all(base, loaded, method=method, scaling=lam, **kw)
        with torch.no_grad():
            loss = float(proxy_ce(model, merged, proxy))
        if best is None or loss < best[2]:
            best = (merged, lam, loss)
    return best[0], best[1]


def irrelevant_share(history, pool: list[str]) -> float:
    """Fraction of FW tensor selections (excluding no-move/zeros) that went to a non-relevant candidate."""
    total = irr = 0
    for rec in history.iterations:
        for label, count in rec["counts"].items():
            if label in ("no_move", "zeros"):
                continue
            total += count
            irr += count if ("irrelevant" in Path(label).name or "noisy" in Path(label).name) else 0
    return irr / total if total else 0.0


def run_seed(seed: int, s: Sizes) -> dict:
    torch.manual_seed(seed)
    folder = Path(tempfile.mkdtemp(prefix=f"merge_fw_{seed}_"))
    try:
        w = build_pool(seed, s, folder)
        model, base, proxy, test, paths = w["model"], w["base"], w["proxy"], w["test"], w["paths"]

        def objective(params):
            return proxy_ce(model, params, proxy)

        out = {
            "train_seconds": w["train_seconds"],
            "base_acc": accuracy(model, base, test),
            "expert_acc_own_domain": [accuracy(model, e, [test[j]]) for j, e in enumerate(w["relevant"])],
            "acc": {m: {} for m in METHODS},
            "lambda": {"ta": {}, "ties": {}},
            "memory": {},
            "bytes_read": {},
            "fw_irrelevant_share": {},
            "fw_gap_final": {},
            "relevance": {},
        }
        model_bytes = sum(v.numel() * 4 for v in base.values())
        out["model_bytes_fp32"] = model_bytes
        for m in s.pool_sizes:
            pool = pool_for(paths, m)
            tracker = ResidentTracker()
            loaded = load_all(pool, tracker)
            avg = {k: sum(sd[k] for sd in loaded) / len(loaded) for k in base}
            out["acc"]["average"][m] = accuracy(model, avg, test)
            merged, lam = tuned(model, base, loaded, proxy, "ta", TA_GRID)
            out["acc"]["ta"][m], out["lambda"]["ta"][m] = accuracy(model, merged, test), lam
            merged, lam = tuned(model, base, loaded, proxy, "ties", TIES_GRID)
            out["acc"]["ties"][m], out["lambda"]["ties"][m] = accuracy(model, merged, test), lam
            load_peak = tracker.peak_bytes
            del loaded, avg, merged
            fw_peak, fw_read = {}, {}
            for method, kw in (
                ("fw_layer", {}),
                ("fw_task", {"lmo": "task"}),
                ("fw_ref_cosine", {"lmo_score": "ref_cosine"}),
            ):
                merged, hist = fw_merge(base, pool, objective, iters=s.fw_iters, progress=False, **kw)
                out["acc"][method][m] = accuracy(model, merged, test)
                out["fw_irrelevant_share"].setdefault(method, {})[m] = irrelevant_share(hist, pool)
                out["fw_gap_final"].setdefault(method, {})[m] = hist.iterations[-1]["gap"]
                fw_peak[method], fw_read[method] = hist.peak_resident_bytes, hist.bytes_read
            out["memory"][m] = {
                "pool_size": len(pool),
                "fw_peak_bytes": fw_peak["fw_layer"],
                "load_all_peak_bytes": load_peak,
            }
            out["bytes_read"][m] = {"fw_layer": fw_read["fw_layer"], "load_all": len(pool) * model_bytes}
        for r in s.extra_relevant:
            pool = pool_for(paths, 0, r)
            merged, _ = fw_merge(base, pool, objective, iters=s.fw_iters, progress=False)
            loaded = load_all(pool, ResidentTracker())
            ta, lam = tuned(model, base, loaded, proxy, "ta", TA_GRID)
            out["relevance"][r] = {"fw_layer": accuracy(model, merged, test), "ta": accuracy(model, ta, test)}
        return out
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# --------------------------------------------------------------------------------------------------------------------
# aggregation, criteria, outputs
# --------------------------------------------------------------------------------------------------------------------


def aggregate(per_seed: dict, s: Sizes) -> dict:
    runs = list(per_seed.values())
    agg = {
        "base_acc": mean_std([r["base_acc"] for r in runs]),
        "expert_acc_own_domain": mean_std([statistics.mean(r["expert_acc_own_domain"]) for r in runs]),
        "acc": {
            meth: {m: mean_std([100 * r["acc"][meth][m] for r in runs]) for m in s.pool_sizes} for meth in METHODS
        },
        "relevance": {
            arm: {r: mean_std([100 * x["relevance"][r][arm] for x in runs]) for r in s.extra_relevant}
            for arm in ("fw_layer", "ta")
        },
        "memory": runs[0]["memory"],  # deterministic given the sizes (identical across seeds)
        "bytes_read": {
            m: {k: statistics.mean(r["bytes_read"][m][k] for r in runs) for k in ("fw_layer", "load_all")}
            for m in s.pool_sizes
        },
        "fw_irrelevant_share": {
            meth: {m: statistics.mean(r["fw_irrelevant_share"][meth][m] for r in runs) for m in s.pool_sizes}
            for meth in ("fw_layer", "fw_task", "fw_ref_cosine")
        },
    }
    return agg


def criteria(per_seed: dict, agg: dict, s: Sizes) -> dict:
    m0, ms, mmax = s.pool_sizes[0], s.pool_sizes[1:], s.pool_sizes[-1]
    runs = list(per_seed.values())

    def count(rule) -> str:
        return f"{sum(rule(r) for r in runs)}/{len(runs)} seeds"

    fw = agg["acc"]["fw_layer"]
    drift = max(abs(fw[m]["mean"] - fw[m0]["mean"]) for m in ms)
    checks = {
        "a": {
            "criterion": f"FW layer-wise: |acc(M) − acc({m0})| ≤ {TOL_PP} pp for every M in {list(ms)}",
            "values": {"max_drift_pp": drift, **{f"acc_M{m}": fw[m]["mean"] for m in s.pool_sizes}},
            "passed": drift <= TOL_PP,
            "per_seed": count(
                lambda r: max(abs(r["acc"]["fw_layer"][m] - r["acc"]["fw_layer"][m0]) * 100 for m in ms) <= TOL_PP
            ),
        },
    }
    drops = {meth: agg["acc"][meth][m0]["mean"] - agg["acc"][meth][mmax]["mean"] for meth in ("ta", "ties")}
    checks["b"] = {
        "criterion": f"TA and TIES degrade: acc({mmax}) ≤ acc({m0}) − {TOL_PP} pp, each",
        "values": {f"{k}_drop_pp": v for k, v in drops.items()},
        "passed": all(v >= TOL_PP for v in drops.values()),
        "per_seed": count(
            lambda r: all((r["acc"][k][m0] - r["acc"][k][mmax]) * 100 >= TOL_PP for k in ("ta", "ties"))
        ),
    }
    mem = agg["memory"]
    fw_peaks = [mem[m]["fw_peak_bytes"] for m in s.pool_sizes]
    load = [mem[m]["load_all_peak_bytes"] for m in s.pool_sizes]
    sizes = [mem[m]["pool_size"] for m in s.pool_sizes]
    linear = all(abs(load[i] / load[0] - sizes[i] / sizes[0]) < 1e-9 for i in range(len(sizes)))
    checks["c"] = {
        "criterion": "FW peak resident candidate bytes flat in pool size; load-all grows linearly",
        "values": {
            "fw_peak_bytes_min": min(fw_peaks),
            "fw_peak_bytes_max": max(fw_peaks),
            "load_all_ratio_largest_vs_smallest": load[-1] / load[0],
            "pool_ratio": sizes[-1] / sizes[0],
        },
        "passed": len(set(fw_peaks)) == 1 and linear,
        "per_seed": count(lambda r: len({r["memory"][m]["fw_peak_bytes"] for m in s.pool_sizes}) == 1),
    }
    return checks


def plot(agg: dict, s: Sizes, path: Path) -> None:
    fig, axes = subplots(1, 3, figsize=(17, 4.8))
    ax = axes[0]
    for meth in METHODS:
        ys = [agg["acc"][meth][m]["mean"] for m in s.pool_sizes]
        es = [agg["acc"][meth][m]["std"] for m in s.pool_sizes]
        ax.errorbar(s.pool_sizes, ys, yerr=es, marker="o", capsize=3, color=COLORS[meth], label=LABELS[meth])
    ax.axhline(100 * agg["base_acc"]["mean"], color="black", linestyle=":", label="base")
    ax.set(
        title="mean target accuracy vs irrelevant pool members M\n(4 relevant experts; mean ± std over seeds)",
        xlabel="M (irrelevant candidates)",
        ylabel="target-domain test accuracy (%)",
    )
    ax.legend(fontsize=8)
    ax = axes[1]
    n = [agg["memory"][m]["pool_size"] for m in s.pool_sizes]
    ax.plot(
        n,
        [agg["memory"][m]["fw_peak_bytes"] / 1024 for m in s.pool_sizes],
        "o-",
        color="tab:red",
        label="FW (streamed from safetensors)",
    )
    ax.plot(
        n,
        [agg["memory"][m]["load_all_peak_bytes"] / 1024 for m in s.pool_sizes],
        "s-",
        color="tab:blue",
        label="load-all baseline",
    )
    ax.set(title="peak resident candidate bytes (fp32 copies)", xlabel="pool size N", ylabel="KiB", yscale="log")
    ax.legend(fontsize=8)
    ax = axes[2]
    ax.plot(
        n,
        [agg["bytes_read"][m]["fw_layer"] / 2**20 for m in s.pool_sizes],
        "o-",
        color="tab:red",
        label=f"FW layer-wise, T = {s.fw_iters}",
    )
    ax.plot(
        n,
        [agg["bytes_read"][m]["load_all"] / 2**20 for m in s.pool_sizes],
        "s-",
        color="tab:blue",
        label="load-all (read once)",
    )
    ax.set(title="bytes read from the pool", xlabel="pool size N", ylabel="MiB")
    ax.legend(fontsize=8)
    fig.suptitle("FW-Merging vs data-free merges as irrelevant models join the pool")
    save_figure(fig, path, dpi=120)


def markdown(result: dict) -> str:
    agg, checks, cfg = result["aggregate"], result["criteria"], result["config"]
    s = cfg["sizes"]

    def fmt(ms):
        return harness_fmt(ms, 1)

    lines = [
        f"Mean ± std over seeds (accuracy in %). MLP {s['dim']}→{s['hidden']}→{s['hidden']}→"
        f"{s['classes']}, base {s['base_steps']} steps, experts {s['expert_steps']} steps; 4 target domains, proxy "
        f"{s['proxy_per_domain']} examples per target domain, test {s['test_per_domain']} per domain; FW T = "
        f"{s['fw_iters']}, η = 1, TA local merge λ = 1, init base. Base accuracy on the targets "
        f"{100 * agg['base_acc']['mean']:.1f}%, each expert on its own domain "
        f"{100 * agg['expert_acc_own_domain']['mean']:.1f}%.",
        "",
        "| method | " + " | ".join(f"M = {m}" for m in s["pool_sizes"]) + " |",
        "|---|" + "---|" * len(s["pool_sizes"]),
    ]
    for meth in METHODS:
        cells = " | ".join(fmt(agg["acc"][meth][str(m)]) for m in s["pool_sizes"])
        lines.append(f"| {LABELS[meth]} | {cells} |")
    lines += [
        "",
        "Share of FW tensor selections that went to an irrelevant candidate:",
        "",
        "| LMO | " + " | ".join(f"M = {m}" for m in s["pool_sizes"]) + " |",
        "|---|" + "---|" * len(s["pool_sizes"]),
    ]
    for meth, v in agg["fw_irrelevant_share"].items():
        lines.append(f"| {LABELS[meth]} | " + " | ".join(f"{v[m]:.2f}" for m in v) + " |")
    lines += [
        "",
        "| pool size N | FW peak resident candidate bytes | load-all peak bytes | FW bytes read | "
        "load-all bytes read |",
        "|---|---|---|---|---|",
    ]
    for m, mem in agg["memory"].items():
        br = agg["bytes_read"][m]
        lines.append(
            f"| {mem['pool_size']} | {mem['fw_peak_bytes']:,} | {mem['load_all_peak_bytes']:,} | "
            f"{br['fw_layer']:,.0f} | {br['load_all']:,.0f} |"
        )
    lines += [
        "",
        "Relevance arm (M = 0, R extra relevant experts):",
        "",
        "| R | FW layer-wise | TA (λ tuned) |",
        "|---|---|---|",
    ]
    for r in agg["relevance"]["fw_layer"]:
        lines.append(f"| {r} | {fmt(agg['relevance']['fw_layer'][r])} | {fmt(agg['relevance']['ta'][r])} |")
    lines += [
        "",
        "## Interpretation",
        "",
        interpretation(agg, checks, s),
        "",
    ]
    return "\n".join(lines)


def interpretation(agg: dict, checks: dict, s: dict) -> str:
    """Sentences generated from the measured numbers (a rerun cannot leave a stale interpretation)."""
    acc = agg["acc"]
    ms = list(acc["fw_layer"])
    first, last = ms[0], ms[-1]
    parts = []
    for meth in METHODS:
        parts.append(f"{LABELS[meth]} {acc[meth][first]['mean']:.1f}% → {acc[meth][last]['mean']:.1f}%")
    text = f"From M = {first} to M = {last}: " + "; ".join(parts) + "."
    text += (
        f" FW layer-wise drifts by at most {checks['a']['values']['max_drift_pp']:.2f} pp "
        f"({'PASS' if checks['a']['passed'] else 'FAIL'} (a), {checks['a']['per_seed']}); TA drops "
        f"{checks['b']['values']['ta_drop_pp']:.1f} pp and TIES {checks['b']['values']['ties_drop_pp']:.1f} pp "
        f"({'PASS' if checks['b']['passed'] else 'FAIL'} (b), {checks['b']['per_seed']})."
    )
    best_static = max(("average", "ta", "ties"), key=lambda k: acc[k][first]["mean"])
    gap0 = acc["fw_layer"][first]["mean"] - acc[best_static][first]["mean"]
    text += (
        f" At M = {first} FW layer-wise is {gap0:+.1f} pp against the best data-free merge "
        f"({LABELS[best_static]}); stability is the claim tested, not the level."
    )
    share = agg["fw_irrelevant_share"]["fw_layer"]
    text += (
        f" FW layer-wise sends {min(list(share.values())[1:]):.0%}–{max(share.values()):.0%} of its tensor selections "
        "to irrelevant candidates once they are in the pool (the linear score <g, θ_i − x> finds descent directions "
        "in some of their tensors), which is where its drift comes from; the task-wise LMO picks an irrelevant model "
        f"in {max(agg['fw_irrelevant_share']['fw_task'].values()):.0%} of its selections at most."
    )
    expert = 100 * agg["expert_acc_own_domain"]["mean"]
    text += (
        f" Caveat: every merge sits far below the experts ({expert:.1f}% on their own domain) and the seed-to-seed "
        "spread of the level is large, because the four target domains use unrelated random teachers over one shared "
        "label space (the data of `merge_fisher_rao.py`), so no single weight vector serves them all; the criteria "
        "compare each method "
        "with itself across M on the same seed, which that spread does not affect."
    )
    rel = agg["relevance"]["fw_layer"]
    rs = list(rel)
    text += (
        f" Adding relevant experts moves FW layer-wise from {rel[rs[0]]['mean']:.1f}% (R = {rs[0]}) to "
        f"{rel[rs[-1]]['mean']:.1f}% (R = {rs[-1]})."
    )
    return text


def _int_keys(agg: dict) -> dict:
    """`agg` with pool sizes / R values as ints again (JSON keys are strings)."""

    def fix(d):
        if isinstance(d, dict):
            return {(int(k) if isinstance(k, str) and k.isdigit() else k): fix(v) for k, v in d.items()}
        return d

    return fix(agg)


EXPERIMENT = declare(
    globals(),
    default_seeds=(0, 1, 2, 3, 4),
    title="FW-Merging stays stable as irrelevant models are added",
    claim="FW-Merging keeps target accuracy as irrelevant experts join the pool, with resident memory flat in the "
    "pool size (arXiv 2503.12649).",
    aggregate=lambda per_seed, s: aggregate(
        {
            k: {**v, **_int_keys({f: v[f] for f in ("acc", "relevance", "bytes_read", "fw_irrelevant_share")})}
            for k, v in per_seed.items()
        },
        s,
    ),
    criteria=lambda per_seed, agg, s: criteria({k: _int_keys(v) for k, v in per_seed.items()}, _int_keys(agg), s),
    plot=lambda result, path: plot(_int_keys(result["aggregate"]), result_sizes(Sizes, result), path),
    config={
        "methods": list(METHODS),
        "ta_grid": TA_GRID,
        "ties_grid": TIES_GRID,
        "ties_density": TIES_DENSITY,
        "tol_pp": TOL_PP,
        "fw": {
            "lmo": "layer|task",
            "lmo_score": "gap|ref_cosine",
            "init": "base",
            "local_merge": {"method": "ta", "scaling": 1.0},
            "step": 1.0,
        },
    },
)


if __name__ == "__main__":
    run(EXPERIMENT)
