"""The skills testbed of the merging experiments (`merge_skills.py`): one tiny Llama base, K experts fine-tuned from
it on genuinely different skills, each scored by greedy exact match on held-out problems of every skill.

* Format: one char per token, fixed width, `<tag><4 digits>=` → 4 answer chars + eos (prompt 6 tokens, answer 4).
  Base tasks (the format and a general mixture): `c` copy (`c4721=` → `4721`) and `o` rotate left by one
  (`o4721=` → `7214`). Skills (one expert each):
  - `s` sort the digits ascending: `s4721=` → `1247` (a comparison over all four digits);
  - `i` add 1 to every digit mod 10: `i4721=` → `5832`;
  - `n` nines' complement of every digit: `n4721=` → `5278`;
  - `t` triple every digit mod 10: `t4721=` → `2163`.
  (Reverse and swap-halves were tried on a pilot seed and dropped: with base-task replay a 64-wide expert learned
  them to only 8-15% EM; add-halves arithmetic reached 4%. Double every digit mod 10 was replaced by triple: in the
  pilot of this design its expert kept 96-100% EM when averaged with a random expert.)
* The regime where task arithmetic is known to work: experts are small moves from a base that already knows the
  format and every skill a little. The base sees each skill only on digit strings whose digits are all below
  `base_skill_digits` (7: 0.7^4 ≈ 24% of the test strings), so it scores ≈ 25% EM per skill, set by the data rather
  than by where training stops; an expert extends its skill to all digits.
* Splits: the 10,000 digit strings are shuffled once (`SPLIT_SEED`, independent of the run seed) into test,
  validation, proxy (a small labelled set for data-driven merges) and training strings, the same for every task.
* Base: `hf_stable.testing`'s tiny Llama from a random init seeded by the run seed, trained on the uniform mixture
  of the base tasks, each row replaced with probability `base_skill_share` by a skill row on small digits (AdamW,
  weight decay 0.01, 5% warmup + linear decay, grad clip 1). Experts: full fine-tuning of the base on one skill's
  training strings (all digits) with half of every batch replayed from the base's own mixture, so an expert keeps
  the base's share of the other skills instead of erasing it (AdamW, weight decay 0 so a task vector holds only
  what the skill moved, LR 1e-3, 10% warmup + linear decay, grad clip 1). Both cached per
  seed under `experiments/cache/<name>/`, keyed by their settings and the skill set.
* Metric: exact match = the 4 greedy answer chars equal the target; loss = mean NLL per supervised token (answer +
  eos, teacher forced).
* Controls every result on this testbed reports (`control_experts_specialise`, `control_merge_can_lose`):
  each expert beats the base on its own skill by a wide margin and is clearly worse than the owning expert on some
  other skill (the skills are different), and a merge that should lose does: averaging an expert with its permuted
  twin (the same network with the residual stream's coordinates and every MLP's hidden units permuted: the same
  function, weights not aligned, as two independently trained models are) costs that expert's skill, so the
  scoring can see a merge lose. The average with a "random expert" (its task vector replaced, tensor by tensor, by
  a Gaussian direction of the same norm) is reported too; it is not the control because in this regime half of a
  task vector plus noise of its norm often keeps the skill (pilot seeds 100-102: −20 to −62 pp by skill, two
  skills' intervals reaching above 0).
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from testbeds import tiny_trl
from testbeds.arithmetic import encoder, warmup_linear


SPLIT_SEED = 4321
PROMPT_LEN, ANSWER_LEN = 6, 4


def _sort(d: str) -> str:
    return "".join(sorted(d))


def _increment(d: str) -> str:
    return "".join(str((int(c) + 1) % 10) for c in d)


def _complement(d: str) -> str:
    return "".join(str(9 - int(c)) for c in d)


def _triple(d: str) -> str:
    return "".join(str(3 * int(c) % 10) for c in d)


BASE_TASKS = {"c": lambda d: d, "o": lambda d: d[1:] + d[0]}
SKILLS = {"s": _sort, "i": _increment, "n": _complement, "t": _triple}
SKILL_NAMES = {"s": "sort", "i": "increment", "n": "complement", "t": "triple"}


@dataclass(frozen=True)
class Sizes:
    """The testbed's sizes; a script subclasses it for its own (a redeclared field keeps its place)."""

    hidden_size: int = 64
    base_steps: int = 1500
    base_batch: int = 64
    base_lr: float = 3e-3
    base_skill_share: float = 0.25
    base_skill_digits: int = 7
    expert_steps: int = 200
    expert_batch: int = 64
    expert_lr: float = 1e-3
    expert_replay: float = 0.5
    num_test: int = 300
    num_val: int = 200
    num_proxy: int = 64


def encode(tag: str, strings: list[str]) -> torch.Tensor:
    """`[n, 11]` token ids: prompt `<tag>dddd=` (6) + 4 answer chars + eos."""
    fn = {**BASE_TASKS, **SKILLS}[tag]
    enc = encoder()
    return torch.tensor([enc(f"{tag}{d}={fn(d)}") for d in strings])


def task_data(sizes: Sizes) -> dict:
    """`{tag: {"train", "val", "test", "proxy"}}` for every base task and skill (one split of the digit strings)."""
    strings = [f"{n:04d}" for n in range(10_000)]
    random.Random(SPLIT_SEED).shuffle(strings)
    cuts = {"test": sizes.num_test, "val": sizes.num_val, "proxy": sizes.num_proxy}
    parts, start = {}, 0
    for key, n in cuts.items():
        parts[key] = strings[start : start + n]
        start += n
    parts["train"] = strings[start:]
    parts["base"] = [d for d in parts["train"] if max(d) < str(sizes.base_skill_digits)]
    return {tag: {k: encode(tag, v) for k, v in parts.items()} for tag in (*BASE_TASKS, *SKILLS)}


def token_loss(model, ids: torch.Tensor) -> torch.Tensor:
    """Mean NLL per supervised token (answer + eos), teacher forced; every row has one length (no padding)."""
    logits = model(input_ids=ids[:, :-1]).logits[:, PROMPT_LEN - 1 :]
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), ids[:, PROMPT_LEN:].reshape(-1)
    )


@torch.no_grad()
def exact_match(model, ids: torch.Tensor) -> float:
    """Share of rows whose 4 greedy answer chars equal the target."""
    was_training = model.training
    model.eval()
    seq = ids[:, :PROMPT_LEN]
    for _ in range(ANSWER_LEN):
        seq = torch.cat([seq, model(input_ids=seq).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    model.train(was_training)
    return (seq[:, PROMPT_LEN:] == ids[:, PROMPT_LEN : PROMPT_LEN + ANSWER_LEN]).all(1).float().mean().item()


def _train(model, batches, steps: int, lr: float, weight_decay: float, warmup: float) -> list[float]:
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_linear(steps, warmup))
    losses = []
    model.train()
    for _ in range(steps):
        loss = token_loss(model, next(batches))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _spec(sizes: Sizes, prefix: str) -> dict:
    fields = {k: v for k, v in asdict(sizes).items() if k.startswith(prefix) or k == "hidden_size"}
    return {**fields, "split_seed": SPLIT_SEED, "base_tasks": sorted(BASE_TASKS), "skills": sorted(SKILLS),
            "format": "tag4=4"}


def base_dir(name: str, seed: int, sizes: Sizes) -> Path:
    return tiny_trl.cache_dir(name, "skills_base", seed, _spec(sizes, "base"))


def expert_dir(name: str, seed: int, sizes: Sizes, skill: str) -> Path:
    spec = {**_spec(sizes, "base"), **_spec(sizes, "expert"), "skill": skill, "replay": "base mixture"}
    return tiny_trl.cache_dir(name, f"skills_expert_{skill}", seed, spec)


def _save(model, tokenizer, path: Path, info: dict) -> None:
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    (path / "done.json").write_text(json.dumps(info))


def mixture_rows(data: dict, sizes: Sizes, n: int, gen: torch.Generator) -> torch.Tensor:
    """`[n, 11]` rows of the base's mixture: base-task rows, each replaced with probability `base_skill_share` by a
    skill row on small digits."""
    pool = torch.cat([data[t]["train"] for t in BASE_TASKS])
    skill_pool = torch.cat([data[t]["base"] for t in SKILLS])
    rows = pool[torch.randint(0, len(pool), (n,), generator=gen)]
    from_skill = torch.rand(n, generator=gen) < sizes.base_skill_share
    picks = skill_pool[torch.randint(0, len(skill_pool), (n,), generator=gen)]
    return torch.where(from_skill[:, None], picks, rows)


def pretrain(name: str, seed: int, sizes: Sizes, data: dict) -> Path:
    """The seed's base trained on the base-task mixture, cached under `experiments/cache/<name>/`."""
    path = base_dir(name, seed, sizes)
    if tiny_trl.cached(path, seed, "skills base"):
        return path
    start = time.time()
    model, tokenizer = tiny_trl.tiny_llama(seed, sizes.hidden_size, max_position_embeddings=16)
    gen = torch.Generator().manual_seed(seed)
    batches = (mixture_rows(data, sizes, sizes.base_batch, gen) for _ in iter(int, 1))
    losses = _train(model, batches, sizes.base_steps, sizes.base_lr, 0.01, 0.05)
    em = {t: exact_match(model, data[t]["val"]) for t in (*BASE_TASKS, *SKILLS)}
    _save(model, tokenizer, path, {"val_em": em, "last_loss": losses[-1], "seconds": time.time() - start})
    print(f"[seed {seed}] skills base: val EM {em} in {time.time() - start:.0f}s", flush=True)
    return path


def finetune(name: str, seed: int, sizes: Sizes, data: dict, skill: str) -> Path:
    """The expert for `skill`: the seed's base fully fine-tuned on that skill alone, cached like the base."""
    path = expert_dir(name, seed, sizes, skill)
    if tiny_trl.cached(path, seed, f"skills expert {skill}"):
        return path
    start = time.time()
    model = load(pretrain(name, seed, sizes, data))
    from hf_stable.testing import build_tiny_tokenizer

    own = data[skill]["train"]
    gen = torch.Generator().manual_seed(1000 * seed + ord(skill))
    n_replay = round(sizes.expert_replay * sizes.expert_batch)

    def batch():
        rows = own[torch.randint(0, len(own), (sizes.expert_batch - n_replay,), generator=gen)]
        return torch.cat([rows, mixture_rows(data, sizes, n_replay, gen)])

    batches = (batch() for _ in iter(int, 1))
    losses = _train(model, batches, sizes.expert_steps, sizes.expert_lr, 0.0, 0.1)
    em = exact_match(model, data[skill]["val"])
    _save(model, build_tiny_tokenizer(), path, {"val_em": em, "last_loss": losses[-1], "seconds": time.time() - start})
    print(f"[seed {seed}] skills expert {skill}: val EM {em:.3f} in {time.time() - start:.0f}s", flush=True)
    return path


def load(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path)


def build(name: str, seed: int, sizes: Sizes, data: dict) -> tuple[object, dict, dict]:
    """`(model, base weights, {skill: expert weights})`; `model` is a working copy the merges are loaded into."""
    model = load(pretrain(name, seed, sizes, data))
    base = weights(model)
    experts = {s: weights(load(finetune(name, seed, sizes, data, s))) for s in SKILLS}
    return model, base, experts


# ---------------------------------------------------------------------------------------------------------------------
# weights as `{name: tensor}` (tied embeddings once) and scoring


def weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@torch.no_grad()
def put(model, params: dict[str, torch.Tensor]):
    """Load `params` into `model` (in place) and return it."""
    for n, p in model.named_parameters():
        p.copy_(params[n])
    return model


def score(model, params: dict, data: dict, skills, split: str = "test") -> dict[str, float]:
    """`{skill: exact match}` of `params` on `split` of each skill."""
    put(model, params)
    return {s: exact_match(model, data[s][split]) for s in skills}


def random_expert(base: dict, expert: dict, seed: int) -> dict:
    """`base + ε`, each tensor's ε a Gaussian direction with the norm of that tensor's task vector `expert − base`."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for n, b in base.items():
        eps = torch.randn(b.shape, generator=g)
        out[n] = b + eps * (expert[n] - b).norm() / eps.norm().clamp_min(1e-12)
    return out


def permuted_twin(params: dict, seed: int) -> dict:
    """The same network in another basis: the residual stream's coordinates permuted (input columns of every
    projection and of the tied embedding, output rows of `o_proj`/`down_proj`, the RMSNorm gains; RoPE acts on the
    heads' own coordinates, untouched) and the hidden units of every MLP permuted. It computes exactly the same
    function, but its weights are not aligned with `params`' (as two independently trained models are not)."""
    g = torch.Generator().manual_seed(seed)
    d = params["model.embed_tokens.weight"].shape[1]
    res = torch.randperm(d, generator=g)
    out = {}
    for n, w in params.items():
        if w.dim() == 1:
            out[n] = w[res]
        elif n.endswith(("o_proj.weight", "down_proj.weight")):
            out[n] = w[res]
        else:
            out[n] = w[:, res]
    for n in params:
        if n.endswith("mlp.gate_proj.weight"):
            pre = n[: -len("gate_proj.weight")]
            unit = torch.randperm(params[n].shape[0], generator=g)
            out[pre + "gate_proj.weight"] = out[pre + "gate_proj.weight"][unit]
            out[pre + "up_proj.weight"] = out[pre + "up_proj.weight"][unit]
            out[pre + "down_proj.weight"] = out[pre + "down_proj.weight"][:, unit]
    return out


def average(models: list[dict]) -> dict:
    return {n: sum(m[n] for m in models) / len(models) for n in models[0]}


def skill_matrix(model, base: dict, experts: dict, data: dict, split: str = "test") -> dict:
    """`{"base": {skill: EM}, "experts": {owner: {skill: EM}}}` on every skill."""
    return {
        "base": score(model, base, data, SKILLS, split),
        "experts": {o: score(model, e, data, SKILLS, split) for o, e in experts.items()},
    }


def merge_can_lose(model, base: dict, experts: dict, data: dict, seed: int) -> dict:
    """Per skill: the expert's own test EM, that of the average of the expert with its permuted twin (the control)
    and that of the average with a same-norm random expert (reported)."""
    out = {}
    for k, (s, e) in enumerate(experts.items()):
        rnd = random_expert(base, e, 7000 + 100 * seed + k)
        out[s] = {
            "expert": score(model, e, data, [s])[s],
            "with_permuted": score(model, average([e, permuted_twin(e, 8000 + 100 * seed + k)]), data, [s])[s],
            "with_random": score(model, average([e, rnd]), data, [s])[s],
        }
    return out


# ---------------------------------------------------------------------------------------------------------------------
# the controls (criteria of every result on this testbed)

T975 = {2: 12.706, 3: 4.303, 4: 3.182, 5: 2.776, 6: 2.571, 7: 2.447, 8: 2.365}  # Student t, two-sided 95%, df n − 1
OWN_MARGIN = 0.5  # an expert beats the base on its own skill by ≥ 50 pp (lower CI end)
OTHER_MARGIN = 0.3  # ... and is ≥ 30 pp worse than the owning expert on some other skill (lower CI end)
LOSE_MARGIN = 0.2  # the merge that should lose costs ≥ 20 pp of the expert's skill (upper CI end of the change)


def paired(a: list[float], b: list[float]) -> dict:
    """Mean of the paired differences `a − b` over seeds and its 95% Student-t interval (infinite for one seed)."""
    d = [x - y for x, y in zip(a, b, strict=True)]
    n, mean = len(d), sum(d) / len(d)
    if n > 1:
        sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1))
        half = T975[n] * sd / math.sqrt(n)
    else:
        half = math.inf
    return {"mean": mean, "ci_low": mean - half, "ci_high": mean + half, "n": n, "differences": d}


def controls(per_seed: dict) -> dict:
    """The testbed's two controls from each seed's `skill_matrix` (key "matrix") and `merge_can_lose` (key
    "can_lose"); criterion dicts as the harness stores them."""
    from _harness import criterion

    seeds = list(per_seed)
    own, other, lose = {}, {}, {}
    for s in SKILLS:
        mine = [per_seed[x]["matrix"]["experts"][s][s] for x in seeds]
        own[s] = paired(mine, [per_seed[x]["matrix"]["base"][s] for x in seeds])
        # the other skill on which this expert falls furthest behind that skill's owner (chosen per seed)
        gaps = [
            max(
                per_seed[x]["matrix"]["experts"][o][o] - per_seed[x]["matrix"]["experts"][s][o]
                for o in SKILLS
                if o != s
            )
            for x in seeds
        ]
        other[s] = paired(gaps, [0.0] * len(seeds))
        lose[s] = paired(
            [per_seed[x]["can_lose"][s]["with_permuted"] for x in seeds],
            [per_seed[x]["can_lose"][s]["expert"] for x in seeds],
        )
    worst_own = min(own, key=lambda s: own[s]["ci_low"])
    worst_lose = max(lose, key=lambda s: lose[s]["ci_high"])
    rnd = {
        s: paired([per_seed[x]["can_lose"][s]["with_random"] for x in seeds],
                  [per_seed[x]["can_lose"][s]["expert"] for x in seeds])
        for s in SKILLS
    }
    passed_a = all(own[s]["ci_low"] >= OWN_MARGIN for s in SKILLS) and all(
        other[s]["ci_low"] >= OTHER_MARGIN for s in SKILLS
    )
    keep = ("mean", "ci_low", "ci_high", "n")
    return {
        "control_experts_specialise": criterion(
            f"control (must pass): every expert beats the base on its own skill by ≥ {OWN_MARGIN * 100:g} pp of "
            f"exact match and is ≥ {OTHER_MARGIN * 100:g} pp worse than the owning expert on some other skill "
            "(lower ends of the 95% t-intervals over seeds)",
            passed_a,
            {
                **{k: own[worst_own][k] for k in keep},
                "worst_own_skill": worst_own,
                "own_minus_base": {s: {k: v[k] for k in keep} for s, v in own.items()},
                "owner_minus_expert_on_other": {s: {k: v[k] for k in keep} for s, v in other.items()},
            },
            f"{sum(all(per_seed[x]['matrix']['experts'][s][s] - per_seed[x]['matrix']['base'][s] >= OWN_MARGIN for s in SKILLS) for x in seeds)}/{len(seeds)} seeds",  # noqa: E501
        ),
        "control_merge_can_lose": criterion(
            "control (must fail, detection): averaging an expert with its permuted twin (the same function, residual "
            "stream and MLP units permuted) costs that expert's skill: the 95% t-interval of the paired EM change "
            f"lies below −{LOSE_MARGIN * 100:g} pp for every skill (the criterion passes when the merge loses)",
            all(lose[s]["ci_high"] <= -LOSE_MARGIN for s in SKILLS),
            {
                **{k: lose[worst_lose][k] for k in keep},
                "worst_skill": worst_lose,
                "per_skill": {s: {k: v[k] for k in keep} for s, v in lose.items()},
                "with_random_per_skill": {s: {k: v[k] for k in keep} for s, v in rnd.items()},
            },
            f"{sum(all(per_seed[x]['can_lose'][s]['with_permuted'] - per_seed[x]['can_lose'][s]['expert'] <= -LOSE_MARGIN for s in SKILLS) for x in seeds)}/{len(seeds)} seeds",  # noqa: E501
        ),
    }
