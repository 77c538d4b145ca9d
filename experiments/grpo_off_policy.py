"""Stale data and large steps on the RL testbed: the ESS-adaptive loss, StableReinforce's pre-clip and its advantage
filter.

Testbed (`experiments/testbeds/rl.py`, recipe `rl_recipe.CONTROL`; its control, plain GRPO raising held-out exact
match, must pass: `grpo_rl_control.py`). Arms, runs and verdicts follow `grpo_methods.py`: every arm of a seed starts
from that seed's warm start and sees the same prompt stream; effects are paired by seed, (arm's held-out gain) −
(baseline's), with a 95% Student-t interval over seeds.

Phenomena (pre-registered here, before any arm of this script ran; only the tuning seed 100 was looked at, one run
of `grpo_stale`, to check that the stale setting is off-policy enough to change GRPO's result):
* **Stale data**: each generation batch trains `STALE_ITERATIONS` = 4 optimizer steps (TRL's `num_iterations`), so
  three of every four steps learn from completions an older policy sampled (the importance ratios leave 1; TRL's
  PPO clip acts). The step count stays 700, so a stale arm sees a quarter of the fresh completions. Detection
  control: stale data lowers plain GRPO's held-out gain (`grpo_stale` − `grpo`, paired interval below 0).
* **Too large a step**: LR 1e-3, 10× the tuned one (the arm `grpo_high` is `grpo_methods.py`'s, from the testbed's
  cache). Detection control: `grpo_high` − `grpo`, paired interval below 0.

Methods and claims:
* `ess` (P3O, Fakoor et al., arXiv 1905.01756; `loss_mode="ess"`): the ESS-adaptive loss uses stale data stably.
  Claim: `ess_stale` − `grpo_stale`, interval above 0.
* `stable_reinforce` (R1-Reward, Zhang et al., arXiv 2505.02835; `loss_mode="stable_reinforce"`, δ = 1e3): the
  pre-clipped ratio keeps RL stable where PPO's ratio blows up. Claim: `sr_stale` − `grpo_stale`, interval above 0
  (stale data is where its ratio can leave [1/δ, δ]: `stable/grpo/stable_reinforce/preclipped_frac` says whether it
  did); and at the large step, `sr_high_stale` − `grpo_high_stale`, interval above 0, with the detection control
  `grpo_high_stale` − `grpo_stale` below 0.
* `sigma_filter` (the same paper; `advantage_filter_sigma=3`): dropping advantages beyond 3σ stabilises RL. Claim at
  the large step: `sigma_high` − `grpo_high`, interval above 0. The arm `sigma` (tuned LR) is reported without a
  claim: on GRPO's group-normalised advantages of a sparse binary reward the filter can zero a batch's whole signal
  (docs/grpo.md), and this arm measures what that costs here.
Verdicts as in `grpo_methods.py` (the best reading over a method's phenomena goes to the evidence index).

Command (each seed cached on its own, each arm within it as it finishes; `grpo`, `grpo_high` come from the testbed's
cache):
    OMP_NUM_THREADS=1 .venv/bin/python experiments/grpo_off_policy.py
Quick smoke run (tiny sizes, one seed; its verdicts mean nothing):
    OMP_NUM_THREADS=1 .venv/bin/python experiments/grpo_off_policy.py --quick --out /tmp/grpo_off_policy
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from _harness import run
from grpo_methods import HIGH_LR, claims_experiment, run_custom
from testbeds import rl
from testbeds.rl_recipe import CONTROL


NAME = "grpo_off_policy"
STALE_ITERATIONS = 4
STALE = {"num_iterations": STALE_ITERATIONS}
SR = {"loss_mode": "stable_reinforce"}

# arm -> (large step, flags); `grpo` and `grpo_high` run through `rl.run_grpo` (shared with grpo_methods.py)
ARMS = {
    "grpo": (False, None),
    "grpo_high": (True, None),
    "sigma": (False, {"advantage_filter_sigma": 3.0}),
    "sigma_high": (True, {"advantage_filter_sigma": 3.0}),
    "grpo_stale": (False, STALE),
    "ess_stale": (False, {**STALE, "loss_mode": "ess"}),
    "sr_stale": (False, {**STALE, **SR}),
    "grpo_high_stale": (True, STALE),
    "sr_high_stale": (True, {**STALE, **SR}),
}

# method (as `hf-stable list` names it) -> (family, arm, baseline arm, detection (arm, baseline))
CLAIMS = {
    "ess": ("loss_mode", "ess_stale", "grpo_stale", ("grpo_stale", "grpo")),
    "stable_reinforce (stale data)": ("loss_mode", "sr_stale", "grpo_stale", ("grpo_stale", "grpo")),
    "stable_reinforce (stale data, LR 1e-3)": (
        "loss_mode",
        "sr_high_stale",
        "grpo_high_stale",
        ("grpo_high_stale", "grpo_stale"),
    ),
    "sigma_filter": ("advantage_filter", "sigma_high", "grpo_high", ("grpo_high", "grpo")),
}
# the metrics that show each mechanism acting, reported per arm
MECHANISMS = (
    "stable/ess/value",
    "stable/ess/capped_frac",
    "stable/grpo/stable_reinforce/preclipped_frac",
    "stable/grpo/sigma_filter/filtered_frac",
    "clip_ratio/region_mean",
)


@dataclass(frozen=True)
class Sizes:
    recipe: rl.Recipe = CONTROL
    high_lr: float = HIGH_LR


QUICK = Sizes(recipe=replace(rl.QUICK, rl_steps=4, eval_every=2, logging_steps=1))


def arm_run(seed: int, sizes: Sizes, name: str) -> dict:
    high, flags = ARMS[name]
    recipe = replace(sizes.recipe, rl_lr=sizes.high_lr) if high else sizes.recipe
    if flags is None:
        return rl.run_grpo(seed, recipe, label=name)
    return run_custom(seed, recipe, [rl.make_reward(seed, recipe)], dict(flags), label=name)


def mechanism_table(result: dict) -> str:
    """Whether each mechanism acted: the mean over the run (and seeds) of its logged metric."""
    rows = ["| arm | " + " | ".join(f"`{m}`" for m in MECHANISMS) + " |", "|---|" + "---|" * len(MECHANISMS)]
    for name in ARMS:
        cells = []
        for key in MECHANISMS:
            series = [r[name].get("logged", {}).get(key) for r in result["per_seed"].values()]
            values = [v for s in series if s for _, v in s]
            cells.append(f"{sum(values) / len(values):.4f}" if values else "-")
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def report(result: dict) -> str:
    return "Mean over each run's logged steps (and the seeds):\n\n" + mechanism_table(result)


EXPERIMENT = claims_experiment(
    NAME,
    "Stale data and large steps on the RL testbed",
    "P3O's ESS-adaptive loss (arXiv 1905.01756) and StableReinforce's pre-clipped ratio (arXiv 2505.02835) "
    "learn from stale data better than GRPO's PPO loss, and StableReinforce's 3-sigma advantage filter keeps a "
    "too-large step from collapsing the policy; each paired on the RL testbed where the phenomenon it targets is "
    "shown to be present.",
    ARMS,
    CLAIMS,
    arm_run,
    Sizes(),
    QUICK,
    report=report,
    config=None,
    script=__file__,
)


if __name__ == "__main__":
    run(EXPERIMENT)
