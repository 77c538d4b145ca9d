"""Tests of the merge engine's safetensors I/O (`hf_stable.merging.io.reader` / `.writer`).

Oracles are independent: `safetensors.safe_open` / `load_file` / `save_file` and transformers' `from_pretrained`.
"""

import json
import os
import random
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from hf_stable.merging.io.header import ModelCheckpoint
from hf_stable.merging.io.reader import TORCH_DTYPES, SafetensorsReader
from hf_stable.merging.io.writer import OutputSpec, StreamingSafetensorsWriter


def _bytes(t: torch.Tensor) -> bytes:
    """Raw bytes of a tensor (any dtype, 0-d included), for bitwise comparisons."""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _sample_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "f32": torch.randn(7, 5, generator=g),
        "bf16": torch.randn(9, 3, 2, generator=g).to(torch.bfloat16),
        "f16": torch.randn(6, 4, generator=g).to(torch.float16),
        "i64": torch.randint(-(2**40), 2**40, (5, 3), generator=g),
        "vec": torch.randn(11, generator=g),
        "scalar": torch.tensor(3.25),
        "mask": torch.rand(4, 3, generator=g) > 0.5,
    }


# ---------------------------------------------------------------------------------------------------------------
# reader


@pytest.fixture
def single_file(tmp_path):
    tensors = _sample_tensors()
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    return tmp_path, tensors


@pytest.mark.parametrize("name", ["f32", "bf16", "f16", "i64", "vec", "mask"])
def test_read_rows_equals_safe_open_slice(single_file, name):
    folder, tensors = single_file
    ckpt = ModelCheckpoint.open(folder)
    n = tensors[name].shape[0]
    ranges = [(0, n), (0, 1), (n - 1, n), (1, n - 1), (2, 2)]
    with SafetensorsReader(ckpt) as reader, safe_open(str(folder / "model.safetensors"), "pt") as f:
        for a, b in ranges:
            got = reader.read_rows(name, a, b)
            want = f.get_slice(name)[a:b]
            assert got.dtype == want.dtype == tensors[name].dtype
            assert got.shape == want.shape == (b - a, *tensors[name].shape[1:])
            assert _bytes(got) == _bytes(want)


def test_read_tensor_all_dtypes_and_zero_d(single_file):
    folder, tensors = single_file
    with SafetensorsReader(ModelCheckpoint.open(folder)) as reader:
        for name, t in tensors.items():
            got = reader.read_tensor(name)
            assert got.dtype == t.dtype and got.shape == t.shape, name
            assert _bytes(got) == _bytes(t), name
        # 0-d: one row, read as (0, 1) with shape (1,) as the contract says; read_tensor keeps shape ().
        row = reader.read_rows("scalar", 0, 1)
        assert row.shape == (1,) and row.item() == 3.25
        assert reader.read_tensor("scalar").shape == ()
        assert reader.bytes_read == sum(t.numel() * t.element_size() for t in tensors.values()) + 2 * 4


def test_read_more_dtypes(tmp_path):
    """Every dtype safetensors and torch share round-trips bitwise (fp8, unsigned, complex, f64)."""
    g = torch.Generator().manual_seed(1)
    base = torch.randn(4, 6, generator=g)
    tensors = {}
    for st, dt in TORCH_DTYPES.items():
        if dt.is_floating_point:
            tensors[st] = base.to(dt)
        elif dt.is_complex:
            tensors[st] = torch.complex(base, -base).to(dt)
        elif dt == torch.bool:
            tensors[st] = base > 0
        else:
            tensors[st] = torch.randint(0, 100, (4, 6), generator=g).to(dt)
    try:
        save_file(tensors, str(tmp_path / "model.safetensors"))
    except Exception as err:  # an old safetensors may lack some fp8 variants: keep the ones it has
        pytest.skip(f"safetensors cannot save every dtype here: {err}")
    with SafetensorsReader(ModelCheckpoint.open(tmp_path)) as reader:
        for name, t in tensors.items():
            assert _bytes(reader.read_rows(name, 1, 3)) == _bytes(t[1:3]), name


def test_sharded_checkpoint(tmp_path):
    tensors = _sample_tensors(seed=2)
    names = list(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:3], "model-00002-of-00002.safetensors": names[3:]}
    weight_map = {}
    for file, ns in shards.items():
        save_file({n: tensors[n] for n in ns}, str(tmp_path / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(ns, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    ckpt = ModelCheckpoint.open(tmp_path)
    assert len(ckpt.files) == 2
    with SafetensorsReader(ckpt) as reader:
        for name, t in tensors.items():
            assert _bytes(reader.read_tensor(name)) == _bytes(t), name
            with safe_open(str(tmp_path / weight_map[name]), "pt") as f:
                if t.dim():
                    assert _bytes(reader.read_rows(name, 1, 3)) == _bytes(f.get_slice(name)[1:3])
        assert len(reader._fds) == 2  # one cached descriptor per shard, however many reads


def test_pickle_in_memory(tmp_path):
    tensors = _sample_tensors(seed=3)
    torch.save(tensors, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="allow_pickle"):
        ModelCheckpoint.open(tmp_path)
    ckpt = ModelCheckpoint.open(tmp_path, allow_pickle=True)
    assert ckpt.in_memory
    with SafetensorsReader(ckpt) as reader:
        for name, t in tensors.items():
            got = reader.read_tensor(name)
            assert got.dtype == t.dtype and got.shape == t.shape
            assert _bytes(got) == _bytes(t), name
        rows = reader.read_rows("f32", 2, 5)
        assert torch.equal(rows, tensors["f32"][2:5])
        rows.zero_()  # the result is a copy: the in-memory checkpoint is unchanged
        assert torch.equal(reader.read_rows("f32", 2, 5), tensors["f32"][2:5])


def test_reader_out_buffer_drop_cache_and_errors(single_file):
    folder, tensors = single_file
    ckpt = ModelCheckpoint.open(folder)
    reader = SafetensorsReader(ckpt, drop_cache=True)
    buf = torch.empty(1000, dtype=torch.uint8)
    got = reader.read_rows("bf16", 3, 7, out=buf)
    assert got.data_ptr() == buf.data_ptr()
    assert torch.equal(got, tensors["bf16"][3:7])
    with pytest.raises(ValueError, match="at least"):
        reader.read_rows("bf16", 0, 9, out=torch.empty(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"'f32'.*\[3, 9\)"):
        reader.read_rows("f32", 3, 9)
    with pytest.raises(ValueError, match="not within"):
        reader.read_rows("f32", 4, 2)
    with pytest.raises(KeyError, match="nope"):
        reader.read_rows("nope", 0, 1)
    reader.close()
    reader.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        reader.read_rows("f32", 0, 1)


def test_truncated_file_raises(single_file):
    folder, _ = single_file
    ckpt = ModelCheckpoint.open(folder)
    path = folder / "model.safetensors"
    os.truncate(path, os.path.getsize(path) - 8)  # header now lies about the data region
    last = max(ckpt.tensors.values(), key=lambda t: t.offset)
    with SafetensorsReader(ckpt) as reader, pytest.raises(OSError, match="end of file"):
        reader.read_tensor(last.name)


# ---------------------------------------------------------------------------------------------------------------
# writer


def _specs(tensors):
    inv = {v: k for k, v in TORCH_DTYPES.items()}
    return [OutputSpec(n, inv[t.dtype], tuple(t.shape)) for n, t in tensors.items()]


def _write_in_tiles(writer, tensors, rows_per_tile=2, seed=0):
    """Write every tensor in row tiles, in a shuffled order (the writer must not care)."""
    jobs = []
    for name, t in tensors.items():
        if t.dim() == 0:
            jobs.append((name, 0, t))
            continue
        for a in range(0, max(1, t.shape[0]), rows_per_tile):
            jobs.append((name, a, t[a : a + rows_per_tile].contiguous()))
    random.Random(seed).shuffle(jobs)
    for name, a, tile in jobs:
        writer.write_rows(name, a, tile)


def test_writer_matches_save_file(tmp_path):
    tensors = _sample_tensors(seed=4)
    out = tmp_path / "out"
    writer = StreamingSafetensorsWriter(out, _specs(tensors), max_shard_size=10**9)
    _write_in_tiles(writer, tensors)
    assert writer.bytes_written == sum(t.numel() * t.element_size() for t in tensors.values())
    assert writer.finalize() == [str(out / "model.safetensors")]
    assert sorted(os.listdir(out)) == ["model.safetensors"]

    save_file(tensors, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    ours, ref = load_file(str(out / "model.safetensors")), load_file(str(tmp_path / "ref.safetensors"))
    assert list(ours) == list(tensors)  # names kept in the given order
    for name in tensors:
        assert ours[name].dtype == ref[name].dtype and ours[name].shape == ref[name].shape
        assert _bytes(ours[name]) == _bytes(ref[name]), name

    with open(out / "model.safetensors", "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    assert (8 + header_len) % 8 == 0
    assert header["__metadata__"] == {"format": "pt"}
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert _bytes(f.get_slice("bf16")[2:5]) == _bytes(tensors["bf16"][2:5])
    # Our own header parser accepts it too (contiguous, non-overlapping, right sizes).
    assert list(ModelCheckpoint.open(out).tensors) == list(tensors)


def test_writer_sharding_and_index(tmp_path):
    tensors = _sample_tensors(seed=5)
    sizes = {n: t.numel() * t.element_size() for n, t in tensors.items()}
    limit = 150
    out = tmp_path / "out"
    writer = StreamingSafetensorsWriter(out, _specs(tensors), max_shard_size=limit)
    _write_in_tiles(writer, tensors, rows_per_tile=3, seed=1)
    paths = writer.finalize()
    n = len(paths) - 1
    assert n > 1
    names = [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert [os.path.basename(p) for p in paths] == [*names, "model.safetensors.index.json"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(sizes.values())
    assert set(index["weight_map"]) == set(tensors)
    # Greedy split in order: every shard is within the limit unless it holds a single tensor over the limit.
    for file in names:
        in_shard = [n for n, f in index["weight_map"].items() if f == file]
        assert sum(sizes[n] for n in in_shard) <= limit or len(in_shard) == 1
        loaded = load_file(str(out / file))
        assert set(loaded) == set(in_shard)
        for name in in_shard:
            assert _bytes(loaded[name]) == _bytes(tensors[name])
    ckpt = ModelCheckpoint.open(out)  # validates the index against the shard headers
    assert list(ckpt.tensors) == list(tensors)


def test_writer_refuses_bad_tiles(tmp_path):
    specs = [OutputSpec("w", "BF16", (4, 3)), OutputSpec("s", "F32", ()), OutputSpec("ids", "I64", (5,))]
    writer = StreamingSafetensorsWriter(tmp_path / "out", specs, max_shard_size=10**6)
    w = torch.randn(4, 3).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"'w'.*dtype"):
        writer.write_rows("w", 0, w.float())
    with pytest.raises(ValueError, match=r"'w'.*shape"):
        writer.write_rows("w", 0, torch.zeros(2, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"'w'.*contiguous"):
        writer.write_rows("w", 0, torch.zeros(3, 2, dtype=torch.bfloat16).t())
    with pytest.raises(ValueError, match=r"'w'.*not within"):
        writer.write_rows("w", 3, w[:2].contiguous())
    with pytest.raises(KeyError, match="nope"):
        writer.write_rows("nope", 0, w)
    writer.write_rows("w", 0, w[:2].contiguous())
    with pytest.raises(ValueError, match=r"'w'.*rows \[1, 3\) overlap rows \[0, 2\)"):
        writer.write_rows("w", 1, w[1:3].contiguous())
    writer.write_rows("s", 0, torch.tensor(1.5))
    with pytest.raises(ValueError, match="overlap"):
        writer.write_rows("s", 0, torch.tensor([1.5]))
    # finalize names every incomplete tensor and its missing rows.
    with pytest.raises(ValueError, match=r"'w' rows \[\(2, 4\)\]; 'ids' rows \[\(0, 5\)\]"):
        writer.finalize()
    writer.write_rows("w", 2, w[2:].contiguous())
    writer.write_rows("ids", 0, torch.arange(5))
    writer.finalize()
    loaded = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert torch.equal(loaded["w"], w) and loaded["s"].item() == 1.5 and loaded["s"].shape == ()
    with pytest.raises(ValueError, match="finalized"):
        writer.write_rows("ids", 0, torch.arange(5))


def test_writer_spec_validation_and_abort(tmp_path):
    with pytest.raises(ValueError, match="dtype 'F33'"):
        OutputSpec("x", "F33", (2,))
    with pytest.raises(ValueError, match="shape"):
        OutputSpec("x", "F32", (2, -1))
    with pytest.raises(ValueError, match="twice"):
        StreamingSafetensorsWriter(tmp_path, [OutputSpec("x", "F32", (2,))] * 2, max_shard_size=100)
    with pytest.raises(ValueError, match="max_shard_size"):
        StreamingSafetensorsWriter(tmp_path, [OutputSpec("x", "F32", (2,))], max_shard_size="5GB")
    out = tmp_path / "out"
    with StreamingSafetensorsWriter(out, [OutputSpec("x", "F32", (2,))], max_shard_size=100) as writer:
        assert os.path.exists(out / "model.safetensors")
        writer.write_rows("x", 0, torch.ones(1))
    # leaving the block without finalize() removes the incomplete output
    assert not os.path.exists(out / "model.safetensors")


def test_writer_empty_tensor(tmp_path):
    """A tensor with no elements needs no write; finalize does not call it missing."""
    tensors = {"empty": torch.zeros(0, 4), "x": torch.ones(2, 2)}
    writer = StreamingSafetensorsWriter(tmp_path / "o", _specs(tensors), max_shard_size=10**6)
    writer.write_rows("x", 0, tensors["x"])
    writer.finalize()
    loaded = load_file(str(tmp_path / "o" / "model.safetensors"))
    assert loaded["empty"].shape == (0, 4) and torch.equal(loaded["x"], tensors["x"])


# ---------------------------------------------------------------------------------------------------------------
# reader → writer → transformers


@pytest.fixture(scope="module")
def tiny_saved(tmp_path_factory):
    from hf_stable.testing import build_tiny_model

    folder = tmp_path_factory.mktemp("tiny")
    model, _ = build_tiny_model(
        folder,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        dtype=torch.bfloat16,
    )
    return folder, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("max_shard_size", [10**9, 3000])
def test_stream_copy_loads_with_from_pretrained(tiny_saved, tmp_path, max_shard_size):
    from transformers import AutoModelForCausalLM

    folder, state = tiny_saved
    ckpt = ModelCheckpoint.open(folder)
    out = tmp_path / "merged"
    specs = [OutputSpec(n, i.dtype, i.shape) for n, i in ckpt.tensors.items()]
    with SafetensorsReader(ckpt) as reader:
        writer = StreamingSafetensorsWriter(out, specs, max_shard_size=max_shard_size)
        for name, info in ckpt.tensors.items():
            for a in range(0, info.n_rows, 7):  # odd tile size: tiles straddle nothing but are not aligned to 8
                b = min(info.n_rows, a + 7)
                writer.write_rows(name, a, reader.read_rows(name, a, b))
        paths = writer.finalize()
    assert (len(paths) > 1) == (max_shard_size == 3000)
    (out / "config.json").write_bytes((folder / "config.json").read_bytes())
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    loaded = model.state_dict()
    assert set(loaded) == set(state)
    for name, t in state.items():
        assert loaded[name].dtype == t.dtype
        assert torch.equal(loaded[name], t), name


def test_small_requests_and_threads(tmp_path, monkeypatch):
    """Requests split into many short preads/pwrites (tiny MAX_REQUEST_BYTES) and concurrent tile I/O from a thread
    pool (as the engine does) still give exact bytes."""
    from concurrent.futures import ThreadPoolExecutor

    import hf_stable.merging.io.reader as reader_mod
    import hf_stable.merging.io.writer as writer_mod

    monkeypatch.setattr(reader_mod, "MAX_REQUEST_BYTES", 7)
    monkeypatch.setattr(writer_mod, "MAX_REQUEST_BYTES", 7)
    tensors = {"a": torch.randn(64, 9).to(torch.bfloat16), "b": torch.randn(33, 5)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    ckpt = ModelCheckpoint.open(tmp_path)
    tiles = [(n, a, min(a + 4, t.shape[0])) for n, t in tensors.items() for a in range(0, t.shape[0], 4)]
    out = tmp_path / "out"
    writer = StreamingSafetensorsWriter(out, _specs(tensors), max_shard_size=10**6)
    with SafetensorsReader(ckpt) as reader, ThreadPoolExecutor(4) as pool:

        def copy(job):
            name, a, b = job
            tile = reader.read_rows(name, a, b)
            assert _bytes(tile) == _bytes(tensors[name][a:b])
            writer.write_rows(name, a, tile)

        list(pool.map(copy, tiles))
        assert reader.bytes_read == sum(t.numel() * t.element_size() for t in tensors.values())
    writer.finalize()
    loaded = load_file(str(out / "model.safetensors"))
    for name, t in tensors.items():
        assert _bytes(loaded[name]) == _bytes(t)


def test_writer_flushes_early_in_the_background_and_reports_a_failed_flush(tmp_path, monkeypatch):
    """Past `EARLY_SYNC_BYTES` unflushed bytes a background thread flushes the shard while writing goes on (so the
    final fsync waits for the tail only); the output is unchanged, and an error of that flush is raised by
    `finalize` (the flush may have consumed the file's error, so the final fsync alone would not see it)."""
    import hf_stable.merging.io.writer as writer_mod

    tensors = _sample_tensors(seed=5)
    monkeypatch.setattr(writer_mod, "EARLY_SYNC_BYTES", 64)
    flushed = []
    real = os.fdatasync

    def counted(fd):
        flushed.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fdatasync", counted)
    writer = StreamingSafetensorsWriter(tmp_path / "out", _specs(tensors), max_shard_size=10**9)
    _write_in_tiles(writer, tensors)
    writer.finalize()
    assert flushed
    save_file(tensors, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    ours, ref = load_file(str(tmp_path / "out" / "model.safetensors")), load_file(str(tmp_path / "ref.safetensors"))
    assert list(ours) == list(tensors) and all(_bytes(ours[n]) == _bytes(ref[n]) for n in tensors)

    def failing(fd):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fdatasync", failing)
    writer = StreamingSafetensorsWriter(tmp_path / "bad", _specs(tensors), max_shard_size=10**9)
    _write_in_tiles(writer, tensors)
    with pytest.raises(OSError, match="flushing the output failed"):
        writer.finalize()
    writer.abort()
    assert not (tmp_path / "bad" / "model.safetensors").exists()
