"""E-B3 TFB calibration: training-free Bayesianisation of an overconfident LoRA (arXiv 2412.05723).

Claim (TFB, arXiv 2412.05723). Searching the largest isotropic low-rank noise σ* whose predictions flip
at most 1 % of the anchor (training) predictions, then averaging N = 10 sampled softmaxes, improves the calibration
of a LoRA fine-tuned to overconfidence (lower ECE and NLL than the deterministic LoRA) at the same accuracy (within
≈ 1 point); σ* grows with the budget; the sampled predictive entropy is higher on shifted inputs.

Design.
* K-way classifier (K = 10): tiny Llama (`hf_stable.testing.build_tiny_model`, hidden 64, 2 layers, ~90k parameters,
  one token per character). Prompt `47+85=` (two zero-padded 2-digit operands); the answer is ONE digit token, the
  class `(a + b) // 20` (here 6; classes 0-9). It is ordinal (each operand carries marginal information, so a LoRA
  learns it from the answer token alone) but its class boundaries depend on the units digits, so a small training set
  does not pin it down: the LoRA's held-out accuracy sits well below its training accuracy.
* Splits: the 10,000 2-digit problems are split once (split seed 1234, independent of the run seed) into 1000
  held-out problems and a 9000-problem pool. Shifted split ("longer operands"): the same 1000 held-out problems with
  the operands zero padded to 3 digits (`047+085=`, same values, same answers); no model saw 3-digit operands, and
  the operand digits sit one or two positions further from `=`.
* Base ("brief pretraining", per seed, cached under `experiments/cache/adapters_tfb_calibration/`): full training of
  the random-init model on all pool problems as addition with the sum reversed (`47+85=231`, the zero-padded sum
  least significant digit first; loss on the 3 answer tokens), 2000 steps of 64, AdamW LR 3e-3, linear schedule,
  warmup 0.1, weight decay 1e-4, gradient clipping 1. The base adds, it never saw the classification task.
* LoRA (PEFT `LoraConfig`, r = 8, α = 16, dropout 0, on q/k/v/o/gate/up/down of both layers, 16k parameters):
  `train_size` = 256 pool problems drawn with the run seed, 250 epochs (2000 steps of 32), AdamW LR 3e-3, no weight
  decay, linear schedule, warmup 0.1: many epochs on a small set, so training accuracy reaches 1 at ≈ 0.99
  confidence (overconfident). Loss: full-vocabulary cross-entropy of the answer token given the prompt (a plain
  torch loop, the same as completion-only SFT of a one-token completion). The adapter is cached.
* TFB (`hf_stable.adapters.tfb_bayesianize`, defaults unless stated): metric "flip", noise "flipout_token" (the
  reference's), n_samples 10, `iters` 10, σ_hi automatic, CRN seed = the run seed. Anchor set: the 256 training
  prompts (the LoRA's whole training set, a subset of the training distribution), each followed by a placeholder
  token (`<pad>`) whose `labels` entry only marks the answer position; gold answers are never given (the criterion
  uses the deterministic argmax as pseudo-label). One flip is 0.39 % of the anchors. σ* is searched for budgets
  {0.5 %, 1 %, 2 %, 5 %} (one search each, on the same model); the 1 % model is "TFB" in the criteria. Extra row
  (not a criterion): noise "weight_per_sequence" at 1 %.
* Evaluation: `predict_bayes(model, batch, n_samples=10)` (the mean of 10 sampled full-vocabulary softmaxes; global
  RNG seeded per evaluation) vs the deterministic LoRA's softmax, at the answer position. K-way restriction (our
  choice): the predictive's mass on the 10 digit tokens is renormalised to sum to 1 (the non-digit mass is reported;
  it is ≤ 0.01 on seeds 0 and 2, 0.03 on seed 1); accuracy = argmax over the digits; NLL = −log p(gold digit);
  top-label ECE with 15 equal-width confidence bins; entropy of the renormalised 10-way distribution (nats). On the
  held-out split (same distribution) and the shifted split. Training accuracy and confidence of the deterministic
  LoRA are reported.
* Seeds 0, 1, 2 (base init and data order, training subset, LoRA init and order, TFB search and sampling); mean ±
  sample std (ddof 1); each criterion is evaluated on the seed means, and the number of seeds where it holds
  individually is reported.
* Pilot (seed 100 only, not reported, before any run on seeds 0-2; the criteria below were fixed before the pilot).
  The task and recipe were chosen on deterministic metrics only; TFB was not run until they were fixed.
  1. First design: class = tens digit of the sum `(a + b) // 10 mod 10`, base trained on the units digit from the
     answer token alone (1500 steps). The base never left the uniform plateau (loss ln 10, units accuracy 0.094; an
     XOR-like target: no single operand digit carries information), nor did the LoRA (train accuracy 0.148).
  2. Base switched to reversed-sum addition with loss on every answer digit (2000 steps: held-out exact match
     1.000). The tens-digit LoRA still did not learn (256 problems, 80 epochs: LR 3e-3 train 0.40 / held-out 0.15;
     LR 1e-2 and 3e-2 on 512 problems: collapse to uniform).
  3. Class switched to `(a + b) // 20` (operands carry marginal information). 80 epochs, LR 3e-3, 512 problems:
     train 0.957 / held-out 0.830 (not yet overconfident); LR 1e-2 unstable (512 × 100 epochs: train 0.705; 256 ×
     150: 0.953 / 0.763); LR 5e-3, 512 × 150 epochs: train 1.000 / held-out 0.910 at confidence 0.944 (ECE 0.034,
     mildly overconfident); LR 3e-3, 256 × 250 epochs: train 1.000 (confidence 0.992) / held-out 0.751 at confidence
     0.901 (ECE 0.154), shifted accuracy 0.170 at confidence 0.889. Rule written into this docstring before the pilot
     began: "the smallest training set in {256, 512, 1024} with training accuracy ≥ 0.99 and held-out accuracy ≥
     0.6" (an overconfident but non-trivial regime; epochs and LR only had to reach the training accuracy): 256
     problems, 250 epochs, LR 3e-3 were kept.
  4. The final script on seed 100, deterministic LoRA only (a pilot flag since retired with the harness port):
     train 1.000 (confidence 0.988), held-out 0.845 (confidence 0.927, ECE 0.093), shifted 0.062 (confidence
     0.947). Then one full run on seed 100 checked
     the run time (TFB part ≈ 60 s per seed); its TFB numbers (1 %: σ* 0.038, held-out ECE 0.093 → 0.076, NLL 0.545
     → 0.485, accuracy −0.009; entropy +0.33 held-out, +0.62 shifted) were seen, and nothing was changed in
     response. Nothing was changed after seeing seeds 0-2.
* Post-hoc diagnostics, added after the seed 0-2 run and outside the criteria (the pre-registered numbers reproduced
  exactly with warm caches): a per-seed table, and the criteria recomputed on the seeds where the premise holds
  (deterministic held-out confidence > accuracy). Added because seed 1's base stayed on its pretraining plateau
  (addition exact match 0.012 after the fixed 2000 steps) and its LoRA came out underconfident; that seed is kept in
  the pre-registered result as is.

Pass criteria (pre-registered before the seed 0-2 run; TFB = flipout_token at budget 1 %, N = 10; printed
PASS/FAIL as measured):
  (1) calibration: on the held-out split, mean ECE(TFB) < mean ECE(deterministic) and mean NLL(TFB) < mean
      NLL(deterministic);
  (2) accuracy: |mean acc(TFB) − mean acc(deterministic)| ≤ 0.01 on the held-out split;
  (3) σ* non-decreasing in the budget: mean σ*(0.5 %) ≤ σ*(1 %) ≤ σ*(2 %) ≤ σ*(5 %) (values equal to a relative
      1e-6, i.e. float rounding, count as equal);
  (4) shift: mean predictive entropy of TFB higher on the shifted split than on the held-out split, and the entropy
      increase H(TFB) − H(deterministic) larger on the shifted split than on the held-out split.

Command (301 s wall on one shared core with a cold cache, i.e. including the three bases and LoRAs; wall time of the
committed run in the Markdown output):
    OMP_NUM_THREADS=1 .venv/bin/python experiments/adapters_tfb_calibration.py
Quick smoke run (< 60 s, 1 seed, tiny sizes; its pass/fail means nothing):
    OMP_NUM_THREADS=1 .venv/bin/python experiments/adapters_tfb_calibration.py --quick --out /tmp/tfb_quick
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import random
import statistics
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from _harness import declare, fmt, mean_std, save_figure, subplots
from _harness import run as run_experiment


NAME = "adapters_tfb_calibration"
ROOT = Path(__file__).resolve().parent
CACHE = ROOT / "cache" / NAME
SPLIT_SEED = 1234
BUCKET = 20
EVAL_SEED = 777  # offset of the global-RNG seed of every predict_bayes evaluation
DIGITS = "0123456789"
BUDGETS = (0.005, 0.01, 0.02, 0.05)
MAIN_BUDGET = 0.01
MAIN_NOISE = "flipout_token"
EXTRA_NOISE = "weight_per_sequence"
N_SAMPLES = 10
ECE_BINS = 15
ACC_TOLERANCE = 0.01
SIGMA_RTOL = 1e-6  # σ* values equal up to float rounding count as non-decreasing
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SPLITS = ("heldout", "shifted")


@dataclass(frozen=True)
class Sizes:
    num_heldout: int = 1000
    num_shifted: int = 1000
    train_size: int = 256  # pilot decision (see the module docstring)
    anchor_size: int = 256
    base_steps: int = 2000
    base_batch: int = 64
    base_lr: float = 3e-3
    lora_epochs: int = 250
    lora_batch: int = 32
    lora_lr: float = 3e-3
    lora_r: int = 8
    lora_alpha: int = 16
    search_iters: int = 10
    hidden_size: int = 64


QUICK = Sizes(
    num_heldout=200, num_shifted=200, train_size=128, anchor_size=128, base_steps=150, lora_epochs=8, search_iters=4
)


# ---------------------------------------------------------------------------------------------------------------------
# task


def bucket(a: int, b: int) -> int:
    """The class: `(a + b) // 20`, 0-9 for operands in [0, 99] (`47+85` → 6)."""
    return (a + b) // BUCKET


def reversed_sum(a: int, b: int) -> str:
    """The base's pretraining completion: the zero-padded 3-digit sum, least significant digit first (132 → 231)."""
    return f"{a + b:03d}"[::-1]


def prompt_of(a: int, b: int, digits: int) -> str:
    return f"{a:0{digits}d}+{b:0{digits}d}="


def split_problems(num_heldout: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(held-out, pool): a fixed split of the 2-digit problems, independent of the run seed."""
    problems = [(a, b) for a in range(100) for b in range(100)]
    random.Random(SPLIT_SEED).shuffle(problems)
    return problems[:num_heldout], problems[num_heldout:]


def encode(tokenizer, problems, digits: int, completion) -> torch.Tensor:
    """`(N, T)` token ids of prompt + completion (all rows of one length: the operands are zero padded)."""
    texts = [prompt_of(a, b, digits) + str(completion(a, b)) for a, b in problems]
    return torch.tensor(tokenizer(texts, add_special_tokens=False)["input_ids"])


def seed_data(seed: int, sizes: Sizes, tokenizer) -> dict:
    """Token ids (prompt + completion) of each set; the LoRA sets' last token is the class digit."""
    heldout, pool = split_problems(sizes.num_heldout)
    train = random.Random(seed).sample(pool, sizes.train_size)
    return {
        "base": encode(tokenizer, pool, 2, reversed_sum),
        "base_heldout": encode(tokenizer, heldout, 2, reversed_sum),
        "train": encode(tokenizer, train, 2, bucket),
        "heldout": encode(tokenizer, heldout[: sizes.num_heldout], 2, bucket),
        "shifted": encode(tokenizer, heldout[: sizes.num_shifted], 3, bucket),
    }


def anchor_batches(tokenizer, ids: torch.Tensor, batch: int = 256) -> list[dict]:
    """TFB anchor batches: the prompt + a `<pad>` placeholder whose label marks the answer position (no gold)."""
    pad = tokenizer.pad_token_id
    full = torch.cat([ids[:, :-1], torch.full((ids.shape[0], 1), pad)], dim=1)
    labels = torch.full_like(full, -100)
    labels[:, -1] = pad
    return [
        {
            "input_ids": full[i : i + batch],
            "attention_mask": torch.ones_like(full[i : i + batch]),
            "labels": labels[i : i + batch],
        }
        for i in range(0, full.shape[0], batch)
    ]


# ---------------------------------------------------------------------------------------------------------------------
# training


def train_tokens(
    model, params, ids, *, completion: int, steps: int, batch: int, lr: float, weight_decay: float, seed: int
) -> list[float]:
    """AdamW on the full-vocabulary cross-entropy of the last `completion` tokens of each row given what precedes them
    (teacher forcing); linear schedule, warmup 0.1, gradient clipping 1.0; epochs of a seeded permutation. Returns the
    mean loss of each 10 % of the steps."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    warmup = max(1, int(0.1 * steps))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: (s + 1) / warmup if s < warmup else max(0.0, (steps - s) / max(1, steps - warmup))
    )
    order, losses, chunk = torch.empty(0, dtype=torch.long), [], []
    model.train()
    for _ in range(steps):
        if order.numel() < batch:
            order = torch.cat([order, torch.randperm(ids.shape[0], generator=generator)])
        idx, order = order[:batch], order[batch:]
        logits = model(input_ids=ids[idx]).logits[:, -completion - 1 : -1].float()
        targets = ids[idx, -completion:].reshape(-1)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        chunk.append(loss.item())
        if len(chunk) >= max(1, steps // 10):
            losses.append(statistics.fmean(chunk))
            chunk = []
    model.eval()
    return losses


def cache_key(sizes: Sizes, fields: tuple[str, ...], **extra) -> str:
    data = {**{k: getattr(sizes, k) for k in fields}, **extra, "split": SPLIT_SEED}
    return hashlib.sha1(json.dumps(data, sort_keys=True).encode()).hexdigest()[:10]


BASE_FIELDS = ("base_steps", "base_batch", "base_lr", "hidden_size", "num_heldout")
LORA_FIELDS = (*BASE_FIELDS, "train_size", "lora_epochs", "lora_batch", "lora_lr", "lora_r", "lora_alpha")


def base_dir(seed: int, sizes: Sizes) -> Path:
    return CACHE / f"base_seed{seed}_{cache_key(sizes, BASE_FIELDS, task='reversed_sum')}"


def lora_dir(seed: int, sizes: Sizes) -> Path:
    key = cache_key(sizes, LORA_FIELDS, task="reversed_sum", bucket=BUCKET, targets=LORA_TARGETS)
    return CACHE / f"lora_seed{seed}_{key}"


@torch.no_grad()
def teacher_forced_exact_match(model, ids, completion: int) -> float:
    """Share of rows whose every completion token is the argmax given the correct prefix."""
    pred = model(input_ids=ids).logits[:, -completion - 1 : -1].argmax(-1)
    return (pred == ids[:, -completion:]).all(-1).float().mean().item()


def run_base(seed: int, sizes: Sizes, data: dict) -> tuple[Path, dict]:
    """The briefly pretrained base of `seed` (reversed-sum addition), trained or loaded from the cache."""
    path = base_dir(seed, sizes)
    if (path / "done.json").exists():
        return path, {**json.loads((path / "done.json").read_text()), "cached": True}
    from hf_stable.testing import build_tiny_model

    start = time.time()
    model, tokenizer = build_tiny_model(
        seed=seed, hidden_size=sizes.hidden_size, intermediate_size=2 * sizes.hidden_size, max_position_embeddings=32
    )
    losses = train_tokens(
        model,
        list(model.parameters()),
        data["base"],
        completion=3,
        steps=sizes.base_steps,
        batch=sizes.base_batch,
        lr=sizes.base_lr,
        weight_decay=1e-4,
        seed=seed,
    )
    info = {
        "heldout_exact_match": teacher_forced_exact_match(model, data["base_heldout"], 3),
        "loss_curve": losses,
        "seconds": time.time() - start,
    }
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    (path / "done.json").write_text(json.dumps(info))
    return path, {**info, "cached": False}


def load_base(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path).eval()


def run_lora(seed: int, sizes: Sizes, data: dict, base_path: Path) -> tuple[object, dict]:
    """The LoRA fine-tuned on the small training set (cached adapter), as an eval-mode `PeftModel`."""
    from peft import LoraConfig, PeftModel, get_peft_model

    path = lora_dir(seed, sizes)
    if (path / "done.json").exists():
        model = PeftModel.from_pretrained(load_base(base_path), path).eval()
        return model, {**json.loads((path / "done.json").read_text()), "cached": True}
    start = time.time()
    config = LoraConfig(r=sizes.lora_r, lora_alpha=sizes.lora_alpha, lora_dropout=0.0, target_modules=LORA_TARGETS)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = get_peft_model(load_base(base_path), config)
    params = [p for p in model.parameters() if p.requires_grad]
    steps = sizes.lora_epochs * math.ceil(data["train"].shape[0] / sizes.lora_batch)
    losses = train_tokens(
        model,
        params,
        data["train"],
        completion=1,
        steps=steps,
        batch=sizes.lora_batch,
        lr=sizes.lora_lr,
        weight_decay=0.0,
        seed=seed + 1,
    )
    info = {
        "steps": steps,
        "trainable_params": sum(p.numel() for p in params),
        "loss_curve": losses,
        "seconds": time.time() - start,
    }
    model.save_pretrained(path)
    (path / "done.json").write_text(json.dumps(info))
    return model.eval(), {**info, "cached": False}


# ---------------------------------------------------------------------------------------------------------------------
# measurements


def digit_ids(tokenizer) -> torch.Tensor:
    return torch.tensor([tokenizer.convert_tokens_to_ids(d) for d in DIGITS])


@torch.no_grad()
def answer_probs(model, rows, sample: bool, seed: int, n_samples: int = N_SAMPLES) -> torch.Tensor:
    """`(N, V)` full-vocabulary predictive of the answer token given the prompt (`rows` = prompt + answer; the answer
    is dropped): `predict_bayes` with `n_samples` sampled forwards (global RNG seeded with `seed`), or the
    deterministic LoRA's softmax (`sample=False`: one plain forward, no sampler needed)."""
    from hf_stable.adapters import predict_bayes

    ids = rows[:, :-1]
    if not sample:
        return torch.softmax(model(input_ids=ids).logits[:, -1].float(), dim=-1)
    torch.manual_seed(seed)
    return predict_bayes(model, {"input_ids": ids}, n_samples=n_samples)[:, -1]


def calibration(probs_full: torch.Tensor, answers: torch.Tensor, digits: torch.Tensor) -> dict:
    """K-way metrics of the renormalised digit distribution: accuracy, top-label ECE (15 equal-width bins), NLL,
    entropy, mean confidence, non-digit mass; plus the per-bin sums for pooled reliability diagrams."""
    mass = probs_full[:, digits].sum(-1)
    probs = probs_full[:, digits] / mass[:, None]
    target = (answers[:, None] == digits[None]).float().argmax(-1)
    confidence, prediction = probs.max(-1)
    correct = (prediction == target).float()
    bins = torch.clamp((confidence * ECE_BINS).long(), max=ECE_BINS - 1)
    count = torch.bincount(bins, minlength=ECE_BINS).float()
    conf_sum = torch.bincount(bins, weights=confidence, minlength=ECE_BINS)
    correct_sum = torch.bincount(bins, weights=correct, minlength=ECE_BINS)
    ece = ((conf_sum - correct_sum).abs().sum() / len(correct)).item()
    entropy = -(probs * torch.log(probs.clamp(min=1e-30))).sum(-1)
    return {
        "accuracy": correct.mean().item(),
        "ece": ece,
        "nll": -torch.log(probs.gather(-1, target[:, None]).clamp(min=1e-30)).mean().item(),
        "entropy": entropy.mean().item(),
        "confidence": confidence.mean().item(),
        "non_digit_mass": (1 - mass).mean().item(),
        "bins": {"count": count.tolist(), "conf_sum": conf_sum.tolist(), "correct_sum": correct_sum.tolist()},
    }


def evaluate(model, data: dict, digits, sample: bool, seed: int) -> dict:
    return {
        split: calibration(answer_probs(model, data[split], sample, seed + EVAL_SEED + i), data[split][:, -1], digits)
        for i, split in enumerate(SPLITS)
    }


def run_search(model, anchors, budget: float, noise: str, seed: int, sizes: Sizes) -> dict:
    from hf_stable.adapters import tfb_bayesianize

    start = time.time()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = tfb_bayesianize(
            model,
            anchors,
            metric="flip",
            budget=budget,
            n_samples=N_SAMPLES,
            noise=noise,
            seed=seed,
            iters=sizes.search_iters,
        )
    result["warnings"] = [str(w.message) for w in caught if "TFB" in str(w.message)]
    result["history"] = [list(h) for h in result["history"]]
    result["seconds"] = time.time() - start
    return result


def run_seed(seed: int, sizes: Sizes, deterministic_only: bool) -> dict:
    from hf_stable.testing import build_tiny_tokenizer

    start = time.time()
    tokenizer = build_tiny_tokenizer()
    digits = digit_ids(tokenizer)
    data = seed_data(seed, sizes, tokenizer)
    base_path, base_info = run_base(seed, sizes, data)
    model, lora_info = run_lora(seed, sizes, data, base_path)
    train_probs = answer_probs(model, data["train"], False, 0)
    out = {
        "base": base_info,
        "lora": lora_info,
        "train": calibration(train_probs, data["train"][:, -1], digits),
        "deterministic": evaluate(model, data, digits, False, seed),
        "tfb": {},
    }
    det = out["deterministic"]
    print(
        f"[seed {seed}] base EM {base_info['heldout_exact_match']:.3f}; LoRA train acc "
        f"{out['train']['accuracy']:.3f} (conf {out['train']['confidence']:.3f}), held-out acc "
        f"{det['heldout']['accuracy']:.3f} (conf {det['heldout']['confidence']:.3f}), shifted acc "
        f"{det['shifted']['accuracy']:.3f} (conf {det['shifted']['confidence']:.3f})",
        flush=True,
    )
    if deterministic_only:
        return out
    anchors = anchor_batches(tokenizer, data["train"][: sizes.anchor_size])
    arms = [(MAIN_NOISE, b) for b in BUDGETS] + [(EXTRA_NOISE, MAIN_BUDGET)]
    for noise, budget in arms:
        search = run_search(model, anchors, budget, noise, seed, sizes)
        metrics = evaluate(model, data, digits, True, seed)
        out["tfb"][arm_key(noise, budget)] = {"search": search, **metrics}
        h, s = metrics["heldout"], metrics["shifted"]
        print(
            f"[seed {seed}] {noise} budget {budget:.3f}: σ* {search['sigma']:.4g} (anchor flips "
            f"{search['criterion']:.4f}); held-out acc {h['accuracy']:.3f} ECE {h['ece']:.3f} NLL {h['nll']:.3f} "
            f"H {h['entropy']:.3f}; shifted H {s['entropy']:.3f}",
            flush=True,
        )
    out["seconds"] = time.time() - start
    return out


def arm_key(noise: str, budget: float) -> str:
    return f"{noise}@{budget:g}"


# ---------------------------------------------------------------------------------------------------------------------
# aggregation, criteria, outputs

METRICS = ("accuracy", "ece", "nll", "entropy", "confidence", "non_digit_mass")


def pooled_bins(results: list[dict]) -> dict:
    return {k: [sum(r["bins"][k][i] for r in results) for i in range(ECE_BINS)] for k in results[0]["bins"]}


def aggregate_model(results: list[dict]) -> dict:
    return {
        split: {
            **{m: mean_std([r[split][m] for r in results]) for m in METRICS},
            "bins": pooled_bins([r[split] for r in results]),
        }
        for split in SPLITS
    }


def aggregate(per_seed: dict) -> dict:
    runs = list(per_seed.values())
    out = {
        "base_exact_match": mean_std([r["base"]["heldout_exact_match"] for r in runs]),
        "train_accuracy": mean_std([r["train"]["accuracy"] for r in runs]),
        "train_confidence": mean_std([r["train"]["confidence"] for r in runs]),
        "deterministic": aggregate_model([r["deterministic"] for r in runs]),
        "tfb": {},
    }
    for arm in runs[0]["tfb"]:
        arms = [r["tfb"][arm] for r in runs]
        out["tfb"][arm] = {
            **aggregate_model(arms),
            "sigma": mean_std([a["search"]["sigma"] for a in arms]),
            "anchor_flips": mean_std([a["search"]["criterion"] for a in arms]),
        }
    return out


def seed_checks(run: dict) -> dict[str, bool]:
    """Each criterion evaluated on one seed's numbers."""
    det, tfb = run["deterministic"], run["tfb"][arm_key(MAIN_NOISE, MAIN_BUDGET)]
    sigmas = [run["tfb"][arm_key(MAIN_NOISE, b)]["search"]["sigma"] for b in BUDGETS]
    return checks_from(det, tfb, sigmas, lambda x: x)


def checks_from(det, tfb, sigmas, value) -> dict[str, bool]:
    h, s = "heldout", "shifted"
    return {
        "1": value(tfb[h]["ece"]) < value(det[h]["ece"]) and value(tfb[h]["nll"]) < value(det[h]["nll"]),
        "2": abs(value(tfb[h]["accuracy"]) - value(det[h]["accuracy"])) <= ACC_TOLERANCE,
        "3": all(a <= b * (1 + SIGMA_RTOL) for a, b in itertools.pairwise(value(x) for x in sigmas)),
        "4": value(tfb[s]["entropy"]) > value(tfb[h]["entropy"])
        and value(tfb[s]["entropy"]) - value(det[s]["entropy"]) > value(tfb[h]["entropy"]) - value(det[h]["entropy"]),
    }


def criteria(per_seed: dict, agg: dict) -> dict:
    det, tfb = agg["deterministic"], agg["tfb"][arm_key(MAIN_NOISE, MAIN_BUDGET)]
    sigmas = [agg["tfb"][arm_key(MAIN_NOISE, b)]["sigma"] for b in BUDGETS]
    passed = checks_from(det, tfb, sigmas, lambda x: x["mean"])
    per = [seed_checks(r) for r in per_seed.values()]

    def mean(model, split, metric):
        return model[split][metric]["mean"]

    values = {
        "1": {
            "ece_det": mean(det, "heldout", "ece"),
            "ece_tfb": mean(tfb, "heldout", "ece"),
            "nll_det": mean(det, "heldout", "nll"),
            "nll_tfb": mean(tfb, "heldout", "nll"),
        },
        "2": {
            "acc_det": mean(det, "heldout", "accuracy"),
            "acc_tfb": mean(tfb, "heldout", "accuracy"),
            "difference": mean(tfb, "heldout", "accuracy") - mean(det, "heldout", "accuracy"),
        },
        "3": {f"sigma@{b:g}": s["mean"] for b, s in zip(BUDGETS, sigmas, strict=True)},
        "4": {
            "entropy_tfb_heldout": mean(tfb, "heldout", "entropy"),
            "entropy_tfb_shifted": mean(tfb, "shifted", "entropy"),
            "increase_heldout": mean(tfb, "heldout", "entropy") - mean(det, "heldout", "entropy"),
            "increase_shifted": mean(tfb, "shifted", "entropy") - mean(det, "shifted", "entropy"),
        },
    }
    descriptions = {
        "1": "held-out: mean ECE(TFB) < mean ECE(det) and mean NLL(TFB) < mean NLL(det)",
        "2": f"held-out: mean acc(TFB) within ±{ACC_TOLERANCE} of mean acc(det)",
        "3": "mean σ* non-decreasing over budgets " + ", ".join(f"{b:.1%}" for b in BUDGETS),
        "4": "mean entropy(TFB) shifted > held-out, and H(TFB) − H(det) larger on shifted than on held-out",
    }
    return {
        k: {
            "criterion": descriptions[k],
            "values": values[k],
            "passed": passed[k],
            "per_seed": f"{sum(p[k] for p in per)}/{len(per)}",
        }
        for k in descriptions
    }


def extra_rows(agg: dict) -> dict:
    """Criteria (1), (2), (4) re-evaluated for the weight_per_sequence row (informative, not scored)."""
    det, wps = agg["deterministic"], agg["tfb"][arm_key(EXTRA_NOISE, MAIN_BUDGET)]
    checks = checks_from(det, wps, [], lambda x: x["mean"])
    return {k: checks[k] for k in ("1", "2", "4")}


def overconfident(run: dict) -> bool:
    """The experiment's premise for one seed: the deterministic LoRA's held-out confidence exceeds its accuracy."""
    heldout = run["deterministic"]["heldout"]
    return heldout["confidence"] > heldout["accuracy"]


def posthoc_premise(per_seed: dict) -> dict:
    """Post-hoc diagnostic, added after the seed 0-2 run and NOT scored: the criteria recomputed on the seeds where the
    premise holds (`overconfident`). Added because one seed's base stayed on its plateau and its LoRA came out
    underconfident; the pre-registered result above stays the result."""
    keep = {seed: run for seed, run in per_seed.items() if overconfident(run)}
    out = {"seeds": list(keep), "excluded": [seed for seed in per_seed if seed not in keep]}
    if keep:
        checks = criteria(keep, aggregate(keep))
        out["criteria"] = {k: {key: c[key] for key in ("passed", "values", "per_seed")} for k, c in checks.items()}
    return out


def reliability(ax, bins: dict, label: str, color: str, marker: str) -> None:
    xs, ys, ns = [], [], []
    for n, c, k in zip(bins["count"], bins["conf_sum"], bins["correct_sum"], strict=True):
        if n > 0:
            xs.append(c / n)
            ys.append(k / n)
            ns.append(n)
    total = sum(ns)
    ax.plot(xs, ys, color=color, marker=marker, label=label)
    ax.scatter(xs, ys, s=[400 * n / total for n in ns], color=color, alpha=0.3)


def plot(agg: dict, per_seed: dict, path: Path) -> None:
    fig, axes = subplots(1, 4, figsize=(21, 4.6))
    det, tfb = agg["deterministic"], agg["tfb"][arm_key(MAIN_NOISE, MAIN_BUDGET)]
    wps = agg["tfb"][arm_key(EXTRA_NOISE, MAIN_BUDGET)]
    panels = ((axes[0], "heldout", "held-out (2-digit)"), (axes[1], "shifted", "shifted (3-digit pad)"))
    for ax, split, title in panels:
        ax.plot([0, 1], [0, 1], color="gray", linestyle=":")
        for model, label, color, marker in (
            (det, "deterministic LoRA", "tab:red", "o"),
            (tfb, f"TFB {MAIN_NOISE} @1%", "tab:blue", "s"),
            (wps, f"TFB {EXTRA_NOISE} @1%", "tab:green", "^"),
        ):
            m = model[split]
            reliability(
                ax, m["bins"], f"{label} (ECE {m['ece']['mean']:.3f}, acc {m['accuracy']['mean']:.3f})", color, marker
            )
        ax.set(
            title=f"reliability, {title}, pooled seeds",
            xlabel="confidence (10-way)",
            ylabel="accuracy",
            xlim=(0, 1.02),
            ylim=(0, 1.02),
        )
        ax.legend(fontsize=8, loc="upper left")
    for run in per_seed.values():
        axes[2].plot(
            [100 * b for b in BUDGETS],
            [run["tfb"][arm_key(MAIN_NOISE, b)]["search"]["sigma"] for b in BUDGETS],
            color="tab:blue",
            alpha=0.35,
            marker=".",
        )
    means = [agg["tfb"][arm_key(MAIN_NOISE, b)]["sigma"]["mean"] for b in BUDGETS]
    axes[2].plot(
        [100 * b for b in BUDGETS], means, color="tab:blue", marker="s", label=f"{MAIN_NOISE} (mean; thin: seeds)"
    )
    axes[2].errorbar(
        [100 * MAIN_BUDGET],
        [wps["sigma"]["mean"]],
        yerr=[wps["sigma"]["std"]],
        color="tab:green",
        marker="^",
        capsize=4,
        label=EXTRA_NOISE,
    )
    axes[2].set(
        title="σ* (ΔW scale) vs flip budget on the anchors", xlabel="flip budget (%)", ylabel="σ*", xscale="log"
    )
    axes[2].set_xticks([100 * b for b in BUDGETS], [f"{100 * b:g}" for b in BUDGETS])
    axes[2].minorticks_off()
    axes[2].legend(fontsize=8)
    labels = ["deterministic", f"TFB {MAIN_NOISE}", f"TFB {EXTRA_NOISE}"]
    width = 0.25
    for i, model in enumerate((det, tfb, wps)):
        vals = [model[s]["entropy"]["mean"] for s in SPLITS]
        errs = [model[s]["entropy"]["std"] for s in SPLITS]
        axes[3].bar(
            [j + (i - 1) * width for j in range(len(SPLITS))],
            vals,
            width,
            yerr=errs,
            capsize=3,
            label=labels[i],
            color=("tab:red", "tab:blue", "tab:green")[i],
        )
    axes[3].set_xticks(range(len(SPLITS)), ["held-out", "shifted"])
    axes[3].set(title="mean predictive entropy (10-way, nats; @1%)", ylabel="entropy")
    axes[3].legend(fontsize=8, loc="upper left")
    fig.suptitle("E-B3: TFB on an overconfident LoRA (class (a+b)//20 of two 2-digit operands; mean ± std over seeds)")
    save_figure(fig, path)


def interpretation(agg: dict, checks: dict, per_seed: dict, posthoc: dict) -> str:
    det, tfb = agg["deterministic"], agg["tfb"][arm_key(MAIN_NOISE, MAIN_BUDGET)]
    wps = agg["tfb"][arm_key(EXTRA_NOISE, MAIN_BUDGET)]

    def m(model, split, metric):
        return model[split][metric]["mean"]

    text = [
        f"Over {len(agg['train_accuracy']['values'])} seeds the LoRA fits its training set "
        f"(accuracy {agg['train_accuracy']['mean']:.3f}, confidence {agg['train_confidence']['mean']:.3f}) but "
        "reaches "
        f"{m(det, 'heldout', 'accuracy'):.3f} held-out accuracy at confidence {m(det, 'heldout', 'confidence'):.3f} "
        f"(ECE {m(det, 'heldout', 'ece'):.3f}); it is overconfident on {sum(map(overconfident, per_seed.values()))} "
        f"of {len(per_seed)} seeds.",
        f"TFB at a 1 % anchor flip budget (σ* = {tfb['sigma']['mean']:.4g}) moves held-out ECE to "
        f"{m(tfb, 'heldout', 'ece'):.3f}, NLL from {m(det, 'heldout', 'nll'):.3f} to {m(tfb, 'heldout', 'nll'):.3f} "
        f"and accuracy by {m(tfb, 'heldout', 'accuracy') - m(det, 'heldout', 'accuracy'):+.3f}; its confidence "
        f"is {m(tfb, 'heldout', 'confidence'):.3f}.",
        f"On the shifted split (accuracy {m(det, 'shifted', 'accuracy'):.3f}) the entropy goes from "
        f"{m(det, 'shifted', 'entropy'):.3f} to {m(tfb, 'shifted', 'entropy'):.3f} nats (held-out: "
        f"{m(det, 'heldout', 'entropy'):.3f} to {m(tfb, 'heldout', 'entropy'):.3f}).",
        f"Per-sequence weight noise (σ* = {wps['sigma']['mean']:.4g}) gives held-out ECE "
        f"{m(wps, 'heldout', 'ece'):.3f}, NLL {m(wps, 'heldout', 'nll'):.3f}, accuracy "
        f"{m(wps, 'heldout', 'accuracy'):.3f}.",
    ]
    for seed, run in per_seed.items():
        if not overconfident(run):
            h = run["deterministic"]["heldout"]
            text.append(
                f"Seed {seed} misses the premise: its base reached only {run['base']['heldout_exact_match']:.3f} "
                f"exact match on addition (it stayed on the pretraining plateau), and its LoRA is underconfident "
                f"(held-out confidence {h['confidence']:.3f} at accuracy {h['accuracy']:.3f}); TFB barely moves it "
                f"(σ* {run['tfb'][arm_key(MAIN_NOISE, MAIN_BUDGET)]['search']['sigma']:.4g}). It is kept in the "
                "pre-registered means, which is why their std is large."
            )
    failed = [k for k, c in checks.items() if not c["passed"]]
    if failed:
        text.append("Not replicated here: " + "; ".join(f"({k}) {checks[k]['criterion']}" for k in failed) + ".")
    if posthoc["excluded"] and "criteria" in posthoc:
        text.append(
            f"On the seeds where the premise holds ({', '.join(posthoc['seeds'])}; post-hoc, not scored): "
            + ", ".join(
                f"({k}) {'PASS' if c['passed'] else 'FAIL'} ({c['per_seed']})" for k, c in posthoc["criteria"].items()
            )
            + "."
        )
    return " ".join(text)


def markdown(result: dict) -> str:
    agg, checks, cfg = result["aggregate"], result["criteria"], result["config"]
    sizes = cfg["sizes"]
    lines = [
        f"Mean ± std over seeds. Task: `(a+b) // 20` (10-way, one answer token); LoRA r "
        f"{sizes['lora_r']}, α {sizes['lora_alpha']} on {sizes['train_size']} training problems for "
        f"{sizes['lora_epochs']} epochs from a base pretrained on reversed-sum addition. TFB: flip budget on "
        f"{sizes['anchor_size']} training prompts (no labels), N = {N_SAMPLES} samples. Metrics over the 10 digit "
        f"tokens (renormalised): accuracy, top-label ECE ({ECE_BINS} bins), NLL, entropy (nats); held-out = "
        f"{sizes['num_heldout']} unseen 2-digit problems, shifted = the first {sizes['num_shifted']} of them with "
        "operands zero padded to 3 digits (same values and answers).",
        "",
        f"Base (reversed-sum addition) held-out exact match {fmt(agg['base_exact_match'])}; LoRA training accuracy "
        f"{fmt(agg['train_accuracy'])}, confidence {fmt(agg['train_confidence'])}.",
        "",
        "| model | σ* | anchor flips | held-out acc | held-out ECE | held-out NLL | held-out H | shifted acc | "
        "shifted ECE | shifted NLL | shifted H |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows = [("deterministic LoRA", agg["deterministic"], None)]
    rows += [(f"TFB {arm.replace('@', ' @ ')}", model, model) for arm, model in agg["tfb"].items()]
    for label, model, search in rows:
        sigma = "—" if search is None else f"{search['sigma']['mean']:.4g} ± {search['sigma']['std']:.2g}"
        flips = "—" if search is None else f"{search['anchor_flips']['mean']:.4f}"
        cells = [fmt(model[s][m]) for s in SPLITS for m in ("accuracy", "ece", "nll", "entropy")]
        lines.append(f"| {label} | {sigma} | {flips} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Main TFB row: `{arm_key(MAIN_NOISE, MAIN_BUDGET)}`. Non-digit predictive mass (held-out, det / "
        f"TFB): {agg['deterministic']['heldout']['non_digit_mass']['mean']:.2e} / "
        f"{agg['tfb'][arm_key(MAIN_NOISE, MAIN_BUDGET)]['heldout']['non_digit_mass']['mean']:.2e}.",
    ]
    lines += [
        "",
        "Per seed (deterministic → TFB flipout_token @ 1 % on held-out; σ* per budget):",
        "",
        "| seed | base EM | train acc / conf | held-out acc | held-out conf | held-out ECE | held-out NLL | "
        "shifted H | σ* " + " / ".join(f"{100 * b:g}%" for b in BUDGETS) + " |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for seed, run in result["per_seed"].items():
        det, tfb = run["deterministic"], run["tfb"][arm_key(MAIN_NOISE, MAIN_BUDGET)]

        def arrow(metric, split="heldout", det=det, tfb=tfb):
            return f"{det[split][metric]:.3f} → {tfb[split][metric]:.3f}"

        sigmas = " / ".join(f"{run['tfb'][arm_key(MAIN_NOISE, b)]['search']['sigma']:.4f}" for b in BUDGETS)
        lines.append(
            f"| {seed} | {run['base']['heldout_exact_match']:.3f} | {run['train']['accuracy']:.3f} / "
            f"{run['train']['confidence']:.3f} | {arrow('accuracy')} | {arrow('confidence')} | {arrow('ece')} | "
            f"{arrow('nll')} | {arrow('entropy', 'shifted')} | {sigmas} |"
        )
    extra = agg["extra_weight_per_sequence"]
    lines += [
        "",
        f"Extra (not scored), `{EXTRA_NOISE}` at 1 % in place of `{MAIN_NOISE}`: "
        + ", ".join(f"({k}) {'PASS' if v else 'FAIL'}" for k, v in extra.items())
        + ".",
    ]
    lines += [
        "",
        "## Interpretation",
        "",
        interpretation(agg, checks, result["per_seed"], agg["posthoc_premise"]),
        "",
        "## Pilot",
        "",
        "Seed 100 only, before seeds 0-2, on deterministic metrics: the first design (tens digit of the sum, "
        "base trained on the units digit) did not train (uniform plateau), so the base became reversed-sum "
        "addition and the class `(a+b)//20`; the training-set size / epochs / LR (256, 250, 3e-3) were chosen "
        "by a rule fixed beforehand (smallest set with training accuracy ≥ 0.99 and held-out accuracy ≥ 0.6). "
        "One full seed-100 run then checked the run time; nothing was changed after it or after seeds 0-2. "
        "Details in the script's docstring.",
        "",
    ]
    return "\n".join(lines)


def with_reported(per_seed: dict, sizes: Sizes) -> dict:
    """The aggregate plus the reported (not scored) weight_per_sequence row and the post-hoc premise check."""
    agg = aggregate(per_seed)
    agg["extra_weight_per_sequence"] = extra_rows(agg)
    agg["posthoc_premise"] = posthoc_premise(per_seed)
    return agg


EXPERIMENT = declare(
    globals(),
    title="E-B3: TFB calibration of an overconfident LoRA",
    claim="Training-free Bayesianisation (TFB) lowers the ECE and NLL of an overconfident LoRA at about the same "
    "accuracy (arXiv 2412.05723).",
    run_seed=lambda seed, sizes: run_seed(seed, sizes, False),
    aggregate=with_reported,
    criteria=lambda per_seed, agg, sizes: criteria(per_seed, agg),
    plot=lambda result, path: plot(result["aggregate"], result["per_seed"], path),
    config={
        "budgets": list(BUDGETS),
        "main_budget": MAIN_BUDGET,
        "main_noise": MAIN_NOISE,
        "extra_noise": EXTRA_NOISE,
        "metric": "flip",
        "n_samples": N_SAMPLES,
        "ece_bins": ECE_BINS,
        "acc_tolerance": ACC_TOLERANCE,
        "split_seed": SPLIT_SEED,
        "bucket": BUCKET,
        "lora_targets": LORA_TARGETS,
        "k_way": "digit mass renormalised",
        "example": {
            "prompt": prompt_of(47, 85, 2),
            "answer": str(bucket(47, 85)),
            "shifted_prompt": prompt_of(47, 85, 3),
            "base_completion": reversed_sum(47, 85),
        },
    },
)


if __name__ == "__main__":
    run_experiment(EXPERIMENT)
