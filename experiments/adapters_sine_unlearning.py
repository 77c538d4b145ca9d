"""E-B4 bounded sine adapters for unlearning: gradient difference with vanilla LoRA vs sine adapters on the MLP.

Claim ("Stable Forgetting", arXiv 2509.24166).
Gradient difference (GradDiff: descent on retain data, ascent on forget data, `loss = CE_retain − λ_f·CE_forget`)
has an unbounded forget term, so LoRA adapters on the MLP projections grow without bound, the gradients grow with
them and retained knowledge collapses. Passing the low-rank product through a sine (`ΔW = s·sin(ω·BA)/g`, s =
lora_alpha/r, g = √in_features; Sine-LoRA) bounds every entry, |ΔW_ij| ≤ s/g, hence ‖ΔW‖_F ≤ s·√(m·n)/g, and
the paper expects forgetting with retained accuracy largely preserved.

Design.
* Facts: per seed, 200 distinct random 4-letter keys (a-z) mapped to random 3-digit values, prompt `qwer=`,
  completion `417` (+ eos), one char per token (`hf_stable.testing` tiny Llama, hidden 64, intermediate 128, 2
  layers, ~90k parameters). The first 50 facts are the forget set, the other 150 the retain set.
* Base model (per seed, cached under `experiments/cache/adapters_sine_unlearning/`): full fine-tune from a random
  init on retain ∪ forget, plain PyTorch loop, AdamW (LR 3e-3, no weight decay), batch 64, 1500 steps, 50 warm-up
  steps then linear decay. It memorises both sets (greedy exact match ≈ 1 on each, checked and reported).
* Unlearning: 500 steps of gradient difference, λ_f = 1, from the base model, plain PyTorch loop. Each step's batch
  is the FULL forget set (50) and the FULL retain set (150), so the logged CEs are the exact set CEs (mean token CE
  over the 3 answer digits + eos). AdamW (β = 0.9/0.999, no weight decay, constant LR, no gradient clipping), the
  same LR for every arm (chosen in the pilot below). Adapters on `gate_proj`, `up_proj`, `down_proj` of both layers
  only (6 matrices; base frozen), r = 8, lora_alpha = 16 (s = 2), no dropout, A initialised identically in every arm
  (same torch seed; PEFT's Kaiming-uniform A, B = 0):
  - `lora`: vanilla PEFT `LoraConfig`;
  - `sine_10`, `sine_100`, `sine_300`: `StableLoraConfig(use_sine=True, sine_freq=ω, sine_g="sqrt_in")`,
    ω ∈ {10, 100, 300}. Bounds: s/g = 2/8 = 0.25 (gate/up, in = 64), 2/√128 ≈ 0.177 (down, in = 128).
* Tracked at every step t = 0..500 (values at t are those of the adapters after t updates; stored every 5 steps,
  summaries use every step): ‖ΔW‖_F summed and max over the 6 adapted matrices (ΔW from each layer's
  `get_delta_weight`, dense), max_ij |ΔW_ij| and its ratio to s/g (the sine bound; for `lora` the same s/g is shown
  for comparison only), ‖ΔW‖_F / (s·√(mn)/g) per layer (max over layers), the norm of the adapter factors, the total
  gradient norm of the adapter parameters (before the update), forget CE and retain CE. Greedy exact match
  (`hf_stable.testing.evaluate_completions`) of the forget and the retain set every 50 steps (the lowest retain
  exact match over these checkpoints is reported as a diagnostic). A non-finite loss
  stops the arm (recorded). A consistency check compares each adapted layer's output with `x @ (W0 + ΔW)ᵀ` at the
  end (so the ΔW measured is the ΔW the forward uses).
* Seeds 0, 1, 2 (facts, base init and data order, adapter init); mean ± sample std over seeds; criteria on the seed
  means, with the number of seeds where each holds individually (criterion 2 is an exact bound: it must hold at
  every step of every seed).

Pass criteria (pre-registered, written before the seed 0-2 runs; printed PASS/FAIL as measured):
  (1a) vanilla LoRA, adapter norm grows: ‖ΔW‖_F (sum over the 6 matrices) at the end > 10 × its value at step 50,
       or the run went non-finite;
  (1b) vanilla LoRA, gradient norm grows: mean gradient norm over steps 476-500 > 2 × its mean over steps 38-62, or
       non-finite;
  (1c) vanilla LoRA, retain accuracy collapses: final retain exact match < 0.5 × retain exact match at step 0;
  (2)  sine, exact bound: for every ω, seed, step and adapted matrix, max_ij |ΔW_ij| ≤ s/g and ‖ΔW‖_F ≤ s·√(mn)/g
       (relative tolerance 1e-6 for fp32 rounding of s·sin(·)/g);
  (3)  sine, forgetting with retention: for at least one ω, the mean forget CE rises by ≥ 1.0 nat/token above its
       step-0 value AND the mean final retain exact match ≥ 0.8 × its step-0 value (each ω reported).

Pilot and LR decision (rule fixed before the pilot): one pilot seed, 100 (not reported), all four arms at
gradient-difference LR 3e-4, 1e-3 and 3e-3; keep the smallest LR at which vanilla LoRA raises the forget CE by
≥ 1 nat/token within the 500 steps (so the arms are compared where gradient difference actually unlearns); if none
does, the largest. Outcome (seed 100, forget CE start → end / retain EM start → end, vanilla | sine ω = 10, 100,
300): LR 3e-4: 0.001 → 16.7 / 1.00 → 0.89 | 16.7 / 0.93, 18.6 / 1.00, 19.9 / 1.00; LR 1e-3: 18.7 / 1.00 | 18.7 /
1.00, 21.6 / 0.99, 20.7 / 1.00; LR 3e-3: 21.2 / 0.99 | 19.8 / 1.00, 22.1 / 0.93, 23.2 / 1.00. Every LR satisfies the
rule, so LR 3e-4 was kept for every arm. The pilot already showed criteria 1a-1c failing at every LR (vanilla LoRA's
‖ΔW‖_F grew ×9.3 / ×4.7 / ×2.8, its late gradient norm was ×1.2 / ×0.10 / ×0.02 the early one, and retain EM did
not collapse at the end, although it dipped to ≈ 0.4 mid-run at LR 3e-4). Nothing was changed in response, except
that the lowest retain EM over the checkpoints is now also reported (a diagnostic, not a criterion); nothing was
changed after the seed 0-2 runs.

Command (cold cache, i.e. including the three base models: 486 s wall on a shared 2-core machine, about half of it
CPU time; wall time in the Markdown output):
    OMP_NUM_THREADS=1 .venv/bin/python experiments/adapters_sine_unlearning.py
Pilot: `... --seeds 100 --out /tmp/pilot` with `Sizes.lr` set to the pilot LR.
Quick smoke run (< 60 s, 1 seed, tiny sizes; its pass/fail means nothing):
    OMP_NUM_THREADS=1 .venv/bin/python experiments/adapters_sine_unlearning.py --quick --out /tmp/e_b4_quick
"""

from __future__ import annotations

import json
import math
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from _harness import declare, run, save_figure, subplots
from testbeds import tiny_trl


NAME = "adapters_sine_unlearning"
ARMS = ("lora", "sine_10", "sine_100", "sine_300")
FREQS = {"sine_10": 10.0, "sine_100": 100.0, "sine_300": 300.0}
LABELS = {"lora": "vanilla LoRA", "sine_10": "sine ω=10", "sine_100": "sine ω=100", "sine_300": "sine ω=300"}
COLORS = {"lora": "tab:red", "sine_10": "tab:blue", "sine_100": "tab:green", "sine_300": "tab:purple"}
TARGETS = ["gate_proj", "up_proj", "down_proj"]
LETTERS = "abcdefghijklmnopqrstuvwxyz"
NORM_GROWTH, GRAD_GROWTH, RETAIN_COLLAPSE = 10.0, 2.0, 0.5  # criteria 1a, 1b, 1c
BOUND_RTOL = 1e-6  # criterion 2
FORGET_MARGIN, RETAIN_KEEP = 1.0, 0.8  # criterion 3


@dataclass(frozen=True)
class Sizes:
    num_forget: int = 50
    num_retain: int = 150
    hidden_size: int = 64
    base_steps: int = 1500
    base_batch: int = 64
    base_lr: float = 3e-3
    base_warmup: int = 50
    steps: int = 500  # gradient-difference steps
    lr: float = 3e-4  # gradient-difference LR (all arms); see the pilot
    rank: int = 8
    lora_alpha: int = 16
    forget_weight: float = 1.0  # λ_f
    em_every: int = 50
    store_every: int = 5
    early_window: tuple[int, int] = (38, 62)  # criterion 1b, inclusive
    late_window: int = 25  # last steps of criterion 1b
    norm_ref_step: int = 50  # criterion 1a


QUICK = Sizes(
    num_forget=10,
    num_retain=30,
    base_steps=300,
    steps=60,
    em_every=20,
    store_every=2,
    early_window=(4, 8),
    late_window=5,
    norm_ref_step=6,
)


# ---------------------------------------------------------------------------------------------------------------------
# data and base model


def make_facts(seed: int, sizes: Sizes) -> tuple[list[dict], list[dict]]:
    """(forget, retain): distinct random 4-letter keys → random 3-digit values, as prompt/completion/answer rows."""
    rng = random.Random(seed)
    keys: list[str] = []
    seen = set()
    while len(keys) < sizes.num_forget + sizes.num_retain:
        key = "".join(rng.choice(LETTERS) for _ in range(4))
        if key not in seen:
            seen.add(key)
            keys.append(key)
    rows = [{"prompt": f"{k}=", "completion": f"{rng.randrange(1000):03d}"} for k in keys]
    for row in rows:
        row["answer"] = row["completion"]
    return rows[: sizes.num_forget], rows[sizes.num_forget :]


def encode(tokenizer, rows: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels): prompt + completion + eos, labels −100 on the prompt (every row has the same length)."""
    eos = tokenizer.eos_token_id
    seqs = [tokenizer(r["prompt"] + r["completion"], add_special_tokens=False)["input_ids"] + [eos] for r in rows]
    prompt_len = len(tokenizer(rows[0]["prompt"], add_special_tokens=False)["input_ids"])
    assert len({len(s) for s in seqs}) == 1
    ids = torch.tensor(seqs)
    labels = ids.clone()
    labels[:, :prompt_len] = -100
    return ids, labels


def per_sequence_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy of each sequence over its supervised tokens (shifted: logits t predict token t+1)."""
    logits, labels = logits[:, :-1].float(), labels[:, 1:]
    mask = labels != -100
    ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels.clamp_min(0), reduction="none")
    return (ce * mask).sum(-1) / mask.sum(-1)


def base_cache_dir(seed: int, sizes: Sizes) -> Path:
    fields = {
        k: v
        for k, v in asdict(sizes).items()
        if k.startswith("base") or k in ("num_forget", "num_retain", "hidden_size")
    }
    return tiny_trl.cache_dir(NAME, "base", seed, {**fields, "key_len": 4, "letters": LETTERS})


def train_base(seed: int, sizes: Sizes, forget: list[dict], retain: list[dict]) -> Path:
    """Full fine-tune of a random-init tiny Llama on retain ∪ forget (or the cached checkpoint of `seed`)."""
    path = base_cache_dir(seed, sizes)
    if tiny_trl.cached(path, seed, "base"):
        return path
    start = time.time()
    model, tokenizer = tiny_trl.tiny_llama(seed, sizes.hidden_size, max_position_embeddings=16)
    ids, labels = encode(tokenizer, forget + retain)
    opt = torch.optim.AdamW(model.parameters(), lr=sizes.base_lr, weight_decay=0.0)
    warmup, total = sizes.base_warmup, sizes.base_steps
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) * max(0.0, 1 - s / total))
    gen = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(total):
        idx = torch.randperm(len(ids), generator=gen)[: sizes.base_batch]
        loss = model(input_ids=ids[idx], labels=labels[idx]).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
    model.save_pretrained(path)
    (path / "done.json").write_text(
        json.dumps({"steps": total, "seconds": time.time() - start, "final_batch_loss": loss.item()})
    )
    print(f"[seed {seed}] base: {total} steps in {time.time() - start:.0f}s", flush=True)
    return path


def load_base(path: Path):
    from transformers import AutoModelForCausalLM

    from hf_stable.testing import build_tiny_tokenizer

    return AutoModelForCausalLM.from_pretrained(path), build_tiny_tokenizer()


def exact_match(model, tokenizer, rows: list[dict]) -> float:
    from datasets import Dataset

    from hf_stable.testing import evaluate_completions

    return evaluate_completions(model, tokenizer, Dataset.from_list(rows), batch_size=256, max_new_tokens=5)[
        "exact_match"
    ]


# ---------------------------------------------------------------------------------------------------------------------
# gradient difference


def adapter_config(arm: str, sizes: Sizes):
    common = {
        "r": sizes.rank,
        "lora_alpha": sizes.lora_alpha,
        "lora_dropout": 0.0,
        "target_modules": TARGETS,
        "bias": "none",
    }
    if arm == "lora":
        from peft import LoraConfig

        return LoraConfig(**common)
    from hf_stable.adapters import StableLoraConfig

    return StableLoraConfig(**common, use_sine=True, sine_freq=FREQS[arm], sine_g="sqrt_in")


def adapted_layers(model) -> dict:
    """`{name: layer}` of the LoRA-adapted modules."""
    from peft.tuners.lora import LoraLayer

    return {n: m for n, m in model.named_modules() if isinstance(m, LoraLayer) and "default" in m.lora_A}


def layer_bounds(layer) -> tuple[float, float]:
    """(entry bound s/g, Frobenius bound s·√(mn)/g) of a layer; g = √in_features (the sine arms' gain)."""
    s = float(layer.scaling["default"])
    sine = getattr(layer, "_sine", {}).get("default")
    gain = sine[1] if sine is not None else math.sqrt(layer.in_features)
    return s / gain, s * math.sqrt(layer.in_features * layer.out_features) / gain


@torch.no_grad()
def delta_stats(layers: dict) -> dict:
    fro, maxabs, entry_ratio, fro_ratio = [], [], [], []
    for layer in layers.values():
        delta = layer.get_delta_weight("default").float()
        entry_bound, fro_bound = layer_bounds(layer)
        f, m = delta.norm().item(), delta.abs().max().item()
        fro.append(f)
        maxabs.append(m)
        entry_ratio.append(m / entry_bound)
        fro_ratio.append(f / fro_bound)
    factors = math.sqrt(
        sum(
            p.float().norm().item() ** 2
            for layer in layers.values()
            for p in (layer.lora_A["default"].weight, layer.lora_B["default"].weight)
        )
    )
    return {
        "dw_fro_sum": sum(fro),
        "dw_fro_max": max(fro),
        "dw_maxabs": max(maxabs),
        "entry_ratio": max(entry_ratio),
        "fro_ratio": max(fro_ratio),
        "factor_norm": factors,
    }


@torch.no_grad()
def forward_consistency(model, layers: dict) -> float:
    """Max |layer(x) − x (W0 + ΔW)ᵀ| over the adapted layers for a random x (the measured ΔW is the one used)."""
    gen = torch.Generator().manual_seed(0)
    worst = 0.0
    for layer in layers.values():
        x = torch.randn(4, layer.in_features, generator=gen)
        expected = torch.nn.functional.linear(x, layer.get_base_layer().weight + layer.get_delta_weight("default"))
        worst = max(worst, (layer(x) - expected).abs().max().item())
    return worst


def finite(x: float) -> bool:
    return math.isfinite(x)


def run_arm(arm: str, seed: int, sizes: Sizes, base_path: Path, forget: list[dict], retain: list[dict]) -> dict:
    from peft import get_peft_model

    start = time.time()
    model, tokenizer = load_base(base_path)
    torch.manual_seed(seed)  # the same A initialisation in every arm
    model = get_peft_model(model, adapter_config(arm, sizes))
    layers = adapted_layers(model)
    assert len(layers) == 3 * model.config.num_hidden_layers, sorted(layers)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=sizes.lr, betas=(0.9, 0.999), weight_decay=0.0)
    f_ids, f_labels = encode(tokenizer, forget)
    r_ids, r_labels = encode(tokenizer, retain)
    ids, labels, nf = torch.cat([f_ids, r_ids]), torch.cat([f_labels, r_labels]), len(forget)
    keys = (
        "forget_ce",
        "retain_ce",
        "grad_norm",
        "dw_fro_sum",
        "dw_fro_max",
        "dw_maxabs",
        "entry_ratio",
        "fro_ratio",
        "factor_norm",
    )
    series: dict[str, list[float]] = {k: [] for k in keys}
    checkpoints, diverged_at = [], None
    model.train()
    for t in range(sizes.steps + 1):
        if t % sizes.em_every == 0 or t == sizes.steps:
            checkpoints.append(
                {
                    "step": t,
                    "forget_em": exact_match(model, tokenizer, forget),
                    "retain_em": exact_match(model, tokenizer, retain),
                }
            )
            model.train()
        ce = per_sequence_ce(model(input_ids=ids).logits, labels)
        forget_ce, retain_ce = ce[:nf].mean(), ce[nf:].mean()
        loss = retain_ce - sizes.forget_weight * forget_ce
        loss.backward()
        grad_norm = torch.sqrt(sum(p.grad.float().pow(2).sum() for p in params)).item()
        row = {
            "forget_ce": forget_ce.item(),
            "retain_ce": retain_ce.item(),
            "grad_norm": grad_norm,
            **delta_stats(layers),
        }
        for k in keys:
            series[k].append(row[k])
        if not all(map(finite, row.values())):
            diverged_at = t
            break
        if t < sizes.steps:
            opt.step()
        opt.zero_grad(set_to_none=True)
    if diverged_at is not None and checkpoints[-1]["step"] != diverged_at:
        checkpoints.append(
            {
                "step": diverged_at,
                "forget_em": exact_match(model, tokenizer, forget),
                "retain_em": exact_match(model, tokenizer, retain),
            }
        )
    result = summarise(series, checkpoints, sizes, diverged_at)
    result.update(
        {
            "forward_consistency_max_abs": forward_consistency(model, layers),
            "seconds": time.time() - start,
            "bounds": {
                name: dict(zip(("entry", "frobenius"), layer_bounds(layer), strict=True))
                for name, layer in layers.items()
            },
            "checkpoints": checkpoints,
            "trajectory": {
                "step": list(range(0, len(series["forget_ce"]), sizes.store_every)),
                **{k: v[:: sizes.store_every] for k, v in series.items()},
            },
        }
    )
    print(
        f"[seed {seed}] {arm:8s}: forget CE {result['forget_ce_start']:.3f}→{result['forget_ce_end']:.3f}  "
        f"retain EM {result['retain_em_start']:.3f}→{result['retain_em_end']:.3f}  forget EM "
        f"{result['forget_em_start']:.3f}→{result['forget_em_end']:.3f}  ‖ΔW‖ {result['dw_fro_ref']:.3g}"
        f"→{result['dw_fro_end']:.3g}  grad {result['grad_early']:.3g}→{result['grad_late']:.3g}  max ratio "
        f"{result['entry_ratio_max']:.3f}  ({result['seconds']:.0f}s)",
        flush=True,
    )
    return result


def summarise(series: dict, checkpoints: list[dict], sizes: Sizes, diverged_at: int | None) -> dict:
    n = len(series["forget_ce"])
    lo, hi = sizes.early_window
    early = series["grad_norm"][lo : hi + 1]
    late = series["grad_norm"][max(0, n - sizes.late_window) :]
    ref = series["dw_fro_sum"][min(sizes.norm_ref_step, n - 1)]
    return {
        "diverged_at": diverged_at,
        "steps_run": n - 1,
        "forget_ce_start": series["forget_ce"][0],
        "forget_ce_end": series["forget_ce"][-1],
        "d_forget_ce": series["forget_ce"][-1] - series["forget_ce"][0],
        "retain_ce_start": series["retain_ce"][0],
        "retain_ce_end": series["retain_ce"][-1],
        "forget_em_start": checkpoints[0]["forget_em"],
        "forget_em_end": checkpoints[-1]["forget_em"],
        "retain_em_start": checkpoints[0]["retain_em"],
        "retain_em_end": checkpoints[-1]["retain_em"],
        "retain_em_ratio": checkpoints[-1]["retain_em"] / max(checkpoints[0]["retain_em"], 1e-12),
        "retain_em_min": min(c["retain_em"] for c in checkpoints),
        "dw_fro_ref": ref,
        "dw_fro_end": series["dw_fro_sum"][-1],
        "dw_growth": series["dw_fro_sum"][-1] / ref if ref > 0 else math.inf,
        "grad_early": statistics.fmean(early),
        "grad_late": statistics.fmean(late),
        "grad_growth": statistics.fmean(late) / statistics.fmean(early),
        "grad_end": series["grad_norm"][-1],
        "factor_norm_end": series["factor_norm"][-1],
        "dw_maxabs_max": max(series["dw_maxabs"]),
        "entry_ratio_max": max(series["entry_ratio"]),
        "fro_ratio_max": max(series["fro_ratio"]),
        "bound_violations": sum(
            e > 1 + BOUND_RTOL or f > 1 + BOUND_RTOL
            for e, f in zip(series["entry_ratio"], series["fro_ratio"], strict=True)
        ),
    }


def run_seed(seed: int, sizes: Sizes, arms: tuple[str, ...]) -> dict:
    forget, retain = make_facts(seed, sizes)
    path = train_base(seed, sizes, forget, retain)
    model, tokenizer = load_base(path)
    base = {"forget_em": exact_match(model, tokenizer, forget), "retain_em": exact_match(model, tokenizer, retain)}
    print(f"[seed {seed}] base: forget EM {base['forget_em']:.3f}  retain EM {base['retain_em']:.3f}", flush=True)
    return {"base": base, "arms": {arm: run_arm(arm, seed, sizes, path, forget, retain) for arm in arms}}


# ---------------------------------------------------------------------------------------------------------------------
# aggregation, criteria, outputs

SUMMARY_KEYS = (
    "forget_ce_start",
    "forget_ce_end",
    "d_forget_ce",
    "retain_ce_start",
    "retain_ce_end",
    "forget_em_start",
    "forget_em_end",
    "retain_em_start",
    "retain_em_end",
    "retain_em_ratio",
    "retain_em_min",
    "dw_fro_ref",
    "dw_fro_end",
    "dw_growth",
    "grad_early",
    "grad_late",
    "grad_growth",
    "grad_end",
    "factor_norm_end",
    "dw_maxabs_max",
    "entry_ratio_max",
    "fro_ratio_max",
    "bound_violations",
    "steps_run",
)


def mean_std(values: list[float]) -> dict:
    finite_values = [v for v in values if finite(v)]
    if len(finite_values) < len(values):
        return {"mean": math.inf, "std": math.nan, "values": values}
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "values": values,
    }


def mean_series(series: list[list[float]]) -> list[float]:
    """Seed mean at each stored point (over the seeds that reached it)."""
    length = max(map(len, series))
    return [statistics.fmean([s[i] for s in series if i < len(s)]) for i in range(length)]


def aggregate(per_seed: dict, arms: tuple[str, ...]) -> dict:
    seeds = list(per_seed)
    out = {
        "base_forget_em": mean_std([per_seed[s]["base"]["forget_em"] for s in seeds]),
        "base_retain_em": mean_std([per_seed[s]["base"]["retain_em"] for s in seeds]),
        "arms": {},
    }
    for arm in arms:
        runs = [per_seed[s]["arms"][arm] for s in seeds]
        agg = {k: mean_std([r[k] for r in runs]) for k in SUMMARY_KEYS}
        agg["diverged"] = sum(r["diverged_at"] is not None for r in runs)
        agg["forward_consistency_max_abs"] = max(r["forward_consistency_max_abs"] for r in runs)
        traj = [r["trajectory"] for r in runs]
        agg["trajectory"] = {
            "step": max((t["step"] for t in traj), key=len),
            **{k: mean_series([t[k] for t in traj]) for k in traj[0] if k != "step"},
        }
        cps = [r["checkpoints"] for r in runs]
        agg["checkpoints"] = {
            "step": [c["step"] for c in max(cps, key=len)],
            **{k: mean_series([[c[k] for c in cp] for cp in cps]) for k in ("forget_em", "retain_em")},
        }
        out["arms"][arm] = agg
    return out


def criteria(per_seed: dict, agg: dict, sizes: Sizes) -> dict:
    seeds, arms = list(per_seed), agg["arms"]
    sine = [a for a in FREQS if a in arms]
    checks = {}

    def holds(rule) -> str:
        return f"{sum(bool(rule(per_seed[s])) for s in seeds)}/{len(seeds)}"

    if "lora" in arms:
        lora = arms["lora"]
        diverged = lora["diverged"] == len(seeds)
        checks["1a"] = {
            "criterion": f"vanilla LoRA: ‖ΔW‖_F (sum) at the end > {NORM_GROWTH:g} × at step "
            f"{sizes.norm_ref_step}, or non-finite",
            "values": {
                "growth": lora["dw_growth"]["mean"],
                "dw_ref_step": lora["dw_fro_ref"]["mean"],
                "dw_end": lora["dw_fro_end"]["mean"],
            },
            "passed": diverged or lora["dw_growth"]["mean"] > NORM_GROWTH,
            "per_seed": holds(
                lambda r: r["arms"]["lora"]["diverged_at"] is not None or r["arms"]["lora"]["dw_growth"] > NORM_GROWTH
            ),
        }
        checks["1b"] = {
            "criterion": f"vanilla LoRA: mean grad norm, last {sizes.late_window} steps > {GRAD_GROWTH:g} × "
            f"mean over steps {sizes.early_window[0]}-{sizes.early_window[1]}, or non-finite",
            "values": {
                "growth": lora["grad_growth"]["mean"],
                "early": lora["grad_early"]["mean"],
                "late": lora["grad_late"]["mean"],
            },
            "passed": diverged or lora["grad_growth"]["mean"] > GRAD_GROWTH,
            "per_seed": holds(
                lambda r: (
                    r["arms"]["lora"]["diverged_at"] is not None or r["arms"]["lora"]["grad_growth"] > GRAD_GROWTH
                )
            ),
        }
        checks["1c"] = {
            "criterion": f"vanilla LoRA: final retain EM < {RETAIN_COLLAPSE:g} × retain EM at step 0",
            "values": {"start": lora["retain_em_start"]["mean"], "end": lora["retain_em_end"]["mean"]},
            "passed": lora["retain_em_end"]["mean"] < RETAIN_COLLAPSE * lora["retain_em_start"]["mean"],
            "per_seed": holds(lambda r: r["arms"]["lora"]["retain_em_ratio"] < RETAIN_COLLAPSE),
        }
    if sine:
        checks["2"] = {
            "criterion": "sine, every ω, seed, step and matrix: max|ΔW_ij| ≤ s/g and ‖ΔW‖_F ≤ s·√(mn)/g "
            f"(rtol {BOUND_RTOL:g})",
            "values": {
                a: {
                    "max_entry_ratio": max(arms[a]["entry_ratio_max"]["values"]),
                    "max_fro_ratio": max(arms[a]["fro_ratio_max"]["values"]),
                    "violations": sum(arms[a]["bound_violations"]["values"]),
                }
                for a in sine
            },
            "passed": all(sum(arms[a]["bound_violations"]["values"]) == 0 for a in sine),
            "per_seed": holds(lambda r: all(r["arms"][a]["bound_violations"] == 0 for a in sine)),
        }

        def ok3(d_ce, em_start, em_end) -> bool:
            return d_ce >= FORGET_MARGIN and em_end >= RETAIN_KEEP * em_start

        per_freq = {
            a: {
                "d_forget_ce": arms[a]["d_forget_ce"]["mean"],
                "retain_em_start": arms[a]["retain_em_start"]["mean"],
                "retain_em_end": arms[a]["retain_em_end"]["mean"],
                "passed": ok3(
                    arms[a]["d_forget_ce"]["mean"],
                    arms[a]["retain_em_start"]["mean"],
                    arms[a]["retain_em_end"]["mean"],
                ),
            }
            for a in sine
        }
        checks["3"] = {
            "criterion": f"sine, some ω: mean forget CE rises ≥ {FORGET_MARGIN:g} nat/token and mean final retain "
            f"EM ≥ {RETAIN_KEEP:g} × its step-0 value",
            "values": per_freq,
            "passed": any(v["passed"] for v in per_freq.values()),
            "per_seed": holds(
                lambda r: any(
                    ok3(r["arms"][a]["d_forget_ce"], r["arms"][a]["retain_em_start"], r["arms"][a]["retain_em_end"])
                    for a in sine
                )
            ),
            "seeds_holding_per_freq": {
                a: holds(
                    lambda r, a=a: ok3(
                        r["arms"][a]["d_forget_ce"], r["arms"][a]["retain_em_start"], r["arms"][a]["retain_em_end"]
                    )
                )
                for a in sine
            },
        }
    return checks


def plot(agg: dict, path: Path) -> None:
    fig, axes = subplots(2, 3, figsize=(16, 8.5))
    panels = [
        (axes[0, 0], "dw_fro_sum", "‖ΔW_MLP‖_F (sum over 6 matrices)", True),
        (axes[0, 1], "grad_norm", "adapter gradient norm", True),
        (axes[0, 2], "entry_ratio", "max |ΔW_ij| / (s/g)  (sine bound = 1)", True),
        (axes[1, 0], "forget_ce", "forget CE (nats/token)", False),
        (axes[1, 1], "retain_ce", "retain CE (nats/token)", True),
    ]
    for ax, key, title, log in panels:
        for arm, a in agg["arms"].items():
            t = a["trajectory"]
            ax.plot(t["step"][: len(t[key])], t[key], color=COLORS[arm], label=LABELS[arm])
        if key == "entry_ratio":
            ax.axhline(1.0, color="black", linestyle="--", label="bound s/g")
        ax.set(title=title, xlabel="gradient-difference step")
        if log:
            ax.set_yscale("log")
        ax.legend(fontsize=8)
    ax = axes[1, 2]
    for arm, a in agg["arms"].items():
        c = a["checkpoints"]
        ax.plot(
            c["step"][: len(c["retain_em"])],
            c["retain_em"],
            color=COLORS[arm],
            marker="o",
            label=LABELS[arm],
        )
        ax.plot(
            c["step"][: len(c["forget_em"])],
            c["forget_em"],
            color=COLORS[arm],
            marker="x",
            linestyle=":",
        )
    ax.set(
        title="greedy exact match (o solid: retain, x dotted: forget)",
        xlabel="gradient-difference step",
        ylim=(-0.02, 1.02),
    )
    ax.legend(fontsize=8, loc="center right")
    fig.suptitle("E-B4: gradient difference with MLP adapters, vanilla LoRA vs sine (seed means)")
    save_figure(fig, path)


def interpretation(agg: dict, checks: dict, hidden_size: int) -> str:
    """Sentences generated from the measured numbers (so a rerun cannot leave a stale interpretation)."""
    arms, text = agg["arms"], []
    if "lora" in arms:
        a = arms["lora"]
        text.append(
            f"Vanilla LoRA: ‖ΔW‖_F went from {a['dw_fro_ref']['mean']:.3g} at the reference step to "
            f"{a['dw_fro_end']['mean']:.3g} at the end (×{a['dw_growth']['mean']:.3g}), the gradient norm from "
            f"{a['grad_early']['mean']:.3g} to {a['grad_late']['mean']:.3g} (×{a['grad_growth']['mean']:.3g}), forget "
            f"CE from {a['forget_ce_start']['mean']:.3f} to {a['forget_ce_end']['mean']:.3g}, and retain exact match "
            f"from {a['retain_em_start']['mean']:.3f} to {a['retain_em_end']['mean']:.3f} (lowest checkpoint "
            f"{a['retain_em_min']['mean']:.3f})"
            + (f" ({a['diverged']} seed(s) went non-finite)." if a["diverged"] else ".")
        )
        if not all(checks[c]["passed"] for c in ("1a", "1b", "1c")):
            text.append(
                "The predicted runaway did not (fully) happen here. A likely reason, not tested by this script: the "
                "base model's final RMSNorm and tied embedding are frozen, so the logits, and with them the forget "
                "CE, are bounded; once the forget answers are pushed far down (forget CE ≈ "
                f"{a['forget_ce_end']['mean']:.0f} nats/token) the ascent term saturates instead of growing, and with "
                "random, unrelated keys the retain term can repair what the ascent disturbs."
            )
    sine = [s for s in FREQS if s in arms]
    if sine:
        parts = [
            f"ω = {FREQS[s]:g}: forget CE {arms[s]['d_forget_ce']['mean']:+.3g}, retain EM "
            f"{arms[s]['retain_em_start']['mean']:.3f} → {arms[s]['retain_em_end']['mean']:.3f} (lowest "
            f"{arms[s]['retain_em_min']['mean']:.3f}), forget EM "
            f"{arms[s]['forget_em_end']['mean']:.3f}, max |ΔW_ij|/(s/g) "
            f"{max(arms[s]['entry_ratio_max']['values']):.3f}"
            for s in sine
        ]
        text.append("Sine adapters (" + "; ".join(parts) + ").")
        if checks.get("2", {}).get("passed"):
            text.append(
                "The entry and Frobenius bounds held at every step, as they must by construction; what "
                "criterion 3 tests is whether the bounded update can still forget without erasing the "
                "retained facts."
            )
        dipped = [
            a for a in arms if arms[a]["retain_em_min"]["mean"] < RETAIN_KEEP * arms[a]["retain_em_start"]["mean"]
        ]
        if dipped:
            lows = ", ".join(f"{LABELS[a]} {arms[a]['retain_em_min']['mean']:.2f}" for a in dipped)
            text.append(
                f"Retain exact match dipped below {RETAIN_KEEP:g} × its start at some checkpoint in "
                f"{'every arm' if len(dipped) == len(arms) else 'these arms'} (lowest checkpoint, seed mean: {lows}); "
                "criterion 3 reads the final checkpoint only, so where a sine arm dipped it shows recovery, not that "
                "the bounded adapter avoided the disruption."
            )
        forgot = {a: first_step(arms[a]["checkpoints"], "forget_em", 0.05) for a in arms}
        if sine and "lora" in arms:
            text.append(
                "Same LR is not same step size: at B = 0 the sine update's Jacobian is s·ω/g, i.e. ω/g = "
                + ", ".join(f"{FREQS[a] / math.sqrt(hidden_size):.3g}" for a in sine)
                + f" times vanilla LoRA's s on gate/up_proj (g = {math.sqrt(hidden_size):.3g}) for ω = "
                + ", ".join(f"{FREQS[a]:g}" for a in sine)
                + ". The seed-mean forget exact match first reached ≤ 0.05 at step "
                + ", ".join(f"{forgot[a] if forgot[a] is not None else 'never'} ({LABELS[a]})" for a in arms)
                + "; an arm that finishes forgetting early has more of its 500 steps to repair the retain set, so "
                "the differences between arms may come from this speed as much as from the bound."
            )
        if "lora" in arms:
            larger = [
                f"{FREQS[s]:g}" for s in sine if arms[s]["dw_fro_end"]["mean"] > arms["lora"]["dw_fro_end"]["mean"]
            ]
            if larger:
                text.append(
                    f"Bounded is not small: at ω = {', '.join(larger)} the final ‖ΔW‖_F exceeded vanilla LoRA's "
                    f"({arms['lora']['dw_fro_end']['mean']:.3g}); the sine saturates, within a few steps at large ω "
                    "(max |ΔW_ij| reaches s/g, ‖ΔW‖_F up to "
                    + ", ".join(f"{max(arms[s]['fro_ratio_max']['values']):.2f}" for s in sine)
                    + " of its bound for ω = "
                    + ", ".join(f"{FREQS[s]:g}" for s in sine)
                    + ")."
                )
    return " ".join(text)


def first_step(checkpoints: dict, key: str, threshold: float) -> int | None:
    """First checkpoint step at which the seed-mean `key` is ≤ `threshold` (None if never)."""
    return next((step for step, v in zip(checkpoints["step"], checkpoints[key], strict=False) if v <= threshold), None)


def markdown(result: dict) -> str:
    agg, checks, cfg = result["aggregate"], result["criteria"], result["config"]
    sizes = cfg["sizes"]

    def fmt(ms, digits=3, sign=False):
        return f"{ms['mean']:{'+' if sign else ''}.{digits}g} ± {ms['std']:.2g}"

    lines = [
        f"Mean ± std over seeds. Tiny Llama fully fine-tuned on {sizes['num_forget']} forget + "
        f"{sizes['num_retain']} retain random key→value facts; then {sizes['steps']} steps of gradient difference "
        f"(CE_retain − {sizes['forget_weight']:g}·CE_forget, full sets every step, AdamW LR {sizes['lr']:g}, "
        "constant) "
        f"with r = {sizes['rank']}, lora_alpha = {sizes['lora_alpha']} adapters on gate/up/down_proj only. EM = "
        "greedy exact match of the 3-digit value.",
        "",
        f"Base model: forget EM {fmt(agg['base_forget_em'])}, retain EM {fmt(agg['base_retain_em'])}.",
        "",
        "| arm | forget CE start → end | forget EM end | retain EM start → end | lowest retain EM | retain CE end | "
        "‖ΔW‖_F ref → end | grad norm early → late | max \\|ΔW_ij\\|/(s/g) | max ‖ΔW‖_F/(s√mn/g) | non-finite seeds |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for arm, a in agg["arms"].items():
        lines.append(
            f"| {LABELS[arm]} | {fmt(a['forget_ce_start'])} → {fmt(a['forget_ce_end'])} | {fmt(a['forget_em_end'])} | "
            f"{fmt(a['retain_em_start'])} → {fmt(a['retain_em_end'])} | {fmt(a['retain_em_min'])} | "
            f"{fmt(a['retain_ce_end'])} | "
            f"{fmt(a['dw_fro_ref'])} → {fmt(a['dw_fro_end'])} | {fmt(a['grad_early'])} → {fmt(a['grad_late'])} | "
            f"{max(a['entry_ratio_max']['values']):.4g} | {max(a['fro_ratio_max']['values']):.4g} | {a['diverged']} |"
        )
    lines += [
        "",
        "(max ratios are over all steps and seeds; for vanilla LoRA the s/g of a sine adapter of the same "
        "layer is only a reference, no bound applies.)",
    ]
    if "3" in checks:
        lines += [
            "",
            "Criterion 3 per ω (seed means):",
            "",
            "| ω | Δ forget CE | retain EM start → end | holds | seeds |",
            "|---|---|---|---|---|",
        ]
        for arm, v in checks["3"]["values"].items():
            lines.append(
                f"| {FREQS[arm]:g} | {v['d_forget_ce']:+.3g} | {v['retain_em_start']:.3f} → "
                f"{v['retain_em_end']:.3f} | {'PASS' if v['passed'] else 'FAIL'} | "
                f"{checks['3']['seeds_holding_per_freq'][arm]} |"
            )
    consistency = max(a["forward_consistency_max_abs"] for a in agg["arms"].values())
    lines += [
        "",
        f"Forward consistency (adapted layer output vs x·(W0 + get_delta_weight)ᵀ): max abs difference "
        f"{consistency:.2g}.",
        "",
        "## Interpretation",
        "",
        interpretation(agg, checks, sizes["hidden_size"]),
    ]
    return "\n".join(lines)


EXPERIMENT = declare(
    globals(),
    title="E-B4: bounded sine adapters for gradient-difference unlearning",
    claim="Bounded sine MLP adapters keep gradient-difference unlearning stable where plain LoRA's adapter norm, "
    "gradients and retained accuracy blow up (Stable Forgetting, arXiv 2509.24166).",
    run_seed=lambda seed, sizes: run_seed(seed, sizes, ARMS),
    aggregate=lambda per_seed, sizes: aggregate(per_seed, ARMS),
    plot=lambda result, path: plot(result["aggregate"], path),
    config={
        "arms": list(ARMS),
        "freqs": FREQS,
        "sine_g": "sqrt_in",
        "target_modules": TARGETS,
        "criteria_constants": {
            "norm_growth": NORM_GROWTH,
            "grad_growth": GRAD_GROWTH,
            "retain_collapse": RETAIN_COLLAPSE,
            "bound_rtol": BOUND_RTOL,
            "forget_margin": FORGET_MARGIN,
            "retain_keep": RETAIN_KEEP,
        },
    },
)


if __name__ == "__main__":
    run(EXPERIMENT)
