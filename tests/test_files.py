"""`hf_stable._files.write_text_atomic`: the whole text or the old file, never half, and no temporary file left."""

import os

import pytest

from hf_stable._files import write_text_atomic


def test_writes_creates_the_folder_and_replaces(tmp_path):
    path = tmp_path / "sub" / "report.json"
    assert write_text_atomic(path, "first ü\n") == str(path)
    assert path.read_text(encoding="utf-8") == "first ü\n"
    write_text_atomic(str(path), "second")
    assert path.read_text(encoding="utf-8") == "second"
    assert os.listdir(path.parent) == ["report.json"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "card.md"
    path.write_text("old")
    with pytest.raises(TypeError):
        write_text_atomic(path, b"not text")  # fails inside the write, after the temporary file exists
    assert path.read_text() == "old"
    assert os.listdir(tmp_path) == ["card.md"]
