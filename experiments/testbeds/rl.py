"""The RL testbed: a task where plain GRPO measurably raises held-out accuracy, so a method's effect can be read.

Task: `a+b=` with operands 0..99 on the tiny offline Llama (`hf_stable.testing.build_tiny_model` defaults: hidden 64,
2 layers, ~90k parameters, one character per token), exact-match reward.

* Held-out: `HELDOUT` problems dealt once (split seed `SPLIT_SEED`, whatever the run seed); no training row of any
  seed, SFT or RL, contains one of them (`hf_stable.testing.arithmetic_splits`).
* Warm start: NLL SFT (`StableSFTTrainer` at its defaults = TRL's SFT) from a random init, seeded by the run seed, on
  `sft_problems` distinct problems for `sft_steps` steps, written by an imperfect demonstrator: a share
  `sft_carry_error` of the rows with a carry show the carry dropped (`hf_stable.testing.with_carry_errors`). The
  warm start learns addition with a wrong carry rule that the verifier's reward can correct. (Without it, a warm
  start made by stopping SFT early on plenty of data sits just before a jump in accuracy, and one trained long on
  few problems is limited by what they teach; GRPO raised neither.) Trained once, cached under
  `experiments/cache/testbeds/rl/` keyed by its settings, the seed and the code digest (these sources and the library).
* RL prompts: fresh problems of the same seed, disjoint from its SFT rows and from the held-out set.
* RL: `StableGRPOTrainer` at its defaults (= TRL's `GRPOTrainer`: its default loss and advantages), beta 0, G = 8,
  temperature 1, full fine-tuning (LoRA and LR 3e-5 moved little in a probe; 3e-4 degraded).
* The control that must pass (`control_verdict`): plain GRPO raises held-out greedy exact match by at least
  `CONTROL_GAIN` with a 95% t-interval over seeds that excludes 0. The LR and step count were chosen on the separate
  seed `TUNING_SEED` (`experiments/grpo_rl_control.py` records that run).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path


HERE = Path(__file__).resolve().parent
EXPERIMENTS = HERE.parent
CACHE = EXPERIMENTS / "cache" / "testbeds" / "rl"
SPLIT_SEED = 20_260  # deals the held-out problems; independent of every run seed
HELDOUT = 300
TUNING_SEED = 100  # the seed the LR and step count were chosen on; never reported as evidence
CONTROL_GAIN = 0.10  # held-out exact-match points plain GRPO must add (the control that must pass)
REWARD_NAME = "arithmetic_reward"


@dataclass(frozen=True)
class Recipe:
    """Every setting of the testbed; the warm start's cache key is made of the `sft_*` fields and `hidden_size`."""

    sft_problems: int = 800
    sft_carry_error: float = 0.0  # share of the SFT rows with a carry whose demonstration drops it (a+b-10)
    sft_steps: int = 1200
    sft_batch: int = 64
    sft_lr: float = 3e-3
    hidden_size: int = 64
    rl_lr: float = 1e-4
    rl_steps: int = 600
    rl_prompts: int = 8  # prompts per step, each with `num_generations` completions
    num_generations: int = 8
    max_completion_length: int = 4  # answers have <= 3 digits, + eos
    temperature: float = 1.0
    lr_scheduler: str = "constant"
    eval_every: int = 100
    logging_steps: int = 10


QUICK = Recipe(sft_problems=200, sft_steps=40, rl_steps=6, rl_prompts=4, eval_every=3, logging_steps=2)


# ---------------------------------------------------------------------------------------------------------------------
# data


def heldout():
    """The held-out problems (a `Dataset`), the same for every seed and every experiment on this testbed."""
    from hf_stable.testing import arithmetic_splits

    return arithmetic_splits({"heldout": HELDOUT}, seed=SPLIT_SEED)["heldout"]


def seed_data(seed: int, recipe: Recipe) -> dict:
    """``heldout``, and the seed's ``sft`` rows and ``rl`` prompt pool: three pairwise disjoint sets of problems."""
    from hf_stable.testing import arithmetic_splits, with_carry_errors

    test = heldout()
    train = arithmetic_splits({"sft": recipe.sft_problems, "rl": None}, seed=seed, exclude=test["prompt"])
    if recipe.sft_carry_error:
        train["sft"] = with_carry_errors(train["sft"], recipe.sft_carry_error, seed)
    return {"heldout": test, **train}


def rl_prompts(data: dict, seed: int, recipe: Recipe):
    """The RL prompt stream: `rl_steps × rl_prompts` fresh problems (no repeats while the pool lasts)."""
    pool = data["rl"].shuffle(seed=seed)
    need = recipe.rl_steps * recipe.rl_prompts
    if need <= len(pool):
        return pool.select(range(need))
    from datasets import concatenate_datasets

    return concatenate_datasets([pool] * math.ceil(need / len(pool))).select(range(need))


def heldout_em(model, tokenizer, test) -> float:
    from hf_stable.testing import evaluate_completions

    return evaluate_completions(model, tokenizer, test, batch_size=len(test), max_new_tokens=4)["exact_match"]


# ---------------------------------------------------------------------------------------------------------------------
# warm start


def code_digest() -> str:
    """sha1 of this module, the package's `__init__` and the library sources the scripts on this testbed load.

    Those sources are the union of the `library_deps.json` entries of the scripts that import this module (a script
    without an entry brings every source), so a change to a part of the library no RL script loads (the merge
    engine, the evaluation scorers) keeps the finished runs. `rl_recipe.py` (the chosen LR and step count) is left
    out: its values enter each run's key themselves, so a new choice keeps the runs already made (the harness still
    digests it, so results that use it go stale)."""
    if str(EXPERIMENTS) not in sys.path:
        sys.path.insert(0, str(EXPERIMENTS))
    from _harness import REPO, library_sources

    sources = sorted({path for script in testbed_scripts() for path in library_sources(str(script))})
    h = hashlib.sha1()
    for path in [HERE / "__init__.py", HERE / "rl.py", *sources]:
        h.update(path.relative_to(REPO).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def testbed_scripts() -> list[Path]:
    """The experiment scripts that import this module (`from testbeds import rl`)."""
    pattern = re.compile(r"^from testbeds import (.*, )?rl\b", re.MULTILINE)
    return sorted(p for p in EXPERIMENTS.glob("*.py") if pattern.search(p.read_text()))


def warm_start_dir(seed: int, recipe: Recipe) -> Path:
    fields = {k: v for k, v in asdict(recipe).items() if k.startswith("sft_") or k == "hidden_size"}
    key = {**fields, "seed": seed, "heldout": HELDOUT, "split_seed": SPLIT_SEED, "code": code_digest()}
    return CACHE / f"warm_seed{seed}_{hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]}"


def load(path: Path):
    """A fresh model from disk (never a deep copy of a model a TRL trainer has patched) and the tiny tokenizer."""
    from transformers import AutoModelForCausalLM

    from hf_stable.testing import build_tiny_tokenizer

    return AutoModelForCausalLM.from_pretrained(path), build_tiny_tokenizer()


def warm_start(seed: int, recipe: Recipe, data: dict | None = None) -> tuple[Path, dict]:
    """Train (or reuse the cached) SFT warm start of `seed`: (its folder, {heldout_em, sft_train_em, cpu_s, ...})."""
    from transformers import PrinterCallback

    from hf_stable import StableSFTConfig, StableSFTTrainer
    from hf_stable.testing import build_tiny_model, evaluate_completions

    path = warm_start_dir(seed, recipe)
    if (path / "done.json").exists():
        return path, json.loads((path / "done.json").read_text())
    data = data or seed_data(seed, recipe)
    wall, cpu = time.time(), time.process_time()
    model, tokenizer = build_tiny_model(
        seed=seed, hidden_size=recipe.hidden_size, intermediate_size=2 * recipe.hidden_size
    )
    with tempfile.TemporaryDirectory() as tmp:
        args = StableSFTConfig(
            output_dir=tmp,
            seed=seed,
            max_steps=recipe.sft_steps,
            per_device_train_batch_size=recipe.sft_batch,
            learning_rate=recipe.sft_lr,
            lr_scheduler_type="cosine",
            warmup_steps=min(20, recipe.sft_steps // 10),
            max_length=32,
            logging_steps=100,
            use_cpu=True,
            bf16=False,
            report_to="none",
            save_strategy="no",
            disable_tqdm=True,
            dataloader_num_workers=0,
        )
        trainer = StableSFTTrainer(model=model, args=args, train_dataset=data["sft"], processing_class=tokenizer)
        trainer.remove_callback(PrinterCallback)
        trainer.train()
    info = {
        "heldout_em": heldout_em(model, tokenizer, data["heldout"]),
        "sft_train_em": evaluate_completions(model, tokenizer, data["sft"], batch_size=400, max_new_tokens=4)[
            "exact_match"
        ],
        "steps": trainer.state.global_step,
        "wall_s": time.time() - wall,
        "cpu_s": time.process_time() - cpu,
    }
    import shutil

    tmp_path = path.with_name(f"{path.name}.tmp{os.getpid()}")  # two scripts may train the same warm start at once
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    (tmp_path / "done.json").write_text(json.dumps(info))
    if (path / "done.json").exists():  # another process finished it first: keep theirs
        shutil.rmtree(tmp_path)
        return path, json.loads((path / "done.json").read_text())
    if path.exists():  # a half-written folder of an interrupted run
        shutil.rmtree(path)
    tmp_path.rename(path)
    return path, info


# ---------------------------------------------------------------------------------------------------------------------
# RL


def grpo_config(output_dir: str, seed: int, recipe: Recipe, **overrides):
    """`StableGRPOConfig` at its defaults (TRL's loss and advantages) with the testbed's sizes; `overrides` (e.g. an
    advantage estimator, for a method's experiment) replace or add fields."""
    from hf_stable import StableGRPOConfig

    settings = dict(
        output_dir=output_dir,
        seed=seed,
        learning_rate=recipe.rl_lr,
        lr_scheduler_type=recipe.lr_scheduler,
        max_steps=recipe.rl_steps,
        per_device_train_batch_size=recipe.rl_prompts * recipe.num_generations,
        num_generations=recipe.num_generations,
        max_completion_length=recipe.max_completion_length,
        temperature=recipe.temperature,
        beta=0.0,
        logging_steps=recipe.logging_steps,
        logging_first_step=True,
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    return StableGRPOConfig(**{**settings, **overrides})


def _heldout_callback(tokenizer, test, every: int):
    from transformers import TrainerCallback

    class HeldoutEM(TrainerCallback):
        """Held-out greedy exact match at step 0, every `every` steps and at the end."""

        def __init__(self):
            self.points: list[list] = []

        def record(self, step, model):
            if not self.points or self.points[-1][0] != step:
                self.points.append([step, heldout_em(model, tokenizer, test)])

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            self.record(0, model)

        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step % every == 0:
                self.record(state.global_step, model)

        def on_train_end(self, args, state, control, model=None, **kwargs):
            self.record(state.global_step, model)

    return HeldoutEM()


NOISE = ("none", "iid", "one_per_group")


def make_reward(seed: int, recipe: Recipe, noise: str = "none", flip: float = 0.0, reward: str = "exact"):
    """The run's reward function, named `REWARD_NAME` so every run logs the same columns.

    `reward`: ``"exact"`` (the verifier) or ``"majority_vote"`` (TTRL's label-free reward: agreement with the group's
    most common answer; the verifier's score is then logged as ``<name>/clean``). `noise`: ``"iid"`` flips every
    reward independently with probability `flip`; ``"one_per_group"`` flips exactly one uniformly chosen completion
    of every group of `num_generations` (marginal rate 1/G: a group whose success pattern one flip explains carries
    no signal). Flips come from private RNGs seeded by the run seed; the clean reward is logged as ``<name>/clean``.
    """
    from hf_stable.rewards.noise import noisy_reward
    from hf_stable.testing import arithmetic_reward

    if noise not in NOISE or reward not in ("exact", "majority_vote"):
        raise ValueError(f"noise must be in {NOISE} and reward 'exact' or 'majority_vote', got {noise!r}, {reward!r}")
    if reward == "majority_vote":
        return _majority(arithmetic_reward, recipe.num_generations)
    if noise == "one_per_group":
        return _one_flip_per_group(arithmetic_reward, recipe.num_generations, seed)
    return noisy_reward(arithmetic_reward, flip if noise == "iid" else 0.0, seed=seed, name=REWARD_NAME)


def _one_flip_per_group(fn, group: int, seed: int):
    import random

    from hf_stable.rewards.noise import noisy_reward

    logged, rng = noisy_reward(fn, 0.0, seed=seed, name=REWARD_NAME), random.Random(seed)

    def wrapped(*args, **kwargs):
        rewards = list(logged(*args, **kwargs))
        if len(rewards) % group:  # TRL scores each prompt's G completions consecutively; anything else breaks groups
            raise RuntimeError(f"{len(rewards)} rewards do not split into groups of {group}")
        for start in range(0, len(rewards), group):
            i = start + rng.randrange(group)
            if rewards[i] is not None:
                rewards[i] = 1.0 - rewards[i]
        return rewards

    wrapped.__name__ = REWARD_NAME
    return wrapped


def _majority(verifier, group: int):
    from hf_stable.rewards.majority import majority_vote_reward

    def wrapped(prompts, completions, **kwargs):
        clean = verifier(prompts=prompts, completions=completions, **kwargs)
        log_metric = kwargs.get("log_metric")
        if log_metric is not None:
            log_metric(f"{REWARD_NAME}/clean", sum(clean) / len(clean))
        return majority_vote_reward(completions, num_generations=group)

    wrapped.__name__ = REWARD_NAME
    return wrapped


def run_grpo(
    seed: int,
    recipe: Recipe,
    flip: float = 0.0,
    label: str = "grpo",
    use_cache: bool = True,
    *,
    noise: str | None = None,
    reward: str = "exact",
    overrides: dict | None = None,
) -> dict:
    """One GRPO run from the seed's warm start: held-out EM curve, reward curve, gain, wall and CPU seconds.

    `flip` with `noise` (``"iid"`` when only `flip` is given) and `reward`: see `make_reward`. `overrides`: more
    `StableGRPOConfig` fields (a method's flag). The record is cached under `experiments/cache/testbeds/rl/` keyed by
    the recipe, the reward spec, the overrides, the seed and the code digest, so every script on the testbed shares
    finished runs.
    """
    noise = noise or ("iid" if flip else "none")
    overrides = dict(overrides or {})
    spec = {"flip": flip}
    if noise not in ("none", "iid") or reward != "exact" or overrides:  # keeps the keys of runs made before these
        spec.update(noise=noise, reward=reward, overrides=overrides)
    key = json.dumps({**asdict(recipe), **spec, "seed": seed, "code": code_digest()}, sort_keys=True)
    path = CACHE / "runs" / f"seed{seed}_{hashlib.sha1(key.encode()).hexdigest()[:12]}.json"
    if use_cache and path.exists():
        record = json.loads(path.read_text())
    else:
        record = _run_grpo(seed, recipe, make_reward(seed, recipe, noise, flip, reward), overrides)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(record))
        tmp.rename(path)
    curve = " ".join(f"{s}:{e:.3f}" for s, e in record["heldout_curve"])
    print(
        f"[{label} seed {seed}] held-out EM {record['heldout_em_start']:.3f} -> {record['heldout_em_end']:.3f} "
        f"({record['gain']:+.3f}); curve {curve}; {record['cpu_s'] / 60:.1f} CPU-min",
        flush=True,
    )
    return record


def _run_grpo(seed: int, recipe: Recipe, reward, overrides: dict) -> dict:
    from transformers import PrinterCallback

    from hf_stable import StableGRPOTrainer

    data = seed_data(seed, recipe)
    path, warm = warm_start(seed, recipe, data)
    wall, cpu = time.time(), time.process_time()
    model, tokenizer = load(path)
    callback = _heldout_callback(tokenizer, data["heldout"], recipe.eval_every)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = StableGRPOTrainer(
            model=model,
            reward_funcs=[reward],
            args=grpo_config(tmp, seed, recipe, **overrides),
            train_dataset=rl_prompts(data, seed, recipe),
            processing_class=tokenizer,
            callbacks=[callback],
        )
        trainer.remove_callback(PrinterCallback)
        trainer.train()
    history = trainer.state.log_history
    start, end = callback.points[0][1], callback.points[-1][1]
    record = {
        "warm_start": {k: warm[k] for k in ("heldout_em", "sft_train_em", "wall_s", "cpu_s")},
        "heldout_em_start": start,
        "heldout_em_end": end,
        "gain": end - start,
        "heldout_curve": callback.points,
        "reward_curve": [
            [h["step"], h[f"rewards/{REWARD_NAME}/mean"]] for h in history if f"rewards/{REWARD_NAME}/mean" in h
        ],
        "steps": trainer.state.global_step,
        "wall_s": time.time() - wall,
        "cpu_s": time.process_time() - cpu,
    }
    clean = [[h["step"], h[f"{REWARD_NAME}/clean"]] for h in history if f"{REWARD_NAME}/clean" in h]
    if clean:
        record["clean_reward_curve"] = clean
    return record


# ---------------------------------------------------------------------------------------------------------------------
# statistics and the control


# two-sided 95% Student-t quantiles by degrees of freedom
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


def t_interval(values: list[float]) -> dict:
    """Mean and two-sided 95% Student-t interval over seeds (needs >= 2 values; one value gives an infinite one)."""
    n, mean = len(values), statistics.fmean(values)
    if n < 2:
        return {"mean": mean, "ci_low": -math.inf, "ci_high": math.inf, "n": n, "values": values}
    half = _T95.get(n - 1, 1.96) * statistics.stdev(values) / math.sqrt(n)
    return {"mean": mean, "ci_low": mean - half, "ci_high": mean + half, "n": n, "values": values}


def control_verdict(gains: list[float]) -> dict:
    """The control that must pass: mean held-out gain >= CONTROL_GAIN and its 95% interval above 0."""
    ci = t_interval(gains)
    return {
        **ci,
        "bar": CONTROL_GAIN,
        "passed": ci["mean"] >= CONTROL_GAIN and ci["ci_low"] > 0,
        "text": (
            f"plain GRPO raises held-out exact match by {ci['mean']:+.3f} (95% CI {ci['ci_low']:+.3f} to "
            f"{ci['ci_high']:+.3f}, {ci['n']} seeds); the bar is +{CONTROL_GAIN:.2f} with the interval above 0"
        ),
    }


def recipe_dict(recipe: Recipe) -> dict:
    return {**asdict(recipe), "heldout": HELDOUT, "split_seed": SPLIT_SEED, "tuning_seed": TUNING_SEED}


def with_steps(recipe: Recipe, steps: int) -> Recipe:
    return replace(recipe, rl_steps=steps)
