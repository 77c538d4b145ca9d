"""One Frank–Wolfe iteration of FW-Merging (Chen et al. 2025, arXiv 2503.12649), as `fw.fw_merge` runs it: the
fp64 inner products of the scoring pass, the linear minimisation oracle (`lmo_select`: vertex per tensor and duality
gap), the step size `γ_t` and the streamed update `x ← x + λγ·d`. The algorithm is written out in `fw`'s docstring.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from hf_stable.merging.fw_local import LocalMerge
from hf_stable.merging.fw_pool import CandidateSource
from hf_stable.merging.ties_ops import trim as trim_top


NO_MOVE = -1  # vertex index meaning "s^ℓ = x^ℓ"
ZEROS = -2  # vertex index meaning "s^ℓ = 0" (ref_cosine layer-wise LMO)
_CHUNK = 1 << 22  # elements per fp64 chunk in inner products (bounds the fp64 temporaries)


def dot64(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor | None = None) -> float:
    """`<a, b − c>` (or `<a, b>`) accumulated in fp64 over flat chunks; a, b, c: same numel."""
    a, b = a.reshape(-1), b.reshape(-1)
    c = None if c is None else c.reshape(-1)
    total = torch.zeros((), dtype=torch.float64, device=a.device)
    for s in range(0, a.numel(), _CHUNK):
        bb = b[s : s + _CHUNK].double()
        if c is not None:
            bb = bb - c[s : s + _CHUNK].double()
        total += torch.dot(a[s : s + _CHUNK].double(), bb)
    return float(total)


def norm64(a: torch.Tensor) -> float:
    return math.sqrt(max(dot64(a, a), 0.0))


def fw_gamma(t: int, step: float) -> float:
    """Frank–Wolfe step `γ_t = η·2/(t+2)` (t = 0, 1, ...; γ_0 = η), as the reference's `2/(t+2)·step_size`."""
    return step * 2.0 / (t + 2.0)


def lmo_select(
    scores: torch.Tensor, cosines: torch.Tensor | None, lmo: str, lmo_score: str, live: torch.Tensor
) -> tuple[list[int], float]:
    """Vertex per tensor and the duality gap.

    scores: (N, L) fp64 `<g^ℓ, θ_i^ℓ − x^ℓ>`; cosines: (N, L) `<g^ℓ, θ_i^ℓ>/(‖g^ℓ‖‖θ_i^ℓ‖)` or None;
    live: (L,) bool, tensors with a non-zero gradient (others never move).
    """
    if lmo == "layer":
        best = scores.min(dim=0)
        gap = float(-best.values.clamp(max=0.0)[live].sum())
    else:
        total = scores[:, live].sum(dim=1)
        gap = float(-total.min().clamp(max=0.0))
    if lmo_score == "gap":
        if lmo == "layer":
            idx = best.indices.tolist()
            chosen = [
                i if (v < 0 and ok) else NO_MOVE
                for i, v, ok in zip(idx, best.values.tolist(), live.tolist(), strict=True)
            ]
        else:
            i = int(total.argmin())
            chosen = [i if (total[i] < 0 and ok) else NO_MOVE for ok in live.tolist()]
    else:  # reference behaviour (hmarkc/FW-Merging `frank_wolfe_selection`)
        if lmo == "layer":
            best_c = cosines.min(dim=0)
            chosen = [
                (i if v < 0 else ZEROS) if ok else NO_MOVE
                for i, v, ok in zip(best_c.indices.tolist(), best_c.values.tolist(), live.tolist(), strict=True)
            ]
        else:
            i = int(cosines[:, live].sum(dim=1).argmin())
            chosen = [i if ok else NO_MOVE for ok in live.tolist()]
    return chosen, gap


@torch.no_grad()
def fw_update(
    params: Mapping[str, torch.Tensor],
    sources: list[CandidateSource],
    tensor_names: list[str],
    chosen: list[int],
    local: LocalMerge,
    coef: float,
) -> None:
    """`x^ℓ += coef · d^ℓ`, `d^ℓ = s^ℓ − x^ℓ` (TIES: its top-ρ entries; one direction, so no sign election)."""
    by_source: dict[int, list[str]] = {}
    for n, c in zip(tensor_names, chosen, strict=True):
        if c == NO_MOVE:
            continue
        if c == ZEROS:
            x = params[n].data
            d = -x
            x.add_(trim_top(d, local.density) if local.method == "ties" else d, alpha=coef)
        else:
            by_source.setdefault(c, []).append(n)
    for i, wanted in by_source.items():
        for n in sources[i].order(wanted):
            theta = sources[i].read(n)
            x = params[n].data
            d = theta - x
            del theta
            x.add_(trim_top(d, local.density) if local.method == "ties" else d, alpha=coef)
            del d
