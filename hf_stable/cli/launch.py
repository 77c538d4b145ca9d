"""Launch a training script of `hf_stable.scripts` through `accelerate launch`, the way `trl <command>` does.

Follows `trl/cli/commands/training.py: TrainingCommand.run` and `trl/cli/accelerate_config.py:
resolve_accelerate_config_argument`: the script's own `TrlParser` parses (and validates) the arguments first, what it
does not know goes to `accelerate launch`, and `--accelerate_config NAME` resolves to a YAML shipped in
`hf_stable/accelerate_configs` (or to a file path). TRL's CLI hard-codes the `trl.scripts` package, so hf_stable needs
its own.
"""

from __future__ import annotations

import importlib
import importlib.resources as resources
import os
import sys
from pathlib import Path


ACCELERATE_CONFIGS = ("ddp", "zero2", "zero3", "fsdp2")


def resolve_accelerate_config(launch_args: list[str]) -> list[str]:
    """Replace ``--accelerate_config NAME|PATH`` by ``--config_file <yaml>``."""
    if "--accelerate_config" not in launch_args:
        return launch_args
    i = launch_args.index("--accelerate_config")
    if i + 1 >= len(launch_args):
        raise ValueError(f"--accelerate_config needs a value: one of {', '.join(ACCELERATE_CONFIGS)} or a YAML path.")
    name = launch_args[i + 1]
    if Path(name).is_file():
        path = name
    else:
        candidate = resources.files("hf_stable.accelerate_configs").joinpath(f"{name}.yaml")
        if not candidate.is_file():
            raise ValueError(
                f"--accelerate_config {name!r} is neither a file nor a shipped config. Shipped configs: "
                f"{', '.join(ACCELERATE_CONFIGS)}."
            )
        path = str(candidate)
    return ["--config_file", path, *launch_args[:i], *launch_args[i + 2 :]]


def _subtract_subsequence(items: list[str], subsequence: list[str]) -> list[str]:
    """``items`` without the ordered ``subsequence`` (what remains are the script's own arguments)."""
    it = iter(subsequence)
    current = next(it, None)
    out = []
    for item in items:
        if current is not None and item == current:
            current = next(it, None)
        else:
            out.append(item)
    return out


def run_training_command(name: str, argv: list[str]) -> int:
    """Parse ``argv`` with ``hf_stable.scripts.<name>.make_parser`` (``--help`` exits here), then launch the script.
    ``--push_to_hub ID`` is read as ``--push_to_hub true --hub_model_id ID``, the same spelling as `hf-stable merge`.

    A flag the configs refuse prints one line naming it and returns 2 (``HF_STABLE_DEBUG=1`` shows the traceback)."""
    from accelerate.commands.launch import launch_command, launch_command_parser

    from ..hub_plan import expand_push_to_hub, hub_dry_run_repo

    module = importlib.import_module(f"hf_stable.scripts.{name}")
    parser = module.make_parser(prog=f"hf-stable {name}")
    try:
        argv = expand_push_to_hub(argv)
        script_args, training_args, *_, config_remaining, cli_remaining = parser.parse_args_and_config(
            argv, return_remaining_strings=True, separate_remaining_strings=True
        )
        hub_dry_run_repo(script_args, training_args)  # a dry run without push_to_hub fails here, not after training
        launch_args = resolve_accelerate_config(config_remaining + cli_remaining)
    except (ValueError, TypeError) as err:  # a bad flag or value, found before anything runs: one line, no traceback
        if os.environ.get("HF_STABLE_DEBUG"):
            raise
        print(f"hf-stable {name}: error: {err}", file=sys.stderr)
        return 2
    script_args = _subtract_subsequence(argv, cli_remaining)
    script = str(resources.files("hf_stable.scripts").joinpath(f"{name}.py"))
    launch_command(launch_command_parser().parse_args([*launch_args, script, *script_args]))
    return 0
