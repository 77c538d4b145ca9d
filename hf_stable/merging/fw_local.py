"""FW-Merging's local merges: how a Frank–Wolfe direction is applied (`LocalMerge`: task arithmetic or TIES), the
pool's opening and shape checks, and the streamed TA / TIES merge of a whole pool (`init="merge_all"` of `fw.fw_merge`,
and the baselines of `local_merge_all`). The TIES steps are `ties_ops`' (the combiner of `merge_method: ties`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hf_stable._validation import check_choice, check_number
from hf_stable.merging.fw_pool import CandidateSource, ResidentTracker
from hf_stable.merging.ties_ops import disjoint_add, disjoint_mean, elect
from hf_stable.merging.ties_ops import trim as trim_top


LOCAL_MERGES = ("ta", "ties")


def _label(spec: Any, i: int) -> str:
    return str(spec) if isinstance(spec, (str, os.PathLike)) else f"pool[{i}]"


def open_pool(pool: Sequence[Any], tracker: ResidentTracker, device) -> list[CandidateSource]:
    if isinstance(pool, (str, os.PathLike, Mapping)):
        raise TypeError("pool: expected a list of checkpoints (paths or state dicts), got a single one")
    return [CandidateSource(spec, tracker, label=_label(spec, i), device=device) for i, spec in enumerate(pool)]


def check_pool(sources: list[CandidateSource], shapes: dict[str, tuple[int, ...]]) -> None:
    for src in sources:
        missing = [n for n in shapes if n not in src.shapes]
        if missing:
            raise ValueError(f"pool entry {src.label}: missing tensor(s) {missing[:5]} of the base model")
        for n, shape in shapes.items():
            if src.shapes[n] != shape:
                raise ValueError(f"pool entry {src.label}: tensor {n!r} has shape {src.shapes[n]}, base has {shape}")


@dataclass
class LocalMerge:
    """How the FW direction is applied: `ta` adds `λγ(s − x)`; `ties` adds `λγ·Trim_ρ(s − x)`."""

    method: str = "ta"
    scaling: float = 1.0
    density: float = 0.3

    @classmethod
    def parse(cls, value: Any) -> LocalMerge:
        if value is None:
            return cls()
        if isinstance(value, LocalMerge):
            out = value
        elif isinstance(value, str):
            out = cls(method=value)
        elif isinstance(value, Mapping):
            unknown = set(value) - {"method", "scaling", "density"}
            if unknown:
                raise ValueError(f"local_merge: unknown key(s) {sorted(unknown)}; allowed: method, scaling, density")
            out = cls(**dict(value))
        else:
            raise TypeError(f"local_merge: expected a dict, a method name or LocalMerge, got {type(value)}")
        check_choice("local_merge.method", out.method, LOCAL_MERGES)
        check_number("local_merge.scaling", out.scaling, low=0, low_open=True)
        check_number("local_merge.density", out.density, low=0, high=1, low_open=True)
        return out


@torch.no_grad()
def merge_all_into(params: Mapping[str, torch.Tensor], sources: list[CandidateSource], local: LocalMerge) -> None:
    """In place: `x ← θ_0 + λ·TA(τ)` or `θ_0 + λ·TIES_ρ(τ)` with `θ_0` = the current `params`, `τ_i = θ_i − θ_0`.

    Streamed candidate by candidate, one tensor resident. TA: `Σ_i τ_i`. TIES (Yadav et al. 2023, the combiner of
    `merge_method: ties` with unit weights): per-tensor magnitude trim of each `τ_i` to density ρ, elected sign
    of `Σ_i trim(τ_i)` (0 → +), disjoint mean over the entries that agree with it. Two passes for TIES (sum of
    trimmed vectors, then the agreeing sum and count): memory O(model), not O(N·model).
    """
    names = list(params)
    base = {n: params[n].detach().clone() for n in names}
    if local.method == "ta":
        acc = {n: torch.zeros_like(base[n]) for n in names}
        for src in sources:
            for n in src.order(names):
                theta = src.read(n)
                acc[n] += theta - base[n]
                del theta
        merged = acc
    else:
        total = {n: torch.zeros_like(base[n]) for n in names}
        for src in sources:
            for n in src.order(names):
                theta = src.read(n)
                total[n] += trim_top(theta - base[n], local.density)
                del theta
        sign = {n: elect(total[n]) for n in names}
        del total
        agree = {n: torch.zeros_like(base[n]) for n in names}
        count = {n: torch.zeros_like(base[n]) for n in names}
        for src in sources:
            for n in src.order(names):
                theta = src.read(n)
                tau = trim_top(theta - base[n], local.density)
                del theta
                disjoint_add(agree[n], count[n], tau, sign[n], 1.0)
        merged = {n: disjoint_mean(agree[n], count[n], sign[n], [1.0]) for n in names}
    for n in names:
        params[n].copy_(base[n] + local.scaling * merged[n])


def local_merge_all(
    base: Mapping[str, torch.Tensor],
    pool: Sequence[Any],
    *,
    method: str = "ta",
    scaling: float = 1.0,
    density: float = 0.3,
    tracker: ResidentTracker | None = None,
) -> dict[str, torch.Tensor]:
    """Task arithmetic / TIES of a whole pool against `base`, streamed (one candidate tensor resident).

    Args:
        base: `{name: tensor}`; its float tensors are merged.
        pool: paths of safetensors checkpoints or state dicts.
        method, scaling, density: `LocalMerge` fields (`ta`: `θ_0 + λΣτ_i`; `ties`: `θ_0 + λ·TIES_ρ(τ)`).
    Returns:
        `{name: fp32 tensor}`.
    """
    local = LocalMerge.parse({"method": method, "scaling": scaling, "density": density})
    tracker = tracker or ResidentTracker()
    params = {n: t.detach().to(torch.float32).clone() for n, t in base.items() if t.dtype.is_floating_point}
    sources = open_pool(pool, tracker, device=next(iter(params.values())).device)
    try:
        check_pool(sources, {n: tuple(t.shape) for n, t in params.items()})
        merge_all_into(params, sources, local)
    finally:
        for src in sources:
            src.close()
    return params
