"""Detect a model that is not connected to its loss, and name the cause.

``NoGradientError`` is raised when, after the first backward, *every* trainable parameter's ``.grad`` is still
``None``: nothing the optimizer holds is connected to the loss, so training would change nothing. Gradients that exist
but are exactly zero are not this error (a GRPO batch whose groups all have equal rewards legitimately gives a zero
gradient).

The most common silent cause we know: TRL's ``SFTTrainer`` replaces ``model.forward`` on the *instance* with a fused
forward (``trl.trainer.utils.add_fused_lm_head``: ``_fused_forward``) whose closure holds the original
``model.forward`` bound to that model. ``copy.deepcopy(model)`` copies the instance attribute but not the closure, so
the copy's non-fused forward runs the *original* model's weights: its loss has a gradient, but only into the
original's parameters, and the copy trains with ``grad_norm`` 0 and never changes. [`foreign_forwards`] finds such
instance-level forwards whose closure calls a different module; [`diagnose_no_gradient`] turns the findings into the
error message.

Pure torch.
"""

from __future__ import annotations

import types

import torch


__all__ = ["NoGradientError", "diagnose_no_gradient", "foreign_forwards", "trainable_parameters"]


class NoGradientError(RuntimeError):
    """No trainable parameter is connected to the training loss."""


def trainable_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def _closure_modules(fn) -> list[torch.nn.Module]:
    """Modules reachable from ``fn``'s closure cells (directly, or as ``__self__`` of a bound method there)."""
    found = []
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(value, torch.nn.Module):
            found.append(value)
        elif isinstance(value, types.MethodType) and isinstance(value.__self__, torch.nn.Module):
            found.append(value.__self__)
    return found


def _function_name(fn) -> str:
    """The function's real name and file: ``functools.wraps`` makes a patched forward *report* the class forward's
    name, so read the code object instead (e.g. ``_fused_forward (trl/trainer/utils.py)``)."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return repr(fn)
    parts = code.co_filename.replace("\\", "/").split("/")
    return f"{code.co_name} ({'/'.join(parts[-3:])})"


def foreign_forwards(model: torch.nn.Module) -> list[tuple[str, str, torch.nn.Module]]:
    """Sub-modules of ``model`` whose instance-level ``forward`` closes over a module *outside* ``model``.

    Returns ``(module_name, forward_name, foreign_module)`` triples; ``module_name`` is ``""`` for ``model`` itself.
    """
    own = {id(m) for m in model.modules()}
    hits = []
    for name, module in model.named_modules():
        forward = module.__dict__.get("forward")
        if forward is None:
            continue
        fn = forward.__func__ if isinstance(forward, types.MethodType) else forward
        for target in _closure_modules(fn):
            if id(target) not in own:
                hits.append((name, _function_name(fn), target))
                break
    return hits


def diagnose_no_gradient(model: torch.nn.Module) -> str:
    """A sentence naming the likely cause when no trainable parameter received a gradient."""
    hits = foreign_forwards(model)
    if hits:
        name, fn_name, target = hits[0]
        where = f"`{type(model).__name__}.forward`" if not name else f"the forward of `{name}`"
        return (
            f"{where} was replaced on the instance by `{fn_name}`, whose closure calls the forward of another "
            f"`{type(target).__name__}` object (id {id(target):#x}), not this model's. This is the copy.deepcopy "
            "trap: "
            "TRL's SFTTrainer patches `model.forward` with a fused LM-head forward bound to that model, and a "
            "`copy.deepcopy` of the patched model keeps the closure over the original's weights, so the loss flows "
            "into the original's parameters and the copy gets no gradient. Fix: `del copied_model.forward` (restores "
            "the class forward), or copy the model before SFTTrainer patches it."
        )
    return (
        "the loss does not depend on any trainable parameter. Check that the loss is computed from this model's "
        "outputs (not a copy or a detached tensor), that `requires_grad` is set on the parameters you mean to train, "
        "and that no `torch.no_grad()` / `inference_mode()` wraps the forward."
    )
