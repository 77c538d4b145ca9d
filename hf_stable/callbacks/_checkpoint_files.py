"""Callback state kept as files inside `checkpoint-N`, for state too large for `trainer_state.json` (tensors).

The hf_stable trainers save a checkpoint atomically (a staged folder, renamed when complete) and call each callback's
``write_checkpoint_state(folder, args, state)`` with the staged folder, so the files are part of the checkpoint or
absent with it. [`CheckpointFiles`] implements that hook and falls back to ``on_save`` (the final folder, after the
checkpoint is complete) under a trainer without it; small JSON state stays with transformers' ``ExportableState``.
"""

from __future__ import annotations

import os

import torch
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR


def save_tensors(path: str, tensors: dict[str, torch.Tensor]) -> None:
    """``tensors`` to the safetensors file ``path`` (temporary file, then rename; an empty dict is written too)."""
    from safetensors.torch import save_file

    os.makedirs(os.path.dirname(path), exist_ok=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, path + ".tmp")
    os.replace(path + ".tmp", path)


def resumed_file(args, state, relative: str) -> str | None:
    """``relative`` inside the checkpoint this run resumed from (``args.resume_from_checkpoint`` or
    ``output_dir/checkpoint-<global_step>``, whichever is named after the resumed step), or ``None``."""
    name = f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
    for folder in (args.resume_from_checkpoint, os.path.join(args.output_dir, name)):
        if isinstance(folder, (str, os.PathLike)) and os.path.basename(os.path.normpath(folder)) == name:
            path = os.path.join(folder, relative)
            if os.path.isfile(path):
                return path
    return None


class CheckpointFiles:
    """Mixin for a `TrainerCallback`: define ``_write_checkpoint_files(folder, args, state)``; it runs once per save,
    on every process, inside the atomic save when the trainer offers it, else in ``on_save``."""

    _written_step: int | None = None

    def _write_checkpoint_files(self, folder: str, args, state) -> None:
        raise NotImplementedError

    def write_checkpoint_state(self, folder: str, args, state) -> None:
        self._written_step = state.global_step
        self._write_checkpoint_files(folder, args, state)

    def on_save(self, args, state, control, **kwargs):
        if self._written_step != state.global_step:  # a trainer without the atomic-save hook
            folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
            self.write_checkpoint_state(folder, args, state)
