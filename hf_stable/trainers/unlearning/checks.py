"""What `UnlearningTrainer` refuses at construction, by name: data a method cannot run on, a collapse guard with
nothing to watch, and the backends the trainer cannot run correctly as launched (``accelerate launch`` configs
included, which `UnlearningConfig` cannot see)."""

from __future__ import annotations

import logging

from ...losses.unlearning import FORGET_LOSSES
from .data import row_keys


logger = logging.getLogger(__name__)


def validate_data(args, forget, retain, normal, oracle, ref_model) -> None:
    if forget is None or len(forget) == 0:
        raise ValueError("`forget_dataset` is empty: there is nothing to unlearn.")
    forget_loss = FORGET_LOSSES.get(args.forget_loss_name)
    needs_retain = (
        args.retain_loss_type != "none"
        or "dmm_retain_kl" in args.method.extra.get("terms", ())
        or ("normal" in forget_loss.extra["needs"] and args.sga_normal_source != "provided")
    )
    if needs_retain and (retain is None or len(retain) == 0):
        raise ValueError(
            f"`retain_dataset` is empty but unlearn_method={args.unlearn_method!r} with "
            f"retain_loss_type={args.retain_loss_type!r} needs retain rows."
        )
    if retain is not None and len(retain):
        shared = row_keys(forget) & row_keys(retain)
        if shared:
            raise ValueError(
                f"`forget_dataset` and `retain_dataset` share {len(shared)} row(s): a row cannot be forgotten "
                "and retained at once."
            )
    if "normal" in forget_loss.extra["needs"] and args.sga_normal_source == "provided" and not normal:
        raise ValueError("sga_normal_source='provided' needs a non-empty `normal_dataset`.")
    if args.needs_reference_logps and not args.precompute_ref_logps and ref_model is None:
        raise ValueError(
            "NPO without a reference: set `precompute_ref_logps=True` (cache the starting model's log-probs) or "
            "pass `ref_model`."
        )
    if "target_logprobs" in forget_loss.extra["needs"] and args.dmm_target == "oracle_model" and oracle is None:
        raise ValueError("dmm_target='oracle_model' needs `oracle_model` (a model that never saw the forget set).")


def check_guard(args, retain, holdout) -> None:
    """``collapse_guard=True`` must have rows to watch; without holdout rows only the retain criterion runs."""
    if not args.collapse_guard:
        return
    has_retain = retain is not None and len(retain) > 0
    has_holdout = holdout is not None and len(holdout) > 0
    if not (has_retain or has_holdout):
        raise ValueError(
            "collapse_guard=True has nothing to watch: pass `retain_dataset` or `holdout_dataset`, or set "
            "`collapse_guard=False`."
        )
    if not has_holdout:
        logger.warning(
            "collapse_guard=True without `holdout_dataset`: only the retain-loss criterion runs (the "
            "forget-probability criterion compares against holdout rows)."
        )


def refuse_backend(trainer) -> None:
    """DeepSpeed ZeRO-3 and FSDP for every method; DeepSpeed and fp16 for the multi-gradient schemes."""
    args = trainer.args
    plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
    if plugin is not None and plugin.zero_stage == 3:
        raise ValueError(
            "UnlearningTrainer does not support DeepSpeed ZeRO-3: its reference model, relearning probe and "
            "multi-gradient steps need full parameters on every process. Use DDP or ZeRO-1/2."
        )
    if trainer.is_fsdp_enabled:
        raise ValueError("UnlearningTrainer does not support FSDP (reference copies need full parameters); use DDP.")
    if args.scheme in ("multipoint", "auto_rate"):
        name = "sga_rate='auto'" if args.scheme == "auto_rate" else f"unlearn_method={args.unlearn_method!r}"
        if plugin is not None:
            raise ValueError(f"{name} does not support DeepSpeed: the engine steps from its own gradient buffers.")
        if trainer.accelerator.mixed_precision == "fp16":
            raise ValueError(f"{name} does not support fp16 (gradients are written unscaled); use bf16 or fp32.")
