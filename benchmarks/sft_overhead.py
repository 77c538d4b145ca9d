"""Time per optimizer step of StableSFTTrainer per objective against TRL's SFTTrainer, side by side in one run.

Setup: a Llama-architecture model built from config (`--hidden`, `--layers`, character tokenizer), batch `--batch`
of arithmetic problems, AdamW, fp32, one CPU thread; the model is sized so that one step of TRL's trainer takes
≥ 100 ms of CPU (printed and stored), so a fixed per-step Python cost shows up at its true relative size.

Same data for every arm: `arithmetic_preference_dataset` expanded into its sequences (each prompt with its correct and
its one-digit-wrong answer, adjacent). TRL and the token objectives train on these prompt/completion rows; REDI reads
the same rows with a ``redi_sign`` column (+1 correct, -1 wrong), so every arm sees the same sequences in the same
order. Arms:

* `trl` — TRL's `SFTTrainer` (the baseline);
* `nll` — `StableSFTTrainer` at its defaults (delegates the loss to TRL: the null arm, expected at 1.00×);
* `prob_power`, `threshold` (active normalisation), `auto` (its probe runs at train begin, before the first timed
  step: a one-time cost, not timed), `feasible` (sample reweighting), `redi` (sequence objective).

Protocol and clocks: `benchmarks/_paired.py` (the claims use CPU time: the machine is shared, see there).

    OMP_NUM_THREADS=1 python benchmarks/sft_overhead.py            # the committed run
    OMP_NUM_THREADS=1 python benchmarks/sft_overhead.py --quick --output_dir /tmp/x    # smoke
"""

from __future__ import annotations

import sys
import time

from _paired import check_args, parser, quiet, report, run_paired, select_arms, summarise, time_trainer, trainer_args


ARMS = {
    "trl": None,
    "nll": {},
    "prob_power": {"sft_objective": "prob_power", "objective_alpha": 1.0},
    "threshold": {"sft_objective": "threshold", "threshold": 0.05},
    "auto": {"sft_objective": "auto", "auto_probe_batches": 4},
    "feasible": {"sample_reweighting": "feasible"},
    "redi": {"sequence_objective": "redi"},
}
TARGETS = {"nll": 1.02, "prob_power": 1.05, "threshold": 1.05}


def dataset(n_pairs: int):
    """The preference set as signed prompt/completion rows, pair members adjacent."""
    from datasets import Dataset

    from hf_stable.testing import arithmetic_preference_dataset

    rows = []
    for ex in arithmetic_preference_dataset(n_pairs, ops=("+", "*")):
        rows.append({"prompt": ex["prompt"], "completion": ex["chosen"], "redi_sign": 1})
        rows.append({"prompt": ex["prompt"], "completion": ex["rejected"], "redi_sign": -1})
    return Dataset.from_list(rows)


def run_arm(arm, cli, data):
    from trl import SFTConfig, SFTTrainer

    from hf_stable import StableSFTConfig, StableSFTTrainer
    from hf_stable.testing import build_tiny_model

    config = ARMS[arm]
    model, tokenizer = build_tiny_model(
        seed=0, hidden_size=cli.hidden, intermediate_size=2 * cli.hidden, num_hidden_layers=cli.layers
    )

    def make(tmp):
        common = dict(**trainer_args(tmp, cli, cli.batch), learning_rate=1e-4, max_length=48, logging_steps=10)
        if config is None:
            return SFTTrainer(
                model=model,
                args=SFTConfig(**common),
                processing_class=tokenizer,
                train_dataset=data.remove_columns("redi_sign"),
            )
        train = data if "sequence_objective" in config else data.remove_columns("redi_sign")
        return StableSFTTrainer(
            model=model, args=StableSFTConfig(**common, **config), processing_class=tokenizer, train_dataset=train
        )

    return time_trainer(make, cli.warmup)[0]


def main(argv=None):
    p = parser(__doc__.splitlines()[0], repeats=6, steps=8, warmup=2)
    p.add_argument("--hidden", type=int, default=192)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=64)
    cli = p.parse_args(argv)
    if cli.quick:
        cli.repeats, cli.steps, cli.warmup, cli.hidden, cli.layers, cli.batch = 2, 2, 1, 32, 1, 8
    check_args(cli)
    quiet()
    arms = select_arms(cli, list(ARMS), "trl")
    started = time.time()
    data = dataset(cli.batch * (cli.warmup + cli.steps) // 2 + cli.batch)
    per_repeat = run_paired(
        arms, lambda arm: run_arm(arm, cli, data), repeats=cli.repeats, baseline="trl", seed=cli.seed
    )
    table = summarise(per_repeat, arms, "trl")
    setup = {
        "model": f"Llama hidden {cli.hidden}, {cli.layers} layers, intermediate {2 * cli.hidden}, "
        "character tokenizer (vocab 100)",
        "batch": f"{cli.batch} sequences (arithmetic, max_length 48)",
        "data": f"{len(data)} signed rows, the same for every arm",
        "optimizer": "AdamW lr 1e-4, fp32",
    }
    notes = [
        "`nll` delegates the loss to TRL, so its ratio is the trainer's fixed overhead; the token objectives "
        "compute the loss from the model's log-probabilities themselves; `auto` runs its probe at train begin, "
        "before the first timed step (a one-time cost, not timed); `redi` and `feasible` add per-sequence "
        "bookkeeping."
    ]
    return report(
        "sft_overhead",
        cli,
        setup=setup,
        table=table,
        per_repeat=per_repeat,
        arms=arms,
        baseline="trl",
        targets={arm: target for arm, target in TARGETS.items() if arm in arms},
        started=started,
        notes=notes,
    )


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
