"""Files that travel with merged weights: model config, generation config and tokenizer files.

`config.json` and `generation_config.json` come from the reference model (the base, else the first input), as
mergekit's `run_merge` does; the tokenizer files come from `tokenizer_source` (`base`, a model of the recipe, a
path, or `union` when the models share one vocabulary), else the base, else the first input. When the output dtype
is set by the recipe, `config.json`'s dtype field is updated so `from_pretrained(dtype="auto")` loads what was
written.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from .config import DTYPE_NAMES
from .resolve import resolve_model_path


CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "spiece.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
_TORCH_NAMES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}


def _tokenizer_files(folder: Path) -> dict[str, bytes]:
    return {name: (folder / name).read_bytes() for name in TOKENIZER_FILES if (folder / name).is_file()}


def _vocab(folder: Path) -> dict[str, int] | None:
    """The vocabulary (token → id) of a local tokenizer, or None when it has none transformers can load."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False).get_vocab()
    except (OSError, ValueError):
        return None


def _union_folder(plan) -> Path:
    """`tokenizer_source: union` (mergekit 0.1.5 `tokenizer/build.py`): the union of the models' vocabularies, and
    each model's embedding rows permuted into it. When every model has the same vocabulary the union is the
    reference's tokenizer and every permutation the identity, so the merge is the plain one. Differing
    vocabularies (embedding rows to permute and fill) are not implemented: refused by name."""
    reference = Path(plan.base_path or plan.input_paths[0])
    folders = [Path(p) for p in (plan.base_path, *plan.input_paths) if p is not None]
    files = _tokenizer_files(reference)
    if all(_tokenizer_files(f) == files for f in folders):
        return reference
    vocab = _vocab(reference)
    if vocab is not None and all(_vocab(f) == vocab for f in folders):
        return reference
    raise ValueError(
        "tokenizer_source: union with models whose vocabularies differ is not supported (the embedding rows would "
        "have to be permuted into the union vocabulary); use tokenizer_source: base or a model of the recipe"
    )


def _tokenizer_folder(config, plan) -> Path:
    source = config.tokenizer_source
    if source is None or source == "base":  # mergekit: no base_model → the first model's tokenizer
        return Path(plan.base_path or plan.input_paths[0])
    if source == "union":
        return _union_folder(plan)
    for label, path in zip(plan.inputs, plan.input_paths, strict=True):
        if source in (label, label.split("#")[0]):
            return Path(path)
    if plan.base is not None and source == plan.base:
        return Path(plan.base_path)
    return Path(resolve_model_path(source))


def _override(data: dict, overrides: dict) -> None:
    """Set the overridden keys where the model's config holds them (top level or `text_config`)."""
    for key, value in overrides.items():
        targets = [c for c in (data, data.get("text_config")) if isinstance(c, dict) and key in c]
        for c in targets or [data]:
            c[key] = value


def check_tokenizer_source(config, plan) -> None:
    """Raise before merging when `tokenizer_source` cannot be honoured (nothing is written yet)."""
    _tokenizer_folder(config, plan)


def copy_side_files(config, plan, out: Path) -> list[str]:
    """Copy config/tokenizer files into `out`; returns the copied names."""
    ref = plan.checkpoints[plan.reference]
    ref_folder = Path(ref.folder)
    copied = []
    for name in CONFIG_FILES:
        src = ref_folder / name
        if not src.is_file():
            continue
        if name == "config.json" and (config.out_dtype or config.dtype or plan.config_overrides):
            data = json.loads(src.read_text(encoding="utf-8"))
            if config.out_dtype or config.dtype:
                dtype = _TORCH_NAMES.get(DTYPE_NAMES[config.out_dtype or config.dtype])
                for key in ("dtype", "torch_dtype"):
                    if key in data and dtype:
                        data[key] = dtype
            _override(data, plan.config_overrides)
            (out / name).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        else:
            shutil.copyfile(src, out / name)
        copied.append(name)
    tok = _tokenizer_folder(config, plan)
    if tok.is_file():
        tok = tok.parent
    for name in TOKENIZER_FILES:
        if (tok / name).is_file():
            shutil.copyfile(tok / name, out / name)
            copied.append(name)
    return copied
