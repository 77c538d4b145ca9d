"""How `hf-stable sft|grpo|unlearn` end in a launched rank when they fail or are interrupted.

An expected failure (a refused value, a file problem, hf_stable's own stop) becomes one line naming what to change,
and a non-zero exit; anything else keeps its traceback. Under `hf-stable` the launcher sets ``HF_STABLE_ERROR_DIR``:
each rank writes its line there and prints nothing, and the launcher prints each distinct line once after the ranks
are gone (so two ranks failing alike give one line, and a failure on one rank only is not lost when the launcher
stops the others). A script run without `hf-stable` (``python hf_stable/scripts/sft.py``, ``torchrun``) prints the
line from its main process. ``HF_STABLE_DEBUG=1`` gives the traceback instead.

Ctrl-C: the rank exits with 130 and no ``KeyboardInterrupt`` traceback; the launcher says where the last checkpoint
is. A launched multi-process rank leaves through `os._exit` after flushing, for the reason `teardown.py` gives (gloo
threads must not outlive interpreter finalization).
"""

from __future__ import annotations

import os
import re
import signal
import sys
import traceback


ERROR_DIR_ENV = "HF_STABLE_ERROR_DIR"
TRUE_WORDS = ("true", "yes", "1", "on")
FALSE_WORDS = ("false", "no", "0", "off", "none", "")


def is_expected(error: BaseException) -> bool:
    """What a user can cause and fix: refused values (`ValueError`, `TypeError`; hf_stable's config validation
    raises them naming the field), file and disk problems (`OSError`), and hf_stable's deliberate stops."""
    if isinstance(error, (ValueError, TypeError, OSError)):
        return True
    stops = [  # looked up, not imported: an error of these types exists only once its module is loaded
        getattr(sys.modules.get("hf_stable.callbacks.stability"), "TrainingDivergedError", None),
        getattr(sys.modules.get("hf_stable.stability.nograd"), "NoGradientError", None),
    ]
    return any(kind is not None and isinstance(error, kind) for kind in stops)


def one_line(error: BaseException) -> str:
    """The message of ``error`` on one line (library messages often span several)."""
    text = " ".join(str(error).split())
    if isinstance(error, OSError) and not isinstance(error, (FileNotFoundError, FileExistsError, PermissionError)):
        text = f"{text} ({type(error).__name__})"
    return text or type(error).__name__


def resume_argument(value):
    """``--resume_from_checkpoint`` as `Trainer.train` reads it: ``true``/``yes``/``1`` (any case) -> ``True`` (the
    newest checkpoint in ``output_dir``), ``false``/``no``/``0`` -> ``None``, anything else a path."""
    if value is None or isinstance(value, bool):
        return value or None
    word = str(value).strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return None
    return value


def last_checkpoint(output_dir: str | None) -> str | None:
    """The newest ``checkpoint-N`` folder of ``output_dir`` that `Trainer` finished writing (its ``trainer_state.json``
    is written last), or None."""
    if not output_dir or not os.path.isdir(output_dir):
        return None
    steps = []
    for name in os.listdir(output_dir):
        match = re.fullmatch(r"checkpoint-(\d+)", name)
        if match and os.path.isfile(os.path.join(output_dir, name, "trainer_state.json")):
            steps.append((int(match.group(1)), name))
    return os.path.join(output_dir, max(steps)[1]) if steps else None


def interrupted_message(command: str, output_dir: str | None) -> str:
    checkpoint = last_checkpoint(output_dir)
    if checkpoint is None:
        return f"hf-stable {command}: interrupted; no checkpoint was saved"
    return (
        f"hf-stable {command}: interrupted; the last checkpoint is {checkpoint} (continue with "
        "--resume_from_checkpoint true)"
    )


def quiet_interrupts() -> None:
    """First thing in a script's ``__main__``: a Ctrl-C while the libraries load ends the rank at once, quietly."""
    signal.signal(signal.SIGINT, _exit_interrupted)


def _exit_interrupted(signum, frame):
    _flush()
    os._exit(130)


def _flush() -> None:
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()


def _report(line: str) -> None:
    folder = os.environ.get(ERROR_DIR_ENV)
    rank = os.environ.get("RANK", "0")
    if folder and os.path.isdir(folder):
        path = os.path.join(folder, f"rank-{rank}")
        with open(path + ".tmp", "w") as f:
            f.write(line + "\n")
        os.replace(path + ".tmp", path)  # the launcher never reads half a line
    elif rank == "0":
        print(line, file=sys.stderr)


def _leave(code: int) -> None:
    from hf_stable.scripts.teardown import launched_processes

    _flush()
    if launched_processes() > 1:
        os._exit(code)
    sys.exit(code)


def run_script(command: str, make_parser, main) -> None:
    """The ``__main__`` of a training script: parse ``sys.argv`` with ``make_parser()``, call ``main(*parsed)``, and
    end an expected failure or a Ctrl-C as the module docstring says."""
    from hf_stable.cli._quiet import silence_known_warnings

    silence_known_warnings()  # before transformers, peft or bitsandbytes are imported
    output_dir = None
    try:
        # from here a Ctrl-C raises KeyboardInterrupt, so `finally` blocks (temporary folders) run
        signal.signal(signal.SIGINT, signal.default_int_handler)
        parsed = make_parser().parse_args_and_config(fail_with_unknown_args=False)
        output_dir = getattr(parsed[1], "output_dir", None)
        main(*parsed)
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not interrupt the exit
        if not os.environ.get(ERROR_DIR_ENV):  # under hf-stable the launcher says it, once
            _report(interrupted_message(command, output_dir))
        _leave(130)
    except Exception as error:
        if is_expected(error) and not os.environ.get("HF_STABLE_DEBUG"):
            _report(f"hf-stable {command}: error: {one_line(error)}")
            _leave(1)
        from hf_stable.scripts.teardown import launched_processes

        if launched_processes() > 1:  # the traceback, then no finalization with gloo threads alive
            traceback.print_exc()
            _leave(1)
        raise
