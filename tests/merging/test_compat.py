"""Compatibility checks from headers and byte sizes (`hf_stable.merging.compat`)."""

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from hf_stable.merging.compat import check_compatible, check_equal_nonfloat, check_sources, parse_size
from hf_stable.merging.io.header import ModelCheckpoint
from hf_stable.merging.io.reader import SafetensorsReader


# ---------------------------------------------------------------------------------------------------------------
# parse_size


@pytest.mark.parametrize(
    "value, expected",
    [
        (4096, 4096),
        (0, 0),
        ("4096", 4096),
        ("10B", 10),
        ("2GB", 2_000_000_000),
        ("2GiB", 2 * 2**30),
        ("2 gib", 2 * 2**30),
        ("512MB", 512_000_000),
        ("512MiB", 512 * 2**20),
        ("5kb", 5000),
        ("3KiB", 3072),
        ("1TB", 10**12),
        ("1.5GB", 1_500_000_000),
        ("1.1GB", 1_100_000_000),
        ("0.5GiB", 2**29),
    ],
)
def test_parse_size(value, expected):
    assert parse_size(value) == expected


@pytest.mark.parametrize("value", ["2G", "abc", "", "GB", "-3GB", "2 XB", "1e9", -1, 1.5, True, None])
def test_parse_size_rejects(value):
    with pytest.raises(ValueError, match=repr(value).replace("(", r"\(").replace(".", r"\.")):
        parse_size(value)


def test_parse_size_bare_unit_hint():
    with pytest.raises(ValueError, match="GiB for 2\\^30"):
        parse_size("2G")


# ---------------------------------------------------------------------------------------------------------------
# checkpoints for the compatibility tests


def _save(folder, tensors, config=None, shards=None):
    """Save `tensors` (optionally as `shards`: list of name lists) plus a config.json; return the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    if shards is None:
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, names in enumerate(shards, 1):
            file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file({n: tensors[n] for n in names}, str(folder / file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(names, file))
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    return ModelCheckpoint.open(folder)


def _model(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(10, 4, generator=g).to(dtype),
        "model.layers.0.mlp.weight": torch.randn(6, 4, generator=g).to(dtype),
        "model.layers.0.norm.weight": torch.randn(4, generator=g).to(dtype),
        "model.position_ids": torch.arange(8),
        "model.mask": torch.tensor([True, False, True]),
        "lm_head.weight": torch.randn(10, 4, generator=g).to(dtype),
    }


def test_check_compatible_ok(tmp_path):
    a = _save(tmp_path / "a", _model(0), {"tie_word_embeddings": False})
    b = _save(tmp_path / "b", _model(1, torch.bfloat16), {"tie_word_embeddings": False})  # float widths may differ
    report = check_compatible({"a": a, "b": b}, reference="a")
    assert report.out_names == list(a.tensors)  # reference file order
    assert set(report.float_names) == {n for n, t in _model().items() if t.is_floating_point()}
    assert set(report.copy_names) == {"model.position_ids", "model.mask"}
    assert sorted(report.float_names + report.copy_names) == sorted(report.out_names) and not report.dropped
    assert report.infos["lm_head.weight"].dtype == "F32"  # the reference's dtype
    assert check_compatible({"b": b, "a": a}, reference="b").infos["lm_head.weight"].dtype == "BF16"
    with pytest.raises(ValueError, match=r"reference 'c' is not one of the models: \['a', 'b'\]"):
        check_compatible({"a": a, "b": b}, reference="c")


def test_check_compatible_shape_mismatch(tmp_path):
    t = _model(1)
    t["model.layers.0.mlp.weight"] = torch.randn(6, 5)
    a, b = _save(tmp_path / "a", _model(0)), _save(tmp_path / "b", t)
    with pytest.raises(ValueError) as err:
        check_compatible({"base": a, "other": b}, reference="base")
    msg = str(err.value)
    assert "'model.layers.0.mlp.weight'" in msg and "[6, 4]" in msg and "[6, 5]" in msg
    assert "'base'" in msg and "'other'" in msg


def test_check_compatible_missing_and_extra(tmp_path):
    ref = {f"layer.{i}.weight": torch.zeros(2) for i in range(8)}
    other = {f"layer.{i}.weight": torch.zeros(2) for i in range(1)}
    other["extra.bias"] = torch.zeros(2)
    a, b = _save(tmp_path / "a", ref), _save(tmp_path / "b", other)
    with pytest.raises(ValueError) as err:
        check_compatible({"a": a, "b": b}, reference="a")
    msg = str(err.value)
    assert "model 'b' lacks 7 tensor(s) of reference 'a'" in msg
    assert "'layer.1.weight', 'layer.2.weight', 'layer.3.weight', 'layer.4.weight', 'layer.5.weight'" in msg
    assert "'layer.6.weight'" not in msg and "(7 in all)" in msg  # at most 5 names listed
    assert "model 'b' has 1 tensor(s) that reference 'a' lacks: 'extra.bias'" in msg


def test_check_compatible_dtype_class(tmp_path):
    t = _model(0)
    t["model.position_ids"] = t["model.position_ids"].float()
    a, b = _save(tmp_path / "a", _model(0)), _save(tmp_path / "b", t)
    with pytest.raises(ValueError, match=r"'model\.position_ids': dtype I64 \(int\) in 'a' but F32 \(float\) in 'b'"):
        check_compatible({"a": a, "b": b}, reference="a")


@pytest.mark.parametrize("reference", ["untied_store", "tied"])
def test_check_compatible_tied_embeddings(tmp_path, reference):
    full = _model(0)
    without = {k: v for k, v in _model(1).items() if k != "lm_head.weight"}
    # A model saved tied (no lm_head) merged with one that stores lm_head but is tied too: lm_head is dropped.
    a = _save(tmp_path / "a", full, {"tie_word_embeddings": True})
    b = _save(tmp_path / "b", without, {"tie_word_embeddings": True})
    ckpts = {"untied_store": a, "tied": b}
    report = check_compatible(ckpts, reference=reference)
    assert "lm_head.weight" in report.dropped and "lm_head.weight" not in report.out_names
    assert "model.embed_tokens.weight" in report.float_names
    # Config silent about tying: still accepted (a checkpoint without lm_head is tied by construction).
    c = _save(tmp_path / "c", full, {})
    assert "lm_head.weight" in check_compatible({"c": c, "tied": b}, reference="c").dropped
    # One model explicitly untied: its lm_head is a real weight, merging it with an embedding would be wrong.
    d = _save(tmp_path / "d", full, {"tie_word_embeddings": False})
    with pytest.raises(ValueError, match=r"'lm_head\.weight'.*\['d'\].*tie_word_embeddings=false"):
        check_compatible({"d": d, "tied": b}, reference="d")
    # Multimodal configs keep the flag in text_config.
    e = _save(tmp_path / "e", without, {"text_config": {"tie_word_embeddings": False}})
    with pytest.raises(ValueError, match="tie_word_embeddings=false"):
        check_compatible({"a": a, "e": e}, reference="a")


def test_check_equal_nonfloat(tmp_path):
    a = _save(tmp_path / "a", _model(0))
    b = _save(tmp_path / "b", _model(1))  # same ints and bools, different floats
    t = _model(2)
    t["model.position_ids"] = torch.tensor([0, 1, 2, 3, 4, 9, 6, 7])
    c = _save(tmp_path / "c", t)
    report = check_compatible({"a": a, "b": b, "c": c}, reference="a")
    readers = {m: SafetensorsReader(ck) for m, ck in {"a": a, "b": b, "c": c}.items()}
    try:
        check_equal_nonfloat({"a": readers["a"], "b": readers["b"]}, report.copy_names)
        with pytest.raises(ValueError, match=r"'model\.position_ids'.*'a' and 'c'.*flat index 5: 5 vs 9"):
            check_equal_nonfloat(readers, report.copy_names, chunk_bytes=16)  # 2 rows per chunk
    finally:
        for r in readers.values():
            r.close()


def test_check_sources_names_the_output_and_both_models(tmp_path):
    a = _save(tmp_path / "a", _model(0))
    t = _model(1)
    t["model.layers.0.mlp.weight"] = torch.randn(6, 5)
    b = _save(tmp_path / "b", t)
    ckpts = {"a": a, "b": b}
    check_sources({"x": [("a", "model.layers.0.norm.weight"), ("b", "model.layers.0.norm.weight")]}, ckpts)
    with pytest.raises(ValueError, match=r"output tensor 'y': shape \[6, 4\] .* in 'a' but \[6, 5\] .* in 'b'"):
        check_sources({"y": [("a", "model.layers.0.mlp.weight"), ("b", "model.layers.0.mlp.weight")]}, ckpts)
    with pytest.raises(ValueError, match=r"output tensor 'z': model 'b' has no tensor 'model.layers.7.w'"):
        check_sources({"z": [("a", "model.mask"), ("b", "model.layers.7.w")]}, ckpts)


def test_compat_imports_no_torch():
    code = "import sys, hf_stable.merging.compat, hf_stable.merging.io.header; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
