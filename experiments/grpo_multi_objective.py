"""E-G2 multi-objective: DVAO, CTWA, hypervolume and gradient reward weighting against a static weighted sum.

Claims: with several rewards, adapting how they are combined beats a fixed weighted sum
(TRL's `sum_then_normalize` with static `reward_weights`):
* DVAO (arXiv 2605.25604): per-group weights proportional to each objective's in-group std; conflicting
  objectives damp the update instead of being renormalised to unit scale; a better Pareto front than RC/AC;
* CTWA (arXiv 2602.06869): raise the weight of an objective whose reward does not covary with the training
  signal, so every objective improves (no cross-objective interference);
* dynamic reward weighting (arXiv 2509.11452): hypervolume-guided advantage multiplier, and gradient-based
  mirror ascent on the weights; Pareto-dominant solutions compared with fixed-weight scalarisation.

Design.
* Task: addition `a+b=` → `a+b` with a, b ∈ [0, 49] (`hf_stable.testing` character tokenizer, tiny Llama, hidden 64,
  2 layers). The 2500 problems are split once (split seed 1234, independent of the run seed) into 500 held-out test
  prompts, a 2000-prompt training pool and, inside the pool, a fixed 32-prompt validation set (hypervolume only).
* Warm start (one, shared by all seeds: `WARM_SEED` = 0; cached under
  `experiments/cache/grpo_multi_objective/`): NLL SFT from a random init on 64,000 pool rows (1000 steps), LR 3e-3,
  batch 64, linear schedule, warmup 0.1. Sampled correctness 0.74 on the pilot seed's warm start, 0.49 on the
  shared one (seed 0): room to improve, mixed groups.
* Two conflicting rewards: (1) correctness, `hf_stable.testing.arithmetic_reward` (exact match); (2) "even
  ending": 1 when the completion's last character is an even digit. On the half of the prompts whose sum is odd, a
  correct answer scores 0 on (2) and an answer that scores on (2) is wrong; on even sums both agree. So no policy
  exceeds correctness + even ≈ 1.5, and improving one objective on odd prompts costs the other.
* Arms, all from the same warm start with `StableGRPOTrainer`, base weights [1, 1], G = 8, 8 prompts/step,
  temperature 1, β = 0, `max_completion_length` 4, constant LR 1e-4 (chosen in the pilot on the static arm only,
  identical for every arm), 200 steps:
  - `static`: `advantage_estimator="grpo"`, `reward_weighting="static"` (TRL's weighted sum, group z-score);
  - `dvao`: `advantage_estimator="dvao"` (γ = 1);
  - `ctwa`: `reward_weighting="ctwa"`, package defaults (correlation targets 1/sqrt(K) = 0.707 per objective,
    `ctwa_lambda_lr` 0.05, EMA 0.1; until the stored result was regenerated the defaults were raw covariance targets
    0.1, under which the weights never moved and the arm reproduced the static runs exactly);
  - `hypervolume`: `reward_weighting="hypervolume"`, `drw_val_size=32` (the validation set above), evaluated after
    every step; the multiplier `0.5 + 1.5 tanh(HVC)` scales the advantages;
  - `gradient`: `reward_weighting="gradient"`, mirror-ascent step `lr·s/μ` with `drw_regularization` μ = 0.05 so
    that the step is ≈ 0.1 (0.11) at LR 1e-4 for the median |influence score| (56.7) of its first 10 steps on the
    pilot seed (the package default μ = 1e-5 would give steps of ≈ 570: one-hot weights after one update); the
    weights update every 2 steps (`drw_every_n_steps=2`, a cost gate the paper's method allows). The scores are
    inner products over the package's default `drw_target_params` (since the regeneration, the last transformer
    block's parameters; every parameter when μ was calibrated), so the same μ now gives smaller steps (first
    logged scores ≈ 6-30 instead of ≈ 57); μ is kept as pre-registered.
* Later arms (added with their methods, criteria written here before their first run, same warm start, seeds and
  LR as the others):
  - `pama`: `reward_weighting="pama"` at its defaults (He & Maghsudi, arXiv 2508.07768; weights reconstructed);
  - `upgrad`, `aligned_mtl`: `gradient_aggregation="upgrad"` / `"aligned_mtl"` (Jacobian descent, arXiv 2406.16232;
    Aligned-MTL, arXiv 2305.19000): one policy gradient per reward, aggregated so that neither is opposed.
  Each has its own criterion, the one below applied to that arm alone; criterion (a) keeps its four arms.
* Control arms (added after the arms above had run, criterion written here before their first run, same warm
  start, seeds, LR and steps as `static`): `correctness_only` (static, `reward_weights` [1, 0]) and `even_only`
  (static, [0, 1]). They show that the two rewards pull the policy to different places on this testbed (the
  conflict every claim here is about), and how far apart: the seed spread of the paired differences is what an
  arm's distance from the static sum is read against.
* Metrics every `eval_every` steps on the test prompts, 4 samples per prompt at temperature 1 (the policy the methods
  optimise; fixed evaluation RNG shared by all arms): the mean of each reward. Greedy means at the end; the weights
  (and the hypervolume multiplier) from the trainer logs.
* Seeds 0, 1, 2 (RL sampling and data order; the warm start is shared); verdicts on the seed means, with per-seed
  counts.
* Pilot (baseline only, seed 100 with its own warm start, not reported): `static` for 300 steps at LR 1e-4, 3e-4,
  1e-3, rule fixed beforehand: the LR with the highest final held-out correctness + even ending (the static method's
  own objective). From 0.737 / 0.501: 1e-4 → 0.674 / 0.642, 3e-4 → 0.354 / 0.876, 1e-3 → 0.000 / 1.000; 1e-4 sat at
  the grid edge, so 3e-5 was added: 0.750 / 0.552 (sum 1.302 < 1.316), LR 1e-4 kept. Before that, warm starts of
  35,000 and 45,000 rows left the pilot seed below the model's sharp learning transition (correctness 0.09, the
  static arm only learned the even ending), so the warm start was lengthened to 64,000 rows. μ of `gradient` from
  its first 10 steps (a scale calibration; no outcome looked at). Timing the arms (gradient ≈ 0.35 s/step, static
  ≈ 0.1) then set the budget: shared warm start, 200 steps, gradient update every 2 steps. Numbers in `PILOT`
  below. After the seed 0-2 runs only two things changed: the first full run had used LR 3e-4 by mistake (a stale
  default, not the pilot's choice; its numbers are in `PILOT["mistaken_first_run"]` and the Markdown) and was rerun
  at 1e-4; and reporting only (paired differences, controller diagnostics, plot style) was added.

Control (must pass for a failure of the criteria below to count; written before the control arms ran),
`control_conflict`: the rewards conflict here and the seeds resolve it: correctness(`correctness_only`) −
correctness(`even_only`) and even ending(`even_only`) − even ending(`correctness_only`), each a paired difference
over the seeds, both have their 95% Student-t interval above 0.

Pre-registered criterion (printed PASS/FAIL as measured): at least one adaptive method ends with both objectives
≥ static − 0.02 and at least one strictly better (> static), i.e. not dominated by the static sum. For every method
the table reports whether it Pareto-dominates the static sum, is dominated by it, or neither (plain Pareto order on
the seed means).

Command (measured 195 s wall with a cold cache, i.e. including the ≈ 85 s warm start, and 261-267 s cached while the
2 shared CPU cores were busier; reruns, cold or cached, reproduce the numbers exactly):
    OMP_NUM_THREADS=1 .venv/bin/python experiments/grpo_multi_objective.py
Pilot: `... --seeds 100 --out /tmp/pilot` with `WARM_SEED = 100`, `ARMS = ("static",)`, `Sizes.steps = 300`
and `Sizes.learning_rate` set.
Quick smoke run (< 60 s, 1 seed, tiny sizes; its verdicts mean nothing):
    OMP_NUM_THREADS=1 .venv/bin/python experiments/grpo_multi_objective.py --quick --out /tmp/grpo_mo_quick
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from _harness import criterion, declare, fmt, mean_std, run, save_figure, subplots
from testbeds import tiny_trl


NAME = "grpo_multi_objective"
ARMS = (
    "static", "dvao", "ctwa", "hypervolume", "gradient", "pama", "upgrad", "aligned_mtl", "correctness_only",
    "even_only",
)
ADAPTIVE = ARMS[1:5]  # criterion (a), registered before the later arms were added
LATER = ARMS[5:8]  # each with its own criterion, pre-registered before their first run
CONTROL_WEIGHTS = {"correctness_only": [1.0, 0.0], "even_only": [0.0, 1.0]}  # static arms with one objective
T975 = {2: 12.706, 3: 4.303, 4: 3.182, 5: 2.776}  # Student t, two-sided 95%, df = n − 1
LABELS = {
    "static": "static weighted sum",
    "dvao": "DVAO",
    "ctwa": "CTWA",
    "hypervolume": "hypervolume multiplier",
    "gradient": "gradient weighting",
    "pama": "PAMA",
    "upgrad": "UPGrad",
    "aligned_mtl": "Aligned-MTL",
    "correctness_only": "control: correctness only",
    "even_only": "control: even ending only",
}
COLORS = {
    "static": "black",
    "dvao": "tab:red",
    "ctwa": "tab:green",
    "hypervolume": "tab:orange",
    "gradient": "tab:purple",
    "pama": "tab:brown",
    "upgrad": "tab:blue",
    "aligned_mtl": "tab:cyan",
    "correctness_only": "gray",
    "even_only": "olive",
}
OBJECTIVES = ("correctness", "even_ending")
MAX_OPERAND = 49
MAX_COMPLETION = 4  # a 2-digit sum + eos is 3 tokens
BASE_WEIGHTS = [1.0, 1.0]
SPLIT_SEED = 1234
TOLERANCE = 0.02
GRADIENT_STEP = 0.1  # target size of lr·median|score|/μ
PILOT = {
    "seed": 100,
    "warm_seed": 100,
    "steps": 300,
    "arm": "static",
    "rule": "highest final held-out correctness + even_ending",
    "grid": [1e-4, 3e-4, 1e-3],
    "extension": [3e-5],
    "start": {"correctness": 0.737, "even_ending": 0.501},
    "results": {
        "3e-5": {"correctness": 0.750, "even_ending": 0.552},
        "1e-4": {"correctness": 0.674, "even_ending": 0.642},
        "3e-4": {"correctness": 0.354, "even_ending": 0.876},
        "1e-3": {"correctness": 0.000, "even_ending": 1.000},
    },
    "chosen": 1e-4,
    "gradient_calibration": {
        "steps": 10,
        "lr": 1e-4,
        "median_abs_score": 56.7,
        "regularization": 0.05,
        "step_at_median": 1e-4 * 56.7 / 0.05,
    },
    "earlier_warm_starts": "35,000 and 45,000 SFT rows left pilot seed 100 below the grokking-like transition "
    "(correctness 0.094 and 0.090; the static arm then only learned the even ending), so the "
    "warm start was lengthened to 64,000 rows (correctness 0.737)",
    "timing": "static ~0.1 s/step, gradient ~0.35 s/step (one extra forward and K backwards): to fit 10 minutes the "
    "warm start is shared by the seeds, the runs have 200 steps and the gradient weights update every "
    "2 steps; fixed before any adaptive arm ran beyond the 10-step calibration",
    "mistaken_first_run": "the first full run (seeds 0-2, warm start 0) used LR 3e-4 by mistake, a stale default and "
    "not the pilot's choice: from 0.486 / 0.493 every arm ran into the even-ending corner "
    "(correctness / even: static 0.068 / 0.987, DVAO 0.074 / 0.996, CTWA 0.078 / 0.987, "
    "hypervolume 0.070 / 0.993, gradient 0.039 / 0.994; the criterion read PASS on "
    "noise-level margins). It was rerun at the pre-registered 1e-4 with nothing else changed",
}


@dataclass(frozen=True)
class Sizes:
    num_test: int = 500
    num_val: int = 32  # hypervolume validation prompts (drw_val_size)
    eval_samples: int = 4
    warm_examples: int = 64000
    warm_lr: float = 3e-3
    warm_batch: int = 64
    steps: int = 200
    prompts_per_step: int = 8
    num_generations: int = 8
    learning_rate: float = 1e-4
    drw_regularization: float = 0.05  # lr·median|score|/μ ≈ 0.11 (pilot calibration)
    drw_every_n_steps: int = 2
    eval_every: int = 25
    logging_steps: int = 10


QUICK = Sizes(num_test=64, num_val=8, eval_samples=2, warm_examples=6000, steps=8, eval_every=4, logging_steps=4)


# ---------------------------------------------------------------------------------------------------------------------
# task


def prompt_of(a: int, b: int) -> str:
    return f"{a}+{b}="


def split_problems(sizes: Sizes) -> dict[str, list[tuple[int, int]]]:
    """Fixed split (independent of the run seed): test prompts, training pool, validation subset of the pool."""
    test, pool, val = tiny_trl.sum_split(MAX_OPERAND, SPLIT_SEED, sizes.num_test, sizes.num_val)
    return {"test": test, "pool": pool, "val": val}


def rows_of(problems) -> list[dict]:
    return [{"prompt": prompt_of(a, b), "completion": str(a + b), "answer": str(a + b)} for a, b in problems]


def correctness(completions: list[str], answer: list[str], **kwargs) -> list[float]:
    """Objective 1: exact match (`hf_stable.testing.arithmetic_reward`)."""
    from hf_stable.testing import arithmetic_reward

    return arithmetic_reward(completions, answer)


def even_ending(completions: list[str], **kwargs) -> list[float]:
    """Objective 2: 1 when the completion ends with an even digit (conflicts with correctness on odd sums)."""
    return [float(c.strip()[-1:] in ("0", "2", "4", "6", "8") and c.strip() != "") for c in completions]


# ---------------------------------------------------------------------------------------------------------------------
# measurements


def generate(model, tokenizer, prompts: list[str], sample: bool, seed: int) -> list[str]:
    eos = tokenizer.eos_token_id
    new = tiny_trl.generate_ids(model, tokenizer, prompts, sample, seed, MAX_COMPLETION)
    new = [row[: row.index(eos)] if eos in row else row for row in new]
    return tokenizer.batch_decode(new, skip_special_tokens=True)


def evaluate(model, tokenizer, problems, samples: int, seed: int, sample: bool = True) -> dict[str, float]:
    """Mean of each objective over `samples` completions per prompt (temperature 1, or greedy)."""
    prompts = [prompt_of(a, b) for a, b in problems] * samples
    answers = [str(a + b) for a, b in problems] * samples
    texts = generate(model, tokenizer, prompts, sample=sample, seed=seed)
    return {
        "correctness": statistics.fmean(correctness(texts, answers)),
        "even_ending": statistics.fmean(even_ending(texts)),
    }


def make_eval_callback(tokenizer, problems, sizes: Sizes, seed: int):
    """Records the held-out objective means at step 0, every `eval_every` steps and at the end (evaluation RNG
    depends on (seed, step) only, shared by all arms)."""

    def measure(step: int, model) -> dict:
        return evaluate(model, tokenizer, problems, sizes.eval_samples, 10_000 * (seed + 1) + step)

    return tiny_trl.curve_callback(measure, sizes.eval_every)


# ---------------------------------------------------------------------------------------------------------------------
# training


def warm_cache_dir(seed: int, sizes: Sizes) -> Path:
    fields = {k: v for k, v in asdict(sizes).items() if k.startswith("warm") or k == "num_test"}
    return tiny_trl.cache_dir(NAME, "warm", seed, {**fields, "max_operand": MAX_OPERAND, "split": SPLIT_SEED})


def warm_start(seed: int, sizes: Sizes, split: dict) -> tuple[Path, bool]:
    """The SFT checkpoint of `seed` (trained once, then loaded from the cache)."""

    def rows() -> list[dict]:
        rng = random.Random(seed)
        picked = rows_of(rng.choice(split["pool"]) for _ in range(sizes.warm_examples))
        return [{"prompt": r["prompt"], "completion": r["completion"]} for r in picked]

    return tiny_trl.sft_warm_start(warm_cache_dir(seed, sizes), seed, rows, sizes.warm_lr, sizes.warm_batch)


def arm_config(arm: str, seed: int, sizes: Sizes, output_dir: str):
    extra = {
        "static": {},
        "dvao": {"advantage_estimator": "dvao"},
        "ctwa": {"reward_weighting": "ctwa"},
        "hypervolume": {"reward_weighting": "hypervolume", "drw_val_size": sizes.num_val, "drw_eval_every": 1},
        "gradient": {
            "reward_weighting": "gradient",
            "drw_regularization": sizes.drw_regularization,
            "drw_every_n_steps": sizes.drw_every_n_steps,
        },
        "pama": {"reward_weighting": "pama"},
        "upgrad": {"gradient_aggregation": "upgrad"},
        "aligned_mtl": {"gradient_aggregation": "aligned_mtl"},
        "correctness_only": {},
        "even_only": {},
    }[arm]
    weights = CONTROL_WEIGHTS.get(arm, BASE_WEIGHTS)
    return tiny_trl.grpo_config(output_dir, seed, sizes, MAX_COMPLETION, reward_weights=weights, **extra)


def train_log(log_history: list[dict]) -> list[dict]:
    """Per logging window: training reward means, the weights, and the controllers' own diagnostics."""
    prefixes = ("rewards/", "stable/grpo/weights/", "stable/grpo/hv/", "stable/grpo/drw/", "stable/grpo/ctwa/")
    return [
        {
            "step": h["step"],
            "reward": h["reward"],
            **{k: v for k, v in h.items() if k.startswith(prefixes) and isinstance(v, (int, float))},
        }
        for h in log_history
        if "reward" in h
    ]


def run_arm(arm: str, seed: int, sizes: Sizes, warm_path: Path, split: dict) -> dict:
    """One arm from a fresh copy of the warm start (from_pretrained: never a deep copy of a trained model)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    from hf_stable import StableGRPOTrainer
    from hf_stable.testing import build_tiny_tokenizer

    start = time.time()
    model, tokenizer = AutoModelForCausalLM.from_pretrained(warm_path), build_tiny_tokenizer()
    callback = make_eval_callback(tokenizer, split["test"], sizes, seed)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = StableGRPOTrainer(
            model=model,
            reward_funcs=[correctness, even_ending],
            args=arm_config(arm, seed, sizes, tmp),
            train_dataset=Dataset.from_list(rows_of(split["pool"])),
            eval_dataset=Dataset.from_list(rows_of(split["val"])),
            processing_class=tokenizer,
            callbacks=[callback],
        )
        tiny_trl.fit(trainer)
    log = train_log(trainer.state.log_history)
    result = {
        "start": {k: callback.points[0][k] for k in OBJECTIVES},
        "end": {k: callback.points[-1][k] for k in OBJECTIVES},
        "greedy_end": evaluate(model, tokenizer, split["test"], 1, 0, sample=False),
        "final_weights": trainer._controller.weights.tolist(),
        "curve": callback.points,
        "train_log": log,
        "steps": trainer.state.global_step,
        "seconds": time.time() - start,
    }
    s, e = result["start"], result["end"]
    print(
        f"[seed {seed}] {arm:12s} correct {s['correctness']:.3f} -> {e['correctness']:.3f}  even "
        f"{s['even_ending']:.3f} -> {e['even_ending']:.3f}  weights "
        f"{[round(w, 3) for w in result['final_weights']]}  ({result['seconds']:.0f}s)",
        flush=True,
    )
    return result


def run_seed(seed: int, sizes: Sizes, arms: list[str], warm_seed: int) -> dict:
    split = split_problems(sizes)
    warm_path, cached = warm_start(warm_seed, sizes, split)
    return {"warm_cached": cached, "arms": {arm: run_arm(arm, seed, sizes, warm_path, split) for arm in arms}}


# ---------------------------------------------------------------------------------------------------------------------
# aggregation, verdicts, outputs


def aggregate(per_seed: dict, arms: list[str]) -> dict:
    seeds = list(per_seed)
    out = {
        "start": {k: mean_std([per_seed[s]["arms"][arms[0]]["start"][k] for s in seeds]) for k in OBJECTIVES},
        "arms": {},
    }
    for arm in arms:
        runs = [per_seed[s]["arms"][arm] for s in seeds]
        steps = [p["step"] for p in runs[0]["curve"]]
        out["arms"][arm] = {
            **{k: mean_std([r["end"][k] for r in runs]) for k in OBJECTIVES},
            **{f"greedy_{k}": mean_std([r["greedy_end"][k] for r in runs]) for k in OBJECTIVES},
            "final_weights": [statistics.fmean(r["final_weights"][i] for r in runs) for i in range(len(OBJECTIVES))],
            "diagnostics": diagnostics(runs),
            "curve": {
                "step": steps,
                **{
                    k: [statistics.fmean(r["curve"][i][k] for r in runs) for i in range(len(steps))]
                    for k in OBJECTIVES
                },
            },
        }
    return out


def diagnostics(runs: list[dict]) -> dict[str, float]:
    """Controller behaviour over the logging windows and seeds: the hypervolume multiplier and the share of windows
    with a positive hypervolume contribution, CTWA's largest deficit, each seed's final share of the correctness
    weight `w_0 / (w_0 + w_1)`."""
    logs = [h for r in runs for h in r["train_log"]]
    out = {}
    multipliers = [h["stable/grpo/hv/multiplier"] for h in logs if "stable/grpo/hv/multiplier" in h]
    if multipliers:
        out["hv_multiplier_mean"] = statistics.fmean(multipliers)
        out["hv_positive_contribution_frac"] = statistics.fmean(
            float(h["stable/grpo/hv/contribution"] > 0) for h in logs if "stable/grpo/hv/contribution" in h
        )
    deficits = [v for h in logs for k, v in h.items() if k.startswith("stable/grpo/ctwa/deficit_")]
    if deficits:
        out["ctwa_max_deficit"] = max(deficits)
    out["final_correctness_share"] = [r["final_weights"][0] / sum(r["final_weights"]) for r in runs]
    return out


def pareto_relation(point: tuple[float, float], static: tuple[float, float]) -> str:
    """`dominates` / `dominated` / `equal` / `neither` in the plain Pareto order (both objectives maximised)."""
    ge = all(p >= s for p, s in zip(point, static, strict=True))
    le = all(p <= s for p, s in zip(point, static, strict=True))
    if ge and le:
        return "equal"
    return "dominates" if ge else "dominated" if le else "neither"


def passes(point: tuple[float, float], static: tuple[float, float]) -> bool:
    """The pre-registered condition: both objectives ≥ static − 0.02 and one strictly better."""
    return all(p >= s - TOLERANCE for p, s in zip(point, static, strict=True)) and any(
        p > s for p, s in zip(point, static, strict=True)
    )


def verdicts(per_seed: dict, agg: dict, arms: list[str]) -> dict:
    if "static" not in arms:
        return {}

    def point(source: dict) -> tuple[float, float]:
        return tuple(source[k]["mean"] if isinstance(source[k], dict) else source[k] for k in OBJECTIVES)

    static = point(agg["arms"]["static"])
    methods = {}
    for arm in arms:
        if arm == "static" or arm in CONTROL_WEIGHTS:
            continue
        runs = {s: per_seed[s]["arms"] for s in per_seed}
        seed_relations = [pareto_relation(point(r[arm]["end"]), point(r["static"]["end"])) for r in runs.values()]
        mine = point(agg["arms"][arm])
        paired = {k: mean_std([r[arm]["end"][k] - r["static"]["end"][k] for r in runs.values()]) for k in OBJECTIVES}
        for d in paired.values():  # |mean| within two standard errors of the paired seed differences
            d["within_noise"] = len(d["values"]) < 2 or abs(d["mean"]) <= 2 * d["std"] / len(d["values"]) ** 0.5
        methods[arm] = {
            "relation": pareto_relation(mine, static),
            "passes": passes(mine, static),
            "paired": paired,
            "delta": {k: m - s for k, m, s in zip(OBJECTIVES, mine, static, strict=True)},
            "per_seed_relations": seed_relations,
            "per_seed_passes": sum(passes(point(r[arm]["end"]), point(r["static"]["end"])) for r in runs.values()),
        }
    adaptive = [m for m in methods if m in ADAPTIVE]
    best = max((methods[m]["per_seed_passes"] for m in adaptive), default=0)
    return {
        "per_seed": f"best adaptive method passes on {best}/{len(per_seed)} seeds",
        "values": {"static": dict(zip(OBJECTIVES, static, strict=True))},
        "criterion": f"some adaptive method has both objectives ≥ static − {TOLERANCE} and one > static (seed means)",
        "passed": any(methods[m]["passes"] for m in adaptive),
        "static": dict(zip(OBJECTIVES, static, strict=True)),
        "methods": methods,
    }


def paired_interval(per_seed: dict, arm: str, other: str, key: str) -> dict:
    """Mean and 95% Student-t interval over the seeds of `arm`'s final `key` minus `other`'s (same seed)."""
    d = [r["arms"][arm]["end"][key] - r["arms"][other]["end"][key] for r in per_seed.values()]
    half = T975[len(d)] * statistics.stdev(d) / len(d) ** 0.5 if len(d) > 1 else float("inf")
    mean = statistics.fmean(d)
    return {"mean": mean, "ci_low": mean - half, "ci_high": mean + half, "n": len(d)}


def conflict_control(per_seed: dict) -> dict | None:
    """`control_conflict`: each single-objective arm beats the other on its own objective (paired 95% intervals)."""
    if not all(arm in r["arms"] for r in per_seed.values() for arm in CONTROL_WEIGHTS):
        return None
    gaps = {
        "correctness": paired_interval(per_seed, "correctness_only", "even_only", "correctness"),
        "even_ending": paired_interval(per_seed, "even_only", "correctness_only", "even_ending"),
    }
    worst = min(gaps.values(), key=lambda g: g["ci_low"])
    return criterion(
        "control (must pass): the rewards conflict here: correctness(correctness only) − correctness(even only) "
        "and even(even only) − even(correctness only), paired over seeds, both with the 95% interval above 0",
        all(g["ci_low"] > 0 for g in gaps.values()),
        {**{k: worst[k] for k in ("mean", "ci_low", "ci_high", "n")}, **gaps},
    )


def later_criteria(a: dict, per_seed: dict) -> dict:
    """Criterion (a) over the first four adaptive arms, for each later arm the same test on its own (both
    objectives ≥ static − `TOLERANCE` and one > static, seed means), and the conflict control."""
    out = {"a": a}
    control = conflict_control(per_seed)
    if control is not None:
        out["control_conflict"] = control
    for arm in LATER:
        method = a.get("methods", {}).get(arm)
        if method is not None:
            out[arm] = criterion(
                f"{arm}: both objectives ≥ static − {TOLERANCE} and one > static (seed means)",
                method["passes"],
                {"relation": method["relation"], "delta": method["delta"]},
                per_seed=f"{method['per_seed_passes']}/{len(method['per_seed_relations'])} seeds",
            )
    return out


def plot(per_seed: dict, agg: dict, path: Path) -> None:
    fig, axes = subplots(1, 3, figsize=(17, 4.8))
    ax = axes[0]
    start = agg["start"]
    ax.scatter(
        [start["correctness"]["mean"]],
        [start["even_ending"]["mean"]],
        marker="*",
        s=220,
        color="gray",
        label="warm start",
        zorder=5,
    )
    xs = [0.0, 0.5, 1.0]
    ax.plot(xs, [1.5 - x if x >= 0.5 else 1.0 for x in xs], color="gray", linestyle=":", linewidth=1)
    for arm, summary in agg["arms"].items():
        curve = summary["curve"]
        ax.plot(curve["correctness"], curve["even_ending"], color=COLORS[arm], alpha=0.4)
        ax.scatter(
            [summary["correctness"]["mean"]],
            [summary["even_ending"]["mean"]],
            s=110,
            color=COLORS[arm],
            edgecolor="black",
            label=LABELS[arm],
            zorder=4,
        )
        ax.scatter(
            summary["correctness"]["values"], summary["even_ending"]["values"], s=22, color=COLORS[arm], alpha=0.6
        )
    ax.set(
        title="final Pareto plot, held-out (big: seed mean, small: seeds,\nline: mean trajectory; dotted: "
        "correct + even = 1.5 bound)",
        xlabel="objective 1: correctness",
        ylabel="objective 2: even ending",
    )
    ax.legend(fontsize=8)
    for ax, key in ((axes[1], "correctness"), (axes[2], "even_ending")):
        for arm, summary in agg["arms"].items():  # static dashed on top: an arm that never adapts hides under it
            style = {"linestyle": "--", "zorder": 5} if arm == "static" else {}
            ax.plot(summary["curve"]["step"], summary["curve"][key], color=COLORS[arm], label=LABELS[arm], **style)
        ax.set(title=f"held-out mean {key} (T = 1 samples)", xlabel="RL step")
    axes[2].legend(fontsize=8)
    fig.suptitle("E-G2: two conflicting rewards, static sum vs adaptive combination (mean over seeds)")
    save_figure(fig, path, dpi=120)


def interpretation(agg: dict, result: dict) -> str:
    v = result["criteria"].get("a")
    if not v:
        return "No static arm in this run: no verdicts."
    static = v["static"]
    parts = [
        f"The static sum ends at correctness {static['correctness']:.3f} / even ending "
        f"{static['even_ending']:.3f} from {agg['start']['correctness']['mean']:.3f} / "
        f"{agg['start']['even_ending']['mean']:.3f}."
    ]
    parts.append(
        "Against it: "
        + "; ".join(
            f"{LABELS[m]} {d['delta']['correctness']:+.3f} / {d['delta']['even_ending']:+.3f} ({d['relation']})"
            for m, d in v["methods"].items()
        )
        + "."
    )
    winners = [LABELS[m] for m, d in v["methods"].items() if d["passes"]]
    parts.append(
        f"The pre-registered criterion {'holds' if v['passed'] else 'fails'}"
        + (f" ({', '.join(winners)})." if winners else ": no adaptive method meets it.")
    )
    control = result["criteria"].get("control_conflict")
    if control:
        c, e = control["values"]["correctness"], control["values"]["even_ending"]
        parts.append(
            f"Control: optimising correctness alone instead of the even ending alone gains correctness "
            f"{c['mean']:+.3f} [{c['ci_low']:+.3f}, {c['ci_high']:+.3f}], and the reverse gains even ending "
            f"{e['mean']:+.3f} [{e['ci_low']:+.3f}, {e['ci_high']:+.3f}] (paired, 95%): the conflict "
            f"{'is present and resolved by the seeds' if control['passed'] else 'is not resolved here'}."
        )
    noisy = [LABELS[m] for m, d in v["methods"].items() if all(x["within_noise"] for x in d["paired"].values())]
    if noisy:
        parts.append(
            f"For {', '.join(noisy)} both paired differences to the static sum are within two standard "
            "errors of the seed-to-seed spread, so these relations are not distinguishable from noise."
        )
    a = agg["arms"]
    if "hypervolume" in a and "hv_multiplier_mean" in a["hypervolume"]["diagnostics"]:
        hv = a["hypervolume"]["diagnostics"]
        parts.append(
            f"The hypervolume multiplier averaged {hv['hv_multiplier_mean']:.2f} (positive contribution "
            f"in {hv['hv_positive_contribution_frac']:.0%} of the logging windows): a validation point only "
            "adds hypervolume when it beats the initial model (the reference point) on both objectives, "
            "which a move along the trade-off cannot do, and a near-constant multiplier of the advantages is "
            "expected to be largely absorbed by Adam's normalisation"
            + (
                "; the arm ended within noise of the static sum."
                if all(d["within_noise"] for d in v["methods"]["hypervolume"]["paired"].values())
                else "."
            )
        )
    if "ctwa" in a and a["ctwa"]["diagnostics"].get("ctwa_max_deficit", 1.0) == 0.0:
        parts.append(
            "CTWA's within-group correlations never fell below their 1/sqrt(K) targets, so its weights never moved "
            "and its runs are the static runs."
        )
    if "gradient" in a:
        share = a["gradient"]["diagnostics"]["final_correctness_share"]
        shares = ", ".join(f"{x:.3f}" for x in share)
        # "corner" only when some seed ended with ≥ 90 % of the weight on one objective
        where = "toward a corner whose direction" if max(abs(x - 0.5) for x in share) >= 0.4 else "to a mix that"
        parts.append(
            f"Gradient weighting moved the weights {where} depends on the seed "
            f"(final correctness share per seed: {shares})."
        )
    if v["passed"] and all(
        all(x["within_noise"] for x in d["paired"].values()) for d in v["methods"].values() if d["passes"]
    ):
        parts.append(
            "Bottom line: the criterion's PASS rests on margins inside the seed noise; no adaptive method "
            "shows a Pareto improvement over the static sum that this experiment can resolve."
        )
    return " ".join(parts)


def markdown(result: dict) -> str:
    agg, v, cfg = result["aggregate"], result["criteria"].get("a", {}), result["config"]
    sizes = cfg["sizes"]
    lines = [
        f"Seeds {cfg['seeds']} (RL; one shared warm start, seed {cfg['warm_seed']}), mean ± std over seeds. "
        f"{sizes['steps']} RL steps × {sizes['prompts_per_step']} "
        f"prompts × G = {sizes['num_generations']}, LR {sizes['learning_rate']:g} (constant, chosen on the static "
        f"arm in a pilot), base weights {BASE_WEIGHTS}, gradient weighting μ = {sizes['drw_regularization']:g} "
        f"(step lr·s/μ ≈ {GRADIENT_STEP} at the median pilot |score|). Objectives on {sizes['num_test']} held-out "
        f"prompts, {sizes['eval_samples']} samples each at T = 1; greedy at the end in the last columns.",
        "",
        "| method | correctness | even ending | vs static (Pareto) | criterion | seeds: relation "
        "| paired Δ correctness | paired Δ even | final weights | greedy correctness | greedy even |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    s = agg["start"]
    lines.append(f"| warm start | {fmt(s['correctness'])} | {fmt(s['even_ending'])} | – | – | – | – | – | – | – | – |")
    for arm, a in agg["arms"].items():
        d = v.get("methods", {}).get(arm)
        relation = d["relation"] if d else "(reference)"
        crit = f"{'PASS' if d['passes'] else 'FAIL'} ({d['per_seed_passes']}/{len(cfg['seeds'])} seeds)" if d else "–"
        seeds = ", ".join(d["per_seed_relations"]) if d else "–"
        paired = [f"{d['paired'][k]['mean']:+.3f} ± {d['paired'][k]['std']:.3f}" if d else "–" for k in OBJECTIVES]
        weights = ", ".join(f"{w:.3g}" for w in a["final_weights"])
        lines.append(
            f"| {LABELS[arm]} | {fmt(a['correctness'])} | {fmt(a['even_ending'])} | {relation} | {crit} | "
            f"{seeds} | {paired[0]} | {paired[1]} | {weights} | {fmt(a['greedy_correctness'])} | "
            f"{fmt(a['greedy_even_ending'])} |"
        )
    pilot = cfg["pilot"]
    grad = pilot["gradient_calibration"]
    lines += [
        "",
        "## Interpretation",
        "",
        interpretation(agg, result),
        "",
        f"Pilot (static arm only, seed {pilot['seed']}, {pilot['steps']} steps, not reported above), final "
        "held-out correctness / even ending by LR from "
        f"{pilot['start']['correctness']:.3f} / {pilot['start']['even_ending']:.3f}: "
        + ", ".join(f"{lr}: {v['correctness']:.3f} / {v['even_ending']:.3f}" for lr, v in pilot["results"].items())
        + f"; chosen LR {pilot['chosen']:g} (best correctness + even ending; 3e-5 was added because 1e-4 sat at "
        f"the grid edge). Gradient weighting: median |influence score| {grad['median_abs_score']} over its "
        f"first {grad['steps']} steps at LR {grad['lr']:g}, so μ = {grad['regularization']} gives a step of "
        f"{grad['step_at_median']:.2f}. Warm start: {pilot['earlier_warm_starts']}. Budget: {pilot['timing']}.",
        "",
        f"Note: {pilot['mistaken_first_run']}.",
    ]
    return "\n".join(lines)


WARM_SEED = 0  # the one warm start all seeds share


EXPERIMENT = declare(
    globals(),
    title="E-G2: adaptive reward combination vs a static weighted sum (two conflicting rewards)",
    claim="Adaptive reward combination (DVAO, CTWA, hypervolume, gradient weights) ends not dominated by a static "
    "weighted sum on two conflicting rewards (arXiv 2605.25604, 2602.06869, 2509.11452).",
    run_seed=lambda seed, sizes: run_seed(seed, sizes, list(ARMS), WARM_SEED),
    aggregate=lambda per_seed, sizes: aggregate(per_seed, list(ARMS)),
    criteria=lambda per_seed, agg, sizes: later_criteria(verdicts(per_seed, agg, list(ARMS)), per_seed),
    plot=lambda result, path: plot(result["per_seed"], result["aggregate"], path),
    config={
        "warm_seed": WARM_SEED,
        "arms": list(ARMS),
        "objectives": list(OBJECTIVES),
        "base_weights": BASE_WEIGHTS,
        "max_operand": MAX_OPERAND,
        "max_completion_length": MAX_COMPLETION,
        "split_seed": SPLIT_SEED,
        "tolerance": TOLERANCE,
        "ctwa": {"use_corr": True, "targets": [2**-0.5, 2**-0.5], "lambda_lr": 0.05, "ema_tau": 0.1},
        "dvao": {"sigma_power": 1.0},
        "hypervolume": {"eval_every": 1},
        "gradient": {"target_step": GRADIENT_STEP},
        "pilot": PILOT,
    },
)


if __name__ == "__main__":
    run(EXPERIMENT)
