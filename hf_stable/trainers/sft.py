"""`StableSFTTrainer`: TRL's SFT with alternative objectives ([`StableSFTConfig`]).

The trainer only gathers inputs, calls the declared methods of `hf_stable.losses.sft` (dispatched through their
registries) and logs. Loss contract (what makes gradient accumulation and the number of processes leave the update
unchanged): every micro-batch's loss is its *sum* of per-token (or per-sequence) terms divided by the count over the
whole optimizer step, all micro-batches and all processes, times the number of processes (DDP averages gradients).
Counts come from `get_batch_samples`, which sees every micro-batch of the step before the first forward
(transformers' `Trainer._get_num_items_in_batch` rule, extended to sequences). The one count that needs the forward,
the number of *active* tokens of a thresholded objective, is applied by rescaling the accumulated gradients once at the
end of the step.
"""

from __future__ import annotations

import logging
import warnings

import torch
from trl import SFTTrainer

from ..callbacks.stability import add_stability_callbacks
from ..cards import CardSections
from ..losses.sft import SFT_SAMPLE_REWEIGHTING, SFT_SEQUENCE_OBJECTIVES, sequence_mean
from ..stability.nograd import OwnForwardMixin
from ._base import StableTrainerBase
from ._sft_data import INDEX_COLUMN, SIGN_COLUMN, ExtraColumnsCollator, SFTDataMixin
from ._sft_probe import PROBE_FILE, ObjectiveProbeMixin
from .sft_config import SFT_REGISTRIES, StableSFTConfig


logger = logging.getLogger(__name__)

__all__ = ["PROBE_FILE", "StableSFTConfig", "StableSFTTrainer"]


def _accumulate(total: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor:
    return value if total is None else total + value


class StableSFTTrainer(StableTrainerBase, OwnForwardMixin, ObjectiveProbeMixin, SFTDataMixin, SFTTrainer):
    """TRL's [`~trl.SFTTrainer`] with the objectives of [`StableSFTConfig`].

    Same arguments as `SFTTrainer`. Papers: Li et al., *Beyond Log Likelihood* (arXiv 2510.00526) for the probability
    family and thresholds; Xu et al., *REDI* (arXiv 2505.24850); Ramirez et al., *Feasible Learning* (arXiv
    2501.14912).

    Example:
    ```python
    from hf_stable import StableSFTConfig, StableSFTTrainer
    args = StableSFTConfig(output_dir="out", sft_objective="prob_power", objective_alpha=1.0)
    trainer = StableSFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tokenizer)
    trainer.train()
    ```
    """

    _tag_names = ["trl", "sft", "hf_stable"]
    _name = "hf_stable StableSFT"
    _config_class = StableSFTConfig
    _output_suffix = "StableSFT"
    _card_registries = SFT_REGISTRIES
    _card_settings = (
        "learning_rate",
        "max_steps",
        "num_train_epochs",
        "per_device_train_batch_size",
        "gradient_accumulation_steps",
    )
    _trl_trainer = "trl.SFTTrainer"
    _card_example_prompt = "1+2="

    def __init__(
        self,
        model,
        args: StableSFTConfig | None = None,
        data_collator=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        **kwargs,
    ):
        args = self._coerce_args(model, args)
        if args.owns_loss and kwargs.get("compute_loss_func") is not None:
            raise ValueError(
                f"`compute_loss_func` cannot be combined with sft_objective={args.sft_objective!r}, "
                f"sequence_objective={args.sequence_objective!r} or sample_reweighting={args.sample_reweighting!r}: "
                "hf_stable computes that loss itself."
            )
        if args.owns_loss and args.label_smoothing_factor > 0:
            raise ValueError("`label_smoothing_factor` only applies to sft_objective='nll'; set it to 0.")
        self._paired = False
        if train_dataset is not None:
            train_dataset = self._add_columns(train_dataset, args, "train")
        if isinstance(eval_dataset, dict):
            eval_dataset = {k: self._add_columns(v, args, k, training=False) for k, v in eval_dataset.items()}
        elif eval_dataset is not None:
            eval_dataset = self._add_columns(eval_dataset, args, "eval", training=False)
        self._redi_reduction = args.redi_reduction or ("pair" if self._paired else "sequence")

        super().__init__(
            model,
            args=args,
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            **kwargs,
        )

        if args.owns_loss:
            # our loss is already divided by step-wide counts (see the module docstring)
            self.loss_is_scaled_for_ga = True
        self.data_collator = ExtraColumnsCollator(self.data_collator, (SIGN_COLUMN, INDEX_COLUMN))
        self._check_parallelism()
        self._init_objective()
        self._sequence = SFT_SEQUENCE_OBJECTIVES.active(args)
        reweighting = SFT_SAMPLE_REWEIGHTING.active(args)
        self._reweighting = None
        if reweighting is not None:
            self._reweighting = reweighting(self._num_samples, **reweighting.params_from(args))
        self._reset_step()
        self._step_counts: dict[str, torch.Tensor] | None = None
        add_stability_callbacks(self, self.args)

    @property
    def _multipliers(self) -> torch.Tensor | None:
        """The per-sample multiplier table of the active sample reweighting, if any."""
        return self._reweighting.multipliers if self._reweighting is not None else None

    def _check_parallelism(self) -> None:
        args = self.args
        pc = self.accelerator.parallelism_config
        if args.owns_loss and pc is not None and getattr(pc, "sp_enabled", False):
            raise ValueError(
                "hf_stable SFT objectives are not supported under sequence parallelism (the loss is the model's own "
                "NLL there); use sft_objective='nll' or disable sequence parallelism."
            )
        if args.per_sample and pc is not None and getattr(pc, "cp_enabled", False):
            raise ValueError(
                "Per-sample objectives need whole sequences on each process; disable context parallelism."
            )
        if (
            args.owns_loss
            and args.threshold_normalization == "active"
            and args.world_size > 1
            and not args.average_tokens_across_devices
        ):
            raise ValueError(
                "threshold_normalization='active' with several processes needs average_tokens_across_devices=True "
                "(the default): the end-of-step rescale must be the same on every process."
            )
        if args.owns_loss and args.threshold_normalization == "active" and self.is_deepspeed_enabled:
            raise ValueError(
                "threshold_normalization='active' rescales the accumulated gradients at the end of each step, which "
                "DeepSpeed's engine does not expose; use threshold_normalization='supervised' under DeepSpeed."
            )

    # ------------------------------------------------------------------------------------------------------------
    # step-wide counts (the denominators of the loss contract)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batch_samples, num_items_in_batch = super().get_batch_samples(epoch_iterator, num_batches, device)
        if self.args.owns_loss:
            self._step_counts = self._count_targets(batch_samples, device)
        return batch_samples, num_items_in_batch

    def _count_targets(self, batch_samples, device) -> dict[str, torch.Tensor]:
        """Supervised tokens and sequences over every micro-batch of the step, summed over processes when
        `average_tokens_across_devices` (transformers' rule for `num_items_in_batch`, extended to sequences)."""
        tokens = torch.zeros((), dtype=torch.float64)
        sequences = torch.zeros((), dtype=torch.float64)
        for batch in batch_samples:
            labels = batch["shift_labels"] if "shift_labels" in batch else batch["labels"][..., 1:]
            valid = labels != -100
            tokens += valid.sum()
            if "seq_idx" in batch:  # padding-free: one row holds several sequences
                sequences += batch["seq_idx"][..., 1:][valid].unique().numel()
            else:
                sequences += valid.any(-1).sum()
        counts = torch.stack([tokens, sequences]).to(device)
        if self.args.average_tokens_across_devices and self.args.world_size > 1:
            counts = self.accelerator.reduce(counts, reduction="sum")
        # tensor/context/sequence-parallel ranks see the same tokens (Trainer._get_num_items_in_batch)
        tokens = counts[0] / (self.get_tp_size() * self.get_cp_size() * self.get_sp_size())
        return {"tokens": tokens, "sequences": counts[1]}

    def _process_multiplier(self) -> int:
        # DDP averages gradients over processes while the counts cover all of them (Trainer.compute_loss)
        if self.args.average_tokens_across_devices:
            return self.accelerator.num_processes // self.get_tp_size()
        return 1

    # ------------------------------------------------------------------------------------------------------------
    # loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        extras = {c: inputs.pop(c) for c in (SIGN_COLUMN, INDEX_COLUMN) if c in inputs}
        if not self.args.owns_loss:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        mode = "train" if self.model.training else "eval"
        objective = self._ensure_objective()
        inputs["use_cache"] = False
        if self.aux_loss_enabled:
            inputs["output_router_logits"] = True
        with self.fused_forward():  # TRL's fused LM head, attached also when called outside `train`
            outputs = model(**inputs, fused_lm_head=True)
        log_probs = outputs.log_probs.float()
        mask = outputs.label_mask.bool()
        per_token, active = objective.fn(log_probs, mask)
        step = self._step_counts if mode == "train" and self._step_counts is not None else None

        if self.args.per_sample:
            seq_idx = inputs["seq_idx"][..., 1:] if "seq_idx" in inputs else None
            num_seqs = next(iter(extras.values())).numel() if extras else None
            if self._sequence is not None:
                total = self._sequence_total(mode, extras, log_probs, mask, seq_idx, num_seqs)
            else:  # per-sample reweighting: mean_i λ_i ℓ_i, λ_i fixed for the whole step
                seq_loss = sequence_mean(per_token, mask, seq_idx, num_seqs)
                if mode == "train" and INDEX_COLUMN in extras:
                    index = extras[INDEX_COLUMN].cpu()
                    weights = self._reweighting.weights(index).to(seq_loss.device)
                    self._step_samples.append((index, seq_loss.detach().cpu()))
                else:  # evaluation reports the plain mean
                    weights = torch.ones_like(seq_loss)
                total = (weights * seq_loss).sum()
            # REDI's "pair" reduction averages over pairs of sequences, as the reference does
            per_unit = 2 if self._sequence is not None and self._redi_reduction == "pair" else 1
            if step is not None:
                denom = step["sequences"] / per_unit
            else:
                denom = (sequence_mean(mask.float(), mask, seq_idx, num_seqs) > 0).sum().float() / per_unit
        else:
            total = per_token.sum()
            normalize_active = self.args.threshold_normalization == "active"
            if step is not None:
                denom = step["tokens"]
                if normalize_active:  # corrected to the step's active count in `_end_step`
                    self._step_active = _accumulate(self._step_active, active.sum().double())
            else:
                denom = (active if normalize_active else mask).sum().float()
        loss = total / torch.as_tensor(denom, device=total.device).clamp(min=1)
        if step is not None:
            loss = loss * self._process_multiplier()
        if self.aux_loss_enabled:
            steps = self.current_gradient_accumulation_steps if step is not None else 1
            loss = loss + self.router_aux_loss_coef * outputs.aux_loss / steps
        self._log_token_metrics(mode, inputs, outputs, log_probs, mask, active)
        if return_outputs:
            warnings.warn("`return_outputs=True` recomputes the logits with an extra forward pass.", stacklevel=2)
            with torch.no_grad():
                outputs = model(**{k: v for k, v in inputs.items() if k != "labels"})
        return (loss, outputs) if return_outputs else loss

    def _sequence_total(self, mode, extras, log_probs, mask, seq_idx, num_seqs) -> torch.Tensor:
        """Summed terms of the active sequence objective over the signed sequences of the micro-batch."""
        if SIGN_COLUMN not in extras:
            raise ValueError(
                f"sequence_objective={self.args.sequence_objective!r} needs a '{SIGN_COLUMN}' column in every batch."
            )
        sign = extras[SIGN_COLUMN].to(log_probs.device)
        seq_logp = sequence_mean(log_probs, mask, seq_idx, num_seqs)
        total = self._sequence(seq_logp, sign, **self._sequence.params_from(self.args)).sum()
        self._log_signed(mode, seq_logp.detach(), sign)
        return total

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        if not self.args.owns_loss:
            return loss
        self._step_loss = _accumulate(self._step_loss, loss.detach())
        if self.accelerator.sync_gradients:  # last micro-batch of the optimizer step: gradients are complete
            loss = self._end_step(model, loss)
        return loss

    def _reset_step(self) -> None:
        # kept on the device: no host sync per micro-batch
        self._step_active: torch.Tensor | None = None
        self._step_loss: torch.Tensor | None = None
        self._step_samples: list[tuple[torch.Tensor, torch.Tensor]] = []

    def _end_step(self, model, loss: torch.Tensor) -> torch.Tensor:
        if self.args.threshold_normalization == "active" and not self.args.per_sample:
            active = self._step_active if self._step_active is not None else torch.zeros((), dtype=torch.float64)
            active = active.to(self.accelerator.device)
            if self.args.average_tokens_across_devices and self.args.world_size > 1:
                active = self.accelerator.reduce(active, reduction="sum")
            factor = (self._step_counts["tokens"].double() / active.clamp(min=1)).float()
            for param in model.parameters():
                if param.grad is not None:
                    param.grad.mul_(factor.to(param.grad.device))
            # the logged loss becomes the step's active-token mean too
            loss = loss + (factor.to(loss.device) - 1) * self._step_loss.to(loss.device)
        if self._reweighting is not None and self._step_samples:
            self._update_multipliers()
        self._reset_step()
        return loss

    def _update_multipliers(self) -> None:
        index = torch.cat([i for i, _ in self._step_samples]).to(self.accelerator.device)
        losses = torch.cat([v for _, v in self._step_samples]).to(self.accelerator.device)
        # every process applies the same update to its full copy of the table
        index = self.accelerator.gather(self.accelerator.pad_across_processes(index, pad_index=-1)).cpu()
        losses = self.accelerator.gather(self.accelerator.pad_across_processes(losses, pad_index=0.0)).cpu()
        keep = index >= 0
        for key, value in self._reweighting.update(index[keep], losses[keep]).items():
            self._metrics["train"][f"stable/sft/{key}"].append(value)

    # ------------------------------------------------------------------------------------------------------------
    # metrics (TRL's names for TRL's metrics; `compute_loss` of trl/trainer/sft_trainer.py)

    def _log_token_metrics(self, mode, inputs, outputs, log_probs, mask, active) -> None:
        gather = self.accelerator.gather_for_metrics
        num_valid = gather(mask.sum()).sum()
        sums = {
            "entropy": gather(outputs.entropy.detach().sum()).sum(),
            "mean_token_accuracy": gather(outputs.is_top1.sum()).sum(),
            "mean_p": gather(torch.where(mask, log_probs.detach().exp(), 0.0).sum()).sum(),
        }
        if self._objective is not None and self._objective.name == "threshold":
            sums["frac_active"] = gather(active.sum()).sum()
        for key, value in sums.items():
            self._metrics[mode][key].append((value / num_valid).item() if num_valid > 0 else 0.0)
        if mode == "train":
            if "attention_mask" in inputs:
                seen = gather(inputs["attention_mask"].sum()).sum().item()
            else:
                seen = gather(torch.tensor(inputs["position_ids"].size(1), device=mask.device)).sum().item()
            self._total_train_tokens += seen // self._tp_size
        self._metrics[mode]["num_tokens"] = [self._total_train_tokens]
        if self.aux_loss_enabled:
            self._metrics[mode]["aux_loss"].append(gather(outputs.aux_loss.detach()).mean().item())

    def _log_signed(self, mode, seq_logp, sign) -> None:
        gather = self.accelerator.gather_for_metrics
        for key, selected in (("pos", sign > 0), ("neg", sign < 0)):
            total = gather(torch.where(selected, seq_logp, 0.0).sum()).sum()
            count = gather(selected.sum()).sum()
            if count > 0:
                self._metrics[mode][f"stable/sft/{self._sequence.name}_{key}_logp"].append((total / count).item())

    # ------------------------------------------------------------------------------------------------------------
    # state and model card

    def _stable_state(self):
        tensors = {"fl_multipliers": self._multipliers} if self._reweighting is not None else {}
        # TRL's `num_tokens` metric counts in `_total_train_tokens`, which transformers does not checkpoint
        meta = {"trainer": type(self).__name__, "probe": self._probe, "num_tokens": self._total_train_tokens}
        return tensors, meta

    def _load_stable_state(self, tensors, meta):
        if self._reweighting is not None:
            if "fl_multipliers" in tensors:
                self._reweighting.load(tensors["fl_multipliers"])
            else:
                logger.warning("The checkpoint has no Feasible Learning multipliers; they restart from `fl_init`.")
        if self.args.needs_probe and meta.get("probe") is not None:
            self._probe = meta["probe"]
            self._objective = self._resolve_objective(self._probe)
        self._total_train_tokens = meta.get("num_tokens", self._total_train_tokens)

    def _card_sections(self) -> CardSections:
        args = self.args
        objective = self._objective.describe() if self._objective is not None else args.sft_objective
        resolved = " (resolved by the base-model probe)" if args.needs_probe else ""
        out = CardSections(
            lines=[f"Per-token objective used: `{objective}`{resolved}."],
            settings={"objective": objective},
            tags=[f"sft_objective-{args.sft_objective}"],
        )
        if self._probe is not None:
            out.settings["probe"] = {k: round(v, 6) for k, v in self._probe["stats"].items()}
        if self._sequence is not None:
            out.settings["redi_reduction"] = self._redi_reduction
        return out
