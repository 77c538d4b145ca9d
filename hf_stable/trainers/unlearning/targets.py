"""Target distributions for datamodel / oracle matching (DMM, Georgiev et al., arXiv 2410.23232).

A provider returns, for a batch stream, the target's next-token log-distribution `(B, T, V)` at the shifted positions
(only answer positions are used). Three providers:

* `OracleTargets`: a model that never saw the forget set (a retrained "oracle"), run online;
* `PrecomputedTargets`: top-k targets stored with each row (``dmm_target_ids`` / ``dmm_target_logps``, one list of k
  per answer token), the remaining probability spread evenly over the other tokens — produced offline by any oracle
  or attribution pipeline with `precompute_dmm_targets`;
* `PriorTargets` (ours): for forget rows, the starting model's average answer distribution at the same answer
  position over retain rows (what the model says about *some other* entity); for retain rows, the starting model
  itself (self-distillation).
"""

from __future__ import annotations

import torch

from .data import pad_stream, tokenize_rows


def shifted_logprobs(model, stream) -> torch.Tensor:
    logits = model(input_ids=stream["input_ids"], attention_mask=stream["attention_mask"], use_cache=False).logits
    return torch.log_softmax(logits[:, :-1].float(), dim=-1)


def answer_positions(labels: torch.Tensor) -> torch.Tensor:
    """`(B, T)` index of each shifted position within its answer (0 for the position predicting the first answer
    token), -1 outside answers."""
    mask = labels[:, 1:] != -100
    index = mask.long().cumsum(-1) - 1
    return torch.where(mask, index, torch.full_like(index, -1))


class OracleTargets:
    def __init__(self, oracle):
        self.oracle = oracle.eval().requires_grad_(False)

    @torch.no_grad()
    def __call__(self, stream, kind: str) -> torch.Tensor:
        return shifted_logprobs(self.oracle, stream)


class PriorTargets:
    """See the module docstring; ``reference`` computes the starting model's log-distributions for a stream."""

    def __init__(self, reference, retain_batches, max_positions: int = 64):
        self.reference = reference
        sums, counts = None, None
        with torch.no_grad():
            for stream in retain_batches:
                logprobs = reference(stream)
                pos = answer_positions(stream["labels"])
                probs = logprobs.exp()
                for j in range(min(int(pos.max().item()) + 1, max_positions)):
                    where = pos == j
                    if not where.any():
                        continue
                    if sums is None:
                        sums = torch.zeros(max_positions, probs.shape[-1], dtype=torch.float64)
                        counts = torch.zeros(max_positions, dtype=torch.float64)
                    sums[j] += probs[where].double().sum(0).cpu()
                    counts[j] += where.sum().item()
        if sums is None:
            raise ValueError("dmm_target='prior' needs retain rows with answer tokens.")
        used = counts > 0
        last = int(used.nonzero().max())
        self.prior = (sums[: last + 1] / counts[: last + 1, None].clamp(min=1)).clamp(min=1e-12).log().float()

    @torch.no_grad()
    def __call__(self, stream, kind: str) -> torch.Tensor:
        if kind == "retain":
            return self.reference(stream)
        pos = answer_positions(stream["labels"]).clamp(min=0).clamp(max=self.prior.shape[0] - 1)
        return self.prior.to(stream["input_ids"].device)[pos]


def require_forget_targets(forget_rows: list[dict]) -> None:
    """``dmm_target="precomputed"`` needs targets on every forget row: without them the row would be matched to the
    starting model (the reference), a loss of about zero that unlearns nothing."""
    missing = [i for i, row in enumerate(forget_rows) if "target_ids" not in row]
    if missing:
        shown = ", ".join(map(str, missing[:5])) + (", ..." if len(missing) > 5 else "")
        raise ValueError(
            f"dmm_target='precomputed' needs `dmm_target_ids`/`dmm_target_logps` on every `forget_dataset` row; "
            f"{len(missing)} of {len(forget_rows)} row(s) have none (rows {shown}). Add them with "
            "`precompute_dmm_targets(oracle, forget_dataset, tokenizer)`, or use dmm_target='oracle_model' or 'prior'."
        )


class PrecomputedTargets:
    """Top-k targets carried by the batch (``target_ids``/``target_logps`` of shape `(B, A, k)`, A answer tokens);
    retain rows without targets fall back to ``reference`` (self-distillation). Forget rows must carry them
    ([`require_forget_targets`])."""

    def __init__(self, vocab_size: int, reference=None):
        self.vocab_size, self.reference = vocab_size, reference

    @torch.no_grad()
    def __call__(self, stream, kind: str) -> torch.Tensor:
        if "target_ids" not in stream:
            if self.reference is None or kind == "forget":
                raise ValueError(
                    f"dmm_target='precomputed': the {kind} rows carry no dmm_target_ids/dmm_target_logps."
                )
            return self.reference(stream)
        ids, logps = stream["target_ids"], stream["target_logps"].float()
        b, t = stream["labels"].shape[0], stream["labels"].shape[1] - 1
        pos = answer_positions(stream["labels"])
        k = ids.shape[-1]
        probs = logps.exp()
        tail = (1.0 - probs.sum(-1)).clamp(min=0) / max(self.vocab_size - k, 1)  # (B, A)
        full = tail[..., None].expand(*tail.shape, self.vocab_size).clone()
        full.scatter_(-1, ids.clamp(min=0), probs)
        index = pos.clamp(min=0).clamp(max=full.shape[1] - 1)
        out = full[torch.arange(b)[:, None], index]  # (B, T, V)
        assert out.shape[:2] == (b, t)
        return out.clamp(min=1e-12).log()


@torch.no_grad()
def precompute_dmm_targets(
    model, dataset, tokenizer, k: int = 32, batch_size: int = 16, max_length: int | None = None
):
    """Add ``dmm_target_ids`` / ``dmm_target_logps`` (top-k of ``model`` at every answer token) to the rows of
    ``dataset`` (a `datasets.Dataset` with prompt/completion); pass the result as the forget set with
    ``dmm_target="precomputed"``. ``model`` is the oracle (or any target model)."""
    rows = tokenize_rows(dataset, tokenizer, max_length, name="dataset")
    ids_out, logps_out = [], []
    device = next(model.parameters()).device
    model.eval()
    for start in range(0, len(rows), batch_size):
        stream = pad_stream(rows[start : start + batch_size], tokenizer.pad_token_id)
        stream = {key: value.to(device) for key, value in stream.items()}
        logprobs = shifted_logprobs(model, stream)
        top = logprobs.topk(k, dim=-1)
        mask = stream["labels"][:, 1:] != -100
        for i in range(mask.shape[0]):
            ids_out.append(top.indices[i][mask[i]].tolist())
            logps_out.append(top.values[i][mask[i]].tolist())
    return dataset.add_column("dmm_target_ids", ids_out).add_column("dmm_target_logps", logps_out)
