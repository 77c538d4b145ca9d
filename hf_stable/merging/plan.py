"""What a merge will do, decided from headers only: per output tensor, its sources, method, parameters, passes and
chunks, and the buffers the engine allocates (the whole result of `merge(..., dry_run=True)`).

`build_plan(config, budget)` opens every input's headers, checks compatibility (`compat`), maps each output tensor
to its input tensors (identity for `models:` recipes; renamed layers for layer-range `slices:`), evaluates each
tensor's parameters at its layer position (`MergeConfig.global_parameters` / `own_parameters`, mergekit 0.1.5
semantics), validates them against the method's declarations, and cuts tensors into row chunks.

Memory (what `memory_budget` bounds, as a ceiling): the engine allocates once a ring of `RING_SLOTS` chunk buffers
(every source of one chunk plus its output), piece-sized fp32 scratch, the fp64 staging block of the Gram, and a
raw cache that keeps a whole tensor's inputs resident when a method reads them more than once. The chunk is
`MAX_CHUNK_ELEMS` elements (4 MiB of fp32) whatever the budget; only a budget too small for that shrinks it. The
cache takes what is left, up to `RESIDENT_CAP` in all. Fixed scratch that does not grow with the model (the
radix-selection histograms, 0.75 MiB) is outside the budget.

Passes per tensor, before the combine pass:
* gram kind needing the Gram (Fisher–Rao, SLERP, ...): one `gram` pass;
* elementwise kind: `kth_high` + `kth_low` when the method ranks scores (TIES, breadcrumbs thresholds), then
  `sums` when it needs whole-tensor sums (the L1 rescale);
* linear, task arithmetic, WSM, passthrough, DARE without rescale: none (one read).
A tensor read more than once whose inputs fit the raw cache is read once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .compat import check_compatible, check_sources, parse_size, with_tied_outputs
from .config import DTYPE_NAMES, MergeConfig
from .io.dtypes import DTYPE_ITEMSIZE
from .io.header import ModelCheckpoint
from .model_refs import ModelRef, OutputSlice

# `_apply_buffers` reads these sizes as this module's globals: a test that shrinks `plan.MAX_CHUNK_ELEMS` or
# `plan.PIECE_ELEMS` changes the chunking of the next plan.
from .plan_records import (
    GRAM_BLOCK,
    MAX_CHUNK_ELEMS,
    PIECE_ELEMS,
    RESIDENT_CAP,
    RING_SLOTS,
    MergePlan,
    Source,
    TensorPlan,
)
from .resolve import resolve_model_path
from .settings import is_pre_layer, layer_index, layer_position, with_layer


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


def _out_dtype(config: MergeConfig, first_input_dtype: str) -> str:
    name = config.out_dtype or config.dtype
    return DTYPE_NAMES[name] if name else first_input_dtype


def compute_dtype_of(config: MergeConfig, input_dtypes: list[str]) -> str:
    """The dtype a recipe's arithmetic is done in, as mergekit 0.1.5 does it (`io/tasks.py` `LoadTensor` casts every
    input to the recipe's `dtype`; without one, `merge_methods/dtype.py` promotes the inputs' dtypes): the recipe's
    `dtype`, else the inputs' dtype when they all share a 16-bit one, else `F32`. `fp32_arithmetic: true` forces
    `F32` (inputs are not rounded; more precise, not mergekit's numbers)."""
    if config.fp32_arithmetic:
        return "F32"
    if config.dtype:
        return DTYPE_NAMES[config.dtype]
    kinds = set(input_dtypes)
    return kinds.pop() if len(kinds) == 1 and kinds <= {"F16", "BF16"} else "F32"


def open_checkpoint(path: str, label: str, allow_pickle: bool) -> ModelCheckpoint:
    try:
        return ModelCheckpoint.open(path, allow_pickle=allow_pickle)
    except ValueError as err:
        if not allow_pickle and "pickle" in str(err).lower():
            raise ValueError(
                f"model {label!r}: {err} (CLI: --allow-pickle; recipe: allow_pickle: true; merge(allow_pickle=True))"
            ) from None
        raise


def _num_layers(ckpt: ModelCheckpoint) -> int | None:
    """Decoder layers: `num_hidden_layers` / `n_layer` in config.json, else from tensor names."""
    cfg = ckpt.config or {}
    for c in (cfg, cfg.get("text_config") or {}):
        for key in ("num_hidden_layers", "n_layer", "num_layers"):
            if isinstance(c.get(key), int):
                return c[key]
    idx = [layer_index(n) for n in ckpt.tensors]
    idx = [i for i in idx if i is not None]
    return max(idx) + 1 if idx else None


@dataclass
class _Out:
    """One output tensor before planning: its sources' refs/labels/names, slice and layer position."""

    name: str
    refs: list[ModelRef]  # one per input (per-model parameters live here)
    labels: list[str]
    in_names: list[str]
    out_slice: OutputSlice | None
    t: float
    base_name: str | None = None  # the base model's tensor (task vectors)


def build_plan(
    config: MergeConfig,
    budget: int,
    *,
    allow_pickle: bool = False,
    diagnose: bool = False,
    max_shard_size: int | None = None,
    vocabulary=None,
) -> MergePlan:
    """Plan a merge from headers (no tensor data read). Raises `ValueError` for every recipe/model problem.
    `vocabulary` (`vocab.Vocabulary`, from `tokenizer_source`) aligns each checkpoint's vocabulary tensors."""
    from .methods import get_merge_method
    from .methods.base import gather_params

    method = config.validate()  # unknown method, bad global parameters, a missing base model: before any I/O
    has_base = config.base_model is not None
    global0 = method.resolve(config.global_parameters(config.slices[0] if config.slices else None))
    uses_base = has_base and method.space(global0, has_base) == "task_vector"

    checkpoints: dict[str, ModelCheckpoint] = {}
    paths: dict[str, str] = {}

    def open_ref(ref: ModelRef, label: str) -> None:
        if label not in checkpoints:
            paths[label] = resolve_model_path(ref.model, ref.revision)
            checkpoints[label] = open_checkpoint(paths[label], label, allow_pickle)
            if vocabulary is not None:
                checkpoints[label] = vocabulary.align(paths[label], checkpoints[label])

    base_label = config.base_model.spec if has_base else None
    outs: list[_Out] = []
    copies: set[str] = set()
    dropped: dict[str, str] = {}
    overrides: dict[str, Any] = {}
    whole = config.slices is None or _whole_model_slice(config, open_ref, checkpoints)
    if whole:
        out_slice = config.slices[0] if config.slices else None
        refs = [s.model for s in out_slice.sources] if out_slice else config.models
        if uses_base:
            refs = [r for r in refs if not r.same_model(config.base_model)]
        elif has_base and method.base_is_input(global0):
            # the base's own entry, when listed, keeps its parameters (its `weight` sets slerp's t)
            listed = next((r for r in refs if r.same_model(config.base_model)), config.base_model)
            refs = [listed, *[r for r in refs if not r.same_model(config.base_model)]]
        if not refs:
            raise ValueError("no input model left after removing base_model from models")
        labels = _label_models(refs)
        for ref, label in zip(refs, labels, strict=True):
            open_ref(ref, label)
        if has_base:
            base_label = next(
                (lab for lab, ref in zip(labels, refs, strict=True) if ref.same_model(config.base_model)), base_label
            )
            open_ref(config.base_model, base_label)
        reference = base_label if has_base else labels[0]
        involved = [label for label in dict.fromkeys([*labels, base_label]) if label is not None]
        if vocabulary is None:  # with a tokenizer_source, `vocabulary.align` has done it
            checkpoints.update(with_tied_outputs({label: checkpoints[label] for label in involved}))
        report = check_compatible({label: checkpoints[label] for label in involved}, reference=reference)
        dropped = dict(report.dropped)
        num_layers = _num_layers(checkpoints[reference])
        for name in report.out_names:
            if name in report.copy_names:
                copies.add(name)
            layer = layer_index(name)
            t = layer_position(name, layer, num_layers)
            outs.append(_Out(name, list(refs), list(labels), [name] * len(refs), out_slice, t, name))
        inputs = list(labels)
    else:
        if has_base:
            open_ref(config.base_model, base_label)
        reference, outs, inputs, overrides = _frankenmerge(config, method, uses_base, open_ref, checkpoints)
        mapping = {o.name: list(zip(o.labels, o.in_names, strict=True)) for o in outs}
        for o in outs:
            if uses_base:
                mapping[o.name].append((base_label, o.base_name))
        check_sources(mapping, checkpoints)
        copies = {o.name for o in outs if checkpoints[o.labels[0]].tensors[o.in_names[0]].dtype_class != "float"}

    plans: list[TensorPlan] = []
    validated: set[str] = set()
    linear = None
    for o in outs:
        info = checkpoints[o.labels[0]].tensors[o.in_names[0]]
        if o.name in copies:
            plans.append(
                TensorPlan(o.name, info.shape, info.dtype, info.dtype, "copy", "copy",
                           sources=[Source(reference if whole else o.labels[0], o.in_names[0])],
                           row_numel=info.row_numel)
            )  # fmt: skip
            continue
        if config.is_excluded(o.name):
            linear = linear or get_merge_method("linear")
            m, action = linear, "linear"
        else:
            m, action = method, "merge"
        global_params = config.global_parameters(o.out_slice, o.name, o.t)
        own = [config.own_parameters(r.parameters, n, o.t) for r, n in zip(o.refs, o.in_names, strict=True)]
        if "weight" in global_params:  # mergekit: a model without its own weight falls back to the global one
            own = [{"weight": global_params["weight"], **x} for x in own]
        weights, params = gather_params(global_params, own, m.param_defaults)
        if action == "linear":
            params = {"normalize": True}
        params = m.resolve(params)
        key = repr((m.name, sorted(params.items(), key=lambda kv: kv[0]), weights))
        if key not in validated:
            try:
                m.validate(params, len(o.refs), has_base)
                m.validate_weights(weights, params)
            except ValueError as err:
                raise ValueError(f"tensor {o.name!r}: {err}") from None
            validated.add(key)
        space = m.space(params, has_base)
        sources = [Source(lab, n) for lab, n in zip(o.labels, o.in_names, strict=True)]
        if space == "task_vector":
            sources.append(Source(base_label, o.base_name))
        kind = m.kind_for(params)
        tp = TensorPlan(
            o.name, info.shape, info.dtype, _out_dtype(config, info.dtype), action, kind, space=space, method=m,
            params=params, weights=weights, sources=sources, row_numel=info.row_numel,
            compute_dtype=compute_dtype_of(config, [checkpoints[s.label].tensors[s.name].dtype for s in sources]),
        )  # fmt: skip
        # mergekit's whole-tensor arithmetic where the method has it (decided per tensor in `_apply_buffers`)
        tp.direct = action == "merge" and not config.fp32_arithmetic and bool(m.mergekit_direct(params))
        tp.mergekit_order = not config.fp32_arithmetic
        if getattr(m, "float32_result", False) and not config.out_dtype and tp.compute_dtype in ("F16", "BF16"):
            tp.out_dtype = "F32"  # mergekit writes the method's float32 result (arcee_fusion)
        if kind == "gram":
            tp.needs_gram = bool(m.needs_gram(params))
            tp.passes = ("gram",) if tp.needs_gram else ()
        else:
            tp.row_local = bool(m.row_local_for(params))
            whole = getattr(m, "whole_tensor", False)
            if tp.row_local and len(info.shape) > 2 and not whole:
                raise ValueError(
                    f"tensor {o.name!r}: merge_method {m.name!r} with these parameters works row by row on matrices "
                    f"and vectors; this tensor has shape {list(info.shape)}"
                )
            tp.ranks = m.ranks(params, tp.n_inputs, tp.numel)
            passes = ("kth_high", "kth_low") if tp.ranks is not None else ()
            tp.passes = passes + (("sums",) if m.needs_sums(params) else ())
        # a vector is one logical row; a whole-tensor method (sce) sees the whole tensor as one
        whole = tp.row_local and getattr(m, "whole_tensor", False)
        tp.row_len = info.numel if len(info.shape) <= 1 or whole else info.row_numel
        plans.append(tp)

    plan = MergePlan(
        method=config.merge_method,
        inputs=inputs,
        input_paths=[paths[label] for label in inputs],
        base=base_label,
        base_path=paths.get(base_label) if base_label else None,
        reference=reference,
        budget=budget,
        max_shard_size=max_shard_size if max_shard_size is not None else parse_size(config.max_shard_size),
        tensors=plans,
        config_overrides=overrides,
        dropped=dropped,
        checkpoints=checkpoints,
    )
    _apply_buffers(plan, plans, checkpoints, budget, diagnose)
    return plan


def _whole_model_slice(config: MergeConfig, open_ref, checkpoints) -> bool:
    """A single slice whose every source spans all layers of its model is the `models:` form."""
    if len(config.slices) != 1:
        return False
    for src in config.slices[0].sources:
        label = src.model.spec
        open_ref(src.model, label)
        if src.layer_range != (0, _num_layers(checkpoints[label]) or 0):
            return False
    return True


def _layer_tensors(ckpt: ModelCheckpoint, layer: int) -> list[str]:
    return [n for n in ckpt.tensors if layer_index(n) == layer]


def _frankenmerge(config: MergeConfig, method, uses_base: bool, open_ref, checkpoints):
    """Outputs of layer-range slices: pre-layer tensors from the first slice's sources, each slice's layers renumbered
    in order, post-layer tensors from the last slice's sources (mergekit 0.1.5 `MergePlanner.plan_module`)."""
    outs: list[_Out] = []
    base_is_input = method.base_is_input(method.resolve(config.global_parameters(config.slices[0])))

    def base_source(sl: OutputSlice):
        found = [s for s in sl.sources if s.model.same_model(config.base_model)] if uses_base else [None]
        if not found:
            raise ValueError(
                f"merge_method {config.merge_method!r} merges task vectors: every slice must list base_model "
                f"{config.base_model.spec!r} among its sources (with the layer range to subtract)"
            )
        return found[0]

    def slice_refs(sl: OutputSlice):
        srcs = [s for s in sl.sources if not (uses_base and s.model.same_model(config.base_model))]
        if config.base_model is not None and base_is_input:
            srcs = sorted(srcs, key=lambda s: not s.model.same_model(config.base_model))
        for s in srcs:
            open_ref(s.model, s.model.spec)
        return srcs

    first, last = slice_refs(config.slices[0]), slice_refs(config.slices[-1])
    ref0 = checkpoints[first[0].model.spec]
    outside = [n for n in ref0.tensors if layer_index(n) is None]
    for name in [n for n in outside if is_pre_layer(n)]:
        outs.append(_Out(name, [s.model for s in first], [s.model.spec for s in first], [name] * len(first),
                         config.slices[0], 0.0, name))  # fmt: skip
    out_layer = 0
    layer_types: list[Any] = []
    for sl in config.slices:
        srcs, base = slice_refs(sl), base_source(sl)
        n = sl.n_layers
        for offset in range(n):
            names0 = _layer_tensors(checkpoints[srcs[0].model.spec], srcs[0].layer_range[0] + offset)
            if not names0:
                raise ValueError(
                    f"model {srcs[0].model.spec!r} has no layer {srcs[0].layer_range[0] + offset} (slice layer_range "
                    f"{list(srcs[0].layer_range)})"
                )
            for name0 in names0:
                in_names = [with_layer(name0, s.layer_range[0] + offset) for s in srcs]
                base_name = with_layer(name0, base.layer_range[0] + offset) if base is not None else None
                outs.append(
                    _Out(with_layer(name0, out_layer), [s.model for s in srcs], [s.model.spec for s in srcs],
                         in_names, sl, layer_position(name0, offset, n), base_name)
                )  # fmt: skip
            types = (checkpoints[srcs[0].model.spec].config or {}).get("layer_types")
            if isinstance(types, list):
                layer_types.append(types[srcs[0].layer_range[0] + offset])
            out_layer += 1
    # Post-layer tensors are read from the last slice's sources; one saved tied reads its input embedding for a
    # missing `lm_head` that another source stores (mergekit's tied names), and a tensor none stores is left out.
    ends = with_tied_outputs({s.model.spec: checkpoints[s.model.spec] for s in last})
    checkpoints.update(ends)
    post = [n for c in [ref0, *ends.values()] for n in c.tensors if layer_index(n) is None and not is_pre_layer(n)]
    for name in dict.fromkeys(post):
        if name not in ends[last[0].model.spec].tensors:
            continue
        outs.append(_Out(name, [s.model for s in last], [s.model.spec for s in last], [name] * len(last),
                         config.slices[-1], 0.0, name))  # fmt: skip
    overrides: dict[str, Any] = {"num_hidden_layers": out_layer}
    if layer_types and len(layer_types) == out_layer:
        overrides["layer_types"] = layer_types
    inputs = list(dict.fromkeys(label for o in outs for label in o.labels))
    return first[0].model.spec, outs, inputs, overrides


def _chunk_rows(n_rows: int, row_numel: int, row_len: int, chunk_elems: int) -> list[tuple[int, int]]:
    """Row ranges of at most `chunk_elems` elements (at least one logical row; a vector with a logical row of
    `row_len = numel` is one chunk)."""
    if n_rows == 0 or row_numel == 0:
        return [(0, n_rows)]
    if row_len > row_numel:  # the whole tensor is one logical row
        return [(0, n_rows)]
    per = max(1, chunk_elems // row_numel)
    return [(a, min(n_rows, a + per)) for a in range(0, n_rows, per)]


def _apply_buffers(plan: MergePlan, plans: list[TensorPlan], checkpoints, budget: int, diagnose: bool) -> None:
    """Size the ring, scratch, Gram staging and raw cache within `budget` and cut every tensor into chunks."""
    merged = [t for t in plans if t.kind != "copy"]
    n_max = max((t.n_inputs for t in merged), default=1)
    in_bytes = max((sum(checkpoints[s.label].tensors[s.name].itemsize for s in t.sources) for t in plans), default=1)
    out_bytes = max((DTYPE_ITEMSIZE[t.out_dtype] for t in plans), default=1)
    min_elems = max(
        ((t.row_len if (t.row_local and t.row_len > t.row_numel) else t.row_numel) for t in plans if t.numel),
        default=1,
    )
    gram = any(t.needs_gram for t in merged)
    piece_rows = 3 + n_max  # acc, scratch, base + the (N, piece) inputs of elementwise methods
    diag = 8 * n_max + 8 if diagnose else 0
    # row-local methods combine whole logical rows at a time
    widest_row = max((t.row_len for t in merged if t.row_local and t.kind != "gram"), default=0)

    def piece_of(e: int) -> int:
        return max(min(PIECE_ELEMS, e), widest_row)

    def total(e: int, block: int) -> tuple[int, int, int]:
        piece = piece_of(e)
        ring = RING_SLOTS * e * (in_bytes + out_bytes)
        scratch = piece * 4 * piece_rows + e * (4 if diagnose else 0) + piece * diag
        staging = n_max * block * 8 if gram else 0
        return ring, scratch, staging

    e, block = MAX_CHUNK_ELEMS, GRAM_BLOCK
    if sum(total(e, block)) > budget:
        # shrink the chunk (and the Gram block with it) to what the budget holds
        per_elem = RING_SLOTS * (in_bytes + out_bytes) + 4 * piece_rows + (4 + diag if diagnose else 0)
        per_elem += 8 * n_max if gram else 0
        e = block = budget // per_elem
    e = max(e, 0)
    if e < min_elems and sum(total(min_elems, min_elems)) <= budget:
        # a method that needs whole rows longer than a chunk (sce's whole-tensor row): one row per chunk, when the
        # budget holds it (the per-element estimate above also charges the piece scratch per element)
        e, block = min_elems, min(min_elems, GRAM_BLOCK)
    if e < min_elems:
        need = sum(total(min_elems, min_elems))
        widest = max((t for t in plans if t.numel), key=lambda t: t.row_len if t.row_local else t.row_numel)
        raise ValueError(
            f"memory budget {budget} bytes is too small for tensor {widest.name!r} (shape {list(widest.shape)}): one "
            f"chunk of {min_elems} elements needs {need} bytes with its ring, scratch and Gram buffers; use "
            f"memory_budget of at least {need} bytes ({need / 2**20:.2f} MiB)"
        )
    block = min(block, GRAM_BLOCK)
    ring, scratch, staging = total(e, block)
    left = min(budget, RESIDENT_CAP) - ring - scratch - staging
    plan.chunk_elems, plan.piece_elems = e, piece_of(e)
    plan.gram_block = block
    plan.ring_bytes, plan.scratch_bytes, plan.staging_bytes = ring, scratch, staging
    plan.slot_in_bytes, plan.slot_out_bytes = e * in_bytes, e * out_bytes
    plan.max_inputs = n_max
    cacheable = [t for t in plans if t.passes]
    cache = max(0, left)
    biggest = 0
    for t in plans:
        src_bytes = sum(checkpoints[s.label].tensors[s.name].nbytes for s in t.sources)
        t.source_bytes = src_bytes
        t.chunks = _chunk_rows(checkpoints[t.sources[0].label].tensors[t.sources[0].name].n_rows, t.row_numel,
                               t.row_len if t.row_local else t.row_numel, e)  # fmt: skip
        t.write_bytes = t.numel * DTYPE_ITEMSIZE[t.out_dtype]
        if t.direct and len(t.chunks) == 1:
            t.passes = ()  # one chunk holds the whole tensor: one read
        t.cached = bool(t.passes) and len(t.chunks) > 0 and src_bytes <= cache
        # the whole tensor in one chunk, or whole rows for a per-row form without passes: mergekit's operations
        # allocate a few copies of their inputs, so a bigger tensor (even a cached one) streams through its passes
        t.direct = t.direct and (len(t.chunks) == 1 or (t.row_local and not t.passes))
        if t.cached:
            biggest = max(biggest, src_bytes)
        t.read_bytes = src_bytes if (t.cached or not t.passes) else src_bytes * (1 + len(t.passes))
        if t.numel == 0:
            t.read_bytes = 0
    plan.cache_bytes = biggest if cacheable else 0


__all__ = [
    "GRAM_BLOCK",
    "MAX_CHUNK_ELEMS",
    "PIECE_ELEMS",
    "RESIDENT_CAP",
    "RING_SLOTS",
    "MergePlan",
    "Source",
    "TensorPlan",
    "build_plan",
    "compute_dtype_of",
    "open_checkpoint",
]
