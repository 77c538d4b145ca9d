"""`StableGRPOTrainer`: TRL's GRPO with the GRPO variants as config flags ([`StableGRPOConfig`]).

The trainer touches TRL through three narrow hooks: it stashes the gathered rewards in `_calculate_rewards` (after
the active reward transform), replaces the advantages after `super()._generate_and_score_completions` (from the
rewards of the *whole* generation batch, gathered across processes, so results do not depend on their number), and
replaces `_compute_loss` only under a loss mode. With every new field at its default nothing is replaced and the
update is TRL's, bit for bit.

Every method is dispatched through its registry (`REGISTRY.active(args)`, called with `method.params_from(args)`);
the maths lives in `hf_stable.losses.{advantages, aggregation, policy, reward_weighting, reward_control}`.
"""

from __future__ import annotations

import copy
import logging

import torch
from trl import GRPOTrainer
from trl.models.utils import disable_gradient_checkpointing

from .._vllm_cpu import maybe_keep_unpacked_linear_weights
from ..callbacks.hypervolume import HypervolumeCallback
from ..callbacks.snr_lr import LR_SCALING, SNRLearningRateCallback, tracked_parameters
from ..callbacks.stability import add_stability_callbacks
from ..cards import CardSections
from ..losses.advantages import ADVANTAGE_ESTIMATORS, check_correctness_index, group_zscore
from ..losses.aggregation import LOSS_AGGREGATIONS
from ..losses.length_mask import LENGTH_MASKS, check_length_mask, reference_lengths
from ..losses.policy import LOSS_MODES, importance_weighted, sequence_logp
from ..losses.reward_control import REWARD_TRANSFORMS, REWARD_WEIGHTINGS, StepContext
from ..losses.reward_weighting import influence_scores
from ..losses.stable_reinforce import ADVANTAGE_FILTERS
from ..rewards.stable_rank import INTRINSIC_REWARDS
from ..stability.config import GRPO_GUARD_DEFAULTS
from . import _grpo_buffer
from ._base import StableTrainerBase
from ._jacobian import JacobianDescentMixin
from .grpo_config import GRPO_REGISTRIES, StableGRPOConfig
from .loss_inputs import LossModeInputsMixin


logger = logging.getLogger(__name__)

__all__ = ["StableGRPOConfig", "StableGRPOTrainer"]

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


class StableGRPOTrainer(StableTrainerBase, LossModeInputsMixin, JacobianDescentMixin, GRPOTrainer):
    """TRL's [`~trl.GRPOTrainer`] with the advantage estimators, loss modes, reward controllers and transforms of
    [`StableGRPOConfig`]. Same arguments as `GRPOTrainer`.

    Example:
    ```python
    from hf_stable import StableGRPOConfig, StableGRPOTrainer
    args = StableGRPOConfig(output_dir="out", advantage_estimator="sgrpo", sgrpo_noise_p=0.2, loss_type="dr_grpo",
                            correctness_reward_index=0)
    trainer = StableGRPOTrainer(model=model, reward_funcs=[correct, short], args=args, train_dataset=ds)
    trainer.train()
    ```
    """

    _tag_names = ["trl", "grpo", "hf_stable"]
    _name = "hf_stable StableGRPO"
    _config_class = StableGRPOConfig
    _output_suffix = "StableGRPO"
    _card_registries = GRPO_REGISTRIES
    _card_settings = ("loss_type", "learning_rate", "num_generations", "beta", "max_completion_length", "max_steps")
    _trl_trainer = "trl.GRPOTrainer"
    _card_example_prompt = "1+2="

    def __init__(self, model, reward_funcs=None, args: StableGRPOConfig | None = None, *pargs, **kwargs):
        args = self._coerce_args(model, args)
        if isinstance(reward_funcs, (list, tuple)):
            reward_funcs = list(reward_funcs)
        intrinsic = INTRINSIC_REWARDS.active(args)
        extra_reward = None
        if intrinsic is not None:
            # `None` is TRL's "the environment owns the reward" (`environment_factory` with `get_reward`), and stays
            # `None` otherwise, so that TRL's own "no reward source" error reaches the user
            reward_funcs = [] if reward_funcs is None else reward_funcs
            reward_funcs = reward_funcs if isinstance(reward_funcs, list) else [reward_funcs]
            # a reference copy is made now, before TRL patches `forward` with its fused LM head: a deep copy of a
            # patched model would keep running the original's weights
            extra_reward = intrinsic(lambda: self._load_reference(model, args), **intrinsic.params_from(args))
            reward_funcs.append(extra_reward)
            if args.reward_weights is not None:
                args.reward_weights = [*args.reward_weights, extra_reward.weight]
            elif extra_reward.weight != 1.0:
                args.reward_weights = [1.0] * (len(reward_funcs) - 1) + [extra_reward.weight]
        maybe_keep_unpacked_linear_weights(args)  # vLLM on a CPU: the weight sync must reach the sampler
        super().__init__(model, reward_funcs, args, *pargs, **kwargs)
        if extra_reward is not None:
            extra_reward.bind(self)

        k = len(self.reward_funcs)
        check_correctness_index(
            "correctness_reward_index", args.correctness_reward_index, k, required=bool(args.success_counters())
        )
        self._length_mask = LENGTH_MASKS.active(args)
        if self._length_mask is not None:
            check_length_mask(args, k, self.train_dataset, self.eval_dataset)
        transform = REWARD_TRANSFORMS.active(args)
        self._transform = transform(k, **transform.params_from(args)) if transform is not None else None
        weighting = REWARD_WEIGHTINGS.get(args.reward_weighting)
        self._controller = weighting(self.reward_weights, **weighting.params_from(args))
        self._estimator = ADVANTAGE_ESTIMATORS.active(args)
        self._aggregation = LOSS_AGGREGATIONS.active(args)
        mode = LOSS_MODES.active(args)
        self._loss_mode = mode(**mode.params_from(args)) if mode is not None else None
        self._stash_rewards: torch.Tensor | None = None
        snr = LR_SCALING.active(args)
        self._snr = snr(self.model.named_parameters(), **snr.params_from(args)) if snr is not None else None
        if self._snr is not None:
            self.add_callback(SNRLearningRateCallback(self._snr))
        if self._controller.needs_validation:
            self.add_callback(HypervolumeCallback(self))
        add_stability_callbacks(self, self.args, guard_defaults=GRPO_GUARD_DEFAULTS)

    @staticmethod
    def _load_reference(model, args):
        if isinstance(model, str):
            from transformers import AutoModelForCausalLM

            init = {"trust_remote_code": args.trust_remote_code, **(args.model_init_kwargs or {})}
            return AutoModelForCausalLM.from_pretrained(model, **init)
        return copy.deepcopy(model)

    # ------------------------------------------------------------------------------------------------------------
    # rewards

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)  # (N_global, K)
        validating = getattr(self, "_validating", False)  # the hypervolume callback's greedy validation
        mode = "train" if self.model.training else "eval"
        if self._length_mask is not None:
            rewards, metrics = self._apply_length_mask(rewards, inputs, completion_ids_list)
            for key, value in metrics.items() if not validating else ():
                self._metrics[mode][f"stable/grpo/length_mask/{key}"].append(value)
        if self._transform is not None:
            rewards, metrics = self._transform(rewards)
            for key, value in metrics.items() if not validating else ():
                self._metrics[mode][f"stable/grpo/{key}"].append(value)
        if not validating:
            self._stash_rewards = rewards
        return rewards

    def _apply_length_mask(self, rewards, inputs, completion_ids_list):
        """The gathered `(N, K)` rewards with the length mask applied; lengths and references gathered likewise."""
        text = getattr(self.processing_class, "tokenizer", self.processing_class)
        local = reference_lengths(inputs, self.args.length_mask_reference, text), list(map(len, completion_ids_list))
        reference, lengths = (self.accelerator.gather(torch.tensor(x, device=rewards.device).float()) for x in local)
        return self._length_mask(rewards, lengths, reference, **self._length_mask.params_from(self.args))

    # ------------------------------------------------------------------------------------------------------------
    # advantages

    def _generate_and_score_completions(self, inputs):
        mode = "train" if self.model.training else "eval"
        controller = self._controller
        if controller.adaptive:
            self.reward_weights = controller.weights.clone()
        out = super()._generate_and_score_completions(inputs)
        if not self.args.replaces_advantages:
            return out
        args = self.args
        num_generations = self.num_generations if mode == "train" else self.num_generations_eval
        rewards = self._stash_rewards
        loss_mask = out["completion_mask"] if "tool_mask" not in out else out["completion_mask"] * out["tool_mask"]
        lengths = self.accelerator.gather(loss_mask.sum(1).float())
        local = slice(self.accelerator.process_index * len(inputs), (self.accelerator.process_index + 1) * len(inputs))
        metrics: dict[str, float] = {}

        if self._loss_mode is not None:
            advantages = self._loss_mode_advantages(out, rewards, lengths, num_generations, local, metrics)
        elif self._estimator is None:
            advantages = self.accelerator.gather(out["advantages"])  # TRL's own, untouched
        else:
            estimator = self._estimator
            advantages, extra = estimator(
                rewards, lengths, num_generations, self.reward_weights, **estimator.params_from(args)
            )
            metrics.update({f"{estimator.name}/{k}": v for k, v in extra.items()})
        advantage_filter = ADVANTAGE_FILTERS.active(args)
        if advantage_filter is not None:
            advantages, extra = advantage_filter(advantages, lengths, **advantage_filter.params_from(args))
            metrics.update({f"{advantage_filter.name}/{k}": v for k, v in extra.items()})
        if self._aggregation is not None:
            aggregation = self._aggregation
            weights, extra = aggregation(lengths, num_generations=num_generations, **aggregation.params_from(args))
            advantages = advantages * weights
            metrics.update({f"{aggregation.name}/{k}": v for k, v in extra.items()})
        multiplier = controller.advantage_multiplier
        if multiplier != 1.0:
            advantages = advantages * multiplier
        out["advantages"] = advantages[local].to(out["advantages"].dtype)
        logged = self._logs["advantages"]  # the completions table shows the advantages actually used
        for _ in range(min(len(advantages), len(logged))):
            logged.pop()
        logged.extend(advantages.tolist())

        if mode == "train" and controller.adaptive:
            context = StepContext(
                self.state.global_step,
                self._get_learning_rate(),
                lambda: self._influence_scores(out, rewards, num_generations),
            )
            metrics.update(controller.observe(rewards, advantages, num_generations, context))
            for k, w in enumerate(controller.weights.tolist()):
                metrics[f"weights/{self.reward_func_names[k]}"] = w
        metrics["advantage_abs_mean"] = advantages.abs().mean().item()
        for key, value in metrics.items():
            self._metrics[mode][f"stable/grpo/{key}"].append(value)
        return out

    def _loss_mode_advantages(self, out, rewards, lengths, num_generations, local, metrics) -> torch.Tensor:
        """The loss mode's per-sample coefficients from the gathered rewards; completions it leaves out are masked
        (and the step's token count redone), so TRL's loss normalisers see the kept tokens only."""
        mode = self._loss_mode
        ids, mask = out["completion_ids"], out["completion_mask"]
        last = ids.gather(1, (mask.sum(1) - 1).clamp(min=0).long().unsqueeze(1)).squeeze(1)
        eos = torch.isin(last, torch.tensor(self.eos_token_ids, device=ids.device)) & (mask.sum(1) > 0)
        complete = self.accelerator.gather(eos)  # ended on eos, not cut at the length budget
        seq_old = None
        if mode.needs_old_logps():
            old = out.get("old_per_token_logps")
            if old is None:
                old = self._policy_logps(out)
            seq_old = self.accelerator.gather(sequence_logp(old, out["completion_mask"]))
        advantages, keep, extra = mode.advantages(
            rewards, self.reward_weights, complete, lengths, num_generations, self.max_completion_length, seq_old
        )
        metrics.update({f"{self.args.loss_mode}/{k}": v for k, v in extra.items()})
        if keep is not None:
            kept = keep[local].unsqueeze(1)
            out["completion_mask"] = out["completion_mask"] * kept.to(out["completion_mask"].dtype)
            if "tool_mask" in out:
                out["tool_mask"] = out["tool_mask"] * kept.to(out["tool_mask"].dtype)
            mask = out["completion_mask"] if "tool_mask" not in out else out["completion_mask"] * out["tool_mask"]
            out["num_items_in_batch"] = self.accelerator.gather(mask.sum()).sum()
        return advantages

    @torch.no_grad()
    def _policy_logps(self, out) -> torch.Tensor:
        """Per-token log-probs of the current (= sampling) policy: one extra no-grad forward."""
        ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
        mask = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
        with disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            return self._extra_forward(self.model, out, ids, mask)

    def _extra_forward(self, model, out, ids, mask) -> torch.Tensor:
        """Per-token log-probs of the completions in ``out`` by a forward of our own, with the vision-language inputs
        TRL's own forwards pass (images, grids, token types)."""
        logps, _, _ = self._get_per_token_logps_and_entropies(
            model,
            ids,
            mask,
            out["completion_ids"].size(1),
            batch_size=self.args.per_device_train_batch_size,
            **{key: out.get(key) for key in _EXTRA_FORWARD_KEYS},
        )
        return logps

    def _influence_scores(self, out, rewards, num_generations) -> torch.Tensor:
        """Influence scores `Σ_j <g_k, g_j>` of the per-objective policy gradients `g_k` of `Σ_i A_{k,i} s(o_i)` on
        this generation batch (rank-local, all-reduced). Memory: the K flat fp32 gradients of the compared parameters
        (`drw_target_params`) plus one objective's gradients while it is copied in, `(K+1)·4·n` bytes for `n`
        parameters."""
        model = self.accelerator.unwrap_model(self.model)  # no DDP hooks: gradients are reduced by hand
        target = self._controller.target_params
        params = [p for _, p in tracked_parameters(model.named_parameters(), target, "drw_target_params")]
        ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
        mask = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
        with torch.enable_grad():
            logps = self._extra_forward(model, out, ids, mask)
            s = sequence_logp(logps, out["completion_mask"])
            n_local = s.shape[0]
            local = slice(self.accelerator.process_index * n_local, (self.accelerator.process_index + 1) * n_local)
            grads = torch.zeros(rewards.shape[1], sum(p.numel() for p in params), device=s.device)
            for k in range(rewards.shape[1]):
                a_k = group_zscore(rewards[:, k], num_generations, self.args.scale_rewards)[local].to(s)
                g = torch.autograd.grad(
                    (a_k * s).sum() / rewards.shape[0], params, retain_graph=True, allow_unused=True
                )
                offset = 0
                for x, p in zip(g, params, strict=True):
                    if x is not None:
                        grads[k, offset : offset + p.numel()] = x.reshape(-1)
                    offset += p.numel()
                del g
        if self.accelerator.num_processes > 1:
            grads = self.accelerator.reduce(grads, reduction="sum")
        return influence_scores(grads)

    # ------------------------------------------------------------------------------------------------------------
    # loss

    def _compute_loss(self, model, inputs):
        if self._loss_mode is None:
            return super()._compute_loss(model, inputs)
        mode = "train" if self.model.training else "eval"
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        per_token_logps, entropies, aux_loss = self._get_per_token_logps_and_entropies(
            model,
            ids,
            attention,
            inputs["completion_ids"].size(1),
            compute_entropy=True,
            compute_aux_loss=self.aux_loss_enabled,
            **{key: inputs.get(key) for key in _EXTRA_FORWARD_KEYS},
        )
        if self.use_vllm and self.vllm_importance_sampling_correction and not self._loss_mode.weights_sampling:
            # TRL's correction of the vLLM sampler/trainer mismatch, for every loss mode that does not weigh by it
            per_token_logps = importance_weighted(per_token_logps, inputs["importance_sampling_ratio"])
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        # TRL's `dapo` normaliser: the loss tokens of the generation batch, per process and accumulation window
        step_tokens = inputs["num_items_in_batch"].float() / self.accelerator.num_processes
        if mode == "train":
            step_tokens = step_tokens * self.current_gradient_accumulation_steps / self.args.steps_per_generation
        loss, policy_loss, parts = self._loss_mode.loss(
            per_token_logps,
            mask,
            inputs["advantages"],
            inputs.get("old_per_token_logps"),
            accumulation,
            step_tokens,
            self.max_completion_length,
        )
        for key, value in parts.items():
            metric = f"stable/grpo/{self.args.loss_mode}/{key}"
            self._metrics[mode][metric].append(self.accelerator.gather(value).mean().item())
        self._metrics[mode]["policy_loss"].append(self.accelerator.gather(policy_loss).mean().item())
        if self.aux_loss_enabled:  # TRL's MoE load-balancing loss, scaled for accumulation as TRL does
            loss = loss + self.router_aux_loss_coef * aux_loss / accumulation
            self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(aux_loss).mean().item())
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
    # state and model card

    def _stable_state(self):
        tensors = {f"controller.{k}": v for k, v in self._controller.state_dict().items()}
        meta = {"trainer": type(self).__name__, "reward_weighting": self.args.reward_weighting}
        if self._snr is not None:
            meta["snr"] = self._snr.state_dict()
        buffer, position = _grpo_buffer.pack(self)  # TRL's generation buffer, when a checkpoint falls inside it
        return {**tensors, **buffer}, {**meta, **position}

    def _load_stable_state(self, tensors, meta):
        if meta.get("reward_weighting", StableGRPOConfig.reward_weighting) != self.args.reward_weighting:
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
        _grpo_buffer.unpack(self, tensors, meta)

    def _card_sections(self) -> CardSections:
        weights = [round(w, 6) for w in self._controller.weights.tolist()]
        return CardSections(settings={"reward_functions": list(self.reward_func_names), "reward_weights": weights})
