"""Writing a text file so that a reader never sees half of it: a temporary file in the same folder, then a rename."""

from __future__ import annotations

import os
import tempfile


def write_text_atomic(path: str | os.PathLike, text: str) -> str:
    """Write ``text`` (UTF-8) to ``path`` through a temporary file in its folder and ``os.replace``, creating the
    folder; on any failure the temporary file is removed and ``path`` is left as it was. Returns the path."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=os.path.basename(path))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return path
