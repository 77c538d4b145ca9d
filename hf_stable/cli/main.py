"""`hf-stable`: the console script.

```bash
hf-stable sft --config examples/configs/sft_prob.yaml [--accelerate_config ddp|zero2|zero3|fsdp2]
hf-stable grpo --config examples/configs/grpo_sgrpo.yaml
hf-stable unlearn --config examples/configs/unlearn_simnpo.yaml
hf-stable merge examples/configs/merge_ties.yaml OUT [--dry-run] [--diagnose] [--push-to-hub REPO]
hf-stable eval runs/sft --dataset problems.jsonl --num_checkpoints 4 --num_samples 8 --ks 1,4
hf-stable eval-unlearning --model ./unlearned --benchmark tofu --forget_split forget10 --retain_model ./retain90
hf-stable demo [--output_dir demo_output] [--stages sft,grpo,merge,unlearn,stability,push] [--quick]
hf-stable list [--family sft_objective]
```
"""

from __future__ import annotations

import argparse
import os
import sys


TRAINING_COMMANDS = {
    "sft": "SFT with hf_stable objectives (StableSFTTrainer); --help lists every flag",
    "grpo": "GRPO with hf_stable variants (StableGRPOTrainer); --help lists every flag",
    "unlearn": "Unlearning with UnlearningTrainer (GA, NPO, SimNPO, PDU, StableUN, ...); --help lists every flag",
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-stable", description="Stable post-training on top of TRL.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_text in TRAINING_COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    # `merge` is a single-process job (no accelerate launch): its own parser in `hf_stable.scripts.merge` handles
    # everything after the command name, `--help` included.
    sub.add_parser(
        "merge", help="Merge models from a recipe (streaming engine); --help lists every flag", add_help=False
    )
    sub.add_parser(
        "eval", help="MaP: average the last checkpoints of a run, score pass@k (--help for flags)", add_help=False
    )
    sub.add_parser(
        "eval-unlearning", help="open-unlearning's TOFU/MUSE metrics on a model (--help for flags)", add_help=False
    )
    demo = sub.add_parser("demo", help="End-to-end demo on the bundled tiny model (minutes on a CPU)")
    demo.add_argument("--output_dir", default="demo_output")
    demo.add_argument("--quick", action="store_true", help="A shorter run (for smoke tests)")
    demo.add_argument(
        "--stages",
        default=None,
        help="Comma-separated subset of sft,grpo,merge,unlearn,stability,push (default: all). A stage that needs an "
        "earlier one's output reads it from --output_dir.",
    )
    listing = sub.add_parser("list", help="List the registered methods by family")
    listing.add_argument("--family", default=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    from ._quiet import silence_known_warnings

    silence_known_warnings()  # before transformers, peft or bitsandbytes are imported
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["demo"]:  # it needs no download: keep library imports (bitsandbytes' kernel lookup) off the Hub
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    if args.command in TRAINING_COMMANDS:
        from .launch import run_training_command

        return run_training_command(args.command, argv[argv.index(args.command) + 1 :])
    if args.command == "merge":
        from ..scripts.merge import main as merge_main

        return merge_main(argv[argv.index("merge") + 1 :], prog="hf-stable merge")
    if args.command == "eval":
        from ..scripts.map_eval import main as map_main

        return map_main(argv[argv.index("eval") + 1 :], prog="hf-stable eval")
    if args.command == "eval-unlearning":
        from ..scripts.eval_unlearning import main as eval_main

        return eval_main(argv[argv.index("eval-unlearning") + 1 :], prog="hf-stable eval-unlearning")
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "demo":
        from .demo import parse_stages, run_demo

        try:
            stages = parse_stages(args.stages)
        except ValueError as err:
            parser.error(str(err))
        try:
            run_demo(args.output_dir, quick=args.quick, stages=stages)
        except FileNotFoundError as err:  # a stage whose input stage has not run
            print(err, file=sys.stderr)
            return 1
        return 0
    if args.command == "list":
        from ..registry import list_methods

        list_methods(args.family)
        return 0
    parser.print_help()
    return 1


if __name__ == "__main__":
    sys.exit(main())
