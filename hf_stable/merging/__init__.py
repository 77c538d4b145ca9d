"""Model merging: a memory-bounded streaming engine over safetensors checkpoints (see `docs/merging.md`).

Public API (imported lazily, so `import hf_stable.merging` does not import torch):

* `MergeConfig` — a merge recipe (mergekit `models:`/`slices:` YAML superset), `MergeConfig.from_yaml(path_or_str)`.
* `merge(config, out_dir, *, memory_budget="2GB", dry_run=False, diagnose=False, progress=True, ...)` →
  `MergeResult(output_dir, per_tensor_stats, timings, bytes_read, bytes_written, peak_tracked_bytes, plan)`; the
  output folder holds the weights, config and tokenizer files, the recipe and the model card.
* `merge_tensors` / `merge_state_dicts` — in-memory merges (whole tensors resident); `get_merge_method`,
  `MERGE_METHODS` — the method registry; `fw_merge` — data-driven FW-Merging (arXiv 2503.12649).

Submodules, in the order a merge passes through them: `config` (the recipe; `settings` and `model_refs` its
parameter values and input models), `resolve` (local folder or Hub), `compat` (can these checkpoints be merged),
`plan` (per-tensor sources, parameters, passes and chunks; `plan_records` its records), `engine` with `execution`
(one run's buffers and arithmetic) and `ring` (the buffer ring and its I/O thread), `io` (header parsing, byte-range
reader, streaming writer), `card` (the model card), `hub` (push). The methods live in `methods` (registry); `gram`,
`quantile`, `rng`, `ties_ops` are their numerics; `reference` merges in memory; `diagnostics`; `fw`, `fw_local`,
`fw_step`, `fw_pool`, `fw_objectives` (FW-Merging).
"""

from __future__ import annotations

import importlib


_LAZY = {
    "MergeConfig": "hf_stable.merging.config",
    "merge": "hf_stable.merging.engine",
    "MergeResult": "hf_stable.merging.engine",
    "MergePlan": "hf_stable.merging.plan",
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
