"""E-A1 capability continuum: which per-token SFT objective wins depends on the base model's prior.

Claim (Li et al., "Beyond Log Likelihood", arXiv 2510.00526): prior-leaning
objectives (-p, -p^10, which weight each token's NLL gradient by p^α) are at least as good as NLL when the model is
already strong on the SFT task (model-strong, MS), and far worse when the task is new to it (model-weak, MW).

Design (CPU, random-init tiny Llama from `hf_stable.testing.build_tiny_model`, char-level tokenizer):

* Task T: 2-digit addition ``"a+b="`` -> ``"a+b"``. Per seed, the 10^4 problems are shuffled; ``n_eval`` of them are
  held out from *all* training (pretraining and SFT) and form the clean evaluation sets.
* "Pretraining": NLL SFT of the random-init model on T (2000 steps x 64, LR 3e-3 cosine), cached per seed under
  ``experiments/cache/``.
* SFT sets (completion-only, one epoch of 150 steps x 64 rows, identical LR/steps/batch/optimiser for every objective):
  - MS: task T with ``noise_rate`` (30 %) of the answer digits replaced by a *different* random digit;
  - MW: task T' = T's answer passed digit by digit through a fixed random derangement of 0-9 (one per seed; every
    digit changes, so the base model's greedy answer is never right).
* Objectives: ``nll``; ``prob_power`` α=1 ("-p") and α=10 ("-p^10"); ``threshold`` ``top_p`` at the base model's
  P20 (``threshold_quantile=0.2``, probed on the SFT set); and ``auto`` (hf_stable's rule; its probe stats and
  decision come from ``objective_probe.json``).
* Metrics: greedy exact match and mean teacher-forced p (``evaluate_completions``) on the clean held-out set of the
  SFT task (T for MS, T' for MW); relative parameter change ||θ-θ0||/||θ0||; base-model probe stats per set.
* Seeds 0-5 (model init, problem split, noise, permutation, data order); mean ± std (ddof=1) over seeds. Seeds 0-2
  calibrate the `auto` rule, seeds 3-5 are the reported (out-of-sample) seeds.

Design choices fixed before the final comparison: 2-digit (not 3-digit) addition so pretraining takes < 1 min per
seed; noisy digits always differ from the true digit (so 30 % of digits are wrong; under uniform noise the correct
digit stays the per-position mode, so NLL's greedy answer is not expected to collapse); SFT LR 1e-3 with cosine
schedule, 10 % warmup, AdamW betas (0.9, 0.95), weight decay 0.01, clip 1.0 (the reference recipe's optimiser); SFT
length chosen from an NLL-only pilot on MW, seed 0 (75 steps: EM 0.23; 150 steps: EM 0.63; 150 kept). No
objective-specific tuning. The pretraining budget was fixed in advance and not changed after seed 1 reached only
0.79 exact match on T (seeds 0 and 2: > 0.99); that seed is reported as is.

History: the first full run (seeds 0-2) used the rule's original P20 guard (``strong_p20=0.3``); it called the noisy
MS set "intermediate" on every seed although -p beat NLL there, so hf_stable's default became ``strong_p20=0``. A
review pointed out that this recalibrated the rule on the very seeds it was reported on, and that the rule's choice
(-p) on clean, high-median data had never been run.

Redesign (pre-registered here before the seed 3-5 runs and before any -p or `auto` run on clean data):
* A clean-label set (T_clean: the MS problems without noise: high median p, and its low-p tail is not noise) runs
  NLL, -p, -p^10 and `auto`.
* Calibration on seeds 0-2 only: for each P20 guard g ∈ {0, 0.1, 0.3} (the rule's other thresholds at hf_stable's
  defaults), a decision on a (seed, set) case is correct when the objective the rule picks (-p when model-strong,
  NLL otherwise) has EM ≥ the other one's − 0.02; the guard with the most correct decisions over the 9 cases
  (MS, MW, T_clean × 3 seeds) is kept, ties going to the larger (more conservative) guard.
* Everything below is evaluated on seeds 3-5 only.

Pass criteria (means over the report seeds 3-5, stated in advance):
  MS: EM(-p) >= EM(nll) - 0.02 and EM(-p^10) >= EM(nll) - 0.02;
  MW: EM(nll) - EM(-p^10) >= 0.2;
  calibrated rule: on each of MS, MW, T_clean, the mean EM of the objectives it picks >= max(mean EM nll,
  mean EM -p) - 0.02;
  shipped rule (hf_stable's default, ``strong_p20=0``): the same test;
  clean data: on T_clean, EM(-p) >= EM(nll) - 0.02 (the shipped rule's choice there does not lose to NLL).

Controls (added after the report seeds ran, nothing else changed: the two that `sft_thresholds.py` pre-registered on
its own seeds, here on the report seeds 3-5; each a paired difference with its 95% Student-t interval): the testbed's
two ends differ under the prior-leaning objective, in opposite directions, so a claim about them can be read:
  control_ms: MS, mean_p(-p) − mean_p(nll), interval above 0;
  control_mw: MW, mean_p(nll) − mean_p(-p), interval above 0.

Command (six seeds; each seed cached on its own):
  OMP_NUM_THREADS=1 .venv/bin/python experiments/sft_capability_continuum.py
Smoke test: ``... --quick --out /tmp/e_a1``.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from _harness import criterion, declare, fmt, mean_std, run, save_figure, subplots
from testbeds import tiny_trl


HERE = Path(__file__).resolve().parent
NAME = "sft_capability_continuum"
DIGITS = "0123456789"

# arm name -> StableSFTConfig objective fields
OBJECTIVES = {
    "nll": {"sft_objective": "nll"},
    "-p": {"sft_objective": "prob_power", "objective_alpha": 1.0},
    "-p^10": {"sft_objective": "prob_power", "objective_alpha": 10.0},
    "top_p@P20": {"sft_objective": "threshold", "threshold_kind": "top_p", "threshold_quantile": 0.2},
    "auto": {"sft_objective": "auto"},
}
SETS = ("MS", "MW")
# post-hoc diagnostic (added after the first full run, outside the pass criterion): the MS problems with clean labels
CONTROL = "T_clean"
CONTROL_ARMS = ("nll", "-p", "-p^10", "auto")
MARGIN_MS = 0.02
ORIGINAL_P20_GUARD = {"strong_p20": 0.3}  # the rule's original P20 guard, before the first run recalibrated it
GAP_MW = 0.2
CALIBRATION_SEEDS = (0, 1, 2)
T_95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}  # by df = n − 1
GUARD_GRID = (0.0, 0.1, 0.3)
RULE_SETS = (*SETS, CONTROL)


@dataclass(frozen=True)
class Config:
    max_operand: int = 99
    n_eval: int = 500
    pretrain_steps: int = 2000
    pretrain_batch: int = 64
    pretrain_lr: float = 3e-3
    sft_steps: int = 150
    sft_batch: int = 64
    sft_lr: float = 1e-3
    noise_rate: float = 0.3
    probe_batches: int = 32
    max_length: int = 16


QUICK = Config(n_eval=64, pretrain_steps=150, sft_steps=15, sft_batch=32, probe_batches=4)


# ---------------------------------------------------------------------------------------------------------------
# data


def split_problems(seed: int, cfg: Config) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """All (a, b) pairs, shuffled by `seed`: (training pool, held-out evaluation problems)."""
    pairs = [(a, b) for a in range(cfg.max_operand + 1) for b in range(cfg.max_operand + 1)]
    random.Random(seed).shuffle(pairs)
    return pairs[cfg.n_eval :], pairs[: cfg.n_eval]


def derangement(rng: random.Random) -> dict[str, str]:
    """A random permutation of the ten digits with no fixed point."""
    while True:
        image = list(DIGITS)
        rng.shuffle(image)
        if all(d != e for d, e in zip(DIGITS, image, strict=True)):
            return dict(zip(DIGITS, image, strict=True))


def add_noise(answer: str, rate: float, rng: random.Random) -> str:
    """Each digit is replaced, with probability `rate`, by a different uniformly random digit."""
    return "".join(rng.choice(DIGITS.replace(d, "")) if rng.random() < rate else d for d in answer)


def to_dataset(problems, answer_fn, target_fn=None):
    """prompt / completion / answer rows; `target_fn` (default: the answer) gives the supervised completion."""
    from datasets import Dataset

    rows = []
    for a, b in problems:
        answer = answer_fn(a, b)
        target = target_fn(answer) if target_fn else answer
        rows.append({"prompt": f"{a}+{b}=", "completion": target, "answer": answer})
    return Dataset.from_list(rows)


def sample(pool, n: int, rng: random.Random):
    return rng.sample(pool, n) if n <= len(pool) else rng.choices(pool, k=n)


def build_sets(seed: int, cfg: Config) -> dict:
    """Training and clean evaluation datasets of MS and MW for one seed, and the permutation of T'."""
    pool, held_out = split_problems(seed, cfg)
    rng = random.Random(10_000 + seed)
    perm = derangement(rng)

    def clean(a, b):
        return str(a + b)

    def permuted(a, b):
        return "".join(perm[d] for d in str(a + b))

    n = cfg.sft_steps * cfg.sft_batch
    t_eval = to_dataset(held_out, clean)
    ms_problems = sample(pool, n, rng)  # the RNG is consumed in this order: MS problems, MS noise, MW problems
    ms_train = to_dataset(ms_problems, clean, lambda ans: add_noise(ans, cfg.noise_rate, rng))
    mw_train = to_dataset(sample(pool, n, rng), permuted)
    return {
        "permutation": "".join(perm[d] for d in DIGITS),
        "MS": {"train": ms_train, "eval": t_eval},
        "MW": {"train": mw_train, "eval": to_dataset(held_out, permuted)},
        CONTROL: {"train": to_dataset(ms_problems, clean), "eval": t_eval},  # MS without the noise
        "T_eval": t_eval,
        "pool": pool,
    }


# ---------------------------------------------------------------------------------------------------------------
# training


def trainer_args(output_dir: str, seed: int, steps: int, batch: int, lr: float, cfg: Config, **objective):
    return tiny_trl.sft_config(
        output_dir,
        seed,
        max_steps=steps,
        per_device_train_batch_size=batch,
        learning_rate=lr,
        lr_scheduler_type="cosine",
        warmup_steps=0.1,
        adam_beta2=0.95,
        weight_decay=0.01,
        max_grad_norm=1.0,
        max_length=cfg.max_length,
        auto_probe_batches=cfg.probe_batches,
        logging_steps=max(steps // 10, 1),
        **objective,
    )


def train(model, tokenizer, dataset, args):
    from transformers.trainer_callback import PrinterCallback

    from hf_stable import StableSFTTrainer

    trainer = StableSFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    return trainer


def evaluate(model, tokenizer, dataset) -> dict:
    from hf_stable.testing import evaluate_completions

    out = evaluate_completions(model, tokenizer, dataset, batch_size=256, max_new_tokens=5)
    return {"exact_match": out["exact_match"], "mean_p": out["mean_p"]}


def cache_key(cfg: Config) -> str:
    fields = {k: v for k, v in asdict(cfg).items() if k.startswith("pretrain") or k in ("max_operand", "n_eval")}
    return hashlib.sha1(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:10]


def load(path: Path):
    """A fresh model from a checkpoint. Never `copy.deepcopy` a model a TRL trainer has used: TRL's fused-LM-head patch
    keeps the *original* model's forward in a closure, so the copy's plain forward (generation, evaluation) would
    silently run the original weights."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path)


def pretrain(seed: int, cfg: Config, sets: dict, cache_dir: Path) -> tuple[Path, dict]:
    """Checkpoint of the model with a prior for T (NLL on clean T), trained unless cached; and its T metrics."""
    from hf_stable.testing import build_tiny_model

    path = cache_dir / f"e_a1_pretrain_{cache_key(cfg)}_seed{seed}"
    info_file = path / "pretrain.json"
    if info_file.exists():
        return path, {**json.loads(info_file.read_text()), "cached": True}
    start = time.time()
    model, tokenizer = build_tiny_model(seed=seed)
    data = to_dataset(sets["pool"], lambda a, b: str(a + b))
    with tempfile.TemporaryDirectory() as tmp:
        args = trainer_args(tmp, seed, cfg.pretrain_steps, cfg.pretrain_batch, cfg.pretrain_lr, cfg)
        train(model, tokenizer, data, args)
    info = {"T_eval": evaluate(model, tokenizer, sets["T_eval"]), "wall_s": round(time.time() - start, 1)}
    model.save_pretrained(path)
    info_file.write_text(json.dumps(info, indent=2))
    return path, {**info, "cached": False}


def param_change(model, base) -> float:
    pairs = list(zip(model.parameters(), base.parameters(), strict=True))
    num = sum((p.detach() - q.detach()).pow(2).sum() for p, q in pairs)
    den = sum(q.detach().pow(2).sum() for _, q in pairs)
    return (num / den).sqrt().item()


def read_probe(output_dir: str) -> dict | None:
    from hf_stable.trainers.sft import PROBE_FILE

    path = Path(output_dir) / PROBE_FILE
    return json.loads(path.read_text()) if path.exists() else None


def run_arm(base, base_path: Path, tokenizer, seed: int, cfg: Config, data: dict, objective: dict) -> dict:
    """SFT a fresh copy of the pretrained model with one objective; clean held-out metrics and the probe, if any."""
    start = time.time()
    model = load(base_path)
    with tempfile.TemporaryDirectory() as tmp:
        args = trainer_args(tmp, seed, cfg.sft_steps, cfg.sft_batch, cfg.sft_lr, cfg, **objective)
        trainer = train(model, tokenizer, data["train"], args)
        probe = read_probe(tmp)
    result = evaluate(model, tokenizer, data["eval"])
    result["param_change"] = param_change(model, base)
    history = trainer.state.log_history
    losses = [h["loss"] for h in history if "loss" in h]
    norms = [h["grad_norm"] for h in history if h.get("grad_norm") is not None]
    result["final_train_loss"] = losses[-1] if losses else None
    result["mean_grad_norm"] = statistics.fmean(norms) if norms else None
    result["wall_s"] = round(time.time() - start, 1)
    if probe is not None:
        result["probe"] = probe
    return result


def run_seed(seed: int, cfg: Config, cache_dir: Path = HERE / "cache") -> dict:
    from hf_stable.testing import build_tiny_tokenizer

    sets = build_sets(seed, cfg)
    base_path, pre = pretrain(seed, cfg, sets, cache_dir)
    base, tokenizer = load(base_path), build_tiny_tokenizer()
    how = "cached" if pre["cached"] else f"{pre['wall_s']} s"
    print(f"[seed {seed}] pretrained: T exact match {pre['T_eval']['exact_match']:.3f} ({how})", flush=True)
    out = {"pretrain": pre, "permutation": sets["permutation"], "sets": {}}
    for name in SETS:
        data = sets[name]
        arms = {"base": evaluate(base, tokenizer, data["eval"])}
        for arm, objective in OBJECTIVES.items():
            arms[arm] = run_arm(base, base_path, tokenizer, seed, cfg, data, objective)
            print(
                f"[seed {seed}] {name} {arm:>10}: EM {arms[arm]['exact_match']:.3f} "
                f"mean_p {arms[arm]['mean_p']:.3f} ({arms[arm]['wall_s']} s)",
                flush=True,
            )
        out["sets"][name] = arms
    control = sets[CONTROL]
    out["control"] = {
        arm: run_arm(base, base_path, tokenizer, seed, cfg, control, OBJECTIVES[arm]) for arm in CONTROL_ARMS
    }
    print(
        f"[seed {seed}] {CONTROL} control (no noise): "
        + ", ".join(f"{arm} EM {r['exact_match']:.3f}" for arm, r in out["control"].items()),
        flush=True,
    )
    return out


# ---------------------------------------------------------------------------------------------------------------
# analysis and reporting


def aggregate_seeds(per_seed: dict) -> dict:
    agg = {}
    for name in SETS:
        agg[name] = {}
        for arm in ["base", *OBJECTIVES]:
            runs = [per_seed[s]["sets"][name][arm] for s in per_seed]
            agg[name][arm] = {k: mean_std([r[k] for r in runs]) for k in ("exact_match", "mean_p")}
            if arm != "base":
                agg[name][arm]["param_change"] = mean_std([r["param_change"] for r in runs])
                agg[name][arm]["mean_grad_norm"] = mean_std([r["mean_grad_norm"] for r in runs])
    agg[CONTROL] = {}
    for arm in CONTROL_ARMS:
        runs = [per_seed[s]["control"][arm] for s in per_seed]
        agg[CONTROL][arm] = {k: mean_std([r[k] for r in runs]) for k in ("exact_match", "mean_p", "param_change")}
    return agg


def split_seeds(per_seed: dict) -> tuple[dict, dict]:
    """(calibration, report) seeds; a run without report seeds (the quick smoke) reports on its calibration seeds."""
    calib = {s: r for s, r in per_seed.items() if int(s) in CALIBRATION_SEEDS}
    report = {s: r for s, r in per_seed.items() if int(s) not in CALIBRATION_SEEDS}
    return calib or per_seed, report or per_seed


def arms_of(record: dict, name: str) -> dict:
    return record["sets"][name] if name in SETS else record["control"]


def rule_pick(stats: dict, guard: float) -> str:
    """The arm (`-p` or `nll`) hf_stable's `auto` rule picks with P20 guard `guard` and default other thresholds."""
    from hf_stable.losses.sft import choose_objective

    return "-p" if choose_objective(stats, {"strong_p20": guard})["sft_objective"] == "prob_power" else "nll"


def picked_em(record: dict, name: str, guard: float) -> float:
    arms = arms_of(record, name)
    return arms[rule_pick(arms["auto"]["probe"]["stats"], guard)]["exact_match"]


def decision_correct(record: dict, name: str, guard: float) -> bool:
    arms = arms_of(record, name)
    return picked_em(record, name, guard) >= max(arms["nll"]["exact_match"], arms["-p"]["exact_match"]) - MARGIN_MS


def calibrate(calib: dict) -> dict:
    """The P20 guard with the most correct decisions on the calibration seeds (ties: the larger guard)."""
    scores = {g: sum(decision_correct(r, n, g) for r in calib.values() for n in RULE_SETS) for g in GUARD_GRID}
    best = max(GUARD_GRID, key=lambda g: (scores[g], g))
    return {
        "strong_p20": best,
        "correct": {f"{g:g}": v for g, v in scores.items()},
        "cases": len(calib) * len(RULE_SETS),
        "seeds": sorted(calib, key=int),
    }


def rule_check(report: dict, guard: float) -> dict:
    """Per set: mean EM of the rule's picks vs the better of mean EM nll and mean EM -p (report seeds)."""
    out = {}
    for name in RULE_SETS:
        picked = statistics.fmean(picked_em(r, name, guard) for r in report.values())
        best = max(
            statistics.fmean(arms_of(r, name)[a]["exact_match"] for r in report.values()) for a in ("nll", "-p")
        )
        picks = [rule_pick(arms_of(r, name)["auto"]["probe"]["stats"], guard) for r in report.values()]
        out[name] = {
            "picked_em": picked,
            "best_em": best,
            "picks": picks,
            "ok": picked >= best - MARGIN_MS,
            "seeds_ok": sum(decision_correct(r, name, guard) for r in report.values()),
        }
    return out


def aggregate(per_seed: dict, cfg: Config | None = None) -> dict:
    calib, report = split_seeds(per_seed)
    calibration = calibrate(calib)
    return {
        "report_seeds": sorted(report, key=int),
        "calibration_seeds": sorted(calib, key=int),
        "report": aggregate_seeds(report),
        "calibration": aggregate_seeds(calib),
        "probe": probe_summary(per_seed),
        "rule_calibration": calibration,
        "calibrated_rule_on_report": rule_check(report, calibration["strong_p20"]),
        "shipped_rule_on_report": rule_check(report, 0.0),
    }


def probe_summary(per_seed: dict) -> dict:
    """Base-model probe stats (from the `auto` arm), the auto decision and the resolved P20 threshold, per set; and
    the decision of the rule's original P20 guard (`strong_p20=0.3`)."""
    from hf_stable.losses.sft import choose_objective

    summary = {}
    for name in RULE_SETS:
        rows = {}
        for seed, res in per_seed.items():
            arms = arms_of(res, name)
            auto = arms["auto"]["probe"]
            stats = auto["stats"]
            rows[seed] = {
                "median": stats["median"],
                "p20": stats["p20"],
                "p10": stats["p10"],
                "mean": stats["mean"],
                "frac_p_gt_0.5": stats["frac_p_gt_0.5"],
                "num_tokens": stats["num_tokens"],
                "decision": auto["decision"],
                "threshold_p20": arms["top_p@P20"]["probe"]["threshold"] if "top_p@P20" in arms else None,
                "decision_with_original_p20_guard": choose_objective(stats, ORIGINAL_P20_GUARD),
            }
        summary[name] = {"per_seed": rows, "decisions": sorted({r["decision"]["regime"] for r in rows.values()})}
    return summary


CHECKS = {  # name -> (set, arm a, arm b, threshold): passes when EM(a) - EM(b) >= threshold
    f"MS: EM(-p) >= EM(nll) - {MARGIN_MS}": ("MS", "-p", "nll", -MARGIN_MS),
    f"MS: EM(-p^10) >= EM(nll) - {MARGIN_MS}": ("MS", "-p^10", "nll", -MARGIN_MS),
    f"MW: EM(nll) - EM(-p^10) >= {GAP_MW}": ("MW", "nll", "-p^10", GAP_MW),
}


def paired(a: list[float], b: list[float]) -> dict:
    """Mean of the paired differences a − b with its 95 % Student-t interval over seeds."""
    d = [x - y for x, y in zip(a, b, strict=True)]
    n, m = len(d), statistics.fmean(d)
    half = T_95[n - 1] * statistics.stdev(d) / math.sqrt(n) if n > 1 else math.inf
    return {"mean": m, "ci_low": m - half, "ci_high": m + half, "n": n, "per_seed": d}


def criteria(per_seed: dict, agg: dict, cfg: Config | None = None) -> dict:
    """The pre-stated criteria on the report seeds' means, with how many report seeds meet each on their own."""
    _, report = split_seeds(per_seed)
    rep, checks = agg["report"], {}
    for key, (text, (name, a, b, threshold)) in zip(("ms_p", "ms_p10", "mw"), CHECKS.items(), strict=True):
        em_a, em_b = rep[name][a]["exact_match"]["values"], rep[name][b]["exact_match"]["values"]
        checks[key] = criterion(
            text,
            statistics.fmean(em_a) - statistics.fmean(em_b) >= threshold,
            {a: statistics.fmean(em_a), b: statistics.fmean(em_b)},
            f"{sum(x - y >= threshold for x, y in zip(em_a, em_b, strict=True))}/{len(em_a)} seeds",
        )
    for key, label in (("calibrated", "calibrated"), ("shipped", "shipped")):
        rule = agg[f"{key}_rule_on_report"]
        guard = agg["rule_calibration"]["strong_p20"] if key == "calibrated" else 0.0
        checks[f"{key}_rule"] = criterion(
            f"{label} rule (strong_p20 = {guard:g}): on MS, MW and {CONTROL}, mean EM of its picks ≥ max(mean EM nll, "
            f"mean EM -p) − {MARGIN_MS}",
            all(r["ok"] for r in rule.values()),
            {name: r["picked_em"] - r["best_em"] for name, r in rule.items()},
            ", ".join(f"{name} {r['seeds_ok']}/{len(report)}" for name, r in rule.items()),
        )
    for key, name, a, b in (("control_ms", "MS", "-p", "nll"), ("control_mw", "MW", "nll", "-p")):
        d = paired(rep[name][a]["mean_p"]["values"], rep[name][b]["mean_p"]["values"])
        checks[key] = criterion(
            f"control: {name}, mean_p({a}) − mean_p({b}), 95 % interval above 0",
            d["ci_low"] > 0,
            {k: d[k] for k in ("mean", "ci_low", "ci_high", "n")},
            f"{sum(x > 0 for x in d['per_seed'])}/{d['n']} seeds",
        )
    em = {a: rep[CONTROL][a]["exact_match"]["values"] for a in ("-p", "nll")}
    checks["clean"] = criterion(
        f"{CONTROL} (clean, high median p): EM(-p) ≥ EM(nll) − {MARGIN_MS}",
        statistics.fmean(em["-p"]) >= statistics.fmean(em["nll"]) - MARGIN_MS,
        {a: statistics.fmean(v) for a, v in em.items()},
        f"{sum(x >= y - MARGIN_MS for x, y in zip(em['-p'], em['nll'], strict=True))}/{len(em['nll'])} seeds",
    )
    return checks


def plot(agg: dict, path: Path, title: str) -> None:
    arms = list(OBJECTIVES)
    fig, axes = subplots(1, 2, figsize=(10, 3.8), sharey=True)
    for ax, name in zip(axes, SETS, strict=True):
        means = [agg[name][a]["exact_match"]["mean"] for a in arms]
        stds = [agg[name][a]["exact_match"]["std"] for a in arms]
        ax.bar(arms, means, yerr=stds, capsize=4, color=["C0", "C1", "C2", "C3", "C7"], alpha=0.85)
        for i, arm in enumerate(arms):  # one dot per seed: the spread is mostly one seed, not noise around a mean
            values = agg[name][arm]["exact_match"]["values"]
            offsets = [0.0] if len(values) == 1 else [-0.2 + 0.4 * k / (len(values) - 1) for k in range(len(values))]
            ax.scatter(
                [i + o for o in offsets], values, s=14, color="k", zorder=3, label="per seed" if i == 0 else None
            )
        ax.axhline(agg[name]["base"]["exact_match"]["mean"], color="k", ls="--", lw=1, label="base (before SFT)")
        label = "MS: noisy T (eval clean T)" if name == "MS" else "MW: new task T' (eval T')"
        ax.set_title(label)
        ax.set_ylim(0, 1.1)
        ax.tick_params(axis="x", rotation=20)
    axes[1].legend(loc="upper right", fontsize=8)
    axes[0].set_ylabel("clean held-out exact match\n(bar: mean ± std over seeds)")
    fig.suptitle(title)
    save_figure(fig, path, dpi=120)


def seed_values(probes: dict, name: str, key: str) -> list[float]:
    return [r[key] for r in probes[name]["per_seed"].values()]


def fmt_probe(probes: dict, name: str, key: str) -> str:
    return f"{statistics.fmean(seed_values(probes, name, key)):.3g}"


def regimes(probes: dict, name: str, key: str = "decision") -> str:
    return ", ".join(f"{r[key]['regime']} ({r[key]['sft_objective']})" for r in probes[name]["per_seed"].values())


def interpretation(result: dict) -> str:
    agg, checks = result["aggregate"], result["criteria"]
    rep = agg["report"]
    em = {s: {a: rep[s][a]["exact_match"]["mean"] for a in rep[s]} for s in (*SETS, CONTROL)}
    cal = agg["rule_calibration"]
    lines = [
        f"On the report seeds {agg['report_seeds']}: on MS (noisy labels for a known task) clean exact match goes "
        "from "
        f"{em['MS']['base']:.3f} (base) to {em['MS']['nll']:.3f} with NLL, {em['MS']['-p']:.3f} with -p and "
        f"{em['MS']['-p^10']:.3f} with -p^10; on MW (new task) NLL reaches {em['MW']['nll']:.3f}, -p "
        f"{em['MW']['-p']:.3f} and -p^10 {em['MW']['-p^10']:.3f}; on clean T data NLL {em[CONTROL]['nll']:.3f}, -p "
        f"{em[CONTROL]['-p']:.3f}, -p^10 {em[CONTROL]['-p^10']:.3f} and `auto` {em[CONTROL]['auto']:.3f}.",
        f"Calibration on seeds {cal['seeds']} kept the P20 guard {cal['strong_p20']:g} (correct decisions per guard: "
        + ", ".join(f"{g}: {v}/{cal['cases']}" for g, v in cal["correct"].items())
        + ").",
        "Verdicts: " + ", ".join(f"{k} {'PASS' if c['passed'] else 'FAIL'}" for k, c in checks.items()) + ".",
    ]
    weak = [s for s, r in result["per_seed"].items() if r["pretrain"]["T_eval"]["exact_match"] < 0.95]
    if weak:
        lines.append(
            "Pretraining left seed(s) "
            + ", ".join(weak)
            + " below 0.95 exact match on T ("
            + ", ".join(f"{result['per_seed'][s]['pretrain']['T_eval']['exact_match']:.3f}" for s in weak)
            + "); they are reported as they are."
        )
    return " ".join(lines)


def markdown(result: dict) -> str:
    agg = result["aggregate"]
    probes = agg["probe"]
    out = [
        f"Mean ± std over seeds; clean held-out exact match (EM) and mean teacher-forced p. MS: task T (2-digit "
        f"addition) with 30 % of answer digits wrong; MW: new task T' (answer digits permuted); {CONTROL}: the MS "
        "problems with clean labels. Pretraining EM on T per seed: "
        + ", ".join(f"{s}: {r['pretrain']['T_eval']['exact_match']:.3f}" for s, r in result["per_seed"].items())
        + ".",
    ]
    for part, label in (("report", "Report seeds"), ("calibration", "Calibration seeds")):
        a = agg[part]
        out += [
            "",
            f"## {label} {agg[part + '_seeds']}",
            "",
            f"| objective | MS EM | MS mean p | MW EM | MW mean p | {CONTROL} EM |",
            "|---|---|---|---|---|---|",
        ]
        for arm in ["base", *OBJECTIVES]:
            cells = [fmt(a[s][arm][k]) for s in SETS for k in ("exact_match", "mean_p")]
            clean = fmt(a[CONTROL][arm]["exact_match"]) if arm in a[CONTROL] else "–"
            out.append(f"| {arm if arm != 'base' else 'base (no SFT)'} | " + " | ".join(cells) + f" | {clean} |")
    cal = agg["rule_calibration"]
    out += [
        "",
        "## The `auto` rule",
        "",
        f"Calibration (seeds {cal['seeds']}): correct decisions per P20 guard "
        + ", ".join(f"{g}: {v}/{cal['cases']}" for g, v in cal["correct"].items())
        + f"; kept strong_p20 = {cal['strong_p20']:g}.",
        "",
        "| rule (report seeds) | set | picks per seed | mean EM of picks | best of nll / -p | seeds correct |",
        "|---|---|---|---|---|---|",
    ]
    for key in ("calibrated", "shipped"):
        for name, r in agg[f"{key}_rule_on_report"].items():
            out.append(
                f"| {key} | {name} | {', '.join(r['picks'])} | {r['picked_em']:.3f} | {r['best_em']:.3f} | "
                f"{r['seeds_ok']}/{len(r['picks'])} |"
            )
    out += [
        "",
        "Base-model probe on each SFT set (all seeds; values: mean over seeds):",
        "",
        "| set | base median p | base P20 | auto decision per seed | original rule (P20 ≥ 0.3) |",
        "|---|---|---|---|---|",
    ]
    for name in RULE_SETS:
        out.append(
            f"| {name} | {fmt_probe(probes, name, 'median')} | {fmt_probe(probes, name, 'p20')} | "
            f"{regimes(probes, name)} | {regimes(probes, name, 'decision_with_original_p20_guard')} |"
        )
    out += ["", "## Interpretation", "", interpretation(result)]
    return "\n".join(out)


EXPERIMENT = declare(
    globals(),
    title="E-A1 capability continuum (CPU, tiny model)",
    claim="Prior-leaning SFT objectives (-p, -p^10) are at least as good as NLL where the model is strong and far "
    "worse where it is weak; hf_stable's `auto` rule, calibrated on seeds 0-2, picks well on seeds 3-5 and on clean "
    "high-median data (Beyond Log Likelihood, arXiv 2510.00526).",
    sizes=Config(),
    plot=lambda result, path: plot(
        result["aggregate"]["report"],
        path,
        f"E-A1 capability continuum (report seeds {result['aggregate']['report_seeds']})",
    ),
    config={"objectives": OBJECTIVES, "calibration_seeds": CALIBRATION_SEEDS, "guard_grid": GUARD_GRID},
    default_seeds=(0, 1, 2, 3, 4, 5),
)


if __name__ == "__main__":
    run(EXPERIMENT)
