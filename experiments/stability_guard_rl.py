"""The stability guard on the RL testbed: it must leave a healthy sparse-reward GRPO run alone and repair an LR
blow-up.

Testbed (`experiments/testbeds/rl.py`, recipe `rl_recipe.CONTROL`; its control, plain GRPO raising held-out exact
match, must pass: `grpo_rl_control.py`). A 0/1 verifier reward with 8 completions a prompt is sparse: many groups
have equal rewards, so many steps have zero advantages and zero gradients. Arms (each from the seed's warm start, the
same prompt stream; runs as in `grpo_methods.py`):
* `grpo`: the testbed's run (from its cache);
* `guard`: the same with `stability_guard=True` at every default (what a user who switches it on gets);
* `fault`: `grpo` with the learning rate × `FAULT_FACTOR` (100: LR 1e-2) for the updates of steps `FAULT_STEPS`
  (`FaultInjectionCallback(kind="lr_scale")`);
* `guard_fault`: `fault` with the guard on.

Criteria (pre-registered here, before any arm of this script ran):
* (H) healthy run untouched: on every seed the guard takes no action (no skip, no rollback: the logged
  `stable/guard/*` counters stay 0) and `guard`'s held-out gain equals `grpo`'s within `SAME` (0.01).
* (F) the fault hurts (the detection control): `fault` − `grpo` held-out gain, paired 95% t-interval below 0.
* (R) the guard repairs it (the claim): `guard_fault` − `fault`, interval above 0.
* (E) and ends where a clean run ends: mean |`guard_fault` − `grpo`| ≤ `NEAR` (0.05).
The index's claim for the guard ("turns faults into runs that end where a clean run ends") is R and E, read only if
F passes; H is the control that must pass for the guard to be usable on sparse-reward RL at all.

Command (each seed cached on its own, each arm within it as it finishes):
    OMP_NUM_THREADS=1 .venv/bin/python experiments/stability_guard_rl.py
Quick smoke run (tiny sizes, one seed; its verdicts mean nothing):
    OMP_NUM_THREADS=1 .venv/bin/python experiments/stability_guard_rl.py --quick --out /tmp/stability_guard_rl
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from _harness import Experiment, criterion, run
from grpo_methods import paired, plot, run_arms, run_custom
from testbeds import rl
from testbeds.rl_recipe import CONTROL


NAME = "stability_guard_rl"
FAULT_FACTOR = 100.0
FAULT_STEPS = (301, 302, 303)
SAME = 0.01
NEAR = 0.05

# arm -> (guard on, fault injected); `grpo` is the testbed's own run
ARMS = {"grpo": (False, False), "guard": (True, False), "fault": (False, True), "guard_fault": (True, True)}


@dataclass(frozen=True)
class Sizes:
    recipe: rl.Recipe = CONTROL
    fault_steps: tuple[int, ...] = FAULT_STEPS


QUICK = Sizes(recipe=replace(rl.QUICK, rl_steps=6, eval_every=3, logging_steps=1), fault_steps=(4,))


def arm_run(seed: int, sizes: Sizes, name: str) -> dict:
    guard, fault = ARMS[name]
    if not (guard or fault):
        return rl.run_grpo(seed, sizes.recipe, label=name)

    def inject(trainer):
        from hf_stable.callbacks import FaultInjectionCallback

        FaultInjectionCallback.attach(trainer, kind="lr_scale", steps=sizes.fault_steps, factor=FAULT_FACTOR)

    overrides = {"stability_guard": True} if guard else {}
    return run_custom(seed, sizes.recipe, [rl.make_reward(seed, sizes.recipe)], overrides,
                      setup=inject if fault else None, label=name)


def run_seed(seed: int, sizes: Sizes, work: Path | None = None) -> dict:
    return run_arms(seed, lambda name: arm_run(seed, sizes, name), ARMS, work)


def guard_actions(record: dict) -> float:
    """The guard's skips and rollbacks over the run (the last value of each logged counter, summed)."""
    logged = record.get("logged", {})
    keys = [k for k in logged if k.startswith("stable/guard/") and k.rsplit("/", 1)[-1] in ("skips", "rollbacks")]
    return sum(logged[k][-1][1] for k in keys)


def aggregate(per_seed: dict, sizes: Sizes) -> dict:
    gains = {name: rl.t_interval([r[name]["gain"] for r in per_seed.values()]) for name in ARMS}
    return {
        "control": rl.control_verdict([r["grpo"]["gain"] for r in per_seed.values()]),
        "arms": {
            name: {"gain": g, "end_em": statistics.fmean(r[name]["heldout_em_end"] for r in per_seed.values())}
            for name, g in gains.items()
        },
        "healthy_actions": {s: guard_actions(r["guard"]) for s, r in per_seed.items()},
        "healthy_diff": {s: r["guard"]["gain"] - r["grpo"]["gain"] for s, r in per_seed.items()},
        "fault_actions": {s: guard_actions(r["guard_fault"]) for s, r in per_seed.items()},
        "fault_effect": paired(per_seed, "fault", "grpo"),
        "repair": paired(per_seed, "guard_fault", "fault"),
        "distance": statistics.fmean(abs(r["guard_fault"]["gain"] - r["grpo"]["gain"]) for r in per_seed.values()),
    }


def criteria(per_seed: dict, agg: dict, sizes: Sizes) -> dict:
    fault, repair = agg["fault_effect"], agg["repair"]
    interval = ("mean", "ci_low", "ci_high", "n")
    healthy = all(a == 0 for a in agg["healthy_actions"].values()) and all(
        abs(d) <= SAME for d in agg["healthy_diff"].values()
    )
    return {
        "control": criterion(
            f"testbed control: plain GRPO's mean held-out gain ≥ +{rl.CONTROL_GAIN:.2f}, interval above 0",
            agg["control"]["passed"],
            {k: agg["control"][k] for k in interval},
        ),
        "H": criterion(
            f"healthy run untouched: no guard action on any seed, and guard − grpo gain within ±{SAME} on each",
            healthy,
            {"actions": agg["healthy_actions"], "diff": agg["healthy_diff"]},
        ),
        "F": criterion("the LR blow-up hurts: fault − grpo held-out gain, 95% interval below 0",
                       fault["ci_high"] < 0, {k: fault[k] for k in interval}),
        "R": criterion("the guard repairs it: guard_fault − fault held-out gain, 95% interval above 0",
                       repair["ci_low"] > 0, {k: repair[k] for k in interval}),
        "E": criterion(f"and ends where a clean run ends: mean |guard_fault − grpo| ≤ {NEAR}",
                       agg["distance"] <= NEAR, {"mean": agg["distance"], "actions": agg["fault_actions"]}),
    }


def draw(result: dict, path: Path) -> None:
    plot(result, path, title="The guard on the RL testbed")


def markdown(result: dict) -> str:
    agg = result["aggregate"]
    lines = [f"Testbed control: {'PASS' if agg['control']['passed'] else 'FAIL'}: {agg['control']['text']}.", "",
             "| arm | held-out gain (95% CI) |", "|---|---|"]
    for name, a in agg["arms"].items():
        g = a["gain"]
        lines.append(f"| {name} | {g['mean']:+.3f} [{g['ci_low']:+.3f}, {g['ci_high']:+.3f}] |")
    lines += ["", f"Guard actions (skips + rollbacks) per seed: healthy {agg['healthy_actions']}, "
              f"with the fault {agg['fault_actions']}; guard − grpo gain per seed {agg['healthy_diff']}."]
    return "\n".join(lines)


EXPERIMENT = Experiment(
    name=NAME,
    title="The stability guard on the RL testbed",
    claim="The stability guard leaves a healthy sparse-reward GRPO run untouched and turns an LR blow-up into a run "
    "that ends where the clean run ends (the guard's recipe follows PaLM, arXiv 2204.02311 §5.1).",
    sizes=Sizes(),
    quick_sizes=QUICK,
    run_seed=run_seed,
    aggregate=aggregate,
    criteria=criteria,
    plot=draw,
    markdown=markdown,
    config={"testbed": "experiments/testbeds/rl.py", "arms": ARMS, "fault_factor": FAULT_FACTOR},
    default_seeds=(1, 2, 3),
    script=__file__,
    work_cache=True,
)


if __name__ == "__main__":
    run(EXPERIMENT)
