"""Fisher–Rao vs linear as heterogeneity grows: does norm-restored spherical merging beat weight averaging?

Claim (Fisher–Rao merging, arXiv 2603.04972). Averaging fine-tunes in Euclidean space shrinks norms and
activation variance once their directions disagree; the Fisher–Rao merge (per-tensor weighted spherical Karcher mean,
then the weighted-mean norm restored) keeps the activation-variance ratio ρ^var ≈ 1 and degrades less as the
heterogeneity h (fine-tuning length) and the number N of merged experts grow. Pre-registered side question: is the
Karcher solve worth it, i.e. is fisher_rao more than 0.5 pp better than NRE (linear + per-tensor norm restoration)
anywhere?

Design (experts are trained batched, 8 at a time, so the full sizes fit a CPU budget).
* Data: x ∈ R^32, 8 domains; domain j draws x ~ N(μ_j, I) with ‖μ_j‖ = 4 (random direction) and labels
  y = argmax(A_j x) from a domain-specific random Gaussian teacher A_j (10×32, shared 10-class space). Base task:
  a generic teacher A_0 on the uniform mixture of the 8 domains. Per domain: 500 validation, 2000 test points; the
  probe set for the data-based diagnostics is 2048 points, 256 from each of the 8 domains.
* Model: MLP 32→256→256→10, blocks Linear → LayerNorm → GELU (77,834 parameters, 10 tensors). Base: 3000 Adam
  steps, LR 1e-3, batch 128 on the mixture. Experts: fine-tune the base on domain j with teacher A_j, Adam LR 1e-3
  (fresh state), batch 128; the heterogeneity knob h ∈ {50, 200, 800, 3200} fine-tuning steps (snapshots of one run).
* Merges of N ∈ {2, 4, 8} experts, uniform weights α_i = 1/N: N = 2 on the 4 disjoint pairs (0,1) (2,3) (4,5) (6,7),
  N = 4 on (0-3) and (4-7), N = 8 on all; a cell's number is the mean over its subsets. Every tensor is merged.
  Methods (all from `hf_stable.merging.reference.merge_tensors`, i.e. the library's registered merge methods):
  linear; task arithmetic `θ0 + λ Σ τ_i` with λ ∈ TA_LAMBDAS chosen on the validation split; NRE (`nre`:
  Σ α_i x_i rescaled per tensor to Σ α_i ‖x_i‖); fisher_rao (`space: weights`, Karcher solver); fisher_rao
  (`space: task_vector`, base = the pre-trained model); TIES (density 0.3, λ ∈ TIES_LAMBDAS chosen on validation);
  multislerp = `nre_unit`. λ is selected per (seed, h, subset) by the mean validation accuracy over the merged
  domains; the test split is only reported.
* Metrics: test accuracy averaged over the N merged domains (each with its own teacher); diagnostics on the
  2048-point probe: per-layer activation-variance ratio ρ^var_ℓ = v(H^merged_ℓ) / Σ α_i v(H^(i)_ℓ) with
  v(H) = mean over units of the variance over probe points, and the effective-rank ratio (Roy–Vetterli erank of the
  centred activations, merged / mean of the experts) at the outputs of block 1, block 2 and the logits; per-tensor
  norm ratio ‖W_merged‖ / Σ α_i ‖W_i‖; mean KL(p_expert_i ‖ p_merged) on expert i's probe points. Measured
  heterogeneity per h: mean pairwise angle between the flattened task vectors τ_i = θ_i − θ0 (all 8 experts) and
  mean ‖τ_i‖ / ‖θ0‖.
* Seeds 0, 1, 2 (teachers, domain means, init, batches); numbers are seed means (± sample std).
* Checks: the library's merges are compared with an independent float64 re-implementation in this script on the
  largest-h, N = 8 cell (relative difference per tensor); the number of tensors on which the library's Karcher solver
  fell back to NRE (an input ≥ π/2 from the initial mean) is recorded per merge.

Pass criterion (pre-registered; printed PASS/FAIL as measured; a failure is a non-replication, not tuned):
  at the largest h (3200) and N = 8, on the seed means,
  (a) accuracy(fisher_rao, weights space) − accuracy(linear) ≥ 5 pp;
  (b) ρ^var(fisher_rao) ≥ 0.9, where ρ^var is the minimum over the three probed layers;
  (c) ρ^var(linear) ≤ 0.8 (same minimum over layers).
Side question (pre-registered, reported, not a criterion): is fisher_rao (weights or task-vector space) more than
0.5 pp better than NRE in any (h, N) cell (seed means)? If not, NRE is the fast default.

Command (4.1 CPU-minutes measured on one core for 3 seeds; 14 min wall on the shared 2-core machine):
    OMP_NUM_THREADS=1 .venv/bin/python experiments/merge_fisher_rao.py
Quick smoke run (< 60 s, 1 seed, tiny sizes; its pass/fail means nothing):
    OMP_NUM_THREADS=1 .venv/bin/python experiments/merge_fisher_rao.py --quick --out /tmp/merge_fisher_rao
Each seed is cached under `experiments/cache/merge_fisher_rao/` (keyed by the code), so rewriting the PNG and
Markdown after a finished run costs seconds.
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from _harness import declare, fmt, mean_std, run, save_figure, subplots


NAME = "merge_fisher_rao"
ROOT = Path(__file__).resolve().parent
DIM, HIDDEN, CLASSES, DOMAINS = 32, 256, 10, 8
MU_NORM = 4.0
TA_LAMBDAS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 1.0)
TIES_LAMBDAS = (0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 2.5, 3.0)
TIES_DENSITY = 0.3
ACC_MARGIN = 0.05  # (a): 5 pp
RHO_FR, RHO_LINEAR = 0.9, 0.8  # (b), (c)
SIDE_MARGIN = 0.005  # side question: 0.5 pp
LAYERS = ("block1", "block2", "logits")
TENSORS = ("w1", "b1", "g1", "n1", "w2", "b2", "g2", "n2", "w3", "b3")
METHODS = {  # label -> (registered method, params, tuned λ grid or None)
    "linear": ("linear", {}, None),
    "task_arithmetic": ("task_arithmetic", {}, TA_LAMBDAS),
    "nre": ("nre", {}, None),
    "nre_tv": ("nre", {"space": "task_vector"}, None),
    "fisher_rao": ("fisher_rao", {"space": "weights"}, None),
    "fisher_rao_tv": ("fisher_rao", {"space": "task_vector"}, None),
    "ties": ("ties", {"density": TIES_DENSITY}, TIES_LAMBDAS),
    "multislerp": ("nre_unit", {}, None),
}
LABELS = {
    "linear": "linear",
    "task_arithmetic": "task arithmetic (λ tuned)",
    "nre": "NRE",
    "nre_tv": "NRE (task vectors)",
    "fisher_rao": "Fisher–Rao (weights)",
    "fisher_rao_tv": "Fisher–Rao (task vectors)",
    "ties": "TIES (d=0.3, λ tuned)",
    "multislerp": "multislerp = nre_unit",
}
COLORS = {
    "linear": "tab:gray",
    "task_arithmetic": "tab:olive",
    "nre": "tab:blue",
    "nre_tv": "tab:pink",
    "fisher_rao": "tab:red",
    "fisher_rao_tv": "tab:purple",
    "ties": "tab:green",
    "multislerp": "tab:cyan",
}


@dataclass(frozen=True)
class Sizes:
    base_steps: int = 3000
    hs: tuple = (50, 200, 800, 3200)
    ns: tuple = (2, 4, 8)
    batch: int = 128
    lr: float = 1e-3
    n_val: int = 500
    n_test: int = 2000
    probe_per_domain: int = 256


QUICK = Sizes(base_steps=300, hs=(20, 200), ns=(2, 8), n_val=200, n_test=300, probe_per_domain=64)


# ---------------------------------------------------------------------------------------------------------------------
# data


class Domains:
    """8 Gaussian domains with their teachers, all drawn from one generator (the run seed)."""

    def __init__(self, seed: int):
        g = torch.Generator().manual_seed(seed)
        mu = torch.randn(DOMAINS, DIM, generator=g)
        self.mu = MU_NORM * mu / mu.norm(dim=1, keepdim=True)  # (8, 32)
        self.teachers = torch.randn(DOMAINS, CLASSES, DIM, generator=g)  # A_j, (8, 10, 32)
        self.generic = torch.randn(CLASSES, DIM, generator=g)  # A_0
        self.g = g

    def sample(self, domain: torch.Tensor, teacher: torch.Tensor | None = None):
        """x (n, 32) for domain ids `domain` (n,); labels from each domain's teacher, or from `teacher` if given."""
        x = self.mu[domain] + torch.randn(domain.shape[0], DIM, generator=self.g)
        if teacher is None:
            y = torch.einsum("ncd,nd->nc", self.teachers[domain], x).argmax(-1)
        else:
            y = (x @ teacher.T).argmax(-1)
        return x, y

    def split(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(8, n, 32) inputs and (8, n) domain-teacher labels."""
        domain = torch.arange(DOMAINS).repeat_interleave(n)
        x, y = self.sample(domain)
        return x.view(DOMAINS, n, DIM), y.view(DOMAINS, n)


# ---------------------------------------------------------------------------------------------------------------------
# model: a functional MLP whose parameters may carry a leading expert dimension E


def init_params(g: torch.Generator) -> dict[str, torch.Tensor]:
    """nn.Linear-style uniform init; LayerNorm gain 1, bias 0."""

    def linear(fan_out, fan_in):
        bound = 1.0 / math.sqrt(fan_in)
        w = (torch.rand(fan_out, fan_in, generator=g) * 2 - 1) * bound
        b = (torch.rand(fan_out, generator=g) * 2 - 1) * bound
        return w, b

    w1, b1 = linear(HIDDEN, DIM)
    w2, b2 = linear(HIDDEN, HIDDEN)
    w3, b3 = linear(CLASSES, HIDDEN)
    one, zero = torch.ones(HIDDEN), torch.zeros(HIDDEN)
    return {
        "w1": w1,
        "b1": b1,
        "g1": one,
        "n1": zero,
        "w2": w2,
        "b2": b2,
        "g2": one.clone(),
        "n2": zero.clone(),
        "w3": w3,
        "b3": b3,
    }


def forward(p: dict[str, torch.Tensor], x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (..., n, 32), p's tensors (..., out, in) / (..., out) → block1 (..., n, 256), block2, logits (..., n, 10)."""

    def block(h, w, b, gain, shift):
        h = torch.baddbmm(b.unsqueeze(-2), h, w.transpose(-1, -2)) if w.dim() == 3 else F.linear(h, w, b)
        if gain.dim() == 1:
            return F.gelu(F.layer_norm(h, (HIDDEN,), gain, shift))
        return F.gelu(torch.addcmul(shift.unsqueeze(-2), F.layer_norm(h, (HIDDEN,)), gain.unsqueeze(-2)))

    h1 = block(x, p["w1"], p["b1"], p["g1"], p["n1"])
    h2 = block(h1, p["w2"], p["b2"], p["g2"], p["n2"])
    w3, b3 = p["w3"], p["b3"]
    return (
        h1,
        h2,
        (torch.baddbmm(b3.unsqueeze(-2), h2, w3.transpose(-1, -2)) if w3.dim() == 3 else F.linear(h2, w3, b3)),
    )


def train(params: dict, steps: int, batches, lr: float, snapshot_at=()) -> dict[int, dict]:
    """Adam on the mean CE (summed over a leading expert dim, which keeps experts independent); snapshots at steps."""
    params = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    opt = torch.optim.Adam(params.values(), lr=lr)
    snaps = {}
    for step in range(1, steps + 1):
        x, y = batches()
        logits = forward(params, x)[2]
        loss = F.cross_entropy(logits.reshape(-1, CLASSES), y.reshape(-1), reduction="none").view(y.shape)
        opt.zero_grad(set_to_none=True)
        loss.mean(-1).sum().backward()
        opt.step()
        if step in snapshot_at:
            snaps[step] = {k: v.detach().clone() for k, v in params.items()}
    snaps[steps] = {k: v.detach().clone() for k, v in params.items()}
    return snaps


@torch.no_grad()
def accuracy(p: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per-domain accuracy (D,) of one model on x (D, n, 32)."""
    return (forward(p, x)[2].argmax(-1) == y).float().mean(-1)


# ---------------------------------------------------------------------------------------------------------------------
# merging (the library) and diagnostics


def independent_merge(method, tensors, *, base=None, weights=None, params=None):
    """An independent float64 re-implementation from the maths (direct-form Karcher, NRE/nre_unit,
    TIES with the disjoint mean), used only to cross-check the library's merges (`config.cross_check`)."""
    params = params or {}
    x = torch.stack([t.reshape(-1).double() for t in tensors])  # (N, n)
    w = torch.tensor(weights, dtype=torch.float64)
    b = base.reshape(-1).double()
    alpha = w / w.sum()
    if method == "linear":
        out = alpha @ x
    elif method == "task_arithmetic":
        out = b + params.get("lambda", 1.0) * (w @ (x - b))
    elif method == "ties":
        tau = x - b
        k = int(params["density"] * tau.shape[1])
        thr = tau.abs().kthvalue(tau.shape[1] - k + 1, dim=1).values if k > 0 else torch.full((len(x),), math.inf)
        trimmed = tau * (tau.abs() >= thr[:, None])
        sign = torch.sign((w[:, None] * trimmed).sum(0))
        mask = (torch.sign(trimmed) == sign) & (trimmed != 0)
        div = (w[:, None] * mask).sum(0)
        merged = torch.where(div > 0, (w[:, None] * trimmed * mask).sum(0) / div.clamp_min(1e-30), 0.0)
        out = b + params.get("lambda", 1.0) * merged
    else:
        v = x - b if params.get("space") == "task_vector" else x
        r = v.norm(dim=1)
        s = alpha @ r
        unit = v / r[:, None]
        if method == "nre":
            m = alpha @ v
        else:  # nre_unit, fisher_rao (Karcher, direct form)
            u = alpha @ unit
            u = u / u.norm()
            if method == "fisher_rao" and (unit @ u).min() <= 0:  # an input ≥ π/2 from u_0: NRE, as the library does
                u = alpha @ v
            elif method == "fisher_rao":
                for _ in range(50):
                    c = (unit @ u).clamp(-1, 1)
                    tang = unit - c[:, None] * u
                    sn = tang.norm(dim=1)
                    theta = torch.atan2(sn, c)
                    t = (alpha * torch.where(sn > 0, theta / sn.clamp_min(1e-300), 0.0)) @ tang
                    tn = t.norm()
                    if tn < 1e-7:
                        break
                    u = math.cos(tn) * u + math.sin(tn) * t / tn
                    u = u / u.norm()
            m = u
        out = s * m / m.norm()
        if params.get("space") == "task_vector":
            out = b + out
    return out.to(tensors[0].dtype).view(tensors[0].shape)


def merge(method: str, experts: list[dict], base: dict, params: dict, merge_fn=None) -> dict[str, torch.Tensor]:
    """The library's `merge_tensors` per tensor (or `merge_fn` with its signature), uniform weights (TA: 1)."""
    from hf_stable.merging.reference import merge_tensors

    merge_fn = merge_fn or merge_tensors
    n = len(experts)
    weights = [1.0 / n] * n if method != "task_arithmetic" else [1.0] * n
    return {
        name: merge_fn(method, [e[name] for e in experts], base=base[name], weights=weights, params=params)
        for name in TENSORS
    }


def flat(p: dict) -> torch.Tensor:
    return torch.cat([p[k].reshape(-1).double() for k in TENSORS])


def angle_deg(a: torch.Tensor, b: torch.Tensor) -> float:
    cos = torch.dot(a, b) / (a.norm() * b.norm())
    return math.degrees(math.acos(max(-1.0, min(1.0, cos.item()))))


def expert_stats(expert: dict, probe: torch.Tensor, rows: torch.Tensor) -> dict:
    """Per-layer activation variance and erank of one expert on the probe, and its log-probs on its own rows."""
    from hf_stable.merging.diagnostics import activation_variance, effective_rank

    acts = forward(expert, probe)
    return {
        "var": [activation_variance(a) for a in acts],
        "erank": [effective_rank(a) for a in acts],
        "logp": F.log_softmax(acts[2][rows], -1),
        "rows": rows,
    }


def diagnostics(merged: dict, experts: list[dict], stats: list[dict], probe: torch.Tensor) -> dict:
    """Diagnostics of a uniform merge against its experts (`stats` from `expert_stats`)."""
    from hf_stable.merging.diagnostics import activation_variance, effective_rank

    acts = forward(merged, probe)
    out = {}
    for li, layer in enumerate(LAYERS):
        out[f"rho_var_{layer}"] = activation_variance(acts[li]) / statistics.fmean(st["var"][li] for st in stats)
        out[f"erank_ratio_{layer}"] = effective_rank(acts[li]) / statistics.fmean(st["erank"][li] for st in stats)
    out["rho_var_min"] = min(out[f"rho_var_{layer}"] for layer in LAYERS)
    out["erank_ratio_min"] = min(out[f"erank_ratio_{layer}"] for layer in LAYERS)
    norm_ratios = {
        name: (merged[name].norm() / statistics.fmean(e[name].norm().item() for e in experts)).item()
        for name in TENSORS
    }
    out["norm_ratio"] = norm_ratios
    out["norm_ratio_min"] = min(norm_ratios.values())
    out["norm_ratio_median"] = statistics.median(norm_ratios.values())
    kls = []
    logp_m = F.log_softmax(acts[2], -1)
    for st in stats:
        logp_e = st["logp"]
        kls.append((logp_e.exp() * (logp_e - logp_m[st["rows"]])).sum(-1).mean().item())
    out["kl_to_experts"] = statistics.fmean(kls)
    return out


# ---------------------------------------------------------------------------------------------------------------------
# one seed


def subsets(n: int) -> list[tuple[int, ...]]:
    return [tuple(range(i, i + n)) for i in range(0, DOMAINS, n)]


def run_seed(seed: int, sizes: Sizes) -> dict:
    torch.manual_seed(seed)
    dom = Domains(seed)
    val_x, val_y = dom.split(sizes.n_val)
    test_x, test_y = dom.split(sizes.n_test)
    probe_domains = torch.arange(DOMAINS).repeat_interleave(sizes.probe_per_domain)
    probe = dom.sample(probe_domains)[0]

    t0 = time.time()

    def base_batches():
        domain = torch.randint(0, DOMAINS, (sizes.batch,), generator=dom.g)
        return dom.sample(domain, teacher=dom.generic)

    base = train(init_params(dom.g), sizes.base_steps, base_batches, sizes.lr)[sizes.base_steps]
    base_x = test_x.reshape(-1, DIM)
    base_generic_acc = (forward(base, base_x)[2].argmax(-1) == (base_x @ dom.generic.T).argmax(-1)).float().mean()
    base_domain_acc = accuracy(base, test_x, test_y)

    def expert_batches():
        domain = torch.arange(DOMAINS).repeat_interleave(sizes.batch)
        x, y = dom.sample(domain)
        return x.view(DOMAINS, sizes.batch, DIM), y.view(DOMAINS, sizes.batch)

    stacked = {k: v.unsqueeze(0).expand(DOMAINS, *v.shape).clone() for k, v in base.items()}
    snaps = train(stacked, max(sizes.hs), expert_batches, sizes.lr, snapshot_at=set(sizes.hs))
    train_seconds = time.time() - t0

    result = {
        "base_generic_accuracy": base_generic_acc.item(),
        "base_domain_accuracy": base_domain_acc.mean().item(),
        "train_seconds": train_seconds,
        "h": {},
    }
    theta0 = flat(base)
    for h in sizes.hs:
        experts = [{k: v[j] for k, v in snaps[h].items()} for j in range(DOMAINS)]
        taus = [flat(e) - theta0 for e in experts]
        with torch.no_grad():
            expert_acc = accuracy(snaps[h], test_x, test_y)  # batched: expert j on its own domain j
            stats = [expert_stats(e, probe, probe_domains == d) for d, e in enumerate(experts)]
        row = {
            "expert_accuracy": expert_acc.mean().item(),
            "tau_angle_deg": statistics.fmean(
                angle_deg(taus[i], taus[j]) for i, j in itertools.combinations(range(DOMAINS), 2)
            ),
            "weight_angle_deg": statistics.fmean(
                angle_deg(flat(experts[i]), flat(experts[j])) for i, j in itertools.combinations(range(DOMAINS), 2)
            ),
            "tau_rel_norm": statistics.fmean((t.norm() / theta0.norm()).item() for t in taus),
            "n": {},
        }
        for n in sizes.ns:
            cells = []
            for members in subsets(n):
                ex = [experts[d] for d in members]
                idx = list(members)
                cell = {}
                for label, (method, params, grid) in METHODS.items():
                    with torch.no_grad():
                        if grid is None:
                            with warnings.catch_warnings(record=True) as caught:  # Karcher → NRE fallbacks
                                warnings.simplefilter("always")
                                merged = merge(method, ex, base, params)
                            fallbacks = sum("falling back" in str(w.message) for w in caught)
                            chosen = None
                        else:  # λ on the validation split only
                            best = None
                            for lam in grid:
                                cand = merge(method, ex, base, {**params, "lambda": lam})
                                v = accuracy(cand, val_x[idx], val_y[idx]).mean().item()
                                if best is None or v > best[0]:
                                    best = (v, lam, cand)
                            _, chosen, merged = best
                            fallbacks = 0
                        acc = accuracy(merged, test_x[idx], test_y[idx]).mean().item()
                        diag = diagnostics(merged, ex, [stats[d] for d in members], probe)
                    cell[label] = {"accuracy": acc, "lambda": chosen, "karcher_fallback_tensors": fallbacks, **diag}
                cells.append(cell)
            row["n"][str(n)] = {
                label: {
                    key: (
                        statistics.fmean(c[label][key] for c in cells)
                        if key not in ("lambda", "norm_ratio")
                        else [c[label][key] for c in cells]
                    )
                    for key in cells[0][label]
                }
                for label in METHODS
            }
        result["h"][str(h)] = row
    # cross-check of the library against `independent_merge` on the hardest cell (largest h, all 8 experts)
    experts = [{k: v[j] for k, v in snaps[max(sizes.hs)].items()} for j in range(DOMAINS)]
    result["cross_check_max_rel_diff"] = {}
    for label, (method, params, grid) in METHODS.items():
        p = {**params, "lambda": 0.5} if grid else params
        lib, ind = merge(method, experts, base, p), merge(method, experts, base, p, merge_fn=independent_merge)
        result["cross_check_max_rel_diff"][label] = max(
            ((lib[k].double() - ind[k].double()).norm() / ind[k].double().norm()).item() for k in TENSORS
        )
    result["seconds"] = time.time() - t0
    return result


# ---------------------------------------------------------------------------------------------------------------------
# aggregation, criteria, outputs


SCALARS = (
    "accuracy",
    "karcher_fallback_tensors",
    "rho_var_min",
    "erank_ratio_min",
    "norm_ratio_min",
    "norm_ratio_median",
    "kl_to_experts",
    *(f"rho_var_{layer}" for layer in LAYERS),
    *(f"erank_ratio_{layer}" for layer in LAYERS),
)


def aggregate(per_seed: dict, sizes: Sizes) -> dict:
    seeds = list(per_seed)
    out = {
        "cross_check_max_rel_diff": {
            label: max(per_seed[s]["cross_check_max_rel_diff"][label] for s in seeds) for label in METHODS
        },
        "base_generic_accuracy": mean_std([per_seed[s]["base_generic_accuracy"] for s in seeds]),
        "base_domain_accuracy": mean_std([per_seed[s]["base_domain_accuracy"] for s in seeds]),
        "h": {},
    }
    for h in map(str, sizes.hs):
        rows = [per_seed[s]["h"][h] for s in seeds]
        agg = {
            k: mean_std([r[k] for r in rows])
            for k in ("expert_accuracy", "tau_angle_deg", "weight_angle_deg", "tau_rel_norm")
        }
        agg["n"] = {
            n: {label: {k: mean_std([r["n"][n][label][k] for r in rows]) for k in SCALARS} for label in METHODS}
            for n in map(str, sizes.ns)
        }
        out["h"][h] = agg
    return out


def criteria(per_seed: dict, agg: dict, sizes: Sizes) -> tuple[dict, dict]:
    h, n = str(max(sizes.hs)), str(max(sizes.ns))
    cell = agg["h"][h]["n"][n]
    seeds = list(per_seed)

    def seeds_holding(rule) -> str:
        return f"{sum(rule(per_seed[s]['h'][h]['n'][n]) for s in seeds)}/{len(seeds)} seeds"

    fr, lin = cell["fisher_rao"], cell["linear"]
    checks = {
        "a": {
            "criterion": f"h={h}, N={n}: accuracy(fisher_rao) − accuracy(linear) ≥ {ACC_MARGIN * 100:g} pp",
            "values": {
                "fisher_rao": fr["accuracy"]["mean"],
                "linear": lin["accuracy"]["mean"],
                "gap_pp": 100 * (fr["accuracy"]["mean"] - lin["accuracy"]["mean"]),
            },
            "passed": fr["accuracy"]["mean"] - lin["accuracy"]["mean"] >= ACC_MARGIN,
            "per_seed": seeds_holding(lambda c: c["fisher_rao"]["accuracy"] - c["linear"]["accuracy"] >= ACC_MARGIN),
        },
        "b": {
            "criterion": f"h={h}, N={n}: ρ^var(fisher_rao) ≥ {RHO_FR} (min over layers)",
            "values": {
                "rho_var_min": fr["rho_var_min"]["mean"],
                **{layer: fr[f"rho_var_{layer}"]["mean"] for layer in LAYERS},
            },
            "passed": fr["rho_var_min"]["mean"] >= RHO_FR,
            "per_seed": seeds_holding(lambda c: c["fisher_rao"]["rho_var_min"] >= RHO_FR),
        },
        "c": {
            "criterion": f"h={h}, N={n}: ρ^var(linear) ≤ {RHO_LINEAR} (min over layers)",
            "values": {
                "rho_var_min": lin["rho_var_min"]["mean"],
                **{layer: lin[f"rho_var_{layer}"]["mean"] for layer in LAYERS},
            },
            "passed": lin["rho_var_min"]["mean"] <= RHO_LINEAR,
            "per_seed": seeds_holding(lambda c: c["linear"]["rho_var_min"] <= RHO_LINEAR),
        },
    }
    gaps = {}
    for hh, row in agg["h"].items():
        for nn, c in row["n"].items():
            acc = {label: c[label]["accuracy"]["mean"] for label in METHODS}
            gaps[f"h={hh},N={nn}"] = {
                "fisher_rao_minus_nre_pp": 100 * (acc["fisher_rao"] - acc["nre"]),
                "fisher_rao_tv_minus_nre_tv_pp": 100 * (acc["fisher_rao_tv"] - acc["nre_tv"]),
            }
    best = max(max(g.values()) for g in gaps.values())
    side = {
        "description": f"is fisher_rao more than {SIDE_MARGIN * 100:g} pp better than NRE in the same space (weights: "
        "fisher_rao vs nre; task vectors: fisher_rao_tv vs nre_tv) in any (h, N) cell (seed means)?",
        "answer": "yes" if best > 100 * SIDE_MARGIN else "no",
        "max_gap_pp": best,
        "gaps": gaps,
    }
    return checks, side


def plot(agg: dict, sizes: Sizes, path: Path) -> None:
    hs = [str(h) for h in sizes.hs]
    ns = [str(n) for n in sizes.ns]
    fig, axes = subplots(2, 3, figsize=(18, 9.5))
    n_top = ns[-1]
    panels = (
        (axes[0, 0], "accuracy", f"test accuracy vs h (N = {n_top})"),
        (axes[0, 1], "rho_var_min", f"ρ^var (min over layers) vs h (N = {n_top})"),
        (axes[0, 2], "erank_ratio_min", f"erank ratio (min over layers) vs h (N = {n_top})"),
    )
    for ax, key, title in panels:
        for label in METHODS:
            ms = [agg["h"][h]["n"][n_top][label][key] for h in hs]
            ax.errorbar(
                [int(h) for h in hs],
                [m["mean"] for m in ms],
                yerr=[m["std"] for m in ms],
                marker="o",
                capsize=3,
                color=COLORS[label],
                label=LABELS[label],
            )
        ax.set(title=title, xlabel="fine-tuning steps h", xscale="log")
    axes[0, 0].plot(
        [int(h) for h in hs], [agg["h"][h]["expert_accuracy"]["mean"] for h in hs], "k--", label="experts (own domain)"
    )
    axes[0, 1].axhline(RHO_FR, color="red", linestyle=":", linewidth=1)
    axes[0, 1].axhline(RHO_LINEAR, color="gray", linestyle=":", linewidth=1)
    axes[0, 0].legend(fontsize=7)
    h_top = hs[-1]
    ax = axes[1, 0]
    width = 0.8 / len(METHODS)
    for i, label in enumerate(METHODS):
        ms = [agg["h"][h_top]["n"][n][label]["accuracy"] for n in ns]
        ax.bar(
            [j + i * width for j in range(len(ns))],
            [m["mean"] for m in ms],
            width,
            yerr=[m["std"] for m in ms],
            color=COLORS[label],
            label=LABELS[label],
        )
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(ns))], [f"N = {n}" for n in ns])
    ax.set(title=f"test accuracy vs N (h = {h_top})", ylabel="accuracy")
    ax = axes[1, 1]
    for i, label in enumerate(METHODS):
        ms = [agg["h"][h_top]["n"][n_top][label][f"rho_var_{layer}"]["mean"] for layer in LAYERS]
        ax.bar([j + i * width for j in range(len(LAYERS))], ms, width, color=COLORS[label], label=LABELS[label])
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(LAYERS))], list(LAYERS))
    ax.set(title=f"ρ^var per layer (h = {h_top}, N = {n_top})")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax = axes[1, 2]
    ax.plot(
        [int(h) for h in hs], [agg["h"][h]["tau_angle_deg"]["mean"] for h in hs], "o-", label="τ pairwise angle (°)"
    )
    ax.plot(
        [int(h) for h in hs],
        [agg["h"][h]["weight_angle_deg"]["mean"] for h in hs],
        "s-",
        label="weight pairwise angle (°)",
    )
    ax.set(title="measured heterogeneity", xlabel="fine-tuning steps h", xscale="log", ylabel="degrees")
    ax2 = ax.twinx()
    ax2.plot(
        [int(h) for h in hs],
        [agg["h"][h]["tau_rel_norm"]["mean"] for h in hs],
        "^--",
        color="tab:red",
        label="‖τ‖/‖θ0‖",
    )
    ax2.set_ylabel("‖τ‖/‖θ0‖")
    ax.legend(loc="upper left", fontsize=8)
    ax2.legend(loc="lower right", fontsize=8)
    fig.suptitle("Fisher–Rao vs linear merging of MLP experts as heterogeneity grows (mean ± std over seeds)")
    save_figure(fig, path)


def interpretation(agg: dict, side: dict) -> str:
    """Sentences generated from the measured numbers (a rerun cannot leave a stale interpretation)."""
    hs = list(agg["h"])
    h, h0 = hs[-1], hs[0]
    n = list(agg["h"][h]["n"])[-1]
    cell = agg["h"][h]["n"][n]
    acc = {k: v["accuracy"]["mean"] for k, v in cell.items()}
    cells = [c for row in agg["h"].values() for c in row["n"].values()]
    weights_space = ("linear", "nre", "fisher_rao", "multislerp")
    spread = max(
        max(c[k]["accuracy"]["mean"] for k in weights_space) - min(c[k]["accuracy"]["mean"] for k in weights_space)
        for c in cells
    )
    tv_wins = sum(c["fisher_rao_tv"]["accuracy"]["mean"] - c["fisher_rao"]["accuracy"]["mean"] > 0.01 for c in cells)
    best = max(acc, key=acc.get)
    angles = [agg["h"][x]["weight_angle_deg"]["mean"] for x in hs]
    tau_angles = [agg["h"][x]["tau_angle_deg"]["mean"] for x in hs]
    rel = [agg["h"][x]["tau_rel_norm"]["mean"] for x in hs]
    rho_lin, rho_fr = cell["linear"]["rho_var_logits"]["mean"], cell["fisher_rao"]["rho_var_logits"]["mean"]
    return (
        f"Measured heterogeneity: the mean pairwise angle between the experts' full weight vectors grows from "
        f"{angles[0]:.1f}° to {angles[-1]:.1f}° over h = {h0}…{h}, ‖τ‖/‖θ0‖ from {rel[0]:.2f} to {rel[-1]:.2f}; the "
        f"task vectors stay near-orthogonal ({min(tau_angles):.1f}°-{max(tau_angles):.1f}°). "
        f"At h = {h}, N = {n}: Fisher–Rao (weights) {acc['fisher_rao']:.3f} vs linear {acc['linear']:.3f} "
        f"({100 * (acc['fisher_rao'] - acc['linear']):+.1f} pp). Restoring each tensor's norm (norm ratio 1.000 vs "
        f"linear's minimum {cell['linear']['norm_ratio_min']['mean']:.3f}) raised ρ^var at the logits only from "
        f"{rho_lin:.2f} to {rho_fr:.2f} and did not change accuracy: in weights space linear, NRE, nre_unit and "
        f"Fisher–Rao are within {100 * spread:.2f} pp of each other in every (h, N) cell. The best method in this "
        f"cell is {LABELS[best]} ({acc[best]:.3f}); Fisher–Rao in task-vector space beats it in weights space by "
        f"> 1 pp in {tv_wins} of {len(cells)} cells. Structural caveats: every hidden Linear is followed by a "
        "LayerNorm, so the hidden activations do not depend on the scale of W1 and W2 (norm restoration acts only "
        "through the LayerNorm gains/biases and the output layer); and the 8 teachers are independent, so one "
        f"merged model cannot fit N domains (experts reach {agg['h'][h]['expert_accuracy']['mean']:.3f} on their own "
        f"domain). Side question: the largest Fisher–Rao − NRE gap in the same space is {side['max_gap_pp']:+.2f} pp."
    )


def markdown(result: dict) -> str:
    agg, cfg = result["aggregate"], result["config"]
    side, sizes = agg["side_question"], cfg["sizes"]
    lines = [
        "Mean ± std over seeds. MLP 32→256→256→10 (LayerNorm, GELU); base "
        f"{sizes['base_steps']} Adam steps on the 8-domain mixture (generic-teacher test accuracy "
        f"{fmt(agg['base_generic_accuracy'])}; on the domain teachers {fmt(agg['base_domain_accuracy'])}); experts "
        f"fine-tuned h ∈ {sizes['hs']} steps; uniform merges of N ∈ {sizes['ns']} experts. Accuracy: test, mean over "
        "the merged domains. ρ^var and erank ratio: minimum over the layers (block1, block2, logits).",
        "",
        "| h | τ angle (°) | ‖τ‖/‖θ0‖ | expert acc |",
        "|---|---|---|---|",
    ]
    for h, row in agg["h"].items():
        lines.append(
            f"| {h} | {fmt(row['tau_angle_deg'], 1)} | {fmt(row['tau_rel_norm'])} | {fmt(row['expert_accuracy'])} |"
        )
    lines += [
        "",
        "| h | N | method | accuracy | ρ^var min | erank ratio min | norm ratio min | KL to experts |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for h, row in agg["h"].items():
        for n, cell in row["n"].items():
            for label, m in cell.items():
                lines.append(
                    f"| {h} | {n} | {LABELS[label]} | {fmt(m['accuracy'])} | {fmt(m['rho_var_min'])} | "
                    f"{fmt(m['erank_ratio_min'])} | {fmt(m['norm_ratio_min'])} | "
                    f"{fmt(m['kl_to_experts'])} |"
                )
    lines += [
        "",
        "## Interpretation",
        "",
        interpretation(agg, side),
        "",
        "## Side question (pre-registered)",
        "",
        f"{side['description']} **{side['answer']}** (largest gap {side['max_gap_pp']:+.2f} pp).",
        "",
        "| cell | FR − NRE, weights (pp) | FR − NRE, task vectors (pp) |",
        "|---|---|---|",
    ]
    for cell, g in side["gaps"].items():
        lines.append(f"| {cell} | {g['fisher_rao_minus_nre_pp']:+.2f} | {g['fisher_rao_tv_minus_nre_tv_pp']:+.2f} |")
    fb = [
        f"h={h}, N={n}, {LABELS[label]}: {cell[label]['karcher_fallback_tensors']['mean']:.2f}"
        for h, row in agg["h"].items()
        for n, cell in row["n"].items()
        for label in ("fisher_rao", "fisher_rao_tv")
        if cell[label]["karcher_fallback_tensors"]["mean"] > 0
    ]
    lines += [
        "",
        "Karcher → NRE fallbacks (the library falls back to `solver: nre` for a tensor when an input is ≥ π/2 from "
        "the initial mean; mean number of the 10 tensors per merge): " + ("; ".join(fb) if fb else "none") + ".",
    ]
    lines += [
        "",
        "Cross-check: largest relative difference (per tensor, h = max, N = 8, every seed) between the library's "
        "merges and an independent float64 re-implementation in this script: "
        + ", ".join(f"{LABELS[k]} {v:.1e}" for k, v in agg["cross_check_max_rel_diff"].items())
        + ".",
    ]
    return "\n".join(lines)


def judged(per_seed: dict, agg: dict, sizes: Sizes) -> dict:
    """The criteria; the pre-registered side question (not a criterion) is stored in the aggregate."""
    checks, agg["side_question"] = criteria(per_seed, agg, sizes)
    return checks


EXPERIMENT = declare(
    globals(),
    title="Fisher–Rao vs linear merging as heterogeneity grows",
    claim="Fisher–Rao merging (weighted spherical Karcher mean + norm restoration) beats linear averaging as expert "
    "heterogeneity grows and keeps the activation variance (arXiv 2603.04972).",
    criteria=judged,
    plot=lambda result, path: plot(result["aggregate"], Sizes(**result["config"]["sizes"]), path),
    config={
        "dim": DIM,
        "hidden": HIDDEN,
        "classes": CLASSES,
        "domains": DOMAINS,
        "mu_norm": MU_NORM,
        "ta_lambdas": TA_LAMBDAS,
        "ties_lambdas": TIES_LAMBDAS,
        "ties_density": TIES_DENSITY,
        "methods": {k: {"method": m, "params": p} for k, (m, p, _) in METHODS.items()},
        "layers": LAYERS,
    },
)


if __name__ == "__main__":
    run(EXPERIMENT)
