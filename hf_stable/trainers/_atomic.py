"""Saving without half-written folders, and finding the newest checkpoint that is whole.

A checkpoint is written into ``tmp-checkpoint-N/checkpoint-N`` beside the final folder, every file and folder is
fsynced, and only then is it renamed to ``checkpoint-N``. ``tmp-checkpoint-N`` matches neither transformers'
``get_last_checkpoint`` (``^checkpoint-(\\d+)$``) nor its rotation glob (``checkpoint-*``), so a process killed at any
moment of a save leaves either the complete ``checkpoint-N`` or no ``checkpoint-N`` at all. The rename is atomic on a
POSIX filesystem (same directory, same filesystem).

[`last_complete_checkpoint`] is what ``train(resume_from_checkpoint=True)`` resumes from: the newest ``checkpoint-N``
holding weights and a readable ``trainer_state.json``. It also rejects folders written by older versions or by other
writers that a kill left without weights or trainer state.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR


STAGING_PREFIX = "tmp-"
TRAINER_STATE = "trainer_state.json"
MARKERS = ("config.json", "adapter_config.json")  # what `from_pretrained` reads first: they appear last
_CHECKPOINT = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")
_WEIGHTS = re.compile(r"^(model|pytorch_model|adapter_model)(-\d+-of-\d+)?\.(safetensors|bin)(\.index\.json)?$")
_SHARDED_STATES = ("pytorch_model_fsdp", "global_step")  # FSDP's model files/folders; DeepSpeed's global_stepN/


def fsync_tree(folder: str) -> None:
    """fsync every file and folder under ``folder`` (itself included), so a rename after it publishes data that is
    on disk, not only in the page cache."""
    for root, _, files in os.walk(folder, topdown=False):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(root)


def fsync_dir(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish_folder(staged: str, final: str) -> None:
    """Rename the fully written ``staged`` folder to ``final``. A ``final`` that already exists (a run saving again
    into its own output_dir) is first moved aside under a staging name and deleted after, so ``final`` only ever
    names a complete folder."""
    fsync_tree(staged)
    old = None
    if os.path.lexists(final):
        old = os.path.join(os.path.dirname(final), f"{STAGING_PREFIX}old-{os.path.basename(final)}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(staged, final)
    fsync_dir(os.path.dirname(final))
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def publish_files(staged: str, final: str) -> None:
    """Move the files of the fully written ``staged`` folder into the existing folder ``final``, configs last.

    ``final`` is an ``output_dir`` that also holds checkpoints, logs and the card, so it cannot be swapped whole.
    What holds instead: every file appears whole (renamed from a written, fsynced copy); ``config.json`` and
    ``adapter_config.json`` of an earlier save are removed before anything moves, weight files the new save does not
    have are removed, and the new configs move last. A crash part-way leaves a folder without a config, which
    ``from_pretrained`` refuses, never a config beside missing or mixed weights.
    """
    fsync_tree(staged)
    names = set(os.listdir(staged))
    for name in MARKERS:
        if os.path.lexists(os.path.join(final, name)):
            os.remove(os.path.join(final, name))
    for name in os.listdir(final):
        if _WEIGHTS.match(name) and name not in names and os.path.isfile(os.path.join(final, name)):
            os.remove(os.path.join(final, name))
    fsync_dir(final)
    for name in sorted(names, key=lambda n: n in MARKERS):
        target = os.path.join(final, name)
        if os.path.isdir(target) and not os.path.islink(target):
            shutil.rmtree(target)
        os.replace(os.path.join(staged, name), target)
    fsync_dir(final)
    os.rmdir(staged)


_IO_FAILURE = re.compile(r"I/O error|os error \d+|PytorchStreamWriter|inline_container|file write failed|No space")


@contextlib.contextmanager
def staging(folder: str, made: str, final: str, writer: bool):
    """Write inside ``folder``: a leftover of an earlier, unfinished save is removed and ``made`` (``folder`` or a
    folder inside it) created by the writing process; when the body fails, ``folder`` is removed and an I/O failure
    is raised again as an `OSError` naming ``final`` ([`save_error`])."""
    try:
        if writer:
            shutil.rmtree(folder, ignore_errors=True)
            os.makedirs(made)
        yield
    except BaseException as e:
        if writer:
            shutil.rmtree(folder, ignore_errors=True)
        error = save_error(e, final) if isinstance(e, Exception) else None
        if error is not None:
            raise error from e
        raise


def save_error(exc: BaseException, folder: str) -> OSError | None:
    """An `OSError` naming ``folder`` for a failed write, or ``None`` when ``exc`` is not an I/O failure.
    safetensors (`SafetensorError`) and `torch.save` (`RuntimeError` from its zip writer) report a full disk as their
    own exception types, with the OS error only in the text."""
    text = str(exc)
    if isinstance(exc, OSError):
        code, detail = exc.errno, exc.strerror or text
    elif isinstance(exc, Exception) and _IO_FAILURE.search(text):
        found = re.search(r"os error (\d+)", text)
        code, detail = (int(found.group(1)) if found else errno.EIO), text
    else:
        return None
    return OSError(code, f"could not save to {folder}: {detail}")


def _weights_present(folder: str) -> bool:
    for name in os.listdir(folder):
        if name.startswith(_SHARDED_STATES):
            return True
        if _WEIGHTS.match(name) and os.path.getsize(os.path.join(folder, name)) > 0:
            return True
    return False


def checkpoint_problem(folder: str) -> str | None:
    """Why ``folder`` is not a complete checkpoint, or ``None`` when it is."""
    if not _weights_present(folder):
        return "no model weights"
    path = os.path.join(folder, TRAINER_STATE)
    if not os.path.isfile(path):
        return f"no {TRAINER_STATE}"
    try:
        with open(path, encoding="utf-8") as f:
            json.load(f)
    except (OSError, ValueError) as e:
        return f"unreadable {TRAINER_STATE} ({e})"
    return None


def last_complete_checkpoint(output_dir: str) -> tuple[str | None, list[tuple[str, str]]]:
    """``(newest complete checkpoint-N or None, [(folder name, why it was skipped), ...])``: leftover staging
    folders, and every ``checkpoint-N`` newer than the one returned that is incomplete."""
    names = os.listdir(output_dir)
    skipped = [
        (n, "an unfinished save (a process stopped while writing it)")
        for n in sorted(names)
        if n.startswith(STAGING_PREFIX + PREFIX_CHECKPOINT_DIR) or n.startswith(STAGING_PREFIX + "old-")
    ]
    checkpoints = sorted(
        (int(m.group(1)), n)
        for n in names
        if (m := _CHECKPOINT.match(n)) and os.path.isdir(os.path.join(output_dir, n))
    )
    for _, name in reversed(checkpoints):
        problem = checkpoint_problem(os.path.join(output_dir, name))
        if problem is None:
            return os.path.join(output_dir, name), skipped
        skipped.append((name, problem))
    return None, skipped
