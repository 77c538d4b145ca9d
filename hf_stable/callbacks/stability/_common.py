"""Plumbing shared by the stability callbacks: distributed helpers, ``attach``, self-restoring JSON state."""

from __future__ import annotations

import logging
import math
import os
import weakref

import torch
from transformers.trainer_callback import ExportableState

from ...stability.signals import install_metrics_hook, install_signals


# one logger for the package (users and tests filter on "hf_stable.callbacks.stability")
logger = logging.getLogger("hf_stable.callbacks.stability")
# (kind, name) -> probe set: a callback transformers re-instantiates from its JSON args finds its probes here
_PROBE_SETS: dict[tuple[str, str], object] = {}


class TrainingDivergedError(RuntimeError):
    """Raised by `StabilityGuardCallback(on_exhausted="raise")` once ``max_rollbacks`` is spent (on every rank)."""


def _prompt_completion_batch(rows, processing_class) -> dict:
    """Right-padded ``input_ids``/``attention_mask`` of prompt + completion, ``labels`` on the completion only (the
    tokens an SFT run on prompt/completion data is trained on)."""
    if processing_class is None:
        raise ValueError("a prompt/completion probe needs the trainer's `processing_class` to tokenize it.")
    seqs, starts = [], []
    for row in rows:
        prompt = processing_class(row["prompt"], add_special_tokens=False)["input_ids"]
        full = processing_class(row["prompt"] + row["completion"], add_special_tokens=False)["input_ids"]
        seqs.append(full)
        starts.append(len(prompt))
    width = max(len(s) for s in seqs)
    pad = processing_class.pad_token_id if processing_class.pad_token_id is not None else 0
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    for i, (seq, start) in enumerate(zip(seqs, starts, strict=True)):
        ids[i, : len(seq)] = torch.tensor(seq)
        mask[i, : len(seq)] = 1
        labels[i, start : len(seq)] = torch.tensor(seq[start:])
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _world_size() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _backend(args, model=None, optimizer=None) -> str:
    """ "deepspeed", "fsdp" or "plain" (one process or DDP)."""
    if getattr(args, "deepspeed_plugin", None) is not None or os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true":
        return "deepspeed"
    if type(optimizer).__name__ == "DeepSpeedOptimizerWrapper":
        return "deepspeed"
    if getattr(args, "fsdp", None) or os.environ.get("ACCELERATE_USE_FSDP") == "true":
        return "fsdp"
    if model is not None:
        from ... import distributed

        if distributed.is_fsdp2(model):
            return "fsdp"
    return "plain"


_RESUME_ATTR = "_hf_stable_resume_dir"


def _record_resume_dir(trainer) -> None:
    """Remember the checkpoint ``trainer.train(resume_from_checkpoint=...)`` loads (transformers keeps no record of
    it), so callbacks can read what they saved beside it. Wraps the instance's optimizer loading, once."""
    if _RESUME_ATTR in trainer.__dict__ or not hasattr(trainer, "_load_optimizer_and_scheduler"):
        return
    setattr(trainer, _RESUME_ATTR, None)
    load = trainer._load_optimizer_and_scheduler

    def _load_optimizer_and_scheduler(checkpoint, *args, **kwargs):
        setattr(trainer, _RESUME_ATTR, checkpoint)
        return load(checkpoint, *args, **kwargs)

    trainer._load_optimizer_and_scheduler = _load_optimizer_and_scheduler


def resume_dir(args, state, trainer=None) -> str | None:
    """The checkpoint a resumed run started from: the one the trainer loaded, else ``args.resume_from_checkpoint``,
    else ``output_dir/checkpoint-<global_step>``; None when none of them is a folder."""
    options = [
        getattr(trainer, _RESUME_ATTR, None),
        args.resume_from_checkpoint if isinstance(args.resume_from_checkpoint, str) else None,
        os.path.join(args.output_dir, f"checkpoint-{state.global_step}"),
    ]
    return next((path for path in options if path and os.path.isdir(path)), None)


class _Attachable:
    """``Callback.attach(trainer, **kwargs)``: build the callback, install what it needs on ``trainer``, add it."""

    needs_signals = False

    @classmethod
    def attach(cls, trainer, **kwargs):
        callback = cls(**kwargs)
        if cls.needs_signals:
            install_signals(trainer)
        install_metrics_hook(trainer)
        _record_resume_dir(trainer)
        callback._trainer_ref = weakref.ref(trainer)
        trainer.add_callback(callback)
        return callback


class _SelfRestoring(ExportableState):
    """JSON state that survives a resume without ``restore_callback_states_from_checkpoint=True``.

    ``state()`` stores the constructor arguments and one attribute, ``restored_payload``. If transformers restores
    callback state it builds a new instance and sets that attribute, which queues the payload; otherwise the callback
    reads its own entry from ``TrainerState.stateful_callbacks`` (loaded from the checkpoint's ``trainer_state.json``)
    in ``on_train_begin`` of a resumed run. Instances of one class are matched by their ``name`` argument.
    """

    name: str
    _pending_payload: dict | None = None
    _restored: bool = False

    def _init_args(self) -> dict:
        raise NotImplementedError

    def _export(self) -> dict:
        raise NotImplementedError

    def _import(self, payload: dict) -> None:
        raise NotImplementedError

    def state(self) -> dict:
        return {"args": self._init_args(), "attributes": {"restored_payload": self._export()}}

    @property
    def restored_payload(self):
        return self._pending_payload

    @restored_payload.setter
    def restored_payload(self, payload):
        self._pending_payload = payload

    def _self_restore(self, state) -> bool:
        """Apply a queued or stored payload once; returns True when something was restored."""
        if self._restored:
            return False
        payload = self._pending_payload
        if payload is None and state.global_step > 0:
            entries = (state.stateful_callbacks or {}).get(type(self).__name__)
            entries = entries if isinstance(entries, list) else [entries] if entries else []
            mine = [e for e in entries if isinstance(e, dict) and e.get("args", {}).get("name") == self.name]
            if mine:  # the last one is the newest (transformers appends when a class has several instances)
                payload = mine[-1].get("attributes", {}).get("restored_payload")
        self._pending_payload = None
        if payload is None:
            return False
        self._import(payload)
        self._restored = True
        return True


def _warn_once(obj, key: str, message: str, state=None) -> None:
    warned = obj.__dict__.setdefault("_warned", set())
    if key in warned:
        return
    warned.add(key)
    if state is None or state.is_world_process_zero:
        logger.warning(message)


def _finite_metrics(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if v is not None and math.isfinite(v)}

