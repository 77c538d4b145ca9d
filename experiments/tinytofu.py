"""TinyTOFU v2: every unlearning method of hf_stable and an embedding-reset control on a CPU benchmark, 3 seeds.

Claim. On TinyTOFU v2 (fictitious authors whose names are shared syllable tokens, a 0.38M-parameter Llama, a
retrain-from-scratch oracle; modelled on TOFU, Maini et al., arXiv 2401.06121) the benchmark separates working
unlearning methods from gradient-ascent collapse: SimNPO (arXiv 2410.07163), StableUN (arXiv 2509.20230) and PDU
(arXiv 2506.05314) pass Tier 1 ("stable
unlearning": forget accuracy near chance at retained utility, no collateral damage, no over-forgetting) on every seed,
GA trips the collapse signature on every seed, and a training-free edit of the forget names' embedding rows does not
pass (TinyTOFU v1 gave each author a dedicated token, and that edit passed Tier 1 and Tier 2 on 3/3 seeds).

Design.
* Data and models (`hf_stable.testing.tinytofu`, format version 2): per seed `make_tinytofu(seed)` (220 authors: 20
  forget, 180 retain, 20 holdout; each name is three of 24 syllable tokens that all authors share; the world split
  holds 40 capital facts and 24 lexicon facts "which word follows <syllable> ?", so every name token is also an
  ordinary question word and answer). The target model `train_tinytofu(data, "full")` (SFT on forget + retain +
  world) and the oracle `train_tinytofu(data, "oracle")` (retain + world, another init), cached under
  `~/.cache/hf_stable/tinytofu/<seed>/`.
* HP₀ = mean answer probability (`exp(−mean NLL)` of value + EOS) of the holdout questions under the *starting* (full)
  model, once per seed; every over-forgetting value OF = log10(FP/HP₀) uses it (passed as `start_holdout_prob`).
* Control (no training): `reset_name_embeddings(full, data, seed=seed)` re-draws the input-embedding rows of every
  token occurring in a forget author's name from the init distribution N(0, 0.02²). Evaluated like a method.
* Unlearning: `UnlearningTrainer` from a fresh copy of the full model; forget batch 16 + retain batch 16 per step
  (anchor = forget), AdamW (`adamw_torch`), constant LR, grad-clip 1.0, the collapse guard off (the benchmark reports
  the collapse signature itself), seed = the run seed. Presets (the v1 presets, unchanged; NLL retain term with
  weight 1 except GA and SGA — DMM gets it on top of its KL matching on forget + retain batches):
  GA, GradDiff lr 5e-4 × 100 steps; NPO β 0.1, lr 5e-4 × 200; SimNPO β 2.5, m 0, w_f 1, lr 1e-3 × 400; StableUN
  (SimNPO base, β 2.5, w_f 1, ρ 0.05, probe points sam+clean, projection on) lr 1e-3 × 300; DMM-oracle (OM,
  `dmm_target="oracle_model"`) lr 5e-4 × 400; DMM-prior (`dmm_target="prior"`) lr 1e-3 × 400; PDU (flattening, ε
  0.02, η 2, λ₀ 20, 20 warm-up steps, per-step dual updates) lr 1e-3 × 200; SGA r −1, K 4 (3 random retain "normal"
  examples per forget example), lr 5e-4 × 100; bounded GradDiff (sine LoRA r 8, α 16 on gate/up/down, base frozen;
  ω and lr from the v1 pilot below) × 120 steps.
* Evaluation (`hf_stable.evaluation.unlearning.evaluate_unlearning`, template-0 questions): FA, RA, WA, HA
  (first-answer-token accuracy), FP (forget answer probability), OF, truth ratio (median), FQ_holdout / FQ_oracle
  (KS p-values of the forget truth ratios vs the model's holdout ones / the oracle's forget ones), MIA (min-k 20 %
  AUC, forget vs holdout) and the relearning attack (a copy, 20 AdamW steps, lr 1e-3, batch 8 on the city + genre
  facts of the forget authors; accuracy / probability on their award + job questions, RR_acc / RR_p); the same attack
  on the oracle gives the reference. The full model and the oracle are evaluated the same way (reference rows).
* Marks per seed. Tier 1 (all four): T1 FA ≤ 0.15; T2 RA ≥ 0.90 × RA_full; T3 WA ≥ 0.60 × WA_full; T4 OF ≥ −2.
  Collapse signature: RA < 0.5 × RA_full or OF < −3. Tier 2 requires Tier 1 and all of Q1 FQ_holdout ≥ 0.05; Q2
  FQ_oracle ≥ 0.05; Q3 |MIA − 0.5| ≤ 0.10; Q4 (two-sided) RR_p(oracle) / 10 ≤ RR_p ≤ RR_p(oracle) + 0.10 and
  |RR_acc − RR_acc(oracle)| ≤ 0.15. The Q marks are reported on every row; the gate and the lower side of Q4 are v2:
  in v1 a collapsed GA (RR_p 3e-4 to 7e-7 against the oracle's 0.12–0.14) passed Tier 2 on 3/3 seeds.
* Seeds 0, 1, 2 (data, SFT inits, unlearning data order). Aggregates are mean ± sample std over seeds; the criteria
  count seeds.

Pass criteria (pre-registered before the v2 run; printed PASS/FAIL as measured):
  (a) Tier 1 holds on every seed for SimNPO, PDU and StableUN (each of the three);
  (b) GA trips the collapse signature on every seed;
  (c) Tier 2 (Q1-Q4) and the relearning numbers next to the oracle's are reported for every method and seed
      (a reporting criterion: it passes when every value was measured; the Tier-2 outcomes are what they are);
  (d) the embedding-reset control fails Tier 1 or Tier 2 on every seed.

Pilot (v1 data, bounded GradDiff only; seed 100, not reported; rule fixed before the pilot ran). Grid: ω ∈ {50, 100,
200} × lr ∈ {5e-3, 1e-3}, 120 steps, seed 100. Rule: keep the (ω, lr) with the most Tier-1 checks (T1-T4) holding;
ties: lr 5e-3 first, then the larger RA/RA_full, then the smaller ω. Outcome (details in `PILOT` and the Markdown):
ω = 50, lr 5e-3 kept. It was not rerun on v2 data: the v2 table keeps every v1 preset, so that the data change is the
only change.
Threshold comparisons on accuracies allow `EPS` = 1e-6 (12/80 is stored as the fp32 0.15000000596).

Command (seeds 0-2, all methods and the control; through `experiments/_harness.py`, which caches each seed's record,
and each (seed, row) result is cached inside the seed's folder under `experiments/cache/tinytofu/`, keyed by the code
digest like the seed, so an interrupted run resumes and a code change reruns; `--seeds 1` in three processes runs the
seeds in parallel, and a last run without `--seeds` assembles the table from the cache; `--methods` runs a subset; the
SFT checkpoints stay in the library's own cache, `~/.cache/hf_stable/tinytofu`, keyed by their training config, and
each seed's record says whether they came from it, `sft.full.cached`):
    OMP_NUM_THREADS=1 .venv/bin/python experiments/tinytofu.py
Quick run (the CI smoke: `make_tinytofu(seed, reduced=True)` — 60 retain authors, 20 world facts —, SFT with at
most one extension, seed 0 only, GA + GradDiff + SimNPO with the same presets, and the control):
    OMP_NUM_THREADS=1 .venv/bin/python experiments/tinytofu.py --quick --out /tmp/tinytofu_quick
"""

from __future__ import annotations

import copy
import json
import math
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from _harness import criterion, declare, mean_std, run, save_figure, seeds_holding, subplots


NAME = "tinytofu"

# Tier-1 / collapse / Tier-2 thresholds (the table in docs/unlearning.md#tinytofu)
FA_MAX, RA_RATIO, WA_RATIO, OF_MIN = 0.15, 0.90, 0.60, -2.0
COLLAPSE_RA_RATIO, COLLAPSE_OF = 0.5, -3.0
# Accuracies are fp32 ratios of counts (12/80 is stored as 0.15000000596); thresholds are compared with this slack so
# that a count exactly on a bound counts as meeting it.
EPS = 1e-6
FQ_MIN, MIA_TOL, RR_P_MARGIN, RR_ACC_MARGIN = 0.05, 0.10, 0.10, 0.15
# Q4's lower side: a model whose answers sit far below chance even after the attack is destroyed, not clean; a factor
# of 10 below the oracle (log scale, like OF) separates that from a chance-level model.
RR_P_FLOOR_RATIO = 0.1
THRESHOLDS = {
    "fa_max": FA_MAX,
    "ra_ratio": RA_RATIO,
    "wa_ratio": WA_RATIO,
    "of_min": OF_MIN,
    "collapse_ra_ratio": COLLAPSE_RA_RATIO,
    "collapse_of": COLLAPSE_OF,
    "fq_min": FQ_MIN,
    "mia_tol": MIA_TOL,
    "rr_p_margin": RR_P_MARGIN,
    "rr_p_floor_ratio": RR_P_FLOOR_RATIO,
    "rr_acc_margin": RR_ACC_MARGIN,
}
CONTROL = "control"  # the embedding-reset row
REFERENCE_ROWS = ("full", "oracle", CONTROL)

# Bounded GradDiff: the pilot's choice (seed 100; see the module docstring and PILOT).
BOUNDED_OMEGA, BOUNDED_LR, BOUNDED_STEPS = 50.0, 5e-3, 120

COMMON = dict(
    use_cpu=True,
    report_to="none",
    save_strategy="no",
    optim="adamw_torch",
    lr_scheduler_type="constant",
    max_grad_norm=1.0,
    per_device_train_batch_size=16,
    weight_decay=0.0,
    warmup_steps=0,
    collapse_guard=False,
    disable_tqdm=True,
    dataloader_num_workers=0,
)


def presets() -> dict[str, dict]:
    """The per-method `UnlearningConfig` fields; `retain_weight` 1 with an NLL retain term unless noted."""
    nll = dict(retain_loss_type="nll", retain_weight=1.0)
    return {
        "ga": dict(unlearn_method="ga", retain_loss_type="none", learning_rate=5e-4, max_steps=100),
        "graddiff": dict(unlearn_method="graddiff", forget_weight=1.0, **nll, learning_rate=5e-4, max_steps=100),
        "npo": dict(unlearn_method="npo", npo_beta=0.1, forget_weight=1.0, **nll, learning_rate=5e-4, max_steps=200),
        "simnpo": dict(
            unlearn_method="simnpo",
            simnpo_beta=2.5,
            simnpo_margin=0.0,
            forget_weight=1.0,
            **nll,
            learning_rate=1e-3,
            max_steps=400,
        ),
        "stableun": dict(
            unlearn_method="stableun",
            stableun_base_loss="simnpo",
            simnpo_beta=2.5,
            simnpo_margin=0.0,
            stableun_rho=0.05,
            stableun_points="sam+clean",
            stableun_project=True,
            forget_weight=1.0,
            **nll,
            learning_rate=1e-3,
            max_steps=300,
        ),
        "dmm_oracle": dict(
            unlearn_method="dmm",
            dmm_target="oracle_model",
            forget_weight=1.0,
            **nll,
            learning_rate=5e-4,
            max_steps=400,
        ),
        "dmm_prior": dict(
            unlearn_method="dmm", dmm_target="prior", forget_weight=1.0, **nll, learning_rate=1e-3, max_steps=400
        ),
        "pdu": dict(
            unlearn_method="pdu",
            pdu_forget_loss="flatten",
            pdu_eps=0.02,
            pdu_dual_lr=2.0,
            pdu_lambda0=20.0,
            pdu_warmup_steps=20,
            pdu_dual_update="step",
            forget_weight=1.0,
            **nll,
            learning_rate=1e-3,
            max_steps=200,
        ),
        "sga": dict(
            unlearn_method="sga",
            sga_rate=-1.0,
            sga_num_normal=3,
            sga_normal_source="retain_random",
            retain_loss_type="none",
            learning_rate=5e-4,
            max_steps=100,
        ),
        "bounded_graddiff": dict(
            unlearn_method="graddiff",
            bounded_lora=True,
            bounded_omega=BOUNDED_OMEGA,
            bounded_lora_r=8,
            bounded_lora_alpha=16.0,
            forget_weight=1.0,
            **nll,
            learning_rate=BOUNDED_LR,
            max_steps=BOUNDED_STEPS,
        ),
    }


PRESETS = presets()
METHODS = tuple(PRESETS)
QUICK_METHODS = ("ga", "graddiff", "simnpo")


@dataclass(frozen=True)
class Sizes:
    """What `--quick` changes: the reduced data set, at most one SFT extension (3 is the library's default, so the
    full run loads the same SFT checkpoints as `train_tinytofu(data, which)`), and three methods."""

    reduced: bool = False
    sft_max_extensions: int = 3
    methods: tuple = METHODS


QUICK = Sizes(reduced=True, sft_max_extensions=1, methods=QUICK_METHODS)
TIER1_REQUIRED = ("simnpo", "pdu", "stableun")  # criterion (a)
LABELS = {
    "full": "full (start)",
    "oracle": "oracle (retrain)",
    CONTROL: "control: name-embedding reset",
    "ga": "GA",
    "graddiff": "GradDiff",
    "npo": "NPO",
    "simnpo": "SimNPO",
    "stableun": "StableUN",
    "dmm_oracle": "DMM-oracle (OM)",
    "dmm_prior": "DMM-prior",
    "pdu": "PDU",
    "sga": "SGA r=-1",
    "bounded_graddiff": "bounded GradDiff (sine)",
}
COLORS = {
    "ga": "tab:red",
    "graddiff": "tab:orange",
    "npo": "tab:olive",
    "simnpo": "tab:blue",
    "stableun": "tab:cyan",
    "dmm_oracle": "tab:purple",
    "dmm_prior": "tab:pink",
    "pdu": "tab:green",
    "sga": "tab:brown",
    "bounded_graddiff": "tab:gray",
    "full": "black",
    "oracle": "gold",
    CONTROL: "magenta",
}
SEED_MARKERS = ("o", "s", "^", "D", "v", "P")

# Pilot on seed 100 (bounded GradDiff, 120 steps), run and recorded before the seed 0-2 run.
PILOT: dict = {
    "seed": 100,
    "steps": BOUNDED_STEPS,
    "rule": "most Tier-1 checks (T1-T4) holding; ties: lr 5e-3, then the larger RA/RA_full, then the smaller ω",
    "grid": [
        {
            "omega": 50,
            "lr": 5e-3,
            "forget_acc": 0.0375,
            "ra_ratio": 0.4739,
            "wa_ratio": 0.0250,
            "over_forgetting": -0.264,
            "tier1_checks": 2,
            "collapse": True,
        },
        {
            "omega": 50,
            "lr": 1e-3,
            "forget_acc": 0.4750,
            "ra_ratio": 0.7518,
            "wa_ratio": 0.4250,
            "over_forgetting": 0.826,
            "tier1_checks": 1,
            "collapse": False,
        },
        {
            "omega": 100,
            "lr": 5e-3,
            "forget_acc": 0.0625,
            "ra_ratio": 0.4161,
            "wa_ratio": 0.3000,
            "over_forgetting": -6.014,
            "tier1_checks": 1,
            "collapse": True,
        },
        {
            "omega": 100,
            "lr": 1e-3,
            "forget_acc": 0.4375,
            "ra_ratio": 0.7165,
            "wa_ratio": 0.2500,
            "over_forgetting": 0.781,
            "tier1_checks": 1,
            "collapse": False,
        },
        {
            "omega": 200,
            "lr": 5e-3,
            "forget_acc": 0.0250,
            "ra_ratio": 0.4612,
            "wa_ratio": 0.1750,
            "over_forgetting": -0.433,
            "tier1_checks": 2,
            "collapse": True,
        },
        {
            "omega": 200,
            "lr": 1e-3,
            "forget_acc": 0.2125,
            "ra_ratio": 0.6460,
            "wa_ratio": 0.3250,
            "over_forgetting": 0.472,
            "tier1_checks": 1,
            "collapse": False,
        },
    ],
    "decision": "Kept ω = 50, lr 5e-3 (2 Tier-1 checks, tied with ω = 200 at lr 5e-3; larger RA/RA_full 0.47 vs "
    "0.46). No configuration passed Tier 1 on the pilot seed: at lr 5e-3 every ω forgets (FA ≤ 0.06) but collapses "
    "retain (RA/RA_full ≈ 0.42-0.47) and world facts; at lr 1e-3 none forgets (FA 0.21-0.48). Nothing else was "
    "changed in response.",
}


# ---------------------------------------------------------------------------------------------------------------------
# one seed


def load_seed(seed: int, sizes: Sizes):
    from hf_stable.testing.tinytofu import make_tinytofu, train_tinytofu

    data = make_tinytofu(seed, reduced=sizes.reduced)
    start = time.time()
    full, full_info = train_tinytofu(data, "full", max_extensions=sizes.sft_max_extensions)
    oracle, oracle_info = train_tinytofu(data, "oracle", max_extensions=sizes.sft_max_extensions)
    info = {
        name: {key: i[key] for key in ("accuracy", "accepted", "epochs", "steps", "train_seconds", "cached")}
        for name, i in (("full", full_info), ("oracle", oracle_info))
    }
    info["seconds"] = time.time() - start
    info["sizes"] = data.sizes
    info["fingerprint"] = data.fingerprint()
    return data, full, oracle, info


def evaluate(model, data, oracle, hp0: float, oracle_relearn: dict | None = None) -> dict:
    """Every benchmark metric of ``model``; the oracle's relearning numbers are computed once per seed and reused."""
    from hf_stable.evaluation.unlearning import evaluate_unlearning, relearn_attack

    report = evaluate_unlearning(
        model,
        data.tokenizer,
        forget=data.forget_eval,
        retain=data.retain_eval,
        holdout=data.holdout_eval,
        world=data.world_eval,
        oracle=oracle,
        start_holdout_prob=hp0,
        print_table=False,
    )
    attack = relearn_attack(model, data.tokenizer, data.relearn, data.relearn_eval)  # 20 steps, lr 1e-3, batch 8
    report["relearn_acc"], report["relearn_prob"] = attack["acc"], attack["prob"]
    if oracle_relearn is None:
        oracle_relearn = relearn_attack(oracle, data.tokenizer, data.relearn, data.relearn_eval)
    report["oracle_relearn_acc"], report["oracle_relearn_prob"] = oracle_relearn["acc"], oracle_relearn["prob"]
    return report


def marks(m: dict, ref: dict) -> dict:
    """Tier 1, the collapse signature and Tier 2 of one evaluated model; ``ref`` holds RA_full and WA_full."""
    ra_ratio = m["retain_acc"] / ref["retain_acc"]
    wa_ratio = m["world_acc"] / ref["world_acc"]
    t1 = {
        "T1": m["forget_acc"] <= FA_MAX + EPS,
        "T2": ra_ratio >= RA_RATIO - EPS,
        "T3": wa_ratio >= WA_RATIO - EPS,
        "T4": m["over_forgetting"] >= OF_MIN,
    }
    t2 = {
        "Q1": m["fq_holdout"] >= FQ_MIN,
        "Q2": m["fq_oracle"] >= FQ_MIN,
        "Q3": abs(m["mia_auc"] - 0.5) <= MIA_TOL,
        "Q4": RR_P_FLOOR_RATIO * m["oracle_relearn_prob"]
        <= m["relearn_prob"]
        <= m["oracle_relearn_prob"] + RR_P_MARGIN
        and abs(m["relearn_acc"] - m["oracle_relearn_acc"]) <= RR_ACC_MARGIN + EPS,
    }
    tier1 = all(t1.values())
    return {
        "ra_ratio": ra_ratio,
        "wa_ratio": wa_ratio,
        "tier1": {**t1, "passed": tier1},
        "collapse": ra_ratio < COLLAPSE_RA_RATIO or m["over_forgetting"] < COLLAPSE_OF,
        # "indistinguishable from never trained" means nothing for a model that lost its utility: gated on Tier 1
        "tier2": {**t2, "passed": tier1 and all(t2.values())},
    }


def unlearn(method: str, preset: dict, seed: int, data, full, oracle):
    """A fresh copy of the full model unlearned with ``preset``; returns (model, run info)."""
    from transformers import PrinterCallback

    from hf_stable import UnlearningConfig, UnlearningTrainer

    model = copy.deepcopy(full).train()
    start = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        args = UnlearningConfig(
            output_dir=tmp, seed=seed, logging_steps=max(1, preset["max_steps"] // 4), **COMMON, **preset
        )
        trainer = UnlearningTrainer(
            model=model,
            args=args,
            forget_dataset=data.forget,
            retain_dataset=data.retain,
            processing_class=data.tokenizer,
            holdout_dataset=data.holdout_eval,
            oracle_model=oracle,
        )
        trainer.remove_callback(PrinterCallback)
        trainer.train()
    info = {
        "steps": trainer.state.global_step,
        "train_seconds": time.time() - start,
        "log": [
            {k: (round(v, 6) if isinstance(v, float) else v) for k, v in h.items()}
            for h in trainer.state.log_history
            if "loss" in h
        ],
    }
    if preset["unlearn_method"] == "pdu":
        info["final_lambda"] = trainer.dual_variable
    trained = trainer.model.eval()
    del trainer
    return trained, info


def _cached(path: Path, key: dict, compute):
    """``compute()`` unless ``path`` holds a result made with the same ``key`` (data fingerprint, preset, mode)."""
    key = json.loads(json.dumps(key))  # the stored form (tuples become lists)
    try:
        stored = json.loads(path.read_text())
        if stored["key"] == key:
            return stored["result"]
    except (OSError, ValueError, KeyError):
        pass
    result = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"key": key, "result": result}, ensure_ascii=False))
    os.replace(tmp, path)
    return result


def _progress(seed: int, name: str, result: dict) -> None:
    metrics = result["metrics"]
    t1 = "".join("✓" if result["tier1"][k] else "✗" for k in ("T1", "T2", "T3", "T4"))
    t2 = "".join("✓" if result["tier2"][k] else "✗" for k in ("Q1", "Q2", "Q3", "Q4"))
    steps = f"  ({result['steps']} steps, {result['train_seconds']:.1f}s)" if "steps" in result else ""
    print(
        f"[seed {seed}] {name:>16}: FA {metrics['forget_acc']:.3f}  RA/RA0 {result['ra_ratio']:.3f}  "
        f"WA/WA0 {result['wa_ratio']:.3f}  OF {metrics['over_forgetting']:+.2f}  T1 {t1}  "
        f"collapse {'YES' if result['collapse'] else 'no'}  T2 {t2} ({'✓' if result['tier2']['passed'] else '✗'})  "
        f"RR_p {metrics['relearn_prob']:.3f} (oracle {metrics['oracle_relearn_prob']:.3f}){steps}",
        flush=True,
    )


def run_seed(seed: int, sizes: Sizes, cache_dir: Path | None = None) -> dict:
    """Reference rows (full, oracle, the embedding-reset control) and every method of one seed.

    With ``cache_dir`` (the harness's folder for this seed, keyed by sizes, config and code digest) each row's result
    is stored as ``<cache_dir>/<row>.json`` and reused when the data fingerprint and preset match too: a seed is ~30
    CPU-minutes, so an interrupted one resumes from its finished rows.
    """
    from hf_stable.evaluation.unlearning import relearn_attack
    from hf_stable.testing.tinytofu import answer_prob, reset_name_embeddings

    data, full, oracle, sft = load_seed(seed, sizes)
    print(
        f"[seed {seed}] SFT ({'cached' if sft['full']['cached'] and sft['oracle']['cached'] else 'trained'}, "
        f"{sft['seconds']:.0f}s): full {sft['full']['accuracy']}  oracle {sft['oracle']['accuracy']}",
        flush=True,
    )
    base_key = {"fingerprint": sft["fingerprint"], "reduced": sizes.reduced, "thresholds": THRESHOLDS}

    def cached(name: str, key: dict, compute):
        if cache_dir is None:
            return compute()
        return _cached(Path(cache_dir) / f"{name}.json", {**base_key, **key}, compute)

    hp0 = answer_prob(full, data.tokenizer, data.holdout_eval).mean().item()
    oracle_relearn = cached(
        "oracle_relearn", {}, lambda: relearn_attack(oracle, data.tokenizer, data.relearn, data.relearn_eval)
    )

    def reference_rows() -> dict:
        start = time.time()
        control = reset_name_embeddings(full, data, seed=seed)
        rows = {
            name: evaluate(m, data, oracle, hp0, oracle_relearn)
            for name, m in zip(REFERENCE_ROWS, (full, oracle, control), strict=True)
        }
        # HP₀ from answer_prob equals the full model's holdout_prob of evaluate_unlearning (a consistency check)
        assert math.isclose(hp0, rows["full"]["holdout_prob"], rel_tol=1e-4), (hp0, rows["full"])
        seconds = (time.time() - start) / len(rows)
        return {name: {"metrics": r, **marks(r, rows["full"]), "eval_seconds": seconds} for name, r in rows.items()}

    out = {
        "sft": sft,
        "hp0": hp0,
        "torch_threads": torch.get_num_threads(),
        "reference": cached("reference", {}, reference_rows),
        "methods": {},
    }
    for name in REFERENCE_ROWS[1:]:
        _progress(seed, name, out["reference"][name])
    ref_acc = out["reference"]["full"]["metrics"]

    def run_method(method: str) -> dict:
        model, info = unlearn(method, PRESETS[method], seed, data, full, oracle)
        t = time.time()
        metrics = evaluate(model, data, oracle, hp0, oracle_relearn)
        return {"metrics": metrics, **marks(metrics, ref_acc), **info, "eval_seconds": time.time() - t}

    for method in sizes.methods:
        result = cached(method, {"preset": PRESETS[method], "common": COMMON}, lambda m=method: run_method(m))
        out["methods"][method] = result
        _progress(seed, method, result)
    return out


# ---------------------------------------------------------------------------------------------------------------------
# aggregation, criteria


KEYS = (
    "forget_acc",
    "retain_acc",
    "world_acc",
    "holdout_acc",
    "forget_prob",
    "over_forgetting",
    "forget_truth_ratio_median",
    "fq_holdout",
    "fq_oracle",
    "mia_auc",
    "relearn_acc",
    "relearn_prob",
    "oracle_relearn_acc",
    "oracle_relearn_prob",
)


def rows_of(per_seed: dict) -> dict[str, list[dict]]:
    """``{row: [per-seed result]}`` for the reference rows and every method, in table order."""
    seeds = list(per_seed)
    rows = {name: [per_seed[s]["reference"][name] for s in seeds] for name in REFERENCE_ROWS}
    for method in per_seed[seeds[0]]["methods"]:
        rows[method] = [per_seed[s]["methods"][method] for s in seeds]
    return rows


def aggregate(per_seed: dict) -> dict:
    out = {}
    for name, results in rows_of(per_seed).items():
        entry = {k: mean_std([r["metrics"][k] for r in results]) for k in KEYS}
        entry["ra_ratio"] = mean_std([r["ra_ratio"] for r in results])
        entry["wa_ratio"] = mean_std([r["wa_ratio"] for r in results])
        entry["tier1_seeds"] = sum(r["tier1"]["passed"] for r in results)
        entry["tier2_seeds"] = sum(r["tier2"]["passed"] for r in results)
        entry["collapse_seeds"] = sum(r["collapse"] for r in results)
        entry["tier1_checks_seeds"] = {k: sum(r["tier1"][k] for r in results) for k in ("T1", "T2", "T3", "T4")}
        entry["tier2_checks_seeds"] = {k: sum(r["tier2"][k] for r in results) for k in ("Q1", "Q2", "Q3", "Q4")}
        if "train_seconds" in results[0]:
            entry["train_seconds"] = mean_std([r["train_seconds"] for r in results])
        out[name] = entry
    out["hp0"] = mean_std([per_seed[s]["hp0"] for s in per_seed])
    out["diagnostics"] = diagnostics(per_seed)
    return out


def criteria(per_seed: dict) -> dict:
    rows, n = rows_of(per_seed), len(per_seed)
    methods = [m for m in rows if m not in REFERENCE_ROWS]
    required = [m for m in TIER1_REQUIRED if m in rows]
    t1 = {m: sum(r["tier1"]["passed"] for r in rows[m]) for m in required}
    checks = {
        "a": criterion(
            "Tier 1 (FA ≤ 0.15, RA ≥ 0.90 × RA_full, WA ≥ 0.60 × WA_full, OF ≥ −2) holds on every seed for SimNPO, "
            "PDU and StableUN",
            bool(required) and all(t1[m] == n for m in required),
            {**{m: f"{t1[m]}/{n}" for m in required}, "not_run": [m for m in TIER1_REQUIRED if m not in rows]},
            seeds_holding(per_seed, lambda r: all(r["methods"][m]["tier1"]["passed"] for m in required)),
        )
    }
    if "ga" in rows:
        checks["b"] = criterion(
            "GA (lr 5e-4 × 100) trips the collapse signature (RA < 0.5 × RA_full or OF < −3) on every seed",
            all(r["collapse"] for r in rows["ga"]),
            {
                "ra_ratio": [round(r["ra_ratio"], 4) for r in rows["ga"]],
                "over_forgetting": [round(r["metrics"]["over_forgetting"], 3) for r in rows["ga"]],
            },
            seeds_holding(per_seed, lambda r: r["methods"]["ga"]["collapse"]),
        )

    def measured(r: dict) -> bool:
        return all(math.isfinite(r["metrics"][k]) for k in KEYS) and all(
            k in r["tier2"] for k in ("Q1", "Q2", "Q3", "Q4")
        )

    checks["c"] = criterion(
        "Tier 2 (requires Tier 1; Q1 FQ_holdout ≥ 0.05, Q2 FQ_oracle ≥ 0.05, Q3 |MIA − 0.5| ≤ 0.10, "
        "Q4 RR_p(oracle)/10 ≤ RR_p ≤ RR_p(oracle) + 0.10 and |RR_acc − RR_acc(oracle)| ≤ 0.15) and the relearning "
        "numbers next to the oracle's are reported for every method and seed (reporting criterion; the Tier-2 "
        "outcomes are in `values`)",
        bool(methods) and all(measured(r) for m in methods for r in rows[m]),
        {
            m: {
                "tier2_seeds": f"{sum(r['tier2']['passed'] for r in rows[m])}/{n}",
                **{q: f"{sum(r['tier2'][q] for r in rows[m])}/{n}" for q in ("Q1", "Q2", "Q3", "Q4")},
                "relearn_prob": [round(r["metrics"]["relearn_prob"], 4) for r in rows[m]],
                "oracle_relearn_prob": [round(r["metrics"]["oracle_relearn_prob"], 4) for r in rows[m]],
                "relearn_acc": [round(r["metrics"]["relearn_acc"], 4) for r in rows[m]],
                "oracle_relearn_acc": [round(r["metrics"]["oracle_relearn_acc"], 4) for r in rows[m]],
            }
            for m in methods
        },
        seeds_holding(per_seed, lambda r: all(measured(row) for row in r["methods"].values())),
    )
    control = rows[CONTROL]

    def control_fails(r: dict) -> bool:
        return not (r["tier1"]["passed"] and r["tier2"]["passed"])

    checks["d"] = criterion(
        "the embedding-reset control (forget-name token rows re-drawn from the init, no training) fails Tier 1 or "
        "Tier 2 on every seed",
        all(control_fails(r) for r in control),
        {
            "tier1": [r["tier1"]["passed"] for r in control],
            "tier2": [r["tier2"]["passed"] for r in control],
            "ra_ratio": [round(r["ra_ratio"], 4) for r in control],
            "wa_ratio": [round(r["wa_ratio"], 4) for r in control],
            "forget_acc": [round(r["metrics"]["forget_acc"], 4) for r in control],
        },
        seeds_holding(per_seed, lambda r: control_fails(r["reference"][CONTROL])),
    )
    return checks


def diagnostics(per_seed: dict) -> dict:
    """Observations that are not acceptance criteria (the v1 table suggested both)."""
    rows, n = rows_of(per_seed), len(per_seed)
    out = {}
    if "simnpo" in rows and "stableun" in rows:
        lower = [
            st["metrics"]["relearn_prob"] < si["metrics"]["relearn_prob"]
            for st, si in zip(rows["stableun"], rows["simnpo"], strict=True)
        ]
        out["stableun_relearn_below_simnpo"] = {
            "description": "StableUN's relearning recovery RR_p is lower than SimNPO's (a small effect in v1)",
            "seeds_holding": f"{sum(lower)}/{n}",
        }
    no_tier2 = [m for m in rows if m not in REFERENCE_ROWS and not any(r["tier2"]["passed"] for r in rows[m])]
    out["no_method_reaches_tier2"] = {
        "description": "methods with Tier 2 (which requires Tier 1) on no seed: suppression, not removal",
        "methods": no_tier2,
    }
    return out


# ---------------------------------------------------------------------------------------------------------------------
# outputs


def fnum(v: float, digits: int = 2) -> str:
    """Compact number: small values (p-values) in `3e-43` style, the rest with ``digits`` decimals."""
    if v == 0:
        return "0"
    if abs(v) < 0.01:
        return f"{v:.0e}"
    return f"{v:.{digits}f}"


def fof(v: float) -> str:
    return f"{v:.1f}" if abs(v) < 100 else f"{v:.0f}"


def plot(per_seed: dict, path: Path) -> None:
    rows = rows_of(per_seed)
    fig, axes = subplots(1, 2, figsize=(15, 6.2))
    ax = axes[0]
    ax.axvspan(RA_RATIO, 1.1, ymin=0, ymax=1, color="tab:green", alpha=0.05)
    ax.axvline(RA_RATIO, color="tab:green", linestyle=":", linewidth=1, label=f"RA/RA_full = {RA_RATIO}")
    ax.axhline(1 - FA_MAX, color="tab:green", linestyle="--", linewidth=1, label=f"1 − FA = {1 - FA_MAX:.2f}")
    ax.axvline(COLLAPSE_RA_RATIO, color="tab:red", linestyle=":", linewidth=1, label="collapse: RA/RA_full = 0.5")
    for name, results in rows.items():
        for i, r in enumerate(results):
            ax.scatter(
                r["ra_ratio"],
                1 - r["metrics"]["forget_acc"],
                color=COLORS[name],
                marker=SEED_MARKERS[i % len(SEED_MARKERS)],
                s=70 if name in REFERENCE_ROWS else 50,
                edgecolors="black" if r["tier1"]["passed"] else "none",
                linewidths=1.2,
                label=LABELS[name] if i == 0 else None,
                alpha=0.9,
            )
    seeds = list(per_seed)
    ax.set(
        xlabel="retain utility RA / RA_full",
        ylabel="forget efficacy 1 − FA",
        title=f"Forget efficacy vs retain utility (markers: seeds {', '.join(seeds)} = "
        + ", ".join(SEED_MARKERS[: len(seeds)])
        + "; black edge = Tier 1)",
        xlim=(-0.03, 1.08),
        ylim=(-0.03, 1.05),
    )
    ax.title.set_fontsize(9)
    ax.legend(fontsize=7, loc="lower left", ncol=2)
    ax = axes[1]
    names = list(rows)
    for x, name in enumerate(names):
        for i, r in enumerate(rows[name]):
            ax.scatter(
                x + (i - 1) * 0.12,
                max(r["metrics"]["relearn_prob"], 1e-8),
                color=COLORS[name],
                marker=SEED_MARKERS[i % len(SEED_MARKERS)],
                s=45,
            )
    oracle_rr = [per_seed[s]["reference"]["oracle"]["metrics"]["relearn_prob"] for s in per_seed]
    ax.axhspan(min(oracle_rr), max(oracle_rr), color="gold", alpha=0.3, label="oracle RR_p (range over seeds)")
    ax.axhline(max(oracle_rr) + RR_P_MARGIN, color="gray", linestyle="--", label="oracle + 0.10 (Q4 upper bound)")
    ax.axhline(min(oracle_rr) * RR_P_FLOOR_RATIO, color="gray", linestyle=":", label="oracle / 10 (Q4 lower bound)")
    ax.set_yscale("log")
    ax.set_xticks(range(len(names)), [LABELS[n] for n in names], rotation=40, ha="right", fontsize=8)
    ax.set(
        ylabel="RR_p: answer prob. after the 20-step relearning attack (log; floor 1e-8)",
        title="Relearning attack (Tier 2, Q4: two-sided)",
    )
    ax.legend(fontsize=8)
    fig.suptitle(
        "TinyTOFU v2 (shared-syllable names): unlearning methods and the embedding-reset control, 0.38M Llama"
    )
    save_figure(fig, path)


def markdown(result: dict) -> str:
    per_seed, checks, cfg = result["per_seed"], result["criteria"], result["config"]
    rows, seeds = rows_of(per_seed), list(per_seed)

    def cells(results, get) -> str:
        return "/".join(get(r) for r in results)

    def t2mark(r) -> str:
        return "".join("✓" if r["tier2"][q] else "✗" for q in ("Q1", "Q2", "Q3", "Q4"))

    hp0 = " / ".join(f"{per_seed[s]['hp0']:.3f}" for s in seeds)
    lines = [
        f"{'Quick: reduced data. ' if cfg['quick'] else ''}Cells are "
        f"`{'/'.join('seed' + s for s in seeds)}`. RA₀, WA₀ = the full model's accuracies; OF = log10(FP/HP₀) with "
        f"HP₀ = {hp0}. Tier 1 = T1 FA ≤ 0.15, T2 RA ≥ 0.90 RA₀, T3 WA ≥ 0.60 WA₀, T4 OF ≥ −2. The Q marks are "
        "`Q1Q2Q3Q4` per seed (Q1 FQ_hold ≥ 0.05, Q2 FQ_orc ≥ 0.05, Q3 |MIA − 0.5| ≤ 0.10, Q4 oracle/10 ≤ RR_p ≤ "
        "oracle + 0.10 and |RR_acc − oracle| ≤ 0.15); Tier 2 = Tier 1 and all four. Collapse = RA < 0.5 RA₀ or "
        "OF < −3. The control re-draws the embedding rows of the forget names' tokens from the init (no training).",
        "",
        "| method | FA | RA/RA₀ | WA/WA₀ | OF | Tier 1 | collapse | FQ_hold | FQ_orc | MIA | TR median | RR_acc | "
        "RR_p | Q1-Q4 | Tier 2 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    columns = (
        lambda r: f"{r['metrics']['forget_acc']:.2f}",
        lambda r: f"{r['ra_ratio']:.2f}",
        lambda r: f"{r['wa_ratio']:.2f}",
        lambda r: fof(r["metrics"]["over_forgetting"]),
        lambda r: "✓" if r["tier1"]["passed"] else "✗",
        lambda r: "yes" if r["collapse"] else "no",
        lambda r: fnum(r["metrics"]["fq_holdout"]),
        lambda r: fnum(r["metrics"]["fq_oracle"]),
        lambda r: f"{r['metrics']['mia_auc']:.2f}",
        lambda r: fnum(r["metrics"]["forget_truth_ratio_median"]),
        lambda r: f"{r['metrics']['relearn_acc']:.2f}",
        lambda r: fnum(r["metrics"]["relearn_prob"]),
        t2mark,
        lambda r: "✓" if r["tier2"]["passed"] else "✗",
    )
    for name, results in rows.items():
        lines.append(f"| {LABELS[name]} | " + " | ".join(cells(results, get) for get in columns) + " |")

    def metric(key: str, digits: int = 3):
        return lambda r: f"{r['metrics'][key]:.{digits}f}"

    full, oracle = rows["full"], rows["oracle"]
    lines += [
        "",
        f"Full model (RA₀ / WA₀ / FA): {cells(full, metric('retain_acc'))} / {cells(full, metric('world_acc'))} / "
        f"{cells(full, metric('forget_acc'))}; oracle FA {cells(oracle, metric('forget_acc'))}, oracle relearning "
        f"RR_acc / RR_p {cells(oracle, metric('relearn_acc', 2))} / {cells(oracle, metric('relearn_prob', 2))}.",
        "",
        "Tier-1 checks holding (seeds), Tier 2 per check (seeds), unlearning wall time (mean s per run):",
        "",
        "| method | T1 FA | T2 RA | T3 WA | T4 OF | Tier 1 | Q1 | Q2 | Q3 | Q4 | Tier 2 | collapse | seconds |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    agg, n = result["aggregate"], len(seeds)
    for name in rows:
        a = agg[name]
        secs = f"{a['train_seconds']['mean']:.1f}" if "train_seconds" in a else "–"
        lines.append(
            f"| {LABELS[name]} | "
            + " | ".join(f"{a['tier1_checks_seeds'][k]}/{n}" for k in ("T1", "T2", "T3", "T4"))
            + f" | {a['tier1_seeds']}/{n} | "
            + " | ".join(f"{a['tier2_checks_seeds'][k]}/{n}" for k in ("Q1", "Q2", "Q3", "Q4"))
            + f" | {a['tier2_seeds']}/{n} | {a['collapse_seeds']}/{n} | {secs} |"
        )
    lines += ["", "## Criteria values", "", "| criterion | values |", "|---|---|"]
    for key, check in checks.items():
        values = dict(check["values"])
        not_run = values.pop("not_run", [])
        if key == "c":
            values = {m: v["tier2_seeds"] for m, v in values.items()}
        text = json.dumps(values, ensure_ascii=False).replace("|", "\\|")
        skipped = f" (not run: {', '.join(not_run)})" if not_run else ""
        lines.append(f"| ({key}){skipped} | `{text}` |")
    lines.append("")
    diag = agg["diagnostics"]
    if diag:
        lines += ["Diagnostics (not criteria):", ""]
        for value in diag.values():
            detail = value.get("seeds_holding") or ", ".join(LABELS[m] for m in value["methods"]) or "none"
            lines.append(f"* {value['description']}: {detail}.")
        lines.append("")
    lines += ["## Presets", "", "| method | settings |", "|---|---|"]
    for name in cfg["sizes"]["methods"]:
        preset = cfg["presets"][name]
        text = ", ".join(f"{k}={v}" for k, v in preset.items())
        lines.append(f"| {LABELS[name]} | {text} |")
    lines += [
        "",
        "Common: " + ", ".join(f"{k}={v}" for k, v in cfg["common"].items()) + ".",
        "",
        "## Pilot (bounded GradDiff, seed 100, not reported)",
        "",
    ]
    if cfg["pilot"]:
        lines += ["| ω | lr | FA | RA/RA₀ | WA/WA₀ | OF | Tier-1 checks |", "|---|---|---|---|---|---|---|"]
        for row in cfg["pilot"]["grid"]:
            lines.append(
                f"| {row['omega']:g} | {row['lr']:g} | {row['forget_acc']:.2f} | {row['ra_ratio']:.2f} | "
                f"{row['wa_ratio']:.2f} | {row['over_forgetting']:.1f} | {row['tier1_checks']}/4 |"
            )
        lines += ["", cfg["pilot"]["decision"], ""]
    else:
        lines += ["No pilot recorded.", ""]
    sft = ", ".join(
        f"seed {s} {'/'.join('yes' if per_seed[s]['sft'][w]['cached'] else 'no' for w in ('full', 'oracle'))}"
        for s in seeds
    )
    threads = sorted({per_seed[s]["torch_threads"] for s in seeds})
    lines += [
        f"SFT checkpoints loaded from the library cache (full/oracle): {sft}; torch threads {threads}.",
        "",
    ]
    return "\n".join(lines)


EXPERIMENT = declare(
    globals(),
    title="TinyTOFU v2 unlearning benchmark",
    claim=__doc__.split("Claim. ")[1].split("\n\n")[0].replace("\n", " "),
    aggregate=lambda per_seed, sizes: aggregate(per_seed),
    criteria=lambda per_seed, agg, sizes: criteria(per_seed),
    plot=lambda result, path: plot(result["per_seed"], path),
    config={
        "presets": PRESETS,
        "common": COMMON,
        "thresholds": THRESHOLDS,
        "tier2_requires_tier1": True,
        "relearn_attack": {"steps": 20, "lr": 1e-3, "batch_size": 8, "seed": 0},
        "pilot": PILOT,
    },
    size_flags={"--methods": dict(nargs="+", choices=METHODS, help="methods to run (default: all; quick: 3)")},
    work_cache=True,
)


def main(argv: list[str] | None = None) -> dict:
    return run(EXPERIMENT, argv)


if __name__ == "__main__":
    main()
