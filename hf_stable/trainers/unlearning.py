"""`UnlearningTrainer`: forget a set of examples while keeping the rest (GA, GradDiff, NPO, SimNPO, SGA, PDU,
StableUN, DMM, bounded sine adapters), on `transformers.Trainer`.

Each optimizer step sees a forget batch and a retain batch (and, for SGA, normal examples). Losses are *normalised by
the whole step*: forget and retain terms are sums divided by the number of answer tokens (or sequences) in every
micro-batch of the step on every process, so batch 8 × accumulation 1, batch 4 × accumulation 2 and two processes
× batch 4 give the same update. The pure loss functions live in `hf_stable.losses.unlearning`.

Schemes: one joint loss (GA, GradDiff, NPO, SimNPO, SGA with a fixed rate, DMM); primal-dual (PDU: `forget + λ (retain
− ε)` with projected dual ascent on λ after every step, checkpointed); and step-level multi-gradient methods
(StableUN; SGA with ``sga_rate="auto"``), which collect the step's micro-batches and compute their gradients at the
last one with `torch.autograd.grad` on the unwrapped model, reducing them across processes themselves.
"""

from __future__ import annotations

import copy
import logging
import os
from collections import defaultdict

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, Trainer

from ..adapters.card import adapter_card_info
from ..losses import unlearning as L
from ._base import AdapterOptimizerMixin, StableStateMixin
from ._unlearn_data import ForgetRetainDataset, UnlearningCollator, row_keys, similar_rows, tokenize_rows
from ._unlearn_targets import (  # noqa: F401  (precompute_dmm_targets is public API)
    OracleTargets,
    PrecomputedTargets,
    PriorTargets,
    _shifted_logprobs,
    precompute_dmm_targets,
)
from .unlearning_config import UnlearningConfig


logger = logging.getLogger(__name__)
PREFIX = "unlearn/"


class UnlearningTrainer(StableStateMixin, AdapterOptimizerMixin, Trainer):
    """Unlearning on `transformers.Trainer`: the forget set is trained away, the retain set kept.

    Args:
        model (`PreTrainedModel` or `str`): the model to unlearn from (weights load from safetensors only).
        args ([`UnlearningConfig`]): the method and its settings, plus every `TrainingArguments` flag.
        forget_dataset, retain_dataset (`datasets.Dataset`): ``prompt`` + ``completion`` (or ``answer``) rows, plain or
            conversational; labels cover the completion and EOS only. They must not share rows.
        processing_class: the tokenizer (loaded from ``model`` when it is a path).
        normal_dataset (`Dataset`, *optional*): SGA's normal examples with ``sga_normal_source="provided"``.
        holdout_dataset (`Dataset`, *optional*): never-trained rows of the same form; the collapse guard's chance
            reference and `evaluate_unlearning`'s default holdout.
        eval_dataset (`Dataset`, *optional*): rows scored with the plain LM loss by `evaluate()`.
        ref_model (`PreTrainedModel`, *optional*): the reference for NPO (when ``precompute_ref_logps=False``) and for
            the KL retain loss; by default the starting model (a frozen copy, or the adapter-free base under PEFT).
        oracle_model (`PreTrainedModel`, *optional*): DMM's target with ``dmm_target="oracle_model"``, and the oracle
            `evaluate_unlearning` compares against.
        peft_config (`peft.PeftConfig`, *optional*): train adapters instead of the full model.
    """

    _tag_names = ["hf_stable", "unlearning"]

    def __init__(
        self,
        model,
        args: UnlearningConfig | None = None,
        forget_dataset=None,
        retain_dataset=None,
        processing_class=None,
        *,
        normal_dataset=None,
        holdout_dataset=None,
        eval_dataset=None,
        ref_model=None,
        oracle_model=None,
        peft_config=None,
        callbacks=None,
        optimizers=(None, None),
        **kwargs,
    ):
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = UnlearningConfig(output_dir=f"{os.path.basename(str(name)) or 'model'}-unlearned")
        if not isinstance(args, UnlearningConfig):
            raise TypeError(f"args must be an UnlearningConfig, got {type(args).__name__}.")
        if isinstance(model, str):
            if processing_class is None:
                processing_class = AutoTokenizer.from_pretrained(model)
            model = AutoModelForCausalLM.from_pretrained(model, use_safetensors=True, trust_remote_code=False)
        if processing_class is None:
            raise ValueError("`processing_class` (the tokenizer) is required when `model` is a model object.")
        if processing_class.pad_token_id is None:
            processing_class.pad_token = processing_class.eos_token
        self._validate_data(args, forget_dataset, retain_dataset, normal_dataset, oracle_model, ref_model)

        if args.bounded_lora:
            if peft_config is not None:
                raise ValueError("`bounded_lora=True` builds its own adapters; do not pass `peft_config` as well.")
            from ..adapters import StableLoraConfig

            peft_config = StableLoraConfig(
                r=args.bounded_lora_r,
                lora_alpha=args.bounded_lora_alpha,
                target_modules=list(args.bounded_targets),
                use_sine=True,
                sine_freq=args.bounded_omega,
                lora_dropout=0.0,
            )
        if peft_config is not None:
            from peft import get_peft_model

            model = get_peft_model(model, peft_config)
        self._is_peft = hasattr(model, "disable_adapter") and hasattr(model, "peft_config")

        tok = processing_class
        self._forget_rows = tokenize_rows(forget_dataset, tok, args.max_length, "forget_dataset")
        # kept even when the loss does not use them: the collapse guard and the evaluation read the retain rows
        has_retain = retain_dataset is not None and len(retain_dataset) > 0
        self._retain_rows = tokenize_rows(retain_dataset, tok, args.max_length, "retain_dataset") if has_retain else []
        self._holdout_rows = (
            tokenize_rows(holdout_dataset, tok, args.max_length, "holdout_dataset") if holdout_dataset else []
        )
        normal_rows, normal_index = None, None
        k = args.sga_num_normal if args.unlearn_method == "sga" else 0
        if k:
            if args.sga_normal_source == "provided":
                normal_rows = tokenize_rows(normal_dataset, tok, args.max_length, "normal_dataset")
            else:
                normal_rows = self._retain_rows
                if args.sga_normal_source == "retain_similar":
                    normal_index = similar_rows(self._forget_rows, self._retain_rows, max(4 * k, k))
        pairs = ForgetRetainDataset(
            self._forget_rows,
            self._retain_rows,
            anchor=args.anchor,
            seed=args.data_seed or args.seed,
            normal=normal_rows,
            num_normal=k,
            normal_index=normal_index,
        )
        eval_rows = tokenize_rows(eval_dataset, tok, args.max_length, "eval_dataset") if eval_dataset else None
        super().__init__(
            model=model,
            args=args,
            data_collator=UnlearningCollator(tok.pad_token_id),
            train_dataset=pairs,
            eval_dataset=eval_rows,
            processing_class=tok,
            callbacks=callbacks,
            optimizers=optimizers,
            **kwargs,
        )
        self.loss_is_scaled_for_ga = True  # losses are normalised by the whole step (see the module docstring)
        self.holdout_dataset, self.oracle_model = holdout_dataset, oracle_model
        self.forget_dataset, self.retain_dataset = forget_dataset, retain_dataset
        self._multi_grad = args.method.scheme == "multipoint" or (
            args.unlearn_method == "sga" and args.sga_rate == "auto"
        )
        self._ref_model = self._build_reference(ref_model)
        self._ref_seq_logps = self._cache_reference_logps() if args.needs_reference_logps else None
        self._targets = self._build_targets() if args.unlearn_method == "dmm" else None
        self._metrics: dict[str, list[float]] = defaultdict(list)
        self._step_counts: dict[str, torch.Tensor] | None = None
        self._step_sums: dict[str, torch.Tensor] = {}
        self._pending: list[dict] = []
        self._lambda = float(args.pdu_lambda0)
        self._eps = args.pdu_eps if isinstance(args.pdu_eps, float) else None
        self._guard_state: dict[str, float] = {}
        self.relearn_report: dict | None = None
        from ..callbacks.unlearning import unlearning_callbacks

        for callback in unlearning_callbacks(self):
            self.add_callback(callback)

    # ------------------------------------------------------------------------------------------------------------
    # construction helpers

    @staticmethod
    def _validate_data(args, forget, retain, normal, oracle, ref_model):
        if forget is None or len(forget) == 0:
            raise ValueError("`forget_dataset` is empty: there is nothing to unlearn.")
        needs_retain = (
            args.retain_loss_type != "none"
            or args.unlearn_method == "dmm"
            or (args.unlearn_method == "sga" and args.sga_normal_source != "provided")
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
        if args.unlearn_method == "sga" and args.sga_normal_source == "provided" and not normal:
            raise ValueError("sga_normal_source='provided' needs a non-empty `normal_dataset`.")
        if args.needs_reference_logps and not args.precompute_ref_logps and ref_model is None:
            raise ValueError(
                "NPO without a reference: set `precompute_ref_logps=True` (cache the starting model's log-probs) or "
                "pass `ref_model`."
            )
        if args.unlearn_method == "dmm" and args.dmm_target == "oracle_model" and oracle_model_missing(oracle):
            raise ValueError("dmm_target='oracle_model' needs `oracle_model` (a model that never saw the forget set).")

    def _build_reference(self, ref_model):
        if (
            self.args.retain_loss_type != "kl"
            and not (self.args.needs_reference_logps and not self.args.precompute_ref_logps)
            and not (self.args.unlearn_method == "dmm" and self.args.dmm_target != "oracle_model")
        ):
            return None
        if ref_model is not None:
            return ref_model.to(self.args.device).eval().requires_grad_(False)
        if self._is_peft:
            return None  # the adapter-free base is the starting model: `disable_adapter` gives it
        return copy.deepcopy(self.model).eval().requires_grad_(False)

    @torch.no_grad()
    def _reference_logprobs(self, stream) -> torch.Tensor:
        """The starting model's shifted log-distributions `(B, T, V)` for a stream."""
        if self._ref_model is not None:
            return _shifted_logprobs(self._ref_model, stream)
        model = self.accelerator.unwrap_model(self.model)
        was_training = model.training
        model.eval()
        try:
            with model.disable_adapter():
                return _shifted_logprobs(model, stream)
        finally:
            model.train(was_training)

    @torch.no_grad()
    def _cache_reference_logps(self) -> torch.Tensor | None:
        """`S_ref` of every forget row under the starting model, computed once (NPO)."""
        if not self.args.precompute_ref_logps:
            return None
        model = self._ref_model if self._ref_model is not None else self.model
        was_training = model.training
        model.eval()
        out = []
        try:
            for stream in self._streams(self._forget_rows):
                logits = model(input_ids=stream["input_ids"], attention_mask=stream["attention_mask"]).logits
                logps, mask = L.token_logps(logits, stream["labels"])
                out.append(L.sequence_logps(logps, mask)[0])
        finally:
            model.train(was_training)
        return torch.cat(out)

    def _streams(self, rows, batch_size: int = 16):
        from ._unlearn_data import pad_stream

        for start in range(0, len(rows), batch_size):
            stream = pad_stream(rows[start : start + batch_size], self.processing_class.pad_token_id)
            yield {key: value.to(self.args.device) for key, value in stream.items()}

    def _build_targets(self):
        args = self.args
        if args.dmm_target == "oracle_model":
            return OracleTargets(self.oracle_model.to(args.device))
        if args.dmm_target == "prior":
            return PriorTargets(self._reference_logprobs, list(self._streams(self._retain_rows[:256])))
        return PrecomputedTargets(
            self.accelerator.unwrap_model(self.model).config.vocab_size, self._reference_logprobs
        )

    # ------------------------------------------------------------------------------------------------------------
    # step-wide normalisation

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batch_samples, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        counts = torch.zeros(5, dtype=torch.float64)
        for batch in batch_samples:
            for i, stream in enumerate(("forget", "retain")):
                if stream in batch:
                    valid = batch[stream]["labels"][:, 1:] != -100
                    counts[2 * i] += valid.sum()
                    counts[2 * i + 1] += valid.any(-1).sum()
            if "normal" in batch:
                counts[4] += (batch["normal"]["labels"][..., 1:] != -100).any(-1).sum()
        counts = counts.to(device)
        if self.accelerator.num_processes > 1:
            counts = self.accelerator.reduce(counts, reduction="sum")
        names = ("forget_token", "forget_sequence", "retain_token", "retain_sequence", "normal_sequence")
        self._step_counts = dict(zip(names, counts.float().clamp(min=1), strict=True))
        return batch_samples, num_items

    def _count(self, stream: str, unit: str, local: torch.Tensor) -> torch.Tensor:
        if self.model.training and self._step_counts is not None:
            return self._step_counts[f"{stream}_{unit}"]
        return local.float().clamp(min=1)  # evaluation: the batch alone

    def _normalise(self, contribution: L.Contribution, stream: str, mask: torch.Tensor) -> torch.Tensor:
        local = mask.sum() if contribution.unit == "token" else mask.any(-1).sum()
        return contribution.values.sum() / self._count(stream, contribution.unit, local)

    # ------------------------------------------------------------------------------------------------------------
    # loss terms

    def _forward(self, model, stream):
        logits = model(input_ids=stream["input_ids"], attention_mask=stream["attention_mask"], use_cache=False).logits
        logps, mask = L.token_logps(logits, stream["labels"])
        return logits[:, :-1], logps, mask

    def _forget_term(self, model, inputs, loss_name: str | None = None) -> tuple[torch.Tensor, dict]:
        args = self.args
        name = loss_name or args.forget_loss_name
        f = inputs["forget"]
        logits, logps, mask = self._forward(model, f)
        if name == "ga":
            c = L.ga_loss(logps, mask, reduction=args.forget_reduction)
        elif name == "npo":
            ref = self._ref_for(inputs, f)
            c = L.npo_loss(logps, mask, ref_seq_logps=ref, beta=args.npo_beta)
        elif name == "simnpo":
            c = L.simnpo_loss(logps, mask, beta=args.simnpo_beta, margin=args.simnpo_margin)
        elif name == "flatten":
            c = L.flatten_loss(logits, mask)
        elif name == "sga":
            n = inputs["normal"]
            shape = n["input_ids"].shape
            flat = {key: value.flatten(0, 1) for key, value in n.items()}
            _, n_logps, n_mask = self._forward(model, flat)
            c = L.sga_loss(
                logps,
                mask,
                n_logps.view(shape[0], shape[1], -1),
                n_mask.view(shape[0], shape[1], -1),
                rate=float(args.sga_rate),
            )
        elif name == "dmm":
            c = L.dmm_loss(logits, mask, self._targets(f, "forget"), temperature=args.dmm_temperature)
        else:
            raise ValueError(f"unknown forget loss {name!r}")
        value = self._normalise(c, "forget", mask)
        stats = {key: (v.float().sum(), v.numel()) for key, v in c.stats.items()}
        return value, stats

    def _ref_for(self, inputs, stream) -> torch.Tensor:
        if self._ref_seq_logps is not None:
            return self._ref_seq_logps.to(stream["input_ids"].device)[inputs["forget_index"]]
        logprobs = self._reference_logprobs(stream)
        picked = logprobs.gather(-1, stream["labels"][:, 1:].clamp(min=0).unsqueeze(-1)).squeeze(-1)
        mask = stream["labels"][:, 1:] != -100
        return torch.where(mask, picked, torch.zeros_like(picked)).sum(-1)

    def _retain_term(self, model, inputs) -> torch.Tensor:
        args = self.args
        if args.retain_loss_type == "none" or "retain" not in inputs:
            return torch.zeros((), device=args.device)
        r = inputs["retain"]
        logits, logps, mask = self._forward(model, r)
        if args.retain_loss_type == "nll":
            c = L.retain_nll(logps, mask)
        else:
            ref = self._reference_logprobs(r)
            c = L.retain_kl(logits, mask, ref_logits=ref)
        return self._normalise(c, "retain", mask)

    def _dmm_retain_term(self, model, inputs) -> torch.Tensor:
        r = inputs["retain"]
        logits, _, mask = self._forward(model, r)
        c = L.dmm_loss(logits, mask, self._targets(r, "retain"), temperature=self.args.dmm_temperature)
        return self._normalise(c, "retain", mask)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if "forget" not in inputs:  # evaluation rows: the plain LM loss (as open-unlearning's prediction_step)
            outputs = model(**inputs)
            return (outputs.loss, outputs) if return_outputs else outputs.loss
        args = self.args
        forget, stats = self._forget_term(model, inputs)
        retain = self._retain_term(model, inputs)
        terms = {"forget_loss": forget.detach(), "retain_loss": retain.detach()}
        if args.method.scheme == "dual":
            loss = forget + self._lambda * retain
            terms["lagrangian"] = (forget + self._lambda * (retain - (self._eps or 0.0))).detach()
        elif args.unlearn_method == "dmm":
            frac = args.dmm_retain_fraction
            matching = self._dmm_retain_term(model, inputs) if frac > 0 else torch.zeros_like(forget)
            terms["dmm_retain_kl"] = matching.detach()
            loss = (1 - frac) * args.forget_weight * forget + frac * matching + args.retain_weight * retain
        else:
            loss = args.forget_weight * forget + args.retain_weight * retain
        if self.model.training:
            self._accumulate(terms, stats)
        # DDP averages gradients over processes while the counts cover all of them
        return loss * self.accelerator.num_processes

    # ------------------------------------------------------------------------------------------------------------
    # steps

    def _accumulate(self, terms: dict[str, torch.Tensor], stats: dict) -> None:
        for key, value in terms.items():
            self._step_sums[key] = self._step_sums.get(key, 0) + value.double()
        for key, (total, count) in stats.items():
            self._step_sums[f"{key}_sum"] = self._step_sums.get(f"{key}_sum", 0) + total.double()
            self._step_sums[f"{key}_n"] = self._step_sums.get(f"{key}_n", 0) + float(count)

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self._multi_grad:
            return self._multi_grad_step(model, inputs)
        loss = super().training_step(model, inputs, num_items_in_batch)
        if self.accelerator.sync_gradients:
            self._end_step()
        return loss

    def _end_step(self) -> None:
        """After the last micro-batch: reduce the step's terms over processes, update λ, queue the metrics."""
        if not self._step_sums:
            return
        keys = sorted(self._step_sums)
        values = torch.stack([torch.as_tensor(self._step_sums[k], dtype=torch.float64) for k in keys])
        values = values.to(self.args.device)
        if self.accelerator.num_processes > 1:
            values = self.accelerator.reduce(values, reduction="sum")
        step = dict(zip(keys, values.tolist(), strict=True))
        self._step_sums = {}
        args = self.args
        if args.method.scheme == "dual":
            if self._eps is None:  # pdu_eps="auto" is set on the first step from the starting model's retain loss
                self._eps = L.auto_retain_eps(step["retain_loss"])
            self._metrics["lambda"].append(self._lambda)
            self._metrics["pdu_eps"].append(self._eps)
            if args.pdu_dual_update == "step" and self.state.global_step >= args.pdu_warmup_steps:
                self._lambda = L.dual_update(self._lambda, step["retain_loss"], self._eps, args.pdu_dual_lr)
        for key, value in step.items():
            if key.endswith("_n"):
                continue
            if key.endswith("_sum"):
                name = key[: -len("_sum")]
                self._metrics[name].append(value / max(step[f"{name}_n"], 1.0))
            else:
                self._metrics[key].append(value)

    def dual_update_from(self, retain_loss: float) -> None:
        """Per-epoch dual ascent (``pdu_dual_update="epoch"``), called by the dual-ascent callback."""
        if self._eps is None:
            self._eps = L.auto_retain_eps(retain_loss)
        if self.state.global_step >= self.args.pdu_warmup_steps:
            self._lambda = L.dual_update(self._lambda, retain_loss, self._eps, self.args.pdu_dual_lr)

    def _multi_grad_step(self, model, inputs) -> torch.Tensor:
        """StableUN and SGA-auto: stash micro-batches; at the last one compute the step's gradients and write them."""
        model.train()
        self._pending.append(self._prepare_inputs(inputs))
        if not self.accelerator.sync_gradients:
            return torch.zeros((), device=self.args.device)
        from ._unlearn_multigrad import multi_grad_step

        batches, self._pending = self._pending, []
        loss = multi_grad_step(self, self.accelerator.unwrap_model(model), batches)
        self._end_step()
        return loss.detach().to(self.args.device)  # already the global value on every process

    # ------------------------------------------------------------------------------------------------------------
    # logging, state, evaluation, card

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        mode = "eval" if next(iter(logs), "").startswith("eval_") else "train"
        if mode == "train":
            for key, values in self._metrics.items():
                if values:
                    logs[f"{PREFIX}{key}"] = sum(values) / len(values)
            self._metrics.clear()
        super().log(logs, *args, **kwargs)

    def _stable_state(self):
        meta = {"lambda": self._lambda, "eps": self._eps, "guard": self._guard_state}
        return {}, meta

    def _load_stable_state(self, tensors, meta):
        self._lambda = float(meta.get("lambda", self._lambda))
        self._eps = meta.get("eps", self._eps)
        self._guard_state = dict(meta.get("guard", {}))

    @property
    def dual_variable(self) -> float:
        """PDU's λ."""
        return self._lambda

    def evaluate_unlearning(
        self,
        forget=None,
        retain=None,
        holdout=None,
        world=None,
        oracle=None,
        relearn=None,
        relearn_test=None,
        print_table: bool = True,
        **kwargs,
    ) -> dict:
        """Forget / retain / holdout accuracy and probability, truth ratio, KS forget quality (against holdout, and
        against ``oracle`` when given), min-k membership AUC, over-forgetting and relearning recovery; see
        `hf_stable.evaluation.unlearning.evaluate_unlearning`. Defaults: the trainer's forget, retain and holdout sets
        and oracle model."""
        from ..evaluation.unlearning import evaluate_unlearning

        model = self.accelerator.unwrap_model(self.model)
        return evaluate_unlearning(
            model,
            self.processing_class,
            forget=self.forget_dataset if forget is None else forget,
            retain=self.retain_dataset if retain is None else retain,
            holdout=self.holdout_dataset if holdout is None else holdout,
            world=world,
            oracle=self.oracle_model if oracle is None else oracle,
            relearn=relearn,
            relearn_test=relearn_test,
            start_holdout_prob=self._guard_state.get("holdout_prob"),
            print_table=print_table and self.is_world_process_zero(),
            max_length=self.args.max_length,
            **kwargs,
        )

    def create_model_card(self, model_name=None, dataset_name=None, tags=None, metrics: dict | None = None):
        """`README.md`: what was unlearned — method, settings, set sizes and metrics — never the forget rows."""
        if not self.is_world_process_zero():
            return
        from ..cards import TrainingCard, write_training_card
        from ..papers import PAPERS
        from ._unlearn_methods import UNLEARNING_METHODS

        args = self.args
        method = UNLEARNING_METHODS.get(args.unlearn_method)
        papers = [p for p in PAPERS.values() if p.url == method.url]
        settings = {
            "unlearn_method": args.unlearn_method,
            "forget_rows": len(self._forget_rows),
            "retain_rows": len(self._retain_rows),
            "forget_weight": args.forget_weight,
            "retain_weight": args.retain_weight,
            "retain_loss_type": args.retain_loss_type,
            "learning_rate": args.learning_rate,
            "max_steps": args.max_steps,
            "steps_done": self.state.global_step,
        }
        prefix = {
            "npo": "npo_",
            "simnpo": "simnpo_",
            "sga": "sga_",
            "pdu": "pdu_",
            "stableun": "stableun_",
            "dmm": "dmm_",
        }.get(args.unlearn_method)
        prefixes = [p for p in (prefix, "bounded_" if args.bounded_lora else None) if p]
        settings.update({k: v for k, v in vars(args).items() if any(k.startswith(p) for p in prefixes)})
        if args.unlearn_method == "pdu":
            settings["final_lambda"] = round(self._lambda, 6)
        if metrics:
            settings["metrics"] = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in metrics.items()}
        lines = [
            f"Unlearning method: `{args.unlearn_method}` ({method.paper}).",
            f"Forget set: {len(self._forget_rows)} rows (not included here); retain set: "
            f"{len(self._retain_rows)} rows.",
        ]
        adapter_papers, adapter_lines, adapter_settings, adapter_tags = adapter_card_info(self.model)
        papers += [p for p in adapter_papers if p not in papers]
        lines += adapter_lines
        settings.update(adapter_settings)
        lines += [f"Paper: [{p.title}]({p.url})." for p in papers]
        card = TrainingCard(
            trainer_name="UnlearningTrainer",
            trl_trainer="transformers.Trainer",
            method="\n\n".join(lines),
            settings=settings,
            tags=[*self._tag_names, f"unlearn-{args.unlearn_method}", *adapter_tags, *(tags or [])],
            citations=[p.bibtex for p in papers],
        )
        base = getattr(self.accelerator.unwrap_model(self.model).config, "_name_or_path", None)
        write_training_card(
            card,
            args.output_dir,
            model_name=model_name or os.path.basename(os.path.abspath(args.output_dir)),
            base_model=base,
            hub_model_id=self.hub_model_id if args.push_to_hub else None,
            dataset_name=dataset_name,
        )


def oracle_model_missing(oracle) -> bool:
    return oracle is None or not isinstance(oracle, (PreTrainedModel, torch.nn.Module))
