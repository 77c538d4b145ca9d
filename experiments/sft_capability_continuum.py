"""E-A1 "capability continuum": which per-token SFT objective wins depends on the base model's prior.

Claim (Li et al., "Beyond Log Likelihood", arXiv 2510.00526; spec `sft_and_adapters.md` §2.1.7): prior-leaning
objectives (-p, -p^10, which weight each token's NLL gradient by p^α) are at least as good as NLL when the model is
already strong on the SFT task (model-strong, MS), and far worse when the task is new to it (model-weak, MW).

Design (CPU, random-init tiny Llama from `hf_stable.testing.build_tiny_model`, char-level tokenizer):

* Task T: 2-digit addition ``"a+b="`` -> ``"a+b"``. Per seed, the 10^4 problems are shuffled; ``n_eval`` of them are
  held out from *all* training (pretraining and SFT) and form the clean evaluation sets.
* "Pretraining": NLL SFT of the random-init model on T (2000 steps x 64, LR 3e-3 cosine), cached per seed under
  ``--cache_dir``.
* SFT sets (completion-only, one epoch of 150 steps x 64 rows, identical LR/steps/batch/optimiser for every objective):
  - MS: task T with ``noise_rate`` (30 %) of the answer digits replaced by a *different* random digit;
  - MW: task T' = T's answer passed digit by digit through a fixed random derangement of 0-9 (one per seed; every
    digit changes, so the base model's greedy answer is never right).
* Objectives: ``nll``; ``prob_power`` α=1 ("-p") and α=10 ("-p^10"); ``threshold`` ``top_p`` at the base model's
  P20 (``threshold_quantile=0.2``, probed on the SFT set); and ``auto`` (hf_stable's rule; its probe stats and
  decision come from ``objective_probe.json``).
* Metrics: greedy exact match and mean teacher-forced p (``evaluate_completions``) on the clean held-out set of the
  SFT task (T for MS, T' for MW); relative parameter change ||θ-θ0||/||θ0||; base-model probe stats per set.
* Seeds 0, 1, 2 (model init, problem split, noise, permutation, data order); mean ± std (ddof=1) over seeds.

Design choices fixed before the final comparison: 2-digit (not 3-digit) addition so pretraining takes < 1 min per
seed; noisy digits always differ from the true digit (so 30 % of digits are wrong; under uniform noise the correct
digit stays the per-position mode, so NLL's greedy answer is not expected to collapse); SFT LR 1e-3 with cosine
schedule, 10 % warmup, AdamW betas (0.9, 0.95), weight decay 0.01, clip 1.0 (the reference recipe's optimiser); SFT
length chosen from an NLL-only pilot on MW, seed 0 (75 steps: EM 0.23; 150 steps: EM 0.63; 150 kept). No
objective-specific tuning. The pretraining budget was fixed in advance and not changed after seed 1 reached only
0.79 exact match on T (seeds 0 and 2: > 0.99); that seed is reported as is.

Post-hoc diagnostics, added after the first full run and outside the criterion (the primary numbers reproduced
exactly): a clean-label control (the MS problems without noise, NLL and -p^10), the mean grad norm per arm, and the
`auto` decision the spec's original rule would take with its P20 guard (``strong_p20=0.3``). The first full run used
that guard as the default; it called the noisy MS set "intermediate" on every seed although -p beat NLL there, so
hf_stable's default became ``strong_p20=0`` (an in-sample recalibration, as the spec asked of this experiment).

Pass criterion (means over seeds, stated in advance):
  MS: EM(-p) >= EM(nll) - 0.02 and EM(-p^10) >= EM(nll) - 0.02;
  MW: EM(nll) - EM(-p^10) >= 0.2.

Command (measured 5 min 42 s on one shared core with a cold cache, i.e. including pretraining):
  OMP_NUM_THREADS=1 .venv/bin/python experiments/sft_capability_continuum.py
Smoke test (< 60 s): ``... --quick --output_dir /tmp/e_a1``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import random
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch


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
CONTROL_ARMS = ("nll", "-p^10")
MARGIN_MS = 0.02
SPEC_P20_GUARD = {"strong_p20": 0.3}  # the spec's original rule, before this experiment recalibrated it
GAP_MW = 0.2


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
    from hf_stable import StableSFTConfig

    return StableSFTConfig(
        output_dir=output_dir, seed=seed, max_steps=steps, per_device_train_batch_size=batch, learning_rate=lr,
        lr_scheduler_type="cosine", warmup_steps=0.1, adam_beta2=0.95, weight_decay=0.01, max_grad_norm=1.0,
        max_length=cfg.max_length, auto_probe_batches=cfg.probe_batches, logging_steps=max(steps // 10, 1),
        use_cpu=True, bf16=False, gradient_checkpointing=False, report_to="none", save_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0, **objective,
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


def run_seed(seed: int, cfg: Config, cache_dir: Path) -> dict:
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
            print(f"[seed {seed}] {name} {arm:>10}: EM {arms[arm]['exact_match']:.3f} "
                  f"mean_p {arms[arm]['mean_p']:.3f} ({arms[arm]['wall_s']} s)", flush=True)
        out["sets"][name] = arms
    control = sets[CONTROL]
    out["control"] = {arm: run_arm(base, base_path, tokenizer, seed, cfg, control, OBJECTIVES[arm])
                      for arm in CONTROL_ARMS}
    print(f"[seed {seed}] {CONTROL} control (no noise): "
          + ", ".join(f"{arm} EM {r['exact_match']:.3f}" for arm, r in out["control"].items()), flush=True)
    return out


# ---------------------------------------------------------------------------------------------------------------
# analysis and reporting


def mean_std(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "values": values}


def aggregate(per_seed: dict) -> dict:
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


def probe_summary(per_seed: dict) -> dict:
    """Base-model probe stats (from the `auto` arm), the auto decision and the resolved P20 threshold, per set; and,
    for calibration, the decision of the spec's original rule with its P20 guard (`strong_p20=0.3`)."""
    from hf_stable.losses.sft import choose_objective

    summary = {}
    for name in SETS:
        rows = {}
        for seed, res in per_seed.items():
            arms = res["sets"][name]
            auto = arms["auto"]["probe"]
            stats = auto["stats"]
            rows[seed] = {
                "median": stats["median"], "p20": stats["p20"], "p10": stats["p10"], "mean": stats["mean"],
                "frac_p_gt_0.5": stats["frac_p_gt_0.5"], "num_tokens": stats["num_tokens"],
                "decision": auto["decision"], "threshold_p20": arms["top_p@P20"]["probe"]["threshold"],
                "decision_with_spec_p20_guard": choose_objective(stats, SPEC_P20_GUARD),
            }
        summary[name] = {"per_seed": rows, "decisions": sorted({r["decision"]["regime"] for r in rows.values()})}
    return summary


CHECKS = {  # name -> (set, arm a, arm b, threshold): passes when EM(a) - EM(b) >= threshold
    f"MS: EM(-p) >= EM(nll) - {MARGIN_MS}": ("MS", "-p", "nll", -MARGIN_MS),
    f"MS: EM(-p^10) >= EM(nll) - {MARGIN_MS}": ("MS", "-p^10", "nll", -MARGIN_MS),
    f"MW: EM(nll) - EM(-p^10) >= {GAP_MW}": ("MW", "nll", "-p^10", GAP_MW),
}


def criteria(agg: dict) -> dict:
    """The pre-stated criterion on the means over seeds (the verdict), and how many seeds meet it on their own."""
    checks, per_seed = {}, {}
    for text, (name, a, b, threshold) in CHECKS.items():
        em_a, em_b = agg[name][a]["exact_match"]["values"], agg[name][b]["exact_match"]["values"]
        checks[text] = statistics.fmean(em_a) - statistics.fmean(em_b) >= threshold
        per_seed[text] = f"{sum(x - y >= threshold for x, y in zip(em_a, em_b, strict=True))}/{len(em_a)}"
    parts = {name: all(ok for text, ok in checks.items() if text.startswith(name)) for name in SETS}
    return {"checks": checks, "seeds_meeting_check": per_seed, "parts": parts, "all": all(parts.values())}


def plot(agg: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(OBJECTIVES)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    for ax, name in zip(axes, SETS, strict=True):
        means = [agg[name][a]["exact_match"]["mean"] for a in arms]
        stds = [agg[name][a]["exact_match"]["std"] for a in arms]
        ax.bar(arms, means, yerr=stds, capsize=4, color=["C0", "C1", "C2", "C3", "C7"], alpha=0.85)
        for i, arm in enumerate(arms):  # one dot per seed: the spread is mostly one seed, not noise around a mean
            values = agg[name][arm]["exact_match"]["values"]
            offsets = [0.0] if len(values) == 1 else [-0.2 + 0.4 * k / (len(values) - 1) for k in range(len(values))]
            ax.scatter([i + o for o in offsets], values, s=14, color="k", zorder=3,
                       label="per seed" if i == 0 else None)
        ax.axhline(agg[name]["base"]["exact_match"]["mean"], color="k", ls="--", lw=1, label="base (before SFT)")
        label = "MS: noisy T (eval clean T)" if name == "MS" else "MW: new task T' (eval T')"
        ax.set_title(label)
        ax.set_ylim(0, 1.1)
        ax.tick_params(axis="x", rotation=20)
    axes[1].legend(loc="upper right", fontsize=8)
    axes[0].set_ylabel("clean held-out exact match\n(bar: mean ± std over seeds)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def fmt(ms: dict) -> str:
    return f"{ms['mean']:.3f} ± {ms['std']:.3f}"


def seed_values(probes: dict, name: str, key: str) -> list[float]:
    return [r[key] for r in probes[name]["per_seed"].values()]


def fmt_probe(probes: dict, name: str, key: str) -> str:
    return f"{statistics.fmean(seed_values(probes, name, key)):.3g}"


def regimes(probes: dict, name: str, key: str = "decision") -> str:
    return ", ".join(f"{r[key]['regime']} ({r[key]['sft_objective']})" for r in probes[name]["per_seed"].values())


def interpretation(result: dict) -> str:
    agg, probes, crit = result["aggregate"], result["probe"], result["criteria"]
    em = {s: {a: agg[s][a]["exact_match"]["mean"] for a in agg[s]} for s in (*SETS, CONTROL)}
    mp = {s: {a: agg[s][a]["mean_p"]["mean"] for a in agg[s]} for s in (*SETS, CONTROL)}
    lines = [
        f"On MS (noisy labels for a known task) clean exact match goes from {em['MS']['base']:.3f} (base) to "
        f"{em['MS']['nll']:.3f} with NLL, {em['MS']['-p']:.3f} with -p and {em['MS']['-p^10']:.3f} with -p^10 "
        f"(clean-answer mean p {mp['MS']['nll']:.3f} / {mp['MS']['-p']:.3f} / {mp['MS']['-p^10']:.3f}); on MW (new "
        f"task) NLL reaches {em['MW']['nll']:.3f} while -p reaches {em['MW']['-p']:.3f} and -p^10 "
        f"{em['MW']['-p^10']:.3f}.",
        f"Pre-stated criterion on the seed means: MS {'PASS' if crit['parts']['MS'] else 'FAIL'}, MW "
        f"{'PASS' if crit['parts']['MW'] else 'FAIL'} (seeds meeting each check on their own: "
        f"{', '.join(crit['seeds_meeting_check'].values())}).",
    ]
    weak = [s for s, r in result["per_seed"].items() if r["pretrain"]["T_eval"]["exact_match"] < 0.95]
    for seed in weak:
        run = result["per_seed"][seed]
        ms = {a: run["sets"]["MS"][a]["exact_match"] for a in ("nll", "-p", "-p^10")}
        ctl = {a: run["control"][a]["exact_match"] for a in CONTROL_ARMS}
        lines.append(
            f"Pretraining left seed {seed} at {run['pretrain']['T_eval']['exact_match']:.3f} exact match on T; on its "
            f"MS set NLL / -p / -p^10 end at {ms['nll']:.3f} / {ms['-p']:.3f} / {ms['-p^10']:.3f}, and with clean "
            f"labels (control) NLL ends at {ctl['nll']:.3f} and -p^10 at {ctl['-p^10']:.3f}."
        )
    lines.append(
        f"`auto` chose {regimes(probes, 'MS')} on MS and {regimes(probes, 'MW')} on MW. The spec's original rule, "
        f"which also asked P20 >= 0.3, would have chosen {regimes(probes, 'MS', 'decision_with_spec_p20_guard')} on "
        f"MS: the noisy digits put its base-model P20 at {fmt_probe(probes, 'MS', 'p20')} although the median is "
        f"{fmt_probe(probes, 'MS', 'median')}."
    )
    return " ".join(lines)


def markdown(result: dict) -> str:
    agg, probes, crit = result["aggregate"], result["probe"], result["criteria"]
    seeds = result["config"]["seeds"]
    out = [
        "# E-A1 capability continuum (CPU, tiny model)", "",
        f"Seeds {seeds}; mean ± std over seeds; clean held-out exact match (EM) and mean teacher-forced p. MS: task T "
        "(2-digit addition) with 30 % of answer digits wrong; MW: new task T' (answer digits permuted). Pretraining "
        "EM on T per seed: " + ", ".join(f"{r['pretrain']['T_eval']['exact_match']:.3f}"
                                          for r in result["per_seed"].values()) + ".", "",
        "| objective | MS EM | MS mean p | MW EM | MW mean p |", "|---|---|---|---|---|",
    ]
    for arm in ["base", *OBJECTIVES]:
        cells = [fmt(agg[s][arm][k]) for s in SETS for k in ("exact_match", "mean_p")]
        out.append(f"| {arm if arm != 'base' else 'base (no SFT)'} | " + " | ".join(cells) + " |")
    out += ["", "Base-model probe on each SFT set (values: mean over seeds):", "",
            "| set | base median p | base P20 | P20 threshold | auto decision per seed | spec rule (P20 ≥ 0.3) |",
            "|---|---|---|---|---|---|"]
    for name in SETS:
        out.append(f"| {name} | {fmt_probe(probes, name, 'median')} | {fmt_probe(probes, name, 'p20')} | "
                   f"{fmt_probe(probes, name, 'threshold_p20')} | {regimes(probes, name)} | "
                   f"{regimes(probes, name, 'decision_with_spec_p20_guard')} |")
    control = ", ".join(f"{arm} EM {fmt(agg[CONTROL][arm]['exact_match'])}" for arm in CONTROL_ARMS)
    out += ["", f"Post-hoc control (MS problems, clean labels; not part of the criterion): {control}.", "",
            "Pass criterion (means over seeds; seeds meeting the check on their own in brackets):", ""]
    out += [f"- {'PASS' if ok else 'FAIL'}: `{text}` ({crit['seeds_meeting_check'][text]} seeds)"
            for text, ok in crit["checks"].items()]
    out += ["", interpretation(result), "", "Rerun:", "", f"```\n{result['command']}\n```", ""]
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------------------------
# main


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output_dir", default=str(HERE / "results"))
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="default: 0 1 2 (quick: 0)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes and one seed (smoke test, < 60 s)")
    parser.add_argument("--cache_dir", default=str(HERE / "cache"), help="pretrained checkpoints per seed")
    return parser.parse_args(argv)


def quiet() -> None:
    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    logging.getLogger("hf_stable").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", message=".*sft_objective='auto'.*")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main(argv=None) -> dict:
    args = parse_args(argv)
    cfg = QUICK if args.quick else Config()
    seeds = args.seeds if args.seeds is not None else ([0] if args.quick else [0, 1, 2])
    quiet()
    start = time.time()
    per_seed = {seed: run_seed(seed, cfg, Path(args.cache_dir)) for seed in seeds}
    agg = aggregate(per_seed)
    probes = probe_summary(per_seed)
    crit = criteria(agg)
    command = "OMP_NUM_THREADS=1 .venv/bin/python experiments/sft_capability_continuum.py " + " ".join(
        sys.argv[1:] if argv is None else argv)
    result = {
        "experiment": "E-A1 capability continuum",
        "config": {**asdict(cfg), "quick": args.quick, "seeds": seeds, "objectives": OBJECTIVES,
                   "torch_threads": torch.get_num_threads()},
        "per_seed": {str(s): r for s, r in per_seed.items()},
        "aggregate": agg,
        "probe": probes,
        "criteria": crit,
        "wall_s": round(time.time() - start, 1),
        "command": command.strip(),
    }
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{NAME}.json").write_text(json.dumps(result, indent=2, default=str))
    plot(agg, out / f"{NAME}.png", f"E-A1 capability continuum (seeds {seeds})")
    (out / f"{NAME}.md").write_text(markdown(result))
    for text, ok in crit["checks"].items():
        print(f"{'PASS' if ok else 'FAIL'}: {text}")
    print(f"wall time {result['wall_s']} s; results in {out}")
    return result


if __name__ == "__main__":
    main()
