"""Reward design on the RL testbed: a proxy reward that can be over-optimised, and an ensemble of noisy reward heads.

Testbed (`experiments/testbeds/rl.py`, recipe `rl_recipe.CONTROL`; its control, plain GRPO raising held-out exact
match, must pass: `grpo_rl_control.py`). Arms, runs and verdicts follow `grpo_methods.py`: every arm of a seed starts
from that seed's warm start and sees the same prompt stream; effects are paired by seed, (arm's held-out gain) −
(baseline's), with a 95% Student-t interval over seeds.

Phenomena (pre-registered here, before any arm of this script ran; only the tuning seed 100 was looked at, one run
of `static`, to check that the proxy is over-optimised at weight `PROXY_WEIGHT`):
* **Over-optimised proxy** (two conflicting rewards, and length growth): the verifier plus a length reward
  `L / max_completion_length` (`L`: the completion's tokens, eos included), weighted 1 : `PROXY_WEIGHT` = 5. A wrong
  answer of the full 4 tokens then scores 5.0, a right 2-digit answer (3 tokens) 1 + 3.75 = 4.75: the proxy pays
  for padding answers with digits, which held-out exact match punishes. Detection control: `static` (TRL's fixed
  `reward_weights`) lowers held-out gain below plain GRPO's on the verifier alone (paired interval below 0).
* **Noisy reward heads**: three copies of the verifier, each flipping its rewards i.i.d. with probability
  `HEAD_FLIP` = 0.3 from its own RNG. Detection control: their mean (`robust_reward="brme"` with `brme_lambda=1`,
  the nominal ensemble) lowers held-out gain below plain GRPO's on the clean verifier (paired interval below 0).

Methods and claims:
* `lagrangian` (Moskovitz et al., arXiv 2310.04373): constraining the proxy at a threshold stops its
  over-optimisation. Threshold θ: the proxy's mean over the seed's RL prompts' true answers (what right answers
  score; about 0.87), the verifier unconstrained, dual step `LAGRANGE_LR` = 0.1 (the default 0.01 moves μ by at most
  about 0.001 a step at the violations this proxy allows, too slow to act within 700 steps; chosen before running).
  Claim: `lagrangian` − `static`, interval above 0.
* `lagrangian_search` (the same paper's threshold search, NM-PPO): the proxy's threshold is not hand-set but found
  during the run by Nelder–Mead on a held-out score (the verifier again, at weight 0, on greedy completions of the
  first 32 RL prompts, every 35 steps; `SEARCH`), starting from the simplex {0.5, 1.0} inside [0, 1] (1.0 leaves the
  proxy unconstrained). Added after the arms above had run (pre-registered here before its first run). Claim:
  `lagrangian_search` − `static`, interval above 0 (same detection control as `lagrangian`).
* `length_conditional` (BalCapRL, Ye et al., arXiv 2605.07394): withholding the proxy from completions longer than
  the reference (`length_mask_max_ratio` 1.0; the reference is the true answer's length plus the eos, a dataset
  column) is a better length control than the linear proxy. Claim: `length_mask` − `static`, interval above 0.
* `brme` (Yan et al., arXiv 2409.15360): the reward-robust ensemble `λ·mean + (1 − λ)·min` (λ = 0.5, the default)
  resists reward-head error. Claim: `brme` − `ens_mean`, interval above 0.
* `stable_rank` (SR-GRPO, Tang & Yang, arXiv 2512.02807): the stable rank of the response's hidden states, as the
  only reward (`stable_rank_reward=True` at its defaults; the verifier is scored at weight 0, for the log), raises
  accuracy without labels. Claim: its held-out gain over the warm start, interval above 0 (no baseline subtracted,
  as for TTRL's majority vote in `grpo_methods.py`). A weak test of the paper's setting: the answers here are 1-3
  tokens, where hidden-state geometry has little room to carry quality; the verdict is read on this task only.
Verdicts as in `grpo_methods.py`: `replicated` (the claim's interval above 0, the detection control and the
testbed's control passed), `not replicated` (the controls passed and the interval does not lie above 0),
`inconclusive` (a control failed).

Command (each seed cached on its own, each arm within it as it finishes; `grpo` comes from the testbed's cache):
    OMP_NUM_THREADS=1 .venv/bin/python experiments/grpo_reward_design.py
Quick smoke run (tiny sizes, one seed; its verdicts mean nothing):
    OMP_NUM_THREADS=1 .venv/bin/python experiments/grpo_reward_design.py --quick --out /tmp/grpo_reward_design
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from _harness import run
from grpo_methods import claims_experiment, run_custom
from testbeds import rl
from testbeds.rl_recipe import CONTROL


NAME = "grpo_reward_design"
PROXY_WEIGHT = 5.0
HEAD_FLIP = 0.3
HEADS = 3
LAGRANGE_LR = 0.1
# lagrangian_search: the proxy's threshold starts at 0.5 with a second vertex at 1.0 (no constraint: the proxy is at
# most 1), bounded to [0, 1]; one proposal per validation, every 35 of the 700 steps (20 evaluations), on 32 prompts
SEARCH = {"start": 0.5, "step": 0.5, "eval_every": 35, "val_size": 32}
PROXY = "length_reward"

PROXY_ARM = {"rewards": "proxy", "overrides": {"reward_weights": [1.0, PROXY_WEIGHT]}}
HEADS_ARM = {"rewards": "heads", "overrides": {"robust_reward": "brme"}}
# arm -> how it is run: `rl.run_grpo` for the testbed's own arm, else `run_custom` with these rewards and flags
ARMS = {
    "grpo": None,
    "static": PROXY_ARM,
    "lagrangian": {**PROXY_ARM, "lagrangian": True},
    "lagrangian_search": {**PROXY_ARM, "search": True},
    "length_mask": {
        **PROXY_ARM,
        "column": True,
        "overrides": {
            **PROXY_ARM["overrides"],
            "length_mask_rewards": [1],
            "length_mask_reference": "reference_length",
            "length_mask_max_ratio": 1.0,
        },
    },
    "ens_mean": {**HEADS_ARM, "overrides": {**HEADS_ARM["overrides"], "brme_lambda": 1.0}},
    "brme": {**HEADS_ARM, "overrides": {**HEADS_ARM["overrides"], "brme_lambda": 0.5}},
    # label-free: the verifier is scored and logged at weight 0, the appended stable-rank reward trains
    "stable_rank": {"rewards": "verifier", "overrides": {"reward_weights": [0.0], "stable_rank_reward": True}},
}

# method (as `hf-stable list` names it) -> (family, arm, baseline arm, detection (arm, baseline))
CLAIMS = {
    "lagrangian": ("reward_weighting", "lagrangian", "static", ("static", "grpo")),
    "lagrangian_search": ("reward_weighting", "lagrangian_search", "static", ("static", "grpo")),
    "length_conditional": ("length_mask", "length_mask", "static", ("static", "grpo")),
    "brme": ("reward_transform", "brme", "ens_mean", ("ens_mean", "grpo")),
    "stable_rank": ("intrinsic_reward", "stable_rank", None, None),
}


@dataclass(frozen=True)
class Sizes:
    recipe: rl.Recipe = CONTROL


QUICK = Sizes(recipe=replace(rl.QUICK, rl_steps=2, eval_every=2, logging_steps=1))


def length_proxy(max_length: int):
    """The proxy reward: the completion's share of `max_length` (its tokens, eos included)."""

    def length_reward(completions, completion_ids, **kwargs) -> list[float]:
        return [len(ids) / max_length for ids in completion_ids]

    return length_reward


def held_out_verifier(verifier):
    """The verifier again, under its own name, at weight 0: the score the threshold search maximises."""

    def heldout_exact(**kwargs) -> list[float]:
        return verifier(**kwargs)

    return heldout_exact


def reference_length(row: dict) -> dict:
    """The true answer's length in tokens plus the eos (one token per character)."""
    return {"reference_length": len(str(row["answer"])) + 1}


def heads(seed: int) -> list:
    from hf_stable.rewards.noise import noisy_reward
    from hf_stable.testing import arithmetic_reward

    return [noisy_reward(arithmetic_reward, HEAD_FLIP, seed=seed * 100 + k, name=f"head{k}") for k in range(HEADS)]


def proxy_threshold(seed: int, recipe: rl.Recipe) -> float:
    answers = rl.rl_prompts(rl.seed_data(seed, recipe), seed, recipe)["answer"]
    return sum((len(str(a)) + 1) / recipe.max_completion_length for a in answers) / len(answers)


def arm_run(seed: int, sizes: Sizes, name: str) -> dict:
    spec = ARMS[name]
    recipe = sizes.recipe
    if spec is None:
        return rl.run_grpo(seed, recipe, label=name)
    overrides = dict(spec["overrides"])
    if spec.get("lagrangian"):
        overrides.update(
            reward_weighting="lagrangian",
            lagrange_thresholds=[None, proxy_threshold(seed, recipe)],
            lagrange_lr=LAGRANGE_LR,
        )
    if spec.get("search"):
        overrides.update(
            reward_weighting="lagrangian_search",
            reward_weights=[1.0, PROXY_WEIGHT, 0.0],
            lagrange_thresholds=[None, SEARCH["start"], None],
            lagrange_lr=LAGRANGE_LR,
            lagrange_search_objective=2,
            lagrange_search_low=[None, 0.0, None],
            lagrange_search_high=[None, 1.0, None],
            lagrange_search_step=[None, SEARCH["step"], None],
            lagrange_search_eval_every=max(1, min(SEARCH["eval_every"], recipe.rl_steps // 2)),
            lagrange_search_val_size=SEARCH["val_size"],
        )
    if spec["rewards"] == "proxy":
        rewards = [rl.make_reward(seed, recipe), length_proxy(recipe.max_completion_length)]
        if spec.get("search"):
            rewards.append(held_out_verifier(rl.make_reward(seed, recipe)))
    elif spec["rewards"] == "heads":
        rewards = heads(seed)
    else:
        rewards = [rl.make_reward(seed, recipe)]
    column = reference_length if spec.get("column") else None
    return run_custom(seed, recipe, rewards, overrides, column=column, label=name)


def proxy_table(result: dict) -> str:
    """The phenomenon behind the verdicts: the proxy's mean and the completion length at the end of each arm."""
    rows = ["| arm | proxy reward at the end | completion length at the end | verifier reward at the end |",
            "|---|---|---|---|"]
    for name in ARMS:
        ends = {}
        for key in (f"rewards/{PROXY}/mean", "completions/mean_length", f"rewards/{rl.REWARD_NAME}/mean"):
            series = [r[name].get("logged", {}).get(key) for r in result["per_seed"].values()]
            values = [s[-1][1] for s in series if s]
            ends[key] = f"{sum(values) / len(values):.3f}" if values else "-"
        rows.append(f"| {name} | " + " | ".join(ends.values()) + " |")
    return "\n".join(rows)


def report(result: dict) -> str:
    return proxy_table(result)


EXPERIMENT = claims_experiment(
    NAME,
    "Reward design on the RL testbed",
    "The constrained-RLHF Lagrangian (arXiv 2310.04373) and BalCapRL's length-conditional mask (arXiv "
    "2605.07394) stop a proxy reward's over-optimisation better than a fixed weight; BRME's robust ensemble (arXiv "
    "2409.15360) resists noisy reward heads better than their mean; SR-GRPO's stable-rank reward (arXiv "
    "2512.02807) raises accuracy without labels; each paired on the RL testbed where the phenomenon it targets is "
    "shown to be present.",
    ARMS,
    CLAIMS,
    arm_run,
    Sizes(),
    QUICK,
    report=report,
    config={"proxy_weight": PROXY_WEIGHT, "head_flip": HEAD_FLIP, "heads": HEADS, "lagrange_lr": LAGRANGE_LR},
    script=__file__,
)


if __name__ == "__main__":
    run(EXPERIMENT)
