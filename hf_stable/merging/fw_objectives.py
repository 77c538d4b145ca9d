"""Objectives for FW-Merging: what the merged model should do, as a differentiable loss.

An objective is an `FWObjective`: `prepare(target)` once (e.g. cache expert logits), `loss_and_grad(target)` (runs
forward + backward over its data, accumulating `.grad` on the target's parameters, returns f as a float) and
`evaluate(target)` (f without gradients). The target is the materialised iterate: an HF causal LM, or, for pure-math
objectives, a dict `{name: fp32 leaf tensor}`.

* `CallableObjective(fn)`: any `fn(target) -> scalar tensor` (e.g. a custom MLP loss).
* `ProxyCE`: labelled proxy set (the reference setup: 800 GLUE / 300 LLaMA examples),
  `f = Σ_k (1/|P_k|) Σ_{(x,y)∈P_k} CE(p_θ(·|x), y)`, CE = mean over completion tokens (prompt tokens masked).
* `KLToExperts`: label-free, `f = Σ_k E_{x∼Q_k} KL(p_{θ_k}(·|x) ‖ p_θ(·|x))` averaged over token positions; expert
  log-probabilities are computed once per expert (experts loaded one at a time) and cached; `Q_k` given or sampled
  from expert k itself. With `top_k`, the KL is taken between the distributions coarsened to the expert's top-k tokens
  plus one "rest" bucket (a lower bound of the full KL by data processing) so the cache is O(tokens·k).
* `Entropy`: AdaMerging-style `f = E_x H(p_θ(·|x))` on unlabelled prompts (FusionBench FW-soft).
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from hf_stable.merging.fw_pool import CandidateSource, ResidentTracker


class FWObjective:
    """Base class; subclasses implement `_loss_terms(target)` yielding scalar loss tensors (summed = f)."""

    def prepare(self, target: Any) -> None:
        """Called once before the first iteration (cache expert outputs, etc.)."""

    def _loss_terms(self, target: Any):
        raise NotImplementedError

    def loss_and_grad(self, target: Any) -> float:
        """Accumulate ∇f into `.grad` (term by term, so only one batch's graph is alive) and return f."""
        total = 0.0
        for term in self._loss_terms(target):
            term.backward()
            total += float(term.detach())
        return total

    @torch.no_grad()
    def evaluate(self, target: Any) -> float:
        return float(sum(float(term) for term in self._loss_terms(target)))


class CallableObjective(FWObjective):
    """Wrap `fn(target) -> scalar loss tensor`."""

    def __init__(self, fn: Callable[[Any], torch.Tensor]):
        self.fn = fn

    def _loss_terms(self, target: Any):
        loss = self.fn(target)
        if not (torch.is_tensor(loss) and loss.numel() == 1):
            raise TypeError(f"objective: the callable must return a scalar tensor, got {type(loss)}")
        yield loss.reshape(())


def load_examples(data: Any) -> list[dict]:
    """Rows `{"task", "prompt", "completion"}` from a list of dicts, a `.jsonl` file or a `.json` list."""
    if isinstance(data, (str, os.PathLike)):
        path = Path(data)
        if not path.is_file():
            raise FileNotFoundError(f"objective.data: {path} not found")
        text = path.read_text()
        if path.suffix == ".jsonl":
            rows = []
            for i, line in enumerate(text.splitlines(), 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as err:
                        raise ValueError(f"objective.data: {path} line {i} is not JSON ({err})") from err
        else:
            rows = json.loads(text)
    else:
        rows = list(data)
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping) or "prompt" not in row:
            raise ValueError(f"objective.data: row {i} needs a `prompt` field, got {row!r}")
    return [dict(r) for r in rows]


def _model_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    return model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits.float()


def _device_of(model) -> torch.device:
    return next(model.parameters()).device


def _pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad to (B, L) input ids and the (B, L) attention mask."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for r, s in enumerate(seqs):
        ids[r, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[r, : len(s)] = 1
    return ids, mask


def _pad_id(tokenizer) -> int:
    for tok_id in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0):
        if tok_id is not None:
            return int(tok_id)
    return 0


class ProxyCE(FWObjective):
    """Completion-only cross-entropy on a labelled proxy set, summed over tasks of per-task mean example losses.

    Args:
        examples: rows `{"task"?, "prompt", "completion"}` (list, `.jsonl` or `.json`); `task` defaults to "default".
        tokenizer: tokenises prompt and completion separately (no special tokens), eos appended when `add_eos`.
        batch_size: examples per forward/backward.
        max_length: truncate each example to this many tokens (examples left without completion tokens are dropped).
        max_tokens_per_task: keep each task's first examples while their total tokens fit (at least one).
    """

    def __init__(
        self,
        examples: Any,
        tokenizer,
        *,
        batch_size: int = 8,
        max_length: int | None = None,
        max_tokens_per_task: int | None = None,
        add_eos: bool = True,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size: expected ≥ 1, got {batch_size}")
        rows = load_examples(examples)
        self.pad_id = _pad_id(tokenizer)
        items: dict[str, list[tuple[list[int], int]]] = {}
        used: dict[str, int] = {}
        for i, row in enumerate(rows):
            if "completion" not in row:
                raise ValueError(f"objective.data: row {i} needs a `completion` field for proxy_ce")
            task = str(row.get("task", "default"))
            prompt = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
            completion = tokenizer(row["completion"], add_special_tokens=False)["input_ids"]
            if add_eos and tokenizer.eos_token_id is not None:
                completion = [*completion, tokenizer.eos_token_id]
            ids = (prompt + completion)[:max_length] if max_length else prompt + completion
            if len(ids) <= max(len(prompt), 1):
                continue  # no completion token left to predict
            if max_tokens_per_task is not None and items.get(task) and used[task] + len(ids) > max_tokens_per_task:
                continue
            items.setdefault(task, []).append((ids, len(prompt)))
            used[task] = used.get(task, 0) + len(ids)
        if not items:
            raise ValueError("objective.data: no usable proxy example (every completion empty or truncated away)")
        flat = [(ids, p, 1.0 / len(v)) for v in items.values() for ids, p in v]
        self.tasks = {k: len(v) for k, v in items.items()}
        self.batches = []
        for s in range(0, len(flat), batch_size):
            chunk = flat[s : s + batch_size]
            ids, mask = _pad([c[0] for c in chunk], self.pad_id)
            # labels mask over predicted positions j = 1..L-1: completion tokens only
            pos = torch.arange(ids.shape[1])[None, 1:]
            start = torch.tensor([max(c[1], 1) for c in chunk])[:, None]
            lengths = mask.sum(1, keepdim=True)
            target_mask = (pos >= start) & (pos < lengths)
            weights = torch.tensor([c[2] for c in chunk], dtype=torch.float32)
            self.batches.append((ids, mask, target_mask, weights))

    def _loss_terms(self, model):
        dev = _device_of(model)
        for ids, mask, target_mask, weights in self.batches:
            ids, mask, target_mask, weights = ids.to(dev), mask.to(dev), target_mask.to(dev), weights.to(dev)
            logits = _model_logits(model, ids, mask)[:, :-1]
            nll = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")  # (B, L-1)
            per_example = (nll * target_mask).sum(1) / target_mask.sum(1).clamp(min=1)
            yield (weights * per_example).sum()


class _PromptSet:
    """Token sequences (list of id lists) for KL / entropy objectives."""

    @staticmethod
    def encode(prompts: Sequence[str], tokenizer, max_length: int | None) -> list[list[int]]:
        seqs = []
        for p in prompts:
            ids = tokenizer(p, add_special_tokens=False)["input_ids"]
            ids = ids[:max_length] if max_length else ids
            if ids:
                seqs.append(ids)
        if not seqs:
            raise ValueError("objective: no non-empty prompt")
        return seqs


class KLToExperts(FWObjective):
    """`Σ_k E_{x∼Q_k} KL(p_{θ_k} ‖ p_θ)`, mean over the valid token positions of `Q_k`, expert logits cached.

    Args:
        experts: expert checkpoints (paths / state dicts loaded into a copy of the model, one at a time) or modules.
        tokenizer: encodes prompts; its pad/eos ids pad batches.
        prompts: `None` (sample `generate["num"]` sequences from each expert itself), a list of strings shared by all
            experts, or one list per expert (list of lists, or a dict keyed by expert index).
        batch_size, max_length: batching and truncation of the prompts.
        top_k: cache only the expert's top-k log-probs per position (coarsened KL, see module docstring).
        generate: `{"num": 16, "max_new_tokens": 24, "temperature": 1.0, "seed": 0}` for self-generated prompts.
    """

    def __init__(
        self,
        experts: Sequence[Any],
        tokenizer,
        *,
        prompts: Any = None,
        batch_size: int = 8,
        max_length: int | None = None,
        top_k: int | None = None,
        generate: Mapping | None = None,
    ):
        if not experts:
            raise ValueError("objective.targets: kl_to_experts needs at least one expert")
        if top_k is not None and top_k < 1:
            raise ValueError(f"objective.top_k: expected ≥ 1 or None, got {top_k}")
        self.experts, self.tokenizer = list(experts), tokenizer
        self.batch_size, self.max_length, self.top_k = batch_size, max_length, top_k
        self.generate = {"num": 16, "max_new_tokens": 24, "temperature": 1.0, "seed": 0, **dict(generate or {})}
        self.pad_id = _pad_id(tokenizer)
        self.prompts = self._per_expert_prompts(prompts)
        self.cache: list[list[tuple]] | None = None

    def _per_expert_prompts(self, prompts) -> list[list[list[int]] | None]:
        n = len(self.experts)
        if prompts is None:
            return [None] * n
        if isinstance(prompts, Mapping):
            return [_PromptSet.encode(prompts[k], self.tokenizer, self.max_length) if k in prompts else None
                    for k in range(n)]  # fmt: skip
        if prompts and all(isinstance(p, str) for p in prompts):
            shared = _PromptSet.encode(prompts, self.tokenizer, self.max_length)
            return [shared] * n
        if len(prompts) != n:
            raise ValueError(f"objective.prompts: {len(prompts)} prompt lists for {n} experts")
        return [_PromptSet.encode(p, self.tokenizer, self.max_length) for p in prompts]

    def _expert_model(self, spec, model):
        if isinstance(spec, torch.nn.Module):
            return spec
        expert = copy.deepcopy(model)
        expert.zero_grad(set_to_none=True)
        src = CandidateSource(spec, ResidentTracker(), label=str(spec) if not isinstance(spec, Mapping) else "expert")
        try:
            with torch.no_grad():
                for name, p in expert.named_parameters():
                    if name not in src.shapes:
                        raise ValueError(f"objective.targets: expert {src.label} has no tensor {name!r}")
                    p.copy_(src.read(name).to(p.device, p.dtype))
        finally:
            src.close()
        return expert

    @torch.no_grad()
    def _sample(self, expert, k: int) -> list[list[int]]:
        g = self.generate
        tok = self.tokenizer
        start = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
        dev = _device_of(expert)
        inputs = torch.full((int(g["num"]), 1), int(start), dtype=torch.long, device=dev)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(g["seed"]) + 1000 * k)
            out = expert.generate(
                input_ids=inputs, attention_mask=torch.ones_like(inputs), do_sample=True,
                temperature=float(g["temperature"]), max_new_tokens=int(g["max_new_tokens"]),
                pad_token_id=self.pad_id, top_k=0, top_p=1.0,
            )  # fmt: skip
        seqs = []
        for row in out.tolist():
            cut = len(row)
            if tok.eos_token_id is not None and tok.eos_token_id in row[1:]:
                cut = row.index(tok.eos_token_id, 1) + 1
            seqs.append(row[:cut])
        return seqs

    def prepare(self, model) -> None:
        if self.cache is not None:
            return
        if not isinstance(model, torch.nn.Module):
            raise TypeError("kl_to_experts: the base must be a model (nn.Module), not a state dict")
        self.cache = []
        for k, spec in enumerate(self.experts):
            expert = self._expert_model(spec, model)
            expert.eval()
            seqs = self.prompts[k] if self.prompts[k] is not None else self._sample(expert, k)
            batches = []
            with torch.no_grad():
                for s in range(0, len(seqs), self.batch_size):
                    ids, mask = _pad(seqs[s : s + self.batch_size], self.pad_id)
                    dev = _device_of(expert)
                    logp = F.log_softmax(_model_logits(expert, ids.to(dev), mask.to(dev)), dim=-1).cpu()
                    if self.top_k is not None:
                        vals, idx = logp.topk(min(self.top_k, logp.shape[-1]), dim=-1)
                        batches.append((ids, mask, vals, idx))
                    else:
                        batches.append((ids, mask, logp, None))
            self.cache.append(batches)
            if expert is not spec:
                del expert

    def _loss_terms(self, model):
        if self.cache is None:
            self.prepare(model)
        dev = _device_of(model)
        for batches in self.cache:
            n_tok = sum(int(b[1].sum()) for b in batches)
            for ids, mask, lp_e, idx in batches:
                ids, mask, lp_e = ids.to(dev), mask.to(dev), lp_e.to(dev)
                logq = F.log_softmax(_model_logits(model, ids, mask), dim=-1)
                if idx is None:
                    kl = (lp_e.exp() * (lp_e - logq)).sum(-1)
                else:
                    logq_k = logq.gather(-1, idx.to(dev))
                    p_k = lp_e.exp()
                    rest_p = (1 - p_k.sum(-1)).clamp(min=1e-12)
                    rest_q = (1 - logq_k.exp().sum(-1)).clamp(min=1e-12)
                    kl = (p_k * (lp_e - logq_k)).sum(-1) + rest_p * (rest_p.log() - rest_q.log())
                yield (kl * mask).sum() / n_tok


class Entropy(FWObjective):
    """AdaMerging-style mean next-token entropy `E_x H(p_θ(·|x))` over the valid positions of unlabelled prompts."""

    def __init__(self, prompts: Sequence[str], tokenizer, *, batch_size: int = 8, max_length: int | None = None):
        seqs = _PromptSet.encode(prompts, tokenizer, max_length)
        pad = _pad_id(tokenizer)
        self.batches = [_pad(seqs[s : s + batch_size], pad) for s in range(0, len(seqs), batch_size)]
        self.n_tok = sum(int(m.sum()) for _, m in self.batches)

    def _loss_terms(self, model):
        dev = _device_of(model)
        for ids, mask in self.batches:
            ids, mask = ids.to(dev), mask.to(dev)
            logq = F.log_softmax(_model_logits(model, ids, mask), dim=-1)
            ent = -(logq.exp() * logq).sum(-1)
            yield (ent * mask).sum() / self.n_tok


OBJECTIVE_KINDS = ("proxy_ce", "kl_to_experts", "entropy")


def make_objective(spec: Mapping, *, tokenizer=None, resolve: Callable[[str], str] | None = None) -> FWObjective:
    """Build an objective from the recipe's `objective:` mapping.

    `kind`: proxy_ce (`data`, `max_tokens_per_task`, `batch_size`, `max_length`) | kl_to_experts (`targets`: list of
    models, `data` prompts optional — rows whose `task` names a target go to that target, other rows are shared —,
    `top_k`, `generate`) | entropy (`data` prompts).
    """
    spec = dict(spec)
    kind = spec.pop("kind", None)
    if kind not in OBJECTIVE_KINDS:
        raise ValueError(f"objective.kind: {kind!r} is not one of {OBJECTIVE_KINDS}")
    if tokenizer is None:
        raise ValueError(f"objective.kind={kind}: a tokenizer is needed to encode the data")
    common = {k: spec.pop(k) for k in ("batch_size", "max_length") if k in spec}
    if kind == "proxy_ce":
        if "data" not in spec:
            raise ValueError("objective.data: proxy_ce needs a data file of {task, prompt, completion} rows")
        out = ProxyCE(spec.pop("data"), tokenizer, max_tokens_per_task=spec.pop("max_tokens_per_task", None),
                      **common)  # fmt: skip
    elif kind == "entropy":
        if "data" not in spec:
            raise ValueError("objective.data: entropy needs a data file of {prompt} rows")
        out = Entropy([r["prompt"] for r in load_examples(spec.pop("data"))], tokenizer, **common)
    else:
        targets = spec.pop("targets", None)
        if not targets:
            raise ValueError("objective.targets: kl_to_experts needs a list of expert models")
        refs = [t["model"] if isinstance(t, Mapping) else str(t) for t in targets]
        paths = [resolve(r) if resolve else r for r in refs]
        prompts = None
        if "data" in spec:
            rows = load_examples(spec.pop("data"))
            shared = [r["prompt"] for r in rows if r.get("task") not in refs]
            prompts = {k: [r["prompt"] for r in rows if r.get("task") == ref] + shared for k, ref in enumerate(refs)}
            prompts = {k: v for k, v in prompts.items() if v}
        out = KLToExperts(paths, tokenizer, prompts=prompts, top_k=spec.pop("top_k", None),
                          generate=spec.pop("generate", None), **common)  # fmt: skip
    spec.pop("max_tokens_per_task", None)
    if spec:
        raise ValueError(f"objective: unknown key(s) {sorted(spec)} for kind {kind!r}")
    return out
