"""The records of a merge plan: `MergePlan` (the whole merge: inputs, the engine's buffer sizes, one `TensorPlan` per
output tensor), `TensorPlan` (one output tensor: sources, method, parameters, passes, chunks, planned I/O) and
`Source`, with the buffer constants they default to. `plan.build_plan` fills them in from the checkpoints' headers;
the memory rules are in `plan`'s module docstring.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .io.header import ModelCheckpoint


RING_SLOTS = 3  # one chunk being read, one being combined, one being written
MAX_CHUNK_ELEMS = 1 << 20  # elements per chunk: 4 MiB of fp32 per input
PIECE_ELEMS = 1 << 18  # elements combined at a time: 1 MiB of fp32 per buffer, cache-resident; fewer calls
GRAM_BLOCK = 1 << 17  # elements per fp64 Gram block (hf_stable.merging.gram.GRAM_CHUNK: its cache-sized block)
RESIDENT_CAP = 192 * 2**20  # ring + scratch + Gram staging + raw cache never exceed this, whatever the budget


def _fields(record, *names: str) -> dict[str, Any]:
    """``{name: record.<name>}`` in the order given: the JSON entries of a plan that are its attributes unchanged."""
    return {name: getattr(record, name) for name in names}


@dataclass
class Source:
    """One input of an output tensor: the model (its label) and the tensor's name in that model."""

    label: str
    name: str


@dataclass
class TensorPlan:
    """One output tensor.

    Attributes:
        name, shape: the output tensor.
        in_dtype: stored dtype of the first input (safetensors string); `out_dtype`: what is written.
        compute_dtype: the dtype the merge's arithmetic is rounded to (`compute_dtype_of`): the recipe's `dtype`,
            else the inputs' common dtype, as mergekit; `F32` with `fp32_arithmetic`.
        action: `"merge"` (the recipe's method), `"linear"` (matched `filter_exclude`) or `"copy"` (non-float).
        kind: `"gram"`, `"elementwise"` or `"copy"`. `space`: `"weights"` or `"task_vector"` (base subtracted).
        params: the method's resolved parameters; `weights`: per-model weights (`None` → 1 each).
        sources: the inputs, then the base for task vectors (the reference for copies).
        passes: data passes before the combine pass (`gram`, `kth_high`, `kth_low`, `sums`).
        ranks: per model the ranks whose k-th largest score the method needs (elementwise), or None.
        row_len: elements of a logical row (row-local methods see whole rows; a vector is one row).
        chunks: row ranges; `cached`: the inputs stay resident across passes (read once).
        direct: the method's `mergekit_merge` runs at the combine (mergekit's own arithmetic): on the whole tensor
            when it is one chunk, on each chunk's rows for a per-row form; never with `fp32_arithmetic`.
        mergekit_order: mergekit's order of operations where a method has one (`rounded_combine`); False with
            `fp32_arithmetic` (hf_stable's own arithmetic).
        read_bytes, write_bytes: planned I/O for this tensor.
    """

    name: str
    shape: tuple[int, ...]
    in_dtype: str
    out_dtype: str
    action: str
    kind: str
    space: str = "weights"
    method: Any = None
    params: dict[str, Any] = field(default_factory=dict)
    weights: list[float] | None = None
    sources: list[Source] = field(default_factory=list)
    needs_gram: bool = False
    passes: tuple[str, ...] = ()
    ranks: list[tuple[int, ...] | None] | None = None
    row_local: bool = False
    row_len: int = 1
    row_numel: int = 1
    chunks: list[tuple[int, int]] = field(default_factory=list)
    cached: bool = False
    read_bytes: int = 0
    write_bytes: int = 0
    source_bytes: int = 0
    compute_dtype: str = "F32"
    direct: bool = False
    mergekit_order: bool = True

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def n_inputs(self) -> int:
        return len(self.sources) - (1 if self.space == "task_vector" else 0)

    @property
    def tiles(self) -> list[tuple[int, int]]:
        return self.chunks

    @property
    def two_pass(self) -> bool:
        return bool(self.passes)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "shape": list(self.shape),
            **_fields(self, "in_dtype", "out_dtype", "compute_dtype", "action", "kind", "space"),
            "method": getattr(self.method, "name", None),
            "params": dict(self.params),
            "weights": self.weights,
            "sources": [(s.label, s.name) for s in self.sources],
            "passes": list(self.passes),
            "chunks": len(self.chunks),
            **_fields(self, "cached", "direct", "read_bytes", "write_bytes"),
        }


@dataclass
class MergePlan:
    """The whole merge: inputs, the engine's buffers and one `TensorPlan` per output tensor (in write order)."""

    method: str
    inputs: list[str]
    input_paths: list[str]
    base: str | None
    base_path: str | None
    reference: str
    budget: int
    max_shard_size: int
    tensors: list[TensorPlan]
    chunk_elems: int = MAX_CHUNK_ELEMS
    piece_elems: int = PIECE_ELEMS
    gram_block: int = GRAM_BLOCK
    ring_bytes: int = 0
    scratch_bytes: int = 0
    staging_bytes: int = 0
    cache_bytes: int = 0
    slot_in_bytes: int = 0
    slot_out_bytes: int = 0
    max_inputs: int = 1
    config_overrides: dict[str, Any] = field(default_factory=dict)
    dropped: dict[str, str] = field(default_factory=dict)
    checkpoints: dict[str, ModelCheckpoint] = field(default_factory=dict, repr=False)

    @property
    def n_chunks(self) -> int:
        return sum(len(t.chunks) for t in self.tensors)

    n_tiles = n_chunks

    @property
    def bytes_to_read(self) -> int:
        return sum(t.read_bytes for t in self.tensors)

    @property
    def bytes_to_write(self) -> int:
        return sum(t.write_bytes for t in self.tensors)

    @property
    def n_two_pass(self) -> int:
        return sum(t.two_pass for t in self.tensors)

    @property
    def allocated_bytes(self) -> int:
        """Bytes of the engine's preallocated buffers: ring, scratch, Gram staging, raw cache (≤ the budget)."""
        return self.ring_bytes + self.scratch_bytes + self.staging_bytes + self.cache_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "inputs": list(self.inputs),
            **_fields(self, "base", "reference"),
            "memory_budget": self.budget,
            "chunk_elems": self.chunk_elems,
            "buffers": {
                "ring": self.ring_bytes,
                "scratch": self.scratch_bytes,
                "gram_staging": self.staging_bytes,
                "raw_cache": self.cache_bytes,
            },
            "max_shard_size": self.max_shard_size,
            "n_tensors": len(self.tensors),
            "n_chunks": self.n_chunks,
            "n_multi_pass": self.n_two_pass,
            **_fields(self, "bytes_to_read", "bytes_to_write"),
            "dropped": dict(self.dropped),
            "tensors": [t.to_dict() for t in self.tensors],
        }

    def summary(self) -> str:
        """Human-readable plan (what `hf-stable merge --dry-run` prints)."""
        gib, mib = 2**30, 2**20
        kinds: dict[str, int] = {}
        for t in self.tensors:
            kinds[t.action] = kinds.get(t.action, 0) + 1
        lines = [
            f"merge_method: {self.method}",
            f"inputs ({len(self.inputs)}): " + ", ".join(self.inputs),
            f"base: {self.base or '-'}    reference (order, config): {self.reference}",
            f"tensors: {len(self.tensors)} ({', '.join(f'{k} {v}' for k, v in kinds.items())}); "
            f"chunks: {self.n_chunks}; multi-pass tensors: {self.n_two_pass}",
            f"memory: budget {self.budget / gib:.3f} GiB; buffers {self.allocated_bytes / mib:.1f} MiB (ring "
            f"{self.ring_bytes / mib:.1f}, scratch {self.scratch_bytes / mib:.1f}, Gram staging "
            f"{self.staging_bytes / mib:.1f}, raw cache {self.cache_bytes / mib:.1f}); "
            f"chunk {self.chunk_elems} elements",
            f"bytes to read: {self.bytes_to_read / gib:.3f} GiB; bytes to write: {self.bytes_to_write / gib:.3f} GiB",
        ]
        if self.dropped:
            lines.append("dropped: " + "; ".join(f"{k} ({v})" for k, v in self.dropped.items()))
        width = max((len(t.name) for t in self.tensors), default=10)
        for t in self.tensors:
            lines.append(
                f"  {t.name:<{width}}  {list(t.shape)!s:<14} {t.in_dtype:>4}->{t.out_dtype:<4} {t.action:<6} "
                f"{t.kind:<11} chunks={len(t.chunks):<4} passes={1 + len(t.passes)}"
                + (f" ({', '.join(t.passes)}{', cached' if t.cached else ''})" if t.passes else "")
            )
        return "\n".join(lines)
