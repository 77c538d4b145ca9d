"""The two stability monitors as detectors: the held-out innovation probe and representation drift, on fine-tuning
runs with an injected LR fault and on healthy runs of the same setup.

Claim. (innovation_probe, arXiv 2601.17483, reconstructed from the abstract: a held-out probe loss through a scalar
local-level Kalman filter, alarm when a rise's normalised innovation squared exceeds 10.83) the innovation probe flags
instability before the loss does: on runs hit by an injected LR fault it raises its alarm, before the training loss
shows the fault, and on healthy runs of the same setup it stays silent. (representation_drift, arXiv 2604.17698,
reconstructed from the abstract: drift = 1 − Spearman ρ between the probe set's pairwise distances now and before
training) representation drift rises with the degradation: its alarm fires on the faulty runs, stays silent on the
healthy ones, and after the fault the faulty runs drift more than the healthy run of the same seed. The paper's
claim is that drift predicts degraded *steerability*; this testbed has no steering task, so it tests only that drift
tracks a degradation of the model (its held-out loss), not steerability.

Design (fixed on the pilot seed 100, which is not reported, before any run of seeds 0-4).
* Model and data: the tiny offline Llama of `hf_stable.testing` (hidden 64, 2 layers), character-level addition from
  `hf_stable.testing.arithmetic_dataset`. A "pretrained" base: 300 SFT steps (data seed 7, lr 1e-3, batch 8), cached
  under `experiments/cache/`; every run starts from it. Plain TRL `SFTTrainer`, AdamW, constant lr 1e-3, batch 8,
  `max_grad_norm=1.0`, weight decay 0.
* Per seed s ∈ {0..4}: 160 steps on 1280 addition rows drawn with seed 1000+s, data order seed s; eval loss on 64
  held-out rows (seed 2000) before and after training. Three runs per seed, each with both monitors attached:
  `healthy` (no fault); `blowup` (`FaultInjectionCallback(kind="lr_scale", factor=1000)` at step 100 only: an abrupt
  fault); `lr_high` (the same callback with factor 10 at every step from 100 on: a sustained LR ten times too high,
  a gradual instability). On seed 100 the factor 10 (the only one tried) degraded the run over a few steps (the
  training loss crossed 2x its level 3 steps after the onset) rather than at once. A fourth run, `bare`, is the
  healthy run without any monitor (for the control that the monitors are passive).
* Innovation probe: `StabilityGuardCallback.attach(trainer, action="log", probe_every=1, probe_dataset=...)` with the
  default `probe_nis_threshold` (10.83); the probe set is 64 held-out prompt/completion rows (seed 3000), loss on the
  completion tokens. `action="log"` makes the guard a pure monitor (no skip, no rollback). Its alarm steps are its
  decisions of kind "probe".
* Representation drift: `RepresentationDriftCallback(probe_dataset=<the same 64 rows as text>, every=2, n_probe=64)`
  with the default alarm (the drift's increase a robust z > 6 against the previous increases); alarm steps from the
  logged `stable/drift/alarm`.
* Definitions. Fault step t = 100. The training loss logged at step k is computed before update k, so update t shows
  in the training loss of step t + 1 first; the probe of step k runs after update k. The loss "shows the
  instability" at the first step k > t whose training loss exceeds 2 × the median training loss of steps t−19..t (the
  pre-fault level), or is not finite. Detection: an alarm at a step ≥ t. A false alarm: an alarm on a healthy run, or
  before step t on a faulty run. Lead (steps) = crossing step − first alarm step ≥ t (positive: the alarm came
  first). Comparators reported next to the probe (not criteria): a naive threshold on the same probe loss (probe loss
  > 2 × its median over the probe steps t−20..t−1), and the guard's own loss-spike rule on the training loss (its
  decisions of kind "loss", the guard's defaults).
* Pilot (seed 100, before seeds 0-4): the default probe threshold (10.83) flagged the healthy run at steps 13-23,
  30, 71-73, 132-136 and 144-146 (NIS up to 212: the probe loss of a fixed probe set moves smoothly, so the noise the
  filter estimates from its first differences is far smaller than its slow drifts under fine-tuning). The claim
  criteria keep the default, the setting the monitor ships with. A secondary threshold, 200 (about twice the largest
  NIS, 108.5, of the healthy pilot run fed to the filter with nothing rejected), is picked on that seed and evaluated
  by replaying `LocalLevelFilter` on the recorded probe losses (exact: with ``action="log"`` an alarm changes nothing
  in training, and the replay at 10.83 is checked to give the callback's own alarms).
* Intervals: rates with the exact (Clopper–Pearson) 95 % binomial interval; leads and paired differences (faulty run
  minus the healthy run of the same seed) with the 95 % Student-t interval over the 5 seeds (t quantile 2.776, df 4).

Pass criteria (printed PASS/FAIL as measured), per fault (blowup, lr_high) where it says so:
  CLAIM innovation_probe:
    innovation_detects  the probe alarms at a step ≥ t on ≥ 4/5 seeds, for each fault;
    innovation_lead     that alarm comes strictly before the training loss crosses 2 × its pre-fault level (or the
                        loss never crosses) on ≥ 4/5 seeds, for each fault;
    innovation_quiet    no probe alarm on any of the 5 healthy runs, nor before step t on any faulty run.
  CLAIM representation_drift:
    drift_detects       the drift alarm fires at a step ≥ t on ≥ 4/5 seeds, for each fault;
    drift_quiet         no drift alarm on any of the 5 healthy runs, nor before step t on any faulty run;
    drift_rises         mean drift over the measurements at steps ≥ t, faulty run − healthy run, paired over seeds:
                        the lower end of the 95 % t interval > 0, for each fault (the mean over the window, not the
                        last value: on the healthy pilot run the drift swung between 0.1 and 0.6).
  CONTROLS that must pass (else a failure of a claim criterion does not count):
    fault_hurts         the fault degrades the run: eval loss faulty − healthy ≥ 0.3 nats on ≥ 4/5 seeds, for each
                        fault;
    healthy_ok          the healthy run is healthy: its training loss never crosses 2 × its pre-fault level and its
                        final eval loss ≤ its eval loss before training + 0.05, on 5/5 seeds.
    monitors_passive    the healthy run with both monitors has exactly the training losses of the bare run, every
                        seed (the monitors observe; they do not change what they observe).
  SECONDARY (a setting picked on the pilot seed, not the shipped default):
    innovation_calibrated  with threshold 200, the probe alarms before the loss crosses on >= 4/5 seeds for each
                        fault and raises no false alarm (healthy runs, pre-fault segments).
  CONTROL that must fail (a detector without the claimed property):
    loss_rule_no_lead   the guard's loss-spike rule, which watches the training loss itself, does NOT alarm before
                        the training loss crosses on the abrupt fault: its first alarm ≥ t comes at or after the
                        crossing step on ≥ 4/5 seeds (blowup). If it passed the lead test, the lead criterion could be
                        met by watching the training loss, and would say nothing about the probe.

A lead of one step on the abrupt fault is what measuring after the update gives: the probe of step t sees update t,
the training loss of step t + 1 is the first to. The sustained fault is where a longer lead can show.

Command (about 4 CPU-minutes):
    OMP_NUM_THREADS=1 .venv/bin/python experiments/stability_monitors.py
Quick smoke run (1 seed, short runs; its verdict means nothing):
    OMP_NUM_THREADS=1 .venv/bin/python experiments/stability_monitors.py --quick --out /tmp/monexp
"""

from __future__ import annotations

import functools
import math
import statistics
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from _harness import criterion, declare, finite, run, save_figure, subplots

# the same tiny base and SFT arguments as the Stable-SPAM experiment (its base is cached there, keyed by its code)
from stability_spam import BASE_ARGS, pretrained_base


NAME = "stability_monitors"
ROOT = Path(__file__).resolve().parent
CACHE = ROOT / "cache" / NAME
FAULTS = ("blowup", "lr_high")
RUNS = ("healthy", *FAULTS)
MONITORED = RUNS  # runs with both monitors attached; "bare" is the healthy run without them
CLAIM = __doc__.split("Claim. ", 1)[1].split("\n\n", 1)[0].replace("\n", " ")
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


@dataclass(frozen=True)
class Sizes:
    base_steps: int = 300
    steps: int = 160
    fault_step: int = 100


QUICK = Sizes(base_steps=40, steps=50, fault_step=30)
SETTINGS = {
    "lr": 1e-3,
    "faults": {"blowup": dict(factor=1000.0, sustained=False), "lr_high": dict(factor=10.0, sustained=True)},
    "probe": dict(action="log", probe_every=1),
    "calibrated_threshold": 200.0,
    "drift": dict(every=2, n_probe=64),
    "probe_rows": 64,
    "pre_window": 20,
    "cross_ratio": 2.0,
    "damage_nats": 0.3,
    "healthy_tolerance": 0.05,
}
def sft_run(kind: str, seed: int, ctx: dict) -> dict:
    """One fine-tuning run with both monitors attached; returns losses, probe and drift series, and alarm steps."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback
    from trl import SFTConfig, SFTTrainer

    from hf_stable.callbacks import FaultInjectionCallback, RepresentationDriftCallback, StabilityGuardCallback

    model = AutoModelForCausalLM.from_pretrained(ctx["base"])
    tokenizer = AutoTokenizer.from_pretrained(ctx["base"])
    with tempfile.TemporaryDirectory() as tmp:
        args = SFTConfig(output_dir=tmp, max_steps=ctx["steps"], learning_rate=ctx["lr"], lr_scheduler_type="constant",
                         max_grad_norm=1.0, seed=seed, data_seed=seed, **BASE_ARGS)  # fmt: skip
        trainer = SFTTrainer(model=model, args=args, train_dataset=ctx["train"][seed], eval_dataset=ctx["eval"],
                             processing_class=tokenizer)  # fmt: skip
        trainer.remove_callback(PrinterCallback)
        if kind == "bare":
            eval_before = trainer.evaluate()["eval_loss"]
            trainer.train()
            losses = [h["loss"] for h in trainer.state.log_history if "loss" in h and "grad_norm" in h]
            return {"eval_before": float(eval_before), "eval_loss": float(trainer.evaluate()["eval_loss"]),
                    "train_loss": [float(x) for x in losses]}  # fmt: skip
        guard = StabilityGuardCallback.attach(trainer, probe_dataset=ctx["probe_pc"], **ctx["probe"])
        drift = RepresentationDriftCallback.attach(trainer, probe_dataset=ctx["probe_text"], **ctx["drift"])
        if kind != "healthy":
            spec = ctx["faults"][kind]
            at = ctx["fault_step"]
            steps = list(range(at, ctx["steps"] + 1)) if spec["sustained"] else [at]
            FaultInjectionCallback.attach(trainer, kind="lr_scale", steps=steps, factor=spec["factor"])
        eval_before = trainer.evaluate()["eval_loss"]
        trainer.train()
        eval_after = trainer.evaluate()["eval_loss"]
    logs = trainer.state.log_history
    losses = [h["loss"] for h in logs if "loss" in h and "grad_norm" in h]
    has_nan = any(not p.detach().isfinite().all() for p in model.parameters())
    return {
        "eval_before": float(eval_before),
        "eval_loss": float("nan") if eval_after is None or has_nan else float(eval_after),
        "train_loss": [float(x) for x in losses],
        "probe": [[int(s), float(loss), float(nis)] for s, loss, nis in guard.probe_history],
        "probe_alarms": [d.step for d in guard.decisions if d.kind == "probe"],
        "loss_rule_alarms": [d.step for d in guard.decisions if d.kind in ("loss", "nonfinite")],
        "drift": [[int(s), float(rho), float(cka)] for s, rho, cka in drift.history],
        "drift_alarms": [int(h["step"]) for h in logs if h.get("stable/drift/alarm", 0.0) > 0],
    }


@functools.cache
def context(sizes: Sizes) -> dict:
    from hf_stable.testing import arithmetic_dataset

    class Train(dict):  # one training set per seed, built on first use
        def __missing__(self, seed):
            self[seed] = arithmetic_dataset(8 * sizes.steps, seed=1000 + seed, max_operand=99)
            return self[seed]

    probe = arithmetic_dataset(SETTINGS["probe_rows"], seed=3000, max_operand=99)
    return {
        **SETTINGS,
        **asdict(sizes),
        "train": Train(),
        "eval": arithmetic_dataset(64, seed=2000, max_operand=99),
        "probe_pc": [{"prompt": r["prompt"], "completion": r["completion"]} for r in probe],
        "probe_text": [r["prompt"] + r["completion"] for r in probe],
        "base": pretrained_base(sizes.base_steps),
    }


def run_seed(seed: int, sizes: Sizes) -> dict:
    ctx = context(sizes)
    return {kind: sft_run(kind, seed, ctx) for kind in (*RUNS, "bare")}


# -- detection statistics ----------------------------------------------------------------------------------------
def crossing_step(train_loss: list[float], at: int, window: int, ratio: float) -> tuple[float, int | None]:
    """(pre-fault level, first step k > at whose training loss exceeds ratio × level or is not finite; None if none).
    ``train_loss[i]`` is the loss of step i + 1."""
    level = statistics.median(train_loss[max(0, at - window) : at])
    for i in range(at, len(train_loss)):
        x = train_loss[i]
        if not math.isfinite(x) or x > ratio * level:
            return level, i + 1
    return level, None


def probe_threshold_step(probe: list, at: int, window: int, ratio: float) -> int | None:
    """First probe step ≥ at whose probe loss exceeds ratio × the median of the probe steps at−window..at−1."""
    before = [loss for s, loss, _ in probe if at - window <= s < at]
    if not before:
        return None
    level = statistics.median(before)
    return next((s for s, loss, _ in probe if s >= at and (not math.isfinite(loss) or loss > ratio * level)), None)


def replay_probe(probe: list, threshold: float) -> list[int]:
    """The probe steps the guard's filter (`LocalLevelFilter`, the probe's defaults but ``threshold``) flags when fed
    the recorded probe losses in order: what the callback would have flagged with that threshold, since with
    ``action="log"`` the alarms do not change training."""
    from hf_stable.stability.stats import LocalLevelFilter

    f = LocalLevelFilter(threshold=threshold)
    return [s for s, loss, _ in probe if f.update(loss)[0]]


def default_threshold() -> float:
    from hf_stable.stability.callback_configs import GuardConfig

    return GuardConfig().probe_nis_threshold


def first_at_or_after(steps: list[int], at: int) -> int | None:
    return next((s for s in sorted(steps) if s >= at), None)


def clopper_pearson(k: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """Exact binomial interval of k successes in n trials (bisection on the binomial tail probabilities)."""
    alpha = (1 - level) / 2

    def tail_ge(p):  # P(X >= k | p)
        return sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k, n + 1))

    def tail_le(p):  # P(X <= k | p)
        return sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(0, k + 1))

    def solve(f, increasing):
        lo, hi = 0.0, 1.0
        for _ in range(60):
            mid = (lo + hi) / 2
            if (f(mid) < alpha) == increasing:
                lo = mid
            else:
                hi = mid
        return (lo + hi) / 2

    low = 0.0 if k == 0 else solve(tail_ge, True)
    high = 1.0 if k == n else solve(tail_le, False)
    return low, high


def t_interval(values: list[float]) -> dict:
    """Mean and 95 % Student-t interval over seeds (values must be finite)."""
    n = len(values)
    mean = statistics.fmean(values) if values else math.nan
    if n < 2:
        return {"mean": mean, "ci_low": math.nan, "ci_high": math.nan, "n": n, "values": values}
    half = T_975[n - 1] * statistics.stdev(values) / math.sqrt(n)
    return {"mean": mean, "ci_low": mean - half, "ci_high": mean + half, "n": n, "values": values}


def rate(k: int, n: int) -> dict:
    low, high = clopper_pearson(k, n)
    return {"k": k, "n": n, "rate": k / n if n else math.nan, "ci_low": low, "ci_high": high}


def post_fault_drift(run_record: dict, at: int) -> float:
    """Mean drift (1 − ρ) over the measurements at steps ≥ at."""
    values = [1.0 - rho for s, rho, _ in run_record["drift"] if s >= at]
    return statistics.fmean(values) if values else math.nan


def analyse_run(r: dict, ctx: dict, at: int) -> dict:
    level, cross = crossing_step(r["train_loss"], at, ctx["pre_window"], ctx["cross_ratio"])
    probe_first = first_at_or_after(r["probe_alarms"], at)
    rule_first = first_at_or_after(r["loss_rule_alarms"], at)
    naive_first = probe_threshold_step(r["probe"], at, ctx["pre_window"], ctx["cross_ratio"])
    drift_first = first_at_or_after(r["drift_alarms"], at)
    calibrated = replay_probe(r["probe"], ctx["calibrated_threshold"])
    calibrated_first = first_at_or_after(calibrated, at)

    def lead(alarm):
        return None if alarm is None or cross is None else cross - alarm

    def before(alarm):
        return alarm is not None and (cross is None or alarm < cross)

    return {
        "pre_level": level,
        "crossing": cross,
        "probe_alarm": probe_first,
        "probe_lead": lead(probe_first),
        "probe_before": before(probe_first),
        "probe_false": [s for s in r["probe_alarms"] if s < at],
        "replay_matches": replay_probe(r["probe"], default_threshold()) == r["probe_alarms"],
        "calibrated_alarm": calibrated_first,
        "calibrated_lead": lead(calibrated_first),
        "calibrated_before": before(calibrated_first),
        "calibrated_false": [s for s in calibrated if s < at],
        "calibrated_any": calibrated[:1],
        "naive_alarm": naive_first,
        "naive_lead": lead(naive_first),
        "rule_alarm": rule_first,
        "rule_lead": lead(rule_first),
        "rule_before": before(rule_first),
        "drift_alarm": drift_first,
        "drift_false": [s for s in r["drift_alarms"] if s < at],
        "post_drift": post_fault_drift(r, at),
        "eval_loss": r["eval_loss"],
        "eval_before": r["eval_before"],
    }


def aggregate(per_seed: dict, sizes: Sizes) -> dict:
    ctx = {**SETTINGS, **asdict(sizes)}
    at = sizes.fault_step
    seeds = list(per_seed)
    runs = {kind: {s: analyse_run(per_seed[s][kind], ctx, at) for s in seeds} for kind in RUNS}
    healthy = runs["healthy"]
    agg: dict = {"runs": runs, "healthy": {}}
    n = len(seeds)
    probe_fa = sum(bool(per_seed[s]["healthy"]["probe_alarms"]) for s in seeds)
    drift_fa = sum(bool(per_seed[s]["healthy"]["drift_alarms"]) for s in seeds)
    agg["healthy"] = {
        "probe_false_alarm": rate(probe_fa, n),
        "drift_false_alarm": rate(drift_fa, n),
        "probe_alarm_steps": {s: per_seed[s]["healthy"]["probe_alarms"] for s in seeds},
        "drift_alarm_steps": {s: per_seed[s]["healthy"]["drift_alarms"] for s in seeds},
        "crossings": {s: healthy[s]["crossing"] for s in seeds},
        "eval_change": [healthy[s]["eval_loss"] - healthy[s]["eval_before"] for s in seeds],
        "calibrated_false_alarm": rate(sum(bool(healthy[s]["calibrated_any"]) for s in seeds), n),
    }
    agg["replay_matches"] = all(runs[kind][s]["replay_matches"] for kind in RUNS for s in seeds)
    agg["passive_max_abs_diff"] = {}
    for s in seeds:
        pairs = zip(per_seed[s]["bare"]["train_loss"], per_seed[s]["healthy"]["train_loss"], strict=True)
        agg["passive_max_abs_diff"][s] = max((abs(a - b) for a, b in pairs), default=math.nan)
    for fault in FAULTS:
        f = runs[fault]
        damage = [f[s]["eval_loss"] - healthy[s]["eval_loss"] for s in seeds]
        drift_diff = [f[s]["post_drift"] - healthy[s]["post_drift"] for s in seeds]
        leads = [f[s]["probe_lead"] for s in seeds if f[s]["probe_lead"] is not None]
        calibrated_leads = [f[s]["calibrated_lead"] for s in seeds if f[s]["calibrated_lead"] is not None]
        agg[fault] = {
            "probe_detect": rate(sum(f[s]["probe_alarm"] is not None for s in seeds), n),
            "probe_before": rate(sum(f[s]["probe_before"] for s in seeds), n),
            "probe_lead": t_interval(leads),
            "probe_prefault_false": sum(bool(f[s]["probe_false"]) for s in seeds),
            "calibrated_detect": rate(sum(f[s]["calibrated_alarm"] is not None for s in seeds), n),
            "calibrated_before": rate(sum(f[s]["calibrated_before"] for s in seeds), n),
            "calibrated_lead": t_interval(calibrated_leads),
            "calibrated_prefault_false": sum(bool(f[s]["calibrated_false"]) for s in seeds),
            "naive_lead": {s: f[s]["naive_lead"] for s in seeds},
            "rule_lead": {s: f[s]["rule_lead"] for s in seeds},
            "rule_before": rate(sum(f[s]["rule_before"] for s in seeds), n),
            "drift_detect": rate(sum(f[s]["drift_alarm"] is not None for s in seeds), n),
            "drift_prefault_false": sum(bool(f[s]["drift_false"]) for s in seeds),
            "drift_minus_healthy": t_interval(drift_diff) if all(map(math.isfinite, drift_diff)) else {},
            "damage": t_interval(damage) if all(map(math.isfinite, damage)) else {"values": damage},
            "damage_values": damage,
        }
    return agg


def criteria(per_seed: dict, agg: dict, sizes: Sizes) -> dict:
    seeds = list(per_seed)
    n = len(seeds)
    need = max(1, n - 1)  # 4/5
    runs = agg["runs"]

    def per_fault(key):
        return {fault: sum(bool(runs[fault][s][key]) if key.endswith("before") else runs[fault][s][key] is not None
                           for s in seeds) for fault in FAULTS}  # fmt: skip

    out = {}
    detects = per_fault("probe_alarm")
    out["innovation_detects"] = criterion(
        f"claim: the probe alarms at a step >= the fault step on >= {need}/{n} seeds, each fault",
        all(k >= need for k in detects.values()),
        {fault: agg[fault]["probe_detect"] for fault in FAULTS},
        ", ".join(f"{fault} {k}/{n}" for fault, k in detects.items()),
    )
    before = per_fault("probe_before")
    out["innovation_lead"] = criterion(
        f"claim: the probe alarm comes before the training loss crosses 2x its pre-fault level on >= {need}/{n} seeds,"
        " each fault",
        all(k >= need for k in before.values()),
        {fault: {**agg[fault]["probe_lead"], "before": agg[fault]["probe_before"]} for fault in FAULTS},
        ", ".join(f"{fault} {k}/{n}" for fault, k in before.items()),
    )
    probe_false = agg["healthy"]["probe_false_alarm"]["k"] + sum(agg[f]["probe_prefault_false"] for f in FAULTS)
    out["innovation_quiet"] = criterion(
        "claim: no probe alarm on a healthy run, nor before the fault step on a faulty run",
        probe_false == 0,
        {"healthy": agg["healthy"]["probe_false_alarm"], **{f: agg[f]["probe_prefault_false"] for f in FAULTS}},
        f"healthy runs with an alarm {agg['healthy']['probe_false_alarm']['k']}/{n}",
    )
    drift_detects = per_fault("drift_alarm")
    out["drift_detects"] = criterion(
        f"claim: the drift alarm fires at a step >= the fault step on >= {need}/{n} seeds, each fault",
        all(k >= need for k in drift_detects.values()),
        {fault: agg[fault]["drift_detect"] for fault in FAULTS},
        ", ".join(f"{fault} {k}/{n}" for fault, k in drift_detects.items()),
    )
    drift_false = agg["healthy"]["drift_false_alarm"]["k"] + sum(agg[f]["drift_prefault_false"] for f in FAULTS)
    out["drift_quiet"] = criterion(
        "claim: no drift alarm on a healthy run, nor before the fault step on a faulty run",
        drift_false == 0,
        {"healthy": agg["healthy"]["drift_false_alarm"], **{f: agg[f]["drift_prefault_false"] for f in FAULTS}},
        f"healthy runs with an alarm {agg['healthy']['drift_false_alarm']['k']}/{n}",
    )
    rises = {f: agg[f]["drift_minus_healthy"] for f in FAULTS}
    out["drift_rises"] = criterion(
        "claim: mean drift after the fault step, faulty - healthy (paired): lower end of the 95% t interval > 0, "
        "each fault",
        all(r and r["ci_low"] > 0 for r in rises.values()),
        rises,
        ", ".join(f"{f} {sum(d > 0 for d in r.get('values', []))}/{n} seeds > 0" for f, r in rises.items()),
    )
    damage = {f: sum(d >= SETTINGS["damage_nats"] for d in agg[f]["damage_values"]) for f in FAULTS}
    out["fault_hurts"] = criterion(
        f"control (must pass): eval loss faulty - healthy >= {SETTINGS['damage_nats']} nats on >= {need}/{n} seeds, "
        "each fault",
        all(k >= need for k in damage.values()),
        {f: agg[f]["damage"] for f in FAULTS},
        ", ".join(f"{f} {k}/{n}" for f, k in damage.items()),
    )
    ok = [
        runs["healthy"][s]["crossing"] is None
        and runs["healthy"][s]["eval_loss"] <= runs["healthy"][s]["eval_before"] + SETTINGS["healthy_tolerance"]
        for s in seeds
    ]
    out["healthy_ok"] = criterion(
        "control (must pass): healthy training loss never crosses 2x its pre-fault level and final eval loss <= eval "
        f"loss before training + {SETTINGS['healthy_tolerance']}, every seed",
        all(ok),
        {"eval_change": agg["healthy"]["eval_change"], "crossings": agg["healthy"]["crossings"]},
        f"{sum(ok)}/{n} seeds",
    )
    passive = [d == 0.0 for d in agg["passive_max_abs_diff"].values()]
    out["monitors_passive"] = criterion(
        "control (must pass): the healthy run with both monitors has the same training losses as without them "
        "(max abs difference 0), every seed",
        all(passive),
        {"max_abs_diff": agg["passive_max_abs_diff"], "probe_replay_matches_callback": agg["replay_matches"]},
        f"{sum(passive)}/{n} seeds",
    )
    cal_ok = {f: sum(runs[f][s]["calibrated_before"] for s in seeds) for f in FAULTS}
    cal_false = agg["healthy"]["calibrated_false_alarm"]["k"]
    cal_false += sum(agg[f]["calibrated_prefault_false"] for f in FAULTS)
    cal_values = {
        f: {key: agg[f][f"calibrated_{key}"] for key in ("detect", "before", "lead", "prefault_false")} for f in FAULTS
    }
    out["innovation_calibrated"] = criterion(
        f"secondary (threshold {SETTINGS['calibrated_threshold']:g} picked on pilot seed 100): the probe alarms "
        f"before the loss crosses on >= {need}/{n} seeds each fault, and no false alarm",
        all(k >= need for k in cal_ok.values()) and cal_false == 0 and agg["replay_matches"],
        {"healthy": agg["healthy"]["calibrated_false_alarm"], **cal_values},
        ", ".join(f"{f} {k}/{n}" for f, k in cal_ok.items()) + f"; false alarms {cal_false}",
    )
    no_lead = [not runs["blowup"][s]["rule_before"] for s in seeds]
    out["loss_rule_no_lead"] = criterion(
        f"control (must fail the lead test): the guard's loss-spike rule on the training loss does not alarm before "
        f"the loss crosses on the abrupt fault (blowup), >= {need}/{n} seeds",
        sum(no_lead) >= need,
        {"rule_lead": agg["blowup"]["rule_lead"], "rule_before": agg["blowup"]["rule_before"]},
        f"{sum(no_lead)}/{n} seeds",
    )
    return out


# -- outputs -----------------------------------------------------------------------------------------------------
def plot(result: dict, path: Path) -> None:
    seed0 = min(result["per_seed"], key=int)
    runs = result["per_seed"][seed0]
    at = result["config"]["sizes"]["fault_step"]
    colors = {"healthy": "black", "blowup": "tab:red", "lr_high": "tab:orange"}
    fig, axes = subplots(1, 3, figsize=(15, 4.2))
    for kind in RUNS:
        r = runs[kind]
        train = [x if math.isfinite(x) else float("nan") for x in r["train_loss"]]
        axes[0].plot(range(1, len(train) + 1), train, color=colors[kind], lw=1, label=kind)
        axes[1].plot([p[0] for p in r["probe"]], [p[1] for p in r["probe"]], color=colors[kind], lw=1, label=kind)
        for s in r["probe_alarms"][:1]:
            axes[1].axvline(s, color=colors[kind], ls=":", lw=1)
        axes[2].plot([d[0] for d in r["drift"]], [1 - d[1] for d in r["drift"]], color=colors[kind], lw=1, label=kind)
        for s in r["drift_alarms"][:1]:
            axes[2].axvline(s, color=colors[kind], ls=":", lw=1)
    for ax, title, ylabel in zip(
        axes,
        ("training loss", "held-out probe loss (dotted: first probe alarm)", "drift 1 - rho (dotted: first alarm)"),
        ("train loss", "probe loss", "drift"),
        strict=True,
    ):
        ax.axvline(at, color="grey", lw=0.6)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{title}, seed {seed0}", fontsize=9)
        ax.legend(fontsize=8)
    axes[0].set_yscale("log")
    axes[1].set_yscale("log")
    save_figure(fig, path)


def _ci(d: dict) -> str:
    if not d or "mean" not in d:
        return "—"
    return f"{finite(d['mean'])} [{finite(d['ci_low'])}, {finite(d['ci_high'])}] (n={d['n']})"


def _rate(d: dict) -> str:
    return f"{d['k']}/{d['n']} [{finite(d['ci_low'], 2)}, {finite(d['ci_high'], 2)}]"


def markdown(result: dict) -> str:
    agg = result["aggregate"]
    sizes = result["config"]["sizes"]
    seeds = list(result["per_seed"])
    lines = [
        f"## Detection ({len(seeds)} seeds; fault at step {sizes['fault_step']} of {sizes['steps']})",
        "",
        "Rates: k/n [exact Clopper–Pearson 95% interval]; leads and paired differences: mean [95% t interval]. "
        "Lead = step where the training loss crosses 2x its pre-fault level − first alarm step (positive: alarm "
        "first).",
        "",
        "| fault | probe detects | probe before loss | probe lead (steps) | drift detects | drift after t − healthy "
        "| eval loss faulty − healthy |",
        "|---|---|---|---|---|---|---|",
    ]
    for fault in FAULTS:
        a = agg[fault]
        lines.append(
            f"| {fault} | {_rate(a['probe_detect'])} | {_rate(a['probe_before'])} | {_ci(a['probe_lead'])} | "
            f"{_rate(a['drift_detect'])} | {_ci(a['drift_minus_healthy'])} | {_ci(a['damage'])} |"
        )
    h = agg["healthy"]
    threshold = result["config"]["calibrated_threshold"]
    lines += [
        "",
        f"Healthy runs with an alarm: probe {_rate(h['probe_false_alarm'])}, drift {_rate(h['drift_false_alarm'])}. "
        f"Faulty runs with an alarm before the fault: probe "
        + ", ".join(f"{f} {agg[f]['probe_prefault_false']}" for f in FAULTS)
        + "; drift "
        + ", ".join(f"{f} {agg[f]['drift_prefault_false']}" for f in FAULTS)
        + ".",
        "",
        f"The probe with the threshold {threshold:g} picked on the pilot seed (secondary; replayed from the recorded "
        f"probe losses, replay = callback at 10.83: {agg['replay_matches']}): healthy runs with an alarm "
        f"{_rate(h['calibrated_false_alarm'])}; "
        + "; ".join(
            f"{f}: detects {_rate(agg[f]['calibrated_detect'])}, "
            f"before the loss {_rate(agg[f]['calibrated_before'])}, "
            f"lead {_ci(agg[f]['calibrated_lead'])}, pre-fault false alarms {agg[f]['calibrated_prefault_false']}"
            for f in FAULTS
        )
        + ".",
        "",
        "Comparators, lead per seed (None: no alarm or no crossing): naive probe 2x "
        + "; ".join(f"{f} {list(agg[f]['naive_lead'].values())}" for f in FAULTS)
        + "; guard loss rule "
        + "; ".join(f"{f} {list(agg[f]['rule_lead'].values())}" for f in FAULTS)
        + ". Training losses with vs without the monitors, max abs difference per seed: "
        + ", ".join(finite(v, 6) for v in agg["passive_max_abs_diff"].values())
        + ".",
        "",
        "## Per seed (steps)",
        "",
        "| seed | run | loss crosses | probe alarm | naive probe 2x | guard loss rule | drift alarm | drift after t "
        "| eval before → after |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in seeds:
        for kind in RUNS:
            r = agg["runs"][kind][s]
            first = {
                "probe": r["probe_alarm"] if kind != "healthy" else (h["probe_alarm_steps"][s][:1] or [None])[0],
                "drift": r["drift_alarm"] if kind != "healthy" else (h["drift_alarm_steps"][s][:1] or [None])[0],
            }
            lines.append(
                f"| {s} | {kind} | {r['crossing'] or '—'} | {first['probe'] or '—'} | {r['naive_alarm'] or '—'} | "
                f"{r['rule_alarm'] or '—'} | {first['drift'] or '—'} | {finite(r['post_drift'])} | "
                f"{finite(r['eval_before'])} → {finite(r['eval_loss'])} |"
            )
    lines += [
        "",
        "On healthy runs the alarm columns list the first alarm at any step; on faulty runs the first at or after the "
        "fault step (earlier ones are false alarms, counted above).",
    ]
    if not result["passed"]:
        lines += ["", "A failed criterion is recorded as a non-replication (unless a must-pass control failed)."]
    return "\n".join(lines)


EXPERIMENT = declare(
    globals(),
    title="Stability monitors as detectors: the innovation probe and representation drift under injected LR faults",
    claim=CLAIM,
    config=SETTINGS,
    default_seeds=(0, 1, 2, 3, 4),
)


if __name__ == "__main__":
    run(EXPERIMENT)
