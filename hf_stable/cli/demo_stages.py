"""The stages of `hf-stable demo`, one function each: ``stage(ctx) -> dict`` with the stage's numbers and its
summary row (``row``: what ran, the key metric before and after, the artifacts folder). `demo.py` times them, prints
the table and writes ``results.json``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from transformers import PrinterCallback, ProgressCallback

from ._quiet import _DropMessage


# The RL testbed's recipe (experiments/testbeds/rl.py, rl_recipe.py): 1,600 SFT problems whose demonstrations drop
# the carry in 70% of the rows that have one (`with_carry_errors`), 2,400 SFT steps at LR 1e-3, then GRPO with full
# fine-tuning, G = 8, temperature 1, LR 1e-4 on fresh problems: the warm start prefers a wrong rule the verifier
# corrects. The testbed's control (`experiments/grpo_rl_control.py`) measures this recipe's held-out gain over seeds.
GRPO_STEPS_FULL = 700
CARRY_ERROR = 0.7


@dataclass
class Sizes:
    """Run lengths: the full demo (`make demo`, ≤ 8 minutes on 2 cores) and `--quick` (smoke tests)."""

    sft_steps: int
    sft_problems: int
    carry_error: float
    test_rows: int
    grpo_steps: int
    grpo_save_every: int
    grpo_batch: int
    unlearn_steps: int
    guard_steps: int
    spike_step: int


# each run length: (the full demo, `--quick`), side by side
_RUN_LENGTHS = {
    "sft_steps": (2400, 40),
    "sft_problems": (1600, 200),
    "carry_error": (CARRY_ERROR, CARRY_ERROR),
    "test_rows": (300, 40),
    "grpo_steps": (GRPO_STEPS_FULL, 4),
    "grpo_save_every": (GRPO_STEPS_FULL // 4, 2),
    "grpo_batch": (64, 8),
    "unlearn_steps": (150, 20),
    "guard_steps": (80, 30),
    "spike_step": (60, 25),
}
FULL = Sizes(**{name: full for name, (full, _) in _RUN_LENGTHS.items()})
QUICK = Sizes(**{name: quick for name, (_, quick) in _RUN_LENGTHS.items()})

SFT_RUNS = (
    # α = 0 is NLL through hf_stable's own loss path (the same update as TRL's, tested), which also logs `mean_p`
    ("nll", {"sft_objective": "prob_power", "objective_alpha": 0.0}),
    ("-p", {"sft_objective": "prob_power", "objective_alpha": 1.0}),
)
GRPO_RUNS = (("trl-default", "grpo"), ("s-grpo", "sgrpo"), ("maxrl", "maxrl"))
COMMON = dict(report_to="none", use_cpu=True, bf16=False, activation_checkpointing=False, seed=0)


class _QuietProgress(ProgressCallback):
    """A progress bar without a printed dict per log step."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        pass


def _quiet(trainer):
    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    trainer.add_callback(_QuietProgress())
    return trainer


def _load(folder):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)


def _exact_match(model, tokenizer, ctx) -> float:
    from ..testing import evaluate_completions

    return round(evaluate_completions(model, tokenizer, ctx.test)["exact_match"], 4)


def _plot(path, panels) -> str | None:
    """``panels``: ``[(title, ylabel, {label: (xs, ys)}, yscale, marks)]`` side by side; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.8), squeeze=False)
    for ax, (title, ylabel, curves, yscale, marks) in zip(axes[0], panels, strict=True):
        for label, (xs, ys) in curves.items():
            ax.plot(xs, ys, label=label)
        for x in marks:
            ax.axvline(x, color="grey", linestyle="--", linewidth=1)
        ax.set(xlabel="step", ylabel=ylabel, title=title, yscale=yscale)
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def _callback(trainer, cls):
    """The instance of ``cls`` that the trainer's config attached (its decisions and findings go into the results)."""
    return next(cb for cb in trainer.callback_handler.callbacks if isinstance(cb, cls))


def _curve(history, key):
    points = [(h["step"], h[key]) for h in history if key in h]
    return [p[0] for p in points], [p[1] for p in points]


# ---- 1. SFT -------------------------------------------------------------------------------------------------------
def sft(ctx) -> dict:
    """NLL and −p (Li et al., arXiv 2510.00526) from a random init on 2-digit addition; the NLL model is the start of
    the GRPO stage. A random init is the model-weak end of the paper's continuum, where NLL should win. The rows are
    an imperfect demonstrator's: most rows with a carry drop it, so the model learns addition with a wrong carry
    rule, which GRPO's exact-match reward can correct."""
    from ..testing import build_tiny_model
    from ..trainers.sft import StableSFTConfig, StableSFTTrainer

    base = ctx.path("sft", "init")
    build_tiny_model(save_dir=base, seed=0)
    model, tokenizer = _load(base)
    before = _exact_match(model, tokenizer, ctx)
    train = ctx.sft_rows
    runs, curves = {}, {}
    for name, objective in SFT_RUNS:
        out = ctx.path("sft", name.strip("-") if name != "-p" else "minus-p")
        args = StableSFTConfig(
            output_dir=out,
            max_steps=ctx.sizes.sft_steps,
            per_device_train_batch_size=64,
            learning_rate=1e-3,  # the RL testbed's: at 3e-3 some seeds' SFT does not converge on these rows
            lr_scheduler_type="cosine",
            warmup_steps=min(20, ctx.sizes.sft_steps // 10),
            logging_steps=max(1, ctx.sizes.sft_steps // 30),
            max_length=32,
            save_strategy="no",
            **COMMON,
            **objective,
        )
        trainer = _quiet(
            StableSFTTrainer(model=_load(base)[0], args=args, train_dataset=train, processing_class=tokenizer)
        )
        trainer.train()
        trainer.save_model(out)
        runs[name] = {"exact_match": _exact_match(trainer.model, tokenizer, ctx), "folder": out}
        curves[name] = {
            "loss": _curve(trainer.state.log_history, "loss"),
            "mean_p": _curve(trainer.state.log_history, "mean_p"),
        }
    plot = _plot(
        ctx.path("sft", "loss_curves.png"),
        [
            (
                "SFT loss (each its own objective)",
                "training loss",
                {k: v["loss"] for k, v in curves.items()},
                "log",
                [],
            ),
            ("Target-token probability", "mean p", {k: v["mean_p"] for k, v in curves.items()}, "linear", []),
        ],
    )
    after = " / ".join(f"{k} {v['exact_match']:.3f}" for k, v in runs.items())
    return {
        "steps": ctx.sizes.sft_steps,
        "exact_match_init": before,
        "runs": runs,
        "plot": plot,
        "row": (
            f"SFT from random init on {len(train)} problems, NLL vs -p, {ctx.sizes.sft_steps} steps each",
            "held-out exact match",
            f"{before:.3f}",
            after,
            ctx.path("sft"),
        ),
    }


# ---- 2. GRPO ------------------------------------------------------------------------------------------------------
def grpo(ctx) -> dict:
    """StableGRPOTrainer (full fine-tuning) from the SFT (NLL) model on fresh problems: TRL's advantages vs S-GRPO
    (arXiv 2508.05928) vs MaxRL, exact-match reward, the stability guard and the degenerate-run warnings attached,
    checkpoints for WSM. The recipe of the experiments' RL testbed, where plain GRPO raises held-out exact match."""
    from transformers import TrainerCallback

    from ..callbacks import GRPODegenerateRunCallback, StabilityGuardCallback
    from ..testing import arithmetic_reward
    from ..trainers.grpo import StableGRPOConfig, StableGRPOTrainer

    start = ctx.require("sft", "nll")
    base, tokenizer = _load(start)
    before = _exact_match(base, tokenizer, ctx)
    s = ctx.sizes
    generations = 8 if s.grpo_batch >= 8 else 4
    prompts = ctx.fresh_rows.select(range(min(len(ctx.fresh_rows), s.grpo_steps * s.grpo_batch // generations)))

    class HeldOut(TrainerCallback):
        """Held-out exact match at every checkpoint, for the curve."""

        def __init__(self):
            self.points = [(0, before)]

        def on_save(self, args, state, control, model=None, **kwargs):
            self.points.append((state.global_step, _exact_match(model, tokenizer, ctx)))

    runs, rewards, heldout = {}, {}, {}
    for name, estimator in GRPO_RUNS:
        out = ctx.path("grpo", name)
        args = StableGRPOConfig(
            output_dir=out,
            advantage_estimator=estimator,
            max_steps=s.grpo_steps,
            # full fine-tuning at 1e-4: on this tiny model LoRA and 3e-5 barely move held-out accuracy, 3e-4 and
            # above degrade it; constant LR, as WSM's checkpoints assume
            learning_rate=1e-4,
            lr_scheduler_type="constant",
            per_device_train_batch_size=s.grpo_batch,
            num_generations=generations,
            max_completion_length=4,
            temperature=1.0,
            beta=0.0,
            logging_steps=max(1, s.grpo_steps // 40),
            save_strategy="steps",
            save_steps=s.grpo_save_every,
            save_only_model=True,
            # the guard with the trainer's GRPO defaults (gradient-norm spikes only: a GRPO loss carries no spike
            # information); the degenerate-run warnings are on by default
            stability_guard=True,
            guard_min_history=min(128, max(2, s.grpo_steps // 3)),  # the guard allows <= 128 (its window)
            **COMMON,
        )
        curve = HeldOut()
        trainer = _quiet(
            StableGRPOTrainer(
                model=_load(start)[0],
                reward_funcs=arithmetic_reward,
                args=args,
                train_dataset=prompts,
                processing_class=tokenizer,
                callbacks=[curve],
            )
        )
        guard = _callback(trainer, StabilityGuardCallback)
        degenerate = _callback(trainer, GRPODegenerateRunCallback)
        trainer.train()
        em = _exact_match(trainer.model, tokenizer, ctx)
        trainer.save_model(ctx.path("grpo", name, "merged"))  # full fine-tuning: the model itself, for merging
        steps, reward = _curve(trainer.state.log_history, "reward")
        rewards[name] = (steps, reward)
        heldout[name] = tuple(zip(*curve.points, strict=True))
        runs[name] = {
            "advantage_estimator": estimator,
            "exact_match": em,
            "gain": round(em - before, 4),
            "heldout_curve": [list(p) for p in curve.points],
            "mean_reward_first_quarter": _mean(reward[: max(1, len(reward) // 4)]),
            "mean_reward_last_quarter": _mean(reward[-max(1, len(reward) // 4) :]),
            "guard_decisions": [[d.step, d.kind, d.action] for d in guard.decisions],
            "degenerate_run_findings": [[step, f.message] for step, f in degenerate.findings],
            "merged": ctx.path("grpo", name, "merged"),
        }
    plot = _plot(
        ctx.path("grpo", "reward_curves.png"),
        [
            ("GRPO from the SFT model", "mean exact-match reward", rewards, "linear", []),
            ("Held-out problems", "greedy exact match", heldout, "linear", []),
        ],
    )
    after = " / ".join(f"{k} {v['exact_match']:.3f}" for k, v in runs.items())
    return {
        "steps": s.grpo_steps,
        "exact_match_sft": before,
        "runs": runs,
        "plot": plot,
        "row": (
            f"GRPO (full fine-tuning), TRL default vs S-GRPO vs MaxRL, {s.grpo_steps} steps",
            "held-out exact match",
            f"{before:.3f}",
            after,
            ctx.path("grpo"),
        ),
    }


def _mean(values) -> float | None:
    return round(sum(values) / len(values), 4) if values else None


# ---- 3. merging ---------------------------------------------------------------------------------------------------
def merge(ctx) -> dict:
    """WSM (arXiv 2507.17634) over the S-GRPO checkpoints and a Fisher–Rao merge (arXiv 2603.04972) of S-GRPO and
    MaxRL, each with the streaming engine; then the merged folder is reloaded and generates."""
    from ..merging import merge as run_merge

    start = ctx.require("sft", "nll")
    sgrpo, maxrl = ctx.require("grpo", "s-grpo", "merged"), ctx.require("grpo", "maxrl", "merged")
    tokenizer = _load(start)[1]
    checkpoints = sorted(
        (d for d in os.listdir(ctx.path("grpo", "s-grpo")) if d.startswith("checkpoint-")),
        key=lambda d: int(d.split("-")[1]),
    )
    wsm_inputs = [ctx.path("grpo", "s-grpo", name) for name in checkpoints]  # full models, oldest first
    recipes = {
        "wsm": {
            "merge_method": "wsm",
            "models": [{"model": f} for f in wsm_inputs],
            "parameters": {"schedule": "1-sqrt"},
        },
        "fisher-rao": {
            "merge_method": "fisher_rao",
            "filter_exclude": ["*norm*"],
            "models": [
                {"model": sgrpo, "parameters": {"weight": 0.5}},
                {"model": maxrl, "parameters": {"weight": 0.5}},
            ],
        },
    }
    inputs = {"s-grpo": sgrpo, "maxrl": maxrl, f"s-grpo {checkpoints[-1]}": wsm_inputs[-1]}
    scores = {name: _exact_match(_load(folder)[0], tokenizer, ctx) for name, folder in inputs.items()}
    outputs = {}
    for name, recipe in recipes.items():
        out = ctx.path("merge", name)
        run_merge(recipe, out, progress=False, overwrite=True)
        model, tok = _load(out)  # what a user does with the folder: plain transformers
        scores[f"merge {name}"] = _exact_match(model, tok, ctx)
        outputs[name] = out
    model, tok = _load(outputs["fisher-rao"])
    samples = {}
    for row in list(ctx.test)[:3]:
        ids = tok(row["prompt"], add_special_tokens=False, return_tensors="pt")["input_ids"]
        new = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)[0, ids.shape[1] :]
        samples[row["prompt"]] = tok.decode(new, skip_special_tokens=True)
    best_input = max(scores[k] for k in inputs)
    return {
        "exact_match": scores,
        "wsm_inputs": len(wsm_inputs),
        "generated_by_fisher_rao_merge": samples,
        "outputs": outputs,
        "row": (
            f"WSM over {len(wsm_inputs)} S-GRPO checkpoints; Fisher-Rao of S-GRPO + MaxRL",
            "exact match (best input -> merges)",
            f"{best_input:.3f}",
            f"wsm {scores['merge wsm']:.3f} / fisher-rao {scores['merge fisher-rao']:.3f}",
            ctx.path("merge"),
        ),
    }


# ---- 4. unlearning ------------------------------------------------------------------------------------------------
def unlearn(ctx) -> dict:
    """SimNPO (arXiv 2410.07163) on TinyTOFU (reduced size): forget 20 of 80 memorised fictitious authors, keep the
    rest and facts never asked about; a short relearning attack shows how much comes back."""
    from ..evaluation.unlearning import evaluate_unlearning
    from ..testing.tinytofu import answer_prob, make_tinytofu, train_tinytofu
    from ..trainers.unlearning import UnlearningConfig, UnlearningTrainer

    data = make_tinytofu(0, reduced=True)
    # The reduced set's seed-0 authors "sa sel bru" and "sa sel sel" differ only in their last syllable; the tiny model
    # keeps confusing three of the first one's facts (forget accuracy 0.9625 after 50 and after 70 epochs), under the
    # 0.98 bar `train_tinytofu` warns about. The demo shows that accuracy in its "before" column and records
    # `tinytofu_model_accepted` in results.json, so the library's warning would only repeat it on a newcomer's screen.
    bar = _DropMessage("TinyTOFU %s seed %d not accepted")
    tinytofu_logger = logging.getLogger("hf_stable.testing.tinytofu")
    tinytofu_logger.addFilter(bar)
    try:
        model, info = train_tinytofu(data, "full", seed=0, max_extensions=1)  # trained once (~660 steps), then cached
    finally:
        tinytofu_logger.removeFilter(bar)
    hp0 = answer_prob(model, data.tokenizer, data.holdout_eval).mean().item()
    sets = dict(
        forget=data.forget_eval,
        retain=data.retain_eval,
        holdout=data.holdout_eval,
        world=data.world_eval,
        relearn=data.relearn,
        relearn_test=data.relearn_eval,
        start_holdout_prob=hp0,
        print_table=False,
    )
    before = evaluate_unlearning(model, data.tokenizer, **sets)
    out = ctx.path("unlearn")
    args = UnlearningConfig(
        output_dir=out,
        unlearn_method="simnpo",
        simnpo_beta=2.5,
        forget_weight=1.0,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        optim="adamw_torch",
        per_device_train_batch_size=16,
        max_steps=ctx.sizes.unlearn_steps,
        max_grad_norm=1.0,
        save_strategy="no",
        logging_steps=50,
        **COMMON,
    )
    trainer = _quiet(
        UnlearningTrainer(
            model=model,
            args=args,
            forget_dataset=data.forget,
            retain_dataset=data.retain,
            processing_class=data.tokenizer,
            holdout_dataset=data.holdout_eval,
        )
    )
    trainer.train()
    trainer.save_model(out)
    after = evaluate_unlearning(trainer.model, data.tokenizer, **sets)
    keys = ("forget_acc", "retain_acc", "world_acc", "over_forgetting", "relearn_acc")
    return {
        "method": "simnpo",
        "steps": args.max_steps,
        "tinytofu_model": "cached" if info.get("cached") else "trained",
        "tinytofu_model_accepted": info["accepted"],
        "tinytofu_model_accuracy": info["accuracy"],
        "before": {k: before[k] for k in keys},
        "after": {k: after[k] for k in keys},
        "row": (
            f"SimNPO on TinyTOFU, {args.max_steps} steps",
            "forget / retain accuracy",
            f"{before['forget_acc']:.3f} / {before['retain_acc']:.3f}",
            f"{after['forget_acc']:.3f} / {after['retain_acc']:.3f}",
            out,
        ),
    }


# ---- 5. stability -------------------------------------------------------------------------------------------------
def stability(ctx) -> dict:
    """One injected LR blow-up (×1000 for a single update) while fine-tuning the SFT model on fresh rows, with and
    without `StabilityGuardCallback`, next to a clean run: the guard skips, then rolls back to a confirmed snapshot;
    the unguarded run keeps the damage."""
    from ..callbacks import FaultInjectionCallback, StabilityGuardCallback
    from ..trainers.sft import StableSFTConfig, StableSFTTrainer

    start = ctx.require("sft", "nll")
    tokenizer = _load(start)[1]
    s = ctx.sizes
    fresh = ctx.fresh_rows  # rows GRPO did not use, none of them held out
    train = fresh.select(range(len(fresh) - min(len(fresh), 8 * s.guard_steps), len(fresh)))
    runs, curves = {}, {}
    guard_options = {"guard_snapshot_every": 10, "guard_min_history": min(20, s.spike_step - 5)}
    for name in ("clean", "unguarded", "guarded"):  # clean: no fault, the reference both should reach
        out = ctx.path("stability", name)
        args = StableSFTConfig(
            output_dir=out,
            max_steps=s.guard_steps,
            per_device_train_batch_size=8,
            learning_rate=2e-4,
            lr_scheduler_type="linear",
            max_grad_norm=1.0,
            logging_steps=1,
            max_length=32,
            save_strategy="no",
            stability_guard=name == "guarded",
            **(guard_options if name == "guarded" else {}),
            **COMMON,
        )
        trainer = _quiet(
            StableSFTTrainer(model=_load(start)[0], args=args, train_dataset=train, processing_class=tokenizer)
        )
        if name != "clean":
            FaultInjectionCallback.attach(trainer, kind="lr_scale", steps=[s.spike_step], factor=1000.0)
        guard = _callback(trainer, StabilityGuardCallback) if name == "guarded" else None
        trainer.train()
        losses = _curve(trainer.state.log_history, "loss")[1]
        runs[name] = {
            "exact_match": _exact_match(trainer.model, tokenizer, ctx),
            "final_loss_last5": _mean(losses[-5:]),
            "guard_decisions": []
            if guard is None
            else [[d.step, d.kind, d.action, d.restore_step] for d in guard.decisions],
        }
        curves[name] = _curve(trainer.state.log_history, "loss")
    plot = _plot(
        ctx.path("stability", "spike.png"),
        [(f"LR x1000 at step {s.spike_step}", "training loss", curves, "log", [s.spike_step])],
    )
    return {
        "spike": {"kind": "lr_scale", "factor": 1000.0, "step": s.spike_step},
        "runs": runs,
        "plot": plot,
        "row": (
            f"SFT with an injected LR spike at step {s.spike_step}, guard off vs on",
            "train loss, last 5 steps (unguarded -> guarded)",
            f"{runs['unguarded']['final_loss_last5']:.3f}",
            f"{runs['guarded']['final_loss_last5']:.3f} (clean run {runs['clean']['final_loss_last5']:.3f})",
            ctx.path("stability"),
        ),
    }


# ---- 6. push (dry run) ----------------------------------------------------------------------------------------------
def push(ctx) -> dict:
    """The Fisher–Rao merge as `hf-stable merge ... --push_to_hub ID --hub_dry_run` would push it: nothing is sent."""
    from ..hub_plan import plan_commit
    from ..merging.hub import upload_files

    folder = ctx.require("merge", "fisher-rao")
    plan = plan_commit(folder, ctx.repo_id, upload_files(folder))
    print(plan.render())
    return {
        "repo_id": plan.repo_id,
        "files": dict(plan.files),
        "total_bytes": plan.total_bytes,
        "token_scan": plan.token_scan,
        "row": (
            f"push dry run of the Fisher-Rao merge to {plan.repo_id}",
            "files / bytes planned",
            "-",
            f"{len(plan.files)} / {plan.total_bytes:,d}",
            folder,
        ),
    }


STAGES = {"sft": sft, "grpo": grpo, "merge": merge, "unlearn": unlearn, "stability": stability, "push": push}
