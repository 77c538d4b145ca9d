"""Launch a training script of `hf_stable.scripts` through `accelerate launch`, the way `trl <command>` does.

Follows `trl/cli/commands/training.py: TrainingCommand.run` and `trl/cli/accelerate_config.py:
resolve_accelerate_config_argument`: the script's own `TrlParser` parses (and validates) the arguments first, what it
does not know goes to `accelerate launch`, and `--accelerate_config NAME` resolves to a YAML shipped in
`hf_stable/accelerate_configs` (or to a file path). TRL's CLI hard-codes the `trl.scripts` package, so hf_stable needs
its own.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import importlib.resources as resources
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from ..scripts.entry import one_line


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


def _launcher_options() -> dict[str, int]:
    """`accelerate launch`'s flags, each with how many values it takes (0 or 1 here)."""
    from accelerate.commands.launch import launch_command_parser

    options = {}
    for flag, action in launch_command_parser()._option_string_actions.items():
        options[flag] = 0 if action.nargs == 0 else 1
    options["--accelerate_config"] = 1
    return options


def check_launcher_args(parser, config_remaining: list[str], cli_remaining: list[str], config: str | None) -> None:
    """What the script's parser left must be `accelerate launch` flags: anything else is a typo, reported here with
    the closest flag (instead of accelerate's usage text after it parsed everything else)."""
    launcher = _launcher_options()
    known = sorted({*launcher, *(f for f in parser._option_string_actions if f.startswith("--"))})

    def closest(flag: str) -> str | None:
        match = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
        return match[0] if match else None

    every_flag = f"`{parser.prog} --help` lists every flag"
    for key in config_remaining[::2]:  # TrlParser returns each unknown YAML key as `--key value`
        if key not in launcher:
            match = closest(key)
            hint = f"did you mean `{match[2:]}`?" if match else every_flag
            raise ValueError(f"unknown field `{key[2:]}` in {config}; {hint}")
    expects_value = False
    for token in cli_remaining:
        if expects_value:
            expects_value = False
        elif token.startswith("-"):
            flag = token.split("=", 1)[0]
            if flag not in launcher:
                match = closest(flag)
                raise ValueError(f"unknown flag {flag}; " + (f"did you mean {match}?" if match else every_flag))
            expects_value = launcher[flag] == 1 and "=" not in token
        else:
            raise ValueError(f"unexpected argument {token!r} (flags are spelled --name value)")


def _error_lines(folder: str) -> list[str]:
    """The distinct one-line errors the ranks wrote (`hf_stable.scripts.entry`), rank 0's first."""
    lines: list[str] = []
    for name in sorted(os.listdir(folder), key=lambda n: (len(n), n)):
        if name.startswith("rank-") and not name.endswith(".tmp"):
            with open(os.path.join(folder, name)) as f:
                line = f.read().strip()
            if line and line not in lines:
                lines.append(line)
    return lines


def parse_launcher_args(launch_argv: list[str]):
    """`accelerate launch`'s namespace; a bad value raises `ValueError` (one line) instead of printing its usage."""
    from accelerate.commands.launch import launch_command_parser

    parser = launch_command_parser()

    def refuse(message):
        raise ValueError(f"accelerate launch: {message}")

    parser.error = refuse
    return parser.parse_args(launch_argv)


def _launch(name: str, launch_args, output_dir: str | None) -> int:
    """`accelerate launch` with our own ending: each distinct rank error once, the interruption once, no launcher
    traceback. Returns the exit status."""
    previous = signal.getsignal(signal.SIGINT)
    try:
        return _launch_and_report(name, launch_args, output_dir)
    finally:
        signal.signal(signal.SIGINT, previous)


def _launch_and_report(name: str, launch_args, output_dir: str | None) -> int:
    import logging

    from accelerate.commands.launch import launch_command

    from ..scripts.entry import ERROR_DIR_ENV, interrupted_message

    existed = bool(output_dir) and os.path.exists(output_dir)
    # torch's elastic agent (multi-process launches) logs each failed or stopped rank; the lines below say it once
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    with tempfile.TemporaryDirectory(prefix="hf-stable-errors-") as folder:
        os.environ[ERROR_DIR_ENV] = folder  # the ranks inherit it
        code = 0
        try:
            launch_command(launch_args)
        except KeyboardInterrupt:
            code = 130
        except SystemExit as exit_:  # accelerate's own exits: 130 on Ctrl-C, 128 + signal, 1
            code = exit_.code if isinstance(exit_.code, int) else 1
        except subprocess.CalledProcessError as error:  # the one-process launcher
            code = error.returncode
        except ValueError as error:  # accelerate refused its own settings (e.g. an accelerate config's values)
            if os.environ.get("HF_STABLE_DEBUG"):
                raise
            print(f"hf-stable {name}: error: accelerate launch: {one_line(error)}", file=sys.stderr)
            return 2
        except Exception as error:  # torch's ChildFailedError (several processes)
            if type(error).__name__ != "ChildFailedError":
                raise
            code = 1
        finally:
            os.environ.pop(ERROR_DIR_ENV, None)
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # the ranks are gone: a second Ctrl-C must not cut this short
        if code == 0:
            return 0
        lines = _error_lines(folder)
    if output_dir and not existed:  # a folder the failed run created and left empty goes (rmdir: only if empty)
        with contextlib.suppress(OSError):
            os.rmdir(output_dir)
    if lines:
        print("\n".join(lines), file=sys.stderr)
        return 1
    if code in (130, -signal.SIGINT):
        print(interrupted_message(name, output_dir), file=sys.stderr)
        return 130
    print(f"hf-stable {name}: the training process failed (exit status {code}; its output is above).", file=sys.stderr)
    return code if 0 < code < 256 else 1


def run_training_command(name: str, argv: list[str]) -> int:
    """Parse ``argv`` with ``hf_stable.scripts.<name>.make_parser`` (``--help`` exits here), check what can be checked
    before launching (`hf_stable.scripts.preflight`), then launch the script. ``--push_to_hub ID`` is read as
    ``--push_to_hub true --hub_model_id ID``, the same spelling as `hf-stable merge`.

    Every expected failure is one line on stderr and a non-zero status (``HF_STABLE_DEBUG=1`` shows the traceback):
    2 for what is found before the launch, 1 for what a rank finds, 130 for Ctrl-C."""
    try:
        return _run_training_command(name, argv)
    except KeyboardInterrupt:  # while parsing and checking: nothing was launched
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        print(f"hf-stable {name}: interrupted; nothing was launched", file=sys.stderr)
        return 130


def _run_training_command(name: str, argv: list[str]) -> int:
    from ..hub_plan import expand_push_to_hub, hub_dry_run_repo
    from ..scripts.preflight import check_before_launch

    module = importlib.import_module(f"hf_stable.scripts.{name}")
    parser = module.make_parser(prog=f"hf-stable {name}")
    try:
        argv = expand_push_to_hub(argv)
        *parsed, config_remaining, cli_remaining = parser.parse_args_and_config(
            argv, return_remaining_strings=True, separate_remaining_strings=True
        )
        config = argv[argv.index("--config") + 1] if "--config" in argv[:-1] else None
        check_launcher_args(parser, config_remaining, cli_remaining, config)
        script_args, training_args = parsed[:2]
        hub_dry_run_repo(script_args, training_args)  # a dry run without push_to_hub fails here, not after training
        check_before_launch(name, tuple(parsed))
        script_argv = _subtract_subsequence(argv, cli_remaining)
        script = str(resources.files("hf_stable.scripts").joinpath(f"{name}.py"))
        launch_args = resolve_accelerate_config(config_remaining + cli_remaining)
        launch_args = parse_launcher_args([*launch_args, script, *script_argv])
    except (ValueError, TypeError, OSError) as err:  # found before anything runs: one line, no traceback
        if os.environ.get("HF_STABLE_DEBUG"):
            raise
        print(f"hf-stable {name}: error: {one_line(err)}", file=sys.stderr)
        return 2
    return _launch(name, launch_args, training_args.output_dir)
