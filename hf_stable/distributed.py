"""Main-process-only and gather helpers for DDP, DeepSpeed ZeRO-3 and FSDP2 (DESIGN.md "Distributed is normal").

Every function here is safe to call outside a distributed run (one process: main, no-op barrier, plain state dict).
Collective functions (``barrier``, ``gather_full_state_dict``) must be called on **every** rank; only the main
process gets the result.

Tested here: one process and two-process CPU DDP (gloo). The ZeRO-3 path (``deepspeed.zero.GatheredParameters``, one
module at a time, as ``transformers.integrations.deepspeed`` and accelerate's ``get_state_dict`` do) and the FSDP2
path (``torch.distributed.checkpoint.state_dict.get_model_state_dict(full_state_dict=True, cpu_offload=True)``)
follow the libraries' documented APIs but are untested in this repository (no GPUs / DeepSpeed in CI).
"""

from __future__ import annotations

import os

import torch


def _dist_ready() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def process_index() -> int:
    """Global rank (0 outside a distributed run; falls back to ``RANK`` before the process group exists)."""
    if _dist_ready():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", "0"))


def num_processes() -> int:
    return torch.distributed.get_world_size() if _dist_ready() else 1


def is_main_process() -> bool:
    """True on global rank 0 (and in a single-process run)."""
    return process_index() == 0


def barrier() -> None:
    """Waits for every process; a no-op outside a distributed run. Call it on every rank."""
    if _dist_ready() and torch.distributed.get_world_size() > 1:
        torch.distributed.barrier()


def unwrap_model(model, accelerator=None):
    """The bare model under DDP / ``torch.compile`` / DeepSpeed wrappers (`Accelerator.unwrap_model` if given)."""
    if accelerator is not None:
        return accelerator.unwrap_model(model)
    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        for attr in ("module", "_orig_mod"):  # DDP / DeepSpeedEngine, torch.compile
            inner = getattr(model, attr, None)
            if isinstance(inner, torch.nn.Module):
                model = inner
                break
    return model


def is_zero3_partitioned(model) -> bool:
    """True when DeepSpeed ZeRO-3 has partitioned the parameters (they carry ``ds_id`` / ``ds_status``)."""
    return any(hasattr(p, "ds_id") for p in model.parameters())


def is_fsdp2(model) -> bool:
    """True when FSDP2 (``fully_shard``) has turned the parameters into DTensors."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - old torch
        return False
    return any(isinstance(p, DTensor) for p in model.parameters())


def gather_full_state_dict(model, accelerator=None) -> dict[str, torch.Tensor] | None:
    """The full (unsharded) state dict on CPU on the main process, ``None`` on the others. Collective: call it on
    every rank.

    * one process / DDP: the unwrapped model's ``state_dict()``, detached and on CPU (no communication).
    * DeepSpeed ZeRO-3: each module's own parameters are gathered with ``deepspeed.zero.GatheredParameters``
      (``modifier_rank=None``: read-only), one module at a time, so peak memory is one layer (untested here).
    * FSDP2: ``get_model_state_dict(full_state_dict=True, cpu_offload=True)`` (rank 0 receives it; untested here).

    Tied parameters appear under each of their names, as ``state_dict()`` gives them; ``save_pretrained`` drops the
    duplicates.
    """
    bare = unwrap_model(model, accelerator)
    main = accelerator.is_main_process if accelerator is not None else is_main_process()
    if is_fsdp2(bare):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(bare, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return state if main else None
    if is_zero3_partitioned(bare):
        return _gather_zero3(bare, main)
    if not main:
        return None
    return {name: t.detach().cpu() for name, t in bare.state_dict().items()}


def _gather_zero3(model, main: bool) -> dict[str, torch.Tensor] | None:
    import deepspeed  # present whenever parameters are ZeRO-3 partitioned

    out: dict[str, torch.Tensor] = {} if main else None
    for prefix, module in model.named_modules():
        own = list(module.named_parameters(recurse=False))
        params = [p for _, p in own]
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            if main:
                for name, p in own:
                    out[f"{prefix}.{name}" if prefix else name] = p.detach().cpu().clone()
                for name, b in module.named_buffers(recurse=False):
                    if name not in module._non_persistent_buffers_set:
                        out[f"{prefix}.{name}" if prefix else name] = b.detach().cpu().clone()
    return out


def local_shard(param: torch.Tensor) -> torch.Tensor:
    """The part of ``param`` this rank owns and updates: the DTensor's local shard (FSDP2), the ZeRO-3 partition
    (``ds_tensor``), or the parameter itself (one process / DDP). In-place writes to the result change the
    parameter."""
    if hasattr(param, "ds_tensor"):
        return param.ds_tensor
    to_local = getattr(param, "to_local", None)
    if callable(to_local):
        return to_local()
    return param


def broadcast_(tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
    """In-place broadcast from ``src`` (no-op outside a distributed run). Collective: call it on every rank."""
    if _dist_ready() and torch.distributed.get_world_size() > 1:
        torch.distributed.broadcast(tensor, src=src)
    return tensor


def broadcast_object(obj, src: int = 0):
    """``obj`` of rank ``src`` on every rank (pickled; small metadata only). Collective."""
    if not (_dist_ready() and torch.distributed.get_world_size() > 1):
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=src)
    return box[0]
