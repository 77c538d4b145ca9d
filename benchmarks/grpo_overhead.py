"""Time per optimizer step of StableGRPOTrainer (default config and each variant) against TRL's GRPOTrainer, measured
side by side in one run.

Setup: a Llama-architecture model built from config (`--hidden`, `--layers`, character tokenizer), batch `--batch`
completions (G = 4 per prompt, `--new_tokens` sampled tokens, real generation), rewards `[arithmetic_reward,
length_penalty]`, β = 0, AdamW, fp32, one CPU thread. The model is sized so that one step of TRL's trainer takes
≥ 100 ms of CPU (printed and stored).

Equal work for every arm: the same model, prompts, seed and arguments, and learning rate 0, so no arm's update
changes what the next step generates: every arm samples the same completions (their mean length is stored per arm as
the check), and a ratio measures the trainer's own cost, not a difference in completion length. AdamW still computes
its full update at lr 0.

Arms: `trl` (TRL's `GRPOTrainer`, the baseline); `default` (`StableGRPOTrainer` at its defaults; claim ≤ 1.02×);
the advantage estimators `sgrpo`, `maxrl`, `dvao`, `oblr` (claim ≤ 1.05× each); `delta_l`, `drpo`, `onpolicy_sft`,
`ctwa`; `stable_rank` (one extra forward per completion, by design).

Protocol and clocks: `benchmarks/_paired.py` (the claims use CPU time: the machine is shared, see there).

    OMP_NUM_THREADS=1 python benchmarks/grpo_overhead.py            # the committed run
    OMP_NUM_THREADS=1 python benchmarks/grpo_overhead.py --quick --output_dir /tmp/x    # smoke
"""

from __future__ import annotations

import statistics
import sys
import time

from _paired import check_args, parser, quiet, report, run_paired, select_arms, summarise, time_trainer, trainer_args


ARMS = {
    "trl": None,
    "default": {},
    "sgrpo": {"advantage_estimator": "sgrpo", "loss_type": "dr_grpo", "correctness_reward_index": 0},
    "maxrl": {"advantage_estimator": "maxrl", "correctness_reward_index": 0},
    "dvao": {"advantage_estimator": "dvao"},
    "oblr": {"advantage_estimator": "oblr"},
    "delta_l": {"delta_l_alpha": 1.0, "loss_type": "dr_grpo"},
    "drpo": {"loss_mode": "drpo", "correctness_reward_index": 0},
    "onpolicy_sft": {"loss_mode": "onpolicy_sft", "correctness_reward_index": 0},
    "ctwa": {"reward_weighting": "ctwa"},
    "stable_rank": {"stable_rank_reward": True, "stable_rank_weight": 0.1},
}
TARGETS = {"default": 1.02, "sgrpo": 1.05, "maxrl": 1.05, "dvao": 1.05, "oblr": 1.05}


def length_penalty(completions, **kwargs):
    return [-0.05 * len(c) for c in completions]


def run_arm(arm, cli, data):
    from trl import GRPOConfig, GRPOTrainer

    from hf_stable import StableGRPOConfig, StableGRPOTrainer
    from hf_stable.testing import arithmetic_reward, build_tiny_model

    config = ARMS[arm]
    model, tokenizer = build_tiny_model(
        seed=0, hidden_size=cli.hidden, intermediate_size=2 * cli.hidden, num_hidden_layers=cli.layers
    )

    def make(tmp):
        common = dict(
            **trainer_args(tmp, cli, cli.batch),
            num_generations=4,
            max_completion_length=cli.new_tokens,
            learning_rate=0.0,
            beta=0.0,
            logging_steps=1,
        )
        args = GRPOConfig(**common) if config is None else StableGRPOConfig(**common, **config)
        trainer_cls = GRPOTrainer if config is None else StableGRPOTrainer
        return trainer_cls(
            model=model,
            reward_funcs=[arithmetic_reward, length_penalty],
            args=args,
            train_dataset=data,
            processing_class=tokenizer,
        )

    out, clock = time_trainer(make, cli.warmup)
    lengths = [log["completions/mean_length"] for log in clock.logs if "completions/mean_length" in log]
    out["completion_mean_length"] = statistics.fmean(lengths) if lengths else None
    return out


def main(argv=None):
    p = parser(__doc__.splitlines()[0], repeats=6, steps=6, warmup=2)
    p.add_argument("--hidden", type=int, default=192)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--new_tokens", type=int, default=8)
    cli = p.parse_args(argv)
    if cli.quick:
        cli.repeats, cli.steps, cli.warmup, cli.hidden, cli.layers, cli.batch = 2, 2, 1, 32, 1, 8
    check_args(cli)
    quiet()
    from hf_stable.testing import arithmetic_dataset

    arms = select_arms(cli, list(ARMS), "trl")
    started = time.time()
    data = arithmetic_dataset(512, max_operand=9)
    per_repeat = run_paired(
        arms, lambda arm: run_arm(arm, cli, data), repeats=cli.repeats, baseline="trl", seed=cli.seed
    )
    table = summarise(per_repeat, arms, "trl")
    lengths = {arm: [r["results"][arm]["completion_mean_length"] for r in per_repeat] for arm in arms}
    equal = len({round(v, 6) for vs in lengths.values() for v in vs if v is not None}) <= 1
    setup = {
        "model": f"Llama hidden {cli.hidden}, {cli.layers} layers, intermediate {2 * cli.hidden}, "
        "character tokenizer (vocab 100)",
        "batch": f"{cli.batch} completions (G=4), {cli.new_tokens} new tokens, beta 0",
        "data": "arithmetic_dataset(512, max_operand=9), the same for every arm",
        "optimizer": "AdamW lr 0 (equal work: identical completions in every arm), fp32",
    }
    notes = [
        f"Equal work: mean completion length per arm {'identical in every run' if equal else 'DIFFERS'} "
        f"({', '.join(f'{a} {statistics.fmean(v):.3f}' for a, v in lengths.items() if None not in v)})."
    ]
    return report(
        "grpo_overhead",
        cli,
        setup=setup,
        table=table,
        per_repeat=per_repeat,
        arms=arms,
        baseline="trl",
        targets={arm: target for arm, target in TARGETS.items() if arm in arms},
        started=started,
        notes=notes,
        extra={"equal_work": {"completion_mean_length": lengths, "identical": equal}},
    )


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
