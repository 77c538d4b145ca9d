"""MaP: checkpoint Merging + Pass@k, for evaluation curves with less noise (Wang et al., *MaP: A Unified Framework
for Reliable Evaluation of Pre-training Dynamics*, arXiv 2510.09295; docs/evaluation.md, "MaP").

The paper's abstract names two noise sources of a training curve: parameter instability (one checkpoint is a noisy
draw around the trajectory) and evaluation instability (one greedy answer per problem is a noisy measurement). MaP
evaluates the average of the recent checkpoints with pass@k over n sampled answers per problem.

Reconstructed from the abstract (neither the paper's text nor its code was reachable here), so these choices are ours:

* merging is the uniform average of the last N checkpoints (`uniform_average`; in training, WSM's window with the
  `"uniform"` schedule, `hf_stable.callbacks.map_eval.MaPCallback`);
* pass@k is the unbiased estimator of Chen et al. 2021 (arXiv 2107.03374, HumanEval):
  `1 − C(n−c, k) / C(n, k)` per problem, averaged over problems, computed in fp64 as the product
  `1 − Π_{i=n−c+1..n} (1 − k/i)` (no large binomials), and exactly 1 when `n − c < k`;
* answers are sampled at `temperature` (default 1.0, no top-k) with a fixed seed under a forked RNG, so an evaluation
  neither reads nor advances the training RNG; a problem is solved when `scorer(completion, answer)` is true
  (default: the stripped completion equals the stripped answer).
"""

from __future__ import annotations

import glob
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence

import torch

from .scoring import _ids, pad_id


CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
Scorer = Callable[[str, object], bool]


def pass_at_k(num_samples, num_correct, k: int) -> torch.Tensor:
    """Unbiased pass@k per problem (Chen et al. 2021, arXiv 2107.03374).

    Args:
        num_samples: `[P]` integers n ≥ k, the answers sampled per problem (a scalar is broadcast).
        num_correct: `[P]` integers 0 ≤ c ≤ n, the correct ones.
        k: the budget, an integer ≥ 1.

    Returns:
        `[P]` float64: `1 − C(n−c, k)/C(n, k) = 1 − Π_{i=n−c+1..n} (1 − k/i)`; 1 where `n − c < k`.
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"pass@k `k` must be an integer >= 1, got {k!r}.")
    c = torch.as_tensor(num_correct).reshape(-1)
    n = torch.as_tensor(num_samples).reshape(-1)
    n = n.expand(c.shape) if n.numel() == 1 else n
    for field, t in (("num_samples", n), ("num_correct", c)):
        if t.is_floating_point() or t.is_complex():
            raise ValueError(f"pass@k `{field}` must hold integers, got dtype {t.dtype}.")
    if n.shape != c.shape:
        raise ValueError(f"pass@k `num_samples` {tuple(n.shape)} and `num_correct` {tuple(c.shape)} differ in shape.")
    if bool((n < k).any()):
        raise ValueError(f"pass@k `num_samples` must be >= k={k} for every problem, got min {int(n.min())}.")
    if bool((c < 0).any() or (c > n).any()):
        raise ValueError("pass@k `num_correct` must lie in [0, num_samples] for every problem.")
    if c.numel() == 0:
        return torch.zeros(0, dtype=torch.float64)
    n, c = n.to(torch.int64), c.to(torch.int64)
    i = torch.arange(1, int(n.max()) + 1, dtype=torch.float64)  # [N]
    inside = (i > (n - c)[:, None].double()) & (i <= n[:, None].double()) & (i > k)  # [P, N]: the product's factors
    log_miss = torch.where(inside, torch.log1p(-k / i), torch.zeros((), dtype=torch.float64)).sum(dim=1)
    return torch.where(n - c < k, torch.ones((), dtype=torch.float64), 0.0 - torch.expm1(log_miss))  # no -0.0


def mean_pass_at_k(num_samples, num_correct, ks: Sequence[int]) -> dict[int, float]:
    """`{k: mean over problems of pass@k}` (see [`pass_at_k`])."""
    return {k: float(pass_at_k(num_samples, num_correct, k).mean()) for k in ks}


def uniform_average(state_dicts: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The uniform mean of N state dicts, summed in fp64 and cast back to each tensor's dtype.

    Args:
        state_dicts: N ≥ 1 mappings name → tensor with the same names and shapes (oldest first; order is irrelevant).
            Non-floating tensors (integer buffers) must agree and are copied from the last one.

    Returns:
        name → the mean tensor.
    """
    if not state_dicts:
        raise ValueError("uniform_average `state_dicts` is empty: give at least one checkpoint.")
    first = state_dicts[0]
    for j, sd in enumerate(state_dicts[1:], start=1):
        if sd.keys() != first.keys():
            diff = sorted(set(sd.keys()) ^ set(first.keys()))[:3]
            raise ValueError(f"uniform_average `state_dicts[{j}]` has other tensor names than the first: {diff}.")
        for name, t in sd.items():
            if t.shape != first[name].shape:
                raise ValueError(
                    f"uniform_average `state_dicts[{j}]`: {name!r} has shape {tuple(t.shape)}, "
                    f"expected {tuple(first[name].shape)}."
                )
    out = {}
    for name, ref in first.items():
        if not ref.is_floating_point():
            if any(not torch.equal(sd[name], ref) for sd in state_dicts[1:]):
                raise ValueError(f"uniform_average: the integer tensor {name!r} differs between checkpoints.")
            out[name] = state_dicts[-1][name].clone()
            continue
        acc = torch.zeros(ref.shape, dtype=torch.float64)
        for sd in state_dicts:
            acc += sd[name].detach().to("cpu", torch.float64)
        out[name] = (acc / len(state_dicts)).to(ref.dtype)
    return out


def last_checkpoints(folder: str, num_checkpoints: int) -> list[str]:
    """The last `num_checkpoints` `checkpoint-<step>` folders of `folder`, oldest first (by step)."""
    if isinstance(num_checkpoints, bool) or not isinstance(num_checkpoints, int) or num_checkpoints < 1:
        raise ValueError(f"`num_checkpoints` must be an integer >= 1, got {num_checkpoints!r}.")
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"No such folder of checkpoints: {folder}")
    found = sorted(
        (int(m.group(1)), os.path.join(folder, name))
        for name in os.listdir(folder)
        if (m := CHECKPOINT_RE.match(name)) and os.path.isdir(os.path.join(folder, name))
    )
    if len(found) < num_checkpoints:
        raise ValueError(
            f"`num_checkpoints`={num_checkpoints} but {folder} holds {len(found)} checkpoint-<step> folders."
        )
    return [path for _, path in found[-num_checkpoints:]]


def load_weights(checkpoint: str) -> dict[str, torch.Tensor]:
    """The model tensors of a checkpoint folder: every `model*.safetensors` file in it (one or sharded)."""
    from safetensors.torch import load_file

    files = sorted(glob.glob(os.path.join(checkpoint, "model*.safetensors")))
    if not files:
        raise FileNotFoundError(f"No model*.safetensors in {checkpoint} (only safetensors checkpoints are read).")
    out: dict[str, torch.Tensor] = {}
    for path in files:
        out.update(load_file(path))
    return out


def exact_match(completion: str, answer) -> bool:
    """The default scorer: the stripped completion equals the stripped answer."""
    return completion.strip() == str(answer).strip()


def prefix_match(completion: str, answer) -> bool:
    """The stripped completion starts with the stripped answer (for models that keep writing after the answer)."""
    return completion.strip().startswith(str(answer).strip())


def contains_match(completion: str, answer) -> bool:
    """The stripped answer occurs anywhere in the completion (an answer inside a worked solution)."""
    return str(answer).strip() in completion


SCORERS: dict[str, Scorer] = {"exact": exact_match, "prefix": prefix_match, "contains": contains_match}


def _prompt_ids(tokenizer, prompt) -> list[int]:
    if isinstance(prompt, str):
        return tokenizer(prompt, add_special_tokens=False)["input_ids"]
    return _ids(tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=True))


@torch.no_grad()
def sample_completions(
    model,
    tokenizer,
    prompts: Sequence,
    *,
    num_samples: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int = 0,
    batch_size: int = 32,
) -> list[list[str]]:
    """`[P][num_samples]` completions of each prompt (text or chat messages), cut at EOS.

    `temperature=0` is greedy decoding (then `num_samples` must be 1). Sampling runs under `torch.random.fork_rng`
    seeded with `seed`: the same call (same `batch_size` too: the batch rows share the random stream) gives the
    same answers, and the caller's RNG state is untouched.
    """
    from transformers import GenerationConfig

    if temperature == 0 and num_samples != 1:
        raise ValueError(f"`num_samples` must be 1 with greedy decoding (temperature=0), got {num_samples}.")
    pad = pad_id(tokenizer)
    eos = tokenizer.eos_token_id
    decoding = (  # sampling settings only when sampling: transformers warns about them with greedy decoding
        {"do_sample": True, "temperature": float(temperature), "top_p": float(top_p), "top_k": 0}
        if temperature > 0
        else {"do_sample": False}
    )
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        num_return_sequences=num_samples,
        pad_token_id=pad,
        eos_token_id=eos,
        **decoding,
    )
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    texts: list[list[str]] = []
    devices = [device.index or 0] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            for start in range(0, len(prompts), batch_size):
                ids = [_prompt_ids(tokenizer, p) for p in prompts[start : start + batch_size]]
                width = max(map(len, ids))
                input_ids = torch.tensor([[pad] * (width - len(r)) + r for r in ids], device=device)
                attention = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in ids], device=device)
                out = model.generate(input_ids=input_ids, attention_mask=attention, generation_config=config)
                rows = out[:, width:].tolist()
                for p in range(len(ids)):
                    group = []
                    for row in rows[p * num_samples : (p + 1) * num_samples]:
                        end = next((i for i, t in enumerate(row) if t == eos), len(row))
                        group.append(tokenizer.decode(row[:end], skip_special_tokens=True))
                    texts.append(group)
    finally:
        model.train(was_training)
    return texts


def evaluate_pass_at_k(
    model,
    tokenizer,
    dataset,
    *,
    ks: Sequence[int] = (1,),
    num_samples: int = 8,
    scorer: Scorer | None = None,
    max_new_tokens: int = 16,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int = 0,
    batch_size: int = 32,
    prompt_column: str = "prompt",
    answer_column: str = "answer",
) -> dict[str, float]:
    """`{"pass@k": mean pass@k for k in ks, "num_problems": P}` of `model` on `dataset` (rows with `prompt_column`
    and `answer_column`), n = `num_samples` answers per problem scored by `scorer` (default [`exact_match`])."""
    check_pass_at_k_settings(ks, num_samples, temperature, "evaluate_pass_at_k")
    rows = list(dataset)
    for column in (prompt_column, answer_column):
        if rows and column not in rows[0]:
            raise ValueError(f"evaluate_pass_at_k: the dataset has no {column!r} column (columns: {list(rows[0])}).")
    scorer = scorer or exact_match
    completions = sample_completions(
        model,
        tokenizer,
        [r[prompt_column] for r in rows],
        num_samples=num_samples,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        batch_size=batch_size,
    )
    correct = torch.tensor(
        [sum(bool(scorer(t, r[answer_column])) for t in group) for group, r in zip(completions, rows, strict=True)],
        dtype=torch.int64,
    )
    scores = mean_pass_at_k(num_samples, correct, ks) if rows else {k: math.nan for k in ks}
    return {**{f"pass@{k}": v for k, v in scores.items()}, "num_problems": len(rows)}


def check_pass_at_k_settings(ks, num_samples, temperature, who: str) -> tuple[int, ...]:
    """Validates `ks`, `num_samples`, `temperature` together; returns `ks` as a tuple."""
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"{who} `num_samples` must be an integer >= 1, got {num_samples!r}.")
    ks = (ks,) if isinstance(ks, int) else tuple(ks)
    if not ks or any(isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= num_samples for k in ks):
        raise ValueError(f"{who} `ks` must be integers in [1, num_samples={num_samples}], got {list(ks)}.")
    if not isinstance(temperature, (int, float)) or temperature < 0 or math.isnan(temperature):
        raise ValueError(f"{who} `temperature` must be >= 0 (0 = greedy), got {temperature!r}.")
    if temperature == 0 and num_samples != 1:
        raise ValueError(f"{who} `num_samples` must be 1 with greedy decoding (temperature=0), got {num_samples}.")
    return ks
