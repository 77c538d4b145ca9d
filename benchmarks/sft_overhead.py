"""Training throughput of StableSFTTrainer per objective against TRL's SFTTrainer, side by side in one run.

    python benchmarks/sft_overhead.py [--steps 60] [--repeats 3] [--hidden 128]

Same tiny model, data, seed and arguments for every row; runs are interleaved (TRL, then each objective, repeated)
so background load affects every row alike. Reported: median optimizer steps per second of `trainer.train()` (model
and dataset preparation excluded) and the ratio to TRL's SFTTrainer (> 1 is faster).
"""

import argparse
import statistics
import time

import datasets
import torch
from transformers import PrinterCallback
from transformers.utils import logging
from trl import SFTConfig, SFTTrainer

from hf_stable import StableSFTConfig, StableSFTTrainer
from hf_stable.testing import arithmetic_dataset, arithmetic_preference_dataset, build_tiny_model


ROWS = {
    "TRL SFTTrainer (nll)": None,
    "hf_stable nll (delegates to TRL)": {},
    "hf_stable prob_power α=1": {"sft_objective": "prob_power", "objective_alpha": 1.0},
    "hf_stable threshold top_p (active)": {"sft_objective": "threshold", "threshold": 0.05},
    "hf_stable auto (probe + objective)": {"sft_objective": "auto", "auto_probe_batches": 4},
    "hf_stable feasible learning": {"sample_reweighting": "feasible"},
    "hf_stable REDI (pairs)": {"sequence_objective": "redi"},
}


def run(config, steps, hidden):
    model, tokenizer = build_tiny_model(seed=0, hidden_size=hidden, intermediate_size=2 * hidden)
    common = dict(
        output_dir="/tmp/hf_stable_bench",
        max_steps=steps,
        per_device_train_batch_size=32,
        learning_rate=1e-3,
        max_length=48,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        disable_tqdm=True,
        logging_steps=10,
        seed=0,
    )
    if config is None:
        trainer = SFTTrainer(
            model=model, args=SFTConfig(**common), train_dataset=arithmetic_dataset(4000), processing_class=tokenizer
        )
    else:
        data = arithmetic_preference_dataset(2000) if config.get("sequence_objective") else arithmetic_dataset(4000)
        trainer = StableSFTTrainer(
            model=model, args=StableSFTConfig(**common, **config), train_dataset=data, processing_class=tokenizer
        )
    trainer.remove_callback(PrinterCallback)  # no log dict per logging step
    start = time.perf_counter()
    trainer.train()
    return steps / (time.perf_counter() - start)


def main(steps, repeats, hidden):
    datasets.disable_progress_bars()
    logging.set_verbosity_error()
    torch.set_num_threads(1)
    rates = {name: [] for name in ROWS}
    for _ in range(repeats):
        for name, config in ROWS.items():
            rates[name].append(run(config, steps, hidden))
    baseline = statistics.median(rates["TRL SFTTrainer (nll)"])
    print(f"{steps} steps, batch 32, hidden {hidden}, {repeats} interleaved repeats, 1 thread\n")
    print(f"{'trainer':<38} {'steps/s':>8} {'vs TRL':>7}")
    for name, values in rates.items():
        median = statistics.median(values)
        print(f"{name:<38} {median:>8.1f} {median / baseline:>6.2f}x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=128)
    args = parser.parse_args()
    main(args.steps, args.repeats, args.hidden)
