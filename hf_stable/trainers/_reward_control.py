"""Stateful reward-weight controllers for `StableGRPOTrainer`: thin holders of the state the pure update rules of
`hf_stable.losses.reward_weighting` need between generation batches, with `state_dict` for checkpoints."""

from __future__ import annotations

import math

import torch

from ..losses.reward_weighting import (
    ctwa_covariance,
    ctwa_update,
    gradient_weight_update,
    hypervolume_step,
    lagrangian_update,
)


class RewardWeightController:
    """`static`: the user's weights, unchanged. Subclasses adapt them; `weights` is what scalarises the next batch."""

    name = "static"

    def __init__(self, base_weights: torch.Tensor, args):
        self.base = base_weights.float().clone()
        self.args = args

    @property
    def weights(self) -> torch.Tensor:
        return self.base

    @property
    def advantage_multiplier(self) -> float:
        return 1.0

    def observe(self, rewards: torch.Tensor, advantages: torch.Tensor, num_generations: int) -> dict[str, float]:
        """Update from a generation batch: raw rewards `(N, K)` and the advantages used `(N,)`; returns metrics."""
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class CTWAController(RewardWeightController):
    """Covariance Targeted Weight Adaptation (arXiv 2602.06869): `log λ_k` grows while the EMA of the within-group
    covariance between objective k's reward and the training signal stays below its target."""

    name = "ctwa"

    def __init__(self, base_weights, args):
        super().__init__(base_weights, args)
        if (self.base <= 0).any():
            raise ValueError(f"reward_weighting='ctwa' needs positive reward_weights, got {self.base.tolist()}.")
        k = self.base.numel()
        self.log_weights = torch.log(self.base)
        self.ema: torch.Tensor | None = None
        self.targets = torch.tensor(args.ctwa_cov_targets if args.ctwa_cov_targets is not None else [0.1] * k)
        self.obj_targets = torch.tensor(args.ctwa_obj_targets) if args.ctwa_obj_targets is not None else None
        for field, value in (("ctwa_cov_targets", self.targets), ("ctwa_obj_targets", self.obj_targets)):
            if value is not None and value.numel() != k:
                raise ValueError(f"`{field}` has {value.numel()} entries but there are {k} reward functions.")

    @property
    def weights(self):
        return self.log_weights.exp()

    def observe(self, rewards, advantages, num_generations):
        cov, metrics = ctwa_covariance(rewards, advantages, num_generations, use_corr=self.args.ctwa_use_corr)
        means = torch.nanmean(rewards.float(), dim=0)
        self.log_weights, self.ema, deficit = ctwa_update(
            self.log_weights,
            self.ema,
            cov,
            self.targets,
            self.args.ctwa_lambda_lr,
            self.args.ctwa_ema_tau,
            objective_means=means,
            objective_targets=self.obj_targets,
            max_log_weight=self.args.ctwa_max_log_weight,
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


class LagrangianController(RewardWeightController):
    """Constrained composite rewards: `w_k = b_k (1 - μ_k)` with dual ascent keeping `E[r_k] ≤ θ_k`."""

    name = "lagrangian"

    def __init__(self, base_weights, args):
        super().__init__(base_weights, args)
        k = self.base.numel()
        if args.lagrange_thresholds is None or len(args.lagrange_thresholds) != k:
            raise ValueError(
                f"reward_weighting='lagrangian' needs `lagrange_thresholds` with one entry per reward function ({k}); "
                "use null for an unconstrained one."
            )
        self.thresholds = torch.tensor([math.nan if t is None else float(t) for t in args.lagrange_thresholds])
        self.multipliers = torch.zeros(k)

    @property
    def weights(self):
        return self.base * (1 - self.multipliers)

    def observe(self, rewards, advantages, num_generations):
        means = torch.nanmean(rewards.float(), dim=0)
        self.multipliers = lagrangian_update(self.multipliers, means, self.thresholds, self.args.lagrange_lr)
        return {f"lagrangian/mu_{k}": v for k, v in enumerate(self.multipliers.tolist())}

    def state_dict(self):
        return {"multipliers": self.multipliers}

    def load_state_dict(self, state):
        self.multipliers = state["multipliers"].float()


class GradientController(RewardWeightController):
    """Gradient-based weights (arXiv 2509.11452): mirror ascent on the objectives' gradient inner products. The
    trainer computes the influence scores (it owns the model) and calls [`update`]."""

    name = "gradient"

    def __init__(self, base_weights, args):
        super().__init__(base_weights, args)
        self.current = self.base / self.base.sum()

    @property
    def weights(self):
        return self.current

    def update(self, scores: torch.Tensor, lr: float) -> dict[str, float]:
        self.current = gradient_weight_update(self.current, scores, lr, self.args.drw_regularization)
        out = {f"drw/score_{k}": v for k, v in enumerate(scores.tolist())}
        return {**out, **{f"drw/weight_{k}": v for k, v in enumerate(self.current.tolist())}}

    def state_dict(self):
        return {"weights": self.current}

    def load_state_dict(self, state):
        self.current = state["weights"].float()


class HypervolumeController(RewardWeightController):
    """Hypervolume-guided multiplier (arXiv 2509.11452): validation means extend a Pareto front seeded with the
    initial model's means; the next steps' advantages are scaled by `0.5 + 1.5 tanh(HVC)`. The reference scales raw
    rewards, which group normalisation would cancel; scaling the advantages keeps its intent (documented)."""

    name = "hypervolume"

    def __init__(self, base_weights, args):
        super().__init__(base_weights, args)
        k = self.base.numel()
        maximize = args.drw_maximize if args.drw_maximize is not None else [True] * k
        if len(maximize) != k:
            raise ValueError(f"`drw_maximize` has {len(maximize)} entries but there are {k} reward functions.")
        self.sign = torch.tensor([1.0 if m else -1.0 for m in maximize])
        self.reference: torch.Tensor | None = None
        self.front: torch.Tensor | None = None
        self.multiplier = 1.0

    @property
    def advantage_multiplier(self):
        return self.multiplier

    def validation_point(self, means: torch.Tensor) -> dict[str, float]:
        point = means.float() * self.sign
        if self.reference is None:  # the first evaluation (before training) is the reference point
            self.reference, self.front = point.clone(), point.reshape(1, -1).clone()
            return {"hv/contribution": 0.0, "hv/multiplier": self.multiplier}
        self.multiplier, self.front, hvc = hypervolume_step(self.front, point, self.reference)
        return {"hv/contribution": hvc, "hv/multiplier": self.multiplier, "hv/front_size": float(len(self.front))}

    def state_dict(self):
        if self.reference is None:
            return {}
        return {"reference": self.reference, "front": self.front, "multiplier": torch.tensor(self.multiplier)}

    def load_state_dict(self, state):
        if "reference" in state:
            self.reference, self.front = state["reference"].float(), state["front"].float()
            self.multiplier = float(state["multiplier"])


CONTROLLERS = {
    c.name: c
    for c in (RewardWeightController, CTWAController, LagrangianController, GradientController, HypervolumeController)
}
