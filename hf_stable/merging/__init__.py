"""Model merging: a memory-bounded streaming engine over safetensors checkpoints (see `docs/merging.md`).

Public API (imported lazily, so `import hf_stable.merging` does not import torch):

* `MergeConfig` — a merge recipe (mergekit `models:` YAML superset), `MergeConfig.from_yaml(path_or_str)`.
* `merge(config, out_dir, *, memory_budget="2GB", dry_run=False, diagnose=False, progress=True, ...)` →
  `MergeResult(output_dir, per_tensor_stats, timings, bytes_read, bytes_written, peak_tracked_bytes, plan)`.
* `merge_tensors` / `merge_state_dicts` — in-memory merges (whole tensors resident); `get_merge_method`,
  `MERGE_METHODS` — the method registry; `fw_merge` — data-driven FW-Merging (spec §5).

Submodules: `io` (header parsing, byte-range reader, streaming writer), `plan` (compatibility checks, tiling),
`methods` (the merge-method registry), `engine`/`pipeline`/`merge_plan` (the streaming engine), `reference`
(in-memory merges), `gram`, `quantile`, `diagnostics`.
"""

from __future__ import annotations

import importlib


_LAZY = {
    "MergeConfig": "hf_stable.merging.config",
    "merge": "hf_stable.merging.engine",
    "MergeResult": "hf_stable.merging.engine",
    "MergePlan": "hf_stable.merging.merge_plan",
    "merge_tensors": "hf_stable.merging.reference",
    "merge_state_dicts": "hf_stable.merging.reference",
    "get_merge_method": "hf_stable.merging.methods",
    "MERGE_METHODS": "hf_stable.merging.methods",
    "fw_merge": "hf_stable.merging.fw",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hf_stable.merging' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
