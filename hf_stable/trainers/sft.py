"""`StableSFTConfig` / `StableSFTTrainer`: TRL's SFT with alternative objectives.

The trainer only gathers inputs, calls the pure functions of `hf_stable.losses.sft` and logs. Loss contract (what
makes gradient accumulation and the number of processes leave the update unchanged): every micro-batch's loss is its
*sum* of per-token (or per-sequence) terms divided by the count over the whole optimizer step, all micro-batches and
all processes, times the number of processes (DDP averages gradients). Counts come from `get_batch_samples`, which sees
every micro-batch of the step before the first forward (transformers' `Trainer._get_num_items_in_batch` rule,
extended to sequences). The one count that needs the forward, the number of *active* tokens of a thresholded
objective, is applied by rescaling the accumulated gradients once at the end of the step.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import warnings
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from accelerate.utils import is_peft_model
from transformers import TrainerCallback
from trl import SFTConfig, SFTTrainer

from ..adapters.card import adapter_card_info
from ..cards import TrainingCard, write_training_card
from ..losses.sft import (
    DEFAULT_AUTO_RULE,
    SFT_OBJECTIVES,
    SFT_SAMPLE_REWEIGHTING,
    SFT_SEQUENCE_OBJECTIVES,
    SFT_THRESHOLDS,
    choose_objective,
    feasible_dual_update,
    probe_statistics,
    quantile,
    redi_terms,
    sequence_mean,
)
from ..papers import PAPERS
from ._base import AdapterOptimizerMixin, StableStateMixin, TokenFreeConfigMixin, write_json_atomic
from ._data import (
    INDEX_COLUMN,
    PAIR_COLUMN,
    SIGN_COLUMN,
    ExtraColumnsCollator,
    PairSampler,
    add_index,
    check_signs,
    column_names,
    complete_pairs_only,
    expand_pairs,
)


logger = logging.getLogger(__name__)

PROBE_FILE = "objective_probe.json"
_NORMALIZATIONS = ("supervised", "active")
_REDI_REDUCTIONS = ("pair", "sequence")


def _check_choice(name: str, value, allowed) -> None:
    if value not in allowed:
        shown = ", ".join(repr(a) for a in allowed)
        raise ValueError(f"`{name}`={value!r} is not valid. Allowed values: {shown}.")


def _check_number(name: str, value, *, low=None, high=None, low_open=False, allow_none=False) -> None:
    if value is None and allow_none:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (low is None or (value > low if low_open else value >= low)) and (high is None or value <= high)
    if not ok:
        bounds = (
            f"{'(' if low_open else '['}{low if low is not None else '-inf'}, {high if high is not None else 'inf'}]"
        )
        raise ValueError(f"`{name}` must be a finite number in {bounds}, got {value!r}.")


@dataclass
class StableSFTConfig(TokenFreeConfigMixin, SFTConfig):
    r"""
    Configuration for [`StableSFTTrainer`]: every [`~trl.SFTConfig`] field, plus the objectives below. With every new
    field at its default the trainer is TRL's `SFTTrainer`.

    Parameters:
        > Per-token objective (Li et al., "Beyond Log Likelihood", arXiv 2510.00526)

        sft_objective (`str`, *optional*, defaults to `"nll"`):
            `"nll"` (`-log p`), `"prob_power"` (`(1-p^α)/α`), `"threshold"` (a thresholded variant, see
            `threshold_kind`) or `"auto"` (probe the base model's token probabilities on the training data and pick
            `prob_power` with α=1 in the model-strong regime, `nll` otherwise; hf_stable's rule, experimental).
        objective_alpha (`float`, *optional*, defaults to `1.0`):
            α ≥ 0 of `prob_power`: 0 is NLL, 1 is "-p" (gradient-identical to TRL's `loss_type="dft"`), 10 is "-p^10".
        threshold_kind (`str`, *optional*, defaults to `"top_p"`):
            `"top_p"`, `"bottom_p"`, `"top_logp"`, `"bottom_logp"`, `"unlikelihood_top"` or `"unlikelihood_bottom"`.
        threshold (`float`, *optional*):
            Absolute probability threshold in [0, 1] of the thresholded objective.
        threshold_quantile (`float`, *optional*):
            Instead of `threshold`: this quantile (in [0, 1]) of the base model's supervised-token probabilities,
            measured by the probe before training and then frozen (how the paper set its thresholds).
        threshold_normalization (`str`, *optional*):
            `"active"` divides by the number of tokens kept by the threshold, `"supervised"` by all supervised tokens.
            Both are exact over gradient accumulation and processes. Defaults to `"active"` for
            `sft_objective="threshold"` (the paper's normalisation) and `"supervised"` otherwise.
        auto_probe_batches (`int`, *optional*, defaults to `32`):
            Training batches (per process) the probe reads for `auto` and `threshold_quantile`.
        auto_rule (`dict` or `str`, *optional*):
            Thresholds of the `auto` rule, keys `strong_median` (0.9), `strong_p20` (0.0: off), `weak_median` (0.3).

        > Sequence objective (REDI, arXiv 2505.24850)

        sequence_objective (`str`, *optional*):
            `"redi"`: `-c⁺·ℓ̄(y⁺) + α·ℓ̄(y⁻)` with `ℓ̄` the length-normalised log-likelihood. The dataset has
            `prompt`/`chosen`/`rejected` columns (pairs) or `prompt`/`completion`/`redi_sign` (±1) columns.
        redi_pos_weight (`float`, *optional*, defaults to `1.0`):
            c⁺, weight of positive sequences.
        redi_neg_weight (`float`, *optional*, defaults to `0.8`):
            α, weight of negative sequences; the paper keeps it below `redi_pos_weight` for stability.
        redi_neg_weighting_gamma (`float`, *optional*):
            If set, negative terms are multiplied by `exp(γ·ℓ̄(y⁻))`, damping the push on already unlikely negatives.
        redi_reduction (`str`, *optional*):
            `"pair"` (divide by the number of pairs, as the reference) or `"sequence"`. Defaults to `"pair"` for paired
            data and `"sequence"` for a `redi_sign` column.

        > Per-sample reweighting (Feasible Learning, arXiv 2501.14912)

        sample_reweighting (`str`, *optional*):
            `"feasible"`: each sample i gets a multiplier λ_i, the loss is `mean_i λ_i ℓ_i` with ℓ_i the sample's
            length-normalised per-token loss, and λ_i follows projected dual ascent on `ℓ_i ≤ ε`.
        fl_epsilon (`float`, *optional*, defaults to `0.001`):
            ε, the per-sample loss bound.
        fl_target_prob (`float`, *optional*):
            Instead of `fl_epsilon`: a per-token probability p* in (0, 1], giving ε = -log p*.
        fl_dual_lr (`float`, *optional*, defaults to `1.0`):
            Dual step size η.
        fl_resilient_rho (`float`, *optional*, defaults to `2.0`):
            ρ of Resilient FL (slack penalty); `None` for hard feasibility.
        fl_init (`float`, *optional*, defaults to `1.0`):
            Initial multiplier of every sample.
    """

    sft_objective: str = field(
        default="nll",
        metadata={"help": "Per-token objective: 'nll', 'prob_power', 'threshold' or 'auto'."},
    )
    objective_alpha: float = field(
        default=1.0,
        metadata={"help": "Power α >= 0 of prob_power, (1 - p^α)/α. 0 = NLL, 1 = -p (DFT gradient), 10 = -p^10."},
    )
    threshold_kind: str = field(
        default="top_p",
        metadata={
            "help": "Thresholded objective: 'top_p', 'bottom_p', 'top_logp', 'bottom_logp', 'unlikelihood_top' or "
            "'unlikelihood_bottom'."
        },
    )
    threshold: float | None = field(
        default=None, metadata={"help": "Absolute probability threshold in [0, 1] of the thresholded objective."}
    )
    threshold_quantile: float | None = field(
        default=None,
        metadata={"help": "Threshold as a quantile in [0, 1] of the base model's token probabilities (probed)."},
    )
    threshold_normalization: str | None = field(
        default=None,
        metadata={
            "help": "'active' (divide by tokens kept by the threshold) or 'supervised' (by all supervised tokens). "
            "Default: 'active' for sft_objective='threshold', else 'supervised'."
        },
    )
    auto_probe_batches: int = field(
        default=32, metadata={"help": "Training batches per process read by the base-model probability probe."}
    )
    auto_rule: dict | str | None = field(
        default=None,
        metadata={"help": "Thresholds of the auto rule (JSON): strong_median, strong_p20, weak_median."},
    )
    sequence_objective: str | None = field(
        default=None, metadata={"help": "Sequence objective: None or 'redi' (reinforcement distillation)."}
    )
    redi_pos_weight: float = field(default=1.0, metadata={"help": "REDI weight c+ of positive sequences."})
    redi_neg_weight: float = field(default=0.8, metadata={"help": "REDI weight α of negative sequences (keep < c+)."})
    redi_neg_weighting_gamma: float | None = field(
        default=None, metadata={"help": "If set, negative terms are multiplied by exp(γ·mean log p)."}
    )
    redi_reduction: str | None = field(
        default=None,
        metadata={"help": "'pair' or 'sequence'. Default: 'pair' for chosen/rejected data, else 'sequence'."},
    )
    sample_reweighting: str | None = field(
        default=None, metadata={"help": "Per-sample reweighting: None or 'feasible' (Feasible Learning)."}
    )
    fl_epsilon: float = field(default=1e-3, metadata={"help": "Feasible Learning per-sample loss bound ε."})
    fl_target_prob: float | None = field(
        default=None, metadata={"help": "Per-token probability p* in (0, 1]; sets ε = -log p* (overrides fl_epsilon)."}
    )
    fl_dual_lr: float = field(default=1.0, metadata={"help": "Feasible Learning dual step size."})
    fl_resilient_rho: float | None = field(
        default=2.0, metadata={"help": "Resilient FL slack penalty ρ; None for hard feasibility."}
    )
    fl_init: float = field(default=1.0, metadata={"help": "Initial Feasible Learning multiplier of every sample."})

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.auto_rule, str):
            self.auto_rule = json.loads(self.auto_rule)
        _check_choice("sft_objective", self.sft_objective, [*SFT_OBJECTIVES.names(), "auto"])
        _check_number("objective_alpha", self.objective_alpha, low=0)
        _check_choice("threshold_kind", self.threshold_kind, SFT_THRESHOLDS.names())
        _check_number("threshold", self.threshold, low=0, high=1, allow_none=True)
        _check_number("threshold_quantile", self.threshold_quantile, low=0, high=1, allow_none=True)
        if self.sft_objective == "threshold" and (self.threshold is None) == (self.threshold_quantile is None):
            raise ValueError("sft_objective='threshold' needs exactly one of `threshold` or `threshold_quantile`.")
        if self.sft_objective != "threshold" and (self.threshold is not None or self.threshold_quantile is not None):
            raise ValueError(
                "`threshold`/`threshold_quantile` only apply to sft_objective='threshold', got "
                f"{self.sft_objective!r}."
            )
        _check_choice("threshold_normalization", self.threshold_normalization, [None, *_NORMALIZATIONS])
        if not isinstance(self.auto_probe_batches, int) or self.auto_probe_batches < 1:
            raise ValueError(f"`auto_probe_batches` must be an integer >= 1, got {self.auto_probe_batches!r}.")
        if self.auto_rule is not None:
            unknown = set(self.auto_rule) - set(DEFAULT_AUTO_RULE)
            if unknown:
                raise ValueError(f"`auto_rule` keys must be among {sorted(DEFAULT_AUTO_RULE)}, got {sorted(unknown)}.")
        if self.loss_type == "dft" and self.sft_objective != "nll":
            raise ValueError(
                f"`loss_type='dft'` cannot be combined with sft_objective={self.sft_objective!r}: DFT is "
                "sft_objective='prob_power' with objective_alpha=1. Keep loss_type='nll'."
            )

        _check_choice("sequence_objective", self.sequence_objective, [None, *SFT_SEQUENCE_OBJECTIVES.names()])
        _check_number("redi_pos_weight", self.redi_pos_weight, low=0)
        _check_number("redi_neg_weight", self.redi_neg_weight, low=0)
        _check_number("redi_neg_weighting_gamma", self.redi_neg_weighting_gamma, allow_none=True)
        _check_choice("redi_reduction", self.redi_reduction, [None, *_REDI_REDUCTIONS])
        _check_choice("sample_reweighting", self.sample_reweighting, [None, *SFT_SAMPLE_REWEIGHTING.names()])
        _check_number("fl_epsilon", self.fl_epsilon, low=0)
        _check_number("fl_target_prob", self.fl_target_prob, low=0, high=1, low_open=True, allow_none=True)
        _check_number("fl_dual_lr", self.fl_dual_lr, low=0, low_open=True)
        _check_number("fl_resilient_rho", self.fl_resilient_rho, low=0, low_open=True, allow_none=True)
        _check_number("fl_init", self.fl_init, low=0)

        per_sample = self.sequence_objective is not None or self.sample_reweighting is not None
        if self.sequence_objective == "redi" and self.sft_objective != "nll":
            raise ValueError(
                "sequence_objective='redi' is defined on log-likelihoods; set sft_objective='nll' (got "
                f"{self.sft_objective!r})."
            )
        if self.sequence_objective is not None and self.sample_reweighting is not None:
            raise ValueError("sequence_objective and sample_reweighting cannot be combined; choose one.")
        if per_sample and self.packing:
            raise ValueError(
                "`packing=True` drops per-example columns (TRL keeps only input_ids/labels when packing), which "
                f"sequence_objective={self.sequence_objective!r} / sample_reweighting={self.sample_reweighting!r} "
                "need. Set packing=False (padding_free=True still works)."
            )
        if per_sample and self.threshold_normalization == "active":
            raise ValueError(
                "threshold_normalization='active' does not apply to per-sample objectives, which average each "
                "sample over its supervised tokens; leave it unset."
            )
        if self.threshold_normalization is None:
            self.threshold_normalization = (
                "active" if self.sft_objective == "threshold" and not per_sample else "supervised"
            )

    @property
    def owns_loss(self) -> bool:
        """Whether hf_stable computes the loss (otherwise TRL's own `compute_loss` runs unchanged)."""
        return not (
            self.sft_objective == "nll" and self.sequence_objective is None and self.sample_reweighting is None
        )

    @property
    def per_sample(self) -> bool:
        return self.sequence_objective is not None or self.sample_reweighting is not None

    @property
    def needs_probe(self) -> bool:
        return self.sft_objective == "auto" or self.threshold_quantile is not None

    @property
    def feasibility_epsilon(self) -> float:
        return -math.log(self.fl_target_prob) if self.fl_target_prob is not None else self.fl_epsilon


@dataclass
class _Objective:
    """The per-token objective actually used (after `auto`/quantile resolution)."""

    name: str
    params: dict[str, Any]

    def __post_init__(self):
        self.fn = partial(SFT_OBJECTIVES.get(self.name).fn, **self.params)

    def describe(self) -> str:
        inner = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in self.params.items())
        return f"{self.name}({inner})" if inner else self.name


def _accumulate(total: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor:
    return value if total is None else total + value


class _ProbeCallback(TrainerCallback):
    """Runs the base-model probe once the model is prepared (so it works under ZeRO-3), before the first step."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer._ensure_objective()


class StableSFTTrainer(StableStateMixin, AdapterOptimizerMixin, SFTTrainer):
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

        self._probe: dict | None = None
        self._objective: _Objective | None = None if args.needs_probe else self._resolve_objective(None)
        if args.needs_probe:
            self.add_callback(_ProbeCallback(self))
        self._multipliers = None
        if args.sample_reweighting == "feasible":
            self._multipliers = torch.full((self._num_samples,), float(args.fl_init))
        self._reset_step()
        self._step_counts: dict[str, torch.Tensor] | None = None
        self._warned_all_feasible = False

    # ------------------------------------------------------------------------------------------------------------
    # construction helpers

    @staticmethod
    def _coerce_args(model, args) -> StableSFTConfig:
        if args is None:
            name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "model")
            return StableSFTConfig(f"{str(name).rstrip('/').split('/')[-1]}-StableSFT")
        if isinstance(args, StableSFTConfig):
            return args
        from transformers import TrainingArguments

        if isinstance(args, TrainingArguments):  # an SFTConfig or plain TrainingArguments: keep every value
            # not `to_dict()`, which masks every `*_token` field (eos_token, hub_token, ...) with a placeholder
            return StableSFTConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.init})
        raise TypeError(
            f"`args` must be a StableSFTConfig, SFTConfig or TrainingArguments, got {type(args).__name__}."
        )

    def _add_columns(self, dataset, args: StableSFTConfig, name: str, training: bool = True):
        names = column_names(dataset)
        if args.sequence_objective == "redi":
            if {"chosen", "rejected"} <= set(names):
                dataset = expand_pairs(dataset)
                self._paired = self._paired or training
            elif SIGN_COLUMN in names:
                check_signs(dataset)
            else:
                raise ValueError(
                    f"sequence_objective='redi' needs, in the {name} dataset, either 'prompt'/'chosen'/'rejected' "
                    f"columns (pairs) or a '{SIGN_COLUMN}' column (+1 positive, -1 negative) with 'prompt'/"
                    f"'completion'; got columns {names}."
                )
        if args.sample_reweighting == "feasible" and training:
            if not hasattr(dataset, "__len__"):
                raise ValueError(
                    "sample_reweighting='feasible' keeps one multiplier per training sample and needs a sized "
                    "`datasets.Dataset`, not an IterableDataset."
                )
            self._num_samples = len(dataset)
            dataset = add_index(dataset)
        return dataset

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

    def _prepare_dataset(self, dataset, processing_class, args, packing, formatting_func, dataset_name):
        dataset = super()._prepare_dataset(dataset, processing_class, args, packing, formatting_func, dataset_name)
        dataset, dropped = complete_pairs_only(dataset)
        if dropped:
            logger.warning(f"Dropped {dropped} {dataset_name} rows whose REDI pair partner was removed by truncation.")
        return dataset

    def _set_signature_columns_if_needed(self):
        super()._set_signature_columns_if_needed()
        for column in (SIGN_COLUMN, INDEX_COLUMN):
            if column not in self._signature_columns:
                self._signature_columns.append(column)

    def _get_train_sampler(self, train_dataset=None):
        dataset = self.train_dataset
        if (
            self.args.sequence_objective == "redi"
            and hasattr(dataset, "column_names")
            and PAIR_COLUMN in dataset.column_names
        ):
            if self.args.per_device_train_batch_size % 2:
                warnings.warn(
                    "REDI pairs are kept together only with an even per_device_train_batch_size; with "
                    f"{self.args.per_device_train_batch_size} a pair can straddle two micro-batches.",
                    stacklevel=2,
                )
            seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
            return PairSampler(dataset[PAIR_COLUMN], seed)
        return super()._get_train_sampler(train_dataset)

    # ------------------------------------------------------------------------------------------------------------
    # objective resolution and the base-model probe

    def _resolve_objective(self, probe: dict | None) -> _Objective:
        args = self.args
        name = args.sft_objective
        if name == "auto":
            decision = probe["decision"]
            name = decision["sft_objective"]
            return _Objective(name, {"alpha": decision["objective_alpha"]} if name == "prob_power" else {})
        if name == "prob_power":
            return _Objective(name, {"alpha": float(args.objective_alpha)})
        if name == "threshold":
            threshold = args.threshold if args.threshold is not None else probe["threshold"]
            return _Objective(name, {"kind": args.threshold_kind, "threshold": float(threshold)})
        return _Objective(name, {})

    def _ensure_objective(self) -> _Objective:
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
        if args.sft_objective == "auto":
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
        outputs = model(**inputs, fused_lm_head=True)
        log_probs = outputs.log_probs.float()
        mask = outputs.label_mask.bool()
        per_token, active = objective.fn(log_probs, mask)
        step = self._step_counts if mode == "train" and self._step_counts is not None else None

        if self.args.per_sample:
            seq_idx = inputs["seq_idx"][..., 1:] if "seq_idx" in inputs else None
            num_seqs = next(iter(extras.values())).numel() if extras else None
            if self.args.sequence_objective == "redi":
                if SIGN_COLUMN not in extras:
                    raise ValueError(f"sequence_objective='redi' needs a '{SIGN_COLUMN}' column in every batch.")
                sign = extras[SIGN_COLUMN].to(log_probs.device)
                seq_logp = sequence_mean(log_probs, mask, seq_idx, num_seqs)
                total = redi_terms(
                    seq_logp,
                    sign,
                    self.args.redi_pos_weight,
                    self.args.redi_neg_weight,
                    self.args.redi_neg_weighting_gamma,
                ).sum()
                self._log_redi(mode, seq_logp.detach(), sign)
            else:  # feasible learning: mean_i λ_i ℓ_i, λ_i fixed for the whole step
                seq_loss = sequence_mean(per_token, mask, seq_idx, num_seqs)
                if mode == "train" and INDEX_COLUMN in extras:
                    index = extras[INDEX_COLUMN].cpu()
                    weights = self._multipliers[index].to(seq_loss.device)
                    self._step_samples.append((index, seq_loss.detach().cpu()))
                else:  # evaluation reports the plain mean
                    weights = torch.ones_like(seq_loss)
                total = (weights * seq_loss).sum()
            # REDI's "pair" reduction averages over pairs of sequences, as the reference does
            per_unit = 2 if self.args.sequence_objective == "redi" and self._redi_reduction == "pair" else 1
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
        if self._multipliers is not None and self._step_samples:
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
        index, losses = index[keep], losses[keep]
        args = self.args
        update = partial(
            feasible_dual_update, epsilon=args.feasibility_epsilon, dual_lr=args.fl_dual_lr, rho=args.fl_resilient_rho
        )
        if index.unique().numel() == index.numel():
            self._multipliers[index] = update(self._multipliers[index], losses)
        else:  # a sample seen twice in one step (dataset smaller than the batch): apply in order
            for i, value in zip(index.tolist(), losses.tolist(), strict=True):
                self._multipliers[i] = update(self._multipliers[i : i + 1], torch.tensor([value]))[0]
        table = self._multipliers
        metrics = self._metrics["train"]
        metrics["stable/sft/fl_lambda_mean"].append(table.mean().item())
        metrics["stable/sft/fl_lambda_max"].append(table.max().item())
        metrics["stable/sft/fl_lambda_p90"].append(quantile(table, 0.9))
        metrics["stable/sft/fl_frac_satisfied"].append((losses <= args.feasibility_epsilon).float().mean().item())
        metrics["stable/sft/fl_worst_decile_loss"].append(quantile(losses, 0.9))
        if not self._warned_all_feasible and bool((self._multipliers[index] == 0).all()):
            self._warned_all_feasible = True
            warnings.warn(
                "Feasible Learning: every sample of this step satisfies its constraint (λ = 0), so these samples no "
                "longer contribute to the gradient. This is by design; lower `fl_epsilon` to keep learning.",
                stacklevel=2,
            )

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

    def _log_redi(self, mode, seq_logp, sign) -> None:
        gather = self.accelerator.gather_for_metrics
        for key, selected in (("pos", sign > 0), ("neg", sign < 0)):
            total = gather(torch.where(selected, seq_logp, 0.0).sum()).sum()
            count = gather(selected.sum()).sum()
            if count > 0:
                self._metrics[mode][f"stable/sft/redi_{key}_logp"].append((total / count).item())

    # ------------------------------------------------------------------------------------------------------------
    # state and model card

    def _stable_state(self):
        tensors = {"fl_multipliers": self._multipliers} if self._multipliers is not None else {}
        meta = {"trainer": type(self).__name__, "probe": self._probe}
        return tensors, meta

    def _load_stable_state(self, tensors, meta):
        if self._multipliers is not None:
            if "fl_multipliers" not in tensors:
                logger.warning("The checkpoint has no Feasible Learning multipliers; they restart from `fl_init`.")
            elif tensors["fl_multipliers"].shape != self._multipliers.shape:
                raise ValueError(
                    f"The checkpoint's Feasible Learning table has {tensors['fl_multipliers'].numel()} entries but "
                    f"the training set has {self._multipliers.numel()} samples; resume with the same dataset."
                )
            else:
                self._multipliers = tensors["fl_multipliers"].float().clone()
        if self.args.needs_probe and meta.get("probe") is not None:
            self._probe = meta["probe"]
            self._objective = self._resolve_objective(self._probe)

    def create_model_card(self, model_name=None, dataset_name=None, tags=None):
        """Write `README.md` in `output_dir`: the objective with its settings and paper (main process only)."""
        if not self.is_world_process_zero():
            return
        args = self.args
        tags = [tags] if isinstance(tags, str) else list(tags or [])
        objective = self._objective.describe() if self._objective is not None else args.sft_objective
        method = [
            f"Per-token objective: `{objective}`"
            + (" (resolved by the base-model probe of `sft_objective='auto'`)." if args.needs_probe else ".")
        ]
        papers = []
        if args.sft_objective != "nll":
            papers.append(PAPERS["beyond_ll"])
            method.append(
                "The probability family `(1 - p^α)/α` and its thresholded variants weight each supervised "
                "token's NLL gradient by `p^α` (or keep it only above/below a probability threshold)."
            )
        settings = {"sft_objective": args.sft_objective, "objective": objective}
        if args.sft_objective == "threshold":
            settings.update(threshold_kind=args.threshold_kind, threshold_normalization=args.threshold_normalization)
        if self._probe is not None:
            settings["probe"] = {k: round(v, 6) for k, v in self._probe["stats"].items()}
        if args.sequence_objective == "redi":
            papers.append(PAPERS["redi"])
            method.append(
                f"REDI: `-c⁺·ℓ̄(y⁺) + α·ℓ̄(y⁻)` over length-normalised log-likelihoods, reduction "
                f"`{self._redi_reduction}`."
            )
            settings.update(
                sequence_objective="redi",
                redi_pos_weight=args.redi_pos_weight,
                redi_neg_weight=args.redi_neg_weight,
                redi_neg_weighting_gamma=args.redi_neg_weighting_gamma,
            )
            tags.append("redi")
        if args.sample_reweighting == "feasible":
            papers.append(PAPERS["feasible_learning"])
            method.append(
                "Feasible Learning: per-sample multipliers λ_i weight each sample's loss and follow "
                "projected dual ascent on `ℓ_i ≤ ε`."
            )
            settings.update(
                sample_reweighting="feasible",
                fl_epsilon=args.feasibility_epsilon,
                fl_dual_lr=args.fl_dual_lr,
                fl_resilient_rho=args.fl_resilient_rho,
                fl_init=args.fl_init,
            )
            tags.append("feasible-learning")
        adapter_papers, adapter_lines, adapter_settings, adapter_tags = adapter_card_info(self.model)
        papers += [p for p in adapter_papers if p not in papers]
        method += adapter_lines
        settings.update(adapter_settings)
        tags += adapter_tags
        method.extend(f"Paper: [{p.title}]({p.url})." for p in papers)
        settings.update(
            learning_rate=args.learning_rate,
            max_steps=args.max_steps,
            num_train_epochs=args.num_train_epochs,
            per_device_train_batch_size=args.per_device_train_batch_size,
            gradient_accumulation_steps=args.gradient_accumulation_steps,
        )
        card = TrainingCard(
            trainer_name="StableSFTTrainer",
            trl_trainer="trl.SFTTrainer",
            method="\n\n".join(method),
            settings=settings,
            tags=[*self._tag_names, f"sft_objective-{args.sft_objective}", *tags],
            citations=[p.bibtex for p in papers],
            example_prompt="1+2=",
        )
        base = getattr(self.model.config, "_name_or_path", None)
        model_name = model_name or os.path.basename(os.path.abspath(args.output_dir))
        write_training_card(
            card,
            args.output_dir,
            model_name=model_name,
            base_model=base,
            hub_model_id=self.hub_model_id if args.push_to_hub else None,
            dataset_name=dataset_name,
        )
