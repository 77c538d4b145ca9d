"""What a merge will do, decided from headers only: per-tensor method, parameters, tiles and passes (spec §8.2).

`build_plan(config, budget)` opens every input's headers (`ModelCheckpoint.open`), checks compatibility
(`plan.check_compatible`), resolves each tensor's parameters (`MergeConfig.resolve_params`, mergekit semantics),
validates them against the method, and cuts tensors into row tiles so that everything in flight fits the budget
(`bytes_per_element`). The result is also what `merge(..., dry_run=True)` returns.

Pass plans (§8.2 step 6):

* gram kind, whole tensor in one tile → one read; Gram, solve and combine in memory;
* gram kind, several tiles, coefficients need the Gram → two reads: pass 1 accumulates the fp64 Gram over
  tiles, a tiny N×N solve, pass 2 combines;
* gram kind without a Gram (linear, task arithmetic, WSM) → one read at any tiling;
* elementwise kind → magnitude thresholds over the whole tensor (`torch.topk` when it is one tile, else the exact
  streamed `quantile.kth_largest_abs`, which re-reads model i and the base twice), then one combine read;
* non-float tensors → copied from the reference model (after `plan.check_equal_nonfloat`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .config import DTYPE_NAMES, MergeConfig, ModelRef, layer_index, resolve_model_path
from .io.header import DTYPE_ITEMSIZE, ModelCheckpoint, TensorInfo
from .pipeline import QUEUE_DEPTH


# Tile sets alive at once per stage (see `pipeline` module docstring): one being filled/drained, `QUEUE_DEPTH`
# queued, one held by compute.
SETS_IN_FLIGHT = QUEUE_DEPTH + 2
# fp32 temporaries of an elementwise combine, in units of N × tile × 4 bytes (TIES keeps v, |v|-masks, signs,
# weighted values and the disjoint sum alive together); also covers topk/quantile scratch of one model.
ELEMENTWISE_WORK = 4


def _label_models(refs: list[ModelRef]) -> list[str]:
    labels, seen = [], {}
    for ref in refs:
        label = ref.spec
        if label in seen:
            seen[label] += 1
            label = f"{label}#{seen[label]}"
        else:
            seen[label] = 0
        labels.append(label)
    return labels


@dataclass
class TensorPlan:
    """One output tensor.

    Attributes:
        name, shape: the output tensor.
        in_dtype: stored dtype of the first input (safetensors string); `out_dtype`: what is written.
        action: `"merge"` (the recipe's method), `"linear"` (matched `filter_exclude`) or `"copy"` (non-float).
        kind: `"gram"`, `"elementwise"` or `"copy"`. `space`: `"weights"` or `"task_vector"` (base subtracted).
        params: the method's resolved parameters; `weights`: per-model weights (`None` → method default 1).
        needs_gram: whether coefficients need the Gram matrix. `thresholds`: `None`, `"topk"` or `"stream"`.
        tiles: row ranges. `passes`: full reads of the inputs (2 for the two-pass Gram).
        sources: labels read per tile (inputs, then the base for task vectors; the reference for copies).
        read_bytes, write_bytes: planned I/O for this tensor (threshold passes included in `read_bytes`).
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
    needs_gram: bool = False
    densities: tuple[float, ...] | None = None
    thresholds: str | None = None
    tiles: list[tuple[int, int]] = field(default_factory=list)
    passes: int = 1
    sources: list[str] = field(default_factory=list)
    row_numel: int = 1
    read_bytes: int = 0
    write_bytes: int = 0

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def two_pass(self) -> bool:
        return self.passes == 2

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "shape": list(self.shape),
            "in_dtype": self.in_dtype,
            "out_dtype": self.out_dtype,
            "action": self.action,
            "kind": self.kind,
            "space": self.space,
            "method": getattr(self.method, "name", None),
            "params": {k: v for k, v in self.params.items()},
            "weights": self.weights,
            "thresholds": self.thresholds,
            "tiles": len(self.tiles),
            "passes": self.passes,
            "read_bytes": self.read_bytes,
            "write_bytes": self.write_bytes,
        }


@dataclass
class MergePlan:
    """The whole merge: inputs, budget accounting and one `TensorPlan` per output tensor (in write order)."""

    method: str
    inputs: list[str]
    input_paths: list[str]
    base: str | None
    base_path: str | None
    reference: str
    budget: int
    bytes_per_element: int
    max_shard_size: int
    tensors: list[TensorPlan]
    dropped: dict[str, str] = field(default_factory=dict)
    checkpoints: dict[str, ModelCheckpoint] = field(default_factory=dict, repr=False)

    @property
    def n_tiles(self) -> int:
        return sum(len(t.tiles) for t in self.tensors)

    @property
    def bytes_to_read(self) -> int:
        return sum(t.read_bytes for t in self.tensors)

    @property
    def bytes_to_write(self) -> int:
        return sum(t.write_bytes for t in self.tensors)

    @property
    def n_two_pass(self) -> int:
        return sum(t.two_pass for t in self.tensors)

    def to_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "inputs": list(self.inputs),
            "base": self.base,
            "reference": self.reference,
            "memory_budget": self.budget,
            "bytes_per_element": self.bytes_per_element,
            "max_shard_size": self.max_shard_size,
            "n_tensors": len(self.tensors),
            "n_tiles": self.n_tiles,
            "n_two_pass": self.n_two_pass,
            "bytes_to_read": self.bytes_to_read,
            "bytes_to_write": self.bytes_to_write,
            "dropped": dict(self.dropped),
            "tensors": [t.to_dict() for t in self.tensors],
        }

    def summary(self) -> str:
        """Human-readable plan (what `hf-stable merge --dry-run` prints)."""
        gib = 2**30
        kinds: dict[str, int] = {}
        for t in self.tensors:
            kinds[t.action] = kinds.get(t.action, 0) + 1
        lines = [
            f"merge_method: {self.method}",
            f"inputs ({len(self.inputs)}): " + ", ".join(self.inputs),
            f"base: {self.base or '-'}    reference (order, config): {self.reference}",
            f"tensors: {len(self.tensors)} ({', '.join(f'{k} {v}' for k, v in kinds.items())}); "
            f"tiles: {self.n_tiles}; two-pass tensors: {self.n_two_pass}",
            f"memory budget: {self.budget / gib:.3f} GiB ({self.bytes_per_element} bytes per tile element in flight)",
            f"bytes to read: {self.bytes_to_read / gib:.3f} GiB; bytes to write: {self.bytes_to_write / gib:.3f} GiB",
        ]
        if self.dropped:
            lines.append("dropped: " + "; ".join(f"{k} ({v})" for k, v in self.dropped.items()))
        width = max((len(t.name) for t in self.tensors), default=10)
        for t in self.tensors:
            lines.append(
                f"  {t.name:<{width}}  {list(t.shape)!s:<14} {t.in_dtype:>4}->{t.out_dtype:<4} {t.action:<6} "
                f"{t.kind:<11} tiles={len(t.tiles):<4} passes={t.passes}"
                + (f" thresholds={t.thresholds}" if t.thresholds else "")
            )
        return "\n".join(lines)


def bytes_per_element(n_sources: int, in_itemsize: int, out_itemsize: int, work: int) -> int:
    """Worst-case tracked bytes per element of a tile, everything in flight (see `pipeline` docstring):

      SETS_IN_FLIGHT × n_sources × in_itemsize      raw input tiles (reader, queue, compute)
    + work                                          compute working set per element (fp32/fp64)
    + SETS_IN_FLIGHT × out_itemsize                 output tiles (compute, queue, writer)
    """
    return SETS_IN_FLIGHT * n_sources * in_itemsize + work + SETS_IN_FLIGHT * out_itemsize


def quantile_chunk_work(itemsize: int) -> int:
    """Bytes per element of one streamed-quantile chunk: model i and base raw + fp32, |v|, bit/index scratch."""
    return 2 * itemsize + 48


def compute_work(
    kind: str, n_inputs: int, n_sources: int, *, gram: bool, diagnose: bool, itemsize: int, stream: bool = True
) -> int:
    """Compute-stage bytes per tile element: fp32 copies of the sources, method temporaries, fp64 Gram operands.

    `stream=True` adds the streamed-quantile chunk an elementwise tensor may read while its first tile is held
    (the planner's bound); the engine charges that chunk separately when it actually reads it (`stream=False`).
    """
    work = n_sources * 4 + 8  # fp32 sources; output and one product temporary
    if kind == "gram" and gram:
        work += n_inputs * 8  # fp64 copy of the (N, n) tile for the Gram GEMM
    if kind == "elementwise":
        work += ELEMENTWISE_WORK * n_inputs * 4
        if stream:
            work += quantile_chunk_work(itemsize)
    if diagnose:
        work += n_inputs * 8 + 8  # fp64 inputs and output for the diagnostic Gram/cross products
    return work


def _out_dtype(config: MergeConfig, first_input_dtype: str) -> str:
    name = config.out_dtype or config.dtype
    return DTYPE_NAMES[name] if name else first_input_dtype


def open_checkpoint(path: str, label: str, allow_pickle: bool) -> ModelCheckpoint:
    try:
        return ModelCheckpoint.open(path, allow_pickle=allow_pickle)
    except ValueError as err:
        if not allow_pickle and "pickle" in str(err).lower():
            raise ValueError(
                f"model {label!r}: {err} (CLI: --allow-pickle; recipe: allow_pickle: true; merge(allow_pickle=True))"
            ) from None
        raise


def build_plan(
    config: MergeConfig,
    budget: int,
    *,
    allow_pickle: bool = False,
    diagnose: bool = False,
    max_shard_size: int | None = None,
) -> MergePlan:
    """Plan a merge from headers (no tensor data read). Raises `ValueError` for every recipe/model problem."""
    from . import plan as planner
    from .methods import get_merge_method
    from .methods.base import gather_params

    method = config.validate()  # unknown method, bad global parameters, a missing base model: before any I/O
    global0 = method.resolve(config.resolve_params("", None, None, None))
    has_base = config.base_model is not None
    space = method.space(global0, has_base)
    uses_base = space == "task_vector"
    input_refs = config.input_models(uses_base=uses_base)
    if not input_refs:
        raise ValueError("no input model left after removing base_model from models")
    labels = _label_models(input_refs)
    paths = [resolve_model_path(r) for r in input_refs]
    base_label = base_path = None
    checkpoints: dict[str, ModelCheckpoint] = {}
    for label, path in zip(labels, paths, strict=True):
        checkpoints[label] = open_checkpoint(path, label, allow_pickle)
    if has_base:
        base_path = resolve_model_path(config.base_model)
        base_label = next(
            (lab for lab, ref in zip(labels, input_refs, strict=True) if ref.same_model(config.base_model)),
            config.base_model.spec,
        )
        if base_label not in checkpoints:
            checkpoints[base_label] = open_checkpoint(base_path, base_label, allow_pickle)
    reference = base_label if has_base else labels[0]
    report = planner.check_compatible(checkpoints, reference=reference)
    ref_ckpt = checkpoints[reference]
    num_layers = _num_layers(ref_ckpt)
    n = len(labels)

    # First pass over tensors: kind, params, sources (tiles need the global per-element cost, computed after).
    plans: list[TensorPlan] = []
    validated: set[str] = set()
    linear = None
    for name in report.out_names:
        info = report.infos[name]
        first = checkpoints[labels[0]].tensors[name]
        if name in report.copy_names:
            plans.append(TensorPlan(name, info.shape, info.dtype, info.dtype, "copy", "copy", sources=[reference]))
            continue
        layer = layer_index(name)
        excluded = config.is_excluded(name)
        if excluded:
            if linear is None:
                linear = get_merge_method("linear")
            m, action = linear, "linear"
        else:
            m, action = method, "merge"
        global_params = config.resolve_params(name, None, layer, num_layers)
        own = [config.resolve_params(name, i, layer, num_layers, models=input_refs, own_only=True) for i in range(n)]
        if "weight" in global_params:  # mergekit: a model without its own weight falls back to the global one
            own = [{"weight": global_params["weight"], **o} for o in own]
        weights, params = gather_params(global_params, own)
        if excluded:
            params = {"normalize": True}
        params = m.resolve(params)
        key = repr((m.name, sorted(params.items(), key=lambda kv: kv[0])))
        if key not in validated:
            try:
                m.validate(params, n, has_base)
            except ValueError as err:
                raise ValueError(f"tensor {name!r}: {err}") from None
            validated.add(key)
        t_space = m.space(params, has_base)
        sources = list(labels) + ([base_label] if t_space == "task_vector" else [])
        tp = TensorPlan(
            name,
            info.shape,
            first.dtype,
            _out_dtype(config, first.dtype),
            action,
            m.kind,
            space=t_space,
            method=m,
            params=params,
            weights=weights,
            sources=sources,
        )
        if m.kind == "gram":
            tp.needs_gram = bool(m.needs_gram(params))
        else:
            tp.densities = m.densities(params, n)
        plans.append(tp)

    # Global per-element cost: component-wise maxima over tensors, so any mix of tensors in flight fits the budget.
    raw = out = work = 0
    for tp in plans:
        in_isz = max(checkpoints[s].tensors[tp.name].itemsize for s in tp.sources)
        raw = max(raw, len(tp.sources) * in_isz)
        out = max(out, DTYPE_ITEMSIZE[tp.out_dtype])
        if tp.kind != "copy":
            work = max(
                work,
                compute_work(tp.kind, n, len(tp.sources), gram=tp.needs_gram, diagnose=diagnose, itemsize=in_isz),
            )
    per_elem = SETS_IN_FLIGHT * raw + work + SETS_IN_FLIGHT * out
    equiv_inputs = max(1, math.ceil(per_elem / (planner.COMPUTE_ITEMSIZE * planner.PIPELINE_FACTOR)))

    for tp in plans:
        info: TensorInfo = report.infos[tp.name]
        tp.row_numel = info.row_numel
        if info.numel and per_elem * info.row_numel > budget:
            need = per_elem * info.row_numel
            raise ValueError(
                f"memory budget {budget} bytes is too small for tensor {tp.name!r} (shape {list(info.shape)}): one "
                f"row of {info.row_numel} elements needs {need} bytes with everything in flight ({per_elem} bytes "
                f"per element); use memory_budget of at least {need} bytes ({need / 2**20:.2f} MiB)"
            )
        # plan.plan_tiles sizes tiles as n × rows × row_numel × 4 × PIPELINE_FACTOR ≤ budget; `equiv_inputs` makes
        # that bound at least our per-element cost, so its even tile split is reused.
        tp.tiles = planner.plan_tiles(info, equiv_inputs, budget)
        src_bytes = sum(checkpoints[s].tensors[tp.name].nbytes for s in tp.sources)
        tp.write_bytes = info.numel * DTYPE_ITEMSIZE[tp.out_dtype]
        if tp.kind == "gram" and tp.needs_gram and len(tp.tiles) > 1:
            tp.passes = 2
        if tp.kind == "elementwise" and tp.densities is not None:
            tp.thresholds = "topk" if len(tp.tiles) == 1 else "stream"
        tp.read_bytes = src_bytes * tp.passes
        if tp.thresholds == "stream":  # two histogram passes over (model i, base) per model
            base_bytes = checkpoints[tp.sources[-1]].tensors[tp.name].nbytes if tp.space == "task_vector" else 0
            tp.read_bytes += 2 * sum(checkpoints[s].tensors[tp.name].nbytes + base_bytes for s in labels)
        if info.numel == 0:
            tp.tiles, tp.read_bytes = [], 0

    return MergePlan(
        method=config.merge_method,
        inputs=labels,
        input_paths=paths,
        base=base_label,
        base_path=base_path,
        reference=reference,
        budget=budget,
        bytes_per_element=per_elem,
        max_shard_size=max_shard_size if max_shard_size is not None else planner.parse_size(config.max_shard_size),
        tensors=plans,
        dropped=dict(report.dropped),
        checkpoints=checkpoints,
    )


def _num_layers(ckpt: ModelCheckpoint) -> int | None:
    """Decoder layers of the reference: `num_hidden_layers` / `n_layer` in config.json, else from tensor names."""
    cfg = ckpt.config or {}
    for c in (cfg, cfg.get("text_config") or {}):
        for key in ("num_hidden_layers", "n_layer", "num_layers"):
            if isinstance(c.get(key), int):
                return c[key]
    idx = [layer_index(n) for n in ckpt.tensors]
    idx = [i for i in idx if i is not None]
    return max(idx) + 1 if idx else None
