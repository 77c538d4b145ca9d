"""Pure statistics, matrix functions, snapshots and decision logic shared by the stability callbacks.

Nothing here imports transformers or trl (only torch and safetensors), nor anything above this layer: the callbacks
in `hf_stable.callbacks.stability` and `hf_stable.callbacks.monitors` are the plumbing around these functions.

| module | holds |
|---|---|
| `stats` | `RobustWindow` (median/MAD), `SpikeRule` (two-condition spike test), `LocalLevelFilter` (innovation) |
| `guard` | `GuardPolicy`: the guard's per-step decision (accept / log / skip / rollback / stop) as a state machine |
| `snapshot` | `take_snapshot` / `restore_snapshot` / `SnapshotStore` (cpu or disk, candidate and confirmed slots) |
| `update` | `drop_update` (a true skip: `p.grad = None`), `force_scaler_skip` (fp16), `scale_lr` |
| `signals` | `StepSignals`, `StabilitySignalsMixin`, `install_signals` (loss and pre-clip grad norm of each step) |
| `clip` | component-wise clipping: parameter groups, group norms, fixed and AdaGC coefficients |
| `nograd` | `NoGradientError`, foreign-forward detection (`own_forward`), `OwnForwardMixin` for SFT trainers |
| `options` | `option`, `Options`, `config_fields`: typed options declared once, generating config fields |
| `callback_configs` | `GuardConfig`, `ComponentClipConfig`, `DegenerateRunConfig`: the callback families' options |
| `config` | the stability fields of the hf_stable configs (`StabilityConfigMixin`, `GRPOStabilityConfigMixin`) |
| `degenerate` | `DegenerateRunMonitor`: degenerate GRPO runs from TRL's metrics |
| `matrix` | stable rank, power iteration, msign (SVD / Newton–Schulz), the MSign correction |
| `drift` | pairwise distances, Spearman, RDM stability, linear CKA |
| `reg` | the experimental REG optimizer (row-and-column scaled momentum) |
| `spam` | the Stable-SPAM optimizer (spike clipping, norm rescaling, moment reset around AdamW) |
"""

from .drift import linear_cka, pairwise_distances, rdm_stability, spearman
from .guard import Decision, GuardPolicy
from .matrix import msign, msign_correction, power_iteration, spectral_norm, stable_rank
from .nograd import NoGradientError
from .reg import REG
from .signals import StabilitySignalsMixin, StepSignals, install_signals
from .snapshot import Snapshot, SnapshotStore, restore_snapshot, take_snapshot
from .spam import StableSPAM
from .stats import GRAD_RULE, LOSS_RULE, LocalLevelFilter, RobustWindow, SpikeRule


__all__ = [
    "GRAD_RULE",
    "LOSS_RULE",
    "REG",
    "Decision",
    "GuardPolicy",
    "LocalLevelFilter",
    "NoGradientError",
    "RobustWindow",
    "Snapshot",
    "SnapshotStore",
    "SpikeRule",
    "StabilitySignalsMixin",
    "StableSPAM",
    "StepSignals",
    "install_signals",
    "linear_cka",
    "msign",
    "msign_correction",
    "pairwise_distances",
    "power_iteration",
    "rdm_stability",
    "restore_snapshot",
    "spearman",
    "spectral_norm",
    "stable_rank",
    "take_snapshot",
]
