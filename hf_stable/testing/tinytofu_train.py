"""TinyTOFU supervised fine-tuning of the ``full`` target and the retrain-from-scratch ``oracle``, cached on disk
([`train_tinytofu`]). Imported through [`hf_stable.testing.tinytofu`]."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import shutil
import time
import uuid
from pathlib import Path

import torch

from .tinytofu_data import (
    DEFAULT_RECIPE,
    DEFAULT_SIZES,
    FORMAT_VERSION,
    REDUCED_EPOCHS,
    TinyTofu,
    build_tinytofu_model,
)
from .tinytofu_eval import encode_split, tinytofu_accuracies


logger = logging.getLogger("hf_stable.testing.tinytofu")  # the name it logged under before the split



def default_cache_dir() -> Path:
    """``$HF_STABLE_CACHE/tinytofu`` when the variable is set, else ``~/.cache/hf_stable/tinytofu``."""
    root = os.environ.get("HF_STABLE_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "hf_stable") / "tinytofu"


def _lr_factor(step: int, warmup: int, total: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return max(0.0, (total - step) / max(1, total - warmup))


def _train_epochs(model, batch, *, epochs, lr, batch_size, warmup_steps, clip, generator) -> int:
    n = batch["input_ids"].shape[0]
    steps_per_epoch = math.ceil(n / batch_size)
    total = epochs * steps_per_epoch
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: _lr_factor(s, warmup_steps, total))
    model.train()
    for _ in range(epochs):
        order = torch.randperm(n, generator=generator)
        for start in range(0, n, batch_size):
            idx = order[start : start + batch_size]
            ids, labels = batch["input_ids"][idx], batch["labels"][idx]
            # Right padding + causal attention: real tokens never see the padding, so no attention mask is needed.
            # The LM head runs only on the positions that predict a label (value, EOS): same loss, ~20 % faster.
            hidden = model.model(input_ids=ids).last_hidden_state[:, :-1]
            targets = labels[:, 1:]
            keep = targets != -100
            loss = torch.nn.functional.cross_entropy(model.lm_head(hidden[keep]), targets[keep])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            scheduler.step()
    return total


def _init_seed(seed: int, which: str) -> int:
    return seed if which == "full" else seed + 100_003  # the oracle gets another init (and data-order) seed


def train_tinytofu(
    data: TinyTofu,
    which: str = "full",
    seed: int | None = None,
    cache_dir: str | os.PathLike | None = None,
    epochs: int | None = None,
    *,
    lr: float = 3e-3,
    batch_size: int = 32,
    warmup_steps: int = 50,
    clip: float = 1.0,
    accept_acc: float = 0.98,
    extension_epochs: int = 20,
    max_extensions: int = 3,
    use_cache: bool = True,
):
    """Supervised fine-tuning of the TinyTOFU target (``"full"``) or retrain-from-scratch oracle (``"oracle"``).

    Recipe: AdamW (lr 3e-3, weight decay 0), batch 32, 50-step linear warm-up then linear decay to 0,
    gradient clipping at 1.0, loss on value + EOS only; ``"full"`` trains on forget + retain + world, ``"oracle"`` on
    retain + world with init seed ``seed + 100003``. A plain PyTorch loop (no `Trainer`) for speed. The model is
    accepted when its template-0 accuracy on the trained authors (forget and retain; retain only for the oracle) is at
    least ``accept_acc``; otherwise it trains ``extension_epochs`` more (a new warm-up/decay schedule over those
    epochs, optimizer state reset), at most ``max_extensions`` times; the final accuracies are recorded either way.

    The result is cached in ``cache_dir/<seed>/<which>/`` (default [`default_cache_dir`]; a non-default data size or
    recipe adds a ``-<hash>`` suffix) as ``model.safetensors`` + config + tokenizer + ``done.json``, written into a
    temporary folder and renamed into place, so a crashed or concurrent run never leaves a half-written checkpoint.
    A cache entry whose data fingerprint or recipe differs from the request is retrained and replaced.

    Args:
        data ([`TinyTofu`]): the benchmark data.
        which (`str`): ``"full"`` or ``"oracle"``.
        seed (`int`, *optional*): init / data-order seed; defaults to ``data.seed``.
        cache_dir (`str` or `os.PathLike`, *optional*): cache root.
        epochs (`int`, *optional*): defaults to 60 (30 for ``make_tinytofu(reduced=True)`` data).
        use_cache (`bool`, defaults to `True`): read and write the cache.

    Returns:
        ``(model, info)``: the `LlamaForCausalLM` in eval mode and a dict with ``accuracy`` (forget, retain, world,
        holdout), ``epochs``, ``steps``, ``train_seconds``, ``path``, ``cached`` and the recipe ``config``.
    """
    from transformers import LlamaForCausalLM

    if which not in ("full", "oracle"):
        raise ValueError(f"which must be 'full' or 'oracle', got {which!r}.")
    seed = data.seed if seed is None else seed
    default_epochs = REDUCED_EPOCHS if data.reduced else DEFAULT_RECIPE["epochs"]
    epochs = default_epochs if epochs is None else epochs
    recipe = {
        "epochs": epochs,
        "lr": lr,
        "batch_size": batch_size,
        "warmup_steps": warmup_steps,
        "clip": clip,
        "accept_acc": accept_acc,
        "extension_epochs": extension_epochs,
        "max_extensions": max_extensions,
    }
    config = {
        "format_version": FORMAT_VERSION,
        "which": which,
        "seed": seed,
        "init_seed": _init_seed(seed, which),
        "data_seed": data.seed,
        "sizes": data.sizes,
        "reduced": data.reduced,
        **recipe,
    }
    is_default = seed == data.seed and not data.reduced and data.sizes == DEFAULT_SIZES and recipe == DEFAULT_RECIPE
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()
    folder = which if is_default else f"{which}-{digest[:10]}"
    path = Path(cache_dir if cache_dir is not None else default_cache_dir()) / str(seed) / folder
    config["data_fingerprint"] = data.fingerprint()  # checked on load, not part of the folder name

    if use_cache:
        done = _read_done(path)
        if done is not None and done.get("config") == config:
            with _quiet_progress_bars():
                model = LlamaForCausalLM.from_pretrained(path).eval()
            return model, {**done, "path": str(path), "cached": True}
        if done is not None:
            logger.warning("TinyTOFU cache %s was made with another data set or recipe; retraining.", path)

    start_time = time.perf_counter()
    model = build_tinytofu_model(data.tokenizer, seed=config["init_seed"])
    batch = encode_split(data.tokenizer, data.sft_dataset(which))
    generator = torch.Generator().manual_seed(config["init_seed"])
    train = dict(lr=lr, batch_size=batch_size, warmup_steps=warmup_steps, clip=clip, generator=generator)
    steps = _train_epochs(model, batch, epochs=epochs, **train)
    total_epochs = epochs
    gated = ("forget", "retain") if which == "full" else ("retain",)
    accuracy = tinytofu_accuracies(model, data)
    extensions = 0
    while min(accuracy[name] for name in gated) < accept_acc and extensions < max_extensions:
        logger.info("TinyTOFU %s seed %d after %d epochs: %s; training more.", which, seed, total_epochs, accuracy)
        steps += _train_epochs(model, batch, epochs=extension_epochs, **train)
        total_epochs += extension_epochs
        extensions += 1
        accuracy = tinytofu_accuracies(model, data)
    model.eval()
    info = {
        "accuracy": accuracy,
        "accepted": min(accuracy[name] for name in gated) >= accept_acc,
        "epochs": total_epochs,
        "steps": steps,
        "train_seconds": round(time.perf_counter() - start_time, 2),
        "torch_threads": torch.get_num_threads(),
        "config": config,
    }
    if not info["accepted"]:
        logger.warning("TinyTOFU %s seed %d not accepted after %d epochs: %s", which, seed, total_epochs, accuracy)
    if use_cache:
        _save_atomically(model, data.tokenizer, info, path)
    return model, {**info, "path": str(path), "cached": False}


@contextlib.contextmanager
def _quiet_progress_bars():
    """transformers prints a progress bar per save/load of a 1.7 MB checkpoint; hide it, then restore the setting."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def _read_done(path: Path) -> dict | None:
    try:
        return json.loads((path / "done.json").read_text())
    except (OSError, ValueError):
        return None


def _save_atomically(model, tokenizer, info: dict, path: Path) -> None:
    """Write into a temporary sibling folder, then rename it to ``path``; ``done.json`` is written last."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        with _quiet_progress_bars():
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
        (tmp / "done.json").write_text(json.dumps(info, indent=2, sort_keys=True))
        existing = _read_done(path)
        if existing is not None and existing.get("config") == info["config"]:
            return  # a concurrent run of the same recipe finished first: keep its copy
        if path.exists():  # a stale entry (other data or recipe) or a half-written folder: move it aside
            trash = path.parent / f".{path.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            os.rename(path, trash)
            shutil.rmtree(trash, ignore_errors=True)
        try:
            os.rename(tmp, path)
        except OSError:  # another process renamed its copy in between: keep theirs
            logger.info("TinyTOFU cache %s was written concurrently; keeping the other copy.", path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
