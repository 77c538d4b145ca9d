"""Push a finished merge folder to the Hugging Face Hub.

`HfApi.create_repo(exist_ok=True)`, then one `HfApi.upload_folder` restricted (`allow_patterns`) to the files of
the merged model: weight shards, the shard index, `config.json`, `generation_config.json`, tokenizer files, the card
(`README.md`), the recipe (`hf_stable_merge.yaml`) and `merge_diagnostics.json`. `upload_folder` is resumable and
splits very large folders into several commits (huggingface_hub ≥ 1.0 with `hf_xet`), so re-running an
interrupted push continues it.

Only the main process pushes (DESIGN.md "Distributed is normal"); other ranks return None. The token is handed to
`HfApi` and nowhere else — never written, printed or logged — and a folder holding a file that contains the token is
refused before anything is uploaded. The scan uses the token the push will use: the one given, else the locally
saved one (`huggingface_hub.get_token()`: `HF_TOKEN` or `hf auth login`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any


logger = logging.getLogger(__name__)

# Never uploaded: partial writes, locks, caches, and hidden files/folders (`.cache/huggingface` from downloads).
_EXCLUDED_SUFFIXES = (".tmp", ".lock", ".partial", ".incomplete")
# Text files scanned for a leaked token before upload (weights are binary and written by the engine).
_TEXT_SUFFIXES = (".json", ".yaml", ".yml", ".md", ".txt", ".jinja", ".py", ".model", ".tiktoken")
_MAX_SCANNED_BYTES = 64 * 1024**2


def upload_files(folder: str | os.PathLike) -> list[str]:
    """The files of ``folder`` to upload (POSIX paths relative to it, sorted); checks the folder is a finished merge.

    Raises:
        FileNotFoundError: ``folder`` does not exist.
        ValueError: no weights (`*.safetensors`), no `config.json`, or a shard named by the index is missing.
    """
    root = Path(folder)
    if not root.is_dir():
        raise FileNotFoundError(f"push: {os.fspath(folder)!r} is not a folder")
    files = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if any(part.startswith(".") for part in rel.parts) or not path.is_file() or path.is_symlink():
            continue
        if path.name.endswith(_EXCLUDED_SUFFIXES):
            continue
        files.append(rel.as_posix())
    if not any(f.endswith(".safetensors") for f in files):
        raise ValueError(f"push: {os.fspath(folder)!r} holds no *.safetensors weights; is the merge finished?")
    if "config.json" not in files:
        raise ValueError(f"push: {os.fspath(folder)!r} has no config.json; transformers could not load it")
    index = root / "model.safetensors.index.json"
    if index.is_file():
        import json

        shards = set(json.loads(index.read_text())["weight_map"].values())
        missing = sorted(shards - set(files))
        if missing:
            raise ValueError(f"push: shards named by model.safetensors.index.json are missing: {missing}")
    return files


def check_no_token(folder: str | os.PathLike, files: Iterable[str], token: str | None) -> None:
    """Raise `ValueError` naming the first text file of ``files`` that contains ``token`` (no-op without a token)."""
    if not token:
        return
    needle = token.encode()
    for rel in files:
        path = Path(folder) / rel
        if not rel.endswith(_TEXT_SUFFIXES) and not rel.startswith("tokenizer"):
            continue
        if path.stat().st_size > _MAX_SCANNED_BYTES:
            continue
        if needle in path.read_bytes():
            raise ValueError(f"push refused: {rel} contains the Hub token; remove it from the file and retry")


def _glob_literal(name: str) -> str:
    """``name`` as an `fnmatch` pattern that matches only itself (`[`, `]`, `*`, `?` bracketed)."""
    return "".join(f"[{c}]" if c in "[]*?" else c for c in name)


def push_merged(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    token: str | None = None,
    commit_message: str = "Upload merged model (hf_stable)",
    create_pr: bool = False,
    api: Any = None,
) -> Any:
    """Upload the merged model in ``folder`` to the model repository ``repo_id``.

    Args:
        folder: a finished merge output (see [`upload_files`] for what is uploaded).
        repo_id: `user/name` or `org/name`; created if missing (`exist_ok=True`).
        private: create the repository private (an existing repository keeps its visibility).
        revision: branch to commit to (created from the default branch if missing); default the main branch.
        token: Hub token; default the locally saved one (`hf auth login` / `HF_TOKEN`). Passed to `HfApi` only.
        commit_message: the commit title.
        create_pr: open a pull request instead of committing to the branch.
        api: an `HfApi` instance (tests pass a recording subclass); default `HfApi(token=token)`.

    Returns:
        The `CommitInfo` of `upload_folder` on the main process; None on the other ranks.
    """
    from hf_stable.distributed import is_main_process

    if not is_main_process():
        return None
    if not isinstance(repo_id, str) or repo_id.count("/") > 1 or not repo_id.strip("/"):
        raise ValueError(f"push: repo_id must look like 'user/name', got {repo_id!r}")
    files = upload_files(folder)
    from huggingface_hub import get_token

    check_no_token(folder, files, token or get_token())
    if api is None:
        from huggingface_hub import HfApi

        api = HfApi(token=token)
    url = api.create_repo(repo_id, token=token, private=private, repo_type="model", exist_ok=True)
    repo_id = getattr(url, "repo_id", None) or repo_id  # `name` alone resolves to `user/name`
    if revision is not None and revision != "main":
        api.create_branch(repo_id, branch=revision, token=token, repo_type="model", exist_ok=True)
    size = sum((Path(folder) / f).stat().st_size for f in files)
    logger.info("Pushing %d files (%.2f GB) to %s", len(files), size / 1e9, repo_id)
    return api.upload_folder(
        repo_id=repo_id,
        folder_path=os.fspath(folder),
        commit_message=commit_message,
        token=token,
        repo_type="model",
        revision=revision,
        create_pr=create_pr,
        allow_patterns=[_glob_literal(f) for f in files],
    )
