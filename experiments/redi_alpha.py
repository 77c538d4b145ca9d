"""E-A2 REDI negative weight: how the weight α of the negative term changes REDI's stage 2 (arXiv 2505.24850).

Claim (REDI, arXiv 2505.24850). REDI's stage-2 loss is `-ℓ̄(y⁺) + α·ℓ̄(y⁻)` with `ℓ̄` the length-normalised
log-likelihood. The negative term is unbounded below, so at α = c⁺ = 1 it drags the positives' log-likelihood down
with it (instability); α ∈ [0.5, 0.8] keeps the stage-1 accuracy; α = 0 is plain (length-normalised) continued SFT.

Design.
* Task: 2-digit addition with a written carry trace, one char per token (`hf_stable.testing` tiny Llama, hidden 64,
  2 layers, ~80k parameters). Prompt `47+85=`, completion `7+5=12,4+8+1=13:132`: one step per column, least
  significant first, `a+b(+carry_in)=` followed by the two-digit column sum (carry out, digit), then `:` and the
  three-digit answer. Operands are zero padded, so every completion has 19 characters (+ eos).
* Positives: correct traces. Two kinds of negatives, each a task of its own (same prompts, same stage-1 checkpoint):
  - `near` (the original task): the same prompt with ONE corrupted carry step: a uniformly chosen column writes the
    flipped carry out (`7+5=02`), the following steps are computed consistently from that wrong carry, so the
    answer is always wrong (`7+5=02,4+8+0=12:122`). Positive and negative share the prefix before the corruption,
    and after it the negative is mostly correct behaviour (copied operand digits, consistent sums).
  - `far` (added in the redesign): the complete trace of a different, uniformly drawn problem with another sum
    (`47+85=` → `3+9=12,1+6+1=08:082`): wrong operand copies, wrong sums and a wrong answer, so the negative is not
    a near-copy of the positive and REDI's push lands on wrong tokens.
* Split: the 10,000 problems are split once (split seed 1234, independent of the run seed) into 500 test prompts
  and a training pool. Per seed: stage-1 positives, stage-2 pairs (from the same pool, as REDI builds both stages
  from one prompt set) and the held-out pair set (test prompts, for log-prob trajectories) are drawn with that seed;
  the seed also sets the weight init and the data order.
* Stage 1: NLL SFT on positives from a random init (`StableSFTTrainer` with defaults = TRL's SFT), LR 3e-3, linear
  schedule, warmup 0.1, weight decay 1e-4 (the paper's recipe shape, LR scaled for a tiny model). The checkpoint is
  cached per seed and sizes under `experiments/cache/redi_alpha/`.
* Stage 2 from the stage-1 checkpoint: `sequence_objective="redi"`, `redi_pos_weight=1`, `redi_neg_weight=α` for
  α ∈ {0, 0.5, 0.8, 1.0}, pair data (`prompt`/`chosen`/`rejected`, default `redi_reduction="pair"`), LR = stage-1
  LR / 10 = 3e-4 (the paper's 10× smaller; fixed before the runs on seeds 0-2, see "LR decision" below), 1 epoch,
  linear, warmup 0.1, weight decay 1e-4, 8 pairs per step.
* Metrics: greedy exact match on the 500 test prompts, computed with `hf_stable.testing.evaluate_completions`
  against the FULL expected completion (trace + answer must both be right), after stage 1 and after each arm;
  mean per-token log-prob (completion + eos, the tokens REDI supervises) of positives and negatives of a fixed
  held-out pair set every few stage-2 steps (the trainer's own `stable/sft/redi_pos_logp`/`redi_neg_logp`, which are
  training-batch values, are stored too). Δ = value at the end of stage 2 − value at its start.
* Seeds 0, 1, 2; mean ± sample std (ddof 1) over seeds; criteria are evaluated on the seed means and the number of
  seeds where each one holds individually is reported alongside.
* LR decision: before running seeds 0-2, one pilot run on seed 100 (not reported) checked that the four arms are
  distinguishable at stage-2 LR 3e-4. They were (Δpos +0.02 / -0.20 / -0.44 / -2.0 for α = 0 / 0.5 / 0.8 / 1), so
  the 10× ratio was kept. The pilot also showed the α > 0 arms losing most of their accuracy (criterion (b)
  failing); nothing was changed in response, and nothing was changed after seeing seeds 0-2.
* Extra diagnostic (not a criterion): failed greedy test outputs counted by the role of their first wrong position
  (operand digit copied from the prompt, carry in, column sum, answer, format, eos).

Redesign (pre-registered here, before any `far` run): a review found the `near` negatives adversarial to REDI (2257
of 3461 failures start at `copy` positions: the length-normalised push on a near-copy lands mostly on correct
behaviour). The `far` task tests whether α ∈ [0.5, 0.8] keeps accuracy when the negatives are genuinely wrong. The
same three criteria are evaluated on each task; nothing else (sizes, LRs, α grid) changed.

Pass criteria (REDI's expectations; printed PASS/FAIL as measured), for each task (`near`, `far`):
  (a) α = 1.0 lowers the held-out positive log-prob more than α = 0.5 and α = 0.8: mean Δpos(1.0) < mean Δpos(0.5)
      and mean Δpos(1.0) < mean Δpos(0.8);
  (b) α ∈ {0.5, 0.8} keep accuracy: mean EM(α) ≥ mean stage-1 EM − 0.02, for each of the two;
  (c) α = 0 behaves like continued SFT: mean Δpos(0) ≥ 0.

Command (about 4 minutes on one core with a cold cache, 3 once stage 1 is cached):
    OMP_NUM_THREADS=1 .venv/bin/python experiments/redi_alpha.py
Quick smoke run (< 60 s, 1 seed, tiny sizes; its pass/fail means nothing):
    OMP_NUM_THREADS=1 .venv/bin/python experiments/redi_alpha.py --quick --out /tmp/redi_alpha_quick
"""

from __future__ import annotations

import json
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from _harness import declare, mean_std, run, save_figure, subplots
from testbeds import tiny_trl


NAME = "redi_alpha"
ALPHAS = (0.0, 0.5, 0.8, 1.0)
SPLIT_SEED = 1234
NUM_DIGITS = 2
EM_TOLERANCE = 0.02
POS_KEY, NEG_KEY = "stable/sft/redi_pos_logp", "stable/sft/redi_neg_logp"
TASKS = ("near", "far")
FAR_SEED_OFFSET = 7919


@dataclass(frozen=True)
class Sizes:
    num_test: int = 500  # test prompts for exact match (also the held-out pair prompts)
    num_heldout_pairs: int = 256  # fixed pair set of the log-prob trajectories
    stage1_examples: int = 6000
    stage1_epochs: int = 6
    stage1_batch: int = 64
    stage1_lr: float = 3e-3
    stage2_pairs: int = 4000
    stage2_batch: int = 16  # sequences per step = 8 pairs
    stage2_lr_ratio: float = 0.1  # stage-2 LR = ratio * stage-1 LR
    eval_every: int = 20  # stage-2 steps between held-out log-prob evaluations
    logging_steps: int = 10
    hidden_size: int = 64


QUICK = Sizes(
    num_test=100,
    num_heldout_pairs=64,
    stage1_examples=1000,
    stage1_epochs=8,
    stage2_pairs=200,
    eval_every=5,
    logging_steps=5,
)


# ---------------------------------------------------------------------------------------------------------------------
# task


def carry_trace(a: int, b: int, flip: int | None = None) -> str:
    """Written column addition of `a + b`, least significant column first; `flip` corrupts that column's carry out.

    `carry_trace(47, 85)` = `7+5=12,4+8+1=13:132`; `carry_trace(47, 85, flip=0)` = `7+5=02,4+8+0=12:122`.
    """
    da = [a // 10**i % 10 for i in range(NUM_DIGITS)]
    db = [b // 10**i % 10 for i in range(NUM_DIGITS)]
    carry, steps, digits = 0, [], []
    for i in range(NUM_DIGITS):
        total = da[i] + db[i] + carry
        carry_out, digit = total // 10, total % 10
        if flip == i:
            carry_out = 1 - carry_out
        lhs = f"{da[i]}+{db[i]}" + (f"+{carry}" if i else "")
        steps.append(f"{lhs}={carry_out}{digit}")
        digits.append(digit)
        carry = carry_out
    return ",".join(steps) + ":" + str(carry) + "".join(str(d) for d in reversed(digits))


def prompt_of(a: int, b: int) -> str:
    return f"{a:0{NUM_DIGITS}d}+{b:0{NUM_DIGITS}d}="


def split_problems(num_test: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(test, pool): a fixed split of all `NUM_DIGITS`-digit problems, independent of the run seed."""
    problems = [(a, b) for a in range(10**NUM_DIGITS) for b in range(10**NUM_DIGITS)]
    random.Random(SPLIT_SEED).shuffle(problems)
    return problems[:num_test], problems[num_test:]


def sft_rows(problems) -> list[dict]:
    """Positives as `prompt`/`completion`; `answer` is the full expected completion (trace + answer)."""
    return [
        {"prompt": prompt_of(a, b), "completion": carry_trace(a, b), "answer": carry_trace(a, b)} for a, b in problems
    ]


def far_negative(a: int, b: int, rng: random.Random) -> str:
    """The trace of a uniformly drawn other problem whose sum differs from `a + b`."""
    while True:
        a2, b2 = rng.randrange(10**NUM_DIGITS), rng.randrange(10**NUM_DIGITS)
        if a2 + b2 != a + b:
            return carry_trace(a2, b2)


def pair_rows(problems, rng: random.Random, kind: str = "near") -> list[dict]:
    """REDI pairs: `chosen` = correct trace, `rejected` = one corrupted carry step (`near`) or the trace of another
    problem (`far`); the answer is wrong either way."""
    rows = []
    for a, b in problems:
        rejected = carry_trace(a, b, flip=rng.randrange(NUM_DIGITS)) if kind == "near" else far_negative(a, b, rng)
        assert rejected != carry_trace(a, b) and rejected[-NUM_DIGITS - 1 :] != str(a + b).zfill(NUM_DIGITS + 1)
        rows.append({"prompt": prompt_of(a, b), "chosen": carry_trace(a, b), "rejected": rejected})
    return rows


def seed_data(seed: int, sizes: Sizes) -> dict:
    """Per-seed datasets: stage-1 positives, stage-2 pairs, test set and held-out pairs."""
    from datasets import Dataset

    test, pool = split_problems(sizes.num_test)
    rng = random.Random(seed)
    stage1 = rng.sample(pool, sizes.stage1_examples)
    stage2 = rng.sample(pool, sizes.stage2_pairs)
    heldout = rng.sample(test, sizes.num_heldout_pairs)
    near = {"stage2": Dataset.from_list(pair_rows(stage2, rng)), "heldout_pairs": pair_rows(heldout, rng)}
    far_rng = random.Random(FAR_SEED_OFFSET + seed)  # a stream of its own: the `near` data stay as they were
    far = {
        "stage2": Dataset.from_list(pair_rows(stage2, far_rng, "far")),
        "heldout_pairs": pair_rows(heldout, far_rng, "far"),
    }
    return {
        "stage1": Dataset.from_list(sft_rows(stage1)),
        "test": Dataset.from_list(sft_rows(test)),
        "tasks": {"near": near, "far": far},
    }


# ---------------------------------------------------------------------------------------------------------------------
# measurements


@torch.no_grad()
def completion_logp(model, tokenizer, prompts: list[str], completions: list[str]) -> float:
    """Mean over sequences of the per-token log-prob of completion + eos given the prompt (REDI's `ℓ̄`)."""
    was_training = model.training
    model.eval()
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    encode = lambda texts: tokenizer(texts, add_special_tokens=False)["input_ids"]  # noqa: E731
    prompt_ids, target_ids = encode(prompts), [[*t, eos] for t in encode(completions)]
    seqs = [p + t for p, t in zip(prompt_ids, target_ids, strict=True)]
    width = max(map(len, seqs))
    ids = torch.tensor([s + [pad] * (width - len(s)) for s in seqs])
    attn = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    logp = torch.log_softmax(model(input_ids=ids, attention_mask=attn).logits.float(), dim=-1)
    token_logp = logp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    mask = torch.zeros_like(token_logp, dtype=torch.bool)
    for row, (p, t) in enumerate(zip(prompt_ids, target_ids, strict=True)):
        mask[row, len(p) - 1 : len(p) + len(t) - 1] = True
    per_seq = (token_logp * mask).sum(-1) / mask.sum(-1)
    model.train(was_training)
    return per_seq.mean().item()


def pair_logps(model, tokenizer, pairs: list[dict]) -> tuple[float, float]:
    prompts = [p["prompt"] for p in pairs]
    return (
        completion_logp(model, tokenizer, prompts, [p["chosen"] for p in pairs]),
        completion_logp(model, tokenizer, prompts, [p["rejected"] for p in pairs]),
    )


def exact_match(model, tokenizer, test) -> dict:
    from hf_stable.testing import evaluate_completions

    return evaluate_completions(model, tokenizer, test, batch_size=250, max_new_tokens=len(test[0]["answer"]) + 2)


def position_roles() -> list[str]:
    """Role of each completion position (+ eos), mirroring `carry_trace`: `copy` (an operand digit copied from the
    prompt), `carry_in`, `sum` (the two-digit column sum), `answer`, `format` (`+ = , :`) and `eos`."""
    roles = []
    for i in range(NUM_DIGITS):
        roles += ["copy", "format", "copy"] + (["format", "carry_in"] if i else [])
        roles += ["format", "sum", "sum"] + (["format"] if i < NUM_DIGITS - 1 else [])
    roles += ["format", *["answer"] * (NUM_DIGITS + 1), "eos"]
    assert len(roles) == len(carry_trace(0, 0)) + 1
    return roles


@torch.no_grad()
def first_error_roles(model, tokenizer, test) -> dict[str, int]:
    """Greedy outputs that differ from the expected completion, counted by the role of their first wrong position."""
    prompts = tokenizer(list(test["prompt"]), add_special_tokens=False, return_tensors="pt")  # all the same length
    out = model.generate(
        **prompts,
        max_new_tokens=len(test[0]["answer"]) + 2,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    texts = tokenizer.batch_decode(out[:, prompts["input_ids"].shape[1] :], skip_special_tokens=True)
    roles, counts = position_roles(), dict.fromkeys(["copy", "carry_in", "sum", "answer", "format", "eos"], 0)
    for text, answer in zip(texts, test["answer"], strict=True):
        if text != answer:
            first = next((i for i, (x, y) in enumerate(zip(text, answer, strict=False)) if x != y), None)
            counts[roles[min(len(text), len(answer))] if first is None else roles[first]] += 1
    return counts


def make_trajectory_callback(tokenizer, pairs: list[dict], every: int):
    """A callback recording the held-out pair log-probs at step 0, every `every` steps and at the end."""

    def measure(step: int, model) -> dict:
        pos, neg = pair_logps(model, tokenizer, pairs)
        return {"pos": pos, "neg": neg}

    return tiny_trl.curve_callback(measure, every)


# ---------------------------------------------------------------------------------------------------------------------
# training


def make_trainer(model, tokenizer, args, dataset, callbacks=()):
    """A `StableSFTTrainer` that does not print its log dicts (they are kept in `state.log_history`)."""
    from transformers import PrinterCallback

    from hf_stable import StableSFTTrainer

    trainer = StableSFTTrainer(
        model=model, args=args, train_dataset=dataset, processing_class=tokenizer, callbacks=list(callbacks)
    )
    trainer.remove_callback(PrinterCallback)
    return trainer


def train_config(output_dir: str, seed: int, lr: float, batch: int, epochs: int, logging_steps: int, **extra):
    return tiny_trl.linear_sft_config(output_dir, seed, lr, batch, epochs, logging_steps, max_length=64, **extra)


def stage1_cache_dir(seed: int, sizes: Sizes) -> Path:
    fields = {k: v for k, v in asdict(sizes).items() if k.startswith("stage1") or k in ("hidden_size", "num_test")}
    return tiny_trl.cache_dir(NAME, "stage1", seed, {**fields, "digits": NUM_DIGITS, "split": SPLIT_SEED})


def run_stage1(seed: int, sizes: Sizes, data: dict) -> Path:
    """Trains (or reuses the cached) stage-1 NLL SFT checkpoint of `seed`."""
    path = stage1_cache_dir(seed, sizes)
    if tiny_trl.cached(path, seed, "stage 1"):
        return path
    start = time.time()
    model, tokenizer = tiny_trl.tiny_llama(seed, sizes.hidden_size, max_position_embeddings=64)
    with tempfile.TemporaryDirectory() as tmp:
        args = train_config(tmp, seed, sizes.stage1_lr, sizes.stage1_batch, sizes.stage1_epochs, 50)
        trainer = make_trainer(model, tokenizer, args, data["stage1"])
        trainer.train()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    (path / "done.json").write_text(json.dumps({"steps": trainer.state.global_step, "seconds": time.time() - start}))
    print(f"[seed {seed}] stage 1: {trainer.state.global_step} steps in {time.time() - start:.0f}s", flush=True)
    return path


def load_checkpoint(path: Path):
    from transformers import AutoModelForCausalLM

    from hf_stable.testing import build_tiny_tokenizer

    return AutoModelForCausalLM.from_pretrained(path), build_tiny_tokenizer()


def train_log_trajectory(log_history: list[dict]) -> list[dict]:
    return [{"step": h["step"], "pos": h[POS_KEY], "neg": h[NEG_KEY]} for h in log_history if POS_KEY in h]


def run_stage2(seed: int, alpha: float, sizes: Sizes, data: dict, stage1_path: Path, task: dict) -> dict:
    """One REDI arm from the stage-1 checkpoint: exact match, held-out and training-batch log-prob trajectories."""
    start = time.time()
    model, tokenizer = load_checkpoint(stage1_path)
    callback = make_trajectory_callback(tokenizer, task["heldout_pairs"], sizes.eval_every)
    with tempfile.TemporaryDirectory() as tmp:
        args = train_config(
            tmp,
            seed,
            sizes.stage1_lr * sizes.stage2_lr_ratio,
            sizes.stage2_batch,
            1,
            sizes.logging_steps,
            sequence_objective="redi",
            redi_pos_weight=1.0,
            redi_neg_weight=alpha,
        )
        trainer = make_trainer(model, tokenizer, args, task["stage2"], [callback])
        trainer.train()
    em = exact_match(model, tokenizer, data["test"])
    first, last = callback.points[0], callback.points[-1]
    result = {
        "exact_match": em["exact_match"],
        "mean_p": em["mean_p"],
        "first_error_roles": first_error_roles(model, tokenizer, data["test"]),
        "pos_start": first["pos"],
        "pos_end": last["pos"],
        "neg_start": first["neg"],
        "neg_end": last["neg"],
        "d_pos": last["pos"] - first["pos"],
        "d_neg": last["neg"] - first["neg"],
        "steps": trainer.state.global_step,
        "seconds": time.time() - start,
        "heldout_trajectory": callback.points,
        "train_log_trajectory": train_log_trajectory(trainer.state.log_history),
    }
    print(
        f"[seed {seed}] α={alpha:.1f}: EM {result['exact_match']:.3f}  Δpos {result['d_pos']:+.3f}  "
        f"Δneg {result['d_neg']:+.3f}  ({result['steps']} steps, {result['seconds']:.0f}s)",
        flush=True,
    )
    return result


def run_seed(seed: int, sizes: Sizes) -> dict:
    data = seed_data(seed, sizes)
    path = run_stage1(seed, sizes, data)
    model, tokenizer = load_checkpoint(path)
    em = exact_match(model, tokenizer, data["test"])
    errors = first_error_roles(model, tokenizer, data["test"])
    out = {
        "stage1": {"exact_match": em["exact_match"], "mean_p": em["mean_p"], "first_error_roles": errors},
        "tasks": {},
    }
    for kind, task in data["tasks"].items():
        pos, neg = pair_logps(model, tokenizer, task["heldout_pairs"])
        print(f"[seed {seed}] {kind}: stage 1 EM {em['exact_match']:.3f}  pos {pos:.3f}  neg {neg:.3f}", flush=True)
        arms = {str(alpha): run_stage2(seed, alpha, sizes, data, path, task) for alpha in ALPHAS}
        out["tasks"][kind] = {
            "stage1": {"exact_match": em["exact_match"], "pos": pos, "neg": neg, "first_error_roles": errors},
            "arms": arms,
            "negative_example": task["heldout_pairs"][0],
        }
    return out


# ---------------------------------------------------------------------------------------------------------------------
# aggregation, criteria, outputs


def summed(counts: list[dict[str, int]]) -> dict[str, int]:
    return {k: sum(c[k] for c in counts) for k in counts[0]}


def aggregate(per_seed: dict, sizes: Sizes | None = None) -> dict:
    """Per task (`near`, `far`): the single-task aggregate below."""
    return {"tasks": {kind: aggregate_task({s: r["tasks"][kind] for s, r in per_seed.items()}) for kind in TASKS}}


def aggregate_task(per_seed: dict) -> dict:
    seeds = list(per_seed)
    stage1 = [per_seed[s]["stage1"] for s in seeds]
    out = {
        "stage1_exact_match": mean_std([r["exact_match"] for r in stage1]),
        "stage1_pos": mean_std([r["pos"] for r in stage1]),
        "stage1_neg": mean_std([r["neg"] for r in stage1]),
        "stage1_first_error_roles": summed([r["first_error_roles"] for r in stage1]),
        "arms": {},
    }
    for alpha in map(str, ALPHAS):
        arms = [per_seed[s]["arms"][alpha] for s in seeds]
        out["arms"][alpha] = {
            k: mean_std([a[k] for a in arms]) for k in ("exact_match", "d_pos", "d_neg", "pos_end", "neg_end")
        }
        out["arms"][alpha]["first_error_roles"] = summed([a["first_error_roles"] for a in arms])
        out["arms"][alpha]["heldout_trajectory"] = mean_trajectory([a["heldout_trajectory"] for a in arms])
    return out


def mean_trajectory(trajectories: list[list[dict]]) -> dict:
    """Seed mean and std at each recorded step (every seed records the same steps)."""
    steps = [p["step"] for p in trajectories[0]]
    out = {"step": steps}
    for key in ("pos", "neg"):
        columns = [[t[i][key] for t in trajectories] for i in range(len(steps))]
        out[f"{key}_mean"] = [statistics.fmean(c) for c in columns]
        out[f"{key}_std"] = [statistics.stdev(c) if len(c) > 1 else 0.0 for c in columns]
    return out


def criteria(per_seed: dict, agg: dict, sizes: Sizes | None = None) -> dict:
    """The three criteria on each task, keyed `a_near`, ..., `c_far`."""
    out = {}
    for kind in TASKS:
        task_seeds = {s: r["tasks"][kind] for s, r in per_seed.items()}
        for name, check in task_criteria(task_seeds, agg["tasks"][kind]).items():
            out[f"{name}_{kind}"] = {**check, "criterion": f"{kind} negatives: {check['criterion']}"}
    return out


def task_criteria(per_seed: dict, agg: dict) -> dict:
    arms, seeds = agg["arms"], list(per_seed)
    d_pos = {a: arms[a]["d_pos"]["mean"] for a in arms}
    stage1 = agg["stage1_exact_match"]["mean"]

    def count(rule) -> str:
        return f"{sum(rule(per_seed[s]) for s in seeds)}/{len(seeds)} seeds"

    def seed_a(r):
        return all(r["arms"]["1.0"]["d_pos"] < r["arms"][a]["d_pos"] for a in ("0.5", "0.8"))

    def seed_b(r):
        return all(r["arms"][a]["exact_match"] >= r["stage1"]["exact_match"] - EM_TOLERANCE for a in ("0.5", "0.8"))

    return {
        "a": {
            "criterion": "mean Δpos(α=1.0) < mean Δpos(α=0.5) and < mean Δpos(α=0.8)",
            "values": {a: d_pos[a] for a in ("0.5", "0.8", "1.0")},
            "passed": d_pos["1.0"] < d_pos["0.5"] and d_pos["1.0"] < d_pos["0.8"],
            "per_seed": count(seed_a),
        },
        "b": {
            "criterion": f"mean EM(α) ≥ mean stage-1 EM − {EM_TOLERANCE} for α ∈ {{0.5, 0.8}}",
            "values": {"stage1": stage1, **{a: arms[a]["exact_match"]["mean"] for a in ("0.5", "0.8")}},
            "passed": all(arms[a]["exact_match"]["mean"] >= stage1 - EM_TOLERANCE for a in ("0.5", "0.8")),
            "per_seed": count(seed_b),
        },
        "c": {
            "criterion": "mean Δpos(α=0) ≥ 0 (continued SFT does not lower the positives)",
            "values": {"0.0": d_pos["0.0"]},
            "passed": d_pos["0.0"] >= 0,
            "per_seed": count(lambda r: r["arms"]["0.0"]["d_pos"] >= 0),
        },
    }


def plot(result: dict, path: Path) -> None:
    fig, rows = subplots(len(TASKS), 3, figsize=(15, 4.2 * len(TASKS)))
    for kind, axes in zip(TASKS, rows, strict=True):
        plot_task(result["aggregate"]["tasks"][kind], axes, kind)
    fig.suptitle("E-A2: REDI stage 2 from an SFT checkpoint, negative weight α (mean ± std over seeds)")
    save_figure(fig, path)


def plot_task(agg: dict, axes, kind: str) -> None:
    colors = dict(zip(map(str, ALPHAS), ("tab:blue", "tab:green", "tab:orange", "tab:red"), strict=True))
    for ax, key, title in ((axes[0], "pos", "held-out positives"), (axes[1], "neg", "held-out negatives")):
        for alpha, arm in agg["arms"].items():
            t = arm["heldout_trajectory"]
            mean, std = t[f"{key}_mean"], t[f"{key}_std"]
            ax.plot(t["step"], mean, color=colors[alpha], label=f"α = {alpha}")
            ax.fill_between(
                t["step"],
                [m - s for m, s in zip(mean, std, strict=True)],
                [m + s for m, s in zip(mean, std, strict=True)],
                color=colors[alpha],
                alpha=0.2,
            )
        ax.set(title=f"{kind}: {title}, mean per-token log p", xlabel="stage-2 step", ylabel="log p (nats/token)")
        ax.legend()
    alphas = list(agg["arms"])
    ems = [agg["arms"][a]["exact_match"] for a in alphas]
    axes[2].bar(
        alphas, [e["mean"] for e in ems], yerr=[e["std"] for e in ems], capsize=4, color=[colors[a] for a in alphas]
    )
    stage1 = agg["stage1_exact_match"]
    axes[2].axhline(stage1["mean"], color="black", linestyle="--", label=f"stage 1 ({stage1['mean']:.3f})")
    axes[2].axhline(stage1["mean"] - EM_TOLERANCE, color="gray", linestyle=":", label="stage 1 − 0.02")
    low = min(min(e["mean"] - e["std"] for e in ems), stage1["mean"] - EM_TOLERANCE)
    axes[2].set(
        title=f"{kind}: held-out exact match after stage 2",
        xlabel="α (redi_neg_weight)",
        ylabel="exact match",
        ylim=(max(0.0, low - 0.05), 1.0),
    )
    axes[2].legend(loc="upper right")


def interpretation(agg: dict, checks: dict, kind: str) -> str:
    """2-4 sentences generated from the measured numbers (so a rerun cannot leave a stale interpretation)."""
    arms = agg["arms"]
    d = {a: arms[a]["d_pos"]["mean"] for a in arms}
    em = ", ".join(f"{arms[a]['exact_match']['mean']:.3f}" for a in arms)
    text = [
        f"Over stage 2 the held-out positive log-prob changed by {d['1.0']:+.3f} nats/token at α = 1.0, "
        f"{d['0.8']:+.3f} at α = 0.8, {d['0.5']:+.3f} at α = 0.5 and {d['0.0']:+.3f} at α = 0 (continued SFT), "
        f"while the negatives' log-prob moved by {arms['1.0']['d_neg']['mean']:+.3f} at α = 1.0.",
        f"Exact match went from {agg['stage1_exact_match']['mean']:.3f} after stage 1 to {em} for α = "
        + ", ".join(arms)
        + ".",
    ]
    errors = summed([arms[a]["first_error_roles"] for a in arms if a != "0.0"])
    total, baseline = sum(errors.values()), sum(arms["0.0"]["first_error_roles"].values())
    if total:
        role, count = max(errors.items(), key=lambda kv: kv[1])
        text.append(
            f"The α > 0 arms fail on {total} greedy test outputs in all (α = 0: {baseline}), most first "
            f"going wrong at a `{role}` position ({count}/{total}); `copy` positions are operand digits "
            "copied from the prompt"
            + (", which every near negative also contains after its corrupted step." if kind == "near" else ".")
        )
    if not checks[f"b_{kind}"]["passed"]:
        text.append(
            "REDI's safe window α ∈ [0.5, 0.8] did not hold here; a likely reason (not tested by "
            f"this script) is that stage 1 leaves the positives nearly saturated (held-out log p "
            f"{agg['stage1_pos']['mean']:.3f} nats/token), so the positive term's gradient is small and the negative "
            "term dominates the Adam-normalised stage-2 updates."
        )
    return " ".join(text)


def markdown(result: dict) -> str:
    agg, checks, cfg = result["aggregate"], result["criteria"], result["config"]

    def fmt(ms, digits=3, sign=False):
        return f"{ms['mean']:{'+' if sign else ''}.{digits}f} ± {ms['std']:.{digits}f}"

    lines = [
        f"Mean ± std over seeds. Stage 1: NLL SFT, LR {cfg['stage1_lr']:g}; stage 2: REDI, LR {cfg['stage2_lr']:g}, 1 "
        f"epoch over {cfg['sizes']['stage2_pairs']} pairs. Exact match = greedy full trace + answer on "
        f"{cfg['sizes']['num_test']} test prompts; Δ = held-out mean per-token log-prob at the end of stage 2 minus "
        f"its start. Negatives: `near` = one corrupted carry step (`{cfg['near_negative_example']}`), `far` = the "
        f"trace of another problem (`{cfg['far_negative_example']}`), for `47+85=` → `{cfg['trace_example']}`.",
    ]
    for kind in TASKS:
        task = agg["tasks"][kind]
        lines += [
            "",
            f"## {kind} negatives",
            "",
            f"Stage-1 exact match: {fmt(task['stage1_exact_match'])}; held-out log p of the negatives after stage 1: "
            f"{fmt(task['stage1_neg'])}.",
            "",
            "| α | exact match | Δ log p positives | Δ log p negatives | log p positives (end) | log p negatives "
            "(end) |",
            "|---|---|---|---|---|---|",
        ]
        for alpha, arm in task["arms"].items():
            lines.append(
                f"| {alpha} | {fmt(arm['exact_match'])} | {fmt(arm['d_pos'], sign=True)} | "
                f"{fmt(arm['d_neg'], sign=True)} | {fmt(arm['pos_end'])} | {fmt(arm['neg_end'])} |"
            )
        roles = list(task["stage1_first_error_roles"])
        lines += [
            "",
            "Failed greedy test outputs (summed over seeds) by the role of their first wrong position:",
            "",
            "| model | " + " | ".join(roles) + " |",
            "|---" * (len(roles) + 1) + "|",
            "| stage 1 | " + " | ".join(str(task["stage1_first_error_roles"][r]) for r in roles) + " |",
        ]
        lines += [
            f"| α = {a} | " + " | ".join(str(arm["first_error_roles"][r]) for r in roles) + " |"
            for a, arm in task["arms"].items()
        ]
        lines += ["", interpretation(task, checks, kind)]
    return "\n".join(lines)


EXPERIMENT = declare(
    globals(),
    title="E-A2: REDI negative weight α",
    claim="REDI's asymmetric negative weight α < 1 keeps stage 2 stable while α = 1 drags the positives down; tested "
    "with near-copy negatives (one corrupted carry step) and with negatives from other problems (arXiv 2505.24850).",
    config={
        "alphas": list(ALPHAS),
        "tasks": list(TASKS),
        "stage1_lr": Sizes().stage1_lr,
        "stage2_lr": Sizes().stage1_lr * Sizes().stage2_lr_ratio,
        "num_digits": NUM_DIGITS,
        "split_seed": SPLIT_SEED,
        "far_seed_offset": FAR_SEED_OFFSET,
        "trace_example": carry_trace(47, 85),
        "near_negative_example": carry_trace(47, 85, flip=0),
        "far_negative_example": carry_trace(31, 96),
        "redi_pos_weight": 1.0,
        "redi_reduction": "pair",
        "em_tolerance": EM_TOLERANCE,
    },
)


if __name__ == "__main__":
    run(EXPERIMENT)
