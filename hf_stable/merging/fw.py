"""FW-Merging: Frank–Wolfe over the (layer-wise) convex hull of a pool of checkpoints.

Paper: Chen et al. 2025, "FW-Merging: Scaling Model Merging with Frank-Wolfe Optimization" (arXiv 2503.12649).
Reference code: `hmarkc/FW-Merging` (`discriminative/merge.py::frank_wolfe_merge`, `generative/merge.py`; MIT), and
FusionBench `fusion_bench/method/fw_merging/fw_soft.py`. What hf_stable does:

    x_0 = θ_0                                   (init="base")  |  local_merge(θ_0, all τ_i)  (init="merge_all")
    for t = 0..T-1:
        g = ∇f(x_t)                              (fp32 gradients of the materialised model)
        score_i^ℓ = <g^ℓ, θ_i^ℓ − x_t^ℓ>         (ℓ = one named tensor; candidates streamed one tensor at a time)
        s^ℓ = θ_{i*}^ℓ if min_i score_i^ℓ < 0 else x_t^ℓ   (the "no-move" vertex)
        gap_t = −Σ_ℓ min(0, min_i score_i^ℓ)       (Frank–Wolfe duality gap over the hull ∪ {x_t}; stop if ≤ tol)
        γ_t = η·2/(t+2);  x_{t+1} = x_t + λ γ_t · d,  d = s − x_t  (ta)  or  Trim_ρ(s − x_t)  (ties)

`lmo="task"` replaces the per-tensor argmin by one argmin of `Σ_ℓ score_i^ℓ` (the task-wise hull). The reference's
LMO (`lmo_score="ref_cosine"`) ranks candidates by the cosine `<g, θ_i>/(‖g‖‖θ_i‖)` of the gradient with
the raw candidate tensor and, layer-wise, takes a zero tensor when the best cosine is ≥ 0 (the reference's
`frank_wolfe_selection`): that vertex shrinks the layer by (1 − λγ). Task-wise it sums the per-tensor cosines and
always moves (as the reference).

Memory (the paper's claim): only the iterate, its gradient, the base snapshot when `init="merge_all"` and
one candidate tensor are resident; candidates are read candidate-major in on-disk order, then the winning tensors are
read once more for the update. Resident memory is O(model) whatever the pool size; the price is I/O:
(T·(N + 1))·|θ| bytes are read (`history.bytes_read`). `ResidentTracker` (`fw_pool`) counts the candidate tensors
alive at once (weak references, so a leaked tensor is seen), which the tests and the experiment report. The TIES
local merge reuses the combiner of `merge_method: ties` (`ties_ops`: trim, sign election, disjoint mean). The local
merges live in `fw_local`, one iteration's oracle and update in `fw_step`.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from hf_stable._validation import check_choice, check_int, check_number
from hf_stable.merging.fw_local import LOCAL_MERGES, LocalMerge, check_pool, local_merge_all, merge_all_into, open_pool
from hf_stable.merging.fw_objectives import CallableObjective, FWObjective, make_objective
from hf_stable.merging.fw_pool import ResidentTracker
from hf_stable.merging.fw_step import NO_MOVE, ZEROS, dot64, fw_gamma, fw_update, lmo_select, norm64
from hf_stable.merging.resolve import resolve_model_path
from hf_stable.merging.ties_ops import trim as trim_top


LMO_KINDS = ("layer", "task")
LMO_SCORES = ("gap", "ref_cosine")
INITS = ("base", "merge_all")


# --------------------------------------------------------------------------------------------------------------------
# configuration and history
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class FWHistory:
    """What `fw_merge` did. `iterations[t]`: `t`, `loss` f(x_t), `gap` (duality gap of the chosen hull),
    `gamma`, `step` (= λγ actually applied, 0 when stopped), `chosen` {tensor: vertex index, −1 no move, −2 zeros},
    `counts` {vertex label: number of tensors}, `bytes_read` (cumulative), `seconds`, `stopped`."""

    pool: list[str]
    settings: dict
    iterations: list[dict] = field(default_factory=list)
    initial_loss: float | None = None
    final_loss: float | None = None
    bytes_read: int = 0
    peak_resident_bytes: int = 0
    peak_resident_tensors: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def _validate(iters, step, lmo, lmo_score, init, tol) -> None:
    check_int("iters", iters, low=0)
    check_number("step", step, low=0, low_open=True)
    check_choice("lmo", lmo, LMO_KINDS)
    check_choice("lmo_score", lmo_score, LMO_SCORES)
    check_choice("init", init, INITS)
    check_number("tol", tol, low=0)


# --------------------------------------------------------------------------------------------------------------------
# the iterate: an nn.Module (HF model) or a dict of fp32 leaf tensors
# --------------------------------------------------------------------------------------------------------------------


def _materialise(base: Any, names: Sequence[str] | None, device) -> tuple[Any, dict[str, torch.Tensor]]:
    """(target handed to the objective, {name: fp32 leaf tensor of the iterate})."""
    if isinstance(base, (str, os.PathLike)):
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if isinstance(base, torch.nn.Module):
        # gradients of the materialised model in fp32: a bf16 base is upcast in place
        if any(p.dtype != torch.float32 for p in base.parameters() if p.dtype.is_floating_point):
            base.float()
        if device is not None:
            base.to(device)
        params = {n: p for n, p in base.named_parameters() if p.dtype.is_floating_point}
        target = base
    elif isinstance(base, Mapping):
        params = {
            n: t.detach().to(device=device or t.device, dtype=torch.float32).clone().requires_grad_(True)
            for n, t in base.items()
            if torch.is_tensor(t) and t.dtype.is_floating_point
        }
        target = params
    else:
        raise TypeError(f"base: expected an nn.Module, a model path or a state dict, got {type(base)}")
    if names is not None:
        unknown = [n for n in names if n not in params]
        if unknown:
            raise ValueError(f"names: {unknown[:5]} are not float parameters of the base model")
        params = {n: params[n] for n in names}
    if not params:
        raise ValueError("base: no floating-point parameters to merge")
    return target, params


def _zero_grads(params: Mapping[str, torch.Tensor], target: Any) -> None:
    if isinstance(target, torch.nn.Module):
        target.zero_grad(set_to_none=True)
    for p in params.values():
        p.grad = None


# --------------------------------------------------------------------------------------------------------------------
# Frank–Wolfe
# --------------------------------------------------------------------------------------------------------------------


def fw_merge(
    base: Any,
    pool: Sequence[Any],
    objective: Any,
    *,
    iters: int = 10,
    step: float = 1.0,
    lmo: str = "layer",
    lmo_score: str = "gap",
    init: str = "base",
    local_merge: Any = None,
    tol: float = 0.0,
    progress: bool = True,
    names: Sequence[str] | None = None,
    device: str | torch.device | None = None,
    tokenizer: Any = None,
) -> tuple[Any, FWHistory]:
    """Frank–Wolfe merging of a pool of checkpoints (Chen et al. 2025, arXiv 2503.12649).

    Args:
        base: the starting point θ_0 and the architecture: an `nn.Module` (updated in place; upcast to fp32), a model
            folder (loaded with `AutoModelForCausalLM`, fp32) or a state dict `{name: tensor}` (for pure-math
            objectives; the objective then receives `{name: fp32 leaf tensor}`).
        pool: candidates θ_1..θ_N: safetensors folders/files (streamed one tensor at a time) or state dicts.
        objective: `f`, minimised. A callable `target -> scalar loss tensor`, an `FWObjective`
            (`hf_stable.merging.fw_objectives.ProxyCE`, `KLToExperts`, `Entropy`), or a dict spec
            `{"kind": "proxy_ce" | "kl_to_experts" | "entropy", ...}` (needs `tokenizer`).
        iters: T, the number of FW iterations (reference default 10).
        step: η in `γ_t = η·2/(t+2)`.
        lmo: `"layer"` (product of per-tensor hulls, default) or `"task"` (hull of whole models).
        lmo_score: `"gap"` (`<g, θ_i − x>` with a no-move vertex, default) or `"ref_cosine"` (reference code).
        init: `"base"` (x_0 = θ_0, default) or `"merge_all"` (x_0 = local merge of the whole pool, reference LLM/GLUE
            code; the reference also appends x_0 to the pool as a vertex, which is not done here).
        local_merge: `{"method": "ta" | "ties", "scaling": λ, "density": ρ}` (default TA, λ = 1).
        tol: stop when the duality gap ≤ tol (`lmo_score="gap"` only; with 0 it stops when no vertex improves).
        progress: tqdm bar over iterations.
        names: restrict the merged tensors (default: every float parameter of the base).
        device: where the iterate, gradients and candidate tensors live (default: the base's device / cpu).
        tokenizer: needed for dict objective specs.

    Returns:
        `(merged, history)`: the module (or `{name: fp32 tensor}` for a state-dict base) at x_T, and an `FWHistory`.
    """
    _validate(iters, step, lmo, lmo_score, init, tol)
    local = LocalMerge.parse(local_merge)
    if isinstance(objective, Mapping):
        objective = make_objective(objective, tokenizer=tokenizer)
    elif not isinstance(objective, FWObjective):
        if not callable(objective):
            raise TypeError(f"objective: expected a callable, an FWObjective or a dict spec, got {type(objective)}")
        objective = CallableObjective(objective)
    start = time.time()
    target, params = _materialise(base, names, device)
    dev = next(iter(params.values())).device
    tracker = ResidentTracker()
    sources = open_pool(pool, tracker, device=dev)
    if not sources:
        raise ValueError("pool: empty; FW-Merging needs at least one candidate")
    tensor_names = list(params)
    settings = {
        "iters": iters, "step": step, "lmo": lmo, "lmo_score": lmo_score, "init": init,
        "local_merge": asdict(local), "tol": tol,
    }  # fmt: skip
    history = FWHistory(pool=[s.label for s in sources], settings=settings)
    try:
        check_pool(sources, {n: tuple(p.shape) for n, p in params.items()})
        objective.prepare(target)
        if init == "merge_all":
            merge_all_into({n: p.data for n, p in params.items()}, sources, local)
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=iters, desc="FW-Merging", unit="it")
        for t in range(iters):
            t0 = time.time()
            _zero_grads(params, target)
            loss = objective.loss_and_grad(target)
            if t == 0:
                history.initial_loss = loss
            grads = {n: p.grad for n, p in params.items()}
            live = torch.tensor([g is not None and bool(g.ne(0).any()) for g in grads.values()])
            scores = torch.zeros(len(sources), len(tensor_names), dtype=torch.float64)
            cosines = torch.zeros_like(scores) if lmo_score == "ref_cosine" else None
            gnorm = {n: norm64(g) for n, g in grads.items() if g is not None}
            col = {n: j for j, n in enumerate(tensor_names)}
            # scoring pass: candidate-major, on-disk order, one candidate tensor resident
            with torch.no_grad():
                for i, src in enumerate(sources):
                    for n in src.order([n for n, ok in zip(tensor_names, live.tolist(), strict=True) if ok]):
                        theta = src.read(n)
                        g, x = grads[n], params[n]
                        scores[i, col[n]] = dot64(g, theta, x)
                        if cosines is not None:
                            denom = gnorm[n] * norm64(theta)
                            cosines[i, col[n]] = dot64(g, theta) / denom if denom > 0 else 0.0
                        del theta
            chosen, gap = lmo_select(scores, cosines, lmo, lmo_score, live)
            gamma = fw_gamma(t, step)
            record = {
                "t": t, "loss": loss, "gap": gap, "gamma": gamma, "step": local.scaling * gamma,
                "chosen": dict(zip(tensor_names, chosen, strict=True)), "stopped": False,
            }  # fmt: skip
            labels = {NO_MOVE: "no_move", ZEROS: "zeros"}
            counts: dict[str, int] = {}
            for c in chosen:
                key = labels.get(c, sources[c].label if c >= 0 else str(c))
                counts[key] = counts.get(key, 0) + 1
            record["counts"] = counts
            if lmo_score == "gap" and gap <= tol:
                record.update(stopped=True, step=0.0, bytes_read=tracker.bytes_read, seconds=time.time() - t0)
                history.iterations.append(record)
                break
            fw_update(params, sources, tensor_names, chosen, local, local.scaling * gamma)
            record.update(bytes_read=tracker.bytes_read, seconds=time.time() - t0)
            history.iterations.append(record)
            if bar is not None:
                bar.set_postfix(loss=f"{loss:.4g}", gap=f"{gap:.3g}")
                bar.update(1)
        if bar is not None:
            bar.close()
        _zero_grads(params, target)
        history.final_loss = objective.evaluate(target)
        if history.initial_loss is None:
            history.initial_loss = history.final_loss
    finally:
        for src in sources:
            src.close()
    history.bytes_read = tracker.bytes_read
    history.peak_resident_bytes = tracker.peak_bytes
    history.peak_resident_tensors = tracker.peak_tensors
    history.seconds = time.time() - start
    if isinstance(target, torch.nn.Module):
        return target, history
    return {n: p.detach() for n, p in params.items()}, history


# --------------------------------------------------------------------------------------------------------------------
# config entry point (`merge_method: fw_merging`)
# --------------------------------------------------------------------------------------------------------------------

_PARAM_KEYS = ("iters", "step", "lmo", "lmo_score", "init", "local_merge", "tol", "grad_device")


def _config_dict(config: Any) -> dict:
    if isinstance(config, Mapping):
        return dict(config)
    if isinstance(config, (str, os.PathLike)):
        import yaml

        text = Path(config).read_text() if Path(str(config)).is_file() else str(config)
        out = yaml.safe_load(text)
        if not isinstance(out, dict):
            raise ValueError("config: the YAML must be a mapping")
        return out
    for attr in ("to_dict", "as_dict"):
        if hasattr(config, attr):
            return dict(getattr(config, attr)())
    if hasattr(config, "__dataclass_fields__"):
        return asdict(config)
    raise TypeError(f"config: expected a MergeConfig, a dict or a YAML path/string, got {type(config)}")


def _model_ref(entry: Any, field_name: str) -> str:
    if isinstance(entry, Mapping):
        if "model" not in entry:
            raise ValueError(f"{field_name}: each entry needs a `model` key, got {dict(entry)}")
        entry = entry["model"]
    if not isinstance(entry, (str, os.PathLike)):
        raise ValueError(f"{field_name}: expected a path or Hub id, got {entry!r}")
    return str(entry)


def fw_merge_from_config(
    config: Any,
    out_dir: str | os.PathLike,
    *,
    overwrite: bool = False,
    progress: bool = True,
    write_card: Callable[[Path, FWHistory], None] | None = None,
    **overrides,
) -> dict:
    """Run `merge_method: fw_merging` from a recipe and save the merged model to `out_dir`.

    Recipe fields: `base_model`, `pool` (list of `{model: path|hub-id}`), `objective` (`kind`: proxy_ce |
    kl_to_experts | entropy, `data` jsonl, `targets`, `max_tokens_per_task`, `batch_size`, ...), `parameters`
    (`iters`, `step`, `lmo`, `lmo_score`, `init`, `local_merge`, `tol`, `grad_device`), optional `dtype`/`out_dtype`
    (output dtype; default the base checkpoint's), `tokenizer_source`. `overrides` replace `parameters` entries.

    The model is written with `save_pretrained` (safetensors) into `OUT.tmp`, with the tokenizer, the recipe
    (`hf_stable_merge.yaml`, local paths named by folder), the history (`fw_history.json`) and the card
    (`write_card(tmp, history)`, when given), then renamed to `OUT`; errors in the recipe are raised before anything
    is created. Returns `{"output_dir", "history"}`.
    """
    cfg = _config_dict(config)
    method = cfg.get("merge_method", "fw_merging")
    if method != "fw_merging":
        raise ValueError(f"merge_method: fw_merge_from_config handles 'fw_merging', got {method!r}")
    if not cfg.get("base_model"):
        raise ValueError("base_model: FW-Merging needs a base model (the starting point and the architecture)")
    pool_cfg = cfg.get("pool") or cfg.get("models")
    if not pool_cfg:
        raise ValueError("pool: FW-Merging needs a non-empty `pool` (list of {model: path})")
    if not isinstance(cfg.get("objective"), Mapping):
        raise ValueError("objective: expected a mapping with `kind` (proxy_ce | kl_to_experts | entropy)")
    params = dict(cfg.get("parameters") or {})
    params.update(overrides)
    unknown = set(params) - set(_PARAM_KEYS)
    if unknown:
        raise ValueError(f"parameters: unknown key(s) {sorted(unknown)}; allowed: {list(_PARAM_KEYS)}")
    device = params.pop("grad_device", None)
    if device is not None and str(device).startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"parameters.grad_device: {device!r} requested but CUDA is not available")
    _validate(
        params.get("iters", 10), params.get("step", 1.0), params.get("lmo", "layer"),
        params.get("lmo_score", "gap"), params.get("init", "base"), params.get("tol", 0.0),
    )  # fmt: skip
    LocalMerge.parse(params.get("local_merge"))
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out}: exists; pass overwrite=True to replace it")

    from transformers import AutoModelForCausalLM, AutoTokenizer

    base_path = resolve_model_path(_model_ref(cfg["base_model"], "base_model"))
    pool_refs = [_model_ref(e, "pool") for e in pool_cfg]
    pool_paths = [resolve_model_path(r) for r in pool_refs]
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(str(cfg.get("tokenizer_source") or base_path)))
    objective = make_objective(cfg["objective"], tokenizer=tokenizer, resolve=resolve_model_path)
    model = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    # the checkpoint's own dtype (config.json), not the fp32 we loaded it in
    base_config = Path(base_path) / "config.json"
    stored = json.loads(base_config.read_text()) if base_config.is_file() else {}
    stored_dtype = stored.get("dtype") or stored.get("torch_dtype")
    model, history = fw_merge(model, pool_paths, objective, progress=progress, device=device, **params)

    out_dtype = cfg.get("out_dtype") or cfg.get("dtype") or stored_dtype or "float32"
    if isinstance(out_dtype, str):
        aliases = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
        out_dtype = getattr(torch, aliases.get(out_dtype, out_dtype))
    model.to(out_dtype)
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        import inspect

        save_kw = (
            {"safe_serialization": True}
            if "safe_serialization" in inspect.signature(model.save_pretrained).parameters
            else {}
        )
        model.save_pretrained(tmp, **save_kw)  # transformers ≥ 5 always writes safetensors (no such argument)
        tokenizer.save_pretrained(tmp)
        import yaml

        from hf_stable.merging.config import _redact_paths

        (tmp / "hf_stable_merge.yaml").write_text(yaml.safe_dump(_redact_paths(_plain(cfg)), sort_keys=False))
        (tmp / "fw_history.json").write_text(json.dumps(_redact_paths(history.to_dict()), indent=1))
        if write_card is not None:
            write_card(tmp, history)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"output_dir": str(out), "history": history}


def _plain(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return str(obj)


__all__ = [
    "INITS",
    "LMO_KINDS",
    "LMO_SCORES",
    "LOCAL_MERGES",
    "FWHistory",
    "LocalMerge",
    "ResidentTracker",
    "fw_gamma",
    "fw_merge",
    "fw_merge_from_config",
    "local_merge_all",
    "trim_top",
]
