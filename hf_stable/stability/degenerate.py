"""Degenerate GRPO runs, read from TRL's logged metrics: each condition, what it means and which knob to turn.

[`DegenerateRunMonitor.observe`] takes one log dict (TRL's names: ``completions/clipped_ratio``,
``frac_reward_zero_std``, ``reward_std``, ``rewards/<fn>/std``, ``entropy``, ``kl``, ``loss``, ``grad_norm``) and
returns the messages to emit. A condition must hold for ``patience`` consecutive logs before its message is emitted;
the count then restarts, so each kind is emitted at most once per ``patience`` logs. A non-finite ``grad_norm`` is
reported on first sight (then at most once per ``patience`` logs).

Default thresholds follow the red flags of Axolotl's training-stability guide (``docs/training_stability.qmd``):
``frac_reward_zero_std`` 1.0 on every step, ``entropy`` < 0.01, ``kl`` > 2.0; for ``completions/clipped_ratio`` the
guide's red flag is > 0.8, and we warn at ≥ 0.99 (every completion truncated: no learning signal at all) — set
``clipped_ratio_min=0.8`` for the guide's value.

Pure Python.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


__all__ = ["DegenerateRunMonitor", "Finding"]

ON_POLICY_ZERO_LOSS_TYPES = ("grpo", "dr_grpo")


@dataclass
class Finding:
    level: str  # "warning" | "info"
    kind: str
    message: str


def _num(logs: dict, key: str) -> float | None:
    value = logs.get(key)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


class DegenerateRunMonitor:
    """Counters per condition; ``state()``/``load_state`` are JSON."""

    def __init__(
        self,
        *,
        patience: int = 3,
        zero_std_min: float = 0.99,
        clipped_ratio_min: float = 0.99,
        entropy_min: float = 0.01,
        kl_max: float = 2.0,
    ):
        self.patience = int(patience)
        self.zero_std_min = float(zero_std_min)
        self.clipped_ratio_min = float(clipped_ratio_min)
        self.entropy_min = float(entropy_min)
        self.kl_max = float(kl_max)
        self.counts: dict[str, int] = {}
        self.cooldown: dict[str, int] = {}
        self.emitted: dict[str, int] = {}
        self.zero_loss_explained = False

    # -- the conditions -----------------------------------------------------------------------------------------
    def _conditions(self, logs: dict, cfg: dict) -> dict[str, str]:
        """Conditions holding in this log: ``{kind: message}``."""
        found: dict[str, str] = {}
        clipped = _num(logs, "completions/clipped_ratio")
        if clipped is not None and clipped >= self.clipped_ratio_min:
            masked = cfg.get("mask_truncated_completions")
            effect = (
                "with mask_truncated_completions=True every token is masked, so loss and gradient are zero"
                if masked
                else "truncated completions rarely earn reward and never learn to stop"
            )
            found["truncated"] = (
                f"completions/clipped_ratio={clipped:.3g}: almost every completion hits max_completion_length="
                f"{cfg.get('max_completion_length')}; {effect}. Raise `max_completion_length`, or check the chat "
                "template and the EOS token (the model may never emit it)."
            )
        zero_std = _num(logs, "frac_reward_zero_std")
        if zero_std is not None and zero_std >= self.zero_std_min:
            found["zero_std"] = (
                f"frac_reward_zero_std={zero_std:.3g}: in (almost) every group all {cfg.get('num_generations')} "
                "completions got the same reward, so the group-centred advantages are 0 and the only gradient left is "
                "the KL/entropy term. The task is too easy or too hard for the model, the reward function is constant "
                "or too coarse, or `num_generations` is too small: make the reward graded, change the prompts' "
                "difficulty, or raise `num_generations`."
            )
        per_fn = [_num(logs, k) for k in logs if k.startswith("rewards/") and k.endswith("/std")]
        stds = [_num(logs, "reward_std"), *per_fn]
        stds = [s for s in stds if s is not None]
        if stds and all(s == 0.0 for s in stds):
            found["constant_reward"] = (
                "reward_std=0 and every rewards/<fn>/std=0: the reward functions returned one constant for the whole "
                "batch. Check the reward functions (a parsing failure often returns the same default) and the dataset "
                "columns they read."
            )
        entropy = _num(logs, "entropy")
        if entropy is not None and entropy < self.entropy_min:
            found["entropy_collapse"] = (
                f"entropy={entropy:.3g} < {self.entropy_min}: the policy is collapsing onto one completion (mode "
                "collapse), so groups stop differing. Raise `temperature`, lower `learning_rate`, add a KL term "
                "(`beta` > 0) or an entropy bonus (`entropy_coef`)."
            )
        kl = _num(logs, "kl")
        if kl is not None and kl > self.kl_max:
            found["kl_divergence"] = (
                f"kl={kl:.3g} > {self.kl_max}: the policy has moved far from the reference model. Lower "
                "`learning_rate`, raise `beta`, or tighten the clip (`epsilon`)."
            )
        loss, grad_norm = _num(logs, "loss"), _num(logs, "grad_norm")
        if loss == 0.0 and grad_norm == 0.0:
            why = sorted(k for k in found if k != "kl_divergence")
            because = f" (also reported: {', '.join(why)})" if why else ""
            found["dead_run"] = (
                f"loss=0 and grad_norm=0: no learning signal reaches the weights{because}. Look at "
                "frac_reward_zero_std (equal rewards in every group), completions/clipped_ratio (all completions "
                "truncated and masked) and the reward functions."
            )
        if grad_norm is not None and not math.isfinite(grad_norm):
            found["nonfinite_grad"] = (
                f"grad_norm={grad_norm}: the update was computed from non-finite gradients and the weights may now be "
                "NaN. `StabilityGuardCallback.attach(trainer)` skips such updates and rolls back to a good snapshot."
            )
        return found

    def _zero_loss_expected(self, logs: dict, cfg: dict) -> str | None:
        loss, grad_norm = _num(logs, "loss"), _num(logs, "grad_norm")
        iterations = cfg.get("num_iterations") or 1
        # TRL's rule (`GRPOTrainer._generate_and_score_completions`): a generation batch that is not used up within
        # one optimizer step keeps old log-probs, and the ratio then differs from 1 after the first step
        generate_every = (cfg.get("steps_per_generation") or 1) * iterations
        on_policy = iterations == 1 and (cfg.get("gradient_accumulation_steps") or 1) % generate_every == 0
        trl_loss = cfg.get("loss_mode") in (None, "ppo")  # hf_stable's other loss modes replace TRL's loss
        if (
            loss == 0.0
            and grad_norm is not None
            and grad_norm > 0
            and on_policy
            and trl_loss
            and not cfg.get("beta")
            and cfg.get("loss_type") in ON_POLICY_ZERO_LOSS_TYPES
        ):
            return (
                f"loss=0 with grad_norm={grad_norm:.3g} is expected, not a bug: on-policy (num_iterations=1) the "
                f"probability ratio is 1, so with loss_type={cfg.get('loss_type')!r} each sequence contributes −A and "
                "group-centred advantages sum to 0, while the gradient −Σ A ∇log π is not zero."
            )
        return None

    # -- driver -------------------------------------------------------------------------------------------------
    def observe(self, logs: dict, cfg: dict) -> list[Finding]:
        """Findings to emit for one log. ``cfg``: the run's GRPO settings (``loss_type``, ``num_iterations``, ``beta``,
        ``num_generations``, ``max_completion_length``, ``mask_truncated_completions``, ``steps_per_generation``,
        ``gradient_accumulation_steps``, and hf_stable's ``loss_mode`` — absent or ``None`` on TRL's config)."""
        if "loss" not in logs and "grad_norm" not in logs and "frac_reward_zero_std" not in logs:
            return []  # not a training log (e.g. the end-of-training summary)
        out: list[Finding] = []
        explanation = None if self.zero_loss_explained else self._zero_loss_expected(logs, cfg)
        if explanation:
            self.zero_loss_explained = True
            out.append(Finding("info", "zero_loss_expected", explanation))
        found = self._conditions(logs, cfg)
        for kind in list(self.counts):
            if kind not in found:
                self.counts[kind] = 0
        for kind in list(self.cooldown):
            self.cooldown[kind] = max(0, self.cooldown[kind] - 1)
        for kind, message in found.items():
            self.counts[kind] = self.counts.get(kind, 0) + 1
            needed = 1 if kind == "nonfinite_grad" else self.patience
            if self.counts[kind] >= needed and self.cooldown.get(kind, 0) == 0:
                runs = f" for {self.counts[kind]} logs in a row" if needed > 1 else ""
                out.append(Finding("warning", kind, f"GRPO degenerate run{runs}: {message}"))
                self.emitted[kind] = self.emitted.get(kind, 0) + 1
                self.counts[kind] = 0
                self.cooldown[kind] = self.patience if needed == 1 else 0
        return out

    def state(self) -> dict:
        return {
            "counts": dict(self.counts),
            "cooldown": dict(self.cooldown),
            "emitted": dict(self.emitted),
            "zero_loss_explained": self.zero_loss_explained,
        }

    def load_state(self, state: dict) -> None:
        self.counts = {k: int(v) for k, v in state.get("counts", {}).items()}
        self.cooldown = {k: int(v) for k, v in state.get("cooldown", {}).items()}
        self.emitted = {k: int(v) for k, v in state.get("emitted", {}).items()}
        self.zero_loss_explained = bool(state.get("zero_loss_explained", False))
