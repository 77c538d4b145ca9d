"""E-G1 "S-GRPO under reward noise": with 20% of binary rewards flipped, GRPO stalls, S-GRPO keeps improving.

Claim (arXiv 2508.05928; spec `grpo_variants.md` §2). S-GRPO multiplies GRPO's group z-scored advantage by the
noise-aware shrinkage `w*(G, k, p)`, which is 0 for groups whose success count a flip could explain and `1 - 2p` at
balanced groups. The paper's headline: with 20% synthetic reward flips standard GRPO stops learning while S-GRPO
keeps improving.

Design.
* Task: addition of two operands in [0, 19] (`12+7=` -> `19`), one char per token (`hf_stable.testing` tiny Llama,
  hidden 64, 2 layers, ~90k parameters). The 400 problems are split once (split seed 1234, independent of the run
  seed) into 100 held-out test problems and a 300-problem training pool; SFT and GRPO only see the pool.
* Warm start: NLL SFT (`StableSFTTrainer`, defaults = TRL's SFT) from a random init (seeded by the run seed) on
  samples of the pool, linear LR decay, sized to stop at a MODERATE held-out greedy accuracy (0.30-0.51 on seeds
  0-2) so RL has room to improve. Saved with `save_pretrained` under `experiments/cache/grpo_reward_noise/` and
  loaded fresh with `from_pretrained` for every RL run (never deep-copied after a TRL trainer touched it).
* RL: `StableGRPOTrainer`, `loss_type="dr_grpo"`, `beta=0`, G = 8 completions per prompt, 16 prompts per step,
  temperature 1, on-policy (1 iteration), constant LR, the same LR / seed / prompt stream for every arm. Reward:
  `noisy_reward(arithmetic_reward, p, seed)`, exact match with each binary reward flipped with probability
  p in {0, 0.1, 0.2}. Arms: GRPO (`advantage_estimator="grpo"`) and S-GRPO (`advantage_estimator="sgrpo"`,
  `correctness_reward_index=0`) with `sgrpo_noise_p` = the true flip rate at p = 0.1 / 0.2 and 0.05 at p = 0. The
  0.05 is a deliberate choice: `sgrpo_noise_p=0` makes S-GRPO GRPO exactly (a vacuous comparison), and a
  practitioner who does not know the flip rate would set a small positive prior; its price is that S-GRPO then
  discards groups with a single success (w* at k = 1 is 0.75 rather than 1 at p = 0.05; 0 for p = 0.2).
* Metrics: the CLEAN (unflipped) training reward, logged by the wrapper as `arithmetic_reward/clean` and averaged
  over each 10-step logging window (sampled at temperature 1 on pool prompts), plus step 1 alone
  (`logging_first_step`: the warm start's own samples, identical across the arms of a seed); greedy exact match on
  the 100 held-out problems (`evaluate_completions`) every 25 steps and at the end. "Final clean accuracy" = mean
  clean reward over the last 50 steps (fixed before any run).
* Seeds 0, 1, 2 (model init, SFT data, RL prompts, sampling and flips); mean ± sample std over seeds.
* Size / LR decision: made in a pilot on seeds 100/101 (not reported) running GRPO at 0% noise only (`PILOT`, also
  in the JSON config): LR 1e-3 collapsed even noise-free GRPO, 1e-4 did not move it, 3e-4 with 16 prompts per step
  raised the clean reward by 0.07-0.12 in 300 steps. Nothing that affects training was changed after seeing any
  noisy or S-GRPO run. After the first full run only reporting was added (the step-1 log point, the gain column and
  the interpretation text); the rerun reproduced every final number bit for bit.

Pass criterion (from the issue; printed PASS/FAIL as measured):
  (a) at 20% flips, S-GRPO's final clean accuracy > GRPO's on EVERY seed;
  (b) S-GRPO at 20% ends within 0.1 of its own 0%-noise run: |mean final clean(S-GRPO, 0.2) - mean final
      clean(S-GRPO, 0.0)| <= 0.1 (seed means; the number of seeds where it holds alone is reported).

Command (6 min on a free core with a cold cache, measured 358 s; 8.5 min measured on a contended one):
    OMP_NUM_THREADS=1 .venv/bin/python experiments/grpo_reward_noise.py
Quick smoke run (< 60 s, 1 seed, tiny sizes; its pass/fail means nothing):
    OMP_NUM_THREADS=1 .venv/bin/python experiments/grpo_reward_noise.py --quick --output_dir /tmp/grpo_reward_noise
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import random
import statistics
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch


NAME = "grpo_reward_noise"
ROOT = Path(__file__).resolve().parent
SPLIT_SEED = 1234
MAX_OPERAND = 19
NOISE_LEVELS = (0.0, 0.1, 0.2)
METHODS = ("grpo", "sgrpo")
SGRPO_P_AT_ZERO_NOISE = 0.05  # S-GRPO's assumed flip rate when the true rate is 0 (see the docstring)
REWARD_NAME = "arithmetic_reward"
CLEAN_KEY = f"{REWARD_NAME}/clean"
CRITERION_NOISE, CRITERION_GAP = 0.2, 0.1
# what the pilot (seeds 100 and 101, GRPO at 0% flips only, not reported) showed before `Sizes` was fixed
PILOT = (
    "Seed 100, GRPO at 0% flips only. SFT 4 / 6 / 8 epochs gave held-out greedy EM 0.11 / 0.27 / 0.35 -> 8 epochs. "
    "RL with 8 prompts/step: LR 1e-3 collapsed the policy (clean reward 0.12 -> 0.02 in 300 steps, held-out EM "
    "0.35 -> 0.02; TRL's own GRPOTrainer degrades the same way, so it is not hf_stable), LR 1e-4 stayed flat "
    "(0.26 -> 0.23), LR 3e-4 was flat to slightly up (0.22 -> 0.24). 16 prompts/step: LR 1e-3 still lost held-out EM "
    "(0.35 -> 0.09), LR 3e-4 rose 0.18 -> 0.30 (seed 100) and 0.17 -> 0.24 (seed 101, checked once). Chosen: 8 SFT "
    "epochs, RL LR 3e-4, 16 prompts/step, 300 steps (~25-30 s per arm on one core)."
)


@dataclass(frozen=True)
class Sizes:
    num_test: int = 100  # held-out problems (of 400)
    sft_examples: int = 1000
    sft_epochs: int = 8
    sft_batch: int = 32
    sft_lr: float = 3e-3
    grpo_steps: int = 300
    grpo_prompts: int = 16  # prompts per step (x num_generations completions)
    num_generations: int = 8
    grpo_lr: float = 3e-4
    max_completion_length: int = 4  # answers have <= 2 digits, + eos
    temperature: float = 1.0
    logging_steps: int = 10
    eval_every: int = 25
    final_window: int = 50  # steps averaged into the final clean accuracy
    hidden_size: int = 64


QUICK = Sizes(sft_examples=600, sft_epochs=4, grpo_steps=12, grpo_prompts=4, logging_steps=4, eval_every=6,
              final_window=4)


# ---------------------------------------------------------------------------------------------------------------------
# task and data


def split_problems(num_test: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(test, pool): a fixed split of all `a+b` problems with operands in [0, MAX_OPERAND], independent of the seed."""
    problems = [(a, b) for a in range(MAX_OPERAND + 1) for b in range(MAX_OPERAND + 1)]
    random.Random(SPLIT_SEED).shuffle(problems)
    return problems[:num_test], problems[num_test:]


def rows(problems) -> list[dict]:
    return [{"prompt": f"{a}+{b}=", "completion": str(a + b), "answer": str(a + b)} for a, b in problems]


def seed_data(seed: int, sizes: Sizes) -> dict:
    """Per-seed SFT examples and RL prompt stream (both sampled from the pool with the run seed), and the test set."""
    from datasets import Dataset

    test, pool = split_problems(sizes.num_test)
    rng = random.Random(seed)
    sft = [rng.choice(pool) for _ in range(sizes.sft_examples)]
    prompts = [rng.choice(pool) for _ in range(sizes.grpo_steps * sizes.grpo_prompts)]
    return {"sft": Dataset.from_list(rows(sft)), "grpo": Dataset.from_list(rows(prompts)),
            "test": Dataset.from_list(rows(test))}


def heldout_em(model, tokenizer, test) -> float:
    from hf_stable.testing import evaluate_completions

    return evaluate_completions(model, tokenizer, test, batch_size=len(test), max_new_tokens=4)["exact_match"]


# ---------------------------------------------------------------------------------------------------------------------
# warm start


def sft_cache_dir(seed: int, sizes: Sizes) -> Path:
    fields = {k: v for k, v in asdict(sizes).items() if k.startswith("sft") or k in ("hidden_size", "num_test")}
    key = hashlib.sha1(json.dumps({**fields, "max_operand": MAX_OPERAND, "split": SPLIT_SEED},
                                  sort_keys=True).encode())
    return ROOT / "cache" / NAME / f"sft_seed{seed}_{key.hexdigest()[:10]}"


def run_sft(seed: int, sizes: Sizes, data: dict) -> Path:
    """Trains (or reuses the cached) NLL SFT warm start of `seed`; returns its directory."""
    from transformers import PrinterCallback

    from hf_stable import StableSFTConfig, StableSFTTrainer
    from hf_stable.testing import build_tiny_model

    path = sft_cache_dir(seed, sizes)
    if (path / "done.json").exists():
        print(f"[seed {seed}] SFT: cached {path.relative_to(ROOT)}", flush=True)
        return path
    start = time.time()
    model, tokenizer = build_tiny_model(seed=seed, hidden_size=sizes.hidden_size,
                                        intermediate_size=2 * sizes.hidden_size, max_position_embeddings=32)
    with tempfile.TemporaryDirectory() as tmp:
        args = StableSFTConfig(
            output_dir=tmp, seed=seed, learning_rate=sizes.sft_lr, per_device_train_batch_size=sizes.sft_batch,
            num_train_epochs=sizes.sft_epochs, lr_scheduler_type="linear", logging_steps=50, max_length=32,
            use_cpu=True, bf16=False, gradient_checkpointing=False, report_to="none", save_strategy="no",
            disable_tqdm=True, dataloader_num_workers=0,
        )
        trainer = StableSFTTrainer(model=model, args=args, train_dataset=data["sft"], processing_class=tokenizer)
        trainer.remove_callback(PrinterCallback)
        trainer.train()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    (path / "done.json").write_text(json.dumps({"steps": trainer.state.global_step, "seconds": time.time() - start}))
    print(f"[seed {seed}] SFT: {trainer.state.global_step} steps in {time.time() - start:.0f}s", flush=True)
    return path


def load_checkpoint(path: Path):
    """A fresh model from disk (never a deep copy of a model a TRL trainer has patched)."""
    from transformers import AutoModelForCausalLM

    from hf_stable.testing import build_tiny_tokenizer

    return AutoModelForCausalLM.from_pretrained(path), build_tiny_tokenizer()


# ---------------------------------------------------------------------------------------------------------------------
# RL


def assumed_noise(method: str, flip_prob: float) -> float | None:
    """S-GRPO's `sgrpo_noise_p`: the true flip rate, or `SGRPO_P_AT_ZERO_NOISE` when there is no noise."""
    if method != "sgrpo":
        return None
    return flip_prob if flip_prob > 0 else SGRPO_P_AT_ZERO_NOISE


def grpo_config(output_dir: str, seed: int, method: str, flip_prob: float, sizes: Sizes):
    from hf_stable import StableGRPOConfig

    estimator = {"advantage_estimator": "sgrpo", "sgrpo_noise_p": assumed_noise(method, flip_prob),
                 "correctness_reward_index": 0} if method == "sgrpo" else {}
    return StableGRPOConfig(
        output_dir=output_dir, seed=seed, learning_rate=sizes.grpo_lr, lr_scheduler_type="constant",
        max_steps=sizes.grpo_steps, per_device_train_batch_size=sizes.grpo_prompts * sizes.num_generations,
        num_generations=sizes.num_generations, max_completion_length=sizes.max_completion_length,
        temperature=sizes.temperature, beta=0.0, loss_type="dr_grpo", logging_steps=sizes.logging_steps,
        logging_first_step=True,
        use_cpu=True, bf16=False, gradient_checkpointing=False, report_to="none", save_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0, **estimator,
    )


def make_heldout_callback(tokenizer, test, every: int):
    """Records held-out greedy exact match at step 0, every `every` steps and at the end of training."""
    from transformers import TrainerCallback

    class HeldoutEM(TrainerCallback):
        def __init__(self):
            self.points: list[dict] = []

        def record(self, step, model):
            if not self.points or self.points[-1]["step"] != step:
                self.points.append({"step": step, "exact_match": heldout_em(model, tokenizer, test)})

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            self.record(0, model)

        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step % every == 0:
                self.record(state.global_step, model)

        def on_train_end(self, args, state, control, model=None, **kwargs):
            self.record(state.global_step, model)

    return HeldoutEM()


def log_series(log_history: list[dict], key: str) -> list[dict]:
    return [{"step": h["step"], "value": h[key]} for h in log_history if key in h]


def window_mean(series: list[dict], last_step: int, window: int) -> float:
    """Mean of the logged values whose logging window lies in the last `window` steps."""
    values = [p["value"] for p in series if p["step"] > last_step - window]
    if not values:
        raise RuntimeError(f"nothing logged in the last {window} steps")
    return statistics.fmean(values)


def run_rl(seed: int, method: str, flip_prob: float, sizes: Sizes, data: dict, sft_path: Path) -> dict:
    """One RL arm from the SFT warm start: clean-reward curve, held-out EM curve and finals."""
    from transformers import PrinterCallback

    from hf_stable import StableGRPOTrainer
    from hf_stable.rewards.noise import noisy_reward
    from hf_stable.testing import arithmetic_reward

    start = time.time()
    model, tokenizer = load_checkpoint(sft_path)
    callback = make_heldout_callback(tokenizer, data["test"], sizes.eval_every)
    reward = noisy_reward(arithmetic_reward, flip_prob, seed=seed, name=REWARD_NAME)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = StableGRPOTrainer(model=model, reward_funcs=[reward], args=grpo_config(tmp, seed, method,
                                    flip_prob, sizes), train_dataset=data["grpo"], processing_class=tokenizer,
                                    callbacks=[callback])
        trainer.remove_callback(PrinterCallback)
        trainer.train()
    history, steps = trainer.state.log_history, trainer.state.global_step
    clean = log_series(history, CLEAN_KEY)
    if not clean:
        raise RuntimeError(f"`{CLEAN_KEY}` was not logged; logged keys: {sorted(history[0])}")
    observed = log_series(history, f"rewards/{REWARD_NAME}/mean")
    result = {
        "final_clean": window_mean(clean, steps, sizes.final_window),
        "final_observed": window_mean(observed, steps, sizes.final_window),
        "start_clean": clean[0]["value"],  # step 1: the warm start's own samples (no update yet)
        "heldout_em_start": callback.points[0]["exact_match"], "heldout_em_end": callback.points[-1]["exact_match"],
        "clean_curve": clean, "observed_curve": observed, "heldout_curve": callback.points,
        "frac_reward_zero_std": statistics.fmean(p["value"] for p in log_series(history, "frac_reward_zero_std")),
        "steps": steps, "seconds": time.time() - start,
    }
    result["gain"] = result["final_clean"] - result["start_clean"]
    if method == "sgrpo":
        for key in ("zero_weight_frac", "mean_weight"):
            result[f"sgrpo_{key}"] = statistics.fmean(
                p["value"] for p in log_series(history, f"stable/grpo/sgrpo/{key}"))
    print(f"[seed {seed}] {method:5s} flips {flip_prob:.1f}: clean {result['start_clean']:.3f} -> "
          f"{result['final_clean']:.3f}  held-out EM {result['heldout_em_start']:.3f} -> "
          f"{result['heldout_em_end']:.3f}  ({steps} steps, {result['seconds']:.0f}s)", flush=True)
    return result


def arm_key(method: str, flip_prob: float) -> str:
    return f"{method}@{flip_prob:g}"


def run_seed(seed: int, sizes: Sizes) -> dict:
    data = seed_data(seed, sizes)
    path = run_sft(seed, sizes, data)
    model, tokenizer = load_checkpoint(path)
    start_em = heldout_em(model, tokenizer, data["test"])
    print(f"[seed {seed}] SFT warm start: held-out greedy EM {start_em:.3f}", flush=True)
    arms = {arm_key(m, p): run_rl(seed, m, p, sizes, data, path) for p in NOISE_LEVELS for m in METHODS}
    return {"sft_heldout_em": start_em, "arms": arms}


# ---------------------------------------------------------------------------------------------------------------------
# aggregation, criterion, outputs


def mean_std(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "values": values}


def mean_curve(curves: list[list[dict]], key: str) -> dict:
    """Seed mean and std at each recorded step (every seed records the same steps)."""
    steps = [p["step"] for p in curves[0]]
    columns = [[c[i][key] for c in curves] for i in range(len(steps))]
    return {"step": steps, "mean": [statistics.fmean(c) for c in columns],
            "std": [statistics.stdev(c) if len(c) > 1 else 0.0 for c in columns]}


def aggregate(per_seed: dict) -> dict:
    seeds = list(per_seed)
    out = {"sft_heldout_em": mean_std([per_seed[s]["sft_heldout_em"] for s in seeds]), "arms": {}}
    for key in per_seed[seeds[0]]["arms"]:
        arms = [per_seed[s]["arms"][key] for s in seeds]
        agg = {k: mean_std([a[k] for a in arms]) for k in arms[0] if isinstance(arms[0][k], float)}
        agg["clean_curve"] = mean_curve([a["clean_curve"] for a in arms], "value")
        agg["heldout_curve"] = mean_curve([a["heldout_curve"] for a in arms], "exact_match")
        out["arms"][key] = agg
    return out


def criteria(per_seed: dict, agg: dict) -> dict:
    seeds = list(per_seed)
    noisy_s, noisy_g = arm_key("sgrpo", CRITERION_NOISE), arm_key("grpo", CRITERION_NOISE)
    clean_s = arm_key("sgrpo", 0.0)
    final = {s: {k: a["final_clean"] for k, a in per_seed[s]["arms"].items()} for s in seeds}
    a_seeds = [final[s][noisy_s] > final[s][noisy_g] for s in seeds]
    gap = agg["arms"][noisy_s]["final_clean"]["mean"] - agg["arms"][clean_s]["final_clean"]["mean"]
    b_seeds = [abs(final[s][noisy_s] - final[s][clean_s]) <= CRITERION_GAP for s in seeds]
    return {
        "a": {"criterion": f"final clean accuracy S-GRPO > GRPO at {CRITERION_NOISE:.0%} flips on every seed",
              "per_seed": {s: {"sgrpo": final[s][noisy_s], "grpo": final[s][noisy_g]} for s in seeds},
              "passed": all(a_seeds), "holds_in": f"{sum(a_seeds)}/{len(seeds)} seeds"},
        "b": {"criterion": f"abs(mean final clean S-GRPO@{CRITERION_NOISE:g} - mean final clean S-GRPO@0) <= "
                           f"{CRITERION_GAP}",
              "per_seed": {s: {"sgrpo@0.2": final[s][noisy_s], "sgrpo@0": final[s][clean_s]} for s in seeds},
              "gap": gap, "passed": abs(gap) <= CRITERION_GAP, "holds_in": f"{sum(b_seeds)}/{len(seeds)} seeds"},
    }


def plot(agg: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"grpo": "tab:red", "sgrpo": "tab:blue"}
    labels = {"grpo": "GRPO", "sgrpo": "S-GRPO"}
    fig, axes = plt.subplots(1, len(NOISE_LEVELS) + 1, figsize=(5 * (len(NOISE_LEVELS) + 1), 4.2))
    for ax, p in zip(axes, NOISE_LEVELS, strict=False):
        for method in METHODS:
            curve = agg["arms"][arm_key(method, p)]["clean_curve"]
            low = [m - s for m, s in zip(curve["mean"], curve["std"], strict=True)]
            high = [m + s for m, s in zip(curve["mean"], curve["std"], strict=True)]
            q = assumed_noise(method, p)
            ax.plot(curve["step"], curve["mean"], color=colors[method],
                    label=labels[method] + (f" (p̂ = {q:g})" if q is not None else ""))
            ax.fill_between(curve["step"], low, high, color=colors[method], alpha=0.2)
        ax.set(title=f"{p:.0%} of rewards flipped", xlabel="RL step", ylabel="clean (unflipped) training reward")
        ax.legend(loc="lower right")
    top = max(max(c["mean"]) + max(c["std"]) for c in (a["clean_curve"] for a in agg["arms"].values()))
    for ax in axes[:-1]:
        ax.set_ylim(0, min(1.0, top + 0.05))
    ax, width = axes[-1], 0.38
    for i, method in enumerate(METHODS):
        ems = [agg["arms"][arm_key(method, p)]["heldout_em_end"] for p in NOISE_LEVELS]
        xs = [j + (i - 0.5) * width for j in range(len(NOISE_LEVELS))]
        ax.bar(xs, [e["mean"] for e in ems], width, yerr=[e["std"] for e in ems], capsize=4, color=colors[method],
               label=labels[method])
    start = agg["sft_heldout_em"]["mean"]
    ax.axhline(start, color="black", linestyle="--", label=f"SFT warm start ({start:.2f})")
    ax.set_xticks(range(len(NOISE_LEVELS)), [f"{p:.0%}" for p in NOISE_LEVELS])
    ax.set(title="held-out greedy exact match after RL", xlabel="flip rate", ylabel="exact match", ylim=(0, 1))
    ax.legend(loc="upper right")
    fig.suptitle("E-G1: GRPO vs S-GRPO with synthetic reward flips (dr_grpo loss; mean ± std over seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def interpretation(agg: dict, checks: dict) -> str:
    """A few sentences generated from the measured numbers (a rerun cannot leave a stale interpretation)."""
    arms = agg["arms"]

    def fc(method, p):
        return arms[arm_key(method, p)]["final_clean"]["mean"]

    def em(method, p):
        return arms[arm_key(method, p)]["heldout_em_end"]["mean"]

    def gain(method, p):
        return arms[arm_key(method, p)]["gain"]

    def seeds_up(method, p):
        values = gain(method, p)["values"]
        return f"{sum(v > 0 for v in values)}/{len(values)}"

    start = statistics.fmean(a["start_clean"]["mean"] for a in arms.values())
    zeroed = arms[arm_key("sgrpo", CRITERION_NOISE)]["sgrpo_zero_weight_frac"]["mean"]
    zero_std = arms[arm_key("grpo", CRITERION_NOISE)]["frac_reward_zero_std"]["mean"]
    text = [
        f"From a clean training reward of {start:.3f} at step 1 (the warm start's samples), the final clean "
        "accuracy is " + ", ".join(f"{fc('grpo', p):.3f} (GRPO) / {fc('sgrpo', p):.3f} (S-GRPO) at {p:.0%}"
                                   for p in NOISE_LEVELS) + " flips.",
        f"GRPO's clean gain (final − step 1) goes from {gain('grpo', 0.0)['mean']:+.3f} without flips to "
        f"{gain('grpo', CRITERION_NOISE)['mean']:+.3f} at {CRITERION_NOISE:.0%} flips "
        f"({seeds_up('grpo', CRITERION_NOISE)} seeds > 0), S-GRPO's from {gain('sgrpo', 0.0)['mean']:+.3f} to "
        f"{gain('sgrpo', CRITERION_NOISE)['mean']:+.3f} ({seeds_up('sgrpo', CRITERION_NOISE)} seeds > 0).",
        f"At {CRITERION_NOISE:.0%} flips S-GRPO beats GRPO on {checks['a']['holds_in']} and ends "
        f"{checks['b']['gap']:+.3f} from its own noise-free run, so the criterion "
        + ("PASSES." if checks["a"]["passed"] and checks["b"]["passed"] else "FAILS."),
        "Held-out greedy exact match (SFT start " + f"{agg['sft_heldout_em']['mean']:.3f}) ends at "
        + ", ".join(f"{em('grpo', p):.3f} / {em('sgrpo', p):.3f}" for p in NOISE_LEVELS)
        + " (GRPO / S-GRPO at " + ", ".join(f"{p:.0%}" for p in NOISE_LEVELS) + f"); at {CRITERION_NOISE:.0%} "
        f"flips S-GRPO gave {zeroed:.0%} of its groups zero weight, while {zero_std:.0%} of GRPO's groups had "
        "identical (observed) rewards.",
    ]
    if not checks["a"]["passed"]:
        text.append(
            "A possible reason (not tested by this script): TRL's default optimiser, AdamW, divides each update by a "
            "running gradient scale, so S-GRPO's global shrinkage (w* ≤ 1 − 2p) largely cancels and what remains is "
            "that the zero-weight groups contribute nothing, i.e. fewer samples behind an update of the same size; "
            f"and with a success rate near {start:.2f} against p = {CRITERION_NOISE:g}, many groups sit where w* is "
            "0 or small.")
    return " ".join(text)


def markdown(result: dict, command: str) -> str:
    agg, checks, cfg = result["aggregated"], result["criteria"], result["config"]
    sizes = cfg["sizes"]

    def fmt(ms, digits=3):
        return f"{ms['mean']:.{digits}f} ± {ms['std']:.{digits}f}"

    def per_seed(ms):
        return ", ".join(f"{v:.3f}" for v in ms["values"])

    lines = [
        "# E-G1: GRPO vs S-GRPO under synthetic reward flips",
        "",
        f"Seeds {cfg['seeds']}, mean ± std over seeds. Task: `a+b=` with operands in [0, {MAX_OPERAND}], "
        f"{sizes['num_test']} held-out problems. Warm start: NLL SFT ({sizes['sft_epochs']} epochs over "
        f"{sizes['sft_examples']} examples, LR {sizes['sft_lr']:g}). RL: {sizes['grpo_steps']} steps of "
        f"{sizes['grpo_prompts']} prompts × G = {sizes['num_generations']}, LR {sizes['grpo_lr']:g} constant, "
        "`loss_type=\"dr_grpo\"`, β = 0, temperature 1. Final clean = mean unflipped training reward over the last "
        f"{sizes['final_window']} steps; held-out EM = greedy exact match after RL.",
        "",
        f"SFT warm start held-out EM: {fmt(agg['sft_heldout_em'])} (per seed {per_seed(agg['sft_heldout_em'])})",
        "",
        "| flips | method | sgrpo_noise_p | clean at step 1 | final clean | per seed | gain (final − step 1) | "
        "seeds with gain > 0 | held-out EM | S-GRPO zero-weight groups |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in NOISE_LEVELS:
        for method in METHODS:
            arm = agg["arms"][arm_key(method, p)]
            q = assumed_noise(method, p)
            zero = fmt(arm["sgrpo_zero_weight_frac"], 2) if "sgrpo_zero_weight_frac" in arm else "–"
            lines.append(f"| {p:.0%} | {'S-GRPO' if method == 'sgrpo' else 'GRPO'} | "
                         f"{'–' if q is None else f'{q:g}'} | {fmt(arm['start_clean'])} | {fmt(arm['final_clean'])} | "
                         f"{per_seed(arm['final_clean'])} | {fmt(arm['gain'])} | "
                         f"{sum(g > 0 for g in arm['gain']['values'])}/{len(arm['gain']['values'])} | "
                         f"{fmt(arm['heldout_em_end'])} | {zero} |")
    lines += ["", "| criterion | result | seeds where it holds |", "|---|---|---|"]
    for name, check in checks.items():
        lines.append(f"| ({name}) {check['criterion']} | {'PASS' if check['passed'] else 'FAIL'} | "
                     f"{check['holds_in']} |")
    passed = all(c["passed"] for c in checks.values())
    wall = f"Wall time of this run: {result['wall_seconds']:.0f} s (SFT cached: {result['sft_cached']})."
    lines += ["", f"Overall: **{'PASS' if passed else 'FAIL'}**.", "", "## Interpretation", "",
              interpretation(agg, checks), "", "## Rerun", "", f"    {command}", "", wall, ""]
    return "\n".join(lines)


def quiet() -> None:
    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    logging.getLogger("hf_stable").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output_dir", default=str(ROOT / "results"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--quick", action="store_true", help="tiny sizes and one seed (smoke test, < 60 s)")
    cli = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    quiet()
    sizes = QUICK if cli.quick else Sizes()
    seeds = cli.seeds[:1] if cli.quick else cli.seeds
    start = time.time()
    cached = all((sft_cache_dir(s, sizes) / "done.json").exists() for s in seeds)
    per_seed = {str(seed): run_seed(seed, sizes) for seed in seeds}
    agg = aggregate(per_seed)
    checks = criteria(per_seed, agg)
    command = f"OMP_NUM_THREADS=1 .venv/bin/python experiments/{NAME}.py" + (" --quick" if cli.quick else "")
    if cli.seeds != [0, 1, 2]:
        command += " --seeds " + " ".join(map(str, seeds))
    result = {
        "experiment": "E-G1 S-GRPO under synthetic reward flips (arXiv 2508.05928)",
        "config": {"seeds": seeds, "quick": cli.quick, "sizes": asdict(sizes), "noise_levels": list(NOISE_LEVELS),
                   "methods": list(METHODS), "sgrpo_noise_p": {arm_key("sgrpo", p): assumed_noise("sgrpo", p)
                                                               for p in NOISE_LEVELS},
                   "max_operand": MAX_OPERAND, "split_seed": SPLIT_SEED, "loss_type": "dr_grpo", "beta": 0.0,
                   "clean_metric": CLEAN_KEY, "pilot": PILOT, "torch_threads": torch.get_num_threads()},
        "per_seed": per_seed, "aggregated": agg, "criteria": checks,
        "passed": all(c["passed"] for c in checks.values()),
        "wall_seconds": time.time() - start, "sft_cached": cached, "command": command,
    }
    out = Path(cli.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{NAME}.json").write_text(json.dumps(result, indent=1))
    plot(agg, out / f"{NAME}.png")
    (out / f"{NAME}.md").write_text(markdown(result, command))
    for name, check in checks.items():
        print(f"({name}) {'PASS' if check['passed'] else 'FAIL'}: {check['criterion']}  holds in {check['holds_in']}  "
              f"per seed {check['per_seed']}")
    print(f"overall {'PASS' if result['passed'] else 'FAIL'}; wall time {result['wall_seconds']:.0f}s -> "
          f"{out / NAME}.{{json,png,md}}")


if __name__ == "__main__":
    main()
