"""The RL testbed with i.i.d. reward flips: does the noise measurably hurt plain GRPO? (a control the noise
experiments need: a noise-robust method can only be shown to help where noise hurts).

Claim (the testbed's, not a paper's). On the RL testbed (`experiments/testbeds/rl.py`, recipe
`testbeds/rl_recipe.py` `CONTROL`), flipping each binary reward independently with probability `FLIP`
(`hf_stable.rewards.noise.noisy_reward`, seeded by the run seed) lowers plain GRPO's held-out exact-match gain.

Design (pre-registered). Seeds 0, 1, 2; per seed the noise-free control run (the same run as
`grpo_rl_control`'s, shared through the testbed's cache) and the run with flips, same warm start, prompts and
sampling seed. Effect: the paired difference gain(noise-free) − gain(flips), mean and 95% Student-t interval.
Under symmetric i.i.d. flips GRPO's expected update keeps its direction, scaled by 1 − 2p, with added variance, so
the expected effect is slower learning, not a reversal.

Pass criteria (pre-registered):
  (control) the noise-free runs pass the testbed's control (mean gain ≥ +0.10, interval above 0);
  (hurts)   the paired difference's mean > 0 and its 95% interval above 0.

Command:
    OMP_NUM_THREADS=1 .venv/bin/python experiments/grpo_noise_control.py
Quick smoke run (tiny sizes, one seed; its pass/fail means nothing):
    OMP_NUM_THREADS=1 .venv/bin/python experiments/grpo_noise_control.py --quick --out /tmp/grpo_noise_control
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

from _harness import Experiment, criterion, run, seeds_holding
from testbeds import rl
from testbeds.rl_recipe import CONTROL


NAME = "grpo_noise_control"
FLIP = 0.2


@dataclass(frozen=True)
class Sizes:
    recipe: rl.Recipe = CONTROL
    flip: float = FLIP


def run_seed(seed: int, sizes: Sizes) -> dict:
    clean = rl.run_grpo(seed, sizes.recipe, label="no flips")
    noisy = rl.run_grpo(seed, sizes.recipe, flip=sizes.flip, label=f"flips {sizes.flip:g}")
    return {"clean": clean, "noisy": noisy, "difference": clean["gain"] - noisy["gain"]}


def aggregate(per_seed: dict, sizes: Sizes) -> dict:
    runs = list(per_seed.values())
    return {
        "control": rl.control_verdict([r["clean"]["gain"] for r in runs]),
        "noisy_gain": rl.t_interval([r["noisy"]["gain"] for r in runs]),
        "difference": rl.t_interval([r["difference"] for r in runs]),
        "warm_start_em": statistics.fmean(r["clean"]["heldout_em_start"] for r in runs),
    }


def criteria(per_seed: dict, agg: dict, sizes: Sizes) -> dict:
    d = agg["difference"]
    return {
        "control": criterion(
            f"noise-free GRPO: mean held-out EM gain ≥ +{rl.CONTROL_GAIN:.2f} with its 95% interval above 0",
            agg["control"]["passed"],
            {k: agg["control"][k] for k in ("mean", "ci_low", "ci_high")},
            seeds_holding(per_seed, lambda r: r["clean"]["gain"] >= rl.CONTROL_GAIN),
        ),
        "hurts": criterion(
            f"i.i.d. flips p = {sizes.flip:g}: gain(noise-free) − gain(flips) > 0 with its 95% interval above 0",
            d["mean"] > 0 and d["ci_low"] > 0,
            {k: d[k] for k in ("mean", "ci_low", "ci_high")},
            seeds_holding(per_seed, lambda r: r["difference"] > 0),
        ),
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.4))
    flip = result["config"]["sizes"]["flip"]
    for arm, color, label in (("clean", "tab:green", "no flips"), ("noisy", "tab:red", f"i.i.d. flips p = {flip:g}")):
        for i, r in enumerate(result["per_seed"].values()):
            steps, ems = zip(*r[arm]["heldout_curve"], strict=True)
            ax.plot(steps, ems, color=color, alpha=0.6, label=label if i == 0 else None)
    ax.set(title="plain GRPO on the RL testbed, per seed", xlabel="GRPO step", ylabel="held-out greedy exact match")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(result: dict) -> str:
    agg, sizes = result["aggregate"], result["config"]["sizes"]
    rec = sizes["recipe"]
    lines = [
        f"RL testbed (`experiments/testbeds/rl.py`), plain GRPO at LR {rec['rl_lr']:g} for {rec['rl_steps']} steps "
        f"(the control's recipe), with and without i.i.d. reward flips p = {sizes['flip']:g}; held-out greedy exact "
        "match on 300 problems disjoint from every training row.",
        "",
        "| seed | warm start EM | gain, no flips | gain, flips | difference |",
        "|---|---|---|---|---|",
    ]
    for seed, r in result["per_seed"].items():
        lines.append(
            f"| {seed} | {r['clean']['heldout_em_start']:.3f} | {r['clean']['gain']:+.3f} | {r['noisy']['gain']:+.3f} "
            f"| {r['difference']:+.3f} |"
        )
    for key, label in (("control", "gain, no flips"), ("noisy_gain", "gain, flips"), ("difference", "difference")):
        v = agg[key]
        lines.append(f"\n{label}: {v['mean']:+.3f} (95% CI {v['ci_low']:+.3f} to {v['ci_high']:+.3f})")
    return "\n".join(lines)


EXPERIMENT = Experiment(
    name=NAME,
    title="RL testbed: i.i.d. reward flips hurt plain GRPO",
    claim=f"On the RL testbed, flipping each reward independently with p = {FLIP:g} lowers plain GRPO's held-out "
    "exact-match gain (paired over seeds, 95% interval above 0): the noise control the reward-noise experiments need.",
    sizes=Sizes(),
    quick_sizes=Sizes(recipe=rl.QUICK),
    run_seed=run_seed,
    aggregate=aggregate,
    criteria=criteria,
    plot=plot,
    markdown=markdown,
    config={"testbed": "experiments/testbeds/rl.py", "noise": "i.i.d. symmetric flips (noisy_reward)"},
    script=__file__,
)


if __name__ == "__main__":
    run(EXPERIMENT)
