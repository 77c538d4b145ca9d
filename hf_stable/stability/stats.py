"""Robust running statistics for spike detection: a median/MAD window, the spike rule and a scalar innovation filter.

Everything here is pure Python on float64 scalars (a few hundred numbers per step), with no torch or transformers
import, so the same code runs identically on every rank from all-reduced values.

Spike rule for a signal ``x`` with transform ``φ`` (identity for the loss, ``log`` for the gradient norm), threshold
``z*`` and ratio ``ρ*``, given the window of accepted values (rejected values never enter it)::

    m = median(φ(window)),  MAD = median(|φ(window) − m|)
    s = max(1.4826·MAD, floor(m))          if MAD > 0
    s = max(1.2533·MeanAD, floor(m))       if MAD = 0,  MeanAD = mean(|φ(window) − m|)
    z = (φ(x) − m) / s
    spike  ⇔  n ≥ min_history  and  z > z*  and  x − φ⁻¹(m) > (ρ* − 1)·|φ⁻¹(m)|

The ratio condition kills false alarms when the MAD is tiny (a flat curve) and keeps the rule meaningful for a negative
median (unlearning losses), where ``x > ρ*·m`` would hold for almost any ``x``. 1.4826·MAD estimates the standard
deviation of Gaussian data. When more than half the window holds one value the MAD is 0 although the window has a
spread; the scale then falls back to the mean absolute deviation, ``√(π/2)·MeanAD ≈ 1.2533·MeanAD`` (also σ for
Gaussian data; the modified z-score of Iglewicz & Hoaglin, "How to Detect and Handle Outliers", 1993), so a window
that is mostly one value does not turn every other value into a z of hundreds. The floor keeps ``s > 0`` when all
values are equal (then only the ratio condition stands between a change and a spike).
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass


__all__ = [
    "GRAD_RULE",
    "LOSS_RULE",
    "MAD_TO_SIGMA",
    "MEANAD_TO_SIGMA",
    "LocalLevelFilter",
    "RobustWindow",
    "SpikeRule",
]

MAD_TO_SIGMA = 1.4826
MEANAD_TO_SIGMA = math.sqrt(math.pi / 2.0)  # σ / E|X − μ| for a Gaussian


class RobustWindow:
    """The last ``size`` accepted values of a signal (in the transformed space the caller chose).

    Args:
        size: capacity W; older values fall out.
        min_history: H, the number of values below which [`SpikeRule.test`] never flags.
    """

    def __init__(self, size: int = 128, min_history: int = 20):
        if size < 1 or min_history < 1 or min_history > size:
            raise ValueError(f"need 1 <= min_history <= size, got size={size}, min_history={min_history}.")
        self.size = int(size)
        self.min_history = int(min_history)
        self._values: deque[float] = deque(maxlen=self.size)

    def __len__(self) -> int:
        return len(self._values)

    def push(self, value: float) -> None:
        """Accept a finite value (non-finite values are refused: they must never enter the window)."""
        value = float(value)
        if not math.isfinite(value):
            raise ValueError(f"RobustWindow only accepts finite values, got {value}.")
        self._values.append(value)

    def values(self) -> list[float]:
        return list(self._values)

    def median(self) -> float:
        """Median of the window; NaN when empty."""
        return statistics.median(self._values) if self._values else math.nan

    def mad(self) -> float:
        """Median absolute deviation from the median; NaN when empty."""
        if not self._values:
            return math.nan
        m = statistics.median(self._values)
        return statistics.median(abs(v - m) for v in self._values)

    def mean_abs_deviation(self) -> float:
        """Mean absolute deviation from the median; NaN when empty."""
        if not self._values:
            return math.nan
        m = statistics.median(self._values)
        return statistics.fmean(abs(v - m) for v in self._values)

    def scale(self, floor: float) -> float:
        """Robust scale: ``max(1.4826·MAD, floor)``, or ``max(1.2533·MeanAD, floor)`` when the MAD is 0 (more than half
        the values equal); ``floor`` when empty."""
        mad = self.mad()
        if math.isnan(mad):
            return floor
        spread = MAD_TO_SIGMA * mad if mad > 0 else MEANAD_TO_SIGMA * self.mean_abs_deviation()
        return max(spread, floor)

    def z(self, value: float, floor: float) -> float:
        """One-sided robust z of ``value``: ``(value − median)/scale``; 0 for an empty window, ±inf for ±inf and
        NaN for NaN (no exception: the caller classifies non-finite inputs itself)."""
        if not self._values:
            return 0.0
        if math.isnan(value):
            return math.nan
        if math.isinf(value):
            return value
        return (value - self.median()) / self.scale(floor)

    def state(self) -> list[float]:
        """JSON-serialisable contents, oldest first."""
        return list(self._values)

    def load_state(self, values: Iterable[float]) -> None:
        self._values = deque((float(v) for v in values), maxlen=self.size)


@dataclass(frozen=True)
class SpikeRule:
    """The two-condition spike test (module docstring) for one signal.

    Args:
        z_threshold: z*; a spike needs ``z > z*``.
        ratio: ρ*; a spike also needs ``x − c > (ρ* − 1)·|c|`` with ``c = φ⁻¹(median)``, on the raw value.
        log: ``φ = log(x + eps)`` (multiplicative, heavy-tailed signals such as gradient norms) instead of identity.
        floor_rel, floor_abs: scale floor ``floor_rel·|m| + floor_abs`` in the transformed space.
        eps: the offset inside the log.
    """

    z_threshold: float
    ratio: float
    log: bool = False
    floor_rel: float = 0.0
    floor_abs: float = 0.0
    eps: float = 1e-12

    def transform(self, x: float) -> float:
        if not self.log:
            return float(x)
        return math.log(x + self.eps) if x + self.eps > 0 else -math.inf

    def inverse(self, y: float) -> float:
        return math.exp(y) - self.eps if self.log else y

    def floor(self, median: float) -> float:
        return self.floor_rel * abs(median) + self.floor_abs

    def z(self, window: RobustWindow, x: float) -> float:
        """Robust z of raw value ``x`` against ``window`` (which holds transformed values)."""
        if math.isnan(x):
            return math.nan
        m = window.median()
        return window.z(self.transform(x), self.floor(0.0 if math.isnan(m) else m))

    def test(self, window: RobustWindow, x: float) -> tuple[bool, float]:
        """``(is_spike, z)`` for raw value ``x``. Non-finite ``x`` is not a spike here (the guard classifies it as
        ``"nonfinite"`` before calling this); neither is anything while ``len(window) < window.min_history``."""
        z = self.z(window, x)
        if not math.isfinite(x) or len(window) < window.min_history:
            return False, z
        center = self.inverse(window.median())
        return bool(z > self.z_threshold and x - center > (self.ratio - 1.0) * abs(center)), z


# Defaults: loss noise is roughly additive (identity, floor 1% of the level); gradient norms are multiplicative and
# heavy-tailed (log space, floor 0.05 nats, ratio 5 on the raw norm, which bounds warm-up rises).
LOSS_RULE = SpikeRule(z_threshold=6.0, ratio=1.25, log=False, floor_rel=0.01, floor_abs=1e-6)
GRAD_RULE = SpikeRule(z_threshold=6.0, ratio=5.0, log=True, floor_rel=0.0, floor_abs=0.05)


class LocalLevelFilter:
    """Scalar local-level Kalman filter over a noisy measurement ``y_k`` (e.g. a held-out probe loss).

    Model: ``x_k = x_{k−1} + w``, ``w ~ N(0, q)``; ``y_k = x_k + v``, ``v ~ N(0, r)``. For each measurement:
    predict ``x̂⁻ = x̂``, ``P⁻ = P + q``; innovation ``ν = y − x̂⁻``, ``S = P⁻ + r``, normalised innovation squared
    ``NIS = ν²/S`` (χ²(1) under the model). ``y`` is *destabilising* when ``ν > 0`` and ``NIS > threshold``; it is
    then rejected (the state is left unchanged). Otherwise ``K = P⁻/S``, ``x̂ = x̂⁻ + Kν``, ``P = (1 − K)P⁻``.

    Noise from the data: ``r = (1.4826·MAD of first differences)²/2`` over the last ``history`` accepted
    measurements (a difference of two independent noises has twice the variance), floored at ``r_floor``;
    ``q = q_ratio·r``.
    The first ``n_init`` measurements initialise the level (their mean) and are always accepted.
    """

    def __init__(
        self,
        threshold: float = 10.83,
        history: int = 32,
        q_ratio: float = 0.01,
        n_init: int = 3,
        r_floor: float = 1e-8,
    ):
        self.threshold = float(threshold)
        self.history = int(history)
        self.q_ratio = float(q_ratio)
        self.n_init = int(n_init)
        self.r_floor = float(r_floor)
        self.accepted: deque[float] = deque(maxlen=self.history)
        self.level: float | None = None
        self.variance: float = 0.0

    def noise(self) -> tuple[float, float]:
        """``(q, r)`` from the accepted history."""
        values = list(self.accepted)
        diffs = [b - a for a, b in itertools.pairwise(values)]
        if diffs:
            m = statistics.median(diffs)
            mad = statistics.median(abs(d - m) for d in diffs)
            r = max((MAD_TO_SIGMA * mad) ** 2 / 2.0, self.r_floor)
        else:
            r = self.r_floor
        return self.q_ratio * r, r

    def update(self, y: float) -> tuple[bool, float]:
        """Feed one measurement; returns ``(destabilising, nis)``. Non-finite ``y`` is destabilising (NIS = inf)."""
        y = float(y)
        if not math.isfinite(y):
            return True, math.inf
        if self.level is None:
            self.accepted.append(y)
            if len(self.accepted) >= self.n_init:
                self.level = statistics.fmean(self.accepted)
                self.variance = self.noise()[1]
            return False, 0.0
        q, r = self.noise()
        prior = self.variance + q
        innovation = y - self.level
        s = prior + r
        nis = innovation * innovation / s
        if innovation > 0 and nis > self.threshold:
            return True, nis
        gain = prior / s
        self.level += gain * innovation
        self.variance = (1.0 - gain) * prior
        self.accepted.append(y)
        return False, nis

    def state(self) -> dict:
        return {"accepted": list(self.accepted), "level": self.level, "variance": self.variance}

    def load_state(self, state: dict) -> None:
        self.accepted = deque((float(v) for v in state.get("accepted", [])), maxlen=self.history)
        self.level = None if state.get("level") is None else float(state["level"])
        self.variance = float(state.get("variance", 0.0))
