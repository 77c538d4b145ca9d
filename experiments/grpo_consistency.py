"""StableReinforce's consistency reward on the RL testbed: does the consistency term make the policy's reasoning agree
with its answer?

Claim (Zhang et al., *R1-Reward*, arXiv 2505.02835): rewarding a correct answer more when the reasoning supports it,
`reward = 0.5·format + accuracy·(1 + 0.5·consistency)` (`hf_stable.rewards.StableReinforceReward` at its defaults,
no format term), makes the policy's reasoning agree with its answer, where a reward on the answer alone does not.

The paper's judge is a model (Qwen2.5-VL) that reads the reasoning and the answer; ours is a rule that reads them:
a weaker test of the same mechanism (the rule is never wrong and cannot be gamed), read on a task whose "reasoning" is
one digit, far from the paper's free-text multimodal reward modelling.

Testbed (`experiments/testbeds/rl.py`, recipe `rl_recipe.CONTROL`: its problem splits, prompt stream, GRPO settings
and statistics; the completions get a reasoning step, so the warm start is this script's own):
* Task: `a+b=` with operands 0..99 on the tiny offline Llama, completion `R;S`: `R` the ones digit of the sum (the
  "reasoning"), `S` the answer. Verifier (`accuracy`): `S` equals the true sum. Rule judge (`consistency`): +1 when
  `R` equals the last digit of `S`, −1 when it does not, no verdict (0) when the completion is not `digit;digits`.
* Held-out: the testbed's 300 problems, disjoint from every training row of every seed.
* Warm start: NLL SFT (`testbeds.tiny_trl.sft_warm_start`: one pass, linear LR after 10% warmup) from a random init
  seeded by the run seed, on the seed's 1,600 SFT problems of the testbed (`rl.seed_data`) repeated for
  `sft_steps × sft_batch` rows (2,400 steps of 64 at LR 1e-3, the testbed's SFT budget), written by an imperfect
  demonstrator: `S` is the testbed's (70% of the rows with a carry show the carry dropped, room for the verifier to
  teach), and each time a row is written its `R` is, with probability `slip` = 0.3, a uniformly drawn wrong digit
  (the phenomenon: a reasoning the answer contradicts; a dropped carry keeps the ones digit, so `R` is otherwise
  consistent). Cached per seed under `experiments/cache/grpo_consistency/`, keyed by its settings and the testbed's
  code digest.
* Arms, paired per seed (same warm start, same prompt stream, same trainer seed): `accuracy` (GRPO on the verifier
  alone) and `stable_reinforce` (GRPO on `StableReinforceReward(accuracy=verifier, consistency=judge)` at the package
  defaults). `StableGRPOTrainer` at TRL's defaults otherwise (`rl.grpo_config`: beta 0, G = 8, 8 prompts a step,
  temperature 1, constant LR), `max_completion_length` 6, on the CPU.
* Measures on the held-out problems at the start, every `eval_every` steps and at the end: greedy exact match, and on
  `eval_samples` = 4 completions a problem sampled at temperature 1 (the policy GRPO trains; the evaluation RNG
  depends on the seed and step only, shared by the arms) the consistency rate (judge +1), the inconsistency rate
  (judge −1) and the sampled exact match. Greedy decoding hides the phenomenon (the most likely `R` is the right
  digit), hence the samples.

Pre-registered (written before any evaluation seed ran; seeds 1-5; 95% Student-t intervals over seeds of paired
differences, `stable_reinforce` minus `accuracy`):
* (claim) the held-out consistency rate's gain (end − start) under `stable_reinforce` minus under `accuracy`:
  interval above 0;
* (guard) greedy held-out exact match at the end under `stable_reinforce` minus under `accuracy`: mean ≥ −0.05 (the
  consistency term does not cost more than 5 points of accuracy);
* (control_learns, must pass) the `accuracy` arm raises held-out greedy exact match: interval of its gain above 0;
* (control_phenomenon, must pass) the warm start's sampled inconsistency rate ≥ 0.10 on every seed.
Verdict (as `grpo_methods.py`): `replicated` (claim and guard pass, both controls pass), `not replicated` (both
controls pass, the claim or the guard fails), `inconclusive` (a control fails: the testbed could not show the effect).

Pilot (accuracy arm only, tuning seed 100, never an evaluation seed; rule fixed beforehand: the testbed's LR 1e-4
and 700 steps unless held-out greedy exact match fails to rise, the step count cut if the budget needs it; `PILOT`):
one run. Warm start: greedy exact match 0.580, sampled inconsistency 0.497 (consistency 0.485; greedy consistency
0.943); after 700 steps at LR 1e-4: greedy exact match 0.853 (+0.273), sampled consistency 0.675, inconsistency
0.302. Exact match rose and the budget allows 700 steps, so LR 1e-4 and 700 steps stand, nothing else was tried.
Costs: warm start 128 CPU-s (285 s wall on the shared machine), the arm 53 CPU-s: about 4 CPU-minutes a seed with
both arms, 20 for five seeds. In 1,200 samples of that warm start (held-out, temperature 1) `R` is wrong in 56%,
and a wrong `R` pulls the answer's last digit with it in a quarter of those (13.5% of all: consistent and wrong);
19% are right answers after a wrong `R`, what the consistency term acts on. So the verifier alone already lowers
the inconsistency (the pilot: 0.497 -> 0.302), and the claim is the difference the consistency term adds.
After the criteria above were committed, seed 100 ran once more with both arms, to time a full seed (the warm start
retrained: its cache key had changed): the verifier arm reproduced its numbers exactly; the consistency arm ended at
greedy exact match 0.897, sampled consistency 0.832, inconsistency 0.143 (the claim's difference +0.157 on that
seed); 245 CPU-s in all (warm start 137, arms 55 and 54), 587 s wall on the shared machine.

Command (≤ 25 CPU-minutes in all; each seed cached on its own):
    OMP_NUM_THREADS=1 .venv/bin/python experiments/grpo_consistency.py
Pilot:
    OMP_NUM_THREADS=1 .venv/bin/python experiments/grpo_consistency.py --seeds 100 --arms accuracy --out /tmp/pilot
Quick smoke run (tiny sizes, one seed; its verdicts mean nothing):
    OMP_NUM_THREADS=1 .venv/bin/python experiments/grpo_consistency.py --quick --out /tmp/grpo_consistency
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from _harness import criterion, declare, run, save_figure, subplots
from testbeds import rl, tiny_trl
from testbeds.rl_recipe import CONTROL


NAME = "grpo_consistency"
ARMS = ("accuracy", "stable_reinforce")
COMPLETION_LENGTH = 6  # ones digit, ";", up to 3 answer digits, eos
GUARD = -0.05
PHENOMENON = 0.10
PILOT = {
    "seed": rl.TUNING_SEED,
    "arm": "accuracy",
    "rule": "the testbed's LR 1e-4 and 700 steps unless held-out greedy exact match fails to rise",
    "start": {"greedy_em": 0.580, "consistent": 0.485, "inconsistent": 0.497},
    "end": {"greedy_em": 0.853, "consistent": 0.675, "inconsistent": 0.302},
    "chosen": {"rl_lr": 1e-4, "rl_steps": 700},
    "cpu_s": {"warm_start": 128, "arm": 53},
    "timing_run": {
        "when": "after the criteria were committed; both arms, seed 100",
        "stable_reinforce_end": {"greedy_em": 0.897, "consistent": 0.832, "inconsistent": 0.143},
        "cpu_s": {"warm_start": 137, "accuracy": 55, "stable_reinforce": 54, "seed": 245},
        "wall_s": 587,
    },
}
RECIPE = replace(CONTROL, max_completion_length=COMPLETION_LENGTH)


@dataclass(frozen=True)
class Sizes:
    recipe: rl.Recipe = RECIPE
    slip: float = 0.3  # the demonstrator's share of rows whose reasoning is a wrong digit
    eval_samples: int = 4


QUICK = Sizes(
    recipe=replace(
        rl.QUICK, sft_steps=40, rl_steps=4, eval_every=2, logging_steps=1, max_completion_length=COMPLETION_LENGTH
    ),
    eval_samples=2,
)


# ---------------------------------------------------------------------------------------------------------------------
# the task: completions `R;S`, the verifier and the rule judge


def parse(text: str) -> tuple[str, str] | None:
    """`(R, S)` of a completion `R;S` with `R` one digit and `S` digits, else None."""
    reason, sep, answer = text.strip().partition(";")
    if not sep or len(reason) != 1 or not reason.isdigit() or not answer.isdigit():
        return None
    return reason, answer


def judge(completions: list[str], **kwargs) -> list[float | None]:
    """The rule judge: +1 when the reasoning (the ones digit) agrees with the answer's last digit, −1 when it
    contradicts it, None (no verdict) when the completion is not `digit;digits`."""
    verdicts = []
    for c in completions:
        parts = parse(c)
        verdicts.append(None if parts is None else (1.0 if parts[0] == parts[1][-1] else -1.0))
    return verdicts


def verifier(completions: list[str], answer: list[str], log_metric=None, **kwargs) -> list[float]:
    """Exact match of the answer part `S`; logs the batch's accuracy and judge verdicts (both arms log the same)."""
    scores = [float(p is not None and p[1] == str(a)) for p, a in zip(map(parse, completions), answer, strict=True)]
    if log_metric is not None:
        verdicts = judge(completions)
        log_metric("consistency/exact", statistics.fmean(scores))
        log_metric("consistency/consistent", statistics.fmean(v == 1.0 for v in verdicts))
        log_metric("consistency/inconsistent", statistics.fmean(v == -1.0 for v in verdicts))
    return scores


def reward(arm: str):
    if arm == "accuracy":
        return verifier
    from hf_stable.rewards import StableReinforceReward

    return StableReinforceReward(accuracy=verifier, consistency=judge)


def demonstrations(seed: int, sizes: Sizes, sft) -> list[dict]:
    """`sft_steps × sft_batch` rows over the seed's SFT problems (a fresh shuffle each pass): `S` the testbed's
    demonstrated answer, `R` its ones digit, or with probability `slip` a uniformly drawn wrong digit."""
    rng = random.Random(f"slip-{seed}")
    rows, need = [], sizes.recipe.sft_steps * sizes.recipe.sft_batch
    problems = list(zip(sft["prompt"], sft["completion"], strict=True))
    while len(rows) < need:
        rng.shuffle(problems)
        for prompt, answer in problems[: need - len(rows)]:
            digit = answer[-1]
            if rng.random() < sizes.slip:
                digit = rng.choice([d for d in "0123456789" if d != digit])
            rows.append({"prompt": prompt, "completion": f"{digit};{answer}"})
    return rows


def warm_start(seed: int, sizes: Sizes, data: dict) -> Path:
    r = sizes.recipe
    spec = {k: v for k, v in asdict(r).items() if k.startswith("sft_")}
    path = tiny_trl.cache_dir(NAME, "warm", seed, {**spec, "slip": sizes.slip, "code": rl.code_digest()})
    return tiny_trl.sft_warm_start(
        path, seed, lambda: demonstrations(seed, sizes, data["sft"]), r.sft_lr, r.sft_batch
    )[0]


# ---------------------------------------------------------------------------------------------------------------------
# measures


def decode(tokenizer, rows: list[list[int]]) -> list[str]:
    eos = tokenizer.eos_token_id
    return tokenizer.batch_decode([r[: r.index(eos)] if eos in r else r for r in rows], skip_special_tokens=True)


def measure(model, tokenizer, heldout, samples: int, seed: int) -> dict:
    """Greedy exact match, and on `samples` completions a problem at temperature 1: consistency, inconsistency and
    exact match rates."""
    prompts, answers = list(heldout["prompt"]), list(heldout["answer"])
    greedy = decode(tokenizer, tiny_trl.generate_ids(model, tokenizer, prompts, False, seed, COMPLETION_LENGTH))
    sampled = decode(
        tokenizer, tiny_trl.generate_ids(model, tokenizer, prompts * samples, True, seed, COMPLETION_LENGTH)
    )
    verdicts = judge(sampled)
    return {
        "greedy_em": statistics.fmean(verifier(greedy, answers)),
        "sampled_em": statistics.fmean(verifier(sampled, answers * samples)),
        "consistent": statistics.fmean(v == 1.0 for v in verdicts),
        "inconsistent": statistics.fmean(v == -1.0 for v in verdicts),
        "greedy_consistent": statistics.fmean(v == 1.0 for v in judge(greedy)),
    }


# ---------------------------------------------------------------------------------------------------------------------
# runs


def run_arm(arm: str, seed: int, sizes: Sizes, path: Path, data: dict) -> dict:
    from hf_stable import StableGRPOTrainer

    recipe = sizes.recipe
    cpu = time.process_time()
    model, tokenizer = rl.load(path)
    curve = tiny_trl.curve_callback(
        lambda step, m: measure(m, tokenizer, data["heldout"], sizes.eval_samples, 10_000 * (seed + 1) + step),
        recipe.eval_every,
    )
    with tempfile.TemporaryDirectory() as tmp:
        trainer = StableGRPOTrainer(
            model=model,
            reward_funcs=[reward(arm)],
            args=rl.grpo_config(tmp, seed, recipe),
            train_dataset=rl.rl_prompts(data, seed, recipe),
            processing_class=tokenizer,
            callbacks=[curve],
        )
        tiny_trl.fit(trainer)
    logged = {}
    for entry in trainer.state.log_history:
        for key, value in entry.items():
            if key.startswith(("consistency/", "rewards/")) and isinstance(value, (int, float)):
                logged.setdefault(key, []).append([entry["step"], value])
    start, end = curve.points[0], curve.points[-1]
    print(
        f"[{arm} seed {seed}] greedy EM {start['greedy_em']:.3f} -> {end['greedy_em']:.3f}, consistent "
        f"{start['consistent']:.3f} -> {end['consistent']:.3f}, inconsistent {start['inconsistent']:.3f} -> "
        f"{end['inconsistent']:.3f} ({(time.process_time() - cpu) / 60:.1f} CPU-min)",
        flush=True,
    )
    return {"start": start, "end": end, "curve": curve.points, "logged": logged, "cpu_s": time.process_time() - cpu}


def run_seed(seed: int, sizes: Sizes) -> dict:
    cpu = time.process_time()
    data = rl.seed_data(seed, sizes.recipe)
    path = warm_start(seed, sizes, data)
    warm_cpu = time.process_time() - cpu
    arms = {arm: run_arm(arm, seed, sizes, path, data) for arm in ARMS_RUN}
    return {"arms": arms, "warm_cpu_s": warm_cpu, "cpu_s": time.process_time() - cpu}


# ---------------------------------------------------------------------------------------------------------------------
# aggregate, criteria, outputs


def gain(record: dict, arm: str, key: str) -> float:
    return record["arms"][arm]["end"][key] - record["arms"][arm]["start"][key]


def aggregate(per_seed: dict, sizes: Sizes) -> dict:
    seeds = list(per_seed.values())
    arms = [a for a in ARMS if all(a in r["arms"] for r in seeds)]
    out = {
        "arms": {
            arm: {
                key: {
                    "start": statistics.fmean(r["arms"][arm]["start"][key] for r in seeds),
                    "end": statistics.fmean(r["arms"][arm]["end"][key] for r in seeds),
                    "gain": rl.t_interval([gain(r, arm, key) for r in seeds]),
                }
                for key in ("greedy_em", "sampled_em", "consistent", "inconsistent")
            }
            for arm in arms
        },
        "warm_inconsistent": [r["arms"][arms[0]]["start"]["inconsistent"] for r in seeds] if arms else [],
    }
    if set(ARMS) <= set(arms):
        out["claim"] = rl.t_interval(
            [gain(r, "stable_reinforce", "consistent") - gain(r, "accuracy", "consistent") for r in seeds]
        )
        ends = [(r["arms"]["stable_reinforce"]["end"], r["arms"]["accuracy"]["end"]) for r in seeds]
        out["guard"] = rl.t_interval([sr["greedy_em"] - acc["greedy_em"] for sr, acc in ends])
    out["passed"] = passed(out)
    if "claim" in out:  # read by experiments/evidence.py like the other RL-testbed experiments' verdicts
        controls = out["passed"]["control_learns"] and out["passed"]["control_phenomenon"]
        out["methods"] = {
            "stable_reinforce_reward": {
                "family": "reward_function",
                "arm": "stable_reinforce",
                "baseline": "accuracy",
                "effect": out["claim"],
                "guard": out["guard"],
                "detection": None,
                "control_passed": controls,
                "verdict": verdict(out["passed"]),
            }
        }
    return out


def passed(agg: dict) -> dict:
    """Each pre-registered criterion's outcome (those the arms that ran can decide)."""
    warm = agg["warm_inconsistent"]
    out = {"control_phenomenon": bool(warm) and min(warm) >= PHENOMENON}
    if "accuracy" in agg["arms"]:
        out["control_learns"] = agg["arms"]["accuracy"]["greedy_em"]["gain"]["ci_low"] > 0
    if "claim" in agg:
        out.update(claim=agg["claim"]["ci_low"] > 0, guard=agg["guard"]["mean"] >= GUARD)
    return out


def _values(ci: dict) -> dict:
    return {k: ci[k] for k in ("mean", "ci_low", "ci_high", "n")}


def criteria(per_seed: dict, agg: dict, sizes: Sizes) -> dict:
    checks = {}
    if "claim" in agg:
        c, g = agg["claim"], agg["guard"]
        checks["claim"] = criterion(
            "held-out consistency-rate gain, stable_reinforce − accuracy (paired): 95% interval above 0",
            agg["passed"]["claim"],
            _values(c),
            f"{sum(v > 0 for v in c['values'])}/{c['n']} seeds above 0",
        )
        checks["guard"] = criterion(
            f"held-out greedy exact match at the end, stable_reinforce − accuracy (paired): mean ≥ {GUARD}",
            agg["passed"]["guard"],
            _values(g),
            f"{sum(v >= GUARD for v in g['values'])}/{g['n']} seeds",
        )
    if "accuracy" in agg["arms"]:
        learn = agg["arms"]["accuracy"]["greedy_em"]["gain"]
        checks["control_learns"] = criterion(
            "control: the accuracy arm raises held-out greedy exact match, 95% interval of its gain above 0",
            agg["passed"]["control_learns"],
            _values(learn),
            f"{sum(v > 0 for v in learn['values'])}/{learn['n']} seeds",
        )
    warm = agg["warm_inconsistent"]
    checks["control_phenomenon"] = criterion(
        f"control: the warm start's sampled held-out inconsistency rate ≥ {PHENOMENON} on every seed",
        agg["passed"]["control_phenomenon"],
        {"mean": statistics.fmean(warm) if warm else None, "min": min(warm) if warm else None},
        f"{sum(v >= PHENOMENON for v in warm)}/{len(warm)} seeds",
    )
    return checks


def verdict(passed: dict) -> str:
    """`replicated` (claim and guard pass, both controls pass), `not replicated` (both controls pass, the claim or
    the guard fails), `inconclusive` (a control failed, or the arms that ran cannot decide the claim)."""
    if not (passed.get("control_learns") and passed["control_phenomenon"]) or "claim" not in passed:
        return "inconclusive"
    return "replicated" if passed["claim"] and passed["guard"] else "not replicated"


COLORS = {"accuracy": "black", "stable_reinforce": "tab:red"}


def plot(result: dict, path: Path) -> None:
    fig, axes = subplots(1, 3, figsize=(15, 4.2))
    for ax, key, label in zip(
        axes,
        ("consistent", "inconsistent", "greedy_em"),
        ("sampled consistency rate", "sampled inconsistency rate", "greedy exact match"),
        strict=True,
    ):
        for arm in ARMS:
            curves = [r["arms"][arm]["curve"] for r in result["per_seed"].values() if arm in r["arms"]]
            if not curves:
                continue
            steps = [p["step"] for p in curves[0]]
            mean = [statistics.fmean(c[i][key] for c in curves) for i in range(len(steps))]
            ax.plot(steps, mean, color=COLORS[arm], label=arm)
            for c in curves:
                ax.plot([p["step"] for p in c], [p[key] for p in c], color=COLORS[arm], alpha=0.2, linewidth=0.8)
        ax.set(title=f"held-out {label}", xlabel="RL step")
    axes[0].legend()
    fig.suptitle("StableReinforce's consistency reward vs the verifier alone (thin: seeds, thick: mean)")
    save_figure(fig, path)


def markdown(result: dict) -> str:
    agg = result["aggregate"]
    lines = [
        "The judge is a rule that reads the reasoning (the ones digit) and the answer, where the paper's is a model: "
        "a weaker test of the same mechanism.",
        "",
        f"**Verdict: {verdict(agg['passed'])}.**",
        "",
        "| arm | measure (held-out) | start | end | gain (95% CI over seeds) |",
        "|---|---|---|---|---|",
    ]
    for arm, measures in agg["arms"].items():
        for key, m in measures.items():
            g = m["gain"]
            lines.append(
                f"| {arm} | {key} | {m['start']:.3f} | {m['end']:.3f} | {g['mean']:+.3f} "
                f"[{g['ci_low']:+.3f}, {g['ci_high']:+.3f}] |"
            )
    for name in ("claim", "guard"):
        if name in agg:
            c = agg[name]
            lines += ["", f"{name}: {c['mean']:+.3f} [{c['ci_low']:+.3f}, {c['ci_high']:+.3f}] over {c['n']} seeds "
                      f"(per seed: {', '.join(f'{v:+.3f}' for v in c['values'])})."]
    p = PILOT
    lines += [
        "",
        f"Pilot (accuracy arm, tuning seed {p['seed']}, not reported above): greedy exact match "
        f"{p['start']['greedy_em']:.3f} -> {p['end']['greedy_em']:.3f}, sampled inconsistency "
        f"{p['start']['inconsistent']:.3f} -> {p['end']['inconsistent']:.3f}; rule: {p['rule']}.",
    ]
    return "\n".join(lines)


def arms_option() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS), help="arms to run (the pilot: accuracy)")
    return p


ARMS_RUN = tuple(arms_option().parse_known_args(sys.argv[1:])[0].arms) if __name__ == "__main__" else ARMS


EXPERIMENT = declare(
    globals(),
    title="StableReinforce's consistency reward on the RL testbed (reasoning `R;S`, a rule as the judge)",
    claim="StableReinforce's consistency reward (R1-Reward, arXiv 2505.02835) makes the policy's reasoning agree with "
    "its answer, where GRPO on the verifier alone does not; here with a rule as the judge.",
    config={"testbed": "experiments/testbeds/rl.py", "arms": list(ARMS_RUN), "guard": GUARD, "phenomenon": PHENOMENON},
    default_seeds=(1, 2, 3, 4, 5),
)

if __name__ == "__main__":
    run(EXPERIMENT, parents=(arms_option(),))
