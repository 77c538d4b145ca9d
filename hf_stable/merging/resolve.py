"""Where a model named in a recipe lives: a local folder, else a Hub snapshot (the one resolver of the package).

A name is local when the path exists, or when it cannot be a Hub id (it starts with `/`, `~` or `.`, or has more
than one `/`, as mergekit's `card.is_hf` decides). Anything else is tried on the Hub with
`huggingface_hub.snapshot_download`, restricted to the files a merge reads (`HUB_FILES`); when that fails, the
error says both that there is no such local folder and what the Hub lookup answered, so a mistyped relative path
is not reported as an anonymous network error.
"""

from __future__ import annotations

import os
from pathlib import Path


# Weights, configs, tokenizers and chat templates: what the engine, FW-Merging and the side-file copy read.
HUB_FILES = ["*.safetensors", "*.json", "tokenizer*", "*.model", "*.tiktoken", "*.txt", "*.jinja"]


def split_revision(spec: str) -> tuple[str, str | None]:
    """`org/name@rev` → `("org/name", "rev")`; a local path containing `@` is kept whole."""
    spec = str(spec)
    if "@" in spec and not Path(spec).exists():
        model, revision = spec.rsplit("@", 1)
        if model and revision:
            return model, revision
    return spec, None


def looks_local(model: str) -> bool:
    """True when `model` cannot be a Hub id (absolute, home-relative, dot-relative, or nested deeper than org/name)."""
    model = str(model)
    return model.startswith(("/", "~", ".")) or os.path.isabs(model) or model.count("/") > 1 or "\\" in model


def is_hub_id(model: str) -> bool:
    """True for a name that is not an existing local path and can be a Hub id (`org/name` or `name`)."""
    model, _ = split_revision(model)
    return bool(model) and not Path(model).exists() and not looks_local(model)


def resolve_model_path(model: str, revision: str | None = None) -> str:
    """A local folder for `model` (`org/name[@rev]` or a path): the path itself when it exists, else a Hub snapshot.

    Raises:
        FileNotFoundError: naming the model, when it is neither a local folder nor downloadable from the Hub
            (with the Hub's own error).
    """
    if revision is None:
        model, revision = split_revision(model)
    if Path(model).exists():
        return model
    spec = model if revision is None else f"{model}@{revision}"
    if looks_local(model):
        raise FileNotFoundError(f"model {spec!r}: no such local folder {model!r} (and it does not look like a Hub id)")
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(model, revision=revision, allow_patterns=HUB_FILES)
    except Exception as err:  # any Hub failure: offline, no such repo, gated, network
        raise FileNotFoundError(
            f"model {spec!r}: no such local folder {model!r}, and the Hub lookup failed: {type(err).__name__}: "
            f"{str(err).strip().splitlines()[0] if str(err).strip() else err!r}"
        ) from None
