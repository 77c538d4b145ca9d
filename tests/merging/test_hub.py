"""Pushing a merged folder: intercepted at the `HfApi` boundary (a recording subclass; nothing reaches the network)."""

import json
import os

import pytest
from huggingface_hub import HfApi
from huggingface_hub.utils import filter_repo_objects

from hf_stable.merging import hub
from hf_stable.merging.hub import push_merged, upload_files


TOKEN = "hf_" + "Zz9" * 12


class RecordingApi(HfApi):
    """`HfApi` whose network methods record their arguments instead of calling the Hub."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.calls = []

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", repo_id, kwargs))
        return type("Url", (), {"repo_id": repo_id if "/" in repo_id else f"me/{repo_id}"})()

    def create_branch(self, repo_id, **kwargs):
        self.calls.append(("create_branch", repo_id, kwargs))

    def upload_folder(self, **kwargs):
        # What huggingface_hub would upload: the folder's files filtered by the patterns, as `upload_folder` does.
        root = kwargs["folder_path"]
        listing = [
            os.path.relpath(os.path.join(d, f), root).replace(os.sep, "/") for d, _, fs in os.walk(root) for f in fs
        ]
        kwargs["uploaded"] = sorted(
            filter_repo_objects(
                listing, allow_patterns=kwargs["allow_patterns"], ignore_patterns=kwargs.get("ignore_patterns")
            )
        )
        self.calls.append(("upload_folder", kwargs["repo_id"], kwargs))
        return "commit-info"

    def create_commit(self, *args, **kwargs):  # pragma: no cover - must not be used
        raise AssertionError("push_merged uses upload_folder")


def _merged_folder(root, *, sharded=True):
    root.mkdir()
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"] if sharded else []
    for name in shards or ["model.safetensors"]:
        (root / name).write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    if sharded:
        index = {"metadata": {"total_size": 0}, "weight_map": {"a": shards[0], "b": shards[1]}}
        (root / "model.safetensors.index.json").write_text(json.dumps(index))
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        (root / name).write_text("{}")
    (root / "README.md").write_text("---\nbase_model: [org/a]\n---\n# card\n")
    (root / "hf_stable_merge.yaml").write_text("merge_method: linear\nmodels: [org/a, org/b]\n")
    (root / "merge_diagnostics.json").write_text("{}")
    # Never uploaded: partial writes, hidden caches.
    (root / "README.md.tmp").write_text("partial")
    (root / ".cache").mkdir()
    (root / ".cache" / "x.lock").write_text("")
    return root


EXPECTED = [
    "README.md",
    "config.json",
    "generation_config.json",
    "hf_stable_merge.yaml",
    "merge_diagnostics.json",
    "model-00001-of-00002.safetensors",
    "model-00002-of-00002.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
]


def test_push_creates_repo_then_uploads_the_merge_files(tmp_path):
    folder = _merged_folder(tmp_path / "merged")
    api = RecordingApi()
    out = push_merged(folder, "me/merged", private=True, token=TOKEN, api=api, commit_message="merge v1")
    assert out == "commit-info"
    assert [c[0] for c in api.calls] == ["create_repo", "upload_folder"]
    _, repo, kwargs = api.calls[0]
    assert repo == "me/merged" and kwargs["exist_ok"] is True and kwargs["private"] is True
    assert kwargs["token"] == TOKEN  # the token goes to HfApi ...
    _, repo, kwargs = api.calls[1]
    assert repo == "me/merged" and kwargs["commit_message"] == "merge v1" and kwargs["token"] == TOKEN
    assert kwargs["uploaded"] == EXPECTED
    assert kwargs["revision"] is None and kwargs["create_pr"] is False
    # ... and nowhere else: no file of the folder contains it.
    for dirpath, _, names in os.walk(folder):
        for name in names:
            assert TOKEN.encode() not in open(os.path.join(dirpath, name), "rb").read()


def test_push_to_a_branch_resolves_the_namespace(tmp_path):
    folder = _merged_folder(tmp_path / "merged", sharded=False)
    api = RecordingApi()
    push_merged(folder, "merged", revision="v2", api=api)
    assert [c[0] for c in api.calls] == ["create_repo", "create_branch", "upload_folder"]
    assert api.calls[1][1] == "me/merged" and api.calls[1][2]["branch"] == "v2"
    upload = api.calls[2][2]
    assert upload["repo_id"] == "me/merged" and upload["revision"] == "v2" and upload["token"] is None
    assert "model.safetensors" in upload["uploaded"] and "README.md.tmp" not in upload["uploaded"]


def test_push_refuses_a_folder_containing_the_token(tmp_path):
    folder = _merged_folder(tmp_path / "merged")
    (folder / "hf_stable_merge.yaml").write_text(f"merge_method: linear\n# token: {TOKEN}\n")
    api = RecordingApi()
    with pytest.raises(ValueError, match=r"hf_stable_merge\.yaml contains the Hub token"):
        push_merged(folder, "me/merged", token=TOKEN, api=api)
    assert api.calls == []


def test_push_without_an_explicit_token_still_scans_with_the_saved_one(tmp_path, monkeypatch):
    """The CLI and the callbacks pass token=None: the scan uses what huggingface_hub would send (HF_TOKEN here)."""
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    folder = _merged_folder(tmp_path / "merged")
    (folder / "notes.json").write_text(json.dumps({"token": TOKEN}))
    api = RecordingApi()
    with pytest.raises(ValueError, match=r"notes\.json contains the Hub token"):
        push_merged(folder, "me/merged", api=api)
    assert api.calls == []
    (folder / "notes.json").unlink()
    push_merged(folder, "me/merged", api=api)
    assert [c[0] for c in api.calls] == ["create_repo", "upload_folder"]


def test_push_checks_the_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a folder"):
        upload_files(tmp_path / "missing")
    folder = _merged_folder(tmp_path / "merged")
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ValueError, match=r"missing: \['model-00002-of-00002.safetensors'\]"):
        upload_files(folder)
    (folder / "model-00001-of-00002.safetensors").unlink()
    with pytest.raises(ValueError, match=r"no \*\.safetensors"):
        upload_files(folder)
    with pytest.raises(ValueError, match="repo_id must look like"):
        push_merged(folder, "a/b/c", api=RecordingApi())


def test_only_the_main_process_pushes(tmp_path, monkeypatch):
    import hf_stable.distributed

    monkeypatch.setattr(hf_stable.distributed, "is_main_process", lambda: False)
    api = RecordingApi()
    assert push_merged(_merged_folder(tmp_path / "merged"), "me/merged", api=api) is None
    assert api.calls == []
    assert hub.upload_files  # the module stays importable without the Hub
