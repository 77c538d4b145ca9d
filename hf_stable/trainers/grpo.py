"""`StableGRPOConfig` / `StableGRPOTrainer`: TRL's GRPO with the GRPO variants as config flags.

The trainer touches TRL through three narrow hooks (spec §1.2): it stashes the gathered rewards in
`_calculate_rewards`, replaces the advantages after `super()._generate_and_score_completions` (from the rewards of
the *whole* generation batch, gathered across processes, so results do not depend on their number), and adds
`_compute_loss` branches only for the new loss modes. With every new field at its default nothing is replaced and the
update is TRL's, bit for bit. The maths lives in `hf_stable.losses.{advantages, aggregation, policy,
reward_weighting}`.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import os
import re
import warnings
from dataclasses import dataclass, field

import torch
from trl import GRPOConfig, GRPOTrainer

from ..adapters.card import adapter_card_info
from ..callbacks.snr_lr import MicroBatchSNR, SNRLearningRateCallback
from ..cards import TrainingCard, write_training_card
from ..losses.advantages import ADVANTAGE_ESTIMATORS, group_zscore, success_indicator
from ..losses.aggregation import delta_l_weights
from ..losses.policy import (
    LOSS_MODES,
    drpo_coefficients,
    drpo_loss,
    onpolicy_sft_keep,
    onpolicy_sft_loss,
    sequence_logp,
)
from ..losses.reward_weighting import REWARD_TRANSFORMS, REWARD_WEIGHTINGS, brme_reward, influence_scores
from ..papers import PAPERS
from ..rewards.stable_rank import StableRankReward
from ._base import AdapterOptimizerMixin, StableStateMixin, TokenFreeConfigMixin
from ._reward_control import CONTROLLERS, GradientController, HypervolumeController
from .sft import _check_choice, _check_number


logger = logging.getLogger(__name__)

_LOSS_MODES = ("ppo", *LOSS_MODES.names())
# model inputs besides ids/mask that TRL's `_compute_loss` forwards (vision-language models)
_EXTRA_FORWARD_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)


@dataclass
class StableGRPOConfig(TokenFreeConfigMixin, GRPOConfig):
    r"""
    Configuration for [`StableGRPOTrainer`]: every [`~trl.GRPOConfig`] field plus the GRPO variants below. With every
    new field at its default the trainer is TRL's `GRPOTrainer`. Composition rules: one advantage estimator, one loss
    mode, one reward-weight controller; ΔL and the hypervolume multiplier stack on any estimator.

    Parameters:
        > Advantage estimator

        advantage_estimator (`str`, *optional*, defaults to `"grpo"`):
            `"grpo"` (TRL's advantages), `"sgrpo"` (noise-aware shrinkage, arXiv 2508.05928), `"maxrl"` (maximum
            likelihood RL, arXiv 2602.02710), `"dvao"` (variance-adaptive multi-reward, arXiv 2605.25604) or `"oblr"`
            (gradient-norm-weighted baseline, arXiv 2511.23310).
        correctness_reward_index (`int`, *optional*):
            Reward function that decides correctness for `sgrpo`, `maxrl`, `drpo` and `onpolicy_sft`; `None` uses
            the weighted sum of all rewards.
        success_threshold (`float`, *optional*, defaults to `0.5`):
            A completion is correct when that reward exceeds this value.
        sgrpo_noise_p (`float`, *optional*, defaults to `0.1`):
            Assumed probability that a binary reward is flipped, in [0, 0.5). 0 gives back GRPO.
        maxrl_truncation (`int`, *optional*):
            Compute index T of MaxRL (`None`: T = G, the maximum-likelihood end; 1: Dr. GRPO).
        maxrl_baseline (`str`, *optional*, defaults to `"mean"`):
            `"mean"` (group mean baseline) or `"none"`.
        maxrl_adv_clip (`float`, *optional*):
            Bound on |A| (a lone success among G gets G-1).
        dvao_sigma_power (`float`, *optional*, defaults to `1.0`):
            Exponent γ of the per-objective std in DVAO's weights.
        oblr_norm_proxy (`str`, *optional*, defaults to `"length"`):
            Proxy of the per-sample gradient norm in OBLR's baseline: `"length"` or `"uniform"` (plain mean).
        oblr_loo (`bool`, *optional*, defaults to `True`):
            Leave-one-out baseline.
        oblr_scale (`str`, *optional*, defaults to `"none"`):
            `"none"` or `"group"` (divide by the group std).
        oblr_adaptive_lr (`bool`, *optional*, defaults to `False`):
            Scale each step's learning rate by `SNR/(1+SNR)` estimated from the micro-batch gradients (needs
            `gradient_accumulation_steps >= 2`). Independent of the estimator.
        oblr_lr_min_ratio (`float`, *optional*, defaults to `0.1`):
            Lower clip of that factor.
        oblr_snr_ema (`float`, *optional*, defaults to `0.9`):
            EMA smoothing of the SNR.
        oblr_snr_params (`str`, *optional*):
            Regex of the parameters whose gradients estimate the SNR (default: all trainable).

        > Loss aggregation

        delta_l_alpha (`float`, *optional*):
            ΔL normalisation (arXiv 2509.07558): per-sample weights `L_i^-α / mean L^-α` on the advantages; needs
            `loss_type="dr_grpo"`. 1 is minimum-variance, 0.75 the paper's math setting.
        delta_l_scope (`str`, *optional*, defaults to `"batch"`):
            Normalise ΔL weights over the batch (reference) or within each group.
        delta_l_max_weight (`float`, *optional*):
            Cap on a ΔL weight.

        > Loss mode

        loss_mode (`str`, *optional*, defaults to `"ppo"`):
            `"ppo"` (TRL's surrogate for `loss_type`), `"drpo"` (decoupled reward policy optimisation, arXiv
            2510.04474) or `"onpolicy_sft"` (SFT on the model's own correct, complete samples, arXiv 2602.13407).
            Both new modes need `beta=0` and no Liger kernel, and replace the advantage estimator.
        drpo_lambda (`float`, *optional*, defaults to `0.1`):
            λ of DRPO's length preference among correct answers (smaller: stronger).
        drpo_tau (`float`, *optional*, defaults to `10.0`):
            τ of the soft-max over incorrect answers.
        drpo_delta (`float`, *optional*, defaults to `1e-4`):
            KL budget δ of the trust-region hinge.
        drpo_beta (`float`, *optional*, defaults to `1000.0`):
            Hinge strength β.
        drpo_kl_type (`str`, *optional*, defaults to `"kl"`):
            `"kl"` or `"k3"` estimator of the KL to the sampling policy.
        drpo_neg_weighting (`str`, *optional*, defaults to `"softmax_old"`):
            `"softmax_old"` (negatives weighted by `softmax(s_old/τ)`; one extra no-grad forward when TRL has no old
            log-probs) or `"uniform"`.
        osft_require_eos (`bool`, *optional*, defaults to `True`):
            On-policy SFT drops completions cut off at `max_completion_length` (the length budget).
        osft_norm (`str`, *optional*, defaults to `"tokens"`):
            `"tokens"` (mean over kept tokens of the step) or `"constant"` (per sample and `max_completion_length`).

        > Reward weighting

        reward_weighting (`str`, *optional*, defaults to `"static"`):
            `"static"`, `"hypervolume"`, `"gradient"` (both arXiv 2509.11452), `"ctwa"` (arXiv 2602.06869) or
            `"lagrangian"`.
        drw_maximize (`list[bool]`, *optional*):
            Hypervolume: whether each objective is maximised (default all).
        drw_eval_every (`int`, *optional*, defaults to `1`):
            Hypervolume: steps between validation evaluations.
        drw_val_size (`int`, *optional*, defaults to `16`):
            Hypervolume: validation prompts (from `eval_dataset`, else the first training prompts).
        drw_regularization (`float`, *optional*, defaults to `1e-5`):
            Gradient weighting: μ of the mirror-ascent step `η s / μ`.
        drw_target_params (`str`, *optional*):
            Gradient weighting: regex of the parameters whose gradients are compared (default: all trainable).
        drw_every_n_steps (`int`, *optional*, defaults to `1`):
            Gradient weighting: steps between updates (each costs one forward and K backwards).
        ctwa_cov_targets (`list[float]`, *optional*):
            CTWA covariance targets per objective (default 0.1 each).
        ctwa_lambda_lr (`float`, *optional*, defaults to `0.05`):
            CTWA step on the log-weights.
        ctwa_ema_tau (`float`, *optional*, defaults to `0.1`):
            CTWA EMA rate of the covariances.
        ctwa_use_corr (`bool`, *optional*, defaults to `False`):
            Correlation instead of covariance (scale-free targets).
        ctwa_obj_targets (`list[float]`, *optional*):
            Objective means above which CTWA stops raising a weight.
        ctwa_max_log_weight (`float`, *optional*):
            Upper bound on a CTWA log-weight.
        lagrange_thresholds (`list[float]`, *optional*):
            Lagrangian: upper bound θ_k on each mean reward (`null` for unconstrained).
        lagrange_lr (`float`, *optional*, defaults to `0.01`):
            Lagrangian: dual step size.

        > Reward transforms

        robust_reward (`str`, *optional*):
            `"brme"`: the reward functions in `brme_heads` become one robust reward `λ·mean + (1-λ)·min` (arXiv
            2409.15360), in the first head's column.
        brme_lambda (`float`, *optional*, defaults to `0.5`):
            λ of the robust reward.
        brme_heads (`list[int]`, *optional*):
            Reward functions forming the ensemble (default: all).
        stable_rank_reward (`bool`, *optional*, defaults to `False`):
            Append SR-GRPO's stable-rank reward (arXiv 2512.02807) as an extra reward function.
        stable_rank_weight (`float`, *optional*, defaults to `1.0`):
            Its reward weight.
        stable_rank_model (`str`, *optional*, defaults to `"ref"`):
            `"ref"` (a frozen copy of the initial policy scores, so the policy cannot game its own geometry) or
            `"policy"`.
    """

    advantage_estimator: str = field(
        default="grpo", metadata={"help": "Advantage estimator: 'grpo', 'sgrpo', 'maxrl', 'dvao' or 'oblr'."}
    )
    correctness_reward_index: int | None = field(
        default=None, metadata={"help": "Reward function deciding correctness (None: the weighted sum)."}
    )
    success_threshold: float = field(default=0.5, metadata={"help": "Correct when that reward exceeds this."})
    sgrpo_noise_p: float = field(default=0.1, metadata={"help": "S-GRPO flip probability p in [0, 0.5)."})
    maxrl_truncation: int | None = field(default=None, metadata={"help": "MaxRL compute index T (None: T = G)."})
    maxrl_baseline: str = field(default="mean", metadata={"help": "MaxRL baseline: 'mean' or 'none'."})
    maxrl_adv_clip: float | None = field(default=None, metadata={"help": "Bound on |A| for MaxRL."})
    dvao_sigma_power: float = field(default=1.0, metadata={"help": "DVAO exponent on the per-objective std."})
    oblr_norm_proxy: str = field(default="length", metadata={"help": "OBLR gradient-norm proxy: 'length', 'uniform'."})
    oblr_loo: bool = field(default=True, metadata={"help": "OBLR leave-one-out baseline."})
    oblr_scale: str = field(default="none", metadata={"help": "OBLR scaling: 'none' or 'group'."})
    oblr_adaptive_lr: bool = field(default=False, metadata={"help": "Scale the LR by SNR/(1+SNR) (OBLR-PO)."})
    oblr_lr_min_ratio: float = field(default=0.1, metadata={"help": "Lower clip of the SNR LR factor."})
    oblr_snr_ema: float = field(default=0.9, metadata={"help": "EMA smoothing of the SNR."})
    oblr_snr_params: str | None = field(default=None, metadata={"help": "Regex of parameters for the SNR."})
    delta_l_alpha: float | None = field(
        default=None, metadata={"help": "ΔL normalisation exponent (needs loss_type='dr_grpo'); None: off."}
    )
    delta_l_scope: str = field(default="batch", metadata={"help": "ΔL normalisation scope: 'batch' or 'group'."})
    delta_l_max_weight: float | None = field(default=None, metadata={"help": "Cap on a ΔL weight."})
    loss_mode: str = field(default="ppo", metadata={"help": "Loss mode: 'ppo', 'drpo' or 'onpolicy_sft'."})
    drpo_lambda: float = field(default=0.1, metadata={"help": "DRPO length-preference temperature λ."})
    drpo_tau: float = field(default=10.0, metadata={"help": "DRPO negative soft-max temperature τ."})
    drpo_delta: float = field(default=1e-4, metadata={"help": "DRPO KL budget δ."})
    drpo_beta: float = field(default=1e3, metadata={"help": "DRPO KL hinge strength β."})
    drpo_kl_type: str = field(default="kl", metadata={"help": "DRPO KL estimator: 'kl' or 'k3'."})
    drpo_neg_weighting: str = field(default="softmax_old", metadata={"help": "'softmax_old' or 'uniform'."})
    osft_require_eos: bool = field(default=True, metadata={"help": "On-policy SFT drops truncated completions."})
    osft_norm: str = field(default="tokens", metadata={"help": "On-policy SFT normaliser: 'tokens' or 'constant'."})
    reward_weighting: str = field(
        default="static",
        metadata={"help": "Reward-weight controller: 'static', 'hypervolume', 'gradient', 'ctwa' or 'lagrangian'."},
    )
    drw_maximize: list[bool] | None = field(default=None, metadata={"help": "Hypervolume: maximise each objective."})
    drw_eval_every: int = field(default=1, metadata={"help": "Hypervolume: steps between evaluations."})
    drw_val_size: int = field(default=16, metadata={"help": "Hypervolume: validation prompts."})
    drw_regularization: float = field(default=1e-5, metadata={"help": "Gradient weighting: μ of the step."})
    drw_target_params: str | None = field(default=None, metadata={"help": "Gradient weighting: parameter regex."})
    drw_every_n_steps: int = field(default=1, metadata={"help": "Gradient weighting: steps between updates."})
    ctwa_cov_targets: list[float] | None = field(default=None, metadata={"help": "CTWA covariance targets."})
    ctwa_lambda_lr: float = field(default=0.05, metadata={"help": "CTWA log-weight step."})
    ctwa_ema_tau: float = field(default=0.1, metadata={"help": "CTWA covariance EMA rate."})
    ctwa_use_corr: bool = field(default=False, metadata={"help": "CTWA on correlations instead of covariances."})
    ctwa_obj_targets: list[float] | None = field(default=None, metadata={"help": "CTWA objective caps."})
    ctwa_max_log_weight: float | None = field(default=None, metadata={"help": "CTWA bound on a log-weight."})
    lagrange_thresholds: list[float] | None = field(default=None, metadata={"help": "Lagrangian reward bounds."})
    lagrange_lr: float = field(default=0.01, metadata={"help": "Lagrangian dual step size."})
    robust_reward: str | None = field(default=None, metadata={"help": "Reward transform: None or 'brme'."})
    brme_lambda: float = field(default=0.5, metadata={"help": "BRME λ (mean weight)."})
    brme_heads: list[int] | None = field(default=None, metadata={"help": "Reward functions forming the ensemble."})
    stable_rank_reward: bool = field(default=False, metadata={"help": "Append the SR-GRPO stable-rank reward."})
    stable_rank_weight: float = field(default=1.0, metadata={"help": "Weight of the stable-rank reward."})
    stable_rank_model: str = field(default="ref", metadata={"help": "Stable-rank scoring model: 'ref' or 'policy'."})

    def __post_init__(self):
        super().__post_init__()
        _check_choice("advantage_estimator", self.advantage_estimator, ADVANTAGE_ESTIMATORS.names())
        _check_choice("loss_mode", self.loss_mode, _LOSS_MODES)
        _check_choice("reward_weighting", self.reward_weighting, REWARD_WEIGHTINGS.names())
        _check_choice("robust_reward", self.robust_reward, [None, *REWARD_TRANSFORMS.names()])
        _check_number("sgrpo_noise_p", self.sgrpo_noise_p, low=0)
        if self.sgrpo_noise_p >= 0.5:
            raise ValueError(f"`sgrpo_noise_p` must be in [0, 0.5) (0.5 divides by zero), got {self.sgrpo_noise_p}.")
        _check_choice("maxrl_baseline", self.maxrl_baseline, ["mean", "none"])
        if self.maxrl_truncation is not None and self.maxrl_truncation < 1:
            raise ValueError(f"`maxrl_truncation` must be >= 1 or None, got {self.maxrl_truncation}.")
        _check_number("maxrl_adv_clip", self.maxrl_adv_clip, low=0, low_open=True, allow_none=True)
        _check_number("dvao_sigma_power", self.dvao_sigma_power, low=0)
        _check_choice("oblr_norm_proxy", self.oblr_norm_proxy, ["length", "uniform"])
        _check_choice("oblr_scale", self.oblr_scale, ["none", "group"])
        _check_number("oblr_lr_min_ratio", self.oblr_lr_min_ratio, low=0, high=1)
        _check_number("oblr_snr_ema", self.oblr_snr_ema, low=0, high=1)
        if self.oblr_adaptive_lr and self.gradient_accumulation_steps < 2:
            raise ValueError(
                "`oblr_adaptive_lr=True` estimates the SNR from the micro-batch gradients of a step: set "
                f"gradient_accumulation_steps >= 2 (got {self.gradient_accumulation_steps})."
            )
        _check_number("delta_l_alpha", self.delta_l_alpha, low=0, allow_none=True)
        _check_choice("delta_l_scope", self.delta_l_scope, ["batch", "group"])
        _check_number("delta_l_max_weight", self.delta_l_max_weight, low=0, low_open=True, allow_none=True)
        if self.delta_l_alpha is not None and self.loss_type != "dr_grpo":
            raise ValueError(
                f"`delta_l_alpha` multiplies the advantages by length weights and needs the constant normaliser of "
                f"loss_type='dr_grpo'; with loss_type={self.loss_type!r} lengths would be normalised twice. Set "
                "loss_type='dr_grpo'."
            )
        for name in ("drpo_lambda", "drpo_tau", "drpo_beta"):
            _check_number(name, getattr(self, name), low=0, low_open=True)
        _check_number("drpo_delta", self.drpo_delta, low=0)
        _check_choice("drpo_kl_type", self.drpo_kl_type, ["kl", "k3"])
        _check_choice("drpo_neg_weighting", self.drpo_neg_weighting, ["softmax_old", "uniform"])
        _check_choice("osft_norm", self.osft_norm, ["tokens", "constant"])
        if self.loss_mode != "ppo":
            problems = []
            if self.beta != 0.0:
                problems.append(f"beta={self.beta} (set beta=0: no reference model)")
            if self.use_liger_kernel:
                problems.append("use_liger_kernel=True (Liger bypasses `_compute_loss`)")
            if self.advantage_estimator != "grpo":
                problems.append(f"advantage_estimator={self.advantage_estimator!r} (the loss mode sets its own)")
            if self.delta_l_alpha is not None:
                problems.append("delta_l_alpha (the loss mode has its own normalisation)")
            if problems:
                raise ValueError(f"loss_mode={self.loss_mode!r} cannot be combined with: " + "; ".join(problems) + ".")
        if self.advantage_estimator != "grpo" and self.multi_objective_aggregation != "sum_then_normalize":
            raise ValueError(
                f"advantage_estimator={self.advantage_estimator!r} aggregates the rewards itself; keep "
                "multi_objective_aggregation='sum_then_normalize'."
            )
        if self.advantage_estimator == "sgrpo" and self.scale_rewards != "group":
            warnings.warn("S-GRPO's weight assumes the group std: scale_rewards='group' is recommended.", stacklevel=2)
        if self.advantage_estimator in ("maxrl", "dvao") and self.scale_rewards != "group":
            warnings.warn(f"advantage_estimator={self.advantage_estimator!r} ignores scale_rewards.", stacklevel=2)
        for name in ("drw_eval_every", "drw_val_size", "drw_every_n_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"`{name}` must be >= 1, got {getattr(self, name)}.")
        _check_number("drw_regularization", self.drw_regularization, low=0, low_open=True)
        _check_number("ctwa_lambda_lr", self.ctwa_lambda_lr, low=0)
        _check_number("ctwa_ema_tau", self.ctwa_ema_tau, low=0, high=1)
        _check_number("lagrange_lr", self.lagrange_lr, low=0)
        _check_number("brme_lambda", self.brme_lambda, low=0, high=1)
        _check_choice("stable_rank_model", self.stable_rank_model, ["ref", "policy"])

    @property
    def replaces_advantages(self) -> bool:
        """Whether the trainer touches TRL's advantages (default config: no, the update is TRL's)."""
        return (
            self.advantage_estimator != "grpo"
            or self.delta_l_alpha is not None
            or self.loss_mode != "ppo"
            or self.reward_weighting in ("hypervolume", "ctwa", "gradient")
        )


class StableGRPOTrainer(StableStateMixin, AdapterOptimizerMixin, GRPOTrainer):
    """TRL's [`~trl.GRPOTrainer`] with the advantage estimators, loss modes, reward controllers and transforms of
    [`StableGRPOConfig`]. Same arguments as `GRPOTrainer`.

    Example:
    ```python
    from hf_stable import StableGRPOConfig, StableGRPOTrainer
    args = StableGRPOConfig(output_dir="out", advantage_estimator="sgrpo", sgrpo_noise_p=0.2, loss_type="dr_grpo")
    trainer = StableGRPOTrainer(model=model, reward_funcs=[correct, short], args=args, train_dataset=ds)
    trainer.train()
    ```
    """

    _tag_names = ["trl", "grpo", "hf_stable"]
    _name = "hf_stable StableGRPO"

    def __init__(self, model, reward_funcs=None, args: StableGRPOConfig | None = None, *pargs, **kwargs):
        args = self._coerce_args(model, args)
        reward_funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        stable_rank = None
        if args.stable_rank_reward:
            scorer = None  # "policy": bound to the trained model after construction
            if args.stable_rank_model == "ref":
                # a copy made now, before TRL patches `forward` with its fused LM head: a deep copy of a patched model
                # would keep running the original's weights
                scorer = self._load_reference(model, args)
            stable_rank = StableRankReward(scorer, None)
            reward_funcs.append(stable_rank)
            if args.reward_weights is not None:
                args.reward_weights = [*args.reward_weights, args.stable_rank_weight]
            elif args.stable_rank_weight != 1.0:
                args.reward_weights = [1.0] * (len(reward_funcs) - 1) + [args.stable_rank_weight]
        super().__init__(model, reward_funcs, args, *pargs, **kwargs)
        if stable_rank is not None:
            self._bind_stable_rank(stable_rank, model)

        k = len(self.reward_funcs)
        if args.robust_reward == "brme":
            heads = args.brme_heads if args.brme_heads is not None else list(range(k))
            if len(heads) < 2 or not all(0 <= h < k for h in heads):
                raise ValueError(f"`brme_heads`={heads} must name at least two of the {k} reward functions.")
            self._brme_heads = heads
        if args.correctness_reward_index is not None and not 0 <= args.correctness_reward_index < k:
            raise ValueError(f"`correctness_reward_index`={args.correctness_reward_index} but there are {k} rewards.")
        self._controller = CONTROLLERS[args.reward_weighting](self.reward_weights, args)
        self._stash_rewards: torch.Tensor | None = None
        self._snr = None
        if args.oblr_adaptive_lr:
            self._snr = MicroBatchSNR(
                self.model.named_parameters(), args.oblr_snr_params, args.oblr_snr_ema, args.oblr_lr_min_ratio
            )
            self.add_callback(SNRLearningRateCallback(self._snr))
        if isinstance(self._controller, HypervolumeController):
            from ._hypervolume import HypervolumeCallback

            self.add_callback(HypervolumeCallback(self))

    @staticmethod
    def _coerce_args(model, args) -> StableGRPOConfig:
        if args is None:
            name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "model")
            return StableGRPOConfig(f"{str(name).rstrip('/').split('/')[-1]}-StableGRPO")
        if isinstance(args, StableGRPOConfig):
            return args
        from transformers import TrainingArguments

        if isinstance(args, TrainingArguments):  # not to_dict(): it masks every *_token field
            values = {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.init}
            if values.get("steps_per_generation") is not None:
                values["generation_batch_size"] = None  # derived from steps_per_generation by __post_init__
            return StableGRPOConfig(**values)
        raise TypeError(f"`args` must be a StableGRPOConfig, GRPOConfig or TrainingArguments, got {type(args)}.")

    @staticmethod
    def _load_reference(model, args):
        if isinstance(model, str):
            from transformers import AutoModelForCausalLM

            init = {"trust_remote_code": args.trust_remote_code, **(args.model_init_kwargs or {})}
            return AutoModelForCausalLM.from_pretrained(model, **init)
        return copy.deepcopy(model)

    def _bind_stable_rank(self, reward: StableRankReward, model) -> None:
        reward.tokenizer = self.processing_class
        if reward.model is None:
            reward.model = self.accelerator.unwrap_model(self.model)
        else:
            reward.model.requires_grad_(False).eval().to(self.accelerator.device)

    # ------------------------------------------------------------------------------------------------------------
    # rewards

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)  # (N_global, K)
        if self.args.robust_reward == "brme":
            rewards = rewards.clone()
            heads = self._brme_heads
            mode = "train" if self.model.training else "eval"
            self._metrics[mode]["stable/grpo/brme/head_min_mean"].append(
                torch.nanmean(torch.nan_to_num(rewards[:, heads], nan=math.inf).min(1).values).item()
            )
            rewards[:, heads[0]] = brme_reward(rewards[:, heads], self.args.brme_lambda)
            rewards[:, heads[1:]] = math.nan  # folded into the first head's column
        self._stash_rewards = rewards
        return rewards

    # ------------------------------------------------------------------------------------------------------------
    # advantages

    def _generate_and_score_completions(self, inputs):
        mode = "train" if self.model.training else "eval"
        if self.args.reward_weighting != "static":
            self.reward_weights = self._controller.weights.clone()
        out = super()._generate_and_score_completions(inputs)
        if not self.args.replaces_advantages and self.args.reward_weighting == "static":
            return out
        num_generations = self.num_generations if mode == "train" else self.num_generations_eval
        rewards = self._stash_rewards
        loss_mask = out["completion_mask"] if "tool_mask" not in out else out["completion_mask"] * out["tool_mask"]
        lengths = self.accelerator.gather(loss_mask.sum(1).float())
        local = slice(self.accelerator.process_index * len(inputs), (self.accelerator.process_index + 1) * len(inputs))
        metrics: dict[str, float] = {}
        args = self.args

        if args.loss_mode == "drpo":
            advantages = self._drpo_advantages(out, rewards, lengths, num_generations, metrics)
        elif args.loss_mode == "onpolicy_sft":
            advantages = self._onpolicy_sft_advantages(out, rewards, local, metrics)
        elif args.advantage_estimator == "grpo":
            advantages = self.accelerator.gather(out["advantages"])  # TRL's own, untouched
        else:
            advantages, extra = ADVANTAGE_ESTIMATORS.get(args.advantage_estimator)(
                rewards, lengths, num_generations, self.reward_weights, **self._estimator_params()
            )
            metrics.update({f"{args.advantage_estimator}/{k}": v for k, v in extra.items()})

        if args.delta_l_alpha is not None:
            weights, extra = delta_l_weights(
                lengths, args.delta_l_alpha, num_generations, args.delta_l_scope, args.delta_l_max_weight
            )
            advantages = advantages * weights
            metrics.update({f"delta_l/{k}": v for k, v in extra.items()})
        multiplier = self._controller.advantage_multiplier
        if multiplier != 1.0:
            advantages = advantages * multiplier
        out["advantages"] = advantages[local].to(out["advantages"].dtype)
        logged = self._logs["advantages"]  # the completions table shows the advantages actually used
        for _ in range(min(len(advantages), len(logged))):
            logged.pop()
        logged.extend(advantages.tolist())

        if mode == "train" and args.reward_weighting != "static":
            if isinstance(self._controller, GradientController):
                if self.state.global_step % args.drw_every_n_steps == 0:
                    metrics.update(self._gradient_weight_step(out, rewards, num_generations))
            else:
                metrics.update(self._controller.observe(rewards, advantages, num_generations))
            for k, w in enumerate(self._controller.weights.tolist()):
                metrics[f"weights/{self.reward_func_names[k]}"] = w
        metrics["advantage_abs_mean"] = advantages.abs().mean().item()
        for key, value in metrics.items():
            self._metrics[mode][f"stable/grpo/{key}"].append(value)
        return out

    def _estimator_params(self) -> dict:
        args = self.args
        common = {"correctness_index": args.correctness_reward_index, "success_threshold": args.success_threshold}
        return {
            "sgrpo": {"noise_p": args.sgrpo_noise_p, "scale": args.scale_rewards, **common},
            "maxrl": {
                "truncation": args.maxrl_truncation,
                "baseline": args.maxrl_baseline,
                "adv_clip": args.maxrl_adv_clip,
                **common,
            },
            "dvao": {"sigma_power": args.dvao_sigma_power},
            "oblr": {"norm_proxy": args.oblr_norm_proxy, "leave_one_out": args.oblr_loo, "scale": args.oblr_scale},
        }[args.advantage_estimator]

    def _correctness(self, out, rewards) -> tuple[torch.Tensor, torch.Tensor]:
        """Global binary correctness and whether each completion ended on eos (not cut at the budget)."""
        correct = success_indicator(
            rewards, self.reward_weights, self.args.correctness_reward_index, self.args.success_threshold
        )
        ids, mask = out["completion_ids"], out["completion_mask"]
        last = ids.gather(1, (mask.sum(1) - 1).clamp(min=0).long().unsqueeze(1)).squeeze(1)
        eos = torch.isin(last, torch.tensor(self.eos_token_ids, device=ids.device)) & (mask.sum(1) > 0)
        return correct, self.accelerator.gather(eos)

    def _drpo_advantages(self, out, rewards, lengths, num_generations, metrics):
        correct, eos = self._correctness(out, rewards)
        correct = torch.where(eos | torch.isnan(correct), correct, torch.zeros_like(correct))  # truncated: incorrect
        seq_old = None
        if self.args.drpo_neg_weighting == "softmax_old":
            old = out.get("old_per_token_logps")
            if old is None:
                old = self._policy_logps(out)
            seq_old = self.accelerator.gather(sequence_logp(old, out["completion_mask"]))
        coef, extra = drpo_coefficients(
            correct,
            lengths,
            num_generations,
            self.max_completion_length,
            self.args.drpo_lambda,
            self.args.drpo_tau,
            seq_old,
        )
        metrics.update({f"drpo/{k}": v for k, v in extra.items()})
        return coef * num_generations

    def _onpolicy_sft_advantages(self, out, rewards, local, metrics):
        correct, eos = self._correctness(out, rewards)
        keep = onpolicy_sft_keep(correct, eos, self.args.osft_require_eos)
        out["completion_mask"] = out["completion_mask"] * keep[local].unsqueeze(1).to(out["completion_mask"].dtype)
        if "tool_mask" in out:
            out["tool_mask"] = out["tool_mask"] * keep[local].unsqueeze(1).to(out["tool_mask"].dtype)
        mask = out["completion_mask"] if "tool_mask" not in out else out["completion_mask"] * out["tool_mask"]
        out["num_items_in_batch"] = self.accelerator.gather(mask.sum()).sum()
        metrics["onpolicy_sft/kept_frac"] = keep.float().mean().item()
        return keep.float()

    @torch.no_grad()
    def _policy_logps(self, out) -> torch.Tensor:
        """Per-token log-probs of the current (= sampling) policy: one extra no-grad forward."""
        ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
        mask = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
        logps, _, _ = self._get_per_token_logps_and_entropies(
            self.model, ids, mask, out["completion_ids"].size(1), batch_size=self.args.per_device_train_batch_size
        )
        return logps

    def _gradient_weight_step(self, out, rewards, num_generations) -> dict[str, float]:
        """Gradient-based weights: per-objective policy gradients `g_k` of `Σ_i A_{k,i} s(o_i)` on this generation
        batch (rank-local, all-reduced), influence scores `Σ_j <g_k, g_j>`, one mirror-ascent step."""
        pattern = re.compile(self.args.drw_target_params) if self.args.drw_target_params else None
        model = self.accelerator.unwrap_model(self.model)  # no DDP hooks: gradients are reduced by hand
        params = [p for n, p in model.named_parameters() if p.requires_grad and (pattern is None or pattern.search(n))]
        if not params:
            raise ValueError(f"`drw_target_params`={self.args.drw_target_params!r} matches no trainable parameter.")
        ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
        mask = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
        with torch.enable_grad():
            logps, _, _ = self._get_per_token_logps_and_entropies(
                model, ids, mask, out["completion_ids"].size(1), batch_size=self.args.per_device_train_batch_size
            )
            s = sequence_logp(logps, out["completion_mask"])
            n_local = s.shape[0]
            local = slice(self.accelerator.process_index * n_local, (self.accelerator.process_index + 1) * n_local)
            grads = []
            for k in range(rewards.shape[1]):
                a_k = group_zscore(rewards[:, k], num_generations, self.args.scale_rewards)[local].to(s)
                g = torch.autograd.grad(
                    (a_k * s).sum() / rewards.shape[0], params, retain_graph=True, allow_unused=True
                )
                grads.append(
                    torch.cat(
                        [
                            (x if x is not None else torch.zeros_like(p)).reshape(-1)
                            for x, p in zip(g, params, strict=True)
                        ]
                    )
                )
        grads = torch.stack(grads)
        if self.accelerator.num_processes > 1:
            grads = self.accelerator.reduce(grads, reduction="sum")
        return self._controller.update(influence_scores(grads), self._get_learning_rate())

    # ------------------------------------------------------------------------------------------------------------
    # loss

    def _compute_loss(self, model, inputs):
        if self.args.loss_mode == "ppo":
            return super()._compute_loss(model, inputs)
        mode = "train" if self.model.training else "eval"
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        per_token_logps, entropies, _ = self._get_per_token_logps_and_entropies(
            model,
            ids,
            attention,
            inputs["completion_ids"].size(1),
            compute_entropy=True,
            **{key: inputs.get(key) for key in _EXTRA_FORWARD_KEYS},
        )
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        if self.args.loss_mode == "drpo":
            loss, parts = drpo_loss(
                per_token_logps,
                mask,
                inputs["advantages"],
                inputs.get("old_per_token_logps"),
                self.args.drpo_delta,
                self.args.drpo_beta,
                self.args.drpo_kl_type,
            )
            loss = loss / accumulation
            self._metrics[mode]["stable/grpo/drpo/kl"].append(self.accelerator.gather(parts["kl"]).mean().item())
        else:
            if self.args.osft_norm == "tokens":  # TRL's `dapo` normaliser: kept tokens of the generation batch
                normalizer = inputs["num_items_in_batch"].float() / self.accelerator.num_processes
                if mode == "train":
                    normalizer = normalizer * self.current_gradient_accumulation_steps / self.args.steps_per_generation
            else:
                normalizer = mask.shape[0] * self.max_completion_length * accumulation
            loss, parts = onpolicy_sft_loss(per_token_logps, mask, normalizer)
        self._metrics[mode]["policy_loss"].append(self.accelerator.gather(parts["policy_loss"]).mean().item())
        totals = self.accelerator.reduce(torch.stack([(entropies * mask).sum(), mask.sum().float()]), reduction="sum")
        self._metrics[mode]["entropy"].append((totals[0] / totals[1].clamp(min=1)).item())
        return loss

    def training_step(self, model, inputs, num_items_in_batch):
        if self._snr is None:
            return super().training_step(model, inputs, num_items_in_batch)
        self._snr.before_backward()
        loss = super().training_step(model, inputs, num_items_in_batch)
        sync = self.accelerator.sync_gradients
        # under DDP the last micro-batch's gradient is already averaged across processes: not a local sample
        self._snr.after_backward(usable=not (sync and self.accelerator.num_processes > 1))
        if sync:
            for key, value in self._snr.finish(self.accelerator).items():
                self._metrics["train"][f"stable/grpo/oblr/{key}"].append(value)
        return loss

    # ------------------------------------------------------------------------------------------------------------
    # state

    def _stable_state(self):
        tensors = {f"controller.{k}": v for k, v in self._controller.state_dict().items()}
        meta = {"trainer": type(self).__name__, "reward_weighting": self.args.reward_weighting}
        if self._snr is not None:
            meta["snr"] = self._snr.state_dict()
        return tensors, meta

    def _load_stable_state(self, tensors, meta):
        if meta.get("reward_weighting", "static") != self.args.reward_weighting:
            logger.warning(
                f"The checkpoint was trained with reward_weighting={meta.get('reward_weighting')!r}; its controller "
                "state is not restored."
            )
        else:
            self._controller.load_state_dict(
                {k.split(".", 1)[1]: v for k, v in tensors.items() if k.startswith("controller.")}
            )
        if self._snr is not None and "snr" in meta:
            self._snr.load_state_dict(meta["snr"])

    # ------------------------------------------------------------------------------------------------------------
    # model card

    def create_model_card(self, model_name=None, dataset_name=None, tags=None):
        """Write `README.md` in `output_dir`: the active GRPO variants with their settings and papers."""
        if not self.is_world_process_zero():
            return
        args = self.args
        tags = [tags] if isinstance(tags, str) else list(tags or [])
        lines, papers = [], []
        chosen = {
            "advantage_estimator": args.advantage_estimator,
            "loss_type": args.loss_type,
            "loss_mode": args.loss_mode,
            "reward_weighting": args.reward_weighting,
            "reward_functions": list(self.reward_func_names),
            "reward_weights": [round(w, 6) for w in self._controller.weights.tolist()],
        }
        for family, name, paper in (
            (
                "advantage estimator",
                args.advantage_estimator,
                {"sgrpo": "sgrpo", "maxrl": "maxrl", "dvao": "dvao", "oblr": "oblr"}.get(args.advantage_estimator),
            ),
            ("loss mode", args.loss_mode, {"drpo": "drpo", "onpolicy_sft": "onpolicy_sft"}.get(args.loss_mode)),
            (
                "reward weighting",
                args.reward_weighting,
                {"hypervolume": "dynamic_weighting", "gradient": "dynamic_weighting", "ctwa": "ctwa"}.get(
                    args.reward_weighting
                ),
            ),
        ):
            lines.append(f"- {family}: `{name}`")
            if paper:
                papers.append(PAPERS[paper])
                tags.append(name)
        for active, text, key in (
            (args.delta_l_alpha is not None, f"ΔL normalisation, α = {args.delta_l_alpha}", "delta_l"),
            (args.robust_reward == "brme", f"robust reward (BRME), λ = {args.brme_lambda}", "brme"),
            (args.stable_rank_reward, f"stable-rank reward (SR-GRPO), weight {args.stable_rank_weight}", "sr_grpo"),
            (args.oblr_adaptive_lr, "SNR-scaled learning rate (OBLR-PO)", "oblr"),
        ):
            if active:
                lines.append(f"- {text}")
                if PAPERS[key] not in papers:
                    papers.append(PAPERS[key])
        fields = {f.name for f in dataclasses.fields(StableGRPOConfig)} - {
            f.name for f in dataclasses.fields(GRPOConfig)
        }
        chosen.update(
            {
                name: getattr(args, name)
                for name in sorted(fields)
                if name.startswith(
                    {"sgrpo": "sgrpo_", "maxrl": "maxrl_", "dvao": "dvao_", "oblr": "oblr_"}.get(
                        args.advantage_estimator, "-"
                    )
                )
            }
        )
        chosen.update(
            learning_rate=args.learning_rate,
            num_generations=args.num_generations,
            beta=args.beta,
            max_completion_length=args.max_completion_length,
            max_steps=args.max_steps,
        )
        adapter_papers, adapter_lines, adapter_settings, adapter_tags = adapter_card_info(self.model)
        papers += [p for p in adapter_papers if p not in papers]
        lines += adapter_lines
        chosen.update(adapter_settings)
        tags += adapter_tags
        method = "\n".join(lines) + (
            "\n\n" + "\n".join(f"Paper: [{p.title}]({p.url})." for p in papers) if papers else ""
        )
        card = TrainingCard(
            trainer_name="StableGRPOTrainer",
            trl_trainer="trl.GRPOTrainer",
            method=method,
            settings=chosen,
            tags=[*self._tag_names, *tags],
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
