"""hf_stable: stable post-training for Hugging Face Transformers and TRL.

```python
from hf_stable import StableSFTConfig, StableSFTTrainer
args = StableSFTConfig(output_dir="out", sft_objective="prob_power", objective_alpha=1.0)
trainer = StableSFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tokenizer)
trainer.train()
```

Exports are lazy: `import hf_stable` loads no torch, transformers or trl; the first use of a name imports its module.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ._peft_hook import install as _install_peft_hook
from ._version import __version__
from .registry import get_registry, list_methods


_install_peft_hook()  # saved MAP/sine adapters load correctly through stock PEFT (see _peft_hook)


_LAZY = {
    "StableSFTConfig": "hf_stable.trainers.sft",
    "StableSFTTrainer": "hf_stable.trainers.sft",
    "StableGRPOConfig": "hf_stable.trainers.grpo",
    "StableGRPOTrainer": "hf_stable.trainers.grpo",
    "UnlearningConfig": "hf_stable.trainers.unlearning",
    "UnlearningTrainer": "hf_stable.trainers.unlearning",
}

__all__ = ["__version__", "get_registry", "list_methods", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hf_stable' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


if TYPE_CHECKING:
    from .trainers.grpo import StableGRPOConfig, StableGRPOTrainer  # noqa: F401
    from .trainers.sft import StableSFTConfig, StableSFTTrainer  # noqa: F401
    from .trainers.unlearning import UnlearningConfig, UnlearningTrainer  # noqa: F401
