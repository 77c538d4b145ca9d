"""Offline tiny-model kit and synthetic tasks with verifiers (tests, the demo, examples and experiments).

```python
from hf_stable.testing import build_tiny_model, arithmetic_dataset, arithmetic_reward
model, tokenizer = build_tiny_model(save_dir="tiny")          # nothing downloads
train = arithmetic_dataset(2000, seed=0)                     # prompt / completion / answer
```
"""

from .smollm2 import smollm2_folder
from .tasks import (
    arithmetic_dataset,
    arithmetic_preference_dataset,
    arithmetic_reward,
    arithmetic_splits,
    evaluate_completions,
    with_carry_errors,
)
from .tiny import CHAT_TEMPLATE, build_tiny_model, build_tiny_tokenizer


__all__ = [
    "CHAT_TEMPLATE",
    "arithmetic_dataset",
    "arithmetic_preference_dataset",
    "arithmetic_reward",
    "arithmetic_splits",
    "build_tiny_model",
    "build_tiny_tokenizer",
    "evaluate_completions",
    "smollm2_folder",
    "with_carry_errors",
]
