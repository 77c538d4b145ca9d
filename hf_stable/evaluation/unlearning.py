"""`evaluate_unlearning`: how much of the forget set a model still knows, and what it cost.

Per set (forget / retain / holdout / world): accuracy (argmax at the position predicting the first answer token),
teacher-forced exact match of the whole answer, and the answer probability `exp(−mean NLL)` of answer + EOS. With
``perturbed`` answers on the rows (a list of wrong answers per question, TOFU-style), the truth ratio and two KS
"forget quality" p-values: forget vs holdout truth ratios (oracle-free) and forget truth ratios of the model vs an
oracle's (TOFU). A min-k membership AUC separates forget (members) from holdout (non-members) — 0.5 is ideal.
Over-forgetting `log10(FP/HP₀)` compares the forget probability with the holdout probability of the *starting* model
(far below 0: the true answers were pushed below chance). A relearning attack fine-tunes a copy on part of the forget
knowledge and measures what comes back on the rest — the real weights are never touched. TOFU: Maini et al., arXiv
2401.06121; metric conventions from open-unlearning (arXiv 2506.12618).
"""

from __future__ import annotations

import copy
import math

import torch

from .rows import _answer_column, pad_stream, tokenize_rows
from .stats import (
    auc,
    ks_2samp_pvalue,
    min_k_score,
    over_forgetting,
    truth_ratio,
    truth_ratio_forget_score,
    truth_ratio_retain_score,
)


SETS = ("forget", "retain", "holdout", "world")


@torch.no_grad()
def score_rows(
    model, tokenizer, rows: list[dict], batch_size: int = 32, min_k: float = 0.2
) -> dict[str, torch.Tensor]:
    """Per tokenised row: ``mean_nll``, ``first_correct`` (bool), ``exact`` (bool) and ``min_k`` (score), `(N,)`."""
    from ..losses.unlearning import mean_nll, token_logps

    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    out = {"mean_nll": [], "first_correct": [], "exact": [], "min_k": []}
    try:
        for start in range(0, len(rows), batch_size):
            stream = pad_stream(rows[start : start + batch_size], tokenizer.pad_token_id)
            stream = {k: v.to(device) for k, v in stream.items()}
            logits = model(input_ids=stream["input_ids"], attention_mask=stream["attention_mask"]).logits
            logps, mask = token_logps(logits, stream["labels"])
            targets = stream["labels"][:, 1:]
            correct = (logits[:, :-1].argmax(-1) == targets) & mask
            first = mask.float().argmax(-1)  # the position predicting the first answer token
            out["mean_nll"].append(mean_nll(logps, mask).cpu())
            out["first_correct"].append(correct.gather(1, first[:, None]).squeeze(1).cpu())
            out["exact"].append((correct | ~mask).all(-1).cpu())
            out["min_k"].append(min_k_score(logps, mask, k=min_k).cpu())
    finally:
        model.train(was_training)
    return {k: torch.cat(v) for k, v in out.items()}


def _tokenize(dataset, tokenizer, max_length, name):
    return tokenize_rows(dataset, tokenizer, max_length, name)


def _perturbed_nll(model, tokenizer, dataset, column, max_length, batch_size) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean NLL of the correct answer `(N,)` and of each perturbed answer `(N, P)`."""
    rows = list(dataset)
    answer = _answer_column(rows[0].keys())
    n_wrong = min(len(r[column]) for r in rows)
    correct = score_rows(model, tokenizer, _tokenize(rows, tokenizer, max_length, "rows"), batch_size)["mean_nll"]
    wrong_rows = [{"prompt": r["prompt"], answer: r[column][j]} for r in rows for j in range(n_wrong)]
    wrong = score_rows(model, tokenizer, _tokenize(wrong_rows, tokenizer, max_length, "perturbed"), batch_size)
    return correct, wrong["mean_nll"].view(len(rows), n_wrong)


def _has_column(dataset, column) -> bool:
    names = getattr(dataset, "column_names", None)
    if names is None:
        names = list(dataset[0].keys()) if len(dataset) else []
    return column in names


def relearn_attack(
    model,
    tokenizer,
    relearn,
    relearn_test,
    steps: int = 20,
    lr: float = 1e-3,
    batch_size: int = 8,
    max_length: int | None = 512,
    seed: int = 0,
) -> dict[str, float]:
    """Fine-tune a *copy* of ``model`` for ``steps`` AdamW steps on ``relearn`` rows (NLL on the answers) and return
    its accuracy / probability on ``relearn_test``. The original model is untouched."""
    from ..losses.unlearning import mean_nll, token_logps
    from ..stability.nograd import own_forward

    # a deep copy of a TRL-trained model keeps TRL's fused-forward patch bound to the original: drop it
    attacker = own_forward(copy.deepcopy(model))
    attacker.train()
    for p in attacker.parameters():
        p.requires_grad_(True)
    params = [p for p in attacker.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    rows = _tokenize(relearn, tokenizer, max_length, "relearn")
    generator = torch.Generator().manual_seed(seed)
    device = next(attacker.parameters()).device
    for _ in range(steps):
        pick = torch.randint(len(rows), (min(batch_size, len(rows)),), generator=generator).tolist()
        stream = {k: v.to(device) for k, v in pad_stream([rows[i] for i in pick], tokenizer.pad_token_id).items()}
        logits = attacker(input_ids=stream["input_ids"], attention_mask=stream["attention_mask"]).logits
        logps, mask = token_logps(logits, stream["labels"])
        loss = mean_nll(logps, mask).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
    scores = score_rows(attacker, tokenizer, _tokenize(relearn_test, tokenizer, max_length, "relearn_test"))
    del attacker
    return {"acc": scores["first_correct"].float().mean().item(), "prob": (-scores["mean_nll"]).exp().mean().item()}


def evaluate_unlearning(
    model,
    tokenizer,
    forget,
    retain=None,
    holdout=None,
    world=None,
    oracle=None,
    relearn=None,
    relearn_test=None,
    *,
    start_holdout_prob: float | None = None,
    perturbed_column: str = "perturbed",
    min_k: float = 0.2,
    relearn_steps: int = 20,
    relearn_lr: float = 1e-3,
    relearn_batch_size: int = 8,
    max_length: int | None = 512,
    batch_size: int = 32,
    seed: int = 0,
    print_table: bool = True,
) -> dict[str, float]:
    """Evaluate an unlearned ``model`` (see the module docstring). Datasets are prompt/completion rows; ``forget`` is
    required, the others optional. Returns a flat dict of floats (and prints a table).

    Keys: ``{set}_acc``, ``{set}_exact``, ``{set}_prob`` for each given set; ``mia_auc`` (with holdout);
    ``over_forgetting`` (with holdout or ``start_holdout_prob``); with perturbed answers ``forget_truth_ratio``,
    ``retain_truth_ratio``, ``fq_holdout`` and, with ``oracle``, ``fq_oracle``; with relearn sets ``relearn_acc``,
    ``relearn_prob`` (and ``oracle_relearn_acc``/``_prob`` when an oracle is given).
    """
    sets = {"forget": forget, "retain": retain, "holdout": holdout, "world": world}
    report: dict[str, float] = {}
    scores = {}
    for name, data in sets.items():
        if data is None or len(data) == 0:
            continue
        scores[name] = score_rows(model, tokenizer, _tokenize(data, tokenizer, max_length, name), batch_size, min_k)
        report[f"{name}_acc"] = scores[name]["first_correct"].float().mean().item()
        report[f"{name}_exact"] = scores[name]["exact"].float().mean().item()
        report[f"{name}_prob"] = (-scores[name]["mean_nll"]).exp().mean().item()
    if "holdout" in scores:
        report["mia_auc"] = auc(scores["forget"]["min_k"], scores["holdout"]["min_k"])
    reference = start_holdout_prob if start_holdout_prob is not None else report.get("holdout_prob")
    if reference is not None:
        report["over_forgetting"] = over_forgetting(report["forget_prob"], reference)
    if _has_column(forget, perturbed_column):
        tr = {}
        for name in ("forget", "retain", "holdout"):
            data = sets[name]
            if data is not None and len(data) and _has_column(data, perturbed_column):
                correct, wrong = _perturbed_nll(model, tokenizer, data, perturbed_column, max_length, batch_size)
                tr[name] = truth_ratio(correct, wrong)
        report["forget_truth_ratio"] = truth_ratio_forget_score(tr["forget"])
        report["forget_truth_ratio_median"] = tr["forget"].median().item()
        if "retain" in tr:
            report["retain_truth_ratio"] = truth_ratio_retain_score(tr["retain"])
        if "holdout" in tr:
            report["fq_holdout"] = ks_2samp_pvalue(tr["forget"], tr["holdout"])
        if oracle is not None:
            correct, wrong = _perturbed_nll(oracle, tokenizer, forget, perturbed_column, max_length, batch_size)
            report["fq_oracle"] = ks_2samp_pvalue(tr["forget"], truth_ratio(correct, wrong))
    if relearn is not None and relearn_test is not None:
        attack = dict(
            steps=relearn_steps, lr=relearn_lr, batch_size=relearn_batch_size, max_length=max_length, seed=seed
        )
        result = relearn_attack(model, tokenizer, relearn, relearn_test, **attack)
        report["relearn_acc"], report["relearn_prob"] = result["acc"], result["prob"]
        if oracle is not None:
            result = relearn_attack(oracle, tokenizer, relearn, relearn_test, **attack)
            report["oracle_relearn_acc"], report["oracle_relearn_prob"] = result["acc"], result["prob"]
    if print_table:
        print(format_report(report))
    return report


def format_report(report: dict[str, float]) -> str:
    """A two-column Markdown table of a report."""
    lines = ["| metric | value |", "|---|---|"]
    for key, value in report.items():
        text = (
            f"{value:.3g}"
            if isinstance(value, float) and math.isfinite(value) and abs(value) < 1e-2
            else (f"{value:.4f}" if isinstance(value, float) else str(value))
        )
        lines.append(f"| {key} | {text} |")
    return "\n".join(lines)
