"""Monitors: stable rank of weight matrices, the (experimental) MSign correction, and representation drift.

Each runs every ``every`` (``period``) optimizer steps in ``on_step_end`` under ``torch.no_grad()``, logs
``stable/<family>/*`` through the metrics hook (``Callback.attach(trainer)`` installs it; hf_stable trainers have it)
and keeps its state across resume, so a resumed run logs what an uninterrupted one does, bit for bit: the small
JSON state (histories, counters) through transformers' ``ExportableState`` (``trainer_state.json``, written with the
checkpoint), the tensors (the power-iteration vectors, the drift reference) as one safetensors file per callback in
``checkpoint-N/stable_monitors/`` (inside the atomic save, `_checkpoint_files`; too large for ``trainer_state.json``).
The monitors never draw from the global RNG, so switching one on does not change training. Costs (measured in
``benchmarks/stability_overhead.py``, see ``docs/stability.md``):

* `StableRankMonitorCallback`: per target matrix (m, n) one exact 2-norm (SVD, O(mn·min(m, n))) below 512 on both
  sides, else ``power_iters`` matrix-vector products with a warm-started vector (O(mn) each).
* `MSignCallback`: one Newton–Schulz msign (5 iterations, O(mn·min(m, n)) each) per corrected matrix per period.
* `RepresentationDriftCallback`: one forward of the ``n_probe`` probe sequences with hidden states, then O(N²·d)
  for the distances and O(N·d²) for CKA.

Distributed: every rank computes the same numbers (DDP replicas are identical; under FSDP2 each matrix is
``full_tensor()``-gathered, a collective all ranks run); DeepSpeed ZeRO-3 partitioned weights are refused.
"""

from __future__ import annotations

import inspect
import logging
import math
import os
import re
import statistics

import torch
from transformers import TrainerCallback

from .._validation import check_choice, check_int, check_number, check_pattern
from ..stability.drift import linear_cka, rdm_stability
from ..stability.matrix import msign_correction, spectral_norm, stable_rank
from ..stability.stats import RobustWindow
from ._checkpoint_files import CheckpointFiles, resumed_file, save_tensors
from .stability import _Attachable, _SelfRestoring, _warn_once


__all__ = ["DEFAULT_TARGETS", "MSignCallback", "RepresentationDriftCallback", "StableRankMonitorCallback"]

logger = logging.getLogger(__name__)

DEFAULT_TARGETS = r"layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)$"
STATE_SUBDIR = "stable_monitors"  # in checkpoint-N: the monitors' tensors, one safetensors file per callback name


def _load_tensors(args, state, name: str) -> dict[str, torch.Tensor] | None:
    """The tensors a monitor named ``name`` saved in the checkpoint this run resumed from, or ``None``."""
    from safetensors.torch import load_file

    path = resumed_file(args, state, os.path.join(STATE_SUBDIR, f"{name}.safetensors"))
    return load_file(path) if path is not None else None


def _refuse_zero3(model, who: str) -> None:
    from .. import distributed

    if distributed.is_zero3_partitioned(model):
        raise ValueError(
            f"{who} does not support DeepSpeed ZeRO-3 partitioned weights (each matrix would have to be "
            "gathered); use ZeRO-1/2, FSDP2 or DDP."
        )


def _full(weight: torch.Tensor) -> torch.Tensor:
    """The full matrix in fp32: DTensor shards gathered (collective), bitsandbytes 4-bit dequantized."""
    if hasattr(weight, "full_tensor"):
        weight = weight.full_tensor()
    if getattr(weight, "quant_state", None) is not None:
        import bitsandbytes.functional as bnbf

        weight = bnbf.dequantize_4bit(weight.data, weight.quant_state)
    return weight.detach().float()


def _effective_weight(module, effective_lora: bool) -> torch.Tensor | None:
    """``W0 + Σ_active s·BA`` for a PEFT LoRA layer (when ``effective_lora``), the weight of a plain 2-D layer, else
    None."""
    base = getattr(module, "base_layer", None)
    if base is not None and hasattr(module, "get_delta_weight"):
        w = _full(base.weight)
        if effective_lora:
            for adapter in getattr(module, "active_adapters", []):
                if adapter in getattr(module, "lora_A", {}):
                    w = w + module.get_delta_weight(adapter).detach().float()
        return w
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.ndim == 2:
        return _full(weight)
    return None


def _targets(model, pattern: str) -> list[tuple[str, torch.nn.Module]]:
    regex = re.compile(pattern)
    return [(name, m) for name, m in model.named_modules() if regex.search(name)]


class _Monitor(_Attachable, _SelfRestoring):
    """What the monitors share: ``_init_args`` (transformers re-creates a callback from them on resume) reads the
    constructor's arguments back from the attributes of the same names, as scikit-learn's ``get_params`` does, so
    each is written once; and the metrics the hook pops after each step."""

    _not_state: tuple[str, ...] = ()  # constructor arguments kept elsewhere than the JSON state

    def _init_args(self) -> dict:
        names = inspect.signature(type(self).__init__).parameters
        return {name: getattr(self, name) for name in names if name != "self" and name not in self._not_state}

    def pop_pending_metrics(self) -> dict:
        pending, self._pending = self._pending, {}
        return pending


# -- stable rank ------------------------------------------------------------------------------------------------
class StableRankMonitorCallback(_Monitor, CheckpointFiles, TrainerCallback):
    """Log the stable rank ``‖W‖_F²/‖W‖₂²`` of target matrices every ``every`` steps and warn on collapse.

    Args:
        every: period in optimizer steps (also measured at step 0, in ``on_train_begin``, as the reference).
        targets: regex (``re.search``) over module names; default: attention and MLP projections of decoder layers.
        power_iters: power iterations for matrices with a side ≥ ``exact_below`` (warm-started from the last call).
        effective_lora: for PEFT LoRA layers monitor ``W0 + s·BA`` (the merged weight), else the base weight.
        collapse_ratio: alarm when a matrix's stable rank falls below this fraction of its first measured value.
        drop_window: alarm when it falls by more than 30 % against the value ``drop_window`` measurements ago.
        log_per_matrix: also log ``stable/srank/<module name>``.

    Metrics: ``stable/srank/min``, ``stable/srank/median``, ``stable/srank/collapse`` (1 when any matrix alarms).

    Resume: the histories are JSON (``ExportableState``); the warm-start vectors are tensors, saved in
    ``checkpoint-N/stable_monitors/<name>.safetensors`` (without them the resumed power iterations start cold and
    the logged ranks differ slightly). First vectors come from a generator seeded with ``args.seed``, never from the
    global RNG that training draws from.
    """

    def __init__(
        self,
        every: int = 100,
        targets: str = DEFAULT_TARGETS,
        power_iters: int = 8,
        effective_lora: bool = True,
        collapse_ratio: float = 0.5,
        drop_window: int = 5,
        log_per_matrix: bool = False,
        exact_below: int = 512,
        name: str = "srank",
    ):
        check_int("every", every, low=1)
        check_pattern("targets", targets, allow_none=False)
        check_int("power_iters", power_iters, low=1)
        check_number("collapse_ratio", collapse_ratio, low=0, high=1)
        check_int("drop_window", drop_window, low=1)
        check_int("exact_below", exact_below, low=1)
        self.name = name
        self.every, self.targets, self.power_iters = every, targets, power_iters
        self.effective_lora, self.collapse_ratio, self.drop_window = effective_lora, collapse_ratio, drop_window
        self.log_per_matrix, self.exact_below = log_per_matrix, exact_below
        self.first: dict[str, float] = {}
        self.recent: dict[str, list[float]] = {}
        self.measured_steps: list[int] = []
        self._vectors: dict[str, torch.Tensor] = {}
        self._generator: torch.Generator | None = None
        self._pending: dict = {}
        self._trainer_ref = None

    def _export(self) -> dict:
        return {
            "first": dict(self.first),
            "recent": {k: list(v) for k, v in self.recent.items()},
            "measured_steps": list(self.measured_steps),
        }

    def _import(self, payload: dict) -> None:
        self.first = {k: float(v) for k, v in payload.get("first", {}).items()}
        self.recent = {k: [float(x) for x in v] for k, v in payload.get("recent", {}).items()}
        self.measured_steps = [int(s) for s in payload.get("measured_steps", [])]

    def measure(self, model) -> dict[str, float]:
        """``{module name: stable rank}`` of the target matrices now."""
        out = {}
        with torch.no_grad():
            for name, module in _targets(model, self.targets):
                w = _effective_weight(module, self.effective_lora)
                if w is None:
                    continue
                v = self._vectors.get(name)
                if v is None and max(w.shape) >= self.exact_below:  # power iterations: a seeded first vector
                    if self._generator is None:
                        self._generator = torch.Generator().manual_seed(0)
                    v = torch.randn(min(w.shape), generator=self._generator)
                sigma, v = spectral_norm(w, v, self.power_iters, self.exact_below)
                if v is not None:
                    self._vectors[name] = v
                out[name] = float(stable_rank(w, sigma))
        return out

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        _refuse_zero3(model, "StableRankMonitorCallback")
        self._generator = torch.Generator().manual_seed(args.seed)
        restored = self._self_restore(state)
        if restored:
            vectors = _load_tensors(args, state, self.name)
            if vectors is None:
                _warn_once(
                    self,
                    "no_vectors",
                    f"StableRankMonitorCallback: the checkpoint holds no {STATE_SUBDIR}/{self.name}.safetensors; the "
                    "power iterations restart from fresh vectors (the logged stable ranks differ slightly).",
                    state,
                )
            self._vectors = dict(vectors or {})
        if not restored and not self.first:
            self._record(0, self.measure(model), state)
        if not self.first:
            raise ValueError(
                f"StableRankMonitorCallback: `targets`={self.targets!r} matches no 2-D weight of "
                f"{type(model).__name__}."
            )

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step % self.every == 0:
            self._record(state.global_step, self.measure(model), state)

    def _write_checkpoint_files(self, folder, args, state) -> None:
        if args.should_save:
            save_tensors(os.path.join(folder, STATE_SUBDIR, f"{self.name}.safetensors"), self._vectors)

    def _record(self, step: int, values: dict[str, float], state) -> None:
        self.measured_steps.append(step)
        collapsed = []
        for name, sr in values.items():
            first = self.first.setdefault(name, sr)
            history = self.recent.setdefault(name, [])
            past = history[-self.drop_window] if len(history) >= self.drop_window else None
            if sr < self.collapse_ratio * first or (past is not None and sr < 0.7 * past):
                collapsed.append((name, sr, first))
            history.append(sr)
            del history[: -self.drop_window]
        if collapsed and state.is_world_process_zero:
            name, sr, first = min(collapsed, key=lambda c: c[1] / max(c[2], 1e-12))
            logger.warning(
                f"StableRankMonitorCallback step {step}: stable rank collapsing in {len(collapsed)} "
                f"matrices (worst {name}: {sr:.3g}, first measured {first:.3g})."
            )
        ranks = list(values.values())
        self._pending = {
            "stable/srank/min": min(ranks),
            "stable/srank/median": statistics.median(ranks),
            "stable/srank/collapse": float(bool(collapsed)),
        }
        if self.log_per_matrix:
            self._pending.update({f"stable/srank/{k}": v for k, v in values.items()})


# -- MSign ------------------------------------------------------------------------------------------------------
class MSignCallback(_Monitor, TrainerCallback):
    """Experimental (reconstructed from arXiv 2602.01734's abstract): every ``period`` steps replace target matrices by
    ``(1 − α)·W + α·(‖W‖_F/‖msign(W)‖_F)·msign(W)``, which keeps ``‖W‖_F`` and, with α = 1, sets the stable rank to
    ``min(m, n)``.

    ``trigger="stable_rank"`` corrects only matrices whose stable rank is below ``sr_threshold``. It discards the
    learned singular spectrum: meant for training from scratch, not for fine-tuning a pretrained model (a warning says
    so when the model has a ``name_or_path`` and α = 1). Adam moments are left as they are. PEFT adapters are refused
    (the base weights are frozen; correcting them would change the model outside training).

    Metrics: ``stable/msign/corrected`` (matrices corrected at the last period), ``stable/msign/min_srank`` (after).
    """

    def __init__(
        self,
        period: int = 100,
        targets: str = DEFAULT_TARGETS,
        alpha: float = 1.0,
        trigger: str = "period",
        sr_threshold: float | None = None,
        method: str = "newton_schulz",
        name: str = "msign",
    ):
        check_int("period", period, low=1)
        check_pattern("targets", targets, allow_none=False)
        check_number("alpha", alpha, low=0, high=1, low_open=True)
        check_choice("trigger", trigger, ("period", "stable_rank"))
        check_number("sr_threshold", sr_threshold, low=1, allow_none=True)
        check_choice("method", method, ("newton_schulz", "svd"))
        if trigger == "stable_rank" and sr_threshold is None:
            raise ValueError(
                "`trigger='stable_rank'` needs `sr_threshold` (the stable rank below which a matrix is corrected)."
            )
        if trigger == "period" and sr_threshold is not None:
            raise ValueError("`sr_threshold` is only read with `trigger='stable_rank'`.")
        self.name = name
        self.period, self.targets, self.alpha = period, targets, alpha
        self.trigger, self.sr_threshold, self.method = trigger, sr_threshold, method
        self.corrections = 0
        self._pending: dict = {}
        self._trainer_ref = None

    def _export(self) -> dict:
        return {"corrections": self.corrections}

    def _import(self, payload: dict) -> None:
        self.corrections = int(payload.get("corrections", 0))

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        _refuse_zero3(model, "MSignCallback")
        if any(hasattr(m, "lora_A") for m in model.modules()):
            raise ValueError(
                "MSignCallback corrects full weight matrices; with PEFT adapters the base weights are "
                "frozen. Monitor with StableRankMonitorCallback instead."
            )
        self._self_restore(state)
        if self.alpha == 1.0 and getattr(getattr(model, "config", None), "_name_or_path", ""):
            _warn_once(
                self,
                "pretrained",
                (
                    "MSignCallback(alpha=1.0) on a pretrained model: every correction replaces the learned singular "
                    "spectrum of the target matrices (all singular values made equal). It is meant for training from "
                    "scratch; use alpha < 1 or trigger='stable_rank' to limit it."
                ),
                state,
            )

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step % self.period != 0:
            return
        corrected, after = 0, []
        with torch.no_grad():
            for _, module in _targets(model, self.targets):
                weight = getattr(module, "weight", None)
                if not isinstance(weight, torch.Tensor) or weight.ndim != 2:
                    continue
                w = _full(weight)
                if self.trigger == "stable_rank" and float(stable_rank(w)) >= self.sr_threshold:
                    after.append(float(stable_rank(w)))
                    continue
                new = msign_correction(w, self.alpha, self.method)
                local = weight.to_local() if hasattr(weight, "to_local") else weight
                if hasattr(weight, "to_local"):  # write back this rank's shard of the full corrected matrix
                    from torch.distributed.tensor import distribute_tensor

                    new = distribute_tensor(new.to(weight.dtype), weight.device_mesh, weight.placements).to_local()
                local.copy_(new.to(local.dtype))
                corrected += 1
                after.append(float(stable_rank(_full(weight))))
        self.corrections += corrected
        self._pending = {"stable/msign/corrected": float(corrected)}
        if after:
            self._pending["stable/msign/min_srank"] = min(after)


# -- representation drift ---------------------------------------------------------------------------------------
_PROBES: dict[str, object] = {}  # name -> probe set, so a callback transformers re-instantiates finds its probes


class RepresentationDriftCallback(_Monitor, CheckpointFiles, TrainerCallback):
    """How much the geometry of a fixed probe set's representations changes (our reconstruction of an unsupervised
    geometric-stability measure from its abstract): Spearman ρ between the pairwise cosine distances of the probe
    representations now and at the reference (``"initial"``: before training; ``"previous"``: the last measurement),
    ``drift = 1 − ρ``; linear CKA is logged next to it. A monitor: it warns, never rolls back.

    Args:
        probe_dataset: a list of strings (tokenized with the trainer's ``processing_class``) or a dict with
            ``input_ids`` and ``attention_mask`` tensors (N, T). At most ``n_probe`` rows are used.
        layers: hidden-state indices (``output_hidden_states``; -1 is the last layer).
        every: period in optimizer steps.
        alarm_drift: warn when the drift exceeds this; if ``None``, warn when the drift's increase is a robust
            z-score above ``alarm_z`` against the previous increases (after 5 of them).
        batch_size: probe sequences per forward.

    The ``"initial"`` reference is saved once (main process) as
    ``output_dir/stable_drift/<name>/reference.safetensors``. Resume: the history and the robust window are JSON
    (``ExportableState``); the current reference (the initial one, or with ``"previous"`` the last measurement,
    which the resumed weights need not reproduce when the checkpoint falls between measurements) is saved in
    ``checkpoint-N/stable_monitors/<name>.safetensors`` and read back first.

    Metrics: ``stable/drift/rdm_spearman``, ``stable/drift/cka`` (mean over ``layers``), ``stable/drift/alarm``.
    """

    def __init__(
        self,
        probe_dataset=None,
        layers: tuple[int, ...] = (-1,),
        pooling: str = "mean",
        every: int = 100,
        n_probe: int = 128,
        distance: str = "cosine",
        reference: str = "initial",
        alarm_drift: float | None = None,
        alarm_z: float = 6.0,
        batch_size: int = 16,
        name: str = "drift",
    ):
        check_choice("pooling", pooling, ("mean",))
        check_int("every", every, low=1)
        check_int("n_probe", n_probe, low=3)
        check_choice("distance", distance, ("cosine", "euclidean"))
        check_choice("reference", reference, ("initial", "previous"))
        check_number("alarm_drift", alarm_drift, low=0, high=2, allow_none=True)
        check_number("alarm_z", alarm_z, low=0, low_open=True)
        check_int("batch_size", batch_size, low=1)
        if probe_dataset is not None:
            _PROBES[name] = probe_dataset
        elif name not in _PROBES:
            raise ValueError(
                "RepresentationDriftCallback needs `probe_dataset` (a list of strings or a dict of "
                "`input_ids`/`attention_mask` tensors)."
            )
        self.name = name
        self.layers, self.every, self.n_probe = tuple(layers), every, n_probe
        self.distance, self.reference, self.alarm_drift, self.alarm_z = distance, reference, alarm_drift, alarm_z
        self.pooling, self.batch_size = pooling, batch_size
        self.increments = RobustWindow(size=64, min_history=5)
        self.history: list[tuple[int, float, float]] = []  # (step, rdm_spearman, cka)
        self._reference: list[torch.Tensor] | None = None
        self._batch: dict | None = None
        self._pending: dict = {}
        self._trainer_ref = None

    _not_state = ("probe_dataset",)  # kept in `_PROBES` under `name`

    def _init_args(self) -> dict:
        return {**super()._init_args(), "layers": list(self.layers)}

    def _export(self) -> dict:
        return {"increments": self.increments.state(), "history": [list(h) for h in self.history]}

    def _import(self, payload: dict) -> None:
        self.increments.load_state(payload.get("increments", []))
        self.history = [tuple(h) for h in payload.get("history", [])]

    def _tokenized(self, processing_class) -> dict:
        probe = _PROBES[self.name]
        if not isinstance(probe, dict):  # strings: tokenized into the tensor form, which the rest reads
            if processing_class is None:
                raise ValueError(
                    "RepresentationDriftCallback: a list of strings needs the trainer's "
                    "`processing_class` to tokenize it; pass token tensors instead."
                )
            probe = processing_class(list(probe), return_tensors="pt", padding=True)
        ids, mask = probe["input_ids"], probe.get("attention_mask")
        mask = torch.ones_like(ids) if mask is None else mask
        return {"input_ids": ids[: self.n_probe], "attention_mask": mask[: self.n_probe]}

    def representations(self, model) -> list[torch.Tensor]:
        """Mean-pooled hidden states (N, d), fp32, one per entry of ``layers``."""
        was_training = model.training
        model.eval()
        device = next(model.parameters()).device
        pooled: list[list[torch.Tensor]] = [[] for _ in self.layers]
        try:
            with torch.no_grad():
                n = self._batch["input_ids"].shape[0]
                for start in range(0, n, self.batch_size):
                    ids = self._batch["input_ids"][start : start + self.batch_size].to(device)
                    mask = self._batch["attention_mask"][start : start + self.batch_size].to(device)
                    hidden = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
                    weights = mask.unsqueeze(-1).float()
                    for i, layer in enumerate(self.layers):
                        h = hidden[layer].float()
                        pooled[i].append(((h * weights).sum(1) / weights.sum(1).clamp_min(1.0)).cpu())
        finally:
            model.train(was_training)
        return [torch.cat(p) for p in pooled]

    def _reference_path(self, args) -> str:
        return os.path.join(args.output_dir, "stable_drift", self.name, "reference.safetensors")

    def on_train_begin(self, args, state, control, model=None, processing_class=None, **kwargs):
        _refuse_zero3(model, "RepresentationDriftCallback")
        self._batch = self._tokenized(processing_class)
        if self._batch["input_ids"].shape[0] < 3:
            raise ValueError("RepresentationDriftCallback needs at least 3 probe sequences.")
        self._self_restore(state)
        saved = _load_tensors(args, state, self.name) if state.global_step > 0 else None
        if saved is not None and len(saved) == len(self.layers):
            self._reference = [saved[f"layer{i}"] for i in range(len(self.layers))]
            return
        path = self._reference_path(args)
        if state.global_step > 0 and self.reference == "initial" and os.path.isfile(path):
            from safetensors.torch import load_file

            saved = load_file(path)
            self._reference = [saved[f"layer{i}"] for i in range(len(self.layers))]
            return
        if state.global_step > 0 and self.reference == "initial":
            _warn_once(
                self,
                "no_reference",
                f"RepresentationDriftCallback: {path} is missing; the drift is measured "
                "against the weights at resume instead of the initial ones.",
                state,
            )
        self._reference = self.representations(model)
        if self.reference == "initial" and state.is_world_process_zero:
            from safetensors.torch import save_file

            os.makedirs(os.path.dirname(path), exist_ok=True)
            save_file({f"layer{i}": x.contiguous() for i, x in enumerate(self._reference)}, path + ".tmp")
            os.replace(path + ".tmp", path)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step % self.every != 0:
            return
        current = self.representations(model)
        rho = statistics.fmean(
            float(rdm_stability(r, c, self.distance)) for r, c in zip(self._reference, current, strict=True)
        )
        cka = statistics.fmean(float(linear_cka(r, c)) for r, c in zip(self._reference, current, strict=True))
        drift = 1.0 - rho
        previous = 1.0 - self.history[-1][1] if self.history else 0.0
        increment = drift - previous if self.reference == "initial" else drift
        if self.alarm_drift is not None:
            alarm = drift > self.alarm_drift
        else:
            z = self.increments.z(increment, floor=1e-6)
            alarm = len(self.increments) >= self.increments.min_history and math.isfinite(z) and z > self.alarm_z
            if not alarm and math.isfinite(increment):
                self.increments.push(increment)
        self.history.append((state.global_step, rho, cka))
        if self.reference == "previous":
            self._reference = current
        if alarm and state.is_world_process_zero:
            logger.warning(
                f"RepresentationDriftCallback step {state.global_step}: representation drift "
                f"{drift:.3g} (RDM Spearman {rho:.3g}, CKA {cka:.3g}) jumped beyond its alarm."
            )
        self._pending = {"stable/drift/rdm_spearman": rho, "stable/drift/cka": cka, "stable/drift/alarm": float(alarm)}

    def _write_checkpoint_files(self, folder, args, state) -> None:
        if args.should_save and self._reference is not None:
            reference = {f"layer{i}": x for i, x in enumerate(self._reference)}
            save_tensors(os.path.join(folder, STATE_SUBDIR, f"{self.name}.safetensors"), reference)
