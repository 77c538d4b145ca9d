"""Which flag helps when: every registered method's claim, experiment and verdict, from the committed results.

Writes `experiments/results/index.json` (family → method name as `hf-stable list` prints it → {experiment, verdict,
effect, ci_low, ci_high, control_passed, ...}) and `docs/evidence.md` (generated: edit this file, not the page).
`tests/experiments/test_evidence_index.py` checks that both are what this script writes from today's results and
that every registered method has a row.

Verdicts:
* `replicated`: the claim's criteria pass and every control of its testbed passes;
* `not replicated`: a claim criterion fails on a testbed whose controls passed (it could show the effect);
* `inconclusive`: a control failed, or the experiment has no control that shows it could detect the effect, so a
  failure says nothing;
* `reference`: a baseline other methods are measured against (no claim of its own);
* `no experiment`: nothing measures the claim yet.

Command:
    .venv/bin/python experiments/evidence.py
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path


ROOT = Path(__file__).resolve().parent
REPO = ROOT.parent
RESULTS = ROOT / "results"
INDEX = RESULTS / "index.json"
PAGE = REPO / "docs" / "evidence.md"
SOURCE = "https://github.com/hf-stable/hf_stable/blob/main/experiments/results"

# Checked tensor for tensor against mergekit on mergekit's own recipes (tests/merging/test_mergekit_parity.py): their
# evidence is parity, not an experiment.
MERGEKIT_CHECKED = frozenset(
    "arcee_fusion breadcrumbs breadcrumbs_ties dare_linear dare_ties della della_linear karcher linear model_stock "
    "multislerp nearswap nuslerp passthrough ram ramplus_tl sce slerp task_arithmetic ties".split()
)
# The docs page that documents each family: its evidence block (between `BEGIN` and `END`) lists the family's rows.
FAMILY_PAGE = {
    "advantage_estimator": "grpo.md",
    "lr_scaling": "grpo.md",
    "loss_aggregation": "grpo.md",
    "loss_mode": "grpo.md",
    "advantage_filter": "grpo.md",
    "length_mask": "grpo.md",
    "intrinsic_reward": "grpo.md",
    "reward_function": "grpo.md",
    "reward_transform": "grpo.md",
    "reward_weighting": "grpo.md",
    "gradient_aggregation": "grpo.md",
    "sft_objective": "sft.md",
    "sft_threshold": "sft.md",
    "sft_sample_reweighting": "sft.md",
    "sft_sequence_objective": "sft.md",
    "merge_method": "merging.md",
    "stability_optimizer": "stability.md",
    "stability_monitor": "stability.md",
    "stability": "stability.md",
    "unlearning_method": "unlearning.md",
    "unlearning_forget_loss": "unlearning.md",
    "unlearning_retain_loss": "unlearning.md",
    "adapter": "adapters.md",
    "evaluation": "evaluation.md",
}
BEGIN, END = "<!-- evidence:begin (written by experiments/evidence.py) -->", "<!-- evidence:end -->"
VERDICTS = ("replicated", "not replicated", "inconclusive", "reference", "no experiment")


@dataclass(frozen=True)
class Row:
    """One method's evidence. `claim`: criteria of `experiment` that state the claim; `controls`: criteria that
    show the testbed can detect it (all must pass for a failure to count). `verdicts`: the method's keys in the
    experiment's `aggregate.methods` (the experiments on the RL testbed compute their own verdicts, each with its
    detection control). `tofu`: the method's arm in `tinytofu.json`. `undetectable`: the testbed cannot show the
    phenomenon the claim is about and no control says otherwise, so a failure there reads inconclusive."""

    family: str
    name: str
    text: str
    experiment: str | None = None
    claim: tuple[str, ...] = ()
    controls: tuple[str, ...] = ()
    verdicts: tuple[str, ...] = ()
    tofu: str | None = None
    reference: bool = False
    why: str = ""
    also: tuple[str, ...] = field(default=())
    undetectable: bool = False


R = Row
ROWS = (
    # GRPO advantages, losses and rewards: the RL testbed's experiments first, then the older toy experiments
    R("advantage_estimator", "sgrpo", "S-GRPO keeps learning under noisy binary rewards where GRPO does not",
      "grpo_methods", verdicts=("sgrpo (i.i.d. flips)", "sgrpo (one flip per group)"),
      also=("grpo_toy_bandits",)),
    R("advantage_estimator", "maxrl", "MaxRL improves on GRPO at equal samples", "grpo_methods",
      verdicts=("maxrl",), also=("grpo_toy_bandits",)),
    R("advantage_estimator", "dvao", "DVAO balances conflicting rewards better than a fixed combination",
      "grpo_toy_bandits", claim=("dvao", "dvao_conflict"), controls=("dvao_control",),
      also=("grpo_multi_objective",)),
    R("advantage_estimator", "oblr", "OBLR-PO keeps RL stable where the step is too large", "grpo_methods",
      verdicts=("oblr",), also=("grpo_toy_bandits",)),
    R("lr_scaling", "snr", "SNR-scaled learning rate keeps RL stable where the step is too large", "grpo_methods",
      verdicts=("snr",)),
    R("loss_aggregation", "delta_l", "ΔL is the minimum-variance unbiased aggregation", "grpo_toy_bandits",
      claim=("delta_l",), also=("grpo_length",)),
    R("loss_mode", "drpo", "DRPO shortens correct answers without losing accuracy", "grpo_length", claim=("a",),
      also=("grpo_toy_bandits",)),
    R("loss_mode", "onpolicy_sft", "on-policy SFT shortens answers without losing accuracy", "grpo_length",
      claim=("b",)),
    R("loss_mode", "stable_reinforce", "the pre-clipped ratio keeps RL stable where PPO's ratio blows up",
      "grpo_off_policy", verdicts=("stable_reinforce (stale data)", "stable_reinforce (stale data, LR 1e-3)")),
    R("advantage_filter", "sigma_filter", "dropping advantages beyond 3 sigma stabilises RL", "grpo_off_policy",
      verdicts=("sigma_filter",)),
    R("reward_function", "stable_reinforce_reward", "the consistency term makes the policy's reasoning agree with "
      "its answer", "grpo_consistency", verdicts=("stable_reinforce_reward",),
      why="the judge is a rule that reads a one-digit reasoning (the ones digit of the sum) where the paper's is a "
      "model reading free text: a weaker test of the same mechanism"),
    R("loss_mode", "ess", "the ESS-adaptive loss uses off-policy data stably", "grpo_off_policy",
      verdicts=("ess",)),
    R("intrinsic_reward", "stable_rank", "stable rank as an intrinsic reward improves alignment without labels",
      "grpo_reward_design", verdicts=("stable_rank",), undetectable=True,
      why="read on 1-3-token answers, where hidden-state geometry has little room to carry quality; the reward alone "
      "collapsed the policy there (-0.564), which says not to use it alone on such a task, not that the paper's "
      "free-text claim fails"),
    R("reward_function", "arithmetic_exact_match", "the testbeds' verifier", reference=True),
    R("reward_function", "majority_vote", "label-free RL with the group's majority answer raises accuracy (TTRL)",
      "grpo_methods", verdicts=("majority_vote",)),
    R("reward_transform", "brme", "a robust reward ensemble resists reward-model error", "grpo_reward_design",
      verdicts=("brme",)),
    R("length_mask", "length_conditional", "withholding a reward past a length ratio to the reference is a better "
      "length penalty than a linear one (BalCapRL)", "grpo_reward_design", verdicts=("length_conditional",),
      also=("grpo_smollm2",), why="confirmed once on SmolLM2-135M-Instruct (grpo_smollm2: +0.150 [+0.038, +0.262] "
      "over held-out problems, far below plain GRPO's 0.675)"),
    R("reward_weighting", "static", "TRL's fixed reward weights", reference=True),
    R("reward_weighting", "ctwa", "CTWA protects the objective that interferes", "grpo_toy_bandits", claim=("ctwa",),
      also=("grpo_multi_objective",)),
    R("reward_weighting", "gradient", "gradient-based weights serve the under-served objective", "grpo_toy_bandits",
      claim=("gradient",), controls=("gradient_control",), also=("grpo_multi_objective",)),
    R("reward_weighting", "hypervolume", "hypervolume weights end undominated by a static sum", "grpo_multi_objective",
      claim=("a",), controls=("control_conflict",), why="criterion (a) passes on margins inside the seed noise: "
      "correctness −0.017, even ending +0.008 against the static sum"),
    R("reward_weighting", "lagrangian", "constrained RLHF stops reward over-optimisation", "grpo_reward_design",
      verdicts=("lagrangian",), also=("grpo_smollm2",), why="not confirmed in one 40-step run on "
      "SmolLM2-135M-Instruct (grpo_smollm2: +0.075 [-0.008, +0.158] over held-out problems)"),
    R("reward_weighting", "lagrangian_search", "the threshold search stops reward over-optimisation without "
      "hand-set thresholds", "grpo_reward_design", verdicts=("lagrangian_search",)),
    R("reward_weighting", "pama", "PAMA's closed-form weights end undominated by a static sum", "grpo_multi_objective",
      claim=("pama",), controls=("control_conflict",)),
    R("gradient_aggregation", "upgrad", "UPGrad's conflict-free update ends undominated by a static sum",
      "grpo_multi_objective", claim=("upgrad",), controls=("control_conflict",)),
    R("gradient_aggregation", "aligned_mtl", "Aligned-MTL's aligned update ends undominated by a static sum",
      "grpo_multi_objective", claim=("aligned_mtl",), controls=("control_conflict",)),
    # SFT
    R("sft_objective", "nll", "TRL's NLL", reference=True),
    R("sft_objective", "prob_power", "-p is as good as NLL on a strong model and far worse on a weak one",
      "sft_capability_continuum", claim=("ms_p", "ms_p10", "mw"), controls=("control_ms", "control_mw")),
    R("sft_objective", "threshold", "thresholded objectives lie between NLL and -p", "sft_thresholds",
      claim=("top_p", "top_p_mw"), controls=("control_ms", "control_mw"),
      why="read on its default kind, top_p"),
    R("sft_objective", "auto", "the `auto` rule picks the better objective by the model's prior",
      "sft_capability_continuum", claim=("calibrated_rule", "shipped_rule"), controls=("control_ms", "control_mw")),
    *(
        R("sft_threshold", name, "the thresholded objective does as well as NLL on a strong model and better than -p "
          "on a weak one", "sft_thresholds", claim=(name, f"{name}_mw"), controls=("control_ms", "control_mw"))
        for name in ("top_p", "bottom_p", "top_logp", "bottom_logp", "unlikelihood_top", "unlikelihood_bottom")
    ),
    R("sft_sample_reweighting", "feasible", "Feasible Learning bounds every sample's loss", "sft_thresholds",
      claim=("feasible", "feasible_mean"), controls=("feasible_tail",)),
    R("sft_sequence_objective", "redi", "REDI's α < 1 keeps training on negatives stable", "redi_alpha",
      claim=("a_near", "a_far", "b_near", "b_far"), controls=("c_near", "c_far")),
    # merging beyond mergekit
    R("merge_method", "fisher_rao", "Fisher-Rao merging beats linear averaging as experts diverge",
      "merge_fisher_rao", claim=("a", "b"), controls=("c",)),
    R("merge_method", "nre", "norm restoration keeps the merged activation scale", "merge_fisher_rao", claim=("b",),
      controls=("c",)),
    R("merge_method", "nre_unit", "norm restoration keeps the merged activation scale", "merge_fisher_rao",
      claim=("b",), controls=("c",)),
    R("merge_method", "fw_merging", "FW-Merging keeps accuracy as irrelevant experts join", "merge_fw", claim=("a",),
      controls=("b",)),
    R("merge_method", "wsm", "merging constant-LR checkpoints matches a real LR decay", "merge_wsm", claim=("a",)),
    # the same merging claims on experts fine-tuned from one tiny Llama on different skills (merge_skills)
    R("merge_method", "fisher_rao (skill experts)", "Fisher-Rao merging beats linear averaging of experts trained "
      "on different skills", "merge_skills", claim=("a",),
      controls=("control_merge_can_win", "control_experts_specialise", "control_merge_can_lose")),
    R("merge_method", "nre (skill experts)", "norm restoration keeps the merged activation scale", "merge_skills",
      claim=("b_nre",), controls=("c",)),
    R("merge_method", "nre_unit (skill experts)", "norm restoration keeps the merged activation scale",
      "merge_skills", claim=("b_nre_unit",), controls=("c",)),
    R("merge_method", "fw_merging (skill experts)", "FW-Merging keeps the target skills as irrelevant experts join",
      "merge_skills", claim=("fw",), controls=("fw_control", "control_experts_specialise")),
    # evaluation
    R("evaluation", "map", "merging the last checkpoints and scoring pass@k gives smoother curves and a smaller gap "
      "between runs than one checkpoint's greedy accuracy", "map_eval", claim=("a", "b"), controls=("c", "d"),
      why="smoother curves shown (a); the gap between two runs was lower on 5/5 seeds but its interval reaches 0 (b)"),
    R("evaluation", "mmc", "the Martingale Majority Certificate keeps its error <= alpha and draws fewer answers "
      "than a fixed-n majority vote of the same error", "evaluation_mmc", claim=("a", "b"), controls=("d", "e"),
      why="error 0 <= alpha on 5/5 seeds; fewer draws only where answers are spread (seed 4: 101 vs 206), more on "
      "easy problems (16 vs 9-10), where MMC cannot stop before 9 draws"),
    # stability
    R("stability_optimizer", "stable_spam", "Stable-SPAM damps a gradient spike before it lands, at no cost on a "
      "clean run", "stability_spam", claim=("S2", "S4"), controls=("S1",)),
    R("stability_monitor", "innovation_probe", "the innovation probe flags instability before the loss does",
      "stability_monitors", claim=("innovation_detects", "innovation_lead", "innovation_quiet"),
      controls=("fault_hurts", "healthy_ok", "monitors_passive", "loss_rule_no_lead")),
    R("stability_monitor", "representation_drift", "representation drift predicts degraded steerability",
      "stability_monitors", claim=("drift_detects", "drift_quiet", "drift_rises"),
      controls=("fault_hurts", "healthy_ok", "monitors_passive"),
      why="the testbed has no steering task: read as 'drift rises with the damage and alarms on it, not on healthy "
      "runs'"),
    # unlearning (TinyTOFU v2: GA's collapse and the embedding-reset control are its controls)
    *(
        R(family, name, "Tier 1 of TinyTOFU v2 on every seed (forgets, keeps retain and world knowledge)",
          "tinytofu", controls=("b", "d"), tofu=arm)
        for family, name, arm in (
            ("unlearning_method", "graddiff", "graddiff"),
            ("unlearning_method", "npo", "npo"),
            ("unlearning_method", "simnpo", "simnpo"),
            ("unlearning_method", "sga", "sga"),
            ("unlearning_method", "pdu", "pdu"),
            ("unlearning_method", "stableun", "stableun"),
            ("unlearning_method", "dmm", "dmm_oracle"),
            ("unlearning_forget_loss", "npo", "npo"),
            ("unlearning_forget_loss", "simnpo", "simnpo"),
            ("unlearning_forget_loss", "sga", "sga"),
            ("unlearning_forget_loss", "flatten", "pdu"),
            ("unlearning_forget_loss", "dmm", "dmm_oracle"),
        )
    ),
    R("unlearning_method", "ga", "gradient ascent: the collapse the others are measured against", reference=True),
    R("unlearning_forget_loss", "ga", "gradient ascent: the collapse the others are measured against", reference=True),
    *(R("unlearning_retain_loss", n, "a retain term other methods combine", reference=True) for n in ("nll", "kl")),
    R("unlearning_retain_loss", "none", "no retain term", reference=True),
    # adapters and the stability callbacks (not registry methods; their flags are listed by their pages)
    R("adapter", "map", "LoMAP at least matches LoRA at equal rank", "adapters_map_rank", claim=("a", "b"),
      controls=("c",)),
    R("adapter", "rslora", "with α/√r the loss keeps improving with rank", "adapters_rslora_rank",
      claim=("a", "c"), controls=("b",)),
    R("adapter", "sine", "bounded sine adapters keep unlearning stable where LoRA blows up",
      "adapters_sine_unlearning", claim=("2", "3"), controls=("1a", "1b", "1c")),
    R("adapter", "tfb", "TFB lowers ECE and NLL at the same accuracy", "adapters_tfb_calibration",
      claim=("1", "2")),
    R("adapter", "svd", "training only the singular values (CLOVER) matches LoRA with fewer parameters",
      "adapters_svd", claim=("A",), controls=("C1", "C2", "C3", "C4")),
    R("stability", "guard", "on SFT, the guard turns three injected faults into runs that end where a clean run ends",
      "stability_guard_spike_v2", claim=("A1", "A3"), controls=("A2",)),
    R("stability", "guard (GRPO, healthy run)", "the guard leaves a healthy sparse-reward GRPO run untouched",
      "stability_guard_rl", claim=("H",), controls=("control",)),
    R("stability", "guard (GRPO, LR blow-up)", "the guard turns an LR blow-up of a GRPO run into a run that ends "
      "where the clean run ends", "stability_guard_rl", claim=("R", "E"), controls=("control", "F")),
    R("stability", "component_clip", "per-component clipping lowers the seed spread of the final loss",
      "stability_guard_spike", claim=("B1", "B2")),
)


def load(name: str) -> dict | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _criteria_verdict(result: dict, claim: tuple[str, ...], controls: tuple[str, ...]) -> tuple[str, bool | None]:
    crit = result["criteria"]
    missing = [k for k in (*claim, *controls) if k not in crit]
    if missing:
        raise KeyError(f"criteria {missing} not in the result")
    controls_ok = all(crit[k]["passed"] for k in controls) if controls else None
    if controls_ok is False:
        return "inconclusive", controls_ok
    if all(crit[k]["passed"] for k in claim):
        return "replicated", controls_ok
    return ("not replicated" if controls_ok else "inconclusive"), controls_ok


def _interval(values: dict | None) -> tuple:
    values = values or {}
    return values.get("mean"), values.get("ci_low"), values.get("ci_high")


def evaluate(row: Row) -> dict:
    out = {"family": row.family, "claim": row.text, "experiment": row.experiment, "also": list(row.also)}
    if row.reference or row.experiment is None:
        verdict = "reference" if row.reference else "no experiment"
        return {**out, "verdict": verdict, "effect": None, "ci_low": None, "ci_high": None, "control_passed": None,
                "why": row.why}
    result = load(row.experiment)
    if result is None:
        return {**out, "verdict": "no experiment", "effect": None, "ci_low": None, "ci_high": None,
                "control_passed": None, "why": f"{row.experiment}.json is not committed"}
    effect = ci_low = ci_high = None
    if row.verdicts:
        found = [result["aggregate"]["methods"][k] for k in row.verdicts]
        verdict = min((v["verdict"] for v in found), key=VERDICTS.index)  # the best reading over its phenomena
        best = next(v for v in found if v["verdict"] == verdict)
        # the controls of the phenomenon the verdict is read on (each phenomenon's own are in `detail`)
        control = best["control_passed"] and (best["detection"] is None or best["detection"]["ci_high"] < 0)
        if row.undetectable and verdict == "not replicated":
            verdict, control = "inconclusive", None
        effect, ci_low, ci_high = _interval(best["effect"])
        detail = {k: {"verdict": v["verdict"], "effect": v["effect"]["mean"], "ci_low": v["effect"]["ci_low"],
                      "ci_high": v["effect"]["ci_high"]} for k, v in zip(row.verdicts, found, strict=True)}
        out["detail"] = detail
    elif row.tofu:
        agg = result["aggregate"][row.tofu]
        n = len(result["per_seed"])
        control = all(result["criteria"][k]["passed"] for k in row.controls)
        effect = agg["tier1_seeds"] / n
        out["effect_is"] = f"share of seeds on which Tier 1 holds ({agg['tier1_seeds']}/{n})"
        verdict = "inconclusive" if not control else ("replicated" if agg["tier1_seeds"] == n else "not replicated")
    else:
        verdict, control = _criteria_verdict(result, row.claim, row.controls)
        if len(row.claim) == 1:
            effect, ci_low, ci_high = _interval(result["criteria"][row.claim[0]].get("values"))
        out["criteria"] = {k: result["criteria"][k]["passed"] for k in (*row.claim, *row.controls)}
        if not row.controls:
            out["why"] = "the experiment has no control that shows it can detect the effect"
    out.update(verdict=verdict, effect=effect, ci_low=ci_low, ci_high=ci_high, control_passed=control)
    if row.why and "why" not in out:
        out["why"] = row.why
    return out


def build_index() -> dict:
    index: dict[str, dict] = {}
    for row in ROWS:
        index.setdefault(row.family, {})[row.name] = evaluate(row)
    return index


def _num(x) -> str:
    return "" if x is None else f"{x:+.3f}"


def anchor(family: str, name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", f"{family}-{name}".lower()).strip("-")


def page(index: dict) -> str:
    counts = {v: sum(r["verdict"] == v for fam in index.values() for r in fam.values()) for v in VERDICTS}
    lines = [
        "# Evidence: which flag helps when",
        "",
        "<!-- generated by experiments/evidence.py from experiments/results/*.json; do not edit by hand -->",
        "",
        "Every registered method (mergekit's methods are checked tensor for tensor against mergekit instead), its "
        "claim, the experiment that tests it, the effect with its 95% interval over seeds where the experiment "
        "reports one, and a verdict. A failure counts as *not replicated* only on a testbed whose controls passed "
        "(it showed it could detect the effect); otherwise it is *inconclusive*. The same table is machine-readable "
        "in `experiments/results/index.json`; `python experiments/_harness.py` says which results today's code "
        "would change.",
        "",
        "Summary: " + ", ".join(f"{counts[v]} {v}" for v in VERDICTS) + ".",
        "",
        "| family | method | verdict | effect [95% CI] | control | experiment |",
        "|---|---|---|---|---|---|",
    ]
    for family, methods in index.items():
        for name, r in methods.items():
            ci = f"{_num(r['effect'])} [{_num(r['ci_low'])}, {_num(r['ci_high'])}]" if r["ci_low"] is not None else (
                _num(r["effect"]) if r["effect"] is not None else "")
            control = {True: "passed", False: "failed", None: "-"}[r["control_passed"]]
            exp = f"[{r['experiment']}](#{anchor(family, name)})" if r["experiment"] else "-"
            lines.append(f"| {family} | `{name}` | {r['verdict']} | {ci} | {control} | {exp} |")
    lines += ["", "## Methods", ""]
    for family, methods in index.items():
        for name, r in methods.items():
            lines += [f'<a id="{anchor(family, name)}"></a>', "", f"### {family}: `{name}`", ""]
            lines += [f"**Claim.** {r['claim']}.", ""]
            if r["experiment"]:
                lines.append(
                    f"**Experiment.** `experiments/{r['experiment']}.py`; result "
                    f"[{r['experiment']}.md]({SOURCE}/{r['experiment']}.md), plot "
                    f"[{r['experiment']}.png]({SOURCE}/{r['experiment']}.png)."
                )
                lines.append("")
            lines.append(f"**Verdict: {r['verdict']}.**" + (f" {r['why'][0].upper()}{r['why'][1:]}." if r.get("why")
                                                              else ""))
            for key, d in r.get("detail", {}).items():
                lines.append(f"- {key}: {d['verdict']}, {_num(d['effect'])} [{_num(d['ci_low'])}, "
                             f"{_num(d['ci_high'])}]")
            if r.get("criteria"):
                lines.append("- criteria: " + ", ".join(f"{k} {'pass' if v else 'FAIL'}"
                                                          for k, v in r["criteria"].items()))
            if r.get("effect_is"):
                lines.append(f"- effect: {r['effect_is']}")
            if r["also"]:
                lines.append("- also measured in: " + ", ".join(f"`{a}`" for a in r["also"]))
            lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def page_block(index: dict, page_name: str) -> str:
    """The evidence block of one docs page: each of its methods' verdict, linked to its row on the evidence page."""
    lines = [
        BEGIN,
        "",
        "## Evidence",
        "",
        "What the experiments say about each method on this page ([all methods](evidence.md)):",
        "",
        "| method | verdict | evidence |",
        "|---|---|---|",
    ]
    for family, methods in index.items():
        if FAMILY_PAGE[family] != page_name:
            continue
        for name, r in methods.items():
            lines.append(
                f"| {family} `{name}` | {r['verdict']} | [row](evidence.md#{anchor(family, name)}) |"
            )
    return "\n".join([*lines, "", END])


def with_block(text: str, block: str) -> str:
    """`text` with its evidence block replaced by `block` (appended at the end when the page has none)."""
    if BEGIN in text:
        head, rest = text.split(BEGIN, 1)
        return head + block + rest.split(END, 1)[1]
    return text.rstrip("\n") + "\n\n" + block + "\n"


def write() -> dict:
    index = build_index()
    INDEX.write_text(json.dumps(index, indent=1, ensure_ascii=False) + "\n")
    PAGE.write_text(page(index))
    for name in sorted(set(FAMILY_PAGE.values())):
        path = PAGE.parent / name
        path.write_text(with_block(path.read_text(), page_block(index, name)))
    return index


if __name__ == "__main__":
    idx = write()
    verdicts = [r["verdict"] for fam in idx.values() for r in fam.values()]
    print({v: verdicts.count(v) for v in VERDICTS})
