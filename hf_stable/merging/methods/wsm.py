"""WSM (Warmup-Stable and Merge): a weighted average of ordered checkpoints that emulates an LR decay.

Coefficients `c_0 … c_k` over the N = k+1 checkpoints (oldest first) come from the decay schedule via
`hf_stable.merging.wsm.wsm_weights(schedule, k, quadrature, floor)` (docs/merging.md, "WSM").
Paper: WSM, arXiv 2507.17634.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from hf_stable._validation import number
from hf_stable.papers import PAPERS
from hf_stable.registry import Field

from .base import GramMethod, merge_method


def wsm_coefficients(n_models: int, schedule: Any = "1-sqrt", quadrature: str = "mid", floor: float = 0.0):
    """`(N,)` float64 merge weights of N ordered checkpoints (N = 1 → `[1]`)."""
    if n_models == 1:
        return torch.ones(1, dtype=torch.float64)
    from hf_stable.merging.wsm import wsm_weights

    _, c = wsm_weights(schedule, n_models - 1, quadrature=quadrature, floor=floor)
    c = torch.as_tensor(list(c), dtype=torch.float64)
    if c.numel() != n_models:
        raise ValueError(f"wsm_weights returned {c.numel()} coefficients for {n_models} checkpoints.")
    return c


def _schedule_check(name, value, where=None):
    try:
        wsm_coefficients(3, value)
    except (ValueError, TypeError) as err:
        raise ValueError(f"{where}: `{name}`={value!r}: {err}") from None


def _quadrature_check(name, value, where=None):
    try:
        wsm_coefficients(3, quadrature=value)
    except (ValueError, TypeError) as err:
        raise ValueError(f"{where}: `{name}`={value!r}: {err}") from None


@merge_method("wsm", PAPERS["wsm"])
class WSMMethod(GramMethod):
    """Checkpoint merge Σ c_j θ_j emulating an LR decay schedule (checkpoints ordered oldest first).

    WSM checkpoint merge (arXiv 2507.17634). Params: `schedule` ("1-sqrt"), `quadrature` ("mid"), `floor` (0).

    The schedule sets the coefficients: per-model weights are refused.
    """

    params = (
        Field("schedule", "1-sqrt", "Decay curve emulated by the merge.", _schedule_check),
        Field("quadrature", "mid", "Where each interval samples the curve.", _quadrature_check),
        Field("floor", 0.0, "Lowest relative learning rate of the curve.", number(low=0, high=1)),
    )

    def _validate(self, params, n_models, has_base):
        try:
            wsm_coefficients(max(n_models, 2), params["schedule"], params["quadrature"], params["floor"])
        except (ValueError, TypeError) as err:
            raise ValueError(f"{self.where}: {err}") from err

    def needs_gram(self, params: Mapping[str, Any]) -> bool:
        return False

    def coefficients(self, gram, weights, params):
        p = self.resolve(params)
        return wsm_coefficients(len(weights), p["schedule"], p["quadrature"], float(p["floor"]))
