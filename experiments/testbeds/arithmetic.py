"""The fixed-width arithmetic testbed of the adapter-rank experiments (`adapters_map_rank.py`, E-B1, and
`adapters_rslora_rank.py`, E-B2): the tiny Llama pretrained on addition (T), then adapted to subtraction (T′).

* T: 2-digit addition, zero-padded and fixed width, one char per token: `47+85=` → `132` (prompt 6 tokens, answer 3
  digits + eos). T′: subtraction in the same format with a ≥ b: `85-47=` → `038`; the `-` token never occurs in T.
* T′ is split once (`SPLIT_SEED`, independent of the run seed) into test, validation and training problems.
* Pretraining: full fine-tuning of `hf_stable.testing`'s tiny Llama from a random init seeded by the run seed (AdamW,
  weight decay 0.01, 5% warmup + linear decay, grad clip 1), cached per seed under `experiments/cache/<name>/`.
* Metrics: loss = mean NLL per supervised token (answer digits + eos, teacher forced); exact match = greedy 3-digit
  answer equal to the target.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from testbeds import tiny_trl


SPLIT_SEED = 1234
PROMPT_LEN, ANSWER_LEN = 6, 3  # `47+85=`, `132`


@dataclass(frozen=True)
class Sizes:
    """The sizes every user of the testbed has; a script subclasses it for its own (a redeclared field keeps its
    place and takes the new default)."""

    hidden_size: int = 64
    pretrain_steps: int = 2500
    pretrain_batch: int = 64
    pretrain_lr: float = 3e-3
    num_test: int = 500
    num_val: int = 500
    steps: int = 150
    batch: int = 64


def encoder():
    from hf_stable.testing import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    vocab = tokenizer.get_vocab()
    eos = tokenizer.eos_token_id
    return lambda text: [vocab[c] for c in text] + [eos]


def encode_problems(problems, op: str) -> torch.Tensor:
    """`[N, 10]` token ids: prompt (6) + 3-digit answer + eos."""
    encode = encoder()
    rows = []
    for a, b in problems:
        c = a + b if op == "+" else a - b
        rows.append(encode(f"{a:02d}{op}{b:02d}={c:0{ANSWER_LEN}d}"))
    return torch.tensor(rows)


def task_data(sizes: Sizes, train_eval: int) -> dict:
    """T (all additions) and the fixed T′ split (subtractions a ≥ b); `train_eval`: how many of the first training
    problems form the fixed set the training loss is measured on."""
    additions = [(a, b) for a in range(100) for b in range(100)]
    subtractions = [(a, b) for a in range(100) for b in range(a + 1)]
    random.Random(SPLIT_SEED).shuffle(subtractions)
    test = subtractions[: sizes.num_test]
    val = subtractions[sizes.num_test : sizes.num_test + sizes.num_val]
    train = subtractions[sizes.num_test + sizes.num_val :]
    return {
        "T": encode_problems(additions, "+"),
        "train": encode_problems(train, "-"),
        "val": encode_problems(val, "-"),
        "test": encode_problems(test, "-"),
        "train_eval": encode_problems(train[:train_eval], "-"),
    }


def token_loss(model, ids: torch.Tensor) -> torch.Tensor:
    """Mean NLL per supervised token (answer digits + eos), teacher forced. No padding: all rows have one length."""
    logits = model(input_ids=ids[:, :-1]).logits[:, PROMPT_LEN - 1 :]
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), ids[:, PROMPT_LEN:].reshape(-1)
    )


@torch.no_grad()
def evaluate(model, ids: torch.Tensor, chunk: int = 500) -> dict:
    """Loss and greedy exact match of the 3 answer digits."""
    was_training = model.training
    model.eval()
    loss_sum, correct = 0.0, 0
    for start in range(0, len(ids), chunk):
        batch = ids[start : start + chunk]
        loss_sum += token_loss(model, batch).item() * len(batch)
        seq = batch[:, :PROMPT_LEN]
        for _ in range(ANSWER_LEN):
            seq = torch.cat([seq, model(input_ids=seq).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        correct += (seq[:, PROMPT_LEN:] == batch[:, PROMPT_LEN : PROMPT_LEN + ANSWER_LEN]).all(1).sum().item()
    model.train(was_training)
    loss = loss_sum / len(ids)
    return {"loss": loss if math.isfinite(loss) else float("inf"), "exact_match": correct / len(ids)}


def warmup_linear(steps: int, warmup: float):
    warm = max(1, round(warmup * steps))
    return lambda s: min(1.0, (s + 1) / warm) * max(0.0, (steps - s) / steps)


def train_steps(
    model, params: list, optimizer, scheduler, batches: Iterable[torch.Tensor], after_step: Callable | None = None
) -> list[float]:
    """One optimiser step per batch (token loss, grad clip 1 on `params`); `after_step(step, model)` after each, with
    the 1-based step. Returns the training losses."""
    losses = []
    model.train()
    for step, batch in enumerate(batches, start=1):
        loss = token_loss(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if after_step is not None:
            after_step(step, model)
    return losses


# ---------------------------------------------------------------------------------------------------------------------
# pretraining on T (cached)


def pretrain_cache_dir(name: str, seed: int, sizes: Sizes) -> Path:
    fields = {k: v for k, v in asdict(sizes).items() if k.startswith("pretrain") or k == "hidden_size"}
    return tiny_trl.cache_dir(name, "pretrain", seed, {**fields, "task": "add2-fixed3"})


def pretrain(name: str, seed: int, sizes: Sizes, data: dict) -> Path:
    """The seed's model pretrained on T, saved under `experiments/cache/<name>/` (reused when there)."""
    path = pretrain_cache_dir(name, seed, sizes)
    if tiny_trl.cached(path, seed, "pretrain"):
        return path
    start = time.time()
    model, tokenizer = tiny_trl.tiny_llama(seed, sizes.hidden_size, max_position_embeddings=16)
    gen = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=sizes.pretrain_lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_linear(sizes.pretrain_steps, 0.05))
    T = data["T"]
    draws = range(sizes.pretrain_steps)
    batches = (T[torch.randint(0, len(T), (sizes.pretrain_batch,), generator=gen)] for _ in draws)
    train_steps(model, list(model.parameters()), optimizer, scheduler, batches)
    on_t = evaluate(model, T[torch.randperm(len(T), generator=gen)[:1000]])
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    info = {"T": on_t, "seconds": time.time() - start, "steps": sizes.pretrain_steps}
    (path / "done.json").write_text(json.dumps(info))
    print(
        f"[seed {seed}] pretrain: T loss {on_t['loss']:.3f} EM {on_t['exact_match']:.3f} in {info['seconds']:.0f}s",
        flush=True,
    )
    return path


def load_base(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path)
