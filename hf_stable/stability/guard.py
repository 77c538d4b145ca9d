"""The spike guard's decision logic as a pure state machine (no torch, no transformers).

[`GuardPolicy.decide`] takes the all-reduced signals of one optimizer step (step loss, pre-clip global grad norm, a
non-finite flag) and returns a [`Decision`]: accept the update, only log, skip it, roll back to a confirmed snapshot,
or stop/raise once the rollback budget is spent, plus the snapshot bookkeeping to carry out and the LR multiplier of
the cooldown. The callback (`hf_stable.callbacks.stability.StabilityGuardCallback`) executes the decision. Because the
inputs are reduced values and the state only ever absorbs reduced values, every rank holds the same state and takes
the same branch.

Per step ``t`` (1-based):

1. ``kind = "nonfinite"`` if the loss or the norm is NaN/Inf; else, if the gradient norm is exactly 0, the step is
   *idle* (below); else ``"loss"``/``"grad"`` by the spike rules of `hf_stable.stability.stats` (checked only once the
   windows hold ``min_history`` values); else healthy.
2. Healthy: both values enter their windows, ``consecutive = 0``; the pending candidate snapshot counts one more
   healthy step and is confirmed after ``confirm_steps`` of them; a new candidate is taken when none is pending, the
   windows are full enough and ``snapshot_every`` steps passed since the last one; the LR cooldown multiplier is
   applied.
3. Anomalous: ``anomalies += 1``, ``consecutive += 1``, a pending candidate is discarded (it may hold the damage).
   ``log``: nothing else. ``skip``: drop this update. ``skip_then_rollback``: skip while
   ``consecutive ≤ skips_before_rollback`` (and this is not the second non-finite step in a row), else roll back.
   Rollback: restore the newest confirmed snapshot and drop this update; if the previous rollback went to that same
   snapshot less than ``lr_cooldown_steps`` ago and an older one exists, the newest is dropped (it may be bad) and the
   older is used. ``consecutive = 0`` and the cooldown restarts. With no confirmed snapshot yet the guard skips. Once
   ``rollbacks > max_rollbacks``: restore, then ``on_exhausted`` ("stop", "raise", or "continue" = keep training and
   only log from then on, since skipping forever would freeze the run).

Idle steps (gradient norm exactly 0, e.g. a GRPO step whose groups all got equal rewards, the normal case with
sparse 0/1 rewards): the batch moved nothing, so its values say nothing about the scale of a real update. They are
not scored and enter neither window (``idle += 1``); otherwise they count as healthy (snapshots, cooldown). Letting
them in made the window of a sparse-reward run mostly ``log(0 + eps)``, with MAD 0, and every step that learned scored
z ≈ 570 and was skipped or rolled back.

Why skip first: a corrupted batch gives a spike *before* any damage, so dropping that one update is enough; a
destabilising update (an LR blow-up) shows on the following steps, on every batch, so the anomaly persists through the
skips and the guard rolls back (PaLM's restart-and-skip-batches recipe, arXiv 2204.02311 §5.1, done automatically).

LR cooldown after a rollback: for ``k = 0 … K−1`` updates, ``lr × (f + (1 − f)·k/K)`` with ``f = lr_cooldown_factor``,
``K = lr_cooldown_steps``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .stats import GRAD_RULE, LOSS_RULE, RobustWindow, SpikeRule


__all__ = ["ACTIONS", "ON_EXHAUSTED", "Decision", "GuardPolicy"]

ACTIONS = ("skip_then_rollback", "skip", "rollback", "log")
ON_EXHAUSTED = ("stop", "raise", "continue")


@dataclass
class Decision:
    """What to do at one optimizer step.

    ``kind``: None (healthy), "idle" (zero gradient, accepted unscored), "nonfinite", "loss", "grad" or "probe".
    ``action``: "accept" (healthy or idle), "log" (anomalous, update applied), "skip", "rollback", "stop" or "raise"
    (the last two after restoring ``restore_step``). ``ops``: snapshot operations in order among "discard" (the
    candidate), "drop_newest" (confirmed), "confirm" (the candidate) and "candidate" (take one now, before this
    update).
    """

    step: int
    kind: str | None
    action: str
    loss_z: float = math.nan
    grad_z: float = math.nan
    restore_step: int | None = None
    ops: list[str] = field(default_factory=list)
    lr_multiplier: float = 1.0
    reason: str = ""

    @property
    def anomalous(self) -> bool:
        return self.kind not in (None, "idle")

    @property
    def drops_update(self) -> bool:
        return self.action in ("skip", "rollback", "stop", "raise")


class GuardPolicy:
    """Guard state and decisions; see the module docstring. All state is JSON (``state()``/``load_state``)."""

    def __init__(
        self,
        *,
        loss_rule: SpikeRule | None = LOSS_RULE,
        grad_rule: SpikeRule | None = GRAD_RULE,
        window: int = 128,
        min_history: int = 20,
        action: str = "skip_then_rollback",
        skips_before_rollback: int = 1,
        snapshot_every: int = 50,
        confirm_steps: int = 2,
        snapshot_history: int = 1,
        lr_cooldown_factor: float = 0.25,
        lr_cooldown_steps: int = 50,
        max_rollbacks: int = 5,
        on_exhausted: str = "stop",
    ):
        if action not in ACTIONS:
            raise ValueError(f"`action`={action!r} is not valid. Allowed values: {', '.join(map(repr, ACTIONS))}.")
        if on_exhausted not in ON_EXHAUSTED:
            raise ValueError(
                f"`on_exhausted`={on_exhausted!r} is not valid. Allowed values: {', '.join(map(repr, ON_EXHAUSTED))}."
            )
        self.loss_rule, self.grad_rule = loss_rule, grad_rule
        self.min_history = int(min_history)
        self.action = action
        self.skips_before_rollback = int(skips_before_rollback)
        self.snapshot_every = int(snapshot_every)
        self.confirm_steps = int(confirm_steps)
        self.snapshot_history = int(snapshot_history)
        self.lr_cooldown_factor = float(lr_cooldown_factor)
        self.lr_cooldown_steps = int(lr_cooldown_steps)
        self.max_rollbacks = int(max_rollbacks)
        self.on_exhausted = on_exhausted
        self.loss_window = RobustWindow(window, min_history)
        self.grad_window = RobustWindow(window, min_history)
        self.accepted = 0
        self.idle = 0
        self.anomalies = 0
        self.skips = 0
        self.rollbacks = 0
        self.consecutive = 0
        self.prev_kind: str | None = None
        self.cooldown_left = 0
        self.last_rollback_step: int | None = None
        self.last_rollback_target: int | None = None
        self.exhausted = False
        self.loss_z = math.nan
        self.grad_z = math.nan
        self.lr_multiplier = 1.0
        self.candidate_step: int | None = None
        self.candidate_healthy = 0
        self.last_candidate_step: int | None = None
        self.confirmed_steps: list[int] = []

    @property
    def uses_snapshots(self) -> bool:
        return self.action in ("rollback", "skip_then_rollback")

    def degrade_for_post_step(self) -> None:
        """No skip possible (the update already happened, e.g. under DeepSpeed): skip_then_rollback → rollback,
        skip → log."""
        self.action = {"skip_then_rollback": "rollback", "skip": "log"}.get(self.action, self.action)

    # -- the decision -------------------------------------------------------------------------------------------
    def _classify(self, loss: float | None, grad_norm: float | None, nonfinite: bool) -> str | None:
        self.loss_z = self.grad_z = math.nan
        loss_spike = grad_spike = False
        if loss is not None and self.loss_rule is not None:
            loss_spike, self.loss_z = self.loss_rule.test(self.loss_window, loss)
        if grad_norm is not None and self.grad_rule is not None:
            grad_spike, self.grad_z = self.grad_rule.test(self.grad_window, grad_norm)
        nonfinite = nonfinite or any(v is not None and not math.isfinite(v) for v in (loss, grad_norm))
        if nonfinite:
            return "nonfinite"
        return "loss" if loss_spike else "grad" if grad_spike else None

    def peek_cooldown(self) -> float:
        """The LR multiplier of the next update, without consuming it."""
        if self.cooldown_left <= 0:
            return 1.0
        k = self.lr_cooldown_steps - self.cooldown_left
        return self.lr_cooldown_factor + (1.0 - self.lr_cooldown_factor) * k / self.lr_cooldown_steps

    def _cooldown(self) -> float:
        multiplier = self.peek_cooldown()
        self.cooldown_left = max(0, self.cooldown_left - 1)
        return multiplier

    def _accept(self, step: int, loss: float | None, grad_norm: float | None, decision: Decision) -> None:
        if decision.kind == "idle":
            self.idle += 1
        else:
            if loss is not None and self.loss_rule is not None:
                self.loss_window.push(self.loss_rule.transform(loss))
            if grad_norm is not None and self.grad_rule is not None:
                self.grad_window.push(self.grad_rule.transform(grad_norm))
        self.accepted += 1
        self.consecutive = 0
        self.prev_kind = None
        if not self.uses_snapshots:
            return
        if self.candidate_step is not None:
            self.candidate_healthy += 1
            if self.candidate_healthy >= self.confirm_steps:
                self._confirm(decision)
        due = self.last_candidate_step is None or step - self.last_candidate_step >= self.snapshot_every
        if self.candidate_step is None and self.accepted >= self.min_history and due:
            decision.ops.append("candidate")
            self.candidate_step, self.candidate_healthy, self.last_candidate_step = step, 0, step
            if self.confirm_steps == 0:
                self._confirm(decision)

    def _confirm(self, decision: Decision) -> None:
        decision.ops.append("confirm")
        self.confirmed_steps.append(self.candidate_step)
        self.candidate_step = None
        del self.confirmed_steps[: max(0, len(self.confirmed_steps) - self.snapshot_history)]

    @staticmethod
    def is_idle(loss: float | None, grad_norm: float | None, nonfinite: bool = False) -> bool:
        """A step with a finite loss and a gradient norm of exactly 0: nothing to score (module docstring)."""
        return grad_norm == 0.0 and not nonfinite and (loss is None or math.isfinite(loss))

    def decide(self, step: int, loss: float | None, grad_norm: float | None, nonfinite: bool = False) -> Decision:
        """Decide for optimizer step ``step`` from reduced values (``None`` = signal unavailable). An idle step gives
        ``Decision(kind="idle", action="accept")`` with NaN z-scores."""
        if self.is_idle(loss, grad_norm, nonfinite):
            self.loss_z = self.grad_z = math.nan
            decision = Decision(step=step, kind="idle", action="accept")
            self._accept(step, loss, grad_norm, decision)
            decision.lr_multiplier = self.lr_multiplier = self._cooldown()
            return decision
        kind = self._classify(loss, grad_norm, nonfinite)
        decision = Decision(step=step, kind=kind, action="accept", loss_z=self.loss_z, grad_z=self.grad_z)
        if kind is None:
            self._accept(step, loss, grad_norm, decision)
            decision.lr_multiplier = self.lr_multiplier = self._cooldown()
            return decision

        self.anomalies += 1
        self.consecutive += 1
        second_nonfinite = kind == "nonfinite" and self.prev_kind == "nonfinite"
        self.prev_kind = kind
        if self.candidate_step is not None:
            decision.ops.append("discard")
            self.candidate_step = None
            self.last_candidate_step = self.confirmed_steps[-1] if self.confirmed_steps else None

        if self.exhausted or self.action == "log":
            decision.action, decision.reason = "log", "exhausted" if self.exhausted else "action=log"
            decision.lr_multiplier = self.lr_multiplier = self._cooldown()
            return decision
        within_skips = self.consecutive <= self.skips_before_rollback and not second_nonfinite
        skip_allowed = self.action == "skip" or (self.action == "skip_then_rollback" and within_skips)
        if skip_allowed:
            decision.action = "skip"
            self.skips += 1
            return decision
        if not self.confirmed_steps:
            decision.action, decision.reason = "skip", "no confirmed snapshot yet"
            self.skips += 1
            return decision
        return self._rollback(step, decision)

    def probe_anomaly(self, step: int, reason: str = "") -> Decision:
        """A destabilising held-out probe measurement after update ``step``: the damage is already in the weights, so
        roll back (never skip); with no confirmed snapshot, or under ``action`` "skip"/"log", only report."""
        self.anomalies += 1
        decision = Decision(step=step, kind="probe", action="log", reason=reason)
        if self.candidate_step is not None:
            decision.ops.append("discard")
            self.candidate_step = None
            self.last_candidate_step = self.confirmed_steps[-1] if self.confirmed_steps else None
        if self.exhausted or not self.uses_snapshots or not self.confirmed_steps:
            decision.reason = f"{reason}; no rollback ({'exhausted' if self.exhausted else 'no confirmed snapshot'})"
            return decision
        return self._rollback(step, decision)

    def _rollback(self, step: int, decision: Decision) -> Decision:
        self.rollbacks += 1
        recent = self.last_rollback_step is not None and step - self.last_rollback_step <= self.lr_cooldown_steps
        if recent and self.last_rollback_target == self.confirmed_steps[-1] and len(self.confirmed_steps) > 1:
            decision.ops.append("drop_newest")
            self.confirmed_steps.pop()
        target = self.confirmed_steps[-1]
        decision.restore_step = target
        self.consecutive = 0
        self.prev_kind = None
        self.cooldown_left = self.lr_cooldown_steps
        self.last_rollback_step, self.last_rollback_target = step, target
        self.last_candidate_step = step  # the next candidate comes snapshot_every steps after the restored state
        if self.rollbacks > self.max_rollbacks:
            if self.on_exhausted == "continue":
                self.exhausted = True
                decision.action, decision.reason = "rollback", "rollback budget spent; only logging from now on"
            else:
                decision.action, decision.reason = self.on_exhausted, f"more than max_rollbacks={self.max_rollbacks}"
            return decision
        decision.action = "rollback"
        return decision

    # -- state --------------------------------------------------------------------------------------------------
    def fingerprint(self) -> float:
        """A number that differs when two ranks' states differ (compared across ranks as a safety net)."""
        return float(
            self.accepted
            + 17 * self.idle
            + 3 * self.anomalies
            + 5 * self.skips
            + 7 * self.rollbacks
            + 11 * self.consecutive
            + 13 * self.cooldown_left
            + sum(self.loss_window.values())
            + sum(self.grad_window.values())
        )

    _SCALARS = (
        "accepted",
        "idle",
        "anomalies",
        "skips",
        "rollbacks",
        "consecutive",
        "prev_kind",
        "cooldown_left",
        "last_rollback_step",
        "last_rollback_target",
        "exhausted",
        "candidate_healthy",
        "last_candidate_step",
        "lr_multiplier",
    )

    def state(self) -> dict:
        """JSON-serialisable state (the snapshots themselves are tensors: the caller saves them beside it)."""
        out = {k: getattr(self, k) for k in self._SCALARS}
        out.update(
            loss_window=self.loss_window.state(),
            grad_window=self.grad_window.state(),
            confirmed_steps=list(self.confirmed_steps),
            candidate_step=self.candidate_step,
            action=self.action,
        )
        return out

    def load_state(
        self, state: dict, confirmed_available: list[int] | None = None, candidate_available: bool = False
    ) -> None:
        """Restore ``state()``; ``confirmed_available`` lists the confirmed snapshots that still exist and
        ``candidate_available`` says whether the pending candidate does (saved with a checkpoint, they all do; an
        in-memory one that was not is lost, and the guard then takes a fresh snapshot at the next healthy step)."""
        for k in self._SCALARS:
            if k in state:
                setattr(self, k, state[k])
        self.loss_window.load_state(state.get("loss_window", []))
        self.grad_window.load_state(state.get("grad_window", []))
        self.confirmed_steps = list(confirmed_available or [])
        self.candidate_step = state.get("candidate_step") if candidate_available else None
        if self.candidate_step is None:
            self.candidate_healthy = 0
            if self.last_candidate_step is not None and not self.confirmed_steps:
                self.last_candidate_step = None
