"""Regenerate the mergekit parity fixtures: run mergekit 0.1.5 on every recipe of `recipes/` over the tiny
checkpoints of `mergekit_models.py` and keep its outputs as `fixtures/<recipe>.safetensors`.

    python -m venv .venv-mergekit && .venv-mergekit/bin/pip install mergekit==0.1.5 torch==2.13.0
    .venv-mergekit/bin/python tests/merging/mergekit_parity/regenerate.py [RECIPE ...]

With recipe names (file stems), only those are run and only their manifest entries are rewritten; the other
fixtures stay as they are.

mergekit is LGPL-3.0: it runs here, in its own venv, and none of its code is part of hf_stable. Recipes are run
through mergekit's own API (`MergeConfiguration`, `run_merge`), with `random_seed=0` (torch's generator, which
draws DARE's and DELLA's masks), no tokenizer copy and no card. `fixtures/manifest.json` records the versions.
A recipe with a `tokenizer_source` makes mergekit write its own tokenizer: its tokens (in id order) and added tokens
are kept as `fixtures/<recipe>.tokenizer.json`, with the output config's `vocab_size`.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

import torch
import yaml


HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from mergekit_models import build, prepare_recipe  # noqa: E402


def _tokenizer_fixture(out: Path, out_config: dict) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out))
    vocab = tok.get_vocab()
    added = [{"id": i, "content": t.content, "special": t.special}
             for i, t in sorted(tok.added_tokens_decoder.items())]  # fmt: skip
    return {"tokens": sorted(vocab, key=vocab.get), "added": added, "vocab_size": out_config["vocab_size"]}


def main(names: list[str]) -> None:
    from mergekit.config import MergeConfiguration
    from mergekit.merge import run_merge
    from mergekit.options import MergeOptions

    out_dir = HERE / "fixtures"
    out_dir.mkdir(exist_ok=True)
    old = json.loads((out_dir / "manifest.json").read_text()) if names else {"recipes": {}}
    manifest = {
        "generator": "tests/merging/mergekit_parity/regenerate.py",
        "mergekit": version("mergekit"),
        "torch": torch.__version__,
        "transformers": version("transformers"),
        "recipes": old["recipes"],
    }
    paths = [HERE / "recipes" / f"{n}.yml" for n in names] or sorted((HERE / "recipes").glob("*.yml"))
    with tempfile.TemporaryDirectory() as tmp:
        folders = build(Path(tmp) / "models")
        for path in paths:
            recipe = prepare_recipe(yaml.safe_load(path.read_text()), folders)
            config = MergeConfiguration.model_validate(recipe)
            out = Path(tmp) / "out" / path.stem
            options = MergeOptions(copy_tokenizer=False, random_seed=0, quiet=True, write_model_card=False)
            run_merge(config, str(out), options=options)
            shutil.copyfile(out / "model.safetensors", out_dir / f"{path.stem}.safetensors")
            out_config = json.loads((out / "config.json").read_text())
            manifest["recipes"][path.stem] = {"num_hidden_layers": out_config["num_hidden_layers"]}
            if recipe.get("tokenizer_source") or recipe.get("tokenizer"):
                fixture = _tokenizer_fixture(out, out_config)
                (out_dir / f"{path.stem}.tokenizer.json").write_text(json.dumps(fixture, indent=1) + "\n")
            print(f"{path.stem}: ok", flush=True)
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
