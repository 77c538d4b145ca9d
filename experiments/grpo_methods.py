"""The GRPO family on the RL testbed: each method's headline claim, read against a phenomenon the testbed shows.

Testbed (`experiments/testbeds/rl.py`, recipe `rl_recipe.CONTROL`): plain GRPO raises held-out exact match there
(`grpo_rl_control.py`, the control that must pass). Every arm of a seed starts from that seed's warm start and sees the
same prompt stream; an arm differs from its baseline in one thing (the method's flag, or the phenomenon). Effects
are paired by seed: (arm's held-out gain) − (baseline's held-out gain), with a 95% Student-t interval over seeds.

Methods, claims and the phenomenon each needs (pre-registered here, before any arm of this script ran):
* `sgrpo` (Shen et al., arXiv 2508.05928): under noisy binary rewards S-GRPO learns where GRPO does not. Phenomena:
  i.i.d. flips at p = 0.2, and one flip per group of G = 8 (correlated within the group, marginal rate 1/8);
  `sgrpo_noise_p` is the true marginal rate. Detection control: the noise lowers GRPO's gain (paired interval below
  0). Claim: S-GRPO's gain − GRPO's gain under the same noise, interval above 0.
* `maxrl` (Tajwar et al., arXiv 2602.02710): maximum-likelihood RL improves on GRPO's objective at equal samples.
  Detection control: the testbed's (GRPO learns). Claim: MaxRL's gain − GRPO's gain, interval above 0.
* `oblr` (advantage estimator) and `snr` (`oblr_adaptive_lr`, both Huang et al., arXiv 2511.23310): stable RL where
  the step is too large. Phenomenon: LR `HIGH_LR` (10× the tuned LR). Detection control: the high LR lowers plain
  GRPO's gain (paired interval below 0). Claim: the method's gain − GRPO's gain at the high LR, interval above 0.
  `snr` needs two micro-batches a step: its arm and its baseline both run 2 × 32 completions (the same 8 prompts).
* `majority_vote` (TTRL, Zuo et al., arXiv 2504.16084): RL on unlabelled prompts with the majority answer of the
  group as the label raises accuracy. Detection control: the testbed's. Claim: its held-out gain (no baseline
  subtracted: the claim is that label-free RL learns), interval above 0.
Verdicts: `replicated` (the claim's interval above 0, its detection control passed), `not replicated` (the detection
control passed and the interval does not lie above 0), `inconclusive` (a detection control failed: the testbed could
not show the effect).

Command (each seed cached on its own; every run also in the testbed's cache, shared with the control):
    OMP_NUM_THREADS=1 .venv/bin/python experiments/grpo_methods.py
Quick smoke run (tiny sizes, one seed; its verdicts mean nothing):
    OMP_NUM_THREADS=1 .venv/bin/python experiments/grpo_methods.py --quick --out /tmp/grpo_methods
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from _harness import Experiment, criterion, run
from testbeds import rl
from testbeds.rl_recipe import CONTROL


NAME = "grpo_methods"
HIGH_LR = 1e-3
TWO_MICRO_BATCHES = {"gradient_accumulation_steps": 2}

# arm -> `rl.run_grpo` keywords; `high`: LR `Sizes.high_lr`; `micro`: two micro-batches of 32 a step
ARMS = {
    "grpo": {},
    "grpo_iid": {"noise": "iid", "flip": 0.2},
    "sgrpo_iid": {"noise": "iid", "flip": 0.2, "overrides": {"advantage_estimator": "sgrpo", "sgrpo_noise_p": 0.2}},
    "grpo_group": {"noise": "one_per_group"},
    "sgrpo_group": {
        "noise": "one_per_group",
        "overrides": {"advantage_estimator": "sgrpo", "sgrpo_noise_p": 0.125},
    },
    "maxrl": {"overrides": {"advantage_estimator": "maxrl"}},
    "grpo_high": {"high": True},
    "oblr_high": {"high": True, "overrides": {"advantage_estimator": "oblr"}},
    "grpo_high_2mb": {"high": True, "micro": True},
    "snr_high_2mb": {"high": True, "micro": True, "overrides": {"oblr_adaptive_lr": True}},
    "majority_vote": {"reward": "majority_vote"},
}

# method (as `hf-stable list` names it) -> (family, arm, baseline arm or None, detection (arm, baseline) or None)
CLAIMS = {
    "sgrpo (i.i.d. flips)": ("advantage_estimator", "sgrpo_iid", "grpo_iid", ("grpo_iid", "grpo")),
    "sgrpo (one flip per group)": ("advantage_estimator", "sgrpo_group", "grpo_group", ("grpo_group", "grpo")),
    "maxrl": ("advantage_estimator", "maxrl", "grpo", None),
    "oblr": ("advantage_estimator", "oblr_high", "grpo_high", ("grpo_high", "grpo")),
    # GRPO at the tuned LR with two micro-batches of 32 is the same update as one of 64 on average: its detection
    # control pairs the two-micro-batch high-LR arm with the testbed's GRPO arm
    "snr": ("lr_scaling", "snr_high_2mb", "grpo_high_2mb", ("grpo_high_2mb", "grpo")),
    "majority_vote": ("reward_function", "majority_vote", None, None),
}


@dataclass(frozen=True)
class Sizes:
    recipe: rl.Recipe = CONTROL
    high_lr: float = HIGH_LR


QUICK = Sizes(recipe=replace(rl.QUICK, rl_steps=2, eval_every=2, logging_steps=1))  # a smoke run of every arm


def arm_run(seed: int, sizes: Sizes, name: str) -> dict:
    spec = dict(ARMS[name])
    recipe = replace(sizes.recipe, rl_lr=sizes.high_lr) if spec.pop("high", False) else sizes.recipe
    overrides = dict(spec.pop("overrides", {}))
    if spec.pop("micro", False):
        per_device = recipe.rl_prompts * recipe.num_generations // 2
        overrides.update(TWO_MICRO_BATCHES, per_device_train_batch_size=per_device)
    return rl.run_grpo(seed, recipe, label=name, overrides=overrides, **spec)


KEEP = ("heldout_em_start", "heldout_em_end", "gain", "heldout_curve", "cpu_s", "logged")


def run_seed(seed: int, sizes: Sizes) -> dict:
    records = {name: arm_run(seed, sizes, name) for name in ARMS}
    return {name: {k: r[k] for k in KEEP if k in r} for name, r in records.items()}


# metrics a run made by `run_custom` keeps (every logged key with one of these prefixes, and the clean means of
# noisy rewards), to show a phenomenon
LOGGED_PREFIXES = ("stable/", "rewards/", "completions/mean_length", "clip_ratio/")


def run_custom(
    seed: int, recipe: rl.Recipe, rewards: list, overrides: dict, column=None, setup=None, label: str = ""
) -> dict:
    """One run from the seed's warm start like `rl.run_grpo`, for what it does not take: several reward functions,
    a dataset column added by `column` (`row -> {name: value}`), `setup(trainer)` before training (e.g. to attach a
    callback), and the logged metrics kept (`LOGGED_PREFIXES`, as `[step, value]` lists). Not cached here: the
    harness caches the seed, `run_arms` each arm within it."""
    from transformers import PrinterCallback

    from hf_stable import StableGRPOTrainer

    data = rl.seed_data(seed, recipe)
    path, _ = rl.warm_start(seed, recipe, data)
    cpu = time.process_time()
    model, tokenizer = rl.load(path)
    heldout = rl._heldout_callback(tokenizer, data["heldout"], recipe.eval_every)
    prompts = rl.rl_prompts(data, seed, recipe)
    prompts = prompts.map(column) if column else prompts
    with tempfile.TemporaryDirectory() as tmp:
        args = rl.grpo_config(tmp, seed, recipe, **overrides)
        trainer = StableGRPOTrainer(model, rewards, args, prompts, processing_class=tokenizer, callbacks=[heldout])
        trainer.remove_callback(PrinterCallback)
        if setup is not None:
            setup(trainer)
        trainer.train()
    logged = {}
    for entry in trainer.state.log_history:
        for key, value in entry.items():
            kept = key.startswith(LOGGED_PREFIXES) or key.endswith("/clean")  # a noisy reward's clean mean
            if kept and isinstance(value, (int, float)):
                logged.setdefault(key, []).append([entry["step"], value])
    start, end = heldout.points[0][1], heldout.points[-1][1]
    record = {"heldout_em_start": start, "heldout_em_end": end, "gain": end - start, "heldout_curve": heldout.points}
    record.update(cpu_s=time.process_time() - cpu, logged=logged)
    print(f"[{label} seed {seed}] held-out EM {start:.3f} -> {end:.3f} ({end - start:+.3f})", flush=True)
    return record


def run_arms(seed: int, arm_run, names, work: Path | None) -> dict:
    """`arm_run(name)` for each arm, each record kept in the seed's work folder (`work`) as it finishes, so an
    interrupted seed resumes at its next arm."""
    out = {}
    for name in names:
        path = work / f"{name}.json" if work else None
        if path is not None and path.exists():
            out[name] = json.loads(path.read_text())
            continue
        record = arm_run(name)
        out[name] = {k: record[k] for k in KEEP if k in record}
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(out[name]))
    return out


def paired(per_seed: dict, arm: str, baseline: str | None) -> dict:
    diffs = [r[arm]["gain"] - (r[baseline]["gain"] if baseline else 0.0) for r in per_seed.values()]
    return rl.t_interval(diffs)


def verdicts(per_seed: dict, claims: dict = CLAIMS) -> dict:
    """Each claim's paired effect, its detection control and its verdict; `claims` as `CLAIMS`."""
    control = rl.control_verdict([r["grpo"]["gain"] for r in per_seed.values()])
    out = {}
    for method, (family, arm, baseline, detection) in claims.items():
        effect = paired(per_seed, arm, baseline)
        detect = paired(per_seed, *detection) if detection else None
        detected = control["passed"] and (detect is None or detect["ci_high"] < 0)
        if not detected:
            verdict = "inconclusive"
        else:
            verdict = "replicated" if effect["ci_low"] > 0 else "not replicated"
        out[method] = {
            "family": family,
            "arm": arm,
            "baseline": baseline,
            "effect": effect,
            "detection": detect,
            "control_passed": control["passed"],
            "verdict": verdict,
        }
    return {"control": control, "methods": out}


def aggregate_arms(per_seed: dict, arms, claims: dict) -> dict:
    """Each arm's held-out gain (interval over seeds) and final EM, then `verdicts`."""
    summary = {
        name: {
            "gain": rl.t_interval([r[name]["gain"] for r in per_seed.values()]),
            "end_em": statistics.fmean(r[name]["heldout_em_end"] for r in per_seed.values()),
        }
        for name in arms
    }
    return {"arms": summary, **verdicts(per_seed, claims)}


def aggregate(per_seed: dict, sizes: Sizes) -> dict:
    return aggregate_arms(per_seed, ARMS, CLAIMS)


def criteria(per_seed: dict, agg: dict, sizes: Sizes) -> dict:
    """The testbed's control, then one criterion per claim (passed = replicated)."""
    checks = {
        "control": criterion(
            f"testbed control: plain GRPO's mean held-out gain ≥ +{rl.CONTROL_GAIN:.2f}, interval above 0",
            agg["control"]["passed"],
            {k: agg["control"][k] for k in ("mean", "ci_low", "ci_high", "n")},
        )
    }
    for method, v in agg["methods"].items():
        e = v["effect"]
        checks[method] = criterion(
            f"{method}: {v['arm']} − {v['baseline'] or 'its warm start'} held-out gain, 95% interval above 0 "
            f"(verdict: {v['verdict']})",
            v["verdict"] == "replicated",
            {k: e[k] for k in ("mean", "ci_low", "ci_high", "n")},
        )
    return checks


def plot(result: dict, path: Path, title: str = "GRPO family on the RL testbed") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = result["aggregate"]["arms"]
    names = list(arms)
    means = [arms[n]["gain"]["mean"] for n in names]
    errs = [
        [m - arms[n]["gain"]["ci_low"] for n, m in zip(names, means, strict=True)],
        [arms[n]["gain"]["ci_high"] - m for n, m in zip(names, means, strict=True)],
    ]
    fig, ax = plt.subplots(figsize=(11, 4.2))
    ax.bar(names, means, yerr=errs, capsize=3, color="tab:blue")
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set(ylabel="held-out EM gain over the warm start (95% CI)", title=title)
    ax.tick_params(axis="x", rotation=35)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(result: dict) -> str:
    agg = result["aggregate"]
    lines = [
        f"Testbed control: {'PASS' if agg['control']['passed'] else 'FAIL'}: {agg['control']['text']}.",
        "",
        "| arm | held-out gain (95% CI) | EM at the end |",
        "|---|---|---|",
    ]
    for name, a in agg["arms"].items():
        g = a["gain"]
        lines.append(f"| {name} | {g['mean']:+.3f} [{g['ci_low']:+.3f}, {g['ci_high']:+.3f}] | {a['end_em']:.3f} |")
    lines += ["", "| method | claim's effect (95% CI) | detection control (95% CI) | verdict |", "|---|---|---|---|"]
    for method, v in agg["methods"].items():
        e, d = v["effect"], v["detection"]
        det = f"{d['mean']:+.3f} [{d['ci_low']:+.3f}, {d['ci_high']:+.3f}]" if d else "the testbed's control"
        eff = f"{e['mean']:+.3f} [{e['ci_low']:+.3f}, {e['ci_high']:+.3f}]"
        lines.append(f"| {method} | {eff} | {det} | {v['verdict']} |")
    return "\n".join(lines)


def claims_experiment(name: str, title: str, claim: str, arms: dict, claims: dict, arm_run, sizes, quick_sizes,
                      report=None, config=None, script: str = "") -> Experiment:
    """An experiment on the RL testbed laid out like this one: `arm_run(seed, sizes, arm) -> record` for each of
    `arms` (each arm kept in the seed's work folder as it finishes), `claims` as `CLAIMS`, the table of `markdown`
    followed by `report(result)` when given."""
    return Experiment(
        name=name,
        title=title,
        claim=claim,
        sizes=sizes,
        quick_sizes=quick_sizes,
        run_seed=lambda seed, sizes, work=None: run_arms(seed, lambda arm: arm_run(seed, sizes, arm), arms, work),
        aggregate=lambda per_seed, sizes: aggregate_arms(per_seed, arms, claims),
        criteria=criteria,
        plot=lambda result, path: plot(result, path, title=title),
        markdown=lambda result: markdown(result) + ("\n\n" + report(result) if report else ""),
        config={"testbed": "experiments/testbeds/rl.py", "arms": arms, "claims": claims, **(config or {})},
        default_seeds=(1, 2, 3),
        script=script,
        work_cache=True,
    )


EXPERIMENT = Experiment(
    name=NAME,
    title="GRPO family on the RL testbed",
    claim="Each GRPO-family method's headline claim (S-GRPO arXiv 2508.05928, MaxRL arXiv 2602.02710, OBLR-PO arXiv "
    "2511.23310, TTRL arXiv 2504.16084), paired against plain GRPO on the RL testbed where the phenomenon it targets "
    "is shown to be present.",
    sizes=Sizes(),
    quick_sizes=QUICK,
    run_seed=run_seed,
    aggregate=aggregate,
    criteria=criteria,
    plot=plot,
    markdown=markdown,
    config={"testbed": "experiments/testbeds/rl.py", "arms": ARMS, "claims": CLAIMS},
    default_seeds=(1, 2, 3, 4, 5),
    script=__file__,
)


if __name__ == "__main__":
    run(EXPERIMENT)
