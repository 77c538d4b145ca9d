"""`UnlearningTrainer`: forget a set of examples while keeping the rest (GA, GradDiff, NPO, SimNPO, SGA, PDU,
StableUN, DMM, bounded sine adapters), on `transformers.Trainer`.

Each optimizer step sees a forget batch and a retain batch (and, for SGA, normal examples). Losses are *normalised by
the whole step*: forget and retain terms are sums divided by the number of answer tokens (or sequences) in every
micro-batch of the step on every process, so batch 8 × accumulation 1, batch 4 × accumulation 2 and two processes
× batch 4 give the same update. The pure loss functions live in `hf_stable.losses.unlearning`; what each method
combines, and how, is declared in `methods.py`, and the trainer dispatches on those declarations.
"""

from __future__ import annotations

import logging
from collections import defaultdict

import torch
from accelerate.utils import is_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer

from ...callbacks.stability import add_stability_callbacks
from ...callbacks.unlearning import unlearning_callbacks
from ...losses import unlearning as L
from .._base import StableTrainerBase
from .card import unlearning_card_sections
from .checks import check_guard, refuse_backend, validate_data
from .config import UnlearningConfig
from .data import UnlearningCollator, tokenize_rows, training_pairs
from .methods import UNLEARNING_METHODS
from .multigrad import MultiGradMixin
from .reference import REF_LOGPS_KEY, ReferenceMixin, frozen
from .targets import OracleTargets, PrecomputedTargets, PriorTargets, require_forget_targets


logger = logging.getLogger(__name__)
PREFIX = "stable/unlearning/"


class UnlearningTrainer(StableTrainerBase, ReferenceMixin, MultiGradMixin, Trainer):
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
    _config_class = UnlearningConfig
    _output_suffix = "unlearned"
    _card_registries = (UNLEARNING_METHODS,)
    _card_settings = ("forget_weight", "retain_weight", "retain_loss_type", "learning_rate", "max_steps")

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
        args = self._coerce_args(model, args)
        if kwargs.get("compute_loss_func") is not None:
            raise ValueError("UnlearningTrainer computes its own losses: `compute_loss_func` is not supported.")
        if isinstance(model, str):
            if processing_class is None:
                processing_class = AutoTokenizer.from_pretrained(model)
            model = AutoModelForCausalLM.from_pretrained(model, use_safetensors=True, trust_remote_code=False)
        if processing_class is None:
            raise ValueError("`processing_class` (the tokenizer) is required when `model` is a model object.")
        if processing_class.pad_token_id is None:
            processing_class.pad_token = processing_class.eos_token
        validate_data(args, forget_dataset, retain_dataset, normal_dataset, oracle_model, ref_model)
        check_guard(args, retain_dataset, holdout_dataset)

        if args.bounded_lora:
            if peft_config is not None:
                raise ValueError("`bounded_lora=True` builds its own adapters; do not pass `peft_config` as well.")
            from ...adapters import StableLoraConfig

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
        self._is_peft = is_peft_model(model)

        tok = processing_class
        forget_loss = L.FORGET_LOSSES.get(args.forget_loss_name)
        num_normal = args.sga_num_normal if "normal" in forget_loss.extra["needs"] else 0
        self._forget_rows, self._retain_rows, self._holdout_rows, pairs = training_pairs(
            args, tok, forget_dataset, retain_dataset, holdout_dataset, normal_dataset, num_normal
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
        self._multi_grad = args.scheme in ("multipoint", "auto_rate")
        refuse_backend(self)
        self.loss_is_scaled_for_ga = True  # losses are normalised by the whole step (see the module docstring)
        self.holdout_dataset, self.oracle_model = holdout_dataset, oracle_model
        self.forget_dataset, self.retain_dataset = forget_dataset, retain_dataset
        self._ref_model = self._build_reference(ref_model)
        self._ref_seq_logps = None  # S_ref, computed at the first step when precompute_ref_logps
        self._targets = self._build_targets() if "target_logprobs" in forget_loss.extra["needs"] else None
        self._inputs = {  # the extra inputs a loss declares in ``needs``
            "ref_seq_logps": lambda model, inputs, s: {"ref_seq_logps": self._reference_seq_logps(inputs, s)},
            "normal": lambda model, inputs, s: self._normal_inputs(model, inputs),
            "target_logprobs": lambda model, inputs, s: {"target_logprobs": self._targets(s, inputs["kind"])},
            "ref_logits": lambda model, inputs, s: {"ref_logits": self._reference_logprobs(s)},
        }
        self._metrics: dict[str, list[float]] = defaultdict(list)
        self._step_counts: dict[str, torch.Tensor] | None = None
        self._step_sums: dict[str, torch.Tensor] = {}
        self._pending: list[dict] = []
        self._lambda = float(args.pdu_lambda0)
        self._eps = args.pdu_eps if isinstance(args.pdu_eps, float) else None
        self._guard_state: dict[str, float] = {}
        self._dual_epochs: int | None = 0  # epochs whose end-of-epoch dual update ran (pdu_dual_update="epoch")
        self.relearn_report: dict | None = None
        for callback in unlearning_callbacks(self):
            self.add_callback(callback)
        add_stability_callbacks(self, self.args)

    # ------------------------------------------------------------------------------------------------------------
    # construction

    def _build_targets(self):
        args = self.args
        if args.dmm_target == "oracle_model":
            return OracleTargets(frozen(self.oracle_model, args.device))
        if args.dmm_target == "prior":
            retain = list(self._streams(self._retain_rows[:256], args.device))
            return PriorTargets(self._reference_logprobs, retain)
        require_forget_targets(self._forget_rows)
        vocab_size = self.accelerator.unwrap_model(self.model).config.vocab_size
        return PrecomputedTargets(vocab_size, self._reference_logprobs)

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

    def _loss_term(self, loss, model, inputs, kind: str) -> tuple[L.Contribution, torch.Tensor]:
        """``loss`` (a FORGET_LOSSES/RETAIN_LOSSES declaration) on stream ``kind``, with the inputs it declares."""
        stream = inputs[kind]
        logits, logps, mask = self._forward(model, stream)
        extra = {}
        for need in loss.extra["needs"]:
            extra.update(self._inputs[need](model, {**inputs, "kind": kind}, stream))
        return loss(logps=logps, mask=mask, logits=logits, **extra, **loss.params_from(self.args)), mask

    def _normal_inputs(self, model, inputs) -> dict[str, torch.Tensor]:
        n = inputs["normal"]
        shape = n["input_ids"].shape
        _, logps, mask = self._forward(model, {key: value.flatten(0, 1) for key, value in n.items()})
        return {"normal_logps": logps.view(shape[0], shape[1], -1), "normal_mask": mask.view(shape[0], shape[1], -1)}

    def _forget_term(self, model, inputs) -> tuple[torch.Tensor, dict]:
        c, mask = self._loss_term(L.FORGET_LOSSES.get(self.args.forget_loss_name), model, inputs, "forget")
        stats = {key: (v.float().sum(), v.numel()) for key, v in c.stats.items()}
        return self._normalise(c, "forget", mask), stats

    def _retain_term(self, model, inputs) -> torch.Tensor:
        if self.args.retain_loss_type == "none" or "retain" not in inputs:  # no retain forward at all
            return torch.zeros((), device=self.args.device)
        c, mask = self._loss_term(L.RETAIN_LOSSES.get(self.args.retain_loss_type), model, inputs, "retain")
        return self._normalise(c, "retain", mask)

    def _dmm_retain_kl(self, model, inputs, like: torch.Tensor) -> torch.Tensor:
        """DMM's matching term on the retain rows (their targets: the oracle, or the starting model)."""
        if self.args.dmm_retain_fraction == 0:
            return torch.zeros_like(like)
        c, mask = self._loss_term(L.FORGET_LOSSES.get(self.args.forget_loss_name), model, inputs, "retain")
        return self._normalise(c, "retain", mask)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if "forget" not in inputs:  # evaluation rows: the plain LM loss (as open-unlearning's prediction_step)
            outputs = model(**inputs)
            return (outputs.loss, outputs) if return_outputs else outputs.loss
        args = self.args
        forget, stats = self._forget_term(model, inputs)
        retain = self._retain_term(model, inputs)
        terms = {"forget": forget, "retain": retain}
        for name in args.method.extra.get("terms", ()):  # extra terms the method's objective combines
            terms[name] = getattr(self, f"_{name}")(model, inputs, forget)
        dual = args.scheme == "dual"
        weight = self._lambda if dual else args.retain_weight  # PDU: the retain weight is the dual variable
        params = args.method.params_from(args)
        loss = args.method(terms, forget_weight=args.forget_weight, retain_weight=weight, **params)
        logged = {f"{k}_loss" if k in ("forget", "retain") else k: v for k, v in terms.items()}
        if dual:
            logged["lagrangian"] = args.forget_weight * forget + self._lambda * (retain - (self._eps or 0.0))
        if self.model.training:
            self._accumulate({key: value.detach() for key, value in logged.items()}, stats)
        # DDP averages gradients over processes while the counts cover all of them
        return loss * self.accelerator.num_processes

    # ------------------------------------------------------------------------------------------------------------
    # steps

    def _accumulate(self, terms: dict[str, torch.Tensor], stats: dict, reduced: bool = False) -> None:
        """Add the step's terms; ``reduced`` values are already global, and `_end_step` sums over processes."""
        shares = self.accelerator.num_processes if reduced else 1
        for key, value in terms.items():
            self._step_sums[key] = self._step_sums.get(key, 0) + value.double() / shares
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
        if args.scheme == "dual":
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
        meta = {"lambda": self._lambda, "eps": self._eps, "guard": self._guard_state, "dual_epochs": self._dual_epochs}
        tensors = {REF_LOGPS_KEY: self._ref_seq_logps} if self._ref_seq_logps is not None else {}
        return tensors, meta

    def _load_stable_state(self, tensors, meta):
        self._lambda = float(meta.get("lambda", self._lambda))
        self._eps = meta.get("eps", self._eps)
        self._guard_state = dict(meta.get("guard", {}))
        self._dual_epochs = meta.get("dual_epochs")
        if REF_LOGPS_KEY in tensors:
            self._ref_seq_logps = tensors[REF_LOGPS_KEY]
        elif self.args.needs_reference_logps and self.args.precompute_ref_logps:
            logger.warning("The checkpoint holds no S_ref: NPO's reference is recomputed from the resumed weights.")

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
        from ...evaluation.unlearning import evaluate_unlearning

        return evaluate_unlearning(
            self.accelerator.unwrap_model(self.model),
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

    def _card_sections(self, metrics: dict | None = None, **_):
        """What was unlearned: set sizes, the forget loss, learned state and metrics, never the forget rows."""
        return unlearning_card_sections(self, metrics)
