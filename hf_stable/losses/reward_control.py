"""The registered reward-weight controllers (`reward_weighting`) and reward transforms (`robust_reward`).

Each is a class built from its declared fields, ``REWARD_WEIGHTINGS.get(name)(base_weights, **params)`` and
``REWARD_TRANSFORMS.get(name)(num_rewards, **params)``, holding the state that the pure update rules of
[`hf_stable.losses.reward_weighting`] need between generation batches (checkpointed through `state_dict`).

* `static`: the user's `reward_weights`.
* `hypervolume` (arXiv 2509.11452): a step multiplier from the hypervolume contribution of validation means.
* `gradient` (arXiv 2509.11452): weights by mirror ascent on the objectives' gradient inner products.
* `ctwa` (arXiv 2602.06869): log-weights raised while an objective's reward does not covary with the update.
* `lagrangian` (arXiv 2310.04373): dual multipliers keeping each mean reward below a threshold, and
  `lagrangian_search`, its thresholds found by Nelder–Mead during the run (`hf_stable.losses.lagrangian`).
* `pama` (arXiv 2508.07768): closed-form Pareto (min-norm) weights from per-objective advantage statistics
  (`hf_stable.losses.pama`).
* `brme` (arXiv 2409.15360): an ensemble of reward functions folded into one robust reward.
"""

from __future__ import annotations

import math

import torch

from .._validation import boolean, check_int, integer, number
from ..papers import PAPERS
from ..registry import Field, Registry
from . import jacobian as _jacobian  # noqa: F401  (registers `gradient_aggregation`, the other multi-reward family)
from .controller_base import REWARD_WEIGHTINGS, RewardWeightController, StepContext, _per_reward
from .lagrangian import LagrangianController, LagrangianSearchController
from .pama import PAMAController
from .reward_weighting import brme_reward, ctwa_covariance, ctwa_update, gradient_weight_update, hypervolume_step


REWARD_TRANSFORMS = Registry(
    "reward_transform", "transforms of the reward columns", selector="robust_reward", builtin=(None,)
)


def default_ctwa_target(num_objectives: int) -> float:
    """`1/sqrt(K)`: the correlation with the z-scored advantage of their sum that each of K independent, equally
    weighted objectives of equal spread has; an objective below that equal share gets its weight raised."""
    return 1.0 / math.sqrt(num_objectives)


@REWARD_WEIGHTINGS.register(
    "ctwa",
    paper=PAPERS["ctwa"],
    description="covariance targeted weight adaptation",
    fields=[
        Field(
            "ctwa_cov_targets",
            None,
            "CTWA targets per objective: correlations with `ctwa_use_corr` (default `1/sqrt(K)` each, the correlation "
            "of K equally served objectives), covariances in reward units without it (then required).",
            param="cov_targets",
            type=list[float] | None,
        ),
        Field("ctwa_lambda_lr", 0.05, "CTWA step on the log-weights.", check=number(low=0), param="lambda_lr"),
        Field("ctwa_ema_tau", 0.1, "CTWA EMA rate of the covariances.", check=number(low=0, high=1), param="ema_tau"),
        Field(
            "ctwa_use_corr",
            True,
            "Correlation instead of covariance: scale-free targets (covariances need targets in each reward's units).",
            check=boolean(),
            param="use_corr",
        ),
        Field(
            "ctwa_obj_targets",
            None,
            "Objective means above which CTWA stops raising a weight.",
            param="obj_targets",
            type=list[float] | None,
        ),
        Field(
            "ctwa_max_log_weight",
            None,
            "Upper bound on a CTWA log-weight.",
            check=number(allow_none=True),
            param="max_log_weight",
            type=float | None,
        ),
    ],
)
class CTWAController(RewardWeightController):
    """Covariance Targeted Weight Adaptation (arXiv 2602.06869): `log λ_k` grows while the EMA of the within-group
    covariance between objective k's reward and the training signal stays below its target."""

    adaptive = True

    def __init__(
        self,
        base_weights,
        cov_targets=None,
        lambda_lr=0.05,
        ema_tau=0.1,
        use_corr=True,
        obj_targets=None,
        max_log_weight=None,
    ):
        super().__init__(base_weights)
        if (self.base <= 0).any():
            raise ValueError(f"reward_weighting='ctwa' needs positive reward_weights, got {self.base.tolist()}.")
        k = self.base.numel()
        _per_reward("ctwa_cov_targets", cov_targets, k)
        _per_reward("ctwa_obj_targets", obj_targets, k)
        self.lambda_lr, self.ema_tau, self.use_corr, self.max_log_weight = lambda_lr, ema_tau, use_corr, max_log_weight
        self.log_weights = torch.log(self.base)
        self.ema: torch.Tensor | None = None
        if cov_targets is None and not use_corr:
            raise ValueError(
                "`ctwa_cov_targets` is required with ctwa_use_corr=False: covariance targets are in the units of each "
                "reward (times the advantage's); no default fits every reward scale."
            )
        self.targets = torch.tensor(cov_targets if cov_targets is not None else [default_ctwa_target(k)] * k)
        self.obj_targets = torch.tensor(obj_targets) if obj_targets is not None else None

    @property
    def weights(self):
        return self.log_weights.exp()

    def observe(self, rewards, advantages, num_generations, context):
        cov, metrics = ctwa_covariance(rewards, advantages, num_generations, use_corr=self.use_corr)
        means = torch.nanmean(rewards.float(), dim=0)
        self.log_weights, self.ema, deficit = ctwa_update(
            self.log_weights,
            self.ema,
            cov,
            self.targets,
            self.lambda_lr,
            self.ema_tau,
            objective_means=means,
            objective_targets=self.obj_targets,
            max_log_weight=self.max_log_weight,
        )
        out = {f"ctwa/cov_{k}": v for k, v in enumerate(cov.tolist())}
        out.update({f"ctwa/deficit_{k}": v for k, v in enumerate(deficit.tolist())})
        return {**out, **{f"ctwa/{k}": v for k, v in metrics.items()}}

    def state_dict(self):
        state = {"log_weights": self.log_weights}
        if self.ema is not None:
            state["ema"] = self.ema
        return state

    def load_state_dict(self, state):
        self.log_weights = state["log_weights"].float()
        self.ema = state["ema"].float() if "ema" in state else None


@REWARD_WEIGHTINGS.register(
    "gradient",
    paper=PAPERS["dynamic_weighting"],
    description="mirror ascent on the objectives' gradient inner products",
    fields=[
        Field(
            "drw_regularization",
            1e-5,
            "μ of the mirror-ascent step `η s / μ`.",
            check=number(low=0, low_open=True),
            param="regularization",
        ),
        Field(
            "drw_target_params",
            None,
            "Regex of the parameters whose gradients are compared (default: the last transformer block's); memory: "
            "K+1 fp32 copies of their gradients (K reward functions).",
            param="target_params",
            type=str | None,
        ),
        Field(
            "drw_every_n_steps",
            1,
            "Optimizer steps between updates, checked at each generation (each update costs one forward and K "
            "backwards).",
            check=integer(low=1),
            param="every_n_steps",
        ),
    ],
)
class GradientController(RewardWeightController):
    """Gradient-based weights (arXiv 2509.11452): mirror ascent on the objectives' gradient inner products, from the
    influence scores the trainer computes (it owns the model) every ``every_n_steps`` steps."""

    adaptive = True

    def __init__(self, base_weights, regularization=1e-5, target_params=None, every_n_steps=1):
        super().__init__(base_weights)
        self.regularization, self.target_params, self.every_n_steps = regularization, target_params, every_n_steps
        self.current = self.base / self.base.sum()
        self.last_step: int | None = None  # optimizer step of the last update

    @property
    def weights(self):
        return self.current

    def observe(self, rewards, advantages, num_generations, context):
        # counted in optimizer steps since the last update: generations need not fall on multiples of n (one every
        # `steps_per_generation · num_iterations` steps)
        if self.last_step is not None and context.step - self.last_step < self.every_n_steps:
            return {}
        self.last_step = context.step
        scores = context.influence()
        self.current = gradient_weight_update(self.current, scores, context.learning_rate, self.regularization)
        out = {f"drw/score_{k}": v for k, v in enumerate(scores.tolist())}
        return {**out, **{f"drw/weight_{k}": v for k, v in enumerate(self.current.tolist())}}

    def state_dict(self):
        state = {"weights": self.current}
        if self.last_step is not None:
            state["last_step"] = torch.tensor(self.last_step)
        return state

    def load_state_dict(self, state):
        self.current = state["weights"].float()
        self.last_step = int(state["last_step"]) if "last_step" in state else None


@REWARD_WEIGHTINGS.register(
    "hypervolume",
    paper=PAPERS["dynamic_weighting"],
    description="step multiplier from the hypervolume contribution of validation means",
    fields=[
        Field(
            "drw_maximize",
            None,
            "Whether each objective is maximised (default all).",
            param="maximize",
            type=list[bool] | None,
        ),
        Field("drw_eval_every", 1, "Steps between validation evaluations.", check=integer(low=1), param="eval_every"),
        Field(
            "drw_val_size",
            16,
            "Validation prompts (from `eval_dataset`, else the first training prompts).",
            check=integer(low=1),
            param="val_size",
        ),
    ],
)
class HypervolumeController(RewardWeightController):
    """Hypervolume-guided multiplier (arXiv 2509.11452): validation means extend a Pareto front seeded with the
    initial model's means; the next steps' advantages are scaled by `0.5 + 1.5 tanh(HVC)`. The reference scales raw
    rewards, which group normalisation would cancel; scaling the advantages keeps its intent (documented)."""

    adaptive = True
    needs_validation = True

    def __init__(self, base_weights, maximize=None, eval_every=1, val_size=16):
        super().__init__(base_weights)
        k = self.base.numel()
        maximize = maximize if maximize is not None else [True] * k
        _per_reward("drw_maximize", maximize, k)
        self.eval_every, self.val_size = eval_every, val_size
        self.sign = torch.tensor([1.0 if m else -1.0 for m in maximize])
        self.reference: torch.Tensor | None = None
        self.front: torch.Tensor | None = None
        self.multiplier = 1.0

    @property
    def advantage_multiplier(self):
        return self.multiplier

    def validation_point(self, means: torch.Tensor) -> dict[str, float]:
        """Add the validation means `(K,)`; objectives that are NaN in the reference (reward columns folded by a
        reward transform) are left out of the hypervolume."""
        point = means.float() * self.sign
        if self.reference is None:  # the first evaluation (before training) is the reference point
            self.reference, self.front = point.clone(), point.reshape(1, -1).clone()
            return {"hv/contribution": 0.0, "hv/multiplier": self.multiplier}
        kept = ~torch.isnan(self.reference)
        point = torch.where(kept, point, self.reference)  # the folded columns stay NaN
        self.multiplier, front, hvc = hypervolume_step(self.front[:, kept], point[kept], self.reference[kept])
        if len(front) > len(self.front):
            self.front = torch.cat([self.front, point.reshape(1, -1)])
        return {"hv/contribution": hvc, "hv/multiplier": self.multiplier, "hv/front_size": float(len(self.front))}

    def state_dict(self):
        if self.reference is None:
            return {}
        # float64: the multiplier is a Python float, and a float32 copy would round it
        multiplier = torch.tensor(self.multiplier, dtype=torch.float64)
        return {"reference": self.reference, "front": self.front, "multiplier": multiplier}

    def load_state_dict(self, state):
        if "reference" in state:
            self.reference, self.front = state["reference"].float(), state["front"].float()
            self.multiplier = float(state["multiplier"])


# ---------------------------------------------------------------------------------------------------------------------
# Transforms: the registered `robust_reward` methods


@REWARD_TRANSFORMS.register(
    "brme",
    paper=PAPERS["brme"],
    description="reward-robust ensemble `λ·mean + (1-λ)·min`",
    fields=[
        Field("brme_lambda", 0.5, "λ of the robust reward.", check=number(low=0, high=1), param="lam"),
        Field(
            "brme_heads",
            None,
            "Reward functions forming the ensemble (default: all).",
            param="heads",
            type=list[int] | None,
        ),
    ],
)
class BRMEFold:
    """The reward functions in ``heads`` become one robust reward [`brme_reward`] in the first head's column; the
    other heads' columns become NaN (folded). Called on the gathered `(N, K)` rewards; returns `(rewards, metrics)`."""

    def __init__(self, num_rewards: int, lam: float = 0.5, heads: list[int] | None = None):
        heads = list(heads) if heads is not None else list(range(num_rewards))
        if len(heads) < 2 or not all(isinstance(h, int) and 0 <= h < num_rewards for h in heads):
            raise ValueError(f"`brme_heads`={heads} must name at least two of the {num_rewards} reward functions.")
        for h in heads:
            check_int("brme_heads", h, low=0, high=num_rewards - 1)
        self.lam, self.heads = lam, heads

    def __call__(self, rewards: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        rewards = rewards.clone()
        heads = self.heads
        metrics = {
            "brme/head_min_mean": torch.nanmean(torch.nan_to_num(rewards[:, heads], nan=math.inf).min(1).values).item()
        }
        rewards[:, heads[0]] = brme_reward(rewards[:, heads], self.lam)
        rewards[:, heads[1:]] = math.nan  # folded into the first head's column
        return rewards, metrics


# The length-conditional mask, a family of its own (it composes with a transform), registers with this module.
from . import length_mask as _length_mask  # noqa: E402, F401


# Importing this module registers every controller (`lagrangian`, `lagrangian_search` and `pama` live in their own
# modules, which import the registry from `controller_base`, not from here).
__all__ = [
    "REWARD_TRANSFORMS",
    "REWARD_WEIGHTINGS",
    "BRMEFold",
    "CTWAController",
    "GradientController",
    "HypervolumeController",
    "LagrangianController",
    "LagrangianSearchController",
    "PAMAController",
    "RewardWeightController",
    "StepContext",
]
