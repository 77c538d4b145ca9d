"""MMC on the arithmetic testbed's answer distributions: does the Martingale Majority Certificate keep its error ≤ α
while drawing fewer answers than a fixed-n majority vote of the same error? (Cordero-Encinar & Duncan, arXiv
2510.17472)

Claim (from the paper's abstract). The Martingale Majority Certificate is a sequential stopping rule that certifies
that the majority answer is the mode of the model's answer distribution with anytime-valid error control, and decides
adaptively when enough answers have been drawn. hf_stable reconstructs the statistic (`hf_stable.evaluation.mmc`).

Design.
* Testbed: `experiments/testbeds/arithmetic.py`'s tiny Llama (hidden 64) pretrained on 2-digit addition for only
  `pretrain_steps` steps (so that it is unsure on part of the problems), seeded by the run seed.
* Answer distributions: `num_problems` additions drawn per seed; `answers_per_problem` completions each at
  temperature `temperature` (`hf_stable.evaluation.map_eval.sample_completions`), the answer = the first 3
  characters. Each problem's empirical answer distribution is the truth the simulation draws from (i.i.d. draws from
  that multinomial), so its mode is known exactly; problems whose two top counts tie are dropped (counted).
* Per problem, `reps` independent answer streams of length `budget` (seeded by seed and problem); on each stream:
  - MMC: `certify_stream(stream, alpha, budget)`; its answer = the certified answer, else (budget spent) the majority
    of the whole stream; its cost = the draws it read;
  - fixed-n majority vote for every n = 1..budget on the same stream's first n draws (ties: the first seen);
  - the invalid control rule: certify the leader as soon as it leads every other answer by 1 (after one draw).
* Errors, per seed, averaged over problems and streams: MMC's certificate error (certified and ≠ mode), MMC's answer
  error (answer ≠ mode, the fallback included), fixed-n error e_fix(n), the control rule's certificate error.
* Baseline n per seed: n_same = the least n with e_fix(n) ≤ MMC's answer error ("the same error"; chosen knowing the
  truth, which favours the baseline); n_alpha = the least n with e_fix(n) ≤ α. Either is `budget` when no n ≤ budget
  reaches it (censored, which understates the saving).
* Effect per seed (paired, same problems and streams): saved = n − MMC's mean draws; 95% Student-t interval over the 5
  seeds (4 degrees of freedom, t = 2.776).
* Seeds 0-4. Pilot seeds 100-102 only, rule fixed before any pilot: e_fix(1) ≥ 0.10 (one answer is often not the
  mode) and MMC certifies ≥ 30% of problem-streams (there are easy problems), on every pilot seed (`PILOT` in the JSON
  config).
* History (disclosed): the first design pretrained for 600 steps, chosen on pilot seed 100 alone (greedy exact match
  on T 0.97, e_fix(1) 0.39, 88% certified, MMC 71 mean draws, n_same 202, n_alpha 24). On seeds 0-4 the 600-step
  models had not learned addition (greedy exact match 0.11-0.20, where seed 100's had: when the model learns it
  depends on the seed), e_fix(1) 0.82-0.90, MMC certified 0-5% of streams and spent the budget (249-256 mean
  draws) with certificate error 0 on every seed; n_same 241-256, so (b) failed on 5/5 seeds, (c) on 3/5; the
  lead-by-1 control erred 0.82-0.90 (commit 9e22bdd, 260 CPU-seconds, not kept). That testbed was outside the pilot
  rule (it fails "certifies ≥ 30%"), so the design was changed to the testbed's default pretraining (2500 steps, as
  the other arithmetic experiments use) with the rule checked on three pilot seeds, and rerun on seeds 0-4 unchanged
  otherwise; the criteria below are the first design's, word for word. At 2500 steps the models are sure (exact
  match 1.0): temperatures 1 and 1.5 fail the rule (e_fix(1) ≤ 0.035), temperature 2 meets it (e_fix(1) 0.16-0.20,
  all streams certified) and is kept. On those pilots MMC drew 15 answers on average against n_same 8-11: (b) is
  expected to fail on this testbed, whose problems are all easy (MMC cannot certify before 9 draws at α = 0.05).

Pass criteria (pre-registered before the run on seeds 0-4; printed PASS/FAIL as measured):
  (a) CLAIM valid: MMC's certificate error ≤ α on every seed;
  (b) CLAIM fewer draws at the same error: n_same − MMC's mean draws, seed mean > 0 and 95% interval above 0;
  (c) REPORTED (not the paper's claim): fewer draws than the fixed n whose error averaged over problems is ≤ α:
      n_alpha − MMC's mean draws, seed mean > 0 and 95% interval above 0. MMC guarantees α on every problem, a
      fixed n tuned on the truth only on average, so MMC is expected to lose here (it did on the first pilot);
  (d) CONTROL that must fail (criterion passes when it does): the lead-by-1 rule's certificate error > α on every
      seed: the error measurement can see an invalid rule;
  (e) CONTROL: the testbed is not trivial: e_fix(1) ≥ 0.10 on every seed.

Command (~2.5 CPU-minutes per seed, 2 of them pretraining, cached per seed under experiments/cache/evaluation_mmc;
~12 CPU-minutes for the 5 seeds):
    OMP_NUM_THREADS=1 .venv/bin/python experiments/evaluation_mmc.py
Quick smoke run (< 60 s, 1 seed, tiny sizes; its pass/fail means nothing):
    OMP_NUM_THREADS=1 .venv/bin/python experiments/evaluation_mmc.py --quick --out /tmp/evaluation_mmc
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from _harness import criterion, declare, mean_std, run, save_figure, seeds_holding, subplots
from testbeds import arithmetic


NAME = "evaluation_mmc"
T_975 = {2: 4.303, 3: 3.182, 4: 2.776}  # two-sided 95% Student-t quantiles by degrees of freedom
NONTRIVIAL = 0.10  # (e)
PILOT = {
    "seeds": [100, 101, 102],
    "rule": "e_fix(1) >= 0.10 and MMC certifies >= 30% of problem-streams, every pilot seed; temperatures tried in "
    "the order 1, 1.5, 2, 3, the first that meets the rule is kept",
    "first_design_seed100_pretrain600_t1": {"e_fix_1": 0.392, "certified": 0.879, "mmc_draws": 70.9, "n_same": 202,
                                            "n_alpha": 24},
    "pretrain2500_t1": {"e_fix_1": [0.001, 0.002, 0.0], "certified": [1.0, 1.0, 1.0], "mmc_draws": [9.1, 9.1, 9.1],
                        "n_same": [3, 3, 3], "n_alpha": [1, 1, 1]},
    "pretrain2500_t1.5": {"e_fix_1": [0.035, 0.035, 0.027], "certified": [1.0, 1.0, 1.0],
                          "mmc_draws": [10.1, 10.3, 10.0], "n_same": [4, 5, 4], "n_alpha": [1, 1, 1]},
    "pretrain2500_t2": {"e_fix_1": [0.2, 0.196, 0.163], "certified": [1.0, 1.0, 1.0], "mmc_draws": [15.4, 15.9, 14.6],
                        "n_same": [9, 11, 8], "n_alpha": [4, 4, 3]},
    "decision": "pretrain 2500 steps, temperature 2 (the first meeting the rule); on it MMC drew more than n_same",
}


@dataclass(frozen=True)
class Sizes(arithmetic.Sizes):
    pretrain_steps: int = 2500
    num_problems: int = 60
    answers_per_problem: int = 400
    temperature: float = 2.0
    reps: int = 40
    budget: int = 256
    alpha: float = 0.05


QUICK = Sizes(pretrain_steps=100, num_problems=8, answers_per_problem=64, reps=5, budget=64)


def answer_distributions(seed: int, sizes: Sizes) -> tuple[list[dict], dict]:
    """Per kept problem `{"prompt", "counts": {answer: count}}` from the seed's briefly pretrained model."""
    from hf_stable.evaluation.map_eval import sample_completions
    from hf_stable.testing import build_tiny_tokenizer

    data = arithmetic.task_data(sizes, train_eval=0)
    path = arithmetic.pretrain(NAME, seed, sizes, data)
    model = arithmetic.load_base(path)
    rng = random.Random(seed)
    pairs = rng.sample([(a, b) for a in range(100) for b in range(100)], sizes.num_problems)
    prompts = [f"{a:02d}+{b:02d}=" for a, b in pairs]
    texts = sample_completions(
        model, build_tiny_tokenizer(), prompts, num_samples=sizes.answers_per_problem,
        max_new_tokens=arithmetic.ANSWER_LEN + 1, temperature=sizes.temperature, seed=seed, batch_size=4,
    )
    problems, dropped = [], 0
    for prompt, group in zip(prompts, texts, strict=True):
        counts: dict[str, int] = {}
        for t in group:
            a = t.strip()[: arithmetic.ANSWER_LEN]
            counts[a] = counts.get(a, 0) + 1
        top = [*sorted(counts.values(), reverse=True), 0]
        if top[0] == top[1]:
            dropped += 1
            continue
        problems.append({"prompt": prompt, "counts": counts})
    return problems, {"dropped_ties": dropped}


def simulate_problem(counts: dict, sizes: Sizes, rng: random.Random) -> dict:
    from hf_stable.evaluation.mmc import certify_stream

    labels = list(counts)
    weights = [counts[a] for a in labels]
    mode = max(labels, key=counts.get)
    fixed_wrong = [0] * sizes.budget
    out = {"mmc_cert_wrong": 0, "mmc_certified": 0, "mmc_answer_wrong": 0, "mmc_draws": 0, "lead1_wrong": 0}
    for _ in range(sizes.reps):
        stream = rng.choices(labels, weights=weights, k=sizes.budget)
        tally: dict[str, int] = {}
        leader = None
        for n, x in enumerate(stream):
            tally[x] = tally.get(x, 0) + 1
            if leader is None or tally[x] > tally[leader]:
                leader = x  # ties keep the earlier leader (the first seen to reach the count)
            fixed_wrong[n] += leader != mode
        cert = certify_stream(iter(stream), alpha=sizes.alpha, max_samples=sizes.budget)
        answer = cert.answer if cert.certified else cert.majority
        out["mmc_certified"] += cert.certified
        out["mmc_cert_wrong"] += cert.certified and cert.answer != mode
        out["mmc_answer_wrong"] += answer != mode
        out["mmc_draws"] += cert.num_samples
        out["lead1_wrong"] += stream[0] != mode  # the lead-by-1 rule certifies the first draw
    reps = sizes.reps
    rates = {k: v / reps for k, v in out.items()}
    rates["fixed_wrong"] = [v / reps for v in fixed_wrong]
    rates["p_mode"] = counts[mode] / sum(weights)
    return rates


def least_n(curve: list[float], target: float) -> int:
    """1-based least n with curve[n − 1] ≤ target; len(curve) when none (censored)."""
    return next((n for n, e in enumerate(curve, start=1) if e <= target + 1e-12), len(curve))


def run_seed(seed: int, sizes: Sizes) -> dict:
    start = time.time()
    problems, info = answer_distributions(seed, sizes)
    sampled = time.time() - start
    rows = [simulate_problem(p["counts"], sizes, random.Random(seed * 100_003 + i)) for i, p in enumerate(problems)]
    mean = lambda key: statistics.fmean(r[key] for r in rows)  # noqa: E731
    fixed = [statistics.fmean(r["fixed_wrong"][n] for r in rows) for n in range(sizes.budget)]
    record = {k: mean(k) for k in ("mmc_cert_wrong", "mmc_certified", "mmc_answer_wrong", "mmc_draws", "lead1_wrong")}
    record["mmc_cert_wrong_max_problem"] = max(r["mmc_cert_wrong"] for r in rows)
    record["fixed_wrong"] = fixed
    record["n_same"] = least_n(fixed, record["mmc_answer_wrong"])
    record["n_alpha"] = least_n(fixed, sizes.alpha)
    record["saved_same"] = record["n_same"] - record["mmc_draws"]
    record["saved_alpha"] = record["n_alpha"] - record["mmc_draws"]
    record["num_problems"] = len(rows)
    record["p_mode"] = [r["p_mode"] for r in rows]
    record["draws_per_problem"] = [r["mmc_draws"] for r in rows]
    record.update(info, seconds_sampling=sampled, seed_wall_s=time.time() - start)
    print(f"[seed {seed}] {len(rows)} problems: MMC draws {record['mmc_draws']:.1f}, cert err "
          f"{record['mmc_cert_wrong']:.4f}, answer err {record['mmc_answer_wrong']:.4f}, n_same {record['n_same']}, "
          f"n_alpha {record['n_alpha']}, e_fix(1) {fixed[0]:.3f}, lead-1 err {record['lead1_wrong']:.3f}", flush=True)
    return record


def interval(diffs: list[float]) -> dict:
    n = len(diffs)
    mean = statistics.fmean(diffs)
    if n < 2:
        return {"mean": mean, "ci_low": float("nan"), "ci_high": float("nan"), "n": n}
    half = T_975.get(n - 1, 1.96) * statistics.stdev(diffs) / n**0.5
    return {"mean": mean, "ci_low": mean - half, "ci_high": mean + half, "n": n}


def aggregate(per_seed: dict, sizes: Sizes) -> dict:
    rs = list(per_seed.values())
    agg = {k: mean_std([r[k] for r in rs]) for k in (
        "mmc_draws", "mmc_cert_wrong", "mmc_answer_wrong", "mmc_certified", "lead1_wrong", "n_same", "n_alpha",
    )}
    agg["fixed_wrong_1"] = mean_std([r["fixed_wrong"][0] for r in rs])
    agg["saved_same"] = interval([r["saved_same"] for r in rs])
    agg["saved_alpha"] = interval([r["saved_alpha"] for r in rs])
    return agg


def criteria(per_seed: dict, agg: dict, sizes: Sizes) -> dict:
    a = sizes.alpha
    cert = [r["mmc_cert_wrong"] for r in per_seed.values()]
    lead = [r["lead1_wrong"] for r in per_seed.values()]
    fix1 = [r["fixed_wrong"][0] for r in per_seed.values()]
    same, nominal = agg["saved_same"], agg["saved_alpha"]
    return {
        "a": criterion(
            f"CLAIM: MMC's certificate error (certified and not the mode) ≤ α = {a} on every seed",
            max(cert) <= a, {"max": max(cert), "values": cert},
            seeds_holding(per_seed, lambda r: r["mmc_cert_wrong"] <= a),
        ),
        "b": criterion(
            "CLAIM: n_same (least fixed n with majority error ≤ MMC's answer error) − MMC's mean draws > 0, 95% "
            "interval above 0", same["mean"] > 0 and same["ci_low"] > 0, same,
            seeds_holding(per_seed, lambda r: r["saved_same"] > 0),
        ),
        "c": criterion(
            f"REPORTED: n_alpha (least fixed n with majority error averaged over problems ≤ α = {a}) − MMC's mean "
            "draws > 0, 95% interval above 0", nominal["mean"] > 0 and nominal["ci_low"] > 0, nominal,
            seeds_holding(per_seed, lambda r: r["saved_alpha"] > 0),
        ),
        "d": criterion(
            f"CONTROL (must fail): the lead-by-1 rule's certificate error > α = {a} on every seed",
            min(lead) > a, {"min": min(lead), "values": lead},
            seeds_holding(per_seed, lambda r: r["lead1_wrong"] > a),
        ),
        "e": criterion(
            f"CONTROL: not trivial: one answer's majority error e_fix(1) ≥ {NONTRIVIAL} on every seed",
            min(fix1) >= NONTRIVIAL, {"min": min(fix1), "values": fix1},
            seeds_holding(per_seed, lambda r: r["fixed_wrong"][0] >= NONTRIVIAL),
        ),
    }


def plot(result: dict, path: Path) -> None:
    fig, axes = subplots(1, 2, (10, 3.6))
    for seed, r in result["per_seed"].items():
        line = axes[0].plot(range(1, len(r["fixed_wrong"]) + 1), r["fixed_wrong"], lw=1, label=f"fixed n, seed {seed}")
        axes[0].plot([r["mmc_draws"]], [r["mmc_answer_wrong"]], "o", color=line[0].get_color())
        axes[1].scatter(r["p_mode"], r["draws_per_problem"], s=8, label=f"seed {seed}")
    alpha = result["config"]["sizes"]["alpha"]
    axes[0].axhline(alpha, color="gray", ls=":", lw=1)
    axes[0].set_xscale("log")
    axes[0].set_xlabel("answers drawn (fixed n; dots: MMC's mean draws)")
    axes[0].set_ylabel("P(answer ≠ mode)")
    axes[0].legend(fontsize=6)
    axes[1].set_xlabel("probability of the mode")
    axes[1].set_ylabel("MMC's mean draws on the problem")
    save_figure(fig, path)


def markdown(result: dict) -> str:
    agg, sizes = result["aggregate"], result["config"]["sizes"]
    ms = lambda k, d=3: f"{agg[k]['mean']:.{d}f} ± {agg[k]['std']:.{d}f}"  # noqa: E731
    ci = lambda k: f"{agg[k]['mean']:+.1f} [{agg[k]['ci_low']:+.1f}, {agg[k]['ci_high']:+.1f}]"  # noqa: E731
    lines = [
        f"α = {sizes['alpha']}, budget {sizes['budget']} draws, {sizes['reps']} streams per problem. Seed mean ± std "
        "(errors averaged over problems and streams); savings: paired per seed, 95% t interval over seeds.",
        "",
        "| measure | value |",
        "|---|---|",
        f"| MMC mean draws | {ms('mmc_draws', 1)} |",
        f"| MMC certified share | {ms('mmc_certified')} |",
        f"| MMC certificate error (certified, ≠ mode) | {ms('mmc_cert_wrong', 4)} |",
        f"| MMC answer error (fallback: majority at the budget) | {ms('mmc_answer_wrong', 4)} |",
        f"| fixed n with the same error (n_same) | {ms('n_same', 1)} |",
        f"| fixed n with error ≤ α (n_alpha) | {ms('n_alpha', 1)} |",
        f"| draws saved vs n_same | {ci('saved_same')} |",
        f"| draws saved vs n_alpha | {ci('saved_alpha')} |",
        f"| one answer's error e_fix(1) | {ms('fixed_wrong_1')} |",
        f"| lead-by-1 rule's certificate error (invalid control) | {ms('lead1_wrong')} |",
        "",
        f"![error vs draws]({NAME}.png)",
    ]
    return "\n".join(lines)


EXPERIMENT = declare(
    globals(),
    title="MMC (Martingale Majority Certificate) vs fixed-n majority vote on the arithmetic testbed's answers",
    claim=(
        "MMC (Cordero-Encinar & Duncan, arXiv 2510.17472): the sequential certificate keeps its error (certifying a "
        "non-mode) ≤ α and draws fewer answers on average than a fixed-n majority vote of the same error."
    ),
    config={"pilot": PILOT, "t_975": T_975, "nontrivial": NONTRIVIAL},
    default_seeds=(0, 1, 2, 3, 4),
    size_flags={"--temperature": {"type": float, "help": "sampling temperature of the answers (pilot)"}},
)


if __name__ == "__main__":
    run(EXPERIMENT)
