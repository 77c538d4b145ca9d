"""Parse safetensors headers ourselves and describe a checkpoint's tensors by file, byte offset and length.

The safetensors layout is: 8 bytes (u64, little-endian) = header length `H`; `H` bytes of UTF-8 JSON
`{name: {"dtype": str, "shape": [int, ...], "data_offsets": [begin, end]}, "__metadata__": {str: str}}`
(optionally padded with trailing spaces); then the data region. `data_offsets` are relative to the start of the
data region (byte `8 + H`). Reading only the header tells the planner everything (names, dtypes, shapes,
where the bytes are) without opening an mmap or touching the weights.

This module does not import torch: the planner and the CLI's dry run stay cheap. Only the `allow_pickle` path
(loading `pytorch_model.bin`) imports torch, on use.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .dtypes import DTYPE_ITEMSIZE


SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
PICKLE_WEIGHTS_NAME = "pytorch_model.bin"
PICKLE_WEIGHTS_INDEX_NAME = "pytorch_model.bin.index.json"
CONFIG_NAME = "config.json"

# The safetensors library refuses headers above 100 MB; so do we, before allocating a buffer for a garbage length.
MAX_HEADER_BYTES = 100_000_000


def dtype_class(dtype: str) -> str:
    """The merge-compatibility class of a safetensors dtype string: `"float"`, `"complex"`, `"int"` or `"bool"`.

    Float tensors of different widths (BF16 vs F32) can be merged (the engine computes in fp32); tensors of
    different classes cannot.
    """
    if dtype == "BOOL":
        return "bool"
    if dtype.startswith("C"):
        return "complex"
    if dtype.startswith(("F", "BF")):
        return "float"
    return "int"


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes are, read from a safetensors header (no data read).

    Attributes:
        name: tensor name in the checkpoint.
        dtype: safetensors dtype string, e.g. `"F32"`, `"BF16"`, `"F16"`, `"I64"`.
        shape: tensor shape; `()` for a 0-d tensor.
        file: path of the file that holds the bytes (a pseudo path for in-memory sources).
        offset: absolute byte offset of the first element in `file` (header included).
        nbytes: `numel × itemsize`.
        buffer: only for in-memory sources (`ModelCheckpoint.open(..., allow_pickle=True)`): the bytes, with
            `offset` relative to it. `None` for file-backed tensors.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: str
    offset: int
    nbytes: int
    buffer: Any = field(default=None, compare=False, repr=False)

    @property
    def itemsize(self) -> int:
        return DTYPE_ITEMSIZE[self.dtype]

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def n_rows(self) -> int:
        """Size of the first dimension; a 0-d tensor counts as one row."""
        return self.shape[0] if self.shape else 1

    @property
    def row_numel(self) -> int:
        """Elements per row: `prod(shape[1:])` (1 for 0-d and 1-d tensors)."""
        return math.prod(self.shape[1:])

    @property
    def row_nbytes(self) -> int:
        return self.row_numel * self.itemsize

    @property
    def dtype_class(self) -> str:
        return dtype_class(self.dtype)


@dataclass(frozen=True)
class SafetensorsHeader:
    """A parsed safetensors header: tensors in data-offset order, the optional `__metadata__`, sizes."""

    path: str
    header_size: int
    data_start: int
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str] | None


def _bad(path: str, msg: str) -> ValueError:
    return ValueError(f"{path}: corrupt or unsupported safetensors header: {msg}")


def parse_header_bytes(
    header_json: bytes, data_size: int, path: str, header_size: int | None = None
) -> tuple[dict[str, TensorInfo], dict[str, str] | None]:
    """Validate a header's JSON against a data region of `data_size` bytes and return `(tensors, metadata)`.

    Checks, per tensor: known dtype, non-negative integer shape, `0 ≤ begin ≤ end ≤ data_size`,
    `end − begin == numel × itemsize`, and no two tensors' byte ranges overlap (gaps are tolerated: they cost
    nothing to a reader). `TensorInfo.offset` is absolute: `8 + header_size + begin`.
    """
    header_size = len(header_json) if header_size is None else header_size
    try:
        header = json.loads(header_json.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise _bad(path, f"header is not valid UTF-8 JSON ({err})") from None
    if not isinstance(header, dict):
        raise _bad(path, f"header must be a JSON object, got {type(header).__name__}")
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
    ):
        raise _bad(path, "__metadata__ must map strings to strings")
    data_start = 8 + header_size
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
            raise _bad(path, f"tensor {name!r}: entry must have dtype, shape and data_offsets, got {entry!r}")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in DTYPE_ITEMSIZE:
            raise _bad(path, f"tensor {name!r}: unsupported dtype {dtype!r} (supported: {sorted(DTYPE_ITEMSIZE)})")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise _bad(path, f"tensor {name!r}: shape must be a list of non-negative integers, got {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
            raise _bad(path, f"tensor {name!r}: data_offsets must be two integers, got {offsets!r}")
        begin, end = offsets
        nbytes = math.prod(shape) * DTYPE_ITEMSIZE[dtype]
        if not 0 <= begin <= end:
            raise _bad(path, f"tensor {name!r}: data_offsets {offsets} are not 0 <= begin <= end")
        if end - begin != nbytes:
            raise _bad(
                path,
                f"tensor {name!r}: data_offsets {offsets} span {end - begin} bytes but {dtype}{shape} needs {nbytes}",
            )
        if end > data_size:
            raise _bad(
                path, f"tensor {name!r}: data_offsets {offsets} run past the {data_size}-byte data region (truncated?)"
            )
        tensors[name] = TensorInfo(name, dtype, tuple(shape), path, data_start + begin, nbytes)
    ordered = sorted(tensors.values(), key=lambda t: (t.offset, t.nbytes))
    for prev, cur in itertools.pairwise(ordered):
        if cur.nbytes and prev.offset + prev.nbytes > cur.offset:
            raise _bad(path, f"tensors {prev.name!r} and {cur.name!r} overlap")
    return {t.name: t for t in ordered}, metadata


def parse_safetensors_header(path: str | os.PathLike) -> SafetensorsHeader:
    """Read and validate the header of one `.safetensors` file (reads `8 + header_size` bytes only)."""
    path = str(path)
    file_size = os.path.getsize(path)
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise _bad(path, f"file has {file_size} bytes, fewer than the 8-byte header length")
        (header_size,) = struct.unpack("<Q", prefix)
        if header_size > MAX_HEADER_BYTES:
            raise _bad(path, f"header length {header_size} exceeds {MAX_HEADER_BYTES} bytes")
        if 8 + header_size > file_size:
            raise _bad(path, f"header length {header_size} runs past the end of the file ({file_size} bytes)")
        header_json = f.read(header_size)
    if not header_json.lstrip(b" ").startswith(b"{"):
        raise _bad(path, "header does not start with '{'")
    tensors, metadata = parse_header_bytes(header_json, file_size - 8 - header_size, path, header_size)
    return SafetensorsHeader(path, header_size, 8 + header_size, tensors, metadata)


def _read_json(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: invalid JSON ({err})") from None


@dataclass
class ModelCheckpoint:
    """The tensors of one model checkpoint, described from headers only.

    Attributes:
        path: the folder (or file) given to `open`.
        folder: the folder holding the weights and, when present, `config.json`.
        files: weight files in shard order (index order for sharded checkpoints).
        tensors: `{name: TensorInfo}`, in file order then byte-offset order.
        metadata: `__metadata__` of the first file (e.g. `{"format": "pt"}`), or `None`.
        config: parsed `config.json`, or `None` when the folder has none.
        weight_map: the index's `{name: file name}` for sharded checkpoints, else `None`.
        in_memory: `True` for a pickle checkpoint loaded with `allow_pickle=True` (tensors carry a `buffer`).
    """

    path: str
    folder: str
    files: list[str]
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str] | None = None
    config: dict | None = None
    weight_map: dict[str, str] | None = None
    in_memory: bool = False

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def __repr__(self) -> str:
        return f"ModelCheckpoint({self.path!r}, {len(self.tensors)} tensors, {len(self.files)} file(s))"

    @classmethod
    def open(cls, path: str | os.PathLike, *, allow_pickle: bool = False) -> ModelCheckpoint:
        """Describe a checkpoint from its safetensors headers.

        Accepts a folder with `model.safetensors` or `model.safetensors.index.json` + shards (transformers'
        names; a single file wins when both exist, as in transformers), or a path to one `.safetensors` file.
        Pickle weights (`pytorch_model.bin[.index.json]`, a `.bin` file) are refused unless `allow_pickle=True`:
        unpickling can run code and cannot be read by byte range. With `allow_pickle=True` they are loaded with
        `torch.load(weights_only=True)` into memory and served through the same `TensorInfo` / reader API.
        """
        p = Path(path)
        if p.is_file():
            folder = p.parent
            if p.suffix == ".safetensors":
                return cls._from_safetensors(str(path), folder, [p], None)
            if p.suffix == ".bin":
                return cls._from_pickle(str(path), folder, [p], allow_pickle)
            raise ValueError(f"{path}: expected a folder, a .safetensors file or a .bin file")
        if not p.is_dir():
            raise FileNotFoundError(f"{path}: no such checkpoint folder or file")
        if (p / SAFE_WEIGHTS_NAME).is_file():
            return cls._from_safetensors(str(path), p, [p / SAFE_WEIGHTS_NAME], None)
        if (p / SAFE_WEIGHTS_INDEX_NAME).is_file():
            weight_map = cls._load_weight_map(p / SAFE_WEIGHTS_INDEX_NAME)
            files = [p / f for f in sorted(set(weight_map.values()))]
            return cls._from_safetensors(str(path), p, files, weight_map)
        if (p / PICKLE_WEIGHTS_INDEX_NAME).is_file():
            weight_map = cls._load_weight_map(p / PICKLE_WEIGHTS_INDEX_NAME)
            files = [p / f for f in sorted(set(weight_map.values()))]
            return cls._from_pickle(str(path), p, files, allow_pickle)
        if (p / PICKLE_WEIGHTS_NAME).is_file():
            return cls._from_pickle(str(path), p, [p / PICKLE_WEIGHTS_NAME], allow_pickle)
        found = sorted(f.name for f in p.iterdir() if f.suffix in (".safetensors", ".bin"))
        raise ValueError(
            f"{path}: no {SAFE_WEIGHTS_NAME} or {SAFE_WEIGHTS_INDEX_NAME} (weight files found: {found or 'none'}); "
            "pass the path of a single .safetensors file to use a file with another name"
        )

    @staticmethod
    def _load_weight_map(index_path: Path) -> dict[str, str]:
        index = _read_json(index_path)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"{index_path}: missing or invalid 'weight_map'")
        for shard in set(weight_map.values()):
            if Path(shard).name != shard:  # a shard name must not escape the folder
                raise ValueError(f"{index_path}: shard name {shard!r} is not a plain file name")
            if not (index_path.parent / shard).is_file():
                raise ValueError(f"{index_path}: shard {shard!r} listed in weight_map does not exist")
        return weight_map

    @staticmethod
    def _load_config(folder: Path) -> dict | None:
        config_path = folder / CONFIG_NAME
        return _read_json(config_path) if config_path.is_file() else None

    @classmethod
    def _from_safetensors(
        cls, path: str, folder: Path, files: list[Path], weight_map: dict[str, str] | None
    ) -> ModelCheckpoint:
        tensors: dict[str, TensorInfo] = {}
        metadata = None
        for i, file in enumerate(files):
            header = parse_safetensors_header(file)
            if i == 0:
                metadata = header.metadata
            for name, info in header.tensors.items():
                if name in tensors:
                    raise ValueError(f"{path}: tensor {name!r} is stored in both {tensors[name].file} and {file}")
                tensors[name] = info
        if weight_map is not None:
            cls._check_index(path, weight_map, tensors)
        return cls(path, str(folder), [str(f) for f in files], tensors, metadata, cls._load_config(folder), weight_map)

    @staticmethod
    def _check_index(path: str, weight_map: dict[str, str], tensors: dict[str, TensorInfo]) -> None:
        """The index must list exactly the tensors in the shard headers, each in the shard that holds it."""
        problems = []
        for name, shard in weight_map.items():
            if name not in tensors:
                problems.append(f"{name!r} is in weight_map (shard {shard!r}) but in no shard header")
            elif Path(tensors[name].file).name != shard:
                problems.append(f"{name!r} is mapped to {shard!r} but stored in {Path(tensors[name].file).name!r}")
        for name, info in tensors.items():
            if name not in weight_map:
                problems.append(f"{name!r} is in shard {Path(info.file).name!r} but not in weight_map")
        if problems:
            shown = "; ".join(problems[:10]) + (f"; ... ({len(problems)} in all)" if len(problems) > 10 else "")
            raise ValueError(f"{path}: {SAFE_WEIGHTS_INDEX_NAME} does not match the shard headers: {shown}")

    @classmethod
    def _from_pickle(cls, path: str, folder: Path, files: list[Path], allow_pickle: bool) -> ModelCheckpoint:
        if not allow_pickle:
            raise ValueError(
                f"{path}: only pickle weights ({', '.join(f.name for f in files)}) and no safetensors. Pickle files "
                "can run arbitrary code when loaded and cannot be streamed by byte range. Convert them to "
                "safetensors (e.g. `model.save_pretrained(dir)`), or pass allow_pickle=True to load them into memory "
                "with torch.load(weights_only=True)."
            )
        tensors = _load_pickle_tensors(files)
        return cls(path, str(folder), [str(f) for f in files], tensors, None, cls._load_config(folder), None, True)


def _load_pickle_tensors(files: list[Path]) -> dict[str, TensorInfo]:
    """Load `.bin` state dicts and pack each file's tensors into one contiguous byte buffer.

    Each `TensorInfo` points into its file's buffer (`offset` relative to the buffer), so the reader serves
    in-memory and on-disk tensors through the same code. Offsets follow the state dict's order, which the planner
    uses as "file order".
    """
    import torch

    from .dtypes import torch_dtypes

    to_safetensors = {v: k for k, v in torch_dtypes().items()}
    tensors: dict[str, TensorInfo] = {}
    for file in files:
        state = torch.load(file, map_location="cpu", weights_only=True)
        if not isinstance(state, dict):
            raise ValueError(f"{file}: expected a state dict, got {type(state).__name__}")
        items = []
        for name, t in state.items():
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{file}: entry {name!r} is a {type(t).__name__}, not a tensor")
            if t.dtype not in to_safetensors:
                raise ValueError(f"{file}: tensor {name!r} has unsupported dtype {t.dtype}")
            if name in tensors:
                raise ValueError(f"{file}: tensor {name!r} is stored in more than one file")
            items.append((name, t))
        total = sum(t.numel() * t.element_size() for _, t in items)
        buffer = torch.empty(total, dtype=torch.uint8)
        offset = 0
        for name, t in items:
            nbytes = t.numel() * t.element_size()
            if nbytes:
                buffer[offset : offset + nbytes].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
            tensors[name] = TensorInfo(
                name, to_safetensors[t.dtype], tuple(t.shape), str(file), offset, nbytes, buffer=buffer
            )
            offset += nbytes
        del state, items  # the packed buffer is now the only copy
    return tensors
