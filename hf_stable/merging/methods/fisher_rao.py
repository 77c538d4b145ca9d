"""Fisher–Rao merging: weighted spherical Karcher mean per tensor with norm restoration, solved from the Gram.

Paper: Wang, Ye, Yin 2026, Fisher–Rao merging (arXiv 2603.04972); its reference code is mergekit's `karcher`
method (`merge_methods/karcher.py`, read, not copied). Spec `merging.md` §3.3 (algorithm), §3.4 (coefficient
space), §3.7 (differences from mergekit: weights honoured, fp64, atan2, backtracking, task-vector space).

Registered names: `fisher_rao` and its alias `karcher` (solver chosen by `solver`), and the norm-restored
Euclidean baselines `nre` and `nre_unit` (= mergekit `multislerp`).
"""

from __future__ import annotations

import functools

from hf_stable.merging.gram import NORM_MODES, SOLVERS, karcher_coefficients
from hf_stable.merging.methods.base import MERGE_METHODS, SPACES, GramMethod


_PAPER = "Wang, Ye, Yin 2026, Functionality-Oriented LLM Merging on the Fisher–Rao Manifold (arXiv 2603.04972)"
_URL = "https://arxiv.org/abs/2603.04972"


class FisherRaoMethod(GramMethod):
    """Fisher–Rao / Karcher merge (Wang, Ye, Yin 2026, arXiv 2603.04972).

    Params: `space` (`weights` | `task_vector`), `solver` (`karcher` | `nre` | `nre_unit`), `norm`
    (`weighted_mean` | `mean` | `median` | `max` | `geometric` | `none`), `max_iter` (50), `tol` (1e-7 rad),
    `step` (1.0), `eps` (1e-12: inputs with a smaller norm are dropped). Per-model weights (≥ 0) are honoured.
    """

    default_name = "fisher_rao"
    fixed_solver: str | None = None
    param_defaults = {
        "space": "weights",
        "solver": "karcher",
        "norm": "weighted_mean",
        "max_iter": 50,
        "tol": 1e-7,
        "step": 1.0,
        "eps": 1e-12,
    }
    choices = {"space": SPACES, "solver": SOLVERS, "norm": NORM_MODES}

    def space(self, params, has_base):
        return self.resolve(params)["space"]

    def _validate(self, params, n_models, has_base):
        mi = params["max_iter"]
        if not isinstance(mi, int) or isinstance(mi, bool) or mi < 0:
            raise ValueError(f"merge_method {self.name!r}: parameter 'max_iter' must be an integer >= 0, got {mi!r}.")
        self._check_number(self.name, "tol", params["tol"], low=0.0)
        self._check_number(self.name, "step", params["step"], low=0.0, high=1.0, low_open=True)
        self._check_number(self.name, "eps", params["eps"], low=0.0)

    def coefficients(self, gram, weights, params):
        p = self.resolve(params)
        return karcher_coefficients(
            gram,
            weights,
            solver=self.fixed_solver or p["solver"],
            norm=p["norm"],
            max_iter=int(p["max_iter"]),
            tol=float(p["tol"]),
            step=float(p["step"]),
            eps=float(p["eps"]),
        )


class _NREMethod(FisherRaoMethod):
    param_defaults = {"space": "weights", "norm": "weighted_mean", "eps": 1e-12}
    choices = {"space": SPACES, "norm": NORM_MODES}

    def _validate(self, params, n_models, has_base):
        self._check_number(self.name, "eps", params["eps"], low=0.0)

    def coefficients(self, gram, weights, params):
        p = self.resolve(params)
        return karcher_coefficients(gram, weights, solver=self.fixed_solver, norm=p["norm"], eps=float(p["eps"]))


class NREMethod(_NREMethod):
    """Norm-restored Euclidean: `s · Σα x / ||Σα x||` (spec §3.3 baseline; Wang, Ye, Yin 2026 comparison)."""

    default_name = "nre"
    fixed_solver = "nre"


class NREUnitMethod(_NREMethod):
    """Normalised mean of unit directions times `s` (= Karcher initialisation = mergekit `multislerp`)."""

    default_name = "nre_unit"
    fixed_solver = "nre_unit"


MERGE_METHODS.register(
    "fisher_rao",
    paper=_PAPER,
    url=_URL,
    description="Weighted spherical Karcher mean per tensor + norm restoration, from the Gram matrix (fp64).",
)(FisherRaoMethod)
MERGE_METHODS.register(
    "karcher",
    paper=_PAPER,
    url=_URL,
    description="Alias of fisher_rao (mergekit-compatible name; per-model weights honoured).",
)(functools.partial(FisherRaoMethod, name="karcher"))
MERGE_METHODS.register(
    "nre",
    paper=_PAPER,
    url=_URL,
    description="Norm-restored Euclidean: weighted average rescaled to the weighted mean norm.",
)(NREMethod)
MERGE_METHODS.register(
    "nre_unit",
    paper=_PAPER,
    url=_URL,
    description="Normalised weighted mean of unit directions rescaled (mergekit multislerp).",
)(NREUnitMethod)
