"""The RL testbed's chosen recipe: the LR and step count picked on the tuning seed by `experiments/grpo_rl_control.py`
(its rule and grid are recorded in that result). Every experiment on the testbed starts from `CONTROL`.

The warm start runs 2,400 SFT steps over 1,600 problems (not `Recipe`'s 1,200 steps over 800): at 1,200 steps two of
three control seeds fit only half of their own SFT rows (exact match 0.51) and GRPO did not raise their held-out
accuracy; at 2,400 steps over 800 problems every seed fit them (0.90-1.00) but the seeds split into warm starts that
memorised their rows (held-out 0.17-0.30) or sat at the ceiling (0.93), and GRPO gained only where held-out exact
match was in between (0.5-0.7). 1,600 problems were probed on seeds 1 and 3 (the memorising ones: held-out 0.58 and
0.60) and 2,000 problems gave 0.67-0.91 (too close to the ceiling), with no GRPO run, before the tuning seed reran.

Design v4 adds the demonstrator's systematic error (`sft_carry_error` 0.7: 70% of the SFT rows with a carry show the
sum with the carry dropped). Without it the warm starts' held-out accuracy was limited by what 1,600 rows can teach
a 90k-parameter model (0.58-0.89 across seeds), which GRPO did not raise (-0.017, 95% CI -0.079 to +0.044, seeds 0-4).
With it the warm start also prefers a wrong rule the verifier can correct: the setting RL with a verifier is for
(demonstrations that are imperfect in a consistent way). Probed on seeds 100 and 0 (held-out 0.54 -> 0.80 and
0.56 -> 0.83 in 800 steps at LR 1e-4) and, at the SFT LR of 3e-3, on control seeds 1 and 2: seed 2 went 0.50 ->
0.74, but seed 1's SFT did not converge (0.07 held-out, 0.25 on its SFT prompts; also with 3,000 problems, 4,000
steps or hidden size 128); at SFT LR 1e-3 seed 1 learns (0.56 held-out, 0.62 on its SFT prompts, both against the
true sums) and 6e-3 fails like 3e-3. So the warm start trains at 1e-3 and the tuning seed was rerun on it; seed 0,
seen while probing, is not a control seed.

Kept apart from `rl.py`: the values enter each run's cache key themselves, so a new choice keeps finished runs.
"""

from dataclasses import replace

from .rl import Recipe


CONTROL = replace(
    Recipe(), sft_problems=1600, sft_steps=2400, sft_lr=1e-3, sft_carry_error=0.7, rl_lr=1e-4, rl_steps=700
)
