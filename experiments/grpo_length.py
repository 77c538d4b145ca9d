"""E-G1 length: DRPO, on-policy SFT and ΔL against length-penalised GRPO on answers of varying length.

Claims:
* DRPO (arXiv 2510.04474): a length penalty folded into the reward (GRPO on `r·(1 − λ·L/L_max)`) can give correct
  but long answers a negative advantage; DRPO keeps correct-vs-incorrect and the length preference apart (softmax of
  `r_len/λ` over the correct answers only), so it shortens correct answers without paying in accuracy.
* On-policy SFT (arXiv 2602.13407): SFT on the model's own correct, complete samples with a length budget
  (`max_completion_length` below the natural length; a truncated sample is dropped) pulls the mean length toward the
  budget while accuracy on the training prompts holds.
* ΔL (arXiv 2509.07558): minimum-variance unbiased length weighting of the loss; reported for stability only.

Design.
* Task: addition `a+b=` with a, b ∈ [0, 49] (character tokenizer of `hf_stable.testing`, tiny Llama, hidden 64, 2
  layers, ~90k parameters). The 2500 problems are split once (split seed 1234, independent of the run seed) into 500
  held-out test prompts and a 2000-prompt training pool; a fixed 500-prompt subset of the pool is the "training
  prompts" evaluation set.
* Verbose warm start (per seed, cached under `experiments/cache/grpo_length/`): NLL SFT from a random init on 35,000
  pool rows whose completion is the sum followed by a random-length filler, `" ok ok ok"[:n]` with n uniform in 0..8
  (`"46"`, `"46 ok"`, `"46 ok ok o"`, ...), LR 3e-3, batch 64, linear schedule, warmup 0.1. The model then produces
  correct answers with a tail of 0-8 characters (mean length ≈ 7 tokens; sampled accuracy 0.41 on the pilot seed but
  0.44 / 0.14 / 0.10 on seeds 0 / 1 / 2: this budget sits on the model's sharp SFT learning transition, which was
  only seen in the seed 0-2 runs and left as it was).
* Correctness: the text before the first space equals the sum. Length L: generated tokens including eos (TRL's
  completion length, the loss mask), L_max = 12 = `max_completion_length` (a 2-digit sum + 8 filler + eos is 11).
* Arms, all from the same warm start with `StableGRPOTrainer`, G = 8, 8 prompts/step, temperature 1, β = 0, constant
  LR (chosen in the pilot below, identical for every arm), the same number of steps:
  - `grpo_lp`: TRL's GRPO (default `loss_type`) on the length-penalised reward `correct·(1 − 0.5·L/L_max)`;
  - `drpo`: `loss_mode="drpo"`, correctness reward only, DRPO defaults (λ = 0.1, τ = 10, δ = 1e-4, β = 1e3);
  - `onpolicy_sft`: `loss_mode="onpolicy_sft"`, correctness reward only, budget `max_completion_length` = 5 tokens
    (below the typical ≈ 7; a 2-digit sum fits with at most 2 filler characters), `osft_require_eos=True`;
  - `delta_l`: GRPO + ΔL (`delta_l_alpha=1.0`, `loss_type="dr_grpo"`), correctness reward only.
* Metrics every `eval_every` steps on the test prompts and the training-prompt subset, 4 samples per prompt at
  temperature 1 (the policy the methods optimise; fixed evaluation RNG, shared across arms): accuracy and mean length
  of the correct samples (also the mean length of all samples and the truncated fraction); greedy accuracy at the end.
  Every arm is evaluated with 12 new tokens, whatever its training budget.
* Seeds 0, 1, 2 (warm-start init and data, RL sampling and data order); criteria on seed means, with the number of
  seeds where each holds.
* Pilot (decided before any method run, baseline only): `grpo_lp` on seed 100 (not reported) for 300 steps at LR
  1e-4, 3e-4 and 1e-3, rule fixed beforehand: "the LR with the highest final held-out accuracy". Accuracy /
  correct length from 0.407 / 6.92: 1e-4 → 0.440 / 3.33, 3e-4 → 0.310 / 3.02, 1e-3 → 0.004 / 2.33 (collapse). The
  winner sat at the grid edge, so 3e-5 was added: 0.442 / 4.76, a tie within evaluation noise (±0.011) that barely
  shortens the answers, so LR 1e-4 was kept for every arm. The other arms were only run for 5 steps to check they
  execute; nothing was tuned per method, and nothing was changed after the seed 0-2 runs.

Pass criteria (pre-registered, the papers' claims; printed PASS/FAIL as measured):
  (a) DRPO: final accuracy ≥ final accuracy of `grpo_lp` − 0.02 and final mean correct length ≤ that of `grpo_lp`;
  (b) on-policy SFT: on the training prompts, the mean correct length closes at least half of its initial gap to the
      budget (end − budget ≤ 0.5·(start − budget)) and accuracy ends ≥ its start − 0.05;
  (c) ΔL (stability only): final held-out accuracy ≥ start − 0.05.

Command (measured 535 s wall with a cold cache, i.e. including the three ≈ 30 s warm starts, and 426 s with them
cached, on 2 CPU cores shared with two other jobs; reruns reproduce the numbers exactly):
    OMP_NUM_THREADS=1 .venv/bin/python experiments/grpo_length.py
Pilot: `... --seeds 100 --out /tmp/pilot` with `ARMS = ("grpo_lp",)` and `Sizes.learning_rate` set.
Quick smoke run (< 60 s, 1 seed, tiny sizes; its pass/fail means nothing):
    OMP_NUM_THREADS=1 .venv/bin/python experiments/grpo_length.py --quick --out /tmp/grpo_length_quick
"""

from __future__ import annotations

import functools
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from _harness import declare, fmt, mean_std, run, save_figure, subplots
from testbeds import tiny_trl


NAME = "grpo_length"
ARMS = ("grpo_lp", "drpo", "onpolicy_sft", "delta_l")
LABELS = {
    "grpo_lp": "GRPO, length-penalised reward",
    "drpo": "DRPO",
    "onpolicy_sft": "on-policy SFT (budget 5)",
    "delta_l": "GRPO + ΔL (α = 1)",
}
COLORS = {"grpo_lp": "tab:blue", "drpo": "tab:red", "onpolicy_sft": "tab:green", "delta_l": "tab:purple"}
MAX_OPERAND = 49
FILLER = " ok ok ok"
MAX_FILLER = 8
L_MAX = 12  # max_completion_length of every arm but on-policy SFT
OSFT_BUDGET = 5  # on-policy SFT's max_completion_length
LENGTH_PENALTY = 0.5  # grpo_lp reward: correct * (1 - 0.5 L / L_max)
SPLIT_SEED = 1234
ACC_TOLERANCE = 0.02  # (a)
HOLD_TOLERANCE = 0.05  # (b), (c)
GAP_FRACTION = 0.5  # (b): the gap to the budget must shrink to at most this fraction
PILOT = {
    "seed": 100,
    "steps": 300,
    "arm": "grpo_lp",
    "rule": "highest final held-out sampled accuracy",
    "grid": [1e-4, 3e-4, 1e-3],
    "extension": [3e-5],
    "results": {
        "3e-5": {"accuracy": 0.442, "correct_length": 4.76},
        "1e-4": {"accuracy": 0.440, "correct_length": 3.33},
        "3e-4": {"accuracy": 0.310, "correct_length": 3.02},
        "1e-3": {"accuracy": 0.004, "correct_length": 2.33},
    },
    "start": {"accuracy": 0.407, "correct_length": 6.92},
    "chosen": 1e-4,
    "note": "1e-4 wins the pre-declared grid; the grid edge was extended by 3e-5, which tied (0.442 vs 0.440, eval "
    "noise ±0.011) while barely shortening the answers in 300 steps, so 1e-4 was kept",
}


@dataclass(frozen=True)
class Sizes:
    num_test: int = 500
    num_train_eval: int = 500
    eval_samples: int = 4  # samples per prompt at temperature 1
    warm_examples: int = 35000
    warm_lr: float = 3e-3
    warm_batch: int = 64
    steps: int = 300
    prompts_per_step: int = 8
    num_generations: int = 8
    learning_rate: float = 1e-4
    eval_every: int = 50
    logging_steps: int = 10


QUICK = Sizes(
    num_test=64, num_train_eval=64, eval_samples=2, warm_examples=6000, steps=8, eval_every=4, logging_steps=4
)


# ---------------------------------------------------------------------------------------------------------------------
# task


def prompt_of(a: int, b: int) -> str:
    return f"{a}+{b}="


def split_problems(sizes: Sizes) -> dict[str, list[tuple[int, int]]]:
    """Fixed split (independent of the run seed): test prompts, training pool, training-prompt evaluation subset."""
    test, pool, train_eval = tiny_trl.sum_split(MAX_OPERAND, SPLIT_SEED, sizes.num_test, sizes.num_train_eval)
    return {"test": test, "pool": pool, "train_eval": train_eval}


def verbose_rows(pool, n: int, rng: random.Random) -> list[dict]:
    """Warm-start SFT rows: the sum followed by a filler of 0..MAX_FILLER characters."""
    rows = []
    for _ in range(n):
        a, b = rng.choice(pool)
        rows.append({"prompt": prompt_of(a, b), "completion": str(a + b) + FILLER[: rng.randint(0, MAX_FILLER)]})
    return rows


def rl_rows(pool) -> list[dict]:
    return [{"prompt": prompt_of(a, b), "answer": str(a + b)} for a, b in pool]


def is_correct(text: str, answer: str) -> bool:
    return text.split(" ")[0] == answer


def correctness_reward(completions: list[str], answer: list[str], **kwargs) -> list[float]:
    """1 when the text before the first space is the sum (the filler is free)."""
    return [float(is_correct(c, a)) for c, a in zip(completions, answer, strict=True)]


def length_penalised_reward(completions: list[str], answer: list[str], completion_ids, **kwargs) -> list[float]:
    """`correct · (1 − 0.5·L/L_max)`, L = generated tokens including eos."""
    return [
        float(is_correct(c, a)) * (1 - LENGTH_PENALTY * len(ids) / L_MAX)
        for c, a, ids in zip(completions, answer, completion_ids, strict=True)
    ]


# ---------------------------------------------------------------------------------------------------------------------
# measurements


def generate(model, tokenizer, prompts: list[str], sample: bool, seed: int) -> tuple[list[str], list[int], list[bool]]:
    """Texts, lengths (tokens including eos) and whether each completion was cut at L_MAX tokens."""
    new = tiny_trl.generate_ids(model, tokenizer, prompts, sample, seed, L_MAX)
    eos = tokenizer.eos_token_id
    lengths = [row.index(eos) + 1 if eos in row else len(row) for row in new]
    truncated = [eos not in row for row in new]
    texts = tokenizer.batch_decode([row[:n] for row, n in zip(new, lengths, strict=True)], skip_special_tokens=True)
    return texts, lengths, truncated


def evaluate(model, tokenizer, problems, samples: int, seed: int) -> dict:
    """Sampled (temperature 1) accuracy and lengths over `samples` completions per prompt."""
    prompts = [prompt_of(a, b) for a, b in problems] * samples
    answers = [str(a + b) for a, b in problems] * samples
    texts, lengths, truncated = generate(model, tokenizer, prompts, sample=True, seed=seed)
    correct = [is_correct(t, a) for t, a in zip(texts, answers, strict=True)]
    correct_lengths = [n for n, c in zip(lengths, correct, strict=True) if c]
    return {
        "accuracy": sum(correct) / len(correct),
        "correct_length": statistics.fmean(correct_lengths) if correct_lengths else float("nan"),
        "length": statistics.fmean(lengths),
        "truncated": sum(truncated) / len(truncated),
    }


def greedy_accuracy(model, tokenizer, problems) -> float:
    texts, _, _ = generate(model, tokenizer, [prompt_of(a, b) for a, b in problems], sample=False, seed=0)
    return statistics.fmean(is_correct(t, str(a + b)) for t, (a, b) in zip(texts, problems, strict=True))


def make_eval_callback(tokenizer, split: dict, sizes: Sizes, seed: int):
    """Records test and training-prompt metrics at step 0, every `eval_every` steps and at the end. The evaluation
    RNG depends on (seed, step) only, so every arm sees the same sampling noise at the same step."""

    def measure(step: int, model) -> dict:
        eval_seed = 10_000 * (seed + 1) + step
        return {
            "test": evaluate(model, tokenizer, split["test"], sizes.eval_samples, eval_seed),
            "train": evaluate(model, tokenizer, split["train_eval"], sizes.eval_samples, eval_seed + 5000),
        }

    return tiny_trl.curve_callback(measure, sizes.eval_every)


# ---------------------------------------------------------------------------------------------------------------------
# training


def warm_cache_dir(seed: int, sizes: Sizes) -> Path:
    fields = {k: v for k, v in asdict(sizes).items() if k.startswith("warm") or k == "num_test"}
    spec = {**fields, "max_operand": MAX_OPERAND, "filler": FILLER, "max_filler": MAX_FILLER, "split": SPLIT_SEED}
    return tiny_trl.cache_dir(NAME, "warm", seed, spec)


def warm_start(seed: int, sizes: Sizes, split: dict) -> tuple[Path, bool]:
    """The verbose SFT checkpoint of `seed` (trained once, then loaded from the cache)."""
    path = warm_cache_dir(seed, sizes)
    rows = functools.partial(verbose_rows, split["pool"], sizes.warm_examples, random.Random(seed))
    return tiny_trl.sft_warm_start(path, seed, rows, sizes.warm_lr, sizes.warm_batch)


def arm_config(arm: str, seed: int, sizes: Sizes, output_dir: str):
    extra = {
        "grpo_lp": {},
        "drpo": {"loss_mode": "drpo"},
        "onpolicy_sft": {"loss_mode": "onpolicy_sft", "osft_require_eos": True},
        "delta_l": {"delta_l_alpha": 1.0, "loss_type": "dr_grpo"},
    }[arm]
    return tiny_trl.grpo_config(output_dir, seed, sizes, OSFT_BUDGET if arm == "onpolicy_sft" else L_MAX, **extra)


def train_log(log_history: list[dict]) -> list[dict]:
    keys = (
        "reward",
        "completions/mean_length",
        "completions/clipped_ratio",
        "entropy",
        "stable/grpo/drpo/frac_valid_groups",
        "stable/grpo/onpolicy_sft/kept_frac",
    )
    return [{"step": h["step"], **{k: h[k] for k in keys if k in h}} for h in log_history if "reward" in h]


def run_arm(arm: str, seed: int, sizes: Sizes, warm_path: Path, split: dict) -> dict:
    """One RL arm from a fresh copy of the warm start (from_pretrained: never a deep copy of a trained model)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    from hf_stable import StableGRPOTrainer
    from hf_stable.testing import build_tiny_tokenizer

    start = time.time()
    model, tokenizer = AutoModelForCausalLM.from_pretrained(warm_path), build_tiny_tokenizer()
    callback = make_eval_callback(tokenizer, split, sizes, seed)
    reward = length_penalised_reward if arm == "grpo_lp" else correctness_reward
    with tempfile.TemporaryDirectory() as tmp:
        trainer = StableGRPOTrainer(
            model=model,
            reward_funcs=[reward],
            args=arm_config(arm, seed, sizes, tmp),
            train_dataset=Dataset.from_list(rl_rows(split["pool"])),
            processing_class=tokenizer,
            callbacks=[callback],
        )
        tiny_trl.fit(trainer)
    first, last = callback.points[0], callback.points[-1]
    result = {
        "start": {"test": first["test"], "train": first["train"]},
        "end": {"test": last["test"], "train": last["train"]},
        "greedy_accuracy": greedy_accuracy(model, tokenizer, split["test"]),
        "curve": callback.points,
        "train_log": train_log(trainer.state.log_history),
        "steps": trainer.state.global_step,
        "seconds": time.time() - start,
    }
    end = last["test"]
    print(
        f"[seed {seed}] {arm:13s} acc {first['test']['accuracy']:.3f} -> {end['accuracy']:.3f}  correct length "
        f"{first['test']['correct_length']:.2f} -> {end['correct_length']:.2f}  train acc "
        f"{last['train']['accuracy']:.3f}  ({result['seconds']:.0f}s)",
        flush=True,
    )
    return result


def run_seed(seed: int, sizes: Sizes, arms: list[str]) -> dict:
    from transformers import AutoModelForCausalLM

    from hf_stable.testing import build_tiny_tokenizer

    split = split_problems(sizes)
    warm_path, cached = warm_start(seed, sizes, split)
    greedy = greedy_accuracy(AutoModelForCausalLM.from_pretrained(warm_path), build_tiny_tokenizer(), split["test"])
    return {
        "warm_cached": cached,
        "warm_greedy_accuracy": greedy,
        "arms": {arm: run_arm(arm, seed, sizes, warm_path, split) for arm in arms},
    }


# ---------------------------------------------------------------------------------------------------------------------
# aggregation, criteria, outputs


def metric(run: dict, when: str, split: str, key: str) -> float:
    return run[when][split][key]


def aggregate(per_seed: dict, arms: list[str]) -> dict:
    seeds = list(per_seed)
    first = per_seed[seeds[0]]["arms"][arms[0]]
    out = {
        "start": {
            f"{split}_{key}": mean_std([metric(per_seed[s]["arms"][arms[0]], "start", split, key) for s in seeds])
            for split in first["start"]
            for key in first["start"][split]
        },
        "arms": {},
    }
    out["start"]["greedy_accuracy"] = mean_std([per_seed[s]["warm_greedy_accuracy"] for s in seeds])
    for arm in arms:
        runs = [per_seed[s]["arms"][arm] for s in seeds]
        summary = {
            f"{split}_{key}": mean_std([metric(r, "end", split, key) for r in runs])
            for split in first["end"]
            for key in first["end"][split]
        }
        summary["greedy_accuracy"] = mean_std([r["greedy_accuracy"] for r in runs])
        summary["curve"] = mean_curve([r["curve"] for r in runs])
        out["arms"][arm] = summary
    return out


def mean_curve(curves: list[list[dict]]) -> dict:
    """Seed means at each evaluated step (all seeds evaluate the same steps)."""
    steps = [p["step"] for p in curves[0]]
    out = {"step": steps}
    for split in ("test", "train"):
        for key in ("accuracy", "correct_length", "length"):
            out[f"{split}_{key}"] = [statistics.fmean(c[i][split][key] for c in curves) for i in range(len(steps))]
    return out


def criteria(per_seed: dict, agg: dict, arms: list[str]) -> dict:
    seeds, checks = list(per_seed), {}

    def count(rule) -> str:
        return f"{sum(rule(per_seed[s]['arms']) for s in seeds)}/{len(seeds)} seeds"

    def rule_a(runs) -> bool:
        d, g = runs["drpo"]["end"]["test"], runs["grpo_lp"]["end"]["test"]
        return d["accuracy"] >= g["accuracy"] - ACC_TOLERANCE and d["correct_length"] <= g["correct_length"]

    def rule_b(runs) -> bool:
        r = runs["onpolicy_sft"]
        s, e = r["start"]["train"], r["end"]["train"]
        return (
            e["correct_length"] - OSFT_BUDGET <= GAP_FRACTION * (s["correct_length"] - OSFT_BUDGET)
            and e["accuracy"] >= s["accuracy"] - HOLD_TOLERANCE
        )

    def rule_c(runs) -> bool:
        r = runs["delta_l"]
        return r["end"]["test"]["accuracy"] >= r["start"]["test"]["accuracy"] - HOLD_TOLERANCE

    a, start = agg["arms"], agg["start"]
    if {"drpo", "grpo_lp"} <= set(arms):
        acc, length = (
            (a["drpo"]["test_accuracy"]["mean"], a["grpo_lp"]["test_accuracy"]["mean"]),
            (a["drpo"]["test_correct_length"]["mean"], a["grpo_lp"]["test_correct_length"]["mean"]),
        )
        checks["a"] = {
            "criterion": f"DRPO acc ≥ GRPO-LP acc − {ACC_TOLERANCE} and DRPO correct length ≤ GRPO-LP's",
            "values": {"drpo_acc": acc[0], "grpo_lp_acc": acc[1], "drpo_len": length[0], "grpo_lp_len": length[1]},
            "passed": acc[0] >= acc[1] - ACC_TOLERANCE and length[0] <= length[1],
            "per_seed": count(rule_a),
        }
    if "onpolicy_sft" in arms:
        s_len, e_len = start["train_correct_length"]["mean"], a["onpolicy_sft"]["train_correct_length"]["mean"]
        s_acc, e_acc = start["train_accuracy"]["mean"], a["onpolicy_sft"]["train_accuracy"]["mean"]
        checks["b"] = {
            "criterion": f"on-policy SFT (training prompts): end length − {OSFT_BUDGET} ≤ {GAP_FRACTION}"
            f"·(start length − {OSFT_BUDGET}) and acc ≥ start − {HOLD_TOLERANCE}",
            "values": {"start_len": s_len, "end_len": e_len, "start_acc": s_acc, "end_acc": e_acc},
            "passed": (
                e_len - OSFT_BUDGET <= GAP_FRACTION * (s_len - OSFT_BUDGET) and e_acc >= s_acc - HOLD_TOLERANCE
            ),
            "per_seed": count(rule_b),
        }
    if "delta_l" in arms:
        s_acc, e_acc = start["test_accuracy"]["mean"], a["delta_l"]["test_accuracy"]["mean"]
        checks["c"] = {
            "criterion": f"ΔL (stability): held-out acc ≥ start − {HOLD_TOLERANCE}",
            "values": {"start_acc": s_acc, "end_acc": e_acc},
            "passed": e_acc >= s_acc - HOLD_TOLERANCE,
            "per_seed": count(rule_c),
        }
    return checks


def plot(per_seed: dict, agg: dict, path: Path) -> None:
    fig, axes = subplots(1, 3, figsize=(17, 4.8))
    start = agg["start"]
    ax = axes[0]
    ax.scatter(
        [start["test_correct_length"]["mean"]],
        [start["test_accuracy"]["mean"]],
        marker="*",
        s=220,
        color="black",
        label="warm start (small: seeds)",
        zorder=5,
    )
    ax.scatter(
        start["test_correct_length"]["values"],
        start["test_accuracy"]["values"],
        marker="*",
        s=60,
        color="black",
        alpha=0.6,
    )
    for arm, summary in agg["arms"].items():
        curve = summary["curve"]
        ax.plot(curve["test_correct_length"], curve["test_accuracy"], color=COLORS[arm], alpha=0.5)
        ax.scatter(
            [summary["test_correct_length"]["mean"]],
            [summary["test_accuracy"]["mean"]],
            s=110,
            color=COLORS[arm],
            label=LABELS[arm],
            zorder=4,
            edgecolor="black",
        )
        ax.scatter(
            summary["test_correct_length"]["values"],
            summary["test_accuracy"]["values"],
            s=22,
            color=COLORS[arm],
            alpha=0.6,
        )
    ax.set(
        title="held-out accuracy vs correct length\n(line: seed-mean trajectory; small: seeds)",
        xlabel="mean length of correct completions (tokens incl. eos)",
        ylabel="sampled accuracy (T = 1)",
    )
    ax.legend(fontsize=8)
    for ax, key, title in (
        (axes[1], "accuracy", "sampled accuracy"),
        (axes[2], "correct_length", "mean correct length"),
    ):
        for arm, summary in agg["arms"].items():
            curve = summary["curve"]
            ax.plot(curve["step"], curve[f"test_{key}"], color=COLORS[arm], label=f"{LABELS[arm]} (held-out)")
            ax.plot(curve["step"], curve[f"train_{key}"], color=COLORS[arm], linestyle=":", alpha=0.8)
        ax.set(title=f"{title}\n(solid: held-out, dotted: training prompts)", xlabel="RL step")
    axes[2].axhline(OSFT_BUDGET, color="gray", linestyle="--", label=f"on-policy SFT budget ({OSFT_BUDGET})")
    axes[2].legend(fontsize=8)
    fig.suptitle("E-G1: length control on a verbose tiny model (mean over seeds)")
    save_figure(fig, path, dpi=120)


def interpretation(agg: dict, checks: dict) -> str:
    """Sentences generated from the measured numbers (a rerun cannot leave a stale interpretation)."""
    a, start = agg["arms"], agg["start"]
    parts = [
        f"From the warm start (held-out sampled accuracy {start['test_accuracy']['mean']:.3f}, correct answers "
        f"{start['test_correct_length']['mean']:.2f} tokens long) the arms end at "
        + "; ".join(
            f"{LABELS[arm]} {s['test_accuracy']['mean']:.3f} / {s['test_correct_length']['mean']:.2f}"
            for arm, s in a.items()
        )
        + " (accuracy / correct length)."
    ]
    if "a" in checks:
        v = checks["a"]["values"]
        verdict = "PASS" if checks["a"]["passed"] else "FAIL"
        parts.append(
            f"DRPO vs length-penalised GRPO: accuracy {v['drpo_acc'] - v['grpo_lp_acc']:+.3f}, correct "
            f"length {v['drpo_len'] - v['grpo_lp_len']:+.2f} tokens ({verdict}, {checks['a']['per_seed']})."
        )
    if "b" in checks:
        v = checks["b"]["values"]
        parts.append(
            f"On-policy SFT moved the training-prompt correct length from {v['start_len']:.2f} to "
            f"{v['end_len']:.2f} (budget {OSFT_BUDGET}) with accuracy {v['start_acc']:.3f} → "
            f"{v['end_acc']:.3f} ({'PASS' if checks['b']['passed'] else 'FAIL'}, {checks['b']['per_seed']})."
        )
    if "delta_l" in a:
        d = a["delta_l"]
        parts.append(
            f"GRPO + ΔL on the correctness reward alone has no length preference and kept the correct length "
            f"near its start ({d['test_correct_length']['mean']:.2f} vs "
            f"{start['test_correct_length']['mean']:.2f}) with accuracy "
            f"{d['test_accuracy']['mean']:.3f} vs {start['test_accuracy']['mean']:.3f} at the start."
        )
    seeds = ", ".join(f"{x:.3f}" for x in start["test_accuracy"]["values"])
    moved = max(abs(x["test_accuracy"]["mean"] - start["test_accuracy"]["mean"]) for x in a.values())
    parts.append(
        f"Caveat: the warm-start accuracy differs between seeds ({seeds}; the tiny model's SFT learning "
        f"transition falls near the fixed warm-start budget) and no arm moved the mean held-out accuracy by "
        f"more than {moved:.3f}, so the accuracy halves of the criteria test preservation, not gains."
    )
    return " ".join(parts)


def markdown(result: dict) -> str:
    agg, checks, cfg = result["aggregate"], result["criteria"], result["config"]
    sizes = cfg["sizes"]
    lines = [
        f"Mean ± std over seeds. {sizes['steps']} RL steps × {sizes['prompts_per_step']} "
        f"prompts × G = {sizes['num_generations']}, LR {sizes['learning_rate']:g} (constant, chosen on the baseline "
        f"in a pilot), temperature 1, L_max = {L_MAX}; on-policy SFT budget {OSFT_BUDGET} tokens. Accuracy: sampled "
        f"(T = 1, {sizes['eval_samples']} per prompt) on {sizes['num_test']} held-out prompts (training prompts: "
        f"{sizes['num_train_eval']}); lengths in tokens including eos, evaluated with {L_MAX} new tokens for every "
        "arm.",
        "",
        "| model | held-out acc | correct length | all lengths | truncated | train-prompt acc | train correct length "
        "| greedy acc |",
        "|---|---|---|---|---|---|---|---|",
    ]
    s = agg["start"]
    lines.append(
        f"| warm start | {fmt(s['test_accuracy'])} | {fmt(s['test_correct_length'], 2)} | "
        f"{fmt(s['test_length'], 2)} | {fmt(s['test_truncated'])} | {fmt(s['train_accuracy'])} | "
        f"{fmt(s['train_correct_length'], 2)} | {fmt(s['greedy_accuracy'])} |"
    )
    for arm, a in agg["arms"].items():
        lines.append(
            f"| {LABELS[arm]} | {fmt(a['test_accuracy'])} | {fmt(a['test_correct_length'], 2)} | "
            f"{fmt(a['test_length'], 2)} | {fmt(a['test_truncated'])} | {fmt(a['train_accuracy'])} | "
            f"{fmt(a['train_correct_length'], 2)} | {fmt(a['greedy_accuracy'])} |"
        )
    pilot = cfg["pilot"]
    lines += [
        "",
        "## Interpretation",
        "",
        interpretation(agg, checks),
        "",
        f"Pilot (baseline only, seed {pilot['seed']}, {pilot['steps']} steps, not reported above), final "
        "held-out accuracy / correct length by LR: "
        + ", ".join(f"{lr}: {v['accuracy']:.3f} / {v['correct_length']:.2f}" for lr, v in pilot["results"].items())
        + f"; chosen LR {pilot['chosen']:g} ({pilot['note']}).",
    ]
    return "\n".join(lines)


EXPERIMENT = declare(
    globals(),
    title="E-G1: DRPO, on-policy SFT and ΔL vs length-penalised GRPO",
    claim="DRPO and on-policy SFT shorten correct answers without losing accuracy; ΔL keeps training stable "
    "(arXiv 2510.04474, 2602.13407, 2509.07558).",
    run_seed=lambda seed, sizes: run_seed(seed, sizes, list(ARMS)),
    aggregate=lambda per_seed, sizes: aggregate(per_seed, list(ARMS)),
    criteria=lambda per_seed, agg, sizes: criteria(per_seed, agg, list(ARMS)),
    plot=lambda result, path: plot(result["per_seed"], result["aggregate"], path),
    config={
        "arms": list(ARMS),
        "max_operand": MAX_OPERAND,
        "filler": FILLER,
        "max_filler": MAX_FILLER,
        "l_max": L_MAX,
        "osft_budget": OSFT_BUDGET,
        "length_penalty": LENGTH_PENALTY,
        "split_seed": SPLIT_SEED,
        "drpo": {"lambda": 0.1, "tau": 10.0, "delta": 1e-4, "beta": 1e3, "neg_weighting": "softmax_old"},
        "delta_l": {"alpha": 1.0, "loss_type": "dr_grpo", "scope": "batch"},
        "grpo_lp_loss_type": "dapo (TRL default)",
        "pilot": PILOT,
    },
)


if __name__ == "__main__":
    run(EXPERIMENT)
