"""WSM — Warmup-Stable and Merge (arXiv 2507.17634; docs/merging.md, "WSM"): a decay schedule emulated by a
weighted average of checkpoints taken at a constant learning rate.

Checkpoints `θ^(0..k)` are taken every `s` optimiser steps (oldest first) and `Δ_i = θ^(i) − θ^(i−1)`. For merge
weights `c` with `Σ_j c_j = 1`:

    Σ_j c_j θ^(j) = θ^(0) + Σ_{i=1..k} w_i Δ_i,      w_i = Σ_{j≥i} c_j,

so a merge multiplies the updates of interval i by `w_i`: a post-hoc learning-rate decay. Inversely (WSM Theorem
3.1) a non-increasing `w ∈ [0,1]^k` gives `c_k = w_k`, `c_j = w_j − w_{j+1}`, `c_0 = 1 − w_1`, all ≥ 0.

A schedule is a relative-LR curve `f: [0,1] → [0,1]`, non-increasing, sampled on each interval by a quadrature
rule (`left`: `f((i−1)/k)`, `mid`: `f((i−½)/k)`, `interval_mean`: the interval's mean of `f`), optionally lifted by
a floor `φ`: `f_φ = φ + (1−φ) f`. `ema:a` and `uniform` are defined by their weights `c` instead.

Everything here is plain Python floats (fp64) plus two torch helpers; nothing imports transformers.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from itertools import pairwise

import torch


QUADRATURES = ("mid", "left", "interval_mean")
CURVES = ("linear", "cosine", "1-sqrt", "inv_sqrt", "exp", "wsd")
WEIGHT_SCHEDULES = ("ema", "uniform")
_ALIASES = {
    "1-sqrt": "1-sqrt",
    "1_sqrt": "1-sqrt",
    "one_minus_sqrt": "1-sqrt",
    "sqrt": "1-sqrt",
    "linear": "linear",
    "cosine": "cosine",
    "cos": "cosine",
    "inv_sqrt": "inv_sqrt",
    "inverse-sqrt": "inv_sqrt",
    "inverse_sqrt": "inv_sqrt",
    "inv-sqrt": "inv_sqrt",
    "exp": "exp",
    "exponential": "exp",
    "wsd": "wsd",
    "ema": "ema",
    "uniform": "uniform",
    "mean": "uniform",
}
_INTERVAL_MEAN_POINTS = 64  # 64 midpoint-rule points per interval
_MONOTONE_GRID = 1024  # points at which a user curve is checked to be non-increasing and within [0, 1]
_TOL = 1e-12

Schedule = str | Callable[[float], float]


def _parse(schedule: str) -> tuple[str, list[str]]:
    """`"name"`, `"name:arg[:arg]"` or `"name(arg, arg)"` → (canonical name, args as strings)."""
    text = schedule.strip().lower().replace(" ", "")
    call = re.fullmatch(r"([a-z0-9_\-]+)\((.*)\)", text)
    if call:
        name, inner = call.group(1), call.group(2)
        args, depth, current = [], 0, ""
        for ch in inner:  # split on top-level commas only: "wsd(0.5,inv_sqrt(8))"
            depth += (ch == "(") - (ch == ")")
            if ch == "," and depth == 0:
                args.append(current)
                current = ""
            else:
                current += ch
        if current:
            args.append(current)
    else:
        name, _, rest = text.partition(":")
        # wsd:r:shape keeps the shape's own "name:arg" whole
        args = (rest.split(":", 1) if name == "wsd" else [rest]) if rest else []
    if name not in _ALIASES:
        raise ValueError(
            f"Unknown WSM `schedule` {schedule!r}. Valid: linear, cosine, 1-sqrt, inv_sqrt[:a] (alias inverse-sqrt), "
            "exp:beta, wsd:r[:shape], ema:a, uniform, or a callable f(tau) on [0, 1]."
        )
    return _ALIASES[name], args


def _float_arg(schedule: str, args: list[str], index: int, default: float | None, what: str) -> float:
    if len(args) <= index or args[index] == "":
        if default is None:
            raise ValueError(f"WSM `schedule` {schedule!r} needs {what}.")
        return default
    try:
        return float(args[index])
    except ValueError:
        raise ValueError(f"WSM `schedule` {schedule!r}: {what} must be a number, got {args[index]!r}.") from None


def decay_curve(schedule: Schedule) -> Callable[[float], float]:
    """The relative-LR curve `f(τ)`, `τ ∈ [0, 1]`, of a curve schedule (the table in docs/merging.md, "WSM").

    `linear` 1−τ; `cosine` ½(1+cos πτ); `1-sqrt` 1−√τ; `inv_sqrt:a` 1/√(1+aτ) (default a = 8, never reaches 0);
    `exp:β` e^{−βτ}; `wsd:r:shape` 1 for τ < 1−r, else shape((τ−(1−r))/r) (default shape `1-sqrt`). A callable is
    returned after checking it is non-increasing with values in [0, 1] on a 1025-point grid.

    Raises:
        ValueError: for `ema`/`uniform` (defined by weights, see [`wsm_weights`]) or an unknown/invalid schedule.
    """
    if callable(schedule):
        _check_callable(schedule)
        return schedule
    if not isinstance(schedule, str):
        raise TypeError(f"WSM `schedule` must be a string or a callable f(tau), got {type(schedule).__name__}.")
    name, args = _parse(schedule)
    if name == "linear":
        return lambda t: 1.0 - t
    if name == "cosine":
        return lambda t: 0.5 * (1.0 + math.cos(math.pi * t))
    if name == "1-sqrt":
        return lambda t: 1.0 - math.sqrt(max(t, 0.0))
    if name == "inv_sqrt":
        a = _float_arg(schedule, args, 0, 8.0, "a ≥ 0")
        if a < 0:
            raise ValueError(f"WSM `schedule` {schedule!r}: a must be ≥ 0, got {a}.")
        return lambda t: 1.0 / math.sqrt(1.0 + a * t)
    if name == "exp":
        beta = _float_arg(schedule, args, 0, None, "beta ≥ 0 (e.g. 'exp:3')")
        if beta < 0:
            raise ValueError(f"WSM `schedule` {schedule!r}: beta must be ≥ 0, got {beta}.")
        return lambda t: math.exp(-beta * t)
    if name == "wsd":
        r = _float_arg(schedule, args, 0, None, "the decay fraction r in (0, 1] (e.g. 'wsd:0.5:1-sqrt')")
        if not 0.0 < r <= 1.0:
            raise ValueError(f"WSM `schedule` {schedule!r}: the decay fraction r must be in (0, 1], got {r}.")
        shape_name = args[1] if len(args) > 1 and args[1] else "1-sqrt"
        if _parse(shape_name)[0] in ("wsd", *WEIGHT_SCHEDULES):
            raise ValueError(f"WSM `schedule` {schedule!r}: the wsd shape must be a curve, got {shape_name!r}.")
        shape = decay_curve(shape_name)
        return lambda t: 1.0 if t < 1.0 - r else shape((t - (1.0 - r)) / r)
    raise ValueError(
        f"WSM `schedule` {schedule!r} is defined by its checkpoint weights, not a curve; use `wsm_weights` instead."
    )


def _check_callable(f: Callable[[float], float]) -> None:
    values = [float(f(i / _MONOTONE_GRID)) for i in range(_MONOTONE_GRID + 1)]
    for i, v in enumerate(values):
        if not (-_TOL <= v <= 1.0 + _TOL) or math.isnan(v):
            raise ValueError(f"WSM `schedule` callable must map [0, 1] into [0, 1]; f({i / _MONOTONE_GRID}) = {v}.")
        if i and v > values[i - 1] + 1e-9:
            raise ValueError(
                "WSM `schedule` callable must be monotone non-increasing (a decay); "
                f"f({(i - 1) / _MONOTONE_GRID}) = {values[i - 1]} < f({i / _MONOTONE_GRID}) = {v}."
            )


def c_to_w(c: Sequence[float]) -> list[float]:
    """Checkpoint weights `c_0..c_k` (oldest first) → interval multipliers `w_i = Σ_{j≥i} c_j`, i = 1..k."""
    c = [float(x) for x in c]
    if len(c) < 2:
        raise ValueError(f"WSM needs at least 2 checkpoint weights (k ≥ 1), got {len(c)}.")
    w, tail = [], 0.0
    for cj in reversed(c[1:]):
        tail += cj
        w.append(tail)
    return w[::-1]


def w_to_c(w: Sequence[float]) -> list[float]:
    """Interval multipliers `w_1..w_k` → checkpoint weights `c_0..c_k` (WSM Theorem 3.1): `c_0 = 1 − w_1`,
    `c_j = w_j − w_{j+1}`, `c_k = w_k`. Raises unless `1 ≥ w_1 ≥ … ≥ w_k ≥ 0` (exactly when every `c_j ≥ 0`)."""
    w = [float(x) for x in w]
    if not w:
        raise ValueError("WSM needs at least one interval multiplier w (k ≥ 1).")
    if w[0] > 1.0 + _TOL or w[-1] < -_TOL or any(b > a + _TOL for a, b in pairwise(w)):
        raise ValueError(f"WSM interval multipliers w must satisfy 1 ≥ w_1 ≥ … ≥ w_k ≥ 0, got {w}.")
    c = [1.0 - w[0]] + [w[j] - w[j + 1] for j in range(len(w) - 1)] + [w[-1]]
    return [max(x, 0.0) if x > -_TOL else x for x in c]  # clean -1e-17 round-off


def _sample(f: Callable[[float], float], k: int, quadrature: str) -> list[float]:
    if quadrature == "left":
        return [float(f((i - 1) / k)) for i in range(1, k + 1)]
    if quadrature == "mid":
        return [float(f((i - 0.5) / k)) for i in range(1, k + 1)]
    n = _INTERVAL_MEAN_POINTS
    return [sum(float(f((i - 1 + (p + 0.5) / n) / k)) for p in range(n)) / n for i in range(1, k + 1)]


def wsm_weights(
    schedule: Schedule, k: int, quadrature: str = "mid", floor: float = 0.0
) -> tuple[list[float], list[float]]:
    """Merge weights of WSM for `k` intervals (k+1 checkpoints): w_i sampled from the curve, c from w
    (WSM, arXiv 2507.17634, Thm. 3.1).

    Args:
        schedule: a curve name (see [`decay_curve`]), `"ema:a"` (`c_j = (1−a) a^{k−j}` for j ≥ 1, `c_0 = a^k`),
            `"uniform"` (`c_j = 1/(k+1)`), or a callable `f(τ)` on [0, 1] (checked non-increasing).
        k: number of intervals (≥ 1).
        quadrature: `"mid"` (default, `w_i = f((i−½)/k)`), `"left"` (`w_i = f((i−1)/k)`: `c_0 = 0`, and uniform
            `θ^(1..k)` is exactly linear decay) or `"interval_mean"` (mean of f over the interval, 64 points).
            Ignored by `ema`/`uniform`.
        floor: `φ ∈ [0, 1)`; multipliers become `φ + (1−φ) w_i` (for `ema`/`uniform` applied to their implied w).

    Returns:
        `(w, c)`: `w` the k interval multipliers (non-increasing, in [0, 1]), `c` the k+1 checkpoint weights
        `c_0..c_k` over checkpoints oldest first, `c ≥ 0`, `Σ c = 1`.
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"WSM `k` (number of intervals) must be an integer ≥ 1, got {k!r}.")
    if quadrature not in QUADRATURES:
        raise ValueError(f"WSM `quadrature` must be one of {', '.join(QUADRATURES)}, got {quadrature!r}.")
    floor = float(floor)
    if not 0.0 <= floor < 1.0:
        raise ValueError(f"WSM `floor` must be in [0, 1), got {floor}.")
    name = None if callable(schedule) else _parse(schedule)[0] if isinstance(schedule, str) else None
    if name == "ema":
        a = _float_arg(schedule, _parse(schedule)[1], 0, None, "the EMA decay a in [0, 1) (e.g. 'ema:0.7')")
        if not 0.0 <= a < 1.0:
            raise ValueError(f"WSM `schedule` {schedule!r}: the EMA decay a must be in [0, 1), got {a}.")
        w = c_to_w([a**k] + [(1.0 - a) * a ** (k - j) for j in range(1, k + 1)])  # w_i = 1 − a^{k−i+1}
    elif name == "uniform":
        w = [(k - i + 1) / (k + 1) for i in range(1, k + 1)]
    else:
        w = _sample(decay_curve(schedule), k, quadrature)
    w = [min(max(floor + (1.0 - floor) * x, 0.0), 1.0) for x in w]
    return w, w_to_c(w)


def merge_window(
    base: Mapping[str, torch.Tensor], deltas: Sequence[Mapping[str, torch.Tensor]], w: Sequence[float]
) -> dict[str, torch.Tensor]:
    """`θ = B + Σ_i w_i Δ_i` per tensor, accumulated in fp32 one delta at a time.

    Args:
        base: window base `B` (name → tensor, any float dtype; upcast to fp32).
        deltas: `Δ_1..Δ_k` oldest first, same names and shapes as `base` (any float dtype).
        w: the k interval multipliers of [`wsm_weights`].

    Returns:
        name → fp32 tensor of the merged weights.
    """
    if len(deltas) != len(w):
        raise ValueError(f"WSM merge got {len(deltas)} deltas but {len(w)} multipliers w.")
    out = {}
    for name, b in base.items():
        acc = b.detach().to(torch.float32, copy=True)
        for wi, delta in zip(w, deltas, strict=True):
            if name not in delta:
                raise ValueError(f"WSM merge: tensor {name!r} is missing from a delta.")
            acc.add_(delta[name].to(torch.float32), alpha=float(wi))
        out[name] = acc
    return out


def merge_snapshots(snapshots: Sequence[Mapping[str, torch.Tensor]], c: Sequence[float]) -> dict[str, torch.Tensor]:
    """`Σ_j c_j θ^(j)` over snapshots oldest first, in fp64 (the independent side of the identity in tests)."""
    if len(snapshots) != len(c):
        raise ValueError(f"WSM merge got {len(snapshots)} snapshots but {len(c)} weights c.")
    return {
        name: sum(float(cj) * snap[name].to(torch.float64) for cj, snap in zip(c, snapshots, strict=True))
        for name in snapshots[0]
    }
