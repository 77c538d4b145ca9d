"""Constrained RLHF (Moskovitz et al., arXiv 2310.04373): the Lagrangian controller (``reward_weighting=
"lagrangian"``: dual multipliers keeping each mean reward below its threshold) and the paper's gradient-free search
over those thresholds during a single run (``reward_weighting="lagrangian_search"``).

Each function evaluation of the search is a stretch of training under the proposed thresholds; its value is minus
the greedy validation mean of a held-out reward function (one that is scored but not trained on), the role the
paper's human-proxy evaluation score plays. The policy carries over from one evaluation to the next.

Followed: the paper's reference code, ``NelderMeadTrainer`` in ``rl4lms/envs/text_generation/training_utils.py`` of
tedmoskovitz/ConstrainedRL4LMs (settings in ``scripts/training/task_configs/dialog/gpt2_nm_ppo.yml``): Nelder-Mead
with reflection 1, expansion 2, contraction 0.5 and shrink 0.5 over the threshold vector; one evaluation is a fixed
number of training iterations under the thresholds, scored by minus the held-out score; the Lagrange multipliers
carry over when the thresholds change. Reconstructed or changed, each on purpose:

* the simplex moves follow the standard algorithm (Lagarias et al., 1998) as ``scipy.optimize.minimize(
  method="Nelder-Mead")`` does, whose path [`NelderMead`] reproduces point for point (tested); the reference code
  contracts inside only and keeps an expansion when it beats the best vertex rather than the reflection;
* the initial simplex is the user's ``lagrange_thresholds`` plus one edge per searched threshold (scipy's 5 % rule
  by default); the reference draws its vertices at random within hand-set ranges of its task;
* the reference ends an evaluation early once every constraint is within 5 % of its threshold, and reuses the value
  of a point within 5e-3 of an evaluated one; here an evaluation is always ``lagrange_search_period`` validations
  (the ask/tell order never evaluates a vertex twice);
* the reference stops when the spread of the simplex values is small after a shrink and ends training; here the
  search stops when every vertex is within ``lagrange_search_xtol`` of the best, which is then held to the end.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .._validation import check_int, check_length, integer, number
from ..papers import PAPERS
from ..registry import Field, Requires
from .controller_base import REWARD_WEIGHTINGS, RewardWeightController
from .reward_weighting import lagrangian_update


PHASES = ("init", "reflect", "expand", "contract_outside", "contract_inside", "shrink", "done")
_INIT, _REFLECT, _EXPAND, _CONTRACT_OUT, _CONTRACT_IN, _SHRINK, _DONE = range(len(PHASES))


class NelderMead:
    """Ask/tell Nelder-Mead minimiser: ``ask()`` is the next point to evaluate (the same until ``tell``),
    ``tell(value)`` its value. The coefficients are the standard ones; points are clipped into ``[low, high]``, and
    initial vertices above ``high`` are first reflected into the interior, as scipy does. A NaN value counts as
    ``inf`` (the worst). The state is float64 tensors (``state_dict``), so a resumed search proposes the same points.

    Args:
        simplex: `(N+1, N)` initial vertices.
        low, high: `(N,)` bounds (``None``: unbounded).
        xatol, fatol: stop when every vertex is within ``xatol`` of the best (max-norm) and every value within
            ``fatol`` of the best value (``fatol=inf``: the vertices alone decide); then ``ask()`` is the best vertex.
    """

    reflection, expansion, contraction, shrinkage = 1.0, 2.0, 0.5, 0.5

    def __init__(self, simplex, low=None, high=None, xatol: float = 0.0, fatol: float = math.inf):
        sim = torch.as_tensor(simplex, dtype=torch.float64).clone()
        if sim.ndim != 2 or sim.shape[0] != sim.shape[1] + 1 or sim.shape[1] == 0:
            raise ValueError(f"The initial simplex must have shape (N+1, N) with N >= 1, got {tuple(sim.shape)}.")
        n = sim.shape[1]
        self.low = _bounds(low, n, -math.inf)
        self.high = _bounds(high, n, math.inf)
        if (self.low > self.high).any():
            raise ValueError(f"Nelder-Mead bounds: low {self.low.tolist()} exceeds high {self.high.tolist()}.")
        sim = torch.where(sim > self.high, 2 * self.high - sim, sim)
        self.sim = self._clip(sim)
        self.fsim = torch.full((n + 1,), math.inf, dtype=torch.float64)
        self.xatol, self.fatol = xatol, fatol
        self.phase, self.index, self.iterations, self.evaluations = _INIT, 0, 0, 0
        self.xr = torch.zeros(n, dtype=torch.float64)
        self.fxr = math.inf
        self.point = self.sim[0].clone()

    @property
    def n(self) -> int:
        return self.sim.shape[1]

    @property
    def done(self) -> bool:
        return self.phase == _DONE

    def ask(self) -> torch.Tensor:
        return self.point.clone()

    def best(self) -> tuple[torch.Tensor, float]:
        """The best vertex evaluated so far and its value (``inf`` before any value)."""
        evaluated = self.fsim if self.phase != _INIT else self.fsim[: self.index]
        if len(evaluated) == 0:
            return self.sim[0].clone(), math.inf
        i = int(torch.argmin(evaluated))  # the first of ties, like a stable sort
        return self.sim[i].clone(), float(evaluated[i])

    def tell(self, value: float) -> None:
        if self.phase == _DONE:
            return
        value = float(value)
        if math.isnan(value):
            value = math.inf
        self.evaluations += 1
        phase = self.phase
        if phase in (_INIT, _SHRINK):
            self.fsim[self.index] = value
            self.index += 1
            if self.index <= self.n:
                self.point = self.sim[self.index].clone()
            elif phase == _INIT:
                self._sort()
                self._begin()
            else:
                self._end()
        elif phase == _REFLECT:
            self.fxr = value
            if value < self.fsim[0]:
                self._move(_EXPAND, 1 + self.reflection * self.expansion)
            elif value < self.fsim[-2]:
                self._accept(self.xr, value)
            elif value < self.fsim[-1]:
                self._move(_CONTRACT_OUT, 1 + self.contraction * self.reflection)
            else:
                self._move(_CONTRACT_IN, 1 - self.contraction)
        elif phase == _EXPAND:
            if value < self.fxr:
                self._accept(self.point, value)
            else:
                self._accept(self.xr, self.fxr)
        elif phase == _CONTRACT_OUT:
            if value <= self.fxr:
                self._accept(self.point, value)
            else:
                self._shrink()
        elif value < self.fsim[-1]:  # inside contraction
            self._accept(self.point, value)
        else:
            self._shrink()

    # -- moves ------------------------------------------------------------------------------------------------------

    def _clip(self, x: torch.Tensor) -> torch.Tensor:
        return torch.minimum(torch.maximum(x, self.low), self.high)

    def _centroid(self) -> torch.Tensor:
        total = self.sim[0].clone()
        for row in self.sim[1:-1]:  # row by row, the order numpy's reduction over rows adds in
            total = total + row
        return total / self.n

    def _move(self, phase: int, a: float) -> None:
        """Propose ``a · x̄ - (a - 1) · x_worst`` (reflection a = 1 + ρ, expansion 1 + ρχ, outside contraction
        1 + ψρ, inside contraction 1 - ψ)."""
        self.phase = phase
        if phase == _CONTRACT_IN:  # scipy's form `(1 - ψ) x̄ + ψ x_worst`: the same point, the same rounding
            self.point = self._clip(a * self._centroid() + self.contraction * self.sim[-1])
        else:
            self.point = self._clip(a * self._centroid() - (a - 1) * self.sim[-1])

    def _begin(self) -> None:
        spread = (self.sim[1:] - self.sim[0]).abs().max()
        values_close = math.isinf(self.fatol) or bool((self.fsim[1:] - self.fsim[0]).abs().max() <= self.fatol)
        if bool(spread <= self.xatol) and values_close:
            self.phase, self.point = _DONE, self.sim[0].clone()
            return
        self._move(_REFLECT, 1 + self.reflection)
        self.xr = self.point.clone()

    def _accept(self, x: torch.Tensor, value: float) -> None:
        self.sim[-1] = x
        self.fsim[-1] = value
        self._end()

    def _shrink(self) -> None:
        for j in range(1, self.n + 1):
            self.sim[j] = self._clip(self.sim[0] + self.shrinkage * (self.sim[j] - self.sim[0]))
        self.phase, self.index = _SHRINK, 1
        self.point = self.sim[1].clone()

    def _end(self) -> None:
        self.iterations += 1
        self._sort()
        self._begin()

    def _sort(self) -> None:
        order = torch.sort(self.fsim, stable=True).indices
        self.sim, self.fsim = self.sim[order], self.fsim[order]

    # -- state -------------------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, torch.Tensor]:
        counters = [self.phase, self.index, self.iterations, self.evaluations]
        return {
            "sim": self.sim.clone(),
            "fsim": self.fsim.clone(),
            "point": self.point.clone(),
            "xr": self.xr.clone(),
            "fxr": torch.tensor(self.fxr, dtype=torch.float64),
            "counters": torch.tensor(counters, dtype=torch.int64),
        }

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if tuple(state["sim"].shape) != tuple(self.sim.shape):
            raise ValueError(
                f"The saved threshold search has a simplex of shape {tuple(state['sim'].shape)}; this one searches "
                f"{self.n} thresholds."
            )
        self.sim, self.fsim = state["sim"].double().clone(), state["fsim"].double().clone()
        self.point, self.xr = state["point"].double().clone(), state["xr"].double().clone()
        self.fxr = float(state["fxr"])
        self.phase, self.index, self.iterations, self.evaluations = (int(c) for c in state["counters"])


def _bounds(values, n: int, fill: float) -> torch.Tensor:
    if values is None:
        return torch.full((n,), fill, dtype=torch.float64)
    return torch.tensor([fill if v is None else float(v) for v in values], dtype=torch.float64)


def default_simplex(x0: torch.Tensor, steps: Sequence[float | None] | None = None) -> torch.Tensor:
    """`(N+1, N)`: ``x0`` and, for each coordinate j, ``x0`` moved along j by ``steps[j]``; a missing step is
    scipy's default (5 % of the coordinate, 0.00025 where it is 0)."""
    x0 = x0.double()
    sim = x0.repeat(len(x0) + 1, 1)
    for j in range(len(x0)):
        step = None if steps is None else steps[j]
        if step is not None:
            sim[j + 1, j] = x0[j] + step
        elif x0[j] != 0:
            sim[j + 1, j] = 1.05 * x0[j]
        else:
            sim[j + 1, j] = 0.00025
    return sim


def _number_list(*, positive: bool = False):
    """A check for a per-reward list of numbers with null entries (``positive``: each > 0)."""

    def check(name, value, where=None):
        if value is None:
            return
        bad = not isinstance(value, (list, tuple)) or any(
            v is not None
            and (
                not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or (positive and v <= 0)
            )
            for v in value
        )
        if bad:
            what = "positive finite numbers" if positive else "finite numbers"
            raise ValueError(f"`{name}` must be a list of {what} or null, one per reward function, got {value!r}.")

    check.describe = "list of " + ("numbers > 0" if positive else "numbers") + " or null"
    return check


@REWARD_WEIGHTINGS.register(
    "lagrangian",
    paper=PAPERS["constrained_rlhf"],
    description="dual multipliers keeping each mean reward below a threshold",
    fields=[
        Field(
            "lagrange_thresholds",
            None,
            "Upper bound θ_k on each mean reward, one per reward function (`null` for unconstrained).",
            param="thresholds",
            type=list[float] | None,
        ),
        Field("lagrange_lr", 0.01, "Dual step size.", check=number(low=0), param="lr"),
    ],
)
class LagrangianController(RewardWeightController):
    """Constrained composite rewards: `w_k = b_k (1 - μ_k)` with dual ascent keeping `E[r_k] ≤ θ_k`."""

    adaptive = True

    def __init__(self, base_weights, thresholds=None, lr=0.01):
        super().__init__(base_weights)
        k = self.base.numel()
        if thresholds is None or len(thresholds) != k:
            raise ValueError(
                f"reward_weighting='lagrangian' needs `lagrange_thresholds` with one entry per reward function ({k}); "
                "use null for an unconstrained one."
            )
        self.lr = lr
        self.thresholds = torch.tensor([math.nan if t is None else float(t) for t in thresholds])
        self.multipliers = torch.zeros(k)

    @property
    def weights(self):
        return self.base * (1 - self.multipliers)

    def observe(self, rewards, advantages, num_generations, context):
        means = torch.nanmean(rewards.float(), dim=0)
        self.multipliers = lagrangian_update(self.multipliers, means, self.thresholds, self.lr)
        return {f"lagrangian/mu_{k}": v for k, v in enumerate(self.multipliers.tolist())}

    def state_dict(self):
        return {"multipliers": self.multipliers}

    def load_state_dict(self, state):
        self.multipliers = state["multipliers"].float()



_LAGRANGIAN_FIELDS = REWARD_WEIGHTINGS.get("lagrangian").fields


@REWARD_WEIGHTINGS.register(
    "lagrangian_search",
    paper=PAPERS["constrained_rlhf"],
    description="the Lagrangian with its thresholds found by Nelder-Mead on a held-out reward",
    requires=[
        Requires(
            "lagrange_search_objective",
            lambda v: v is not None,
            "name the held-out reward function, weight 0 and threshold null, whose validation mean is maximised",
        ),
        Requires(
            "lagrange_thresholds",
            lambda v: isinstance(v, (list, tuple)) and any(t is not None for t in v),
            "give the starting threshold of each searched reward function, null for the others",
        ),
    ],
    example={"lagrange_thresholds": [None, 0.5, None], "lagrange_search_objective": 2},
    fields=[
        *_LAGRANGIAN_FIELDS,
        Field(
            "lagrange_search_objective",
            None,
            "Index of the held-out reward function whose greedy validation mean the threshold search maximises "
            "(required; its reward weight must be 0 and its threshold null).",
            check=integer(low=0, allow_none=True),
            param="objective",
            type=int | None,
        ),
        Field(
            "lagrange_search_low",
            None,
            "Lower bound of each searched threshold, one per reward function (null: unbounded).",
            check=_number_list(),
            param="low",
            type=list[float] | None,
        ),
        Field(
            "lagrange_search_high",
            None,
            "Upper bound of each searched threshold, one per reward function (null: unbounded).",
            check=_number_list(),
            param="high",
            type=list[float] | None,
        ),
        Field(
            "lagrange_search_step",
            None,
            "Edge of the initial simplex along each searched threshold, one per reward function (null: 5 % of the "
            "threshold, 0.00025 where it is 0).",
            check=_number_list(positive=True),
            param="step",
            type=list[float] | None,
        ),
        Field(
            "lagrange_search_period",
            1,
            "Validation evaluations each proposed threshold vector is trained under; the last one scores it.",
            check=integer(low=1),
            param="period",
        ),
        Field(
            "lagrange_search_eval_every",
            1,
            "Steps between validation evaluations.",
            check=integer(low=1),
            param="eval_every",
        ),
        Field(
            "lagrange_search_val_size",
            16,
            "Validation prompts (from `eval_dataset`, else the first training prompts).",
            check=integer(low=1),
            param="val_size",
        ),
        Field(
            "lagrange_search_xtol",
            0.0,
            "The search stops, holding its best thresholds, once every vertex is within this of the best (0: never).",
            check=number(low=0),
            param="xtol",
        ),
    ],
)
class LagrangianSearchController(LagrangianController):
    """The Lagrangian (`w_k = b_k (1 - μ_k)`, dual ascent on `E[r_k] ≤ θ_k`) whose non-null thresholds are proposed by
    [`NelderMead`]: each proposal is held for ``period`` validation evaluations (one every ``eval_every`` steps), then
    scored by minus the held-out reward's validation mean. The first validation (before training) is the reference
    and scores nothing. The search costs ``period`` validations per function evaluation: N+1 to score the initial
    simplex, then 1 or 2 per iteration, N more on a shrink."""

    needs_validation = True

    def __init__(
        self,
        base_weights,
        thresholds=None,
        lr=0.01,
        objective=None,
        low=None,
        high=None,
        step=None,
        period=1,
        eval_every=1,
        val_size=16,
        xtol=0.0,
    ):
        k = base_weights.numel()
        if thresholds is None or len(thresholds) != k:
            raise ValueError(
                f"reward_weighting='lagrangian_search' needs `lagrange_thresholds` with one entry per reward function "
                f"({k}): the starting thresholds of the searched rewards, null for the others."
            )
        super().__init__(base_weights, thresholds, lr)
        if objective is None:
            raise ValueError(
                "reward_weighting='lagrangian_search' needs `lagrange_search_objective`: the index of a held-out "
                f"reward function (weight 0, threshold null) among the {k}."
            )
        check_int("lagrange_search_objective", objective, low=0, high=k - 1)
        if self.base[objective] != 0 or thresholds[objective] is not None:
            raise ValueError(
                f"`lagrange_search_objective`={objective} must name a held-out reward function: reward weight 0 "
                f"(got {self.base[objective].item()}) and `lagrange_thresholds` entry null (got "
                f"{thresholds[objective]!r})."
            )
        per_reward = {"lagrange_search_low": low, "lagrange_search_high": high, "lagrange_search_step": step}
        for name, value in per_reward.items():
            check_length(name, value, k, of="reward function")
        self.searched = [i for i, t in enumerate(thresholds) if t is not None]
        if not self.searched:
            raise ValueError(
                "reward_weighting='lagrangian_search' needs a non-null `lagrange_thresholds` entry to search."
            )
        self.objective, self.period, self.eval_every, self.val_size = objective, period, eval_every, val_size
        x0 = self.thresholds[self.searched].double()
        pick = self.searched
        lo = _bounds(None if low is None else [low[i] for i in pick], len(pick), -math.inf)
        hi = _bounds(None if high is None else [high[i] for i in pick], len(pick), math.inf)
        outside = [pick[j] for j in range(len(pick)) if not lo[j] <= x0[j] <= hi[j]]
        if outside or (lo > hi).any():
            raise ValueError(
                f"`lagrange_thresholds` entries {outside} lie outside [`lagrange_search_low`, `lagrange_search_high`] "
                f"= {[low, high]} (each low must be <= its high)."
            )
        simplex = default_simplex(x0, None if step is None else [step[i] for i in pick])
        self.search = NelderMead(simplex, lo, hi, xatol=xtol)
        self.reference: torch.Tensor | None = None
        self.held = 0
        self._propose()

    def _propose(self) -> None:
        self.thresholds[self.searched] = self.search.ask().float()

    def validation_point(self, means: torch.Tensor) -> dict[str, float]:
        """Score the current proposal with the held-out mean of `means` `(K,)` once it has been held ``period``
        validations; the first call (before training) is the reference."""
        score = float(means[self.objective])
        metrics = {"lagrangian_search/objective": score}
        if self.reference is None:
            self.reference = means.float().clone()
            return metrics
        self.held += 1
        if self.held >= self.period:
            self.search.tell(-score)  # NaN (nothing scored) counts as the worst value
            self.held = 0
            self._propose()
        metrics.update({f"lagrangian_search/threshold_{k}": float(self.thresholds[k]) for k in self.searched})
        metrics["lagrangian_search/evaluations"] = float(self.search.evaluations)
        metrics["lagrangian_search/phase"] = float(self.search.phase)
        return metrics

    def state_dict(self):
        state = {**super().state_dict(), **{f"search.{k}": v for k, v in self.search.state_dict().items()}}
        state["held"] = torch.tensor(self.held, dtype=torch.int64)
        if self.reference is not None:
            state["reference"] = self.reference
        return state

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.search.load_state_dict({k.split(".", 1)[1]: v for k, v in state.items() if k.startswith("search.")})
        self.held = int(state["held"])
        self.reference = state["reference"].float() if "reference" in state else None
        self._propose()
