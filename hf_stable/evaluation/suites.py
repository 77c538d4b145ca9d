"""The TOFU and MUSE metric suites of open-unlearning (`configs/eval/{tofu,muse}.yaml` and their `*_metrics/`), run on
a model and written as open-unlearning's logs: ``{metric: {"agg_value": ..., "value_by_index": {...}}}``.

Metric names, datasets, generation lengths and aggregations are open-unlearning's; a retain model's logs (from
``hf-stable eval-unlearning`` or open-unlearning's ``TOFU_EVAL.json`` / ``MUSE_EVAL.json``) give forget quality and
privleak their reference. See ``docs/evaluation.md`` for the definitions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from . import metrics as M
from .benchmarks import load_muse, load_tofu, tofu_holdout_of
from .rouge import rouge_l, rouge_n
from .scoring import (
    answer_texts,
    encode_completion,
    encode_qa,
    generate_answers,
    gradient_norms,
    pad_id,
    score_examples,
)


MIA_METRICS = ("mia_loss", "mia_zlib", "mia_min_k", "mia_min_k_plus_plus", "mia_gradnorm", "mia_reference")
TOFU_DEFAULT = (
    "forget_truth_ratio", "forget_quality", "forget_Q_A_Prob", "forget_Q_A_ROUGE", "model_utility", "privleak",
    "extraction_strength",
)  # fmt: skip
TOFU_METRICS = (*TOFU_DEFAULT, "exact_memorization", "forget_Q_A_PARA_Prob", "forget_Q_A_PERT_Prob", *MIA_METRICS)
MUSE_DEFAULT = (
    "forget_knowmem_ROUGE", "retain_knowmem_ROUGE", "forget_verbmem_ROUGE", "privleak", "extraction_strength",
)  # fmt: skip
MUSE_METRICS = (*MUSE_DEFAULT, "exact_memorization", *MIA_METRICS)
# model_utility's nine statistics (configs/eval/tofu_metrics/model_utility.yaml)
UTILITY_PARTS = (
    "retain_Q_A_Prob", "retain_Q_A_ROUGE", "retain_Truth_Ratio", "ra_Q_A_Prob_normalised", "ra_Q_A_ROUGE",
    "ra_Truth_Ratio", "wf_Q_A_Prob_normalised", "wf_Q_A_ROUGE", "wf_Truth_Ratio",
)  # fmt: skip
MUSE_STOPWORDS = ("\n\n", "\nQuestion", "Question:")


@dataclass
class EvalOptions:
    """How to render and score. Defaults are open-unlearning's (batch 32, MIA k = 0.4, GradNorm p = 2, TOFU
    generations of up to 200 new tokens, MUSE knowmem 32 and verbmem 128)."""

    chat: bool = False
    system_prompt: str | None = None
    chat_kwargs: dict = field(default_factory=dict)
    batch_size: int = 32
    max_length: int = 512
    max_new_tokens: int | None = None  # None: each metric's own length
    mia_k: float = 0.4
    gradnorm_p: float = 2
    truth_ratio_aggregator: str = "closer_to_1_better"
    progress: bool = True


def _float(value):
    value = float(value)
    return None if math.isnan(value) else value


def _by_index(**columns) -> dict:
    """``{"0": {name: value, ...}, ...}`` from equal-length columns (tensors or lists); NaN becomes None."""
    n = len(next(iter(columns.values())))
    out = {}
    for i in range(n):
        row = {}
        for name, column in columns.items():
            v = column[i]
            row[name] = v if isinstance(v, (str, list)) else _float(v)
        out[str(i)] = row
    return out


def _agg(values) -> float | None:
    return _float(M.nanmean(values))


class _Scorer:
    """Caches the model passes one suite needs (each dataset is scored or generated once)."""

    def __init__(self, model, tokenizer, options: EvalOptions, reference_model=None):
        self.model, self.tokenizer, self.o, self.reference = model, tokenizer, options, reference_model
        self.pad = pad_id(tokenizer)
        self._cache: dict = {}

    def qa(self, questions, answers, fewshot=()):
        o = self.o
        kw = dict(chat=o.chat, fewshot=fewshot, system_prompt=o.system_prompt, chat_kwargs=o.chat_kwargs)
        return [
            encode_qa(self.tokenizer, q, a, max_length=o.max_length, **kw)
            for q, a in zip(questions, answers, strict=True)
        ]

    def scores(self, key, examples, min_k_plus_plus=False):
        cached = self._cache.get(("scores", key))
        if cached is None or (min_k_plus_plus and "min_k_plus_plus" not in cached):
            self._cache[("scores", key)] = score_examples(
                self.model, examples, pad=self.pad, batch_size=self.o.batch_size, k=self.o.mia_k,
                min_k_plus_plus=min_k_plus_plus, desc=f"scoring {key}", progress=self.o.progress,
            )  # fmt: skip
        return self._cache[("scores", key)]

    def perturbed_losses(self, key, questions, lists):
        """Mean NLL of each wrong answer, ``(N, P)`` (NaN-padded when rows have different counts)."""
        flat_q = [q for q, wrong in zip(questions, lists, strict=True) for _ in wrong]
        flat = self.scores(key, self.qa(flat_q, [w for wrong in lists for w in wrong]))["avg_loss"]
        out = torch.full((len(lists), max(len(w) for w in lists)), math.nan)
        i = 0
        for row, wrong in enumerate(lists):
            out[row, : len(wrong)] = flat[i : i + len(wrong)]
            i += len(wrong)
        return out

    def rouge(self, key, examples, targets, max_new_tokens, stopwords=()):
        if ("rouge", key) not in self._cache:
            texts = generate_answers(
                self.model, self.tokenizer, examples, batch_size=self.o.batch_size, stopwords=stopwords,
                max_new_tokens=self.o.max_new_tokens or max_new_tokens, desc=f"generating {key}",
                progress=self.o.progress,
            )  # fmt: skip
            rows = {}
            for i, (target, text) in enumerate(zip(targets, texts, strict=True)):
                rl = rouge_l(target, text)
                rows[str(i)] = {
                    "rouge1_recall": rouge_n(target, text).recall, "rougeL_f1": rl.fmeasure,
                    "rougeL_recall": rl.recall, "ground_truth": target, "generation": text,
                }  # fmt: skip
            self._cache[("rouge", key)] = rows
        return self._cache[("rouge", key)]


def _rouge_metric(rows: dict, rouge_type: str) -> dict:
    return {"agg_value": _agg([r[rouge_type] for r in rows.values()]), "value_by_index": rows}


def _prob_metric(losses: torch.Tensor) -> dict:
    """open-unlearning's ``probability``: one loss per row ``(N,)`` or several ``(N, P)`` (averaged per row)."""
    probs = M.probability(losses)
    if losses.dim() == 1:
        per_row = _by_index(prob=probs.tolist(), avg_loss=losses.tolist())
        return {"agg_value": _agg(probs), "value_by_index": per_row}
    rows = {}
    for i, (prob, loss) in enumerate(zip(probs.tolist(), losses.tolist(), strict=True)):
        keep = [j for j, v in enumerate(loss) if not math.isnan(v)]  # NaN pads rows with fewer wrong answers
        rows[str(i)] = {"prob": [prob[j] for j in keep], "avg_loss": [loss[j] for j in keep]}
    return {"agg_value": _agg([M.nanmean(r["prob"]) for r in rows.values()]), "value_by_index": rows}


def _nanmean_rows(losses: torch.Tensor) -> torch.Tensor:
    """Per-row mean of a NaN-padded ``(N, P)`` tensor."""
    valid = ~torch.isnan(losses)
    return torch.where(valid, losses, torch.zeros_like(losses)).sum(-1) / valid.sum(-1).clamp(min=1)


def _truth_ratio_metric(correct_loss, wrong_losses, aggregator) -> dict:
    scores = M.truth_ratio_scores(correct_loss, _nanmean_rows(wrong_losses).unsqueeze(-1), aggregator)
    return {
        "agg_value": _float(M.truth_ratio_aggregate(scores, aggregator)),
        "value_by_index": _by_index(score=scores.tolist()),
        "aggregator": aggregator,
    }


def retain_truth_ratios(retain_logs: dict, aggregator: str) -> torch.Tensor | None:
    """The retain model's per-question forget truth ratios from its logs, in the definition ``aggregator`` uses.

    Logs without an ``aggregator`` field (open-unlearning's) hold TOFU's ``p_w / p_c``; ``prob_mean`` logs hold
    ``p_c / (p_c + p_w) = 1 / (1 + TR)``; the two convert exactly into each other."""
    entry = (retain_logs or {}).get("forget_truth_ratio")
    if not entry or not entry.get("value_by_index"):
        return None
    values = entry["value_by_index"]
    scores = torch.tensor([values[k]["score"] for k in sorted(values, key=int)], dtype=torch.float64)
    theirs = entry.get("aggregator", "closer_to_1_better")
    if (theirs == "prob_mean") != (aggregator == "prob_mean"):
        scores = 1 / scores - 1 if theirs == "prob_mean" else 1 / (1 + scores)
    return scores


def _mia(scorer: _Scorer, name: str, sets: dict) -> dict:
    """One MIA as open-unlearning's ``mia_auc`` output: per-set scores, their means, and the AUC. ``sets`` maps
    ``forget`` and ``holdout`` to ``(cache key, examples)``."""
    o = scorer.o
    out: dict = {}
    scores = {}
    for part, (key, examples) in sets.items():
        if name == "mia_gradnorm":
            values = gradient_norms(scorer.model, examples, pad=scorer.pad, p=o.gradnorm_p, progress=o.progress)
        else:
            stats = scorer.scores(key, examples, min_k_plus_plus=name == "mia_min_k_plus_plus")
            if name == "mia_loss":
                values = stats["avg_loss"]
            elif name == "mia_zlib":
                values = M.zlib_scores(stats["avg_loss"], answer_texts(scorer.tokenizer, examples))
            elif name == "mia_min_k":
                values = stats["min_k"]
            elif name == "mia_min_k_plus_plus":
                values = stats["min_k_plus_plus"]
            else:  # mia_reference
                if scorer.reference is None:
                    raise ValueError("`mia_reference` needs a reference model (`--reference_model`).")
                ref = score_examples(scorer.reference, examples, pad=scorer.pad, batch_size=o.batch_size,
                                     desc=f"reference {key}", progress=o.progress)["avg_loss"]  # fmt: skip
                values = stats["avg_loss"] - ref
        scores[part] = values
        out[part] = {"agg_value": _agg(values), "value_by_index": _by_index(score=values.tolist())}
    out["auc"] = out["agg_value"] = _float(M.mia_auc(scores["forget"], scores["holdout"]))
    return out


def _privleak(logs: dict, retain_logs: dict | None) -> dict:
    reference = ((retain_logs or {}).get("mia_min_k") or {}).get("agg_value")
    value = M.privleak(logs["mia_min_k"]["agg_value"], 0.5 if reference is None else reference)
    return {"agg_value": _float(value), "reference_auc": 0.5 if reference is None else reference}


def evaluate_tofu(
    model,
    tokenizer,
    *,
    forget_split: str = "forget10",
    data_dir: str | None = None,
    metrics=TOFU_DEFAULT,
    options: EvalOptions | None = None,
    retain_logs: dict | None = None,
    reference_model=None,
) -> dict:
    """open-unlearning's TOFU suite (see the module docstring); returns its logs. Forget metrics use
    ``<forget_split>_perturbed``, MIAs and privleak ``holdoutNN``, model utility ``retain_perturbed``,
    ``real_authors_perturbed`` and ``world_facts_perturbed``."""
    o = options or EvalOptions()
    unknown = [m for m in metrics if m not in TOFU_METRICS]
    if unknown:
        raise ValueError(f"Unknown TOFU metric(s) {', '.join(unknown)}. Allowed values: {', '.join(TOFU_METRICS)}.")
    s = _Scorer(model, tokenizer, o, reference_model)
    forget = load_tofu(f"{forget_split}_perturbed", data_dir)
    fq, fa = forget["question"], forget["answer"]
    f_examples = s.qa(fq, fa)
    logs: dict = {}

    def forget_truth_ratio():
        if "forget_truth_ratio" not in logs:
            para = s.scores("forget_para", s.qa(fq, forget["paraphrased_answer"]))["avg_loss"]
            pert = s.perturbed_losses("forget_pert", fq, forget["perturbed_answer"])
            logs["forget_Q_A_PARA_Prob"], logs["forget_Q_A_PERT_Prob"] = _prob_metric(para), _prob_metric(pert)
            logs["forget_truth_ratio"] = _truth_ratio_metric(para, pert, o.truth_ratio_aggregator)
        return logs["forget_truth_ratio"]

    holdout = None
    for name in metrics:
        if name in ("forget_truth_ratio", "forget_Q_A_PARA_Prob", "forget_Q_A_PERT_Prob"):
            forget_truth_ratio()
        elif name == "forget_quality":
            mine = forget_truth_ratio()["value_by_index"]
            theirs = retain_truth_ratios(retain_logs, o.truth_ratio_aggregator)
            ours = torch.tensor([mine[k]["score"] for k in sorted(mine, key=int)], dtype=torch.float64)
            logs[name] = {"agg_value": None if theirs is None else _float(M.forget_quality(ours, theirs))}
        elif name == "forget_Q_A_Prob":
            logs[name] = _prob_metric(s.scores("forget", f_examples)["avg_loss"])
        elif name == "forget_Q_A_ROUGE":
            logs[name] = _rouge_metric(s.rouge("forget", f_examples, fa, 200), "rougeL_recall")
        elif name in ("extraction_strength", "exact_memorization"):
            values = s.scores("forget", f_examples)[name]
            logs[name] = {"agg_value": _agg(values), "value_by_index": _by_index(score=values.tolist())}
        elif name == "model_utility":
            parts = _tofu_utility(s, data_dir, logs)
            logs[name] = {"agg_value": _float(M.harmonic_mean([logs[p]["agg_value"] for p in parts]))}
        elif name in (*MIA_METRICS, "privleak"):
            if holdout is None:
                held = load_tofu(tofu_holdout_of(forget_split), data_dir)
                holdout = s.qa(held["question"], held["answer"])
            mia = "mia_min_k" if name == "privleak" else name
            if mia not in logs:
                logs[mia] = _mia(s, mia, {"forget": ("forget", f_examples), "holdout": ("holdout", holdout)})
            if name == "privleak":
                logs[name] = _privleak(logs, retain_logs)
    return logs


def _tofu_utility(s: _Scorer, data_dir, logs: dict) -> tuple[str, ...]:
    """The nine statistics of TOFU's model utility, added to ``logs``."""
    for prefix, config in (("retain", "retain_perturbed"), ("ra", "real_authors_perturbed"),
                           ("wf", "world_facts_perturbed")):  # fmt: skip
        data = load_tofu(config, data_dir)
        q, a = data["question"], data["answer"]
        examples = s.qa(q, a)
        losses = s.scores(prefix, examples)["avg_loss"]
        wrong = s.perturbed_losses(f"{prefix}_pert", q, data["perturbed_answer"])
        logs[f"{prefix}_Q_A_ROUGE"] = _rouge_metric(s.rouge(prefix, examples, a, 200), "rougeL_recall")
        if prefix == "retain":  # truth ratio against the paraphrased answer, raw probability
            para = s.scores("retain_para", s.qa(q, data["paraphrased_answer"]))["avg_loss"]
            logs["retain_Q_A_Prob"] = _prob_metric(losses)
            logs["retain_Truth_Ratio"] = _truth_ratio_metric(para, wrong, "true_better")
        else:  # real authors / world facts: normalised against the wrong options, truth ratio against the answer
            normalised = M.probability_with_options(losses, torch.nan_to_num(wrong, nan=math.inf))
            logs[f"{prefix}_Q_A_Prob_normalised"] = {
                "agg_value": _agg(normalised), "value_by_index": _by_index(prob=normalised.tolist())
            }  # fmt: skip
            logs[f"{prefix}_Truth_Ratio"] = _truth_ratio_metric(losses, wrong, "true_better")
    return UTILITY_PARTS


def evaluate_muse(
    model,
    tokenizer,
    *,
    corpus: str = "News",
    data_dir: str | None = None,
    metrics=MUSE_DEFAULT,
    options: EvalOptions | None = None,
    retain_logs: dict | None = None,
    reference_model=None,
) -> dict:
    """open-unlearning's MUSE suite: knowmem ROUGE-L F1 (few-shot from the ``*_icl`` splits), verbmem ROUGE-L F1,
    privleak from Min-K% on ``privleak`` forget vs holdout, extraction strength / exact memorisation on verbmem."""
    o = options or EvalOptions(max_length=2048)
    unknown = [m for m in metrics if m not in MUSE_METRICS]
    if unknown:
        raise ValueError(f"Unknown MUSE metric(s) {', '.join(unknown)}. Allowed values: {', '.join(MUSE_METRICS)}.")
    s = _Scorer(model, tokenizer, o, reference_model)
    logs: dict = {}
    verbmem = privleak_sets = None
    for name in metrics:
        if name in ("forget_knowmem_ROUGE", "retain_knowmem_ROUGE"):
            part = name.split("_")[0]
            qa = load_muse("knowmem", f"{part}_qa", corpus, data_dir)
            icl = load_muse("knowmem", f"{part}_qa_icl", corpus, data_dir)
            shots = list(zip(icl["question"], icl["answer"], strict=True))
            examples = [encode_qa(tokenizer, q, a, chat=o.chat, fewshot=shots, system_prompt=o.system_prompt,
                                  chat_kwargs=o.chat_kwargs, max_length=512)
                        for q, a in zip(qa["question"], qa["answer"], strict=True)]  # fmt: skip
            rows = s.rouge(name, examples, qa["answer"], 32, stopwords=MUSE_STOPWORDS)
            logs[name] = _rouge_metric(rows, "rougeL_f1")
        elif name in ("forget_verbmem_ROUGE", "extraction_strength", "exact_memorization"):
            if verbmem is None:
                data = load_muse("verbmem", "forget", corpus, data_dir)
                verbmem = (data["gt"], [encode_completion(tokenizer, p, g, max_length=o.max_length, insert_space=True)
                                        for p, g in zip(data["prompt"], data["gt"], strict=True)])  # fmt: skip
            if name == "forget_verbmem_ROUGE":
                logs[name] = _rouge_metric(s.rouge(name, verbmem[1], verbmem[0], 128), "rougeL_f1")
            else:
                values = s.scores("verbmem", verbmem[1])[name]
                logs[name] = {"agg_value": _agg(values), "value_by_index": _by_index(score=values.tolist())}
        else:  # MIAs and privleak on privleak forget vs holdout
            if privleak_sets is None:
                privleak_sets = [
                    [encode_completion(tokenizer, "", t, max_length=o.max_length) for t in
                     load_muse("privleak", part, corpus, data_dir)["text"]] for part in ("forget", "holdout")
                ]  # fmt: skip
            mia = "mia_min_k" if name == "privleak" else name
            if mia not in logs:
                sets = {
                    part: (f"privleak_{part}", examples)
                    for part, examples in zip(("forget", "holdout"), privleak_sets, strict=True)
                }
                logs[mia] = _mia(s, mia, sets)
            if name == "privleak":
                logs[name] = _privleak(logs, retain_logs)
    return logs


def summarize(logs: dict, metrics) -> dict:
    """``{metric: agg_value}`` for the requested metrics (and, with model_utility, its nine parts)."""
    names = list(metrics)
    if "model_utility" in names:
        names += [p for p in UTILITY_PARTS if p in logs]
    return {name: logs[name].get("agg_value") for name in names if name in logs}
