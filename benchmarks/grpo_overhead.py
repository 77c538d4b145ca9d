"""Training throughput of StableGRPOTrainer (default config and each variant) against TRL's GRPOTrainer, side by side.

    python benchmarks/grpo_overhead.py [--steps 20] [--repeats 5]

Same tiny model, data, seed and arguments for every row, real sampling; rows are interleaved (TRL, then each
variant, repeated) so background load hits them alike. Each cell is `trainer.train()` wall time for `--steps` steps
(model and dataset preparation excluded); printed as steps/s and as the ratio of time to TRL's (< 1 is faster) with
min / median / max over the repeats. Targets: default ≤ 1.02x, each estimator ≤ 1.05x; the stable-rank reward runs
one extra forward per completion and the gradient controller one forward and K backwards per step, by design.
"""

import argparse
import statistics
import time

import datasets
import torch
from transformers import PrinterCallback
from transformers.utils import logging
from trl import GRPOConfig, GRPOTrainer

from hf_stable import StableGRPOConfig, StableGRPOTrainer
from hf_stable.testing import arithmetic_dataset, arithmetic_reward, build_tiny_model


def length_penalty(completions, **kwargs):
    return [-0.05 * len(c) for c in completions]


ROWS = {
    "TRL GRPOTrainer": None,
    "hf_stable default": {},
    "sgrpo": {"advantage_estimator": "sgrpo", "loss_type": "dr_grpo", "correctness_reward_index": 0},
    "maxrl": {"advantage_estimator": "maxrl", "correctness_reward_index": 0},
    "dvao": {"advantage_estimator": "dvao"},
    "oblr": {"advantage_estimator": "oblr"},
    "delta_l": {"delta_l_alpha": 1.0, "loss_type": "dr_grpo"},
    "drpo": {"loss_mode": "drpo", "correctness_reward_index": 0},
    "onpolicy_sft": {"loss_mode": "onpolicy_sft", "correctness_reward_index": 0},
    "ctwa": {"reward_weighting": "ctwa"},
    "stable_rank reward (extra forward)": {"stable_rank_reward": True, "stable_rank_weight": 0.1},
}


def run(config, steps):
    model, tokenizer = build_tiny_model(seed=0)
    common = dict(
        output_dir="/tmp/hf_stable_grpo_bench",
        max_steps=steps,
        per_device_train_batch_size=16,
        num_generations=4,
        max_completion_length=8,
        learning_rate=1e-3,
        beta=0.0,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        disable_tqdm=True,
        logging_steps=steps,
        seed=0,
    )
    if config is None:
        trainer_cls, args = GRPOTrainer, GRPOConfig(**common)
    else:
        trainer_cls, args = StableGRPOTrainer, StableGRPOConfig(**common, **config)
    trainer = trainer_cls(
        model=model,
        reward_funcs=[arithmetic_reward, length_penalty],
        args=args,
        train_dataset=arithmetic_dataset(512, max_operand=9),
        processing_class=tokenizer,
    )
    trainer.remove_callback(PrinterCallback)
    start = time.perf_counter()
    trainer.train()
    return time.perf_counter() - start


def main(steps, repeats):
    datasets.disable_progress_bars()
    logging.set_verbosity_error()
    torch.set_num_threads(1)
    times = {name: [] for name in ROWS}
    for _ in range(repeats):
        for name, config in ROWS.items():
            times[name].append(run(config, steps))
    base = statistics.median(times["TRL GRPOTrainer"])
    print(f"{steps} steps x {repeats} interleaved repeats, batch 16, G=4, 8 new tokens, 1 thread\n")
    print(f"{'trainer':<36} {'steps/s':>8} {'time ratio vs TRL (min / median / max)':>40}")
    for name, values in times.items():
        ratios = sorted(v / base for v in values)
        print(
            f"{name:<36} {steps / statistics.median(values):>8.1f}   "
            f"{ratios[0]:>10.3f} / {statistics.median(ratios):.3f} / {ratios[-1]:.3f}"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    main(args.steps, args.repeats)
