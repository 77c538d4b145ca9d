"""E-G1 S-GRPO under reward noise: does noise-aware shrinkage beat GRPO when binary rewards are flipped?

Claim (S-GRPO, arXiv 2508.05928). S-GRPO multiplies GRPO's group z-scored advantage by the noise-aware shrinkage
`w*(G, k, p)`, which is 0 for groups whose success count a flip could explain and `1 - 2p` at balanced groups. The
paper's headline: under synthetic reward flips standard GRPO stops learning while S-GRPO keeps improving.

Redesign (pre-registered here, before any run of this design). A review of the first design found that (1) under
i.i.d. symmetric flips the observed reward is an affine function of the clean one, so GRPO's expected direction is
already right and S-GRPO can only lower the signal-to-noise ratio; (2) noise-free GRPO lowered the held-out accuracy
(0.403 → 0.357), so the task did not show that RL helps at all; (3) the LR came from a noise-free GRPO pilot and was
shared by every arm although S-GRPO's w* ≤ 1 − 2p shrinks its step. So:
* Two noise models: `iid` (the paper's own: every reward flipped independently with p = 0.2) and `one_per_group`
  (within-group correlated: exactly one uniformly chosen completion of every group of G = 8 flipped, marginal rate
  1/G = 0.125; a group whose success pattern one flip explains, k = 1 or 7, then carries no signal, which is the
  premise of S-GRPO's shrinkage). S-GRPO's `sgrpo_noise_p` is the true marginal rate (0.2 or 0.125).
* A noise-free GRPO control.
* Every arm (control, GRPO and S-GRPO under each noise model) runs at LR 3e-4 and 6e-4 (6e-4 ≈ 3e-4 / (1 − 2·0.2),
  S-GRPO's matched step at its balanced-group weight); each arm is reported at its own best LR, the one with the
  higher seed-mean clean training reward averaged over the whole run.
* Sizes are unchanged from the first design (below); the control shows whether RL helps on this task at all.

Design (unchanged from the first design except the arms above).
* Task: addition of two operands in [0, 19] (`12+7=` -> `19`), one char per token (`hf_stable.testing` tiny Llama,
  hidden 64, 2 layers, ~90k parameters). The 400 problems are split once (split seed 1234, independent of the run
  seed) into 100 held-out test problems and a 300-problem training pool; SFT and GRPO only see the pool.
* Warm start: NLL SFT (`StableSFTTrainer`, defaults = TRL's SFT) from a random init (seeded by the run seed) on
  samples of the pool, linear LR decay, sized to stop at a moderate held-out greedy accuracy so RL has room to
  improve. Cached under `experiments/cache/grpo_reward_noise/` and loaded fresh for every RL run.
* RL: `StableGRPOTrainer`, `loss_type="dr_grpo"`, `beta=0`, G = 8 completions per prompt, 16 prompts per step,
  temperature 1, on-policy, constant LR, 300 steps, the same seed and prompt stream for every arm. Flips come from a
  private RNG seeded by the run seed (`hf_stable.rewards.noise.noisy_reward` for `iid`; a wrapper in this script for
  `one_per_group`, which relies on TRL scoring each prompt's G completions consecutively).
* Metrics: the clean (unflipped) training reward `arithmetic_reward/clean`, averaged over each 10-step logging
  window, plus step 1 alone; greedy exact match on the 100 held-out problems every 25 steps and at the end. "Final
  clean accuracy" = mean clean reward over the last 50 steps.
* Seeds 0, 1, 2; mean ± sample std over seeds.

Pass criteria (pre-registered; printed PASS/FAIL as measured; a failure is a non-replication):
  (control) noise-free GRPO at its best LR: final clean accuracy ≥ its step-1 value + 0.05 and held-out greedy EM at
            the end ≥ the warm start's − 0.02 (the task is learnable by RL without degrading held-out accuracy);
  (iid)     under i.i.d. flips (p = 0.2), S-GRPO's final clean accuracy > GRPO's, each at its best LR (seed means);
  (group)   the same under one flip per group.

Command (three seeds; each seed is cached on its own):
    OMP_NUM_THREADS=1 .venv/bin/python experiments/grpo_reward_noise.py
Quick smoke run (1 seed, tiny sizes; its pass/fail means nothing):
    OMP_NUM_THREADS=1 .venv/bin/python experiments/grpo_reward_noise.py --quick --out /tmp/grpo_reward_noise
"""

from __future__ import annotations

import hashlib
import json
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from _harness import Experiment, criterion, fmt, mean_std, run, seeds_holding


NAME = "grpo_reward_noise"
ROOT = Path(__file__).resolve().parent
SPLIT_SEED = 1234
MAX_OPERAND = 19
NOISE_MODELS = {"none": 0.0, "iid": 0.2, "one_per_group": 0.125}  # model -> marginal flip rate
ARMS = (("none", "grpo"), ("iid", "grpo"), ("iid", "sgrpo"), ("one_per_group", "grpo"), ("one_per_group", "sgrpo"))
LRS = (3e-4, 6e-4)
REWARD_NAME = "arithmetic_reward"
CLEAN_KEY = f"{REWARD_NAME}/clean"
CONTROL_GAIN, EM_TOLERANCE = 0.05, 0.02
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
    max_completion_length: int = 4  # answers have <= 2 digits, + eos
    temperature: float = 1.0
    logging_steps: int = 10
    eval_every: int = 25
    final_window: int = 50  # steps averaged into the final clean accuracy
    hidden_size: int = 64


QUICK = Sizes(
    sft_examples=600, sft_epochs=4, grpo_steps=12, grpo_prompts=4, logging_steps=4, eval_every=6, final_window=4
)


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
    return {
        "sft": Dataset.from_list(rows(sft)),
        "grpo": Dataset.from_list(rows(prompts)),
        "test": Dataset.from_list(rows(test)),
    }


def heldout_em(model, tokenizer, test) -> float:
    from hf_stable.testing import evaluate_completions

    return evaluate_completions(model, tokenizer, test, batch_size=len(test), max_new_tokens=4)["exact_match"]


# ---------------------------------------------------------------------------------------------------------------------
# warm start


def sft_cache_dir(seed: int, sizes: Sizes) -> Path:
    fields = {k: v for k, v in asdict(sizes).items() if k.startswith("sft") or k in ("hidden_size", "num_test")}
    key = hashlib.sha1(
        json.dumps({**fields, "max_operand": MAX_OPERAND, "split": SPLIT_SEED}, sort_keys=True).encode()
    )
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
    model, tokenizer = build_tiny_model(
        seed=seed, hidden_size=sizes.hidden_size, intermediate_size=2 * sizes.hidden_size, max_position_embeddings=32
    )
    with tempfile.TemporaryDirectory() as tmp:
        args = StableSFTConfig(
            output_dir=tmp,
            seed=seed,
            learning_rate=sizes.sft_lr,
            per_device_train_batch_size=sizes.sft_batch,
            num_train_epochs=sizes.sft_epochs,
            lr_scheduler_type="linear",
            logging_steps=50,
            max_length=32,
            use_cpu=True,
            bf16=False,
            gradient_checkpointing=False,
            report_to="none",
            save_strategy="no",
            disable_tqdm=True,
            dataloader_num_workers=0,
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


def one_flip_per_group(fn, group: int, seed: int, name: str):
    """Wrap a binary reward so exactly one uniformly chosen completion of every consecutive group of `group` has its
    reward flipped; the clean mean is logged as `<name>/clean` (through `noisy_reward` at flip rate 0)."""
    from hf_stable.rewards.noise import noisy_reward

    logged, rng = noisy_reward(fn, 0.0, seed=seed, name=name), random.Random(seed)

    def wrapped(*args, **kwargs):
        rewards = list(logged(*args, **kwargs))
        if len(rewards) % group:
            raise RuntimeError(f"{len(rewards)} rewards do not split into groups of {group}")
        for start in range(0, len(rewards), group):
            i = start + rng.randrange(group)
            if rewards[i] is not None:
                rewards[i] = 1.0 - rewards[i]
        return rewards

    wrapped.__name__ = name
    return wrapped


def make_reward(noise: str, seed: int, group: int):
    from hf_stable.rewards.noise import noisy_reward
    from hf_stable.testing import arithmetic_reward

    if noise == "one_per_group":
        return one_flip_per_group(arithmetic_reward, group, seed, REWARD_NAME)
    return noisy_reward(arithmetic_reward, NOISE_MODELS[noise], seed=seed, name=REWARD_NAME)


def grpo_config(output_dir: str, seed: int, method: str, noise: str, lr: float, sizes: Sizes):
    from hf_stable import StableGRPOConfig

    estimator = (
        {"advantage_estimator": "sgrpo", "sgrpo_noise_p": NOISE_MODELS[noise], "correctness_reward_index": 0}
        if method == "sgrpo"
        else {}
    )
    return StableGRPOConfig(
        output_dir=output_dir,
        seed=seed,
        learning_rate=lr,
        lr_scheduler_type="constant",
        max_steps=sizes.grpo_steps,
        per_device_train_batch_size=sizes.grpo_prompts * sizes.num_generations,
        num_generations=sizes.num_generations,
        max_completion_length=sizes.max_completion_length,
        temperature=sizes.temperature,
        beta=0.0,
        loss_type="dr_grpo",
        logging_steps=sizes.logging_steps,
        logging_first_step=True,
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        **estimator,
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


def run_rl(seed: int, method: str, noise: str, lr: float, sizes: Sizes, data: dict, sft_path: Path) -> dict:
    """One RL arm from the SFT warm start: clean-reward curve, held-out EM curve and finals."""
    from transformers import PrinterCallback

    from hf_stable import StableGRPOTrainer

    start = time.time()
    model, tokenizer = load_checkpoint(sft_path)
    callback = make_heldout_callback(tokenizer, data["test"], sizes.eval_every)
    reward = make_reward(noise, seed, sizes.num_generations)
    with tempfile.TemporaryDirectory() as tmp:
        args = grpo_config(tmp, seed, method, noise, lr, sizes)
        trainer = StableGRPOTrainer(
            model=model,
            reward_funcs=[reward],
            args=args,
            train_dataset=data["grpo"],
            processing_class=tokenizer,
            callbacks=[callback],
        )
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
        "heldout_em_start": callback.points[0]["exact_match"],
        "heldout_em_end": callback.points[-1]["exact_match"],
        "clean_curve": clean,
        "observed_curve": observed,
        "heldout_curve": callback.points,
        "frac_reward_zero_std": statistics.fmean(p["value"] for p in log_series(history, "frac_reward_zero_std")),
        "steps": steps,
        "seconds": time.time() - start,
    }
    result["gain"] = result["final_clean"] - result["start_clean"]
    result["mean_clean"] = statistics.fmean(p["value"] for p in clean)
    if method == "sgrpo":
        for key in ("zero_weight_frac", "mean_weight"):
            result[f"sgrpo_{key}"] = statistics.fmean(
                p["value"] for p in log_series(history, f"stable/grpo/sgrpo/{key}")
            )
    print(
        f"[seed {seed}] {method:5s} {noise} lr {lr:g}: clean {result['start_clean']:.3f} -> "
        f"{result['final_clean']:.3f}  held-out EM {result['heldout_em_start']:.3f} -> "
        f"{result['heldout_em_end']:.3f}  ({steps} steps, {result['seconds']:.0f}s)",
        flush=True,
    )
    return result


def arm_key(noise: str, method: str, lr: float | None = None) -> str:
    return f"{noise}/{method}" + ("" if lr is None else f"/lr{lr:g}")


def run_seed(seed: int, sizes: Sizes) -> dict:
    data = seed_data(seed, sizes)
    path = run_sft(seed, sizes, data)
    model, tokenizer = load_checkpoint(path)
    start_em = heldout_em(model, tokenizer, data["test"])
    print(f"[seed {seed}] SFT warm start: held-out greedy EM {start_em:.3f}", flush=True)
    arms = {
        arm_key(noise, method, lr): run_rl(seed, method, noise, lr, sizes, data, path)
        for noise, method in ARMS
        for lr in LRS
    }
    return {"sft_heldout_em": start_em, "arms": arms}


# ---------------------------------------------------------------------------------------------------------------------
# aggregation, criteria, outputs


def mean_curve(curves: list[list[dict]], key: str) -> dict:
    """Seed mean and std at each recorded step (every seed records the same steps)."""
    steps = [p["step"] for p in curves[0]]
    columns = [[c[i][key] for c in curves] for i in range(len(steps))]
    return {
        "step": steps,
        "mean": [statistics.fmean(c) for c in columns],
        "std": [statistics.stdev(c) if len(c) > 1 else 0.0 for c in columns],
    }


def aggregate(per_seed: dict, sizes: Sizes | None = None) -> dict:
    seeds = list(per_seed)
    out = {"sft_heldout_em": mean_std([per_seed[s]["sft_heldout_em"] for s in seeds]), "runs": {}, "best": {}}
    for key in per_seed[seeds[0]]["arms"]:
        arms = [per_seed[s]["arms"][key] for s in seeds]
        agg = {k: mean_std([a[k] for a in arms]) for k in arms[0] if isinstance(arms[0][k], float)}
        agg["clean_curve"] = mean_curve([a["clean_curve"] for a in arms], "value")
        agg["heldout_curve"] = mean_curve([a["heldout_curve"] for a in arms], "exact_match")
        out["runs"][key] = agg
    for noise, method in ARMS:  # each arm at its own best LR: the highest seed-mean clean reward over the run
        lr = max(LRS, key=lambda lr: out["runs"][arm_key(noise, method, lr)]["mean_clean"]["mean"])
        out["best"][arm_key(noise, method)] = {"lr": lr, **out["runs"][arm_key(noise, method, lr)]}
    return out


def control_holds(record: dict, lr: float) -> bool:
    run = record["arms"][arm_key("none", "grpo", lr)]
    return run["gain"] >= CONTROL_GAIN and run["heldout_em_end"] >= record["sft_heldout_em"] - EM_TOLERANCE


def criteria(per_seed: dict, agg: dict, sizes: Sizes | None = None) -> dict:
    best, seeds = agg["best"], list(per_seed)

    def final(s, noise, method):
        return per_seed[s]["arms"][arm_key(noise, method, best[arm_key(noise, method)]["lr"])]

    ctl = best[arm_key("none", "grpo")]
    start_em = agg["sft_heldout_em"]["mean"]
    checks = {
        "control": criterion(
            f"noise-free GRPO (best LR): final clean ≥ step 1 + {CONTROL_GAIN} and held-out EM ≥ warm start − "
            f"{EM_TOLERANCE}",
            ctl["gain"]["mean"] >= CONTROL_GAIN and ctl["heldout_em_end"]["mean"] >= start_em - EM_TOLERANCE,
            {
                "gain": ctl["gain"]["mean"],
                "heldout_em_end": ctl["heldout_em_end"]["mean"],
                "warm_start_em": start_em,
                "lr": ctl["lr"],
            },
            seeds_holding(
                per_seed,
                lambda r: (
                    r["arms"][arm_key("none", "grpo", ctl["lr"])]["gain"] >= CONTROL_GAIN
                    and r["arms"][arm_key("none", "grpo", ctl["lr"])]["heldout_em_end"]
                    >= r["sft_heldout_em"] - EM_TOLERANCE
                ),
            ),
        )
    }
    for noise, label in (("iid", "i.i.d. flips p = 0.2"), ("one_per_group", "one flip per group")):
        s_arm, g_arm = best[arm_key(noise, "sgrpo")], best[arm_key(noise, "grpo")]
        holds = sum(final(s, noise, "sgrpo")["final_clean"] > final(s, noise, "grpo")["final_clean"] for s in seeds)
        checks["iid" if noise == "iid" else "group"] = criterion(
            f"{label}: S-GRPO final clean > GRPO's, each at its best LR",
            s_arm["final_clean"]["mean"] > g_arm["final_clean"]["mean"],
            {
                "sgrpo": s_arm["final_clean"]["mean"],
                "grpo": g_arm["final_clean"]["mean"],
                "sgrpo_lr": s_arm["lr"],
                "grpo_lr": g_arm["lr"],
            },
            f"{holds}/{len(seeds)} seeds",
        )
    return checks


COLORS = {
    "none/grpo": "tab:green",
    "iid/grpo": "tab:red",
    "iid/sgrpo": "tab:blue",
    "one_per_group/grpo": "tab:orange",
    "one_per_group/sgrpo": "tab:purple",
}
LABELS = {
    "none/grpo": "GRPO, no noise",
    "iid/grpo": "GRPO, i.i.d. 0.2",
    "iid/sgrpo": "S-GRPO, i.i.d. 0.2",
    "one_per_group/grpo": "GRPO, 1 flip/group",
    "one_per_group/sgrpo": "S-GRPO, 1 flip/group",
}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    agg = result["aggregate"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.4))
    panels = (("iid", "i.i.d. flips, p = 0.2"), ("one_per_group", "one flip per group (p = 0.125)"))
    for ax, (noise, title) in zip(axes, panels, strict=False):
        for key in ("none/grpo", f"{noise}/grpo", f"{noise}/sgrpo"):
            arm = agg["best"][key]
            curve = arm["clean_curve"]
            ax.plot(curve["step"], curve["mean"], color=COLORS[key], label=f"{LABELS[key]} (LR {arm['lr']:g})")
            ax.fill_between(
                curve["step"],
                [m - s for m, s in zip(curve["mean"], curve["std"], strict=True)],
                [m + s for m, s in zip(curve["mean"], curve["std"], strict=True)],
                color=COLORS[key],
                alpha=0.15,
            )
        ax.set(title=title, xlabel="RL step", ylabel="clean (unflipped) training reward")
        ax.legend(loc="lower right", fontsize=8)
    ax = axes[-1]
    keys = list(agg["best"])
    ems = [agg["best"][k]["heldout_em_end"] for k in keys]
    ax.bar(
        range(len(keys)),
        [e["mean"] for e in ems],
        yerr=[e["std"] for e in ems],
        capsize=4,
        color=[COLORS[k] for k in keys],
    )
    ax.axhline(agg["sft_heldout_em"]["mean"], color="black", linestyle="--", label="SFT warm start")
    ax.set_xticks(range(len(keys)), [LABELS[k] for k in keys], rotation=20, fontsize=8)
    ax.set(title="held-out greedy exact match after RL (best LR)", ylabel="exact match", ylim=(0, 1))
    ax.legend(loc="upper right")
    fig.suptitle("E-G1: GRPO vs S-GRPO under reward flips (dr_grpo loss; each arm at its best LR; mean ± std)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(result: dict) -> str:
    agg, cfg = result["aggregate"], result["config"]
    sizes = cfg["sizes"]

    def per_seed(ms):
        return ", ".join(f"{v:.3f}" for v in ms["values"])

    lines = [
        f"Mean ± std over seeds. Task: `a+b=` with operands in [0, {MAX_OPERAND}], {sizes['num_test']} held-out "
        f"problems. Warm start: NLL SFT ({sizes['sft_epochs']} epochs over {sizes['sft_examples']} examples, LR "
        f"{sizes['sft_lr']:g}). RL: {sizes['grpo_steps']} steps of {sizes['grpo_prompts']} prompts × G = "
        f'{sizes["num_generations"]}, LR ∈ {list(LRS)} constant (each arm at its best), `loss_type="dr_grpo"`, '
        "β = 0, temperature 1. Final clean = mean unflipped training reward over the last "
        f"{sizes['final_window']} steps; mean clean = over the whole run (selects the LR); held-out EM = greedy "
        "exact match after RL.",
        "",
        f"SFT warm start held-out EM: {fmt(agg['sft_heldout_em'])} (per seed {per_seed(agg['sft_heldout_em'])})",
        "",
        "| noise | method | LR | mean clean | clean at step 1 | final clean | per seed | held-out EM | S-GRPO "
        "zero-weight groups |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key, arm in agg["runs"].items():
        noise, method, lr = key.split("/")
        best = agg["best"][f"{noise}/{method}"]["lr"] == float(lr[2:])
        zero = fmt(arm["sgrpo_zero_weight_frac"], 2) if "sgrpo_zero_weight_frac" in arm else "–"
        lines.append(
            f"| {noise} | {'S-GRPO' if method == 'sgrpo' else 'GRPO'} | {lr[2:]}{' (best)' if best else ''} "
            f"| {fmt(arm['mean_clean'])} | {fmt(arm['start_clean'])} | {fmt(arm['final_clean'])} | "
            f"{per_seed(arm['final_clean'])} | {fmt(arm['heldout_em_end'])} | {zero} |"
        )
    lines += ["", "## Interpretation", "", interpretation(agg, result["criteria"])]
    return "\n".join(lines)


def interpretation(agg: dict, checks: dict) -> str:
    """Sentences generated from the measured numbers (a rerun cannot leave a stale interpretation)."""
    best = agg["best"]
    ctl = best["none/grpo"]
    text = [
        f"Noise-free GRPO (LR {ctl['lr']:g}) moves the clean training reward by {ctl['gain']['mean']:+.3f} and ends "
        f"at held-out EM {ctl['heldout_em_end']['mean']:.3f} from the warm start's "
        f"{agg['sft_heldout_em']['mean']:.3f}: the control {'PASSES' if checks['control']['passed'] else 'FAILS'}.",
    ]
    for noise, label in (("iid", "i.i.d. flips"), ("one_per_group", "one flip per group")):
        g, sg = best[f"{noise}/grpo"], best[f"{noise}/sgrpo"]
        text.append(
            f"Under {label}: GRPO (LR {g['lr']:g}) final clean {g['final_clean']['mean']:.3f}, S-GRPO "
            f"(LR {sg['lr']:g}) {sg['final_clean']['mean']:.3f}, S-GRPO zeroing "
            f"{sg['sgrpo_zero_weight_frac']['mean']:.0%} of its mixed groups."
        )
    return " ".join(text)


EXPERIMENT = Experiment(
    name=NAME,
    title="E-G1: GRPO vs S-GRPO under synthetic reward flips",
    claim="Under reward flips S-GRPO's noise-aware shrinkage keeps learning where GRPO stalls; tested under the "
    "paper's i.i.d. flips and under one correlated flip per group, each arm at its best LR, with a noise-free control "
    "(S-GRPO, arXiv 2508.05928).",
    sizes=Sizes(),
    quick_sizes=QUICK,
    run_seed=run_seed,
    aggregate=aggregate,
    criteria=criteria,
    plot=plot,
    markdown=markdown,
    config={
        "noise_models": NOISE_MODELS,
        "arms": [list(a) for a in ARMS],
        "lrs": list(LRS),
        "max_operand": MAX_OPERAND,
        "split_seed": SPLIT_SEED,
        "loss_type": "dr_grpo",
        "beta": 0.0,
        "clean_metric": CLEAN_KEY,
        "pilot": PILOT,
    },
    script=__file__,
)


if __name__ == "__main__":
    run(EXPERIMENT)
