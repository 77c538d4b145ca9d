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
instance-level forwards that reach a different module (the one implementation, also used by [`own_forward`], which
removes them, and by the unlearning trainer's reference copies); [`diagnose_no_gradient`] turns the findings into the
error message.

Pure torch.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import types

import torch


__all__ = [
    "NoGradientError",
    "OwnForwardMixin",
    "diagnose_no_gradient",
    "foreign_forwards",
    "outside_module",
    "own_forward",
    "repair_trl_fused_forwards",
    "trainable_parameters",
]

logger = logging.getLogger(__name__)


class NoGradientError(RuntimeError):
    """No trainable parameter is connected to the training loss."""


def trainable_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def outside_module(obj, inside: set[int], depth: int = 4) -> torch.nn.Module | None:
    """The first module *not* in ``inside`` (a set of ``id``s) that ``obj`` reaches: ``obj`` itself, the ``__self__``
    of a bound method, the parts of a ``functools.partial`` or a closure cell, followed ``depth`` levels deep
    (TRL's fused forward is a closure over a bound method of the model it patched: two levels)."""
    if isinstance(obj, torch.nn.Module):
        return None if id(obj) in inside else obj
    if depth == 0:
        return None
    if isinstance(obj, types.MethodType):
        return outside_module(obj.__self__, inside, depth) or outside_module(obj.__func__, inside, depth - 1)
    if isinstance(obj, functools.partial):
        parts = (obj.func, *obj.args, *obj.keywords.values())
    else:
        parts = []
        for cell in getattr(obj, "__closure__", None) or ():
            try:
                parts.append(cell.cell_contents)
            except ValueError:  # an empty cell
                continue
    for part in parts:
        found = outside_module(part, inside, depth - 1)
        if found is not None:
            return found
    return None


def _function_name(fn) -> str:
    """The function's real name and file: ``functools.wraps`` makes a patched forward *report* the class forward's
    name, so read the code object instead (e.g. ``_fused_forward (trl/trainer/utils.py)``)."""
    while isinstance(fn, (types.MethodType, functools.partial)):
        fn = fn.__func__ if isinstance(fn, types.MethodType) else fn.func
    code = getattr(fn, "__code__", None)
    if code is None:
        return repr(fn)
    parts = code.co_filename.replace("\\", "/").split("/")
    return f"{code.co_name} ({'/'.join(parts[-3:])})"


def foreign_forwards(model: torch.nn.Module) -> list[tuple[str, str, torch.nn.Module]]:
    """Sub-modules of ``model`` whose instance-level ``forward`` reaches a module *outside* ``model``.

    Returns ``(module_name, forward_name, foreign_module)`` triples; ``module_name`` is ``""`` for ``model`` itself.
    """
    inside = {id(m) for m in model.modules()}
    hits = []
    for name, module in model.named_modules():
        forward = module.__dict__.get("forward")
        if forward is None:
            continue
        target = outside_module(forward, inside)
        if target is not None:
            hits.append((name, _function_name(forward), target))
    return hits


def own_forward(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` without the instance-level ``forward`` patches that reach a module outside ``model``.

    ``copy.deepcopy`` copies such a patch together with its closure, and the closure still holds the original
    module. TRL's fused LM head (``trl.trainer.utils.add_fused_lm_head``, applied by ``SFTTrainer``) keeps
    ``original_forward``, a bound method of the model it patched: a deep copy of a TRL-trained model runs the
    *original's* weights. Removing the patch restores the class's own forward, which the patch calls anyway for a
    plain (``fused_lm_head=False``) forward.
    """
    modules = dict(model.named_modules())
    for name, _, _ in foreign_forwards(model):
        del modules[name].forward
    return model


def repair_trl_fused_forwards(model, trainer_name: str):
    """Remove, from a model handed to an hf_stable trainer, TRL's fused-LM-head forwards that reach *another* model
    (the deep-copy trap of [`own_forward`]), logging one info line; return ``model``.

    Only TRL's ``_fused_forward`` is removed: its plain path calls the class forward anyway, so the repair changes
    nothing but which weights run. Any other foreign forward is left as it is (we cannot know what it is for), and
    the no-gradient check still names it. A model name (``str``) is returned unchanged.
    """
    if not isinstance(model, torch.nn.Module):
        return model
    modules = dict(model.named_modules())
    repaired = []
    for name, fn_name, _ in foreign_forwards(model):
        if _is_trl_fused_forward(modules[name].__dict__["forward"]):
            del modules[name].forward
            repaired.append(f"`{name or type(model).__name__}` ({fn_name})")
    if repaired:
        logger.info(
            f"{trainer_name}: removed TRL's fused LM-head forward from {', '.join(repaired)}; it called another "
            "model object (a copy.deepcopy of a model TRL's SFTTrainer patched), so this copy would not have trained. "
            "The model's class forward is used."
        )
    return model


def diagnose_no_gradient(model: torch.nn.Module) -> str:
    """A sentence naming the likely cause when no trainable parameter received a gradient."""
    hits = foreign_forwards(model)
    if hits:
        name, fn_name, target = hits[0]
        where = f"`{type(model).__name__}.forward`" if not name else f"the forward of `{name}`"
        return (
            f"{where} was replaced on the instance by `{fn_name}`, which calls the forward of another "
            f"`{type(target).__name__}` object (id {id(target):#x}), not this model's, so the loss flows into that "
            "object's parameters and this model gets no gradient. The usual cause is the copy.deepcopy trap: TRL's "
            "SFTTrainer patches `model.forward` with a fused LM-head forward bound to that model, and a "
            "`copy.deepcopy` of the patched model keeps the closure over the original's weights. Fix: "
            "`hf_stable.stability.nograd.own_forward(model)` (deletes such instance forwards, restoring the class "
            "forward), copy the model before SFTTrainer patches it, or train with StableSFTTrainer, which hands back "
            "a model with its own forward."
        )
    return (
        "the loss does not depend on any trainable parameter. Check that the loss is computed from this model's "
        "outputs (not a copy or a detached tensor), that `requires_grad` is set on the parameters you mean to train, "
        "and that no `torch.no_grad()` / `inference_mode()` wraps the forward."
    )


def _is_trl_fused_forward(forward) -> bool:
    fn = forward.__func__ if isinstance(forward, types.MethodType) else forward
    code = getattr(fn, "__code__", None)
    path = "" if code is None else code.co_filename.replace("\\", "/")
    return code is not None and code.co_name == "_fused_forward" and path.endswith("trl/trainer/utils.py")


class OwnForwardMixin:
    """Mix into a TRL ``SFTTrainer`` subclass: the model it hands back has its class's own ``forward``.

    ``SFTTrainer.__init__`` patches ``model.forward`` on the instance with TRL's fused LM head (``_fused_forward`` of
    ``trl/trainer/utils.py``), which the loss needs. Left in place after training, a ``copy.deepcopy`` of the trained
    model keeps a closure over the trainer's model and trains the wrong weights (see [`diagnose_no_gradient`]). So the
    patch is attached only while ``train``/``evaluate``/``predict``/``compute_loss``/``prediction_step`` (or a
    ``with trainer.fused_forward():`` block) run, and removed when they return: TRL's API keeps working after
    training (``trainer.compute_loss(model, batch)`` returns what ``SFTTrainer`` returns).
    """

    _fused_patches: list | None = None

    def _detach_fused_forwards(self) -> None:
        if self._fused_patches is None:
            self._fused_patches = [
                (module, module.__dict__["forward"])
                for module in self.model.modules()
                if "forward" in module.__dict__ and _is_trl_fused_forward(module.__dict__["forward"])
            ]
        for module, _ in self._fused_patches:
            module.__dict__.pop("forward", None)

    def _attach_fused_forwards(self) -> None:
        for module, forward in self._fused_patches or ():
            module.forward = forward

    @contextlib.contextmanager
    def fused_forward(self):
        """The fused LM head attached for the duration (re-entrant), e.g. for a direct
        ``model(..., fused_lm_head=True)`` call after training."""
        depth = getattr(self, "_fused_depth", 0)
        if depth == 0:
            self._attach_fused_forwards()
        self._fused_depth = depth + 1
        try:
            yield
        finally:
            self._fused_depth = depth
            if depth == 0:  # not an evaluation inside `train`
                self._detach_fused_forwards()

    def train(self, *args, **kwargs):
        with self.fused_forward():
            return super().train(*args, **kwargs)

    def evaluate(self, *args, **kwargs):
        with self.fused_forward():
            return super().evaluate(*args, **kwargs)

    def predict(self, *args, **kwargs):
        with self.fused_forward():
            return super().predict(*args, **kwargs)

    # TRL's API outside `train`: `compute_loss` / `prediction_step` call `model(..., fused_lm_head=True)`
    def compute_loss(self, *args, **kwargs):
        with self.fused_forward():
            return super().compute_loss(*args, **kwargs)

    def prediction_step(self, *args, **kwargs):
        with self.fused_forward():
            return super().prediction_step(*args, **kwargs)
