"""Can these checkpoints be merged? Compatibility checks from headers, and byte sizes.

* `check_compatible`: names, shapes and dtype classes must agree across the inputs; tied output embeddings are
  reconciled; float tensors are merged, non-float ones copied (and must be bitwise equal: `check_equal_nonfloat`,
  the one function here that reads data).
* `check_sources`: the same rules for an explicit mapping of output tensors to input tensors (layer-range slices).
* `parse_size`: "2GB" / "512MiB" / int → bytes.

No torch import at module level.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from dataclasses import dataclass, field
from decimal import Decimal
from typing import TYPE_CHECKING

from .io.header import ModelCheckpoint, TensorInfo
from .settings import is_pre_layer


if TYPE_CHECKING:
    from .io.reader import SafetensorsReader


# Output-embedding names that transformers drops from a checkpoint when `tie_word_embeddings` is true (the weight
# is the input embedding's). Listed explicitly: guessing from names would hide real missing tensors.
TIED_OUTPUT_NAMES = ("lm_head.weight",)

# Tensors mergekit 0.1.5's architecture definitions give a vocabulary axis (always axis 0).
VOCAB_TENSORS = frozenset({
    "model.embed_tokens.weight", "lm_head.weight", "lm_head.bias", "transformer.wte.weight", "embed_tokens.weight",
    "model.language_model.embed_tokens.weight", "gpt_neox.embed_in.weight", "embed_out.weight", "output.weight",
    "model.tok_embeddings.weight", "transformer.word_embeddings.weight", "backbone.embeddings.weight",
    "transformer.embedding.word_embeddings.weight", "transformer.output_layer.weight", "transformer.embd.wte.weight",
})  # fmt: skip

# How many names an error message lists before "... (n in all)".
_SHOW = 5


def _show(names: list[str], limit: int = _SHOW) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "")


# ---------------------------------------------------------------------------------------------------------------
# sizes


_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*$")


def parse_size(value: int | str) -> int:
    """A byte count from an int or a string such as `"2GB"`, `"2 GiB"`, `"512MB"`, `"1.5GB"`, `"4096"`.

    Units (case-insensitive), as transformers' `convert_file_size_to_int` for `max_shard_size`: decimal
    `KB`/`MB`/`GB`/`TB` = 10³/10⁶/10⁹/10¹² bytes, binary `KiB`/`MiB`/`GiB`/`TiB` = 2¹⁰/2²⁰/2³⁰/2⁴⁰, `B` or no
    unit = bytes. So `"2GB"` = 2 000 000 000 and `"2GiB"` = 2 147 483 648. Bare `K`/`M`/`G` are refused as
    ambiguous. Fractions are rounded down to whole bytes.

    Raises:
        ValueError: naming the bad value, for negative numbers, unknown units, or anything that is not a size.
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"size must be an int number of bytes or a string like '2GB' or '512MiB', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size must be a non-negative number of bytes, got {value!r}")
        return value
    m = _SIZE_RE.match(value)
    unit = m.group(2).upper() if m else None
    if m is None or unit not in _SIZE_UNITS:
        hint = (
            " (bare K/M/G/T are ambiguous: write GB for 10^9 or GiB for 2^30)" if unit in ("K", "M", "G", "T") else ""
        )
        raise ValueError(
            f"cannot parse size {value!r}: expected a number with an optional unit B, KB, MB, GB, TB, KiB, MiB, "
            f"GiB or TiB{hint}"
        )
    number = m.group(1)
    if "." in number:
        return int(Decimal(number) * _SIZE_UNITS[unit])  # Decimal: "1.1GB" is exactly 1_100_000_000
    return int(number) * _SIZE_UNITS[unit]


# ---------------------------------------------------------------------------------------------------------------
# compatibility


@dataclass
class CompatReport:
    """What `check_compatible` found.

    Attributes:
        reference: name of the reference model (its file order and dtypes define the output).
        models: the model names, in the order given.
        out_names: output tensor names, in the reference's file order (shards in order, byte offset within).
        float_names: the floating-point outputs (merged), in `out_names` order.
        copy_names: non-float outputs (integer, bool, complex), in `out_names` order: copied from the reference,
            after `check_equal_nonfloat` confirmed every input holds the same bytes.
        dropped: `{name: reason}` for tensors present in some inputs and deliberately not written (tied output
            embeddings: transformers re-ties them from the input embedding at load).
        infos: `{name: TensorInfo}` of the reference for every output (dtype, shape, where it is).
        tied: `{model: True | False | None}` — each model's `tie_word_embeddings` (`None` when the config does not
            say).
    """

    reference: str
    models: list[str]
    out_names: list[str]
    float_names: list[str]
    copy_names: list[str]
    dropped: dict[str, str] = field(default_factory=dict)
    infos: dict[str, TensorInfo] = field(default_factory=dict)
    tied: dict[str, bool | None] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        """Bytes of the reference's outputs in their stored dtypes."""
        return sum(self.infos[n].nbytes for n in self.out_names)


def tie_word_embeddings(config: dict | None) -> bool | None:
    """`tie_word_embeddings` from a `config.json` dict (top level, else `text_config` for multimodal configs);
    `None` when absent: transformers v5 has no global default, the model class decides."""
    if not config:
        return None
    for cfg in (config, config.get("text_config")):
        if isinstance(cfg, dict) and isinstance(cfg.get("tie_word_embeddings"), bool):
            return cfg["tie_word_embeddings"]
    return None


def tied_input(name: str, ckpt: ModelCheckpoint) -> str | None:
    """The input embedding that stands for the missing output embedding `name` (the checkpoint's only vocabulary
    tensor before the layers), or None."""
    if name not in TIED_OUTPUT_NAMES:
        return None
    inputs = [n for n in ckpt.tensors if n in VOCAB_TENSORS and is_pre_layer(n)]
    return inputs[0] if len(inputs) == 1 else None


def with_tied_outputs(checkpoints: dict[str, ModelCheckpoint]) -> dict[str, ModelCheckpoint]:
    """The checkpoints, each lacking an output embedding (saved tied) that another one stores given that name for
    its input embedding's bytes: mergekit 0.1.5 reads a tensor's tied name when the tensor is missing (its
    architectures' `tied_names`), so the stored `lm_head` is merged with the tied models' embeddings and written.
    A checkpoint with no single input embedding is left as it is (`compat.check_compatible` then decides)."""
    out = dict(checkpoints)
    for name in TIED_OUTPUT_NAMES:
        stored = [c.tensors[name] for c in checkpoints.values() if name in c.tensors]
        if not stored:
            continue
        for label, ckpt in checkpoints.items():
            source = None if name in ckpt.tensors else tied_input(name, ckpt)
            if source is not None and ckpt.tensors[source].shape == stored[0].shape:
                tensors = {**out[label].tensors, name: dataclasses.replace(ckpt.tensors[source], name=name)}
                out[label] = dataclasses.replace(out[label], tensors=tensors)
    return out


def check_compatible(checkpoints: dict[str, ModelCheckpoint], *, reference: str) -> CompatReport:
    """Check that the inputs can be merged tensor by tensor, from their headers.

    Rules:
        * every model has the reference's tensors and no others, except tied output embeddings (below);
        * each tensor has the same shape in every model;
        * each tensor has the same dtype class (float / int / bool / complex) in every model; float widths may
          differ (BF16 with F32): the engine computes in fp32;
        * tied output embeddings: a model saved with `tie_word_embeddings=True` has no `lm_head.weight` (it is
          the input embedding). When `lm_head.weight` is stored by some models only, it is dropped from the output
          (written once, as the embedding) provided no model's config says `tie_word_embeddings: false` (then the
          models are not tied alike, and merging one's `lm_head` with another's embedding would be wrong).

    Non-finite values are not checked here (that needs the data; the engine checks tiles as it reads them).

    Args:
        checkpoints: `{model name: ModelCheckpoint}`, in the recipe's order.
        reference: the key whose file order and dtypes define the output (the base model, or the first).

    Raises:
        ValueError: listing every problem found (missing/extra tensors per model with up to 5 names each, shape
            and dtype-class mismatches naming the tensor, both values and both models).
    """
    if not checkpoints:
        raise ValueError("check_compatible needs at least one checkpoint")
    if reference not in checkpoints:
        raise ValueError(f"reference {reference!r} is not one of the models: {list(checkpoints)}")
    models = list(checkpoints)
    ref = checkpoints[reference]
    tied = {m: tie_word_embeddings(c.config) for m, c in checkpoints.items()}
    problems: list[str] = []

    # Tied output embeddings present in some inputs only.
    dropped: dict[str, str] = {}
    for name in TIED_OUTPUT_NAMES:
        have = [m for m in models if name in checkpoints[m].tensors]
        if not have or len(have) == len(models):
            continue  # stored everywhere (merged like any tensor) or nowhere
        lack = [m for m in models if m not in have]
        untied = [m for m in models if tied[m] is False]
        if untied:
            problems.append(
                f"{name!r} is stored by {have} but not by {lack}, and {untied} set tie_word_embeddings=false: "
                f"a model without {name!r} has tied embeddings, so these models are not tied alike and cannot be "
                "merged tensor by tensor"
            )
            continue
        dropped[name] = (
            f"tied output embedding: stored by {have} only; the models without it tie it to the input embedding, "
            "so the merge writes the embedding once and transformers re-ties it at load"
        )

    ref_names = [n for n in ref.tensors if n not in dropped]
    ref_set = set(ref_names)
    for m in models:
        if m == reference:
            continue
        names = checkpoints[m].tensors
        missing = [n for n in ref_names if n not in names]
        extra = [n for n in names if n not in ref_set and n not in dropped]
        if missing:
            problems.append(f"model {m!r} lacks {len(missing)} tensor(s) of reference {reference!r}: {_show(missing)}")
        if extra:
            problems.append(
                f"model {m!r} has {len(extra)} tensor(s) that reference {reference!r} lacks: {_show(extra)}"
            )

    mismatches: list[str] = []
    for name in ref_names:
        info = ref.tensors[name]
        for m in models:
            other = checkpoints[m].tensors.get(name)
            if m == reference or other is None:
                continue
            if other.shape != info.shape:
                mismatches.append(
                    f"tensor {name!r}: shape {list(info.shape)} in {reference!r} but {list(other.shape)} in {m!r}"
                )
            elif other.dtype_class != info.dtype_class:
                mismatches.append(
                    f"tensor {name!r}: dtype {info.dtype} ({info.dtype_class}) in {reference!r} but {other.dtype} "
                    f"({other.dtype_class}) in {m!r}; only float widths may differ"
                )
    if mismatches:
        shown = mismatches[:10] + ([f"... ({len(mismatches)} mismatches in all)"] if len(mismatches) > 10 else [])
        problems.extend(shown)
    if problems:
        raise ValueError("models cannot be merged:\n  " + "\n  ".join(problems))

    float_names = [n for n in ref_names if ref.tensors[n].dtype_class == "float"]
    copy_names = [n for n in ref_names if ref.tensors[n].dtype_class != "float"]
    return CompatReport(
        reference=reference,
        models=models,
        out_names=ref_names,
        float_names=float_names,
        copy_names=copy_names,
        dropped=dropped,
        infos={n: ref.tensors[n] for n in ref_names},
        tied=tied,
    )


def check_equal_nonfloat(
    readers: dict[str, SafetensorsReader], names: list[str], *, chunk_bytes: int = 64 * 2**20
) -> None:
    """Check that each non-float tensor in `names` holds the same bytes in every reader (integer and bool tensors —
    position ids, masks, quantisation tables — cannot be averaged, so they are copied, which is only right if the
    inputs agree).

    Reads row chunks of at most `chunk_bytes` per model, so memory stays bounded for any tensor size.

    Args:
        readers: `{model name: SafetensorsReader}`; the first one is compared with every other.
        names: tensors to compare (e.g. `CompatReport.copy_names`).

    Raises:
        ValueError: naming the tensor, the two models, and the first differing element (flat index and values).
    """
    import torch

    if len(readers) < 2:
        return
    models = list(readers)
    first = models[0]
    for name in names:
        info = readers[first].info(name)
        step = max(1, chunk_bytes // max(1, info.row_nbytes))
        for start in range(0, info.n_rows, step):
            stop = min(info.n_rows, start + step)
            a = readers[first].read_rows(name, start, stop)
            for m in models[1:]:
                b = readers[m].read_rows(name, start, stop)
                if a.dtype != b.dtype or a.shape != b.shape:
                    raise ValueError(
                        f"tensor {name!r}: {a.dtype}{list(a.shape)} in {first!r} but {b.dtype}{list(b.shape)} in {m!r}"
                    )
                # Compare bytes, not values: bitwise equality is what copying needs (and NaN-safe for complex).
                ab, bb = a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
                if not torch.equal(ab, bb):
                    diff = (a.reshape(-1) != b.reshape(-1)).nonzero()
                    i = int(diff[0]) if diff.numel() else 0
                    flat = start * info.row_numel + i
                    raise ValueError(
                        f"tensor {name!r} ({info.dtype}) differs between {first!r} and {m!r} (first at flat index "
                        f"{flat}: {a.reshape(-1)[i].item()!r} vs {b.reshape(-1)[i].item()!r}); non-float tensors are "
                        "copied, not merged, so they must be identical in every model"
                    )


def check_sources(outputs: dict[str, list[tuple[str, str]]], checkpoints: dict[str, ModelCheckpoint]) -> None:
    """Check an explicit output → `[(model, input tensor name), ...]` mapping (layer-range slices).

    Every input tensor must exist, and the inputs of one output must agree in shape and dtype class.

    Raises:
        ValueError: listing up to 10 problems, each naming the output tensor, the models and the values.
    """
    problems: list[str] = []
    for out, sources in outputs.items():
        infos = []
        for label, name in sources:
            info = checkpoints[label].tensors.get(name)
            if info is None:
                problems.append(f"output tensor {out!r}: model {label!r} has no tensor {name!r}")
            else:
                infos.append((label, info))
        for (la, a), (lb, b) in itertools.pairwise(infos):
            if a.shape != b.shape:
                problems.append(
                    f"output tensor {out!r}: shape {list(a.shape)} of {a.name!r} in {la!r} but {list(b.shape)} of "
                    f"{b.name!r} in {lb!r}"
                )
            elif a.dtype_class != b.dtype_class:
                problems.append(f"output tensor {out!r}: dtype {a.dtype} in {la!r} but {b.dtype} in {lb!r}")
    if problems:
        shown = problems[:10] + ([f"... ({len(problems)} problems in all)"] if len(problems) > 10 else [])
        raise ValueError("models cannot be merged:\n  " + "\n  ".join(shown))
