"""Regenerate the mergekit parity fixtures: run mergekit 0.1.5 on every recipe of `recipes/` over the tiny
checkpoints of `mergekit_models.py` and keep its outputs as `fixtures/<recipe>.safetensors`.

    python -m venv .venv-mergekit && .venv-mergekit/bin/pip install mergekit==0.1.5 torch==2.13.0
    .venv-mergekit/bin/python tests/merging/mergekit_parity/regenerate.py

mergekit is LGPL-3.0: it runs here, in its own venv, and none of its code is part of hf_stable. Recipes are run
through mergekit's own API (`MergeConfiguration`, `run_merge`), with `random_seed=0` (torch's generator, which
draws DARE's and DELLA's masks), no tokenizer copy and no card. `fixtures/manifest.json` records the versions.
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


def main() -> None:
    from mergekit.config import MergeConfiguration
    from mergekit.merge import run_merge
    from mergekit.options import MergeOptions

    out_dir = HERE / "fixtures"
    out_dir.mkdir(exist_ok=True)
    manifest = {
        "generator": "tests/merging/mergekit_parity/regenerate.py",
        "mergekit": version("mergekit"),
        "torch": torch.__version__,
        "transformers": version("transformers"),
        "recipes": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        folders = build(Path(tmp) / "models")
        for path in sorted((HERE / "recipes").glob("*.yml")):
            recipe = prepare_recipe(yaml.safe_load(path.read_text()), folders)
            config = MergeConfiguration.model_validate(recipe)
            out = Path(tmp) / "out" / path.stem
            options = MergeOptions(copy_tokenizer=False, random_seed=0, quiet=True, write_model_card=False)
            run_merge(config, str(out), options=options)
            shutil.copyfile(out / "model.safetensors", out_dir / f"{path.stem}.safetensors")
            out_config = json.loads((out / "config.json").read_text())
            manifest["recipes"][path.stem] = {"num_hidden_layers": out_config["num_hidden_layers"]}
            print(f"{path.stem}: ok", flush=True)
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")


if __name__ == "__main__":
    main()
