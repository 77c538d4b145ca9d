"""TRL's GRPO generation buffer in a checkpoint, so a run resumed inside it continues exactly.

`GRPOTrainer` generates once every ``steps_per_generation × num_iterations`` micro-steps and feeds the slices of that
generation batch (``_buffered_inputs``) to the micro-steps in between, counted by ``_step``. Neither is checkpointed:
a run resumed from a checkpoint that falls inside the buffer regenerates from the resumed weights and restarts the
slice count, so its updates differ from the uninterrupted run's (TRL: "``_buffered_inputs=None`` can occur when
resuming from a checkpoint"). The buffer is small (token ids, masks, advantages and log-probs of one generation batch),
so `StableGRPOTrainer` saves it with its state when a checkpoint falls inside it: tensors to safetensors, the other
values (``None``, lists of ints) to JSON.

Each process holds its own slices; the state is written by the main process only, so under several processes the
buffer is not saved and a resumed run regenerates as TRL does (a warning says so).
"""

from __future__ import annotations

import json
import logging

import torch


logger = logging.getLogger(__name__)
PREFIX = "grpo_buffer."


def mid_buffer(trainer) -> bool:
    """Whether the next micro-step reuses the buffer instead of generating."""
    generate_every = trainer.args.steps_per_generation * trainer.num_iterations
    return trainer._buffered_inputs is not None and trainer._step % generate_every != 0


def pack(trainer) -> tuple[dict[str, torch.Tensor], dict]:
    """``(tensors, meta)`` for the trainer's state: the micro-step count always, the buffer when inside it."""
    meta: dict = {"trl_step": trainer._step}
    if not mid_buffer(trainer):
        return {}, meta
    if trainer.accelerator.num_processes > 1:
        logger.warning(
            "This checkpoint falls inside a GRPO generation batch; under several processes the buffered slices are "
            "not saved, so a run resumed from it regenerates them from the resumed weights (TRL's behaviour)."
        )
        return {}, meta
    tensors, others = {}, []
    for i, batch in enumerate(trainer._buffered_inputs):
        rest = {}
        for key, value in batch.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{PREFIX}{i}.{key}"] = value.detach().clone()  # slices share storage: safetensors refuses
            else:
                rest[key] = value
        others.append(rest)
    try:
        json.dumps(others)
    except TypeError:
        logger.warning("The GRPO generation buffer holds values JSON cannot store; it is not saved.")
        return {}, meta
    meta["grpo_buffer"] = others
    return tensors, meta


def unpack(trainer, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """Restore what `pack` saved (the buffer moved to the trainer's device)."""
    if "trl_step" in meta:
        trainer._step = int(meta["trl_step"])
    others = meta.get("grpo_buffer")
    if others is None:
        return
    if len(others) != trainer.args.steps_per_generation:
        logger.warning(
            f"The checkpoint's GRPO generation buffer has {len(others)} slices but steps_per_generation="
            f"{trainer.args.steps_per_generation}: it is not restored and the next step generates afresh."
        )
        trainer._buffered_inputs = None
        return
    device = trainer.accelerator.device
    buffer = [dict(rest) for rest in others]
    for name, value in tensors.items():
        if name.startswith(PREFIX):
            index, key = name[len(PREFIX) :].split(".", 1)
            buffer[int(index)][key] = value.to(device)
    trainer._buffered_inputs = buffer
