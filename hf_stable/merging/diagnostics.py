"""Collapse diagnostics for a merge (docs/merging.md, "Diagnostics"): is the merged model a shrunken average of its
parents?

Two families:

* **Data-free** ([`weight_diagnostics`]), from the per-tensor statistics the engine accumulates anyway (fp64 Gram
  matrix `G[i,j] = <x_i, x_j>` of the inputs in weight space, `cross[i] = <x_i, out>`, `out_sq = ||out||²`):
  the norm ratio `ρ = ||out|| / Σ_i α_i ||x_i||` (Euclidean averaging of non-aligned vectors shrinks the result,
  `ρ = 1/√N` for mutually orthogonal equal-norm inputs with uniform α; Fisher–Rao merging keeps `ρ ≈ 1` by
  construction), pairwise angles `∠(x_i, x_j)` and the angle of each input to the merge.
* **Data-based** ([`activation_diagnostics`]), on a probe set of tokens: the activation-variance ratio
  `ρ^var_ℓ = v(H^merged_ℓ) / Σ_i α_i v(H^{(i)}_ℓ)` with `v(H) = (1/d) Σ_j Var_m H[m, j]`, the ratio of the effective
  rank (Roy & Vetterli, "The effective rank: a measure of effective dimensionality", EUSIPCO 2007) of the centred
  hidden states to the inputs' mean, and `KL(p_expert ‖ p_merged)` of the next-token distributions.

α are the merge weights normalised to sum to one (absolute values if they sum to zero or less, uniform if none).
Everything returned is plain Python (floats, lists, dicts), ready for `json.dump` ([`to_json`]) and the model card.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

import torch

from .._files import write_text_atomic


def normalized_weights(weights, n: int) -> torch.Tensor:
    """`α` (n,) float64 summing to one: `weights / Σ weights` (uniform when ``weights`` is None).

    Task-arithmetic style weights (any sum) are normalised the same way, so `ρ` compares the merge with the
    α-weighted mean norm of its inputs. Weights summing to zero or less fall back to `|w| / Σ |w|`.
    """
    if weights is None:
        return torch.full((n,), 1.0 / n, dtype=torch.float64)
    w = torch.as_tensor(weights, dtype=torch.float64).flatten()
    if w.numel() != n:
        raise ValueError(f"weights has {w.numel()} entries but there are {n} input models.")
    if not torch.isfinite(w).all():
        raise ValueError(f"weights must be finite, got {w.tolist()}.")
    total = float(w.sum())
    if total <= 0:
        w, total = w.abs(), float(w.abs().sum())
    if total == 0:
        raise ValueError("weights are all zero: the norm ratio is undefined.")
    return w / total


def _angle_deg(dot: torch.Tensor, norm_a: torch.Tensor, norm_b: torch.Tensor) -> torch.Tensor:
    """Angle in degrees between vectors with inner product ``dot`` and norms ``norm_a``, ``norm_b`` (broadcast).

    `atan2(sqrt(|a|²|b|² − <a,b>²), <a,b>)` rather than `arccos`: it stays accurate near 0° and 180° (`arccos`
    of an fp32 cosine returns 0 for a true angle of 1e-4 rad). NaN where a norm is zero.
    """
    prod = norm_a * norm_b
    sin_part = torch.clamp(prod * prod - dot * dot, min=0.0).sqrt()
    angle = torch.rad2deg(torch.atan2(sin_part, dot))
    return torch.where(prod > 0, angle, torch.full_like(angle, float("nan")))


def _finite(values) -> list[float]:
    return [float(v) for v in values if v is not None and math.isfinite(v)]


def _or_none(value: float) -> float | None:
    return float(value) if math.isfinite(value) else None


def tensor_diagnostics(gram: torch.Tensor, cross: torch.Tensor, out_sq: float, alpha: torch.Tensor) -> dict:
    """Diagnostics of one tensor from its statistics.

    Args:
        gram: (N, N) inner products `<x_i, x_j>` of the inputs (weight space), float64.
        cross: (N,) inner products `<x_i, out>` of each input with the merged tensor.
        out_sq: `||out||²` of the merged tensor.
        alpha: (N,) normalised weights (see [`normalized_weights`]).

    Returns:
        `{"norm_ratio", "out_norm", "norms": [N], "pairwise_angles_deg": [[N×N]], "angle_to_merge_deg": [N]}`;
        undefined values (zero norms) are None.
    """
    gram = torch.as_tensor(gram, dtype=torch.float64)
    cross = torch.as_tensor(cross, dtype=torch.float64).flatten()
    n = gram.shape[0]
    if gram.shape != (n, n) or cross.numel() != n or alpha.numel() != n:
        raise ValueError(
            f"inconsistent statistics: gram {tuple(gram.shape)}, cross {tuple(cross.shape)}, {alpha.numel()} weights."
        )
    norms = torch.clamp(torch.diagonal(gram), min=0.0).sqrt()
    out_norm = math.sqrt(max(float(out_sq), 0.0))
    denominator = float((alpha * norms).sum())
    ratio = out_norm / denominator if denominator > 0 else float("nan")
    pairwise = _angle_deg(gram, norms[:, None], norms[None, :])
    pairwise.fill_diagonal_(0.0)
    to_merge = _angle_deg(cross, norms, torch.tensor(out_norm, dtype=torch.float64))
    return {
        "norm_ratio": _or_none(ratio),
        "out_norm": out_norm,
        "norms": norms.tolist(),
        "pairwise_angles_deg": [[_or_none(v) for v in row] for row in pairwise.tolist()],
        "angle_to_merge_deg": [_or_none(v) for v in to_merge.tolist()],
    }


def weight_diagnostics(per_tensor_stats: Mapping[str, Mapping[str, Any]], weights=None) -> dict:
    """Data-free diagnostics over every tensor the engine reported statistics for.

    Args:
        per_tensor_stats: `{name: {"gram": (N, N) float64, "cross": (N,), "out_sq": float}}` (`MergeResult.
            per_tensor_stats` with `diagnose=True`). A tensor's own `"weights"` entry, if not None, overrides
            ``weights`` (per-layer weight gradients).
        weights: (N,) merge weights (normalised here), or None for uniform.

    Returns:
        `{"per_tensor": {name: tensor_diagnostics}, "summary": {...}}` where the summary holds `n_tensors`,
        `norm_ratio_{min,median,max}` (+ the tensor with the minimum), `pairwise_angle_{max,median}_deg` and
        `pairwise_angle_histogram` (15° bins; over all tensors and pairs) and `angle_to_merge_max_deg`.
    """
    per_tensor = {}
    for name, stats in per_tensor_stats.items():
        missing = [key for key in ("gram", "cross", "out_sq") if key not in stats]
        if missing:
            raise ValueError(f"per_tensor_stats[{name!r}] lacks {missing}; run the merge with diagnose=True.")
        gram = torch.as_tensor(stats["gram"], dtype=torch.float64)
        own = stats.get("weights")
        alpha = normalized_weights(weights if own is None else own, gram.shape[0])
        per_tensor[name] = tensor_diagnostics(gram, stats["cross"], float(stats["out_sq"]), alpha)
    return {"per_tensor": per_tensor, "summary": summarize_weights(per_tensor)}


def summarize_weights(per_tensor: Mapping[str, Mapping[str, Any]]) -> dict:
    """Summary of [`tensor_diagnostics`] results (see [`weight_diagnostics`])."""
    ratios = {name: d["norm_ratio"] for name, d in per_tensor.items() if d["norm_ratio"] is not None}
    pairwise, to_merge = [], []
    for d in per_tensor.values():
        rows = d["pairwise_angles_deg"]
        pairwise += _finite(rows[i][j] for i in range(len(rows)) for j in range(i + 1, len(rows)))
        to_merge += _finite(d["angle_to_merge_deg"])
    summary: dict[str, Any] = {"n_tensors": len(per_tensor)}
    if ratios:
        worst = min(ratios, key=ratios.get)
        summary.update(
            norm_ratio_min=ratios[worst],
            norm_ratio_min_tensor=worst,
            norm_ratio_median=statistics.median(ratios.values()),
            norm_ratio_max=max(ratios.values()),
        )
    if pairwise:
        summary.update(pairwise_angle_max_deg=max(pairwise), pairwise_angle_median_deg=statistics.median(pairwise))
        summary["pairwise_angle_histogram"] = angle_histogram(pairwise)
    if to_merge:
        summary["angle_to_merge_max_deg"] = max(to_merge)
    return summary


def angle_histogram(angles_deg: Sequence[float], width: int = 15) -> dict[str, int]:
    """Counts of angles per ``width``-degree bin (`"75-90": 8`), non-empty bins only, in increasing order."""
    counts: dict[int, int] = {}
    for angle in angles_deg:
        b = min(int(angle // width), 180 // width - 1)
        counts[b] = counts.get(b, 0) + 1
    return {f"{b * width}-{(b + 1) * width}": counts[b] for b in sorted(counts)}


# ---------------------------------------------------------------------------------------------------------------------
# Data-based diagnostics


def activation_variance(h: torch.Tensor) -> float:
    """`v(H) = (1/d) Σ_j Var_m H[m, j]` (population variance) of hidden states ``h`` (M, d)."""
    h = h.to(torch.float64)
    return float(h.var(dim=0, unbiased=False).mean())


def effective_rank(h: torch.Tensor) -> float:
    """Roy–Vetterli effective rank of the centred ``h`` (M, d): `exp(−Σ_k p_k ln p_k)`, `p_k = σ_k / Σ σ`.

    Ranges from 1 (rank one) to `min(M, d)` (flat spectrum); 0 for an all-constant ``h``.
    """
    h = h.to(torch.float64)
    sigma = torch.linalg.svdvals(h - h.mean(dim=0, keepdim=True))
    total = sigma.sum()
    if total <= 0:
        return 0.0
    p = sigma / total
    p = p[p > 0]
    return float(torch.exp(-(p * p.log()).sum()))


def _load(model, device=None):
    """A model from a path / Hub id (float32, in eval mode, on ``device`` or the CPU), or the module itself."""
    if isinstance(model, (str, os.PathLike)):
        from transformers import AutoModelForCausalLM

        loaded = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        return loaded.to(device) if device is not None else loaded
    return model


def _device(model) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:
        return torch.device("cpu")


@torch.no_grad()
def _forward(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, batch_size: int, hidden: bool):
    """Yield `(rows, logits (b, T, V) float32, hidden_states tuple | None)` batch by batch."""
    device = _device(model)
    for start in range(0, input_ids.shape[0], batch_size):
        ids = input_ids[start : start + batch_size].to(device)
        mask = attention_mask[start : start + batch_size].to(device)
        out = model(input_ids=ids, attention_mask=mask, output_hidden_states=hidden, use_cache=False)
        yield slice(start, start + ids.shape[0]), out.logits.float(), (out.hidden_states if hidden else None)


def _hidden_states(model, input_ids, attention_mask, batch_size, layers) -> list[torch.Tensor]:
    """Per requested layer, the hidden states of the non-padding tokens: list of (M, d) float32 on the CPU."""
    keep = attention_mask.bool()
    chunks: list[list[torch.Tensor]] = []
    for rows, _, hidden in _forward(model, input_ids, attention_mask, batch_size, hidden=True):
        picked = list(range(len(hidden))) if layers is None else list(layers)
        if not chunks:
            chunks = [[] for _ in picked]
        for k, layer in enumerate(picked):
            chunks[k].append(hidden[layer].float().cpu()[keep[rows]])
    return [torch.cat(c) for c in chunks]


def activation_diagnostics(
    merged,
    inputs: Sequence,
    input_ids: torch.Tensor,
    weights=None,
    *,
    attention_mask: torch.Tensor | None = None,
    layers: Sequence[int] | None = None,
    batch_size: int = 8,
    device: str | torch.device | None = None,
) -> dict:
    """Data-based diagnostics of ``merged`` against its ``inputs`` on the probe tokens ``input_ids``.

    Hidden states come from `output_hidden_states=True` (entry 0 is the embedding output, entry ℓ the output of
    block ℓ); only tokens with ``attention_mask`` 1 count. Memory: one model's hidden states of the requested
    ``layers`` at a time — inputs given as paths are loaded one by one (float32, CPU) and freed; the merged model is
    run again per expert for the KL instead of keeping its (M, vocab) log-probabilities.

    Args:
        merged: a causal LM (`transformers` model) or a path to one.
        inputs: the N input models (modules or paths), in the order of ``weights``.
        input_ids: (B, T) token ids of the probe set.
        weights: (N,) merge weights (normalised here), or None for uniform.
        attention_mask: (B, T) 1 for real tokens; defaults to all ones.
        layers: hidden-state indices to analyse (default all).
        batch_size: rows per forward pass.
        device: where models given as paths are placed (default CPU); modules stay where they are.

    Returns:
        `{"per_layer": [{"layer", "var_ratio", "erank_ratio", "erank_merged", "var_merged", "var_inputs",
        "erank_inputs"}], "kl_to_experts": [N], "entropy_merged": float, "summary": {"n_tokens", "var_ratio_min",
        "var_ratio_min_layer", "erank_ratio_min", "erank_ratio_min_layer", "kl_mean", "kl_max", "entropy_merged"}}`.
        `kl_to_experts[i]` = mean over probe positions of `KL(p_i(·|x) ‖ p_merged(·|x))` in nats.
    """
    input_ids = torch.as_tensor(input_ids, dtype=torch.long)
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be (batch, length), got shape {tuple(input_ids.shape)}.")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    attention_mask = torch.as_tensor(attention_mask, dtype=torch.long)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)} != input_ids {tuple(input_ids.shape)}.")
    if len(inputs) == 0:
        raise ValueError("activation_diagnostics needs at least one input model.")
    alpha = normalized_weights(weights, len(inputs))
    keep = attention_mask.bool()
    n_tokens = int(keep.sum())
    if n_tokens < 2:
        raise ValueError(f"the probe set has {n_tokens} real tokens; at least 2 are needed for variances.")

    merged = _load(merged, device)
    merged_hidden = _hidden_states(merged, input_ids, attention_mask, batch_size, layers)
    var_merged = [activation_variance(h) for h in merged_hidden]
    erank_merged = [effective_rank(h) for h in merged_hidden]
    del merged_hidden
    entropy_sum = 0.0
    for rows, logits, _ in _forward(merged, input_ids, attention_mask, batch_size, hidden=False):
        logp = torch.log_softmax(logits, dim=-1)
        entropy_sum += float(-(logp.exp() * logp).sum(-1)[keep[rows].to(logp.device)].sum())

    var_inputs: list[list[float]] = []
    erank_inputs: list[list[float]] = []
    kl = []
    for model in inputs:
        expert = _load(model, device)
        hidden = _hidden_states(expert, input_ids, attention_mask, batch_size, layers)
        if len(hidden) != len(var_merged):
            raise ValueError(f"input model has {len(hidden)} hidden-state layers, the merged one {len(var_merged)}.")
        var_inputs.append([activation_variance(h) for h in hidden])
        erank_inputs.append([effective_rank(h) for h in hidden])
        del hidden
        kl_sum = 0.0
        merged_batches = _forward(merged, input_ids, attention_mask, batch_size, hidden=False)
        for (rows, logits, _), (_, merged_logits, _) in zip(
            _forward(expert, input_ids, attention_mask, batch_size, hidden=False), merged_batches, strict=True
        ):
            logp = torch.log_softmax(logits, dim=-1)
            logq = torch.log_softmax(merged_logits.to(logits.device), dim=-1)
            per_position = (logp.exp() * (logp - logq)).sum(-1)
            kl_sum += float(per_position[keep[rows].to(per_position.device)].sum())
        kl.append(kl_sum / n_tokens)

    layer_ids = list(range(len(var_merged))) if layers is None else list(layers)
    per_layer = []
    for k, layer in enumerate(layer_ids):
        reference_var = sum(a * v[k] for a, v in zip(alpha.tolist(), var_inputs, strict=True))
        mean_erank = sum(e[k] for e in erank_inputs) / len(erank_inputs)
        per_layer.append(
            {
                "layer": layer,
                "var_ratio": _or_none(var_merged[k] / reference_var) if reference_var > 0 else None,
                "erank_ratio": _or_none(erank_merged[k] / mean_erank) if mean_erank > 0 else None,
                "var_merged": var_merged[k],
                "var_inputs": [v[k] for v in var_inputs],
                "erank_merged": erank_merged[k],
                "erank_inputs": [e[k] for e in erank_inputs],
            }
        )
    entropy = entropy_sum / n_tokens
    summary: dict[str, Any] = {"n_tokens": n_tokens}
    for key in ("var_ratio", "erank_ratio"):
        valid = [row for row in per_layer if row[key] is not None]
        if valid:
            worst = min(valid, key=lambda row, key=key: row[key])
            summary[f"{key}_min"] = worst[key]
            summary[f"{key}_min_layer"] = worst["layer"]
    summary.update(kl_mean=sum(kl) / len(kl), kl_max=max(kl), entropy_merged=entropy)
    return {"per_layer": per_layer, "kl_to_experts": kl, "entropy_merged": entropy, "summary": summary}


def read_probe_texts(path: str | os.PathLike, tokenizer=None) -> list[str]:
    """Texts of a probe file: `.jsonl` rows (`text`; else `prompt` + `completion`; else `messages`), else lines.

    Conversational `prompt`/`completion`/`messages` values (lists of `{role, content}`) are rendered with the
    tokenizer's chat template when it has one, else by joining the contents. Empty texts are skipped.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"probe data {path!r} does not exist")
    with open(path, encoding="utf-8") as f:
        if not path.endswith((".jsonl", ".json")):
            return [line.rstrip("\n") for line in f if line.strip()]
        texts = []
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"probe data {path}:{number} is not valid JSON ({err.msg})") from None
            text = _row_text(row, tokenizer)
            if text is None:
                raise ValueError(
                    f"probe data {path}:{number}: a row needs a `text`, `prompt` (+ `completion`) or `messages` "
                    f"field, got keys {sorted(row) if isinstance(row, dict) else type(row).__name__}"
                )
            if text.strip():
                texts.append(text)
    return texts


def _row_text(row: Any, tokenizer) -> str | None:
    if isinstance(row, str):
        return row
    if not isinstance(row, dict):
        return None
    if isinstance(row.get("text"), str):
        return row["text"]
    if "messages" in row:
        return _render(row["messages"], tokenizer)
    if "prompt" in row:
        return _render(row["prompt"], tokenizer) + _render(row.get("completion") or "", None)
    return None


def _render(value: Any, tokenizer) -> str:
    if isinstance(value, str):
        return value
    messages = list(value)
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False)
    return "\n".join(str(m.get("content", "")) for m in messages)


def probe_batch(
    texts: Sequence[str], tokenizer, *, max_tokens: int = 2048, max_length: int = 256
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(input_ids, attention_mask)` (B, T) of the probe set: texts tokenised and truncated to ``max_length``,
    taken in order until ``max_tokens`` real tokens (2048 by default), right-padded."""
    if max_tokens < 2 or max_length < 1:
        raise ValueError(f"max_tokens must be ≥ 2 and max_length ≥ 1, got {max_tokens}, {max_length}")
    rows, total = [], 0
    for text in texts:
        ids = tokenizer(text, add_special_tokens=True)["input_ids"][:max_length][: max_tokens - total]
        if ids:
            rows.append(ids)
            total += len(ids)
        if total >= max_tokens:
            break
    if total < 2:
        raise ValueError(f"the probe data gives {total} tokens; at least 2 are needed")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, ids in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attention_mask[i, : len(ids)] = 1
    return input_ids, attention_mask


# ---------------------------------------------------------------------------------------------------------------------
# Reporting


def summary(diagnostics: Mapping[str, Any]) -> dict:
    """The flat summary the model card shows, from `{"weights": ..., "activations": ...}` (either may be absent)."""
    out: dict[str, Any] = {}
    for part in ("weights", "activations"):
        if diagnostics.get(part):
            out.update(diagnostics[part]["summary"])
    return out


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, Mapping):
        return ", ".join(f"{k}: {v}" for k, v in value.items())
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def print_table(diagnostics: Mapping[str, Any], *, file: TextIO | None = None, top: int = 10) -> None:
    """Plain-text report: the summary, the ``top`` tensors with the lowest norm ratio, and the per-layer table.

    ``diagnostics`` is `{"weights": weight_diagnostics(...), "activations": activation_diagnostics(...)}`.
    """
    file = file or sys.stdout
    weights, activations = diagnostics.get("weights"), diagnostics.get("activations")
    print("Merge diagnostics (docs/merging.md, Diagnostics; ρ < 1 = shrinkage)", file=file)
    for key, value in summary(diagnostics).items():
        print(f"  {key:<28} {_fmt(value)}", file=file)
    if weights and weights["per_tensor"]:
        rows = sorted(
            ((name, d) for name, d in weights["per_tensor"].items() if d["norm_ratio"] is not None),
            key=lambda item: item[1]["norm_ratio"],
        )[:top]
        width = max([len("tensor"), *(len(name) for name, _ in rows)])
        print(f"\nLowest norm ratios ({len(rows)} of {len(weights['per_tensor'])} tensors)", file=file)
        print(f"  {'tensor':<{width}}  {'rho':>8}  {'max pair angle':>14}  {'max angle to merge':>18}", file=file)
        for name, d in rows:
            matrix = d["pairwise_angles_deg"]
            pair = _finite(v for row in matrix for v in row)
            merge = _finite(d["angle_to_merge_deg"])
            print(
                f"  {name:<{width}}  {_fmt(d['norm_ratio']):>8}  {_fmt(max(pair) if pair else None):>14}  "
                f"{_fmt(max(merge) if merge else None):>18}",
                file=file,
            )
    if activations:
        print("\nPer layer (hidden states)", file=file)
        print(f"  {'layer':>5}  {'var ratio':>9}  {'erank ratio':>11}  {'erank merged':>12}", file=file)
        for row in activations["per_layer"]:
            print(
                f"  {row['layer']:>5}  {_fmt(row['var_ratio']):>9}  {_fmt(row['erank_ratio']):>11}  "
                f"{_fmt(row['erank_merged']):>12}",
                file=file,
            )
        kl = ", ".join(_fmt(v) for v in activations["kl_to_experts"])
        print(f"  KL(expert ‖ merged) per expert (nats): {kl}", file=file)


def to_json(diagnostics: Mapping[str, Any], path: str | os.PathLike) -> str:
    """Write ``diagnostics`` to ``path`` as JSON (atomically: temporary file, then rename); returns the path."""
    return write_text_atomic(path, json.dumps(_jsonable(diagnostics), indent=1, allow_nan=False) + "\n")


def _jsonable(value):
    """Plain JSON values: tensors as lists, non-finite floats as null (strict JSON has no NaN)."""
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
