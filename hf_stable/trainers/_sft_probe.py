"""The per-token objective `StableSFTTrainer` uses, resolved from the config and, for `sft_objective="auto"` or a
`threshold_quantile`, from a probe of the base model's token probabilities on the training data (run once, before
the first step, and checkpointed)."""

from __future__ import annotations

import json
import logging
import math
import os
import warnings
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from accelerate.utils import is_peft_model
from transformers import TrainerCallback

from ..losses.sft import SFT_OBJECTIVES, choose_objective, probe_statistics, quantile
from ._base import write_json_atomic
from ._sft_data import INDEX_COLUMN, SIGN_COLUMN


logger = logging.getLogger(__name__)

PROBE_FILE = "objective_probe.json"


@dataclass
class ResolvedObjective:
    """The per-token objective actually used (after `auto`/quantile resolution): a `sft_objective` name and the
    keyword arguments of its callable."""

    name: str
    params: dict[str, Any]

    def __post_init__(self):
        self.fn = partial(SFT_OBJECTIVES.get(self.name).fn, **self.params)

    def describe(self) -> str:
        inner = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in self.params.items())
        return f"{self.name}({inner})" if inner else self.name


class _ProbeCallback(TrainerCallback):
    """Runs the base-model probe once the model is prepared (so it works under ZeRO-3), before the first step."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer._ensure_objective()


class ObjectiveProbeMixin:
    """Mix into `StableSFTTrainer`: ``_objective`` is resolved at construction, or by the probe when the config
    needs one (``args.needs_probe``); ``_probe`` holds the probe's result."""

    def _init_objective(self) -> None:
        self._probe: dict | None = None
        self._objective = None if self.args.needs_probe else self._resolve_objective(None)
        if self.args.needs_probe:
            self.add_callback(_ProbeCallback(self))

    def _resolve_objective(self, probe: dict | None) -> ResolvedObjective:
        args = self.args
        method = SFT_OBJECTIVES.get(args.sft_objective)
        if method.fn is None:  # declared only (`auto`): the probe's decision names the objective
            decision = probe["decision"]
            name = decision["sft_objective"]
            return ResolvedObjective(name, {"alpha": decision["objective_alpha"]} if name == "prob_power" else {})
        params = method.params_from(args)
        if args.threshold_quantile is not None:
            params["threshold"] = probe["threshold"]
        return ResolvedObjective(method.name, params)

    def _ensure_objective(self) -> ResolvedObjective:
        if self._objective is None:
            if self._probe is None:
                self._probe = self._run_probe()
            self._objective = self._resolve_objective(self._probe)
            logger.info(f"hf_stable objective: {self._objective.describe()}")
        return self._objective

    @torch.no_grad()
    def _run_probe(self) -> dict:
        """Token probabilities of the base model (adapters disabled, eval mode) on a seeded subset of the training
        data; all processes take part (collective forwards under ZeRO-3) and see the same gathered statistics."""
        args = self.args
        dataset = self.train_dataset
        world, rank = self.accelerator.num_processes, self.accelerator.process_index
        batch_size = args.per_device_train_batch_size
        n_rows = args.auto_probe_batches * batch_size * world
        if hasattr(dataset, "__len__"):
            n_rows = min(n_rows, len(dataset))
            order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(args.seed))[:n_rows]
            rows = [dataset[i] for i in order.tolist()]
        else:
            rows = [row for _, row in zip(range(n_rows), dataset, strict=False)]
        shard = rows[rank::world]
        n_batches = math.ceil(len(rows) / (batch_size * world))  # equal on every process
        model = self.model_wrapped
        unwrapped = self.accelerator.unwrap_model(model)
        adapters_off = unwrapped.disable_adapter() if is_peft_model(unwrapped) else nullcontext()
        was_training = model.training
        model.eval()
        probs = []
        with adapters_off:
            for b in range(n_batches):
                examples = shard[b * batch_size : (b + 1) * batch_size] or shard[:1]
                inputs = self.data_collator(examples)
                for column in (SIGN_COLUMN, INDEX_COLUMN):
                    inputs.pop(column, None)
                inputs = self._prepare_inputs(inputs)
                out = model(**inputs, use_cache=False, fused_lm_head=True)
                if b * batch_size < len(shard):  # padding batches only keep the processes in step
                    probs.append(out.log_probs.float()[out.label_mask.bool()].exp())
        model.train(was_training)
        local = torch.cat(probs) if probs else torch.zeros(0, device=self.accelerator.device)
        gathered = self.accelerator.gather(self.accelerator.pad_across_processes(local, pad_index=-1.0))
        kept = gathered[gathered >= 0].cpu()
        stats = probe_statistics(kept)
        probe = {"stats": stats, "num_rows": len(rows), "seed": args.seed}
        if SFT_OBJECTIVES.get(args.sft_objective).fn is None:
            probe["decision"] = choose_objective(stats, args.auto_rule)
            if probe["decision"]["regime"] == "intermediate":
                warnings.warn(
                    f"sft_objective='auto': {probe['decision']['reason']}. No objective is known to win in this "
                    "regime; using nll. Consider comparing with prob_power.",
                    stacklevel=2,
                )
        if args.threshold_quantile is not None:
            probe["threshold_quantile"] = args.threshold_quantile
            probe["threshold"] = quantile(kept, args.threshold_quantile)
        if self.args.should_save:
            os.makedirs(args.output_dir, exist_ok=True)
            write_json_atomic(os.path.join(args.output_dir, PROBE_FILE), probe)
        logger.info(f"hf_stable probe: {json.dumps(probe)}")
        return probe
