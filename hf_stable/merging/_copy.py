"""Files that travel with merged weights: model config, generation config and tokenizer files.

`config.json` and `generation_config.json` come from the reference model (the base, else the first input), as
mergekit's `run_merge` does; the tokenizer files come from `tokenizer_source` (`base`, a model of the recipe, a
path), else the base, else the first input. With `union` (`vocab`) the union tokenizer is written, unless it is the
reference's own vocabulary (then its files are copied), and `config.json`'s `vocab_size` is the union's size,
rounded up to `pad_to_multiple_of` (mergekit 0.1.5 `merge.py` `_update_config_vocab`). When the output dtype is set
by the recipe, `config.json`'s dtype field is updated so `from_pretrained(dtype="auto")` loads what was written.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from .config import DTYPE_NAMES
from .resolve import resolve_model_path
from .vocab import config_vocab_size


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


def _tokenizer_folder(config, plan) -> Path:
    source = config.tokenizer_source
    if source is None or source == "base":  # mergekit: no base_model → the first model's tokenizer
        return Path(plan.base_path or plan.input_paths[0])
    if source == "union":  # the union's own files are written by `vocab.Vocabulary.save`
        return Path(plan.base_path or plan.input_paths[0])
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


def copy_side_files(config, plan, out: Path, vocabulary=None) -> list[str]:
    """Copy config/tokenizer files into `out` (the union tokenizer, `vocab.Vocabulary`, written); returns the
    names."""
    ref = plan.checkpoints[plan.reference]
    ref_folder = Path(ref.folder)
    copied = []
    overrides = dict(plan.config_overrides)
    if vocabulary is not None and config_vocab_size(ref_folder) != vocabulary.padded_size:
        overrides["vocab_size"] = vocabulary.padded_size
    for name in CONFIG_FILES:
        src = ref_folder / name
        if not src.is_file():
            continue
        if name == "config.json" and (config.out_dtype or config.dtype or overrides):
            data = json.loads(src.read_text(encoding="utf-8"))
            if config.out_dtype or config.dtype:
                dtype = _TORCH_NAMES.get(DTYPE_NAMES[config.out_dtype or config.dtype])
                for key in ("dtype", "torch_dtype"):
                    if key in data and dtype:
                        data[key] = dtype
            _override(data, overrides)
            (out / name).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        else:
            shutil.copyfile(src, out / name)
        copied.append(name)
    tok = _tokenizer_folder(config, plan)
    if vocabulary is not None and not vocabulary.same_as(tok):
        return copied + vocabulary.save(out)
    if tok.is_file():
        tok = tok.parent
    for name in TOKENIZER_FILES:
        if (tok / name).is_file():
            shutil.copyfile(tok / name, out / name)
            copied.append(name)
    return copied
