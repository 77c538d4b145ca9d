"""The methods added for mergekit 0.1.5 recipes, each against an independent float64 re-derivation of mergekit's
definition (written from `mergekit/merge_methods/*.py` and `mergekit/sparsify.py`, not calling hf_stable's code),
plus the rescale rules of DARE and TIES.

Random methods (DARE, DELLA) are checked on hf_stable's own masks (the arithmetic) and statistically (the kept
fraction), since mergekit's `torch.bernoulli` stream cannot be reproduced.
"""

from __future__ import annotations

import math

import pytest
import torch

from hf_stable.merging import rng
from hf_stable.merging.methods import get_merge_method
from hf_stable.merging.reference import merge_tensors


def _data(n_models=3, shape=(12, 10), seed=0, spread=0.3):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(shape, generator=g)
    xs = [base + spread * torch.randn(shape, generator=g) for _ in range(n_models)]
    return base, xs


def _d(x):
    return x.double().reshape(-1)


def _close(got, expected, tol=2e-6):
    got, expected = got.double().reshape(-1), expected.double().reshape(-1)
    scale = max(float(expected.abs().max()), 1.0)
    assert float((got - expected).abs().max()) <= tol * scale


# ------------------------------------------------------------------------------------------------ gram kind
def test_multislerp_fp64():
    base, xs = _data(3)
    w = torch.tensor([0.2, 0.5, 1.3], dtype=torch.float64)
    for with_base, normalize in [(False, True), (True, True), (True, False)]:
        vs = [_d(x) - (_d(base) if with_base else 0) for x in xs]
        a = w / w.sum() if normalize else w
        norms = torch.stack([v.norm() for v in vs])
        units = [v / (n + 1e-8) for v, n in zip(vs, norms, strict=True)]
        mean = sum(ai * u for ai, u in zip(a, units, strict=True))
        expected = mean / mean.norm() * (norms * a).sum() + (_d(base) if with_base else 0)
        params = {"normalize_weights": normalize}
        got = merge_tensors("multislerp", xs, base=base if with_base else None, weights=w.tolist(), params=params)
        _close(got, expected)


def test_multislerp_antipodal_fallback_and_error():
    x = torch.randn(50)
    got = merge_tensors("multislerp", [x, -x], weights=[1.0, 1.0])  # 2 inputs: the weighted sum
    _close(got, torch.zeros(50))
    with pytest.raises(ValueError, match="antipodal"):
        merge_tensors("multislerp", [x, -x, x - x], weights=[1.0, 1.0, 1.0])


def _nuslerp_ref(v0, v1, t):
    """mergekit `nuslerp` on float64 rows (last dimension)."""
    n0 = v0.norm(dim=-1, keepdim=True).clamp(min=1e-7)
    n1 = v1.norm(dim=-1, keepdim=True).clamp(min=1e-7)
    cos = ((v0 / n0) * (v1 / n1)).sum(-1, keepdim=True).clamp(-1, 1)
    colinear = (1 - cos**2) <= 1e-16
    theta = torch.acos(torch.where(colinear, torch.zeros_like(cos), cos))
    res = (torch.sin((1 - t) * theta) * v0 + torch.sin(t * theta) * v1) / torch.sin(theta)
    return torch.where(colinear, (1 - t) * v0 + t * v1, res)


@pytest.mark.parametrize("mode", ["flatten", "rows", "columns"])
@pytest.mark.parametrize("with_base", [False, True])
def test_nuslerp_fp64(mode, with_base):
    base, xs = _data(2, shape=(9, 7), seed=3, spread=0.8)
    w = [0.7, 1.9]
    t = w[1] / sum(w)
    v0, v1 = (x.double() - (base.double() if with_base else 0) for x in xs)
    if mode == "flatten":
        expected = _nuslerp_ref(v0.reshape(-1), v1.reshape(-1), t).reshape(v0.shape)
    elif mode == "rows":
        expected = _nuslerp_ref(v0, v1, t)
    else:
        expected = _nuslerp_ref(v0.T, v1.T, t).T
    expected = expected + (base.double() if with_base else 0)
    params = {"nuslerp_flatten": mode == "flatten", "nuslerp_row_wise": mode == "columns"}
    got = merge_tensors("nuslerp", xs, base=base if with_base else None, weights=w, params=params)
    _close(got, expected)
    vec = merge_tensors("nuslerp", [x[0] for x in xs], weights=w, params=params)  # a vector is one row/column
    _close(vec, _nuslerp_ref(xs[0][0].double(), xs[1][0].double(), t))


def _model_stock_ref(base, xs, filter_wise):
    w0 = base.double()
    ws = [x.double() for x in xs]
    if not filter_wise or w0.dim() == 1:
        w0, ws = w0.reshape(1, -1), [w.reshape(1, -1) for w in ws]
    offsets = [w - w0 for w in ws]
    cos = []
    for i, a in enumerate(offsets):
        for b in offsets[i + 1 :]:
            cos.append(((a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1)).clamp(min=1e-6)).clamp(-1, 1))
    c = torch.stack(cos).mean(0).unsqueeze(-1)
    n = len(ws)
    den = 1 + (n - 1) * c
    t = torch.where(den.abs() < 1e-6, torch.zeros_like(c), n * c / den)
    return (t * (sum(ws) / n) + (1 - t) * w0).reshape(base.shape)


@pytest.mark.parametrize("filter_wise", [False, True])
def test_model_stock_fp64(filter_wise):
    base, xs = _data(3, seed=5)
    got = merge_tensors("model_stock", xs, base=base, params={"filter_wise": filter_wise})
    _close(got, _model_stock_ref(base, xs, filter_wise))
    got = merge_tensors("model_stock", [x[0] for x in xs], base=base[0], params={"filter_wise": filter_wise})
    _close(got, _model_stock_ref(base[0], [x[0] for x in xs], filter_wise))
    # mergekit 0.1.5 accepts a per-model weight on model_stock and ignores it: the same output, and a warning
    params = {"filter_wise": filter_wise}
    with pytest.warns(UserWarning, match="weight"):
        weighted = merge_tensors("model_stock", xs, base=base, weights=[3, 1, 0.5], params=params)
    assert torch.equal(weighted, merge_tensors("model_stock", xs, base=base, params=params))


def test_passthrough_copies_and_scales():
    x = torch.randn(6, 4)
    assert torch.equal(merge_tensors("passthrough", [x]), x)
    _close(merge_tensors("passthrough", [x], params={"scale": 0.5}), x.double() * 0.5)
    with pytest.raises(ValueError, match="exactly 1"):
        merge_tensors("passthrough", [x, x])


def _karcher_ref(vs, max_iter, tol):
    """mergekit `karcher_merge_tensors` with uniform weights, in float64."""
    norms = [v.norm() for v in vs]
    units = [v / n for v, n in zip(vs, norms, strict=True)]
    a = 1 / len(vs)
    mean = sum(units) * a
    mean = mean / mean.norm()
    for _ in range(max_iter):
        tangent = torch.zeros_like(mean)
        for u in units:
            dot = torch.clamp(mean @ u, -1, 1)
            theta = torch.arccos(dot)
            if theta >= tol:
                tangent += a * (theta / torch.sin(theta)) * (u - dot * mean)
        tn = tangent.norm()
        if tn < tol:
            break
        mean = torch.cos(tn) * mean + torch.sin(tn) * tangent / tn
        mean = mean / mean.norm()
    return sum(norms) * a * mean


def test_karcher_is_mergekits_karcher_mean_and_ignores_weights():
    """`karcher` is fisher_rao at mergekit's iteration defaults (max_iter 10, tol 1e-5) with mergekit's uniform
    weights: mergekit's Karcher mean; per-model weights are ignored with a warning (mergekit 0.1.5
    `karcher_merge_method` sets α = 1/N), while fisher_rao honours them."""
    _, xs = _data(3, seed=7, spread=1.5)
    vs = [_d(x) for x in xs]
    _close(merge_tensors("karcher", xs), _karcher_ref(vs, 10, 1e-5), tol=1e-6)
    _close(merge_tensors("fisher_rao", xs), _karcher_ref(vs, 500, 1e-13), tol=1e-6)
    w = [1.0, 2.0, 3.0]
    with pytest.warns(UserWarning, match="weight"):
        weighted = merge_tensors("karcher", xs, weights=w)
    _close(weighted, merge_tensors("karcher", xs), tol=0)
    same = {"max_iter": 10, "tol": 1e-5}
    assert not torch.equal(merge_tensors("fisher_rao", xs, weights=w, params=same), merge_tensors("karcher", xs))


def test_arcee_fusion_fp64():
    base, xs = _data(1, shape=(20, 16), seed=11, spread=0.5)
    b, x = base.double(), xs[0].double()
    p = torch.softmax(x, -1) + 1e-8
    q = torch.softmax(b, -1) + 1e-8
    imp = (x - b).abs() * (p * torch.log(p / q)).sum(-1, keepdim=True)
    srt = imp.reshape(-1).sort().values
    n = srt.numel()
    q1, med, q3 = (srt[int(f * (n - 1))] for f in (0.25, 0.5, 0.75))
    expected = b + (x - b) * (imp >= med + 1.5 * (q3 - q1))
    got = merge_tensors("arcee_fusion", [base, xs[0]])
    frac_kept = float((got != base).double().mean())
    assert 0 < frac_kept < 0.5
    _close(got, expected)


# ------------------------------------------------------------------------------------------------ elementwise kind
def _gta_ref(taus, w, keeps, factors, consensus, normalize, lam):
    """mergekit `GeneralizedTaskArithmeticMerge.merge_group` on float64 task vectors with given masks/factors."""
    deltas = torch.stack([t * k * f for t, k, f in zip(taus, keeps, factors, strict=True)])
    wt = torch.tensor(w, dtype=torch.float64)[:, None]
    deltas = deltas * wt
    if consensus:
        majority = torch.where(deltas.sum(0) >= 0, 1.0, -1.0)
        mask = (torch.sign(deltas) == majority).double()
        mixed, divisor = (deltas * mask).sum(0), (wt * mask).sum(0)
        divisor[divisor == 0] = 1
    else:
        mixed, divisor = deltas.sum(0), wt.sum(0)
        divisor[divisor.abs() < 1e-8] = 1
    if normalize:
        mixed = mixed / divisor
    return lam * mixed


def _kth_mask(t, k):
    """Keep the k largest |t| (no ties in random data)."""
    m = torch.zeros_like(t)
    m[torch.topk(t.abs(), k).indices] = 1
    return m


@pytest.mark.parametrize("rescale", [False, True])
@pytest.mark.parametrize("name", ["ties", "breadcrumbs", "breadcrumbs_ties"])
def test_magnitude_methods_fp64(name, rescale):
    base, xs = _data(3, seed=13)
    taus = [_d(x) - _d(base) for x in xs]
    n = taus[0].numel()
    w, dens, gamma = [0.5, 1.0, 2.0], [0.3, 0.5, 0.9], [0.05, 0.1, 0.0]
    keeps = []
    for t, d, g in zip(taus, dens, gamma, strict=True):
        if name == "ties":
            keeps.append(_kth_mask(t, max(1, int(d * n))))
        else:  # magnitude_outliers: ascending ranks [n_bot, n_bot + k)
            k, n_top = int(d * n), int(g * n)
            n_bot = max(0, n - k - n_top)
            order = torch.argsort(t.abs())
            m = torch.zeros_like(t)
            m[order[n_bot : n_bot + k]] = 1
            keeps.append(m)
    factors = [t.abs().sum() / (t * k).abs().sum() if rescale else 1.0 for t, k in zip(taus, keeps, strict=True)]
    consensus = name != "breadcrumbs"
    method = get_merge_method(name)
    normalize = method.param_defaults["normalize"]
    expected = _d(base) + _gta_ref(taus, w, keeps, factors, consensus, normalize, 0.8)
    params = {"density": dens, "rescale": rescale, "lambda": 0.8}
    if name != "ties":
        params["gamma"] = gamma
    got = merge_tensors(name, xs, base=base, weights=w, params=params)
    _close(got, expected)


def test_ties_rescale_is_mergekit_l1():
    """TIES `rescale: true` (refused before) scales each trimmed task vector to its L1 norm (mergekit 0.1.5)."""
    base, xs = _data(1, seed=17)
    tau = _d(xs[0]) - _d(base)
    keep = _kth_mask(tau, int(0.4 * tau.numel()))
    expected = _d(base) + tau * keep * (tau.abs().sum() / (tau * keep).abs().sum())
    got = merge_tensors("ties", xs, base=base, params={"density": 0.4, "rescale": True})
    _close(got, expected)
    plain = merge_tensors("ties", xs, base=base, params={"density": 0.4})
    _close(plain, _d(base) + tau * keep)


def test_dare_rescale_is_mergekit_l1_and_paper_option():
    """DARE's default rescale matches mergekit 0.1.5 (L1 norm of the task vector); the paper's 1/density is
    `rescale_norm: inverse_density`. Both on hf_stable's own mask."""
    base, xs = _data(2, shape=(40, 25), seed=19)
    name, seed, dens = "model.layers.0.mlp.up_proj.weight", 5, [0.3, 0.7]
    taus = [_d(x) - _d(base) for x in xs]
    pairs = enumerate(zip(taus, dens, strict=True))
    keeps = [rng.keep_mask(seed, i, name, 0, t.numel(), d).double() for i, (t, d) in pairs]
    kw = {"base": base, "tensor_name": name, "seed": seed, "weights": [1.0, 0.5]}
    l1 = [t.abs().sum() / (t * k).abs().sum() for t, k in zip(taus, keeps, strict=True)]
    for consensus, method in [(False, "dare_linear"), (True, "dare_ties")]:
        got = merge_tensors(method, xs, params={"density": dens}, **kw)
        _close(got, _d(base) + _gta_ref(taus, [1.0, 0.5], keeps, l1, consensus, False, 1.0))
        paper = merge_tensors(method, xs, params={"density": dens, "rescale_norm": "inverse_density"}, **kw)
        inv = [1 / d for d in dens]
        _close(paper, _d(base) + _gta_ref(taus, [1.0, 0.5], keeps, inv, consensus, False, 1.0))
        none = merge_tensors(method, xs, params={"density": dens, "rescale": False}, **kw)
        _close(none, _d(base) + _gta_ref(taus, [1.0, 0.5], keeps, [1.0, 1.0], consensus, False, 1.0))
    with pytest.raises(ValueError, match="rescale_norm"):
        get_merge_method("dare_ties").validate({"rescale": False, "rescale_norm": "inverse_density"}, 2, True)


@pytest.mark.parametrize("name", ["della", "della_linear"])
def test_della_fp64_on_our_mask_and_kept_fraction(name):
    base, xs = _data(2, shape=(64, 50), seed=23)
    tname, seed = "model.layers.1.self_attn.q_proj.weight", 9
    dens, eps = [0.4, 0.6], [0.15, 0.1]
    taus = [x.double() - base.double() for x in xs]
    keeps = []
    for i, (t, d, e) in enumerate(zip(taus, dens, eps, strict=True)):
        ranks = torch.argsort(torch.argsort(t.abs(), dim=1, stable=True), dim=1).double()  # 0-based, ties by position
        probs = (d - e) + ranks / (t.shape[1] - 1) * 2 * e
        u = rng.uniform(seed, i, tname, 0, t.numel()).reshape(t.shape)
        keeps.append((u < probs).double().reshape(-1))
        assert abs(float(keeps[-1].mean()) - d) < 4 * math.sqrt(d * (1 - d) / t.numel())  # kept fraction
    flat = [t.reshape(-1) for t in taus]
    l1 = [t.abs().sum() / (t * k).abs().sum() for t, k in zip(flat, keeps, strict=True)]
    method = get_merge_method(name)
    expected = _d(base) + _gta_ref(
        flat, [1.0, 1.0], keeps, l1, name == "della", method.param_defaults["normalize"], 1.0
    )
    got = merge_tensors(name, xs, base=base, params={"density": dens, "epsilon": eps}, tensor_name=tname, seed=seed)
    _close(got, expected)
    with pytest.raises(ValueError, match="epsilon"):
        method.validate({"density": 0.9, "epsilon": 0.15}, 2, True)


def test_slerp_extrapolation_is_refused_unless_allowed():
    _, xs = _data(2)
    with pytest.raises(ValueError, match="allow_extrapolation"):
        merge_tensors("slerp", xs, params={"t": 1.5})
    with pytest.raises(ValueError, match="allow_extrapolation"):
        merge_tensors("slerp", xs, weights=[-0.5, 1.0])  # t = 2 from the weights
    got = merge_tensors("slerp", xs, params={"t": 1.5, "allow_extrapolation": True})
    assert torch.isfinite(got).all()
