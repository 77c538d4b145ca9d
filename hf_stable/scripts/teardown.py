"""The end of a training script under `accelerate launch`: every rank waits, the process group goes, and a
multi-process run exits without interpreter finalization.

Why the last step. ProcessGroupGloo's worker threads free each finished collective's work object themselves, and that
object holds Python references (the thread-local state it captured), so freeing it takes the GIL. When the last
collective's object is freed while the interpreter finalizes, CPython ends the thread inside a C++ destructor and the
rank aborts with "terminate called without an active exception". `scripts/ddp_teardown_stress.py` reproduces that
abort at the end of plain DDP runs, with and without a barrier first (native stacks in docs/distributed.md, "The gloo
teardown race"). The same free waiting for the GIL while a thread holding it waits for the gloo threads would be a
hang; that is our reading of the one CI hang, not observed. `os._exit` after flushing skips finalization, so nothing
is freed on another thread afterwards. A one-process run returns normally.
"""

from __future__ import annotations

import logging
import os
import sys


def launched_processes() -> int:
    """``WORLD_SIZE`` as the launcher set it (it outlives the process group, which `Trainer.end` destroys)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def finish(trainer) -> None:
    """Call last, on every rank: barrier, `Trainer.end()` (trackers, process group), then in a multi-process run
    flush and leave with `os._exit(0)`."""
    # main-process-only work before this (card, push) must finish before any rank tears the process group down
    trainer.accelerator.wait_for_everyone()
    trainer.end()
    leave_without_finalization()


def leave_without_finalization() -> None:
    """In a multi-process run (after the process group is gone): flush logs and streams, then `os._exit(0)`."""
    if launched_processes() > 1:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
