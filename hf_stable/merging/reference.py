"""In-memory reference merges: whole tensors resident (tests, callbacks, experiments).

`merge_tensors` applies one registered method to one tensor exactly as the streaming engine does, but in one
piece: the Gram is `V Vᵀ` in float64 over the whole tensor, the k-th largest scores come from `torch.kthvalue`,
method sums are gathered over the whole tensor, and the combine runs on the whole flat tensor (`offset = 0`).
Elementwise maths is float32, reductions float64.
`merge_state_dicts` does that for every floating-point tensor of N state dicts; other tensors are copied from the
base (or the first model).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from hf_stable.merging.gram import gram as gram_of
from hf_stable.merging.methods import MergeMethod, apply_coefficients, get_merge_method
from hf_stable.merging.quantile import kth_largest_abs_tensor


def merge_vectors(
    method: MergeMethod,
    v: torch.Tensor,
    weights: torch.Tensor,
    params: Mapping[str, Any],
    *,
    tensor_name: str = "t",
    seed: int = 0,
    base: torch.Tensor | None = None,
    shape: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """Merged vector in the method's space.

    Args:
        method: a `MergeMethod`.
        v: `(N, n)` float32 inputs in `space` (full weights or task vectors).
        weights: `(N,)` per-model weights.
        params: resolved parameters.
        base: `(n,)` float32 base (task-vector methods), passed to elementwise methods.
        shape: the tensor's shape (row-local methods; default a vector).

    Returns:
        `(n,)` float32 (the base is NOT added).
    """
    v = v.float()
    n_models, numel = v.shape
    if method.kind_for(params) == "gram":
        g = gram_of(v) if method.needs_gram(params) else None
        c = method.coefficients(g, weights.to(torch.float64), params)
        return apply_coefficients(v, c)
    shape = tuple(shape) if shape is not None else (numel,)
    row_len = numel if len(shape) <= 1 else numel // shape[0]
    kw = {"tensor_name": tensor_name, "offset": 0, "seed": seed, "base": base, "row_len": row_len, "shape": shape}
    thresholds = None
    ranks = method.ranks(params, n_models, numel)
    if ranks is not None:
        scores = method.score(v, base=base, row_len=row_len)
        rows = [None if r is None else [kth_largest_abs_tensor(scores[i], k) for k in r] for i, r in enumerate(ranks)]
        k = max(len(r) for r in rows if r is not None)
        thr = torch.tensor([r if r is not None else [float("nan")] * k for r in rows], dtype=torch.float32)
        thresholds = thr[:, 0] if k == 1 else thr
    w32 = weights.to(torch.float32)
    sums = None
    if method.needs_sums(params):
        sums = method.new_sums(n_models)
        method.accumulate(sums, v, w32, params, thresholds=thresholds, **kw)
    return method.combine(v, w32, params, thresholds=thresholds, sums=sums, **kw)


def merge_tensors(
    method: str | MergeMethod,
    tensors: Sequence[torch.Tensor],
    *,
    base: torch.Tensor | None = None,
    weights: Sequence[float] | torch.Tensor | None = None,
    params: Mapping[str, Any] | None = None,
    tensor_name: str = "t",
    seed: int = 0,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Merge N same-shaped tensors with a registered method.

    Args:
        method: registered name (e.g. ``"ties"``) or a `MergeMethod`.
        tensors: N tensors of one shape.
        base: the base model's tensor (needed for task-vector methods).
        weights: N per-model weights (default all 1).
        params: method parameters (defaults filled in); per-model `density` may be a list of N values.
        tensor_name, seed: key the DARE masks.
        out_dtype: output dtype (default: the first tensor's dtype).

    Returns:
        The merged tensor, shape of the inputs.
    """
    method = get_merge_method(method)
    if not tensors:
        raise ValueError("merge_tensors needs at least one tensor.")
    shape = tensors[0].shape
    for i, t in enumerate(tensors):
        if t.shape != shape:
            raise ValueError(f"tensor {tensor_name!r}: model {i} has shape {tuple(t.shape)}, expected {tuple(shape)}.")
    n_models = len(tensors)
    has_base = base is not None
    p = method.resolve(params)
    method.validate(p, n_models, has_base)
    if weights is not None:
        method.validate_weights(list(torch.as_tensor(weights).reshape(-1).tolist()), p)
    w = torch.ones(n_models, dtype=torch.float64) if weights is None else torch.as_tensor(weights, dtype=torch.float64)
    if w.numel() != n_models:
        raise ValueError(f"weights has {w.numel()} entries for {n_models} models.")
    x = torch.stack([t.detach().reshape(-1).float() for t in tensors])
    b = None
    if method.space(p, has_base) == "task_vector":
        if base is None:
            raise ValueError(f"merge_method {method.name!r} needs a base tensor (task-vector space).")
        if base.shape != shape:
            raise ValueError(f"tensor {tensor_name!r}: base has shape {tuple(base.shape)}, expected {tuple(shape)}.")
        b = base.detach().reshape(-1).float()
        x = x - b
    out = merge_vectors(method, x, w, p, tensor_name=tensor_name, seed=seed, base=b, shape=tuple(shape))
    if b is not None:
        out = out + b
    return out.reshape(shape).to(out_dtype or tensors[0].dtype)


def merge_state_dicts(
    method: str | MergeMethod,
    state_dicts: Sequence[Mapping[str, torch.Tensor]],
    *,
    base: Mapping[str, torch.Tensor] | None = None,
    weights: Sequence[float] | torch.Tensor | None = None,
    params: Mapping[str, Any] | None = None,
    seed: int = 0,
    out_dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """Merge N state dicts tensor by tensor (keys and shapes of the first one; every input must have them).

    Floating-point tensors are merged with `merge_tensors` (tensor name keys the DARE masks); other tensors
    (integer buffers) are copied from `base` if given, else from the first state dict.
    """
    method = get_merge_method(method)
    if not state_dicts:
        raise ValueError("merge_state_dicts needs at least one state dict.")
    out: dict[str, torch.Tensor] = {}
    for name, first in state_dicts[0].items():
        for i, sd in enumerate(state_dicts):
            if name not in sd:
                raise ValueError(f"tensor {name!r} is missing from model {i}.")
        if not torch.is_floating_point(first):
            src = base[name] if base is not None and name in base else first
            out[name] = src.detach().clone()
            continue
        b = None
        if base is not None:
            if name not in base:
                raise ValueError(f"tensor {name!r} is missing from the base model.")
            b = base[name]
        out[name] = merge_tensors(
            method,
            [sd[name] for sd in state_dicts],
            base=b,
            weights=weights,
            params=params,
            tensor_name=name,
            seed=seed,
            out_dtype=out_dtype,
        )
    return out
