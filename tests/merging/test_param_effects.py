"""No silent merge parameter: every parameter every merge method declares changes the merged output when set away
from its default, or is refused with a message naming it.

The parameters are enumerated from the methods' declarations (`MergeMethod.params`), so a parameter added without
an entry in `CHANGED` (the value to try) or `IO_ONLY` (with its reason) fails `test_every_parameter_is_covered`.
Some parameters only act in a context (a rescale needs a sparsified task vector, `allow_extrapolation` needs `t`
outside [0, 1]): `CONTEXT` sets it, for both the default and the changed run.
"""

from __future__ import annotations

import pytest
import torch
from merge_helpers import load_folder_state_dict

from hf_stable.merging.methods import MERGE_METHODS, get_merge_method
from hf_stable.merging.reference import merge_tensors


# Parameters that cannot change a merge, each with the reason.
IO_ONLY = {
    "int8_mask": "mergekit's memory option for its sign mask (int8 instead of the compute dtype); hf_stable never "
    "materialises that mask, so the merged values are the same by construction.",
}

# The value tried instead of the default, per parameter name (per-model parameters get it for every model).
CHANGED = {
    "weight": [3.0, 1.0, 0.5],
    "density": 0.5,
    "lambda": 0.6,
    "normalize": "flip",
    "rescale": "flip",
    "rescale_norm": "inverse_density",
    "gamma": 0.2,
    "epsilon": 0.05,
    "t": 0.3,
    "allow_extrapolation": True,
    "nuslerp_flatten": False,
    "nuslerp_row_wise": True,
    "filter_wise": True,
    "normalize_weights": False,
    "eps": 1e3,  # fisher_rao family: every input's norm is below it, so every input is dropped
    "space": "task_vector",
    "solver": "nre",
    "norm": "max",
    "max_iter": 0,
    "tol": 0.5,
    "step": 0.25,
    "granularity": "global",
    "scale": 0.5,
    "schedule": "cosine",
    "quadrature": "left",
    "floor": 0.3,
    "r": 0.5,
    "alpha": 0.5,
    "select_topk": 0.5,
}

# Where one method needs another value than the name's (multislerp's eps is added to the norms).
CHANGED_FOR = {("multislerp", "eps"): 0.05}

# Extra parameters under which a parameter acts: {(method or "*", parameter): {parameter: value}}.
CONTEXT = {
    ("*", "rescale"): {"density": 0.5},
    ("*", "rescale_norm"): {"density": 0.5},
    ("*", "normalize"): {"density": 0.5},
    ("*", "gamma"): {"density": 0.5},
    ("*", "epsilon"): {"density": 0.5},
    ("*", "lambda"): {"density": 0.5},
    ("slerp", "allow_extrapolation"): {"t": 1.5},
    ("*", "step"): {"max_iter": 2},
    ("nuslerp", "nuslerp_row_wise"): {"nuslerp_flatten": False},
    # RAM+ rescales unique entries only: with epsilon at the task vectors' scale some entries are unique, some shared
    ("ramplus_tl", "r"): {"epsilon": 0.4},
    ("ramplus_tl", "alpha"): {"epsilon": 0.4},  # flattening wins (mergekit): per column only then
}

DATA_DRIVEN = "fw_merging"  # its parameters belong to FW-Merging's own schema (tests/merging/test_fw.py)


def _declared():
    for method in MERGE_METHODS:
        if method.name == DATA_DRIVEN:
            continue
        for param in get_merge_method(method.name).params:
            yield method.name, param


CASES = sorted({(name, p.name) for name, p in _declared()})


def test_every_parameter_is_covered():
    missing = sorted({p.name for _, p in _declared()} - set(CHANGED) - set(IO_ONLY))
    assert not missing, f"declare a changed value (CHANGED) or an I/O-only reason (IO_ONLY) for: {missing}"
    assert not get_merge_method(DATA_DRIVEN).params


def _inputs(method):
    g = torch.Generator().manual_seed(0)
    base = torch.randn(8, 12, generator=g)
    n = method.max_models or 3
    xs = [base + 0.4 * torch.randn(8, 12, generator=g) for _ in range(n)]
    if method.base == "endpoint":
        xs = [base, *xs[1:]]
    return base, xs


def _merge(name, params, weights):
    method = get_merge_method(name)
    base, xs = _inputs(method)
    use_base = method.base in ("task_vector", "optional") or params.get("space") == "task_vector"
    w = None if weights is None else weights[: len(xs)]
    return merge_tensors(name, xs, base=base if use_base else None, weights=w, params=params, seed=1)


def _outcome(name, params, weights):
    try:
        return _merge(name, params, weights), None
    except ValueError as err:
        return None, str(err)


def _case(name, param):
    """`(context, params, weights, value)`: the parameters of the default run, and those of the changed run."""
    if param in IO_ONLY:
        pytest.skip(IO_ONLY[param])
    method = get_merge_method(name)
    declared = method.param(param)
    context = {**CONTEXT.get(("*", param), {}), **CONTEXT.get((name, param), {})}
    context = {k: v for k, v in context.items() if method.param(k) is not None}
    value = CHANGED_FOR.get((name, param), CHANGED[param])
    if value == "flip":
        value = not declared.default
    assert value != declared.default, f"{name}.{param}: the changed value equals the default"
    if param == "weight":
        return context, dict(context), value, value
    return context, {**context, param: value}, None, value


def _refused_by_name(name, param, default_err, changed_err) -> bool:
    if default_err is None and changed_err is None:
        return False
    err = changed_err if changed_err is not None else default_err
    assert f"`{param}`" in err or param in err, f"{name}.{param}: refused without naming it: {err}"
    return True


@pytest.mark.parametrize(("name", "param"), CASES, ids=[f"{n}.{p}" for n, p in CASES])
def test_changing_a_parameter_changes_the_merge_or_is_refused(name, param):
    context, params, weights, value = _case(name, param)
    default_out, default_err = _outcome(name, context, None)
    changed_out, changed_err = _outcome(name, params, weights)
    if _refused_by_name(name, param, default_err, changed_err):
        return
    assert not torch.equal(default_out, changed_out), f"{name}.{param}={value!r} does not change the merge"


# ---------------------------------------------------------------------------------------------------------------------
# The same matrix through a recipe: parsed by `MergeConfig` (per-model parameters under each model, the others under
# the recipe's `parameters:`), planned and merged by the streaming engine on pico checkpoints. A parameter that the
# parser, planner or engine dropped on the way to the method would pass above and fail here.

_RECIPE_DEFAULTS: dict = {}


def _recipe(name, params, weights, pico_models):
    method = get_merge_method(name)
    base, experts = pico_models["base"], pico_models["experts"]
    n = method.max_models or 3
    if method.base == "endpoint":  # mergekit's form: the base is listed first among the models
        paths = [base, *experts[: n - 1]]
    else:
        paths = experts[:n]
    per_model = {k: v for k, v in params.items() if method.param(k) is not None and method.param(k).per_model}
    models = []
    for i, path in enumerate(paths):
        own = {k: (v[i] if isinstance(v, list) else v) for k, v in per_model.items()}
        if weights is not None:
            own["weight"] = weights[i]
        models.append({"model": path, **({"parameters": own} if own else {})})
    recipe = {
        "merge_method": name,
        "models": models,
        "parameters": {k: v for k, v in params.items() if k not in per_model},
        "seed": 1,
    }
    if method.base in ("task_vector", "optional", "endpoint") or params.get("space") == "task_vector":
        recipe["base_model"] = base
    return recipe


def _recipe_outcome(tmp_path, recipe):
    from hf_stable.merging import merge

    try:
        merge(recipe, tmp_path, progress=False)
    except ValueError as err:
        return None, str(err)
    return load_folder_state_dict(tmp_path), None


@pytest.mark.slow
@pytest.mark.parametrize(("name", "param"), CASES, ids=[f"{n}.{p}" for n, p in CASES])
def test_changing_a_recipe_parameter_changes_the_merged_model_or_is_refused(pico_models, tmp_path, name, param):
    context, params, weights, value = _case(name, param)
    key = (name, tuple(sorted(context.items())))
    if key not in _RECIPE_DEFAULTS:
        _RECIPE_DEFAULTS[key] = _recipe_outcome(tmp_path / "default", _recipe(name, context, None, pico_models))
    default_out, default_err = _RECIPE_DEFAULTS[key]
    changed_out, changed_err = _recipe_outcome(tmp_path / "changed", _recipe(name, params, weights, pico_models))
    if _refused_by_name(name, param, default_err, changed_err):
        return
    assert set(default_out) == set(changed_out)
    assert any(not torch.equal(default_out[k], changed_out[k]) for k in default_out), (
        f"{name}.{param}={value!r} in a recipe does not change the merged model"
    )
