"""Stability callbacks for any transformers/TRL trainer: spike guard, component-wise clipping, no-gradient detection,
degenerate-GRPO warnings, and a fault injector to check them on your own setup.

```python
from trl import SFTTrainer
from hf_stable.callbacks import StabilityGuardCallback
trainer = SFTTrainer(model=model, args=args, train_dataset=ds)
StabilityGuardCallback.attach(trainer)        # plain Trainer, SFTTrainer, GRPOTrainer, DPOTrainer, ...
trainer.train()
```

``attach`` installs the step signals (loss and pre-clip gradient norm of each optimizer step,
`hf_stable.stability.signals`) and the metrics hook, then adds the callback. hf_stable trainers carry the signals as a
mixin. The decision logic is `hf_stable.stability.guard.GuardPolicy`; this package is the plumbing: all-reduce, skip,
snapshot, restore, cooldown, logging, state. Each family takes one frozen options class
(`hf_stable.stability.callback_configs`: `GuardConfig`, `ComponentClipConfig`, `DegenerateRunConfig`).

Where each callback acts in the transformers loop (per optimizer step): micro-batches → global clip (``max_grad_norm``)
→ ``on_pre_optimizer_step`` (guard decides, skips or rolls back; component clipping) → ``optimizer.step()`` →
``on_optimizer_step`` (learning rates put back) → scheduler → ``on_step_end``.

| module | holds |
|---|---|
| `guard` (+ `guard_extras`: probe, DeepSpeed, log lines) | `StabilityGuardCallback` |
| `clip` | `ComponentClipCallback` |
| `spam` | `StableSPAMCallback` (the Stable-SPAM optimizer, `hf_stable.stability.spam`) |
| `detectors` | `NoGradientCallback`, `GRPODegenerateRunCallback` |
| `faults` | `FaultInjectionCallback` |
| `attach` | `add_stability_callbacks` (what an hf_stable config asks for) |
| `_common` | distributed helpers, ``attach``, the self-restoring JSON state |

Docs: ``docs/stability.md`` (algorithm, metrics, DeepSpeed/FSDP limits, measured results).
"""

from ...stability.callback_configs import ComponentClipConfig, DegenerateRunConfig, GuardConfig, StableSPAMConfig
from ...stability.nograd import NoGradientError
from ._common import (  # noqa: F401 (the private names: `hf_stable.callbacks.monitors` builds on them)
    TrainingDivergedError,
    _Attachable,
    _backend,
    _SelfRestoring,
    _warn_once,
    _world_size,
)
from .attach import add_stability_callbacks
from .clip import ComponentClipCallback
from .detectors import GRPODegenerateRunCallback, NoGradientCallback
from .faults import FaultInjectionCallback
from .guard import StabilityGuardCallback
from .spam import StableSPAMCallback


__all__ = [
    "ComponentClipCallback",
    "ComponentClipConfig",
    "DegenerateRunConfig",
    "FaultInjectionCallback",
    "GRPODegenerateRunCallback",
    "GuardConfig",
    "NoGradientCallback",
    "NoGradientError",
    "StabilityGuardCallback",
    "StableSPAMCallback",
    "StableSPAMConfig",
    "TrainingDivergedError",
    "add_stability_callbacks",
]
