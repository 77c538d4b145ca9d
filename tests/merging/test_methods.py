"""Registered merge methods against independent hand computations, PEFT parity, tiling invariance and the DARE RNG."""

import itertools
import math
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from peft.utils import merge_utils

from hf_stable.merging import rng
from hf_stable.merging.gram import gram
from hf_stable.merging.methods import (
    MERGE_METHODS,
    ElementwiseMethod,
    GramMethod,
    apply_coefficients,
    gather_params,
    get_merge_method,
    keep_count,
)
from hf_stable.merging.reference import merge_tensors


ALL = ["linear", "task_arithmetic", "ties", "dare_linear", "dare_ties", "slerp", "fisher_rao", "karcher", "nre"]
ALL += ["nre_unit", "wsm"]


def _data(n_models=3, shape=(24, 16), seed=0):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(shape, generator=g)
    xs = [base + 0.3 * torch.randn(shape, generator=g) for _ in range(n_models)]
    return base, xs


# ------------------------------------------------------------------------------------------------- registry
def test_registry_and_kinds():
    assert set(ALL) <= set(MERGE_METHODS.names())
    for name in ALL:
        m = get_merge_method(name)
        assert m.name == name
        assert m.kind in ("gram", "elementwise")
        assert isinstance(m, GramMethod if m.kind == "gram" else ElementwiseMethod)
        assert MERGE_METHODS.get(name).paper and MERGE_METHODS.get(name).url
    assert get_merge_method("ties").kind == "elementwise"
    assert not get_merge_method("linear").needs_gram({})
    assert get_merge_method("fisher_rao").needs_gram({})
    assert get_merge_method("ties").requires_base({}) and not get_merge_method("linear").requires_base({})
    assert get_merge_method("fisher_rao").requires_base({"space": "task_vector"})
    assert get_merge_method("ties").densities({"density": [0.5, 1.0]}, 2) == (0.5, 1.0)
    assert get_merge_method("ties").densities({"density": 1.0}, 2) is None
    assert get_merge_method("dare_ties").densities({"density": 0.5}, 2) is None  # random: no thresholds
    with pytest.raises(ValueError, match="Valid names"):
        get_merge_method("tiess")


def test_merge_method_declares_the_name_and_the_description_once(monkeypatch):
    """`@merge_method(name, paper)` registers the class under `name`, which becomes its `default_name`, with the first
    paragraph of its own docstring as the description; a class without a docstring of its own is refused."""
    from hf_stable import registry
    from hf_stable.merging.methods import base

    monkeypatch.setattr(registry, "_FAMILIES", dict(registry._FAMILIES))  # the probe family leaves no trace
    probes = registry.Registry("merge_method_probe")
    monkeypatch.setattr(base, "MERGE_METHODS", probes)

    @base.merge_method("probe", "A citation (no paper)", url="https://example.org/probe")
    class ProbeMethod(GramMethod):
        """Says what it does,
        over two lines.

        Details the description leaves out."""

    entry = probes.get("probe")
    assert entry.fn is ProbeMethod and ProbeMethod().name == "probe"
    assert entry.description == "Says what it does, over two lines."
    assert (entry.paper_text, entry.url) == ("A citation (no paper)", "https://example.org/probe")

    class Undocumented(ProbeMethod):
        pass

    with pytest.raises(TypeError, match=r"'bare' .* needs a docstring"):
        base.merge_method("bare", "A citation")(Undocumented)
    assert probes.names() == ["probe"]


@pytest.mark.parametrize(
    "name,params,n,has_base,match",
    [
        ("ties", {"density": 1.5}, 2, True, "density"),
        ("ties", {"density": 0.0}, 2, True, "density"),
        ("ties", {"density": [0.5]}, 2, True, "density"),
        ("ties", {"desnity": 0.5}, 2, True, "unknown parameter"),
        ("ties", {}, 2, False, "base_model"),
        ("slerp", {"t": 0.5}, 3, False, "exactly 2"),
        ("fisher_rao", {"solver": "newton"}, 2, False, "solver"),
        ("fisher_rao", {"norm": "l1"}, 2, False, "norm"),
        ("fisher_rao", {"space": "task_vector"}, 2, False, "base_model"),
        ("fisher_rao", {"max_iter": -1}, 2, False, "max_iter"),
        ("linear", {"normalize": "yes"}, 2, False, "normalize"),
        ("wsm", {"schedule": "nope"}, 3, False, "wsm"),
    ],
)
def test_validate_errors(name, params, n, has_base, match):
    with pytest.raises(ValueError, match=match):
        get_merge_method(name).validate(params, n, has_base)


def test_validate_accepts_defaults_and_int8_mask_only_where_mergekit_declares_it():
    for name in ALL:
        n = 2 if name == "slerp" else 3
        get_merge_method(name).validate({}, n, True)
    for name in ("ties", "dare_linear", "dare_ties"):  # mergekit's GTA methods declare int8_mask (a memory option)
        get_merge_method(name).validate({"int8_mask": True}, 3, True)
    with pytest.raises(ValueError, match="unknown parameter"):
        get_merge_method("linear").validate({"int8_mask": True}, 3, True)


def test_gather_params():
    w, p = gather_params({"normalize": True}, [{"weight": 1.0, "density": 0.5}, {"weight": 2.0, "density": 0.7}])
    assert w == [1.0, 2.0] and p == {"normalize": True, "density": [0.5, 0.7]}
    w, p = gather_params({"density": 0.3}, [{"weight": 1.0}, {"density": 0.3}])
    assert w == [1.0, 1.0] and p == {"density": 0.3}
    w, p = gather_params({"weight": 0.5}, [{}, {}])
    assert w == [0.5, 0.5] and p == {}


# ------------------------------------------------------------------------------------------------- gram kind
def test_linear_and_task_arithmetic_hand_computed():
    base, xs = _data()
    w = [0.2, 0.5, 1.3]
    expected = sum(wi * x for wi, x in zip(w, xs, strict=True)) / sum(w)
    assert torch.allclose(merge_tensors("linear", xs, weights=w), expected, atol=1e-6)
    expected = sum(wi * x for wi, x in zip(w, xs, strict=True))
    assert torch.allclose(merge_tensors("linear", xs, weights=w, params={"normalize": False}), expected, atol=1e-5)
    lam = 0.7
    expected = base + lam * sum(wi * (x - base) for wi, x in zip(w, xs, strict=True))
    got = merge_tensors("task_arithmetic", xs, base=base, weights=w, params={"lambda": lam})
    assert torch.allclose(got, expected, atol=1e-5)
    expected = base + sum(wi * (x - base) for wi, x in zip(w, xs, strict=True)) / sum(w)
    got = merge_tensors("task_arithmetic", xs, base=base, weights=w, params={"normalize": True})
    assert torch.allclose(got, expected, atol=1e-5)


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    weights=st.lists(st.floats(0.05, 5.0), min_size=2, max_size=5),
    k=st.floats(0.1, 10.0),
    lam=st.floats(-2.0, 2.0),
)
def test_linear_combination_invariances(seed, weights, k, lam):
    base, xs = _data(len(weights), shape=(6, 5), seed=seed)
    out = merge_tensors("linear", xs, weights=weights)
    # normalised weights: scale-free, permutation-invariant, affine (adding c to every input adds c)
    assert torch.allclose(merge_tensors("linear", xs, weights=[k * w for w in weights]), out, atol=1e-5)
    perm = torch.randperm(len(xs), generator=torch.Generator().manual_seed(seed)).tolist()
    assert torch.allclose(
        merge_tensors("linear", [xs[i] for i in perm], weights=[weights[i] for i in perm]), out, atol=1e-5
    )
    assert torch.allclose(merge_tensors("linear", [x + 3.0 for x in xs], weights=weights), out + 3.0, atol=1e-5)
    # task arithmetic is linear in λ and independent of the base when λ Σ w = 1
    ta1 = merge_tensors("task_arithmetic", xs, base=base, weights=weights) - base
    tal = merge_tensors("task_arithmetic", xs, base=base, weights=weights, params={"lambda": lam}) - base
    assert torch.allclose(tal, lam * ta1, atol=1e-4)
    unit = merge_tensors("task_arithmetic", xs, base=base, weights=weights, params={"lambda": 1 / sum(weights)})
    assert torch.allclose(unit, out, atol=1e-5)


def test_task_arithmetic_matches_peft():
    base, xs = _data()
    w = torch.tensor([0.2, 0.5, 1.3])
    ours = merge_tensors("task_arithmetic", xs, base=base, weights=w)
    peft = base + merge_utils.task_arithmetic([x - base for x in xs], w)
    assert torch.allclose(ours, peft, atol=1e-5)


def test_slerp_mergekit_semantics():
    _, xs = _data(2)
    a, b = xs[0].double().reshape(-1), xs[1].double().reshape(-1)
    t = 0.3
    ah, bh = a / a.norm(), b / b.norm()
    om = math.acos(float(ah @ bh))
    expected = (math.sin((1 - t) * om) * a + math.sin(t * om) * b) / math.sin(om)  # raw vectors
    got = merge_tensors("slerp", xs, params={"t": t})
    assert torch.allclose(got.reshape(-1).double(), expected, atol=1e-5)
    # t from the weights when not given
    assert torch.allclose(merge_tensors("slerp", xs, weights=[0.7, 0.3]), got)
    # lerp fallback on nearly colinear inputs
    near = [xs[0], 1.5 * xs[0] + 1e-4]
    assert torch.allclose(merge_tensors("slerp", near, params={"t": t}), 0.7 * near[0] + 0.3 * near[1], atol=1e-6)


def test_fisher_rao_methods_and_alias():
    base, xs = _data(3)
    w = [1.0, 2.0, 3.0]
    x = torch.stack([t.reshape(-1).double() for t in xs])
    a = torch.tensor(w, dtype=torch.float64) / 6
    from hf_stable.merging.gram import karcher_direct

    expected = karcher_direct(x, a)
    got = merge_tensors("fisher_rao", xs, weights=w, params={"max_iter": 50, "tol": 1e-7})
    assert torch.allclose(got.reshape(-1).double(), expected, atol=1e-5)
    # karcher (mergekit's): uniform α whatever the weights (ignored with a warning); its defaults are (10, 1e-5)
    uniform = karcher_direct(x, torch.full((3,), 1 / 3, dtype=torch.float64))
    with pytest.warns(UserWarning, match="weight"):
        got = merge_tensors("karcher", xs, weights=w, params={"max_iter": 50, "tol": 1e-7})
    assert torch.allclose(got.reshape(-1).double(), uniform, atol=1e-5)
    # task-vector space: base + Karcher mean of the task vectors
    tv = x - base.reshape(-1).double()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # random task vectors are ~orthogonal: NRE fallback may trigger
        coeffs = get_merge_method("fisher_rao").coefficients(gram(tv), a, {"space": "task_vector"})
        got = merge_tensors("fisher_rao", xs, base=base, weights=w, params={"space": "task_vector"})
    assert torch.allclose(got.reshape(-1).double(), base.reshape(-1).double() + coeffs @ tv, atol=1e-5)
    s = float((a * x.norm(dim=1)).sum())
    raw = (a[:, None] * x).sum(0)
    assert torch.allclose(merge_tensors("nre", xs, weights=w).reshape(-1).double(), s * raw / raw.norm(), atol=1e-5)
    unit = (a[:, None] * x / x.norm(dim=1, keepdim=True)).sum(0)
    got = merge_tensors("nre_unit", xs, weights=w).reshape(-1).double()
    assert torch.allclose(got, s * unit / unit.norm(), atol=1e-5)


def test_wsm_coefficients_from_schedule():
    wsm = pytest.importorskip("hf_stable.merging.wsm", reason="hf_stable.merging.wsm (helper 'callbacks') missing")
    _, xs = _data(5)
    _, c = wsm.wsm_weights("1-sqrt", 4, quadrature="mid", floor=0.0)
    expected = sum(ci * x for ci, x in zip(c, xs, strict=True))
    assert torch.allclose(merge_tensors("wsm", xs), expected, atol=1e-5)
    _, c = wsm.wsm_weights("cosine", 4, quadrature="left", floor=0.1)
    got = merge_tensors("wsm", xs, params={"schedule": "cosine", "quadrature": "left", "floor": 0.1})
    assert torch.allclose(got, sum(ci * x for ci, x in zip(c, xs, strict=True)), atol=1e-5)


@pytest.mark.parametrize("name", [n for n in ALL if n not in ("wsm", "karcher")])  # karcher: mergekit's uniform α
def test_weights_change_the_output(name):
    base, xs = _data(2 if name == "slerp" else 3, seed=4)
    params = {"density": 0.6} if name in ("ties", "dare_ties", "dare_linear") else {}
    if name in ("ties", "dare_ties"):
        params["normalize"] = True  # otherwise an overall scale of the weights is the only difference
    n = len(xs)
    w1, w2 = [1.0] * n, [3.0] + [1.0] * (n - 1)
    a = merge_tensors(name, xs, base=base, weights=w1, params=params)
    b = merge_tensors(name, xs, base=base, weights=w2, params=params)
    assert (a - b).abs().max() > 1e-4


def test_apply_coefficients_bitwise_tiling_invariant():
    v = torch.randn(4, 1001)
    c = torch.tensor([0.1, -0.7, 1.3, 0.25], dtype=torch.float64)
    base = torch.randn(1001)
    whole = apply_coefficients(v, c, base)
    tiles = torch.cat([apply_coefficients(v[:, a:b], c, base[a:b]) for a, b in [(0, 3), (3, 517), (517, 1001)]])
    assert torch.equal(whole, tiles)


# ------------------------------------------------------------------------------------------------- TIES / DARE
def _ties_hand(taus, w, dens, normalize=True, lam=1.0):
    """TIES from the paper/mergekit description, with topk-based trimming, one element at a time in float64."""
    n, numel = len(taus), taus[0].numel()
    trimmed = []
    for t, d in zip(taus, dens, strict=True):
        flat = t.reshape(-1).double()
        k = int(d * numel)
        mask = torch.zeros(numel, dtype=torch.bool)
        mask[torch.topk(flat.abs(), k).indices] = True
        trimmed.append(torch.where(mask, flat, 0.0))
    out = torch.zeros(numel, dtype=torch.float64)
    for j in range(numel):
        vals = [w[i] * float(trimmed[i][j]) for i in range(n)]
        elected = 1.0 if sum(vals) >= 0 else -1.0
        agree = [i for i in range(n) if vals[i] != 0 and math.copysign(1.0, vals[i]) == elected]
        num = sum(vals[i] for i in agree)
        den = sum(w[i] for i in agree) or 1.0
        out[j] = lam * (num / den if normalize else num)
    return out.reshape(taus[0].shape)


def test_ties_hand_computed_with_per_model_density():
    base, xs = _data(3, shape=(10, 12), seed=1)
    taus = [x - base for x in xs]
    w, dens = [0.5, 1.0, 2.0], [0.3, 0.5, 0.9]
    for normalize, lam in [(True, 1.0), (False, 0.6)]:
        params = {"density": dens, "normalize": normalize, "lambda": lam}
        got = merge_tensors("ties", xs, base=base, weights=w, params=params) - base
        assert torch.allclose(got.double(), _ties_hand(taus, w, dens, normalize, lam), atol=1e-5)


def test_ties_matches_peft_with_unit_weights():
    base, xs = _data(4, shape=(32, 16), seed=2)
    taus = [x - base for x in xs]
    for density in (0.2, 0.5, 1.0):
        ours = merge_tensors("ties", xs, base=base, params={"density": density})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # PEFT warns that density 1 prunes nothing
            peft = base + merge_utils.ties(taus, torch.ones(4), density)
        assert torch.allclose(ours, peft, atol=1e-6)


def test_dare_matches_peft_at_density_one():
    base, xs = _data(3, seed=3)
    taus = [x - base for x in xs]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lin = base + merge_utils.dare_linear(taus, torch.ones(3), 1.0)
        ties = base + merge_utils.dare_ties(taus, torch.ones(3), 1.0)
    assert torch.allclose(merge_tensors("dare_linear", xs, base=base, params={"density": 1.0}), lin, atol=1e-6)
    got = merge_tensors("dare_ties", xs, base=base, params={"density": 1.0, "normalize": True})
    assert torch.allclose(got, ties, atol=1e-6)


def test_dare_matches_peft_formula_on_our_mask():
    base, xs = _data(3, shape=(40, 25), seed=5)
    taus = [(x - base).reshape(-1) for x in xs]
    dens, seed, name = [0.3, 0.6, 0.9], 17, "model.layers.0.mlp.up_proj.weight"
    # PEFT random_pruning with the mask injected: tensor * mask / density
    pruned = [
        t * rng.keep_mask(seed, i, name, 0, t.numel(), d) / d for i, (t, d) in enumerate(zip(taus, dens, strict=True))
    ]
    stacked = torch.stack(pruned)
    ones = torch.ones(3)
    lin = merge_utils.task_arithmetic(pruned, ones)
    sign = merge_utils.calculate_majority_sign_mask(stacked, method="total")
    ties = merge_utils.disjoint_merge(stacked * ones[:, None], sign)
    kw = {"base": base, "tensor_name": name, "seed": seed}
    paper = {"density": dens, "rescale_norm": "inverse_density"}
    got = merge_tensors("dare_linear", xs, params=paper, **kw) - base
    assert torch.allclose(got.reshape(-1), lin, atol=1e-5)
    got = merge_tensors("dare_ties", xs, params={**paper, "normalize": True}, **kw) - base
    assert torch.allclose(got.reshape(-1), ties, atol=1e-5)
    # the paper's rescale, no division (normalize false)
    got = merge_tensors("dare_ties", xs, params={"density": dens, "rescale_norm": "inverse_density"}, **kw) - base
    assert torch.allclose(got.reshape(-1), (stacked * sign).sum(0), atol=1e-5)


def _split(n, cuts):
    bounds = [0, *sorted({c for c in cuts if 0 < c < n}), n]
    return list(itertools.pairwise(bounds))


@settings(max_examples=30, deadline=None)
@given(
    name=st.sampled_from(["ties", "dare_ties", "dare_linear"]),
    cuts=st.lists(st.integers(1, 499), max_size=6),
    seed=st.integers(0, 2**40),
    normalize=st.booleans(),
)
def test_combine_is_tiling_invariant(name, cuts, seed, normalize):
    m = get_merge_method(name)
    g = torch.Generator().manual_seed(seed % 1000)
    v = torch.randn(3, 500, generator=g)
    w = torch.tensor([0.5, 1.0, 1.5])
    params = m.resolve({"density": [0.4, 0.7, 0.5], "normalize": normalize})
    thr = None
    if m.densities(params, 3) is not None:
        thr = torch.tensor(
            [float(torch.topk(v[i].abs(), keep_count(d, 500)).values[-1]) for i, d in enumerate([0.4, 0.7, 0.5])]
        )
    kw = {"thresholds": thr, "tensor_name": "w", "seed": seed}
    sums = None
    if m.needs_sums(params):  # DARE's L1 rescale: whole-tensor norms gathered chunk by chunk, then the combine
        sums = m.new_sums(3)
        for a, b in _split(500, cuts):
            m.accumulate(sums, v[:, a:b], w, params, offset=a, **kw)
    whole = m.combine(v, w, params, offset=0, sums=sums, **kw)
    tiles = torch.cat([m.combine(v[:, a:b], w, params, offset=a, sums=sums, **kw) for a, b in _split(500, cuts)])
    assert torch.equal(whole, tiles)


# ------------------------------------------------------------------------------------------------- RNG
@settings(max_examples=30, deadline=None)
@given(cuts=st.lists(st.integers(1, 2999), max_size=8), seed=st.integers(0, 2**63 - 1), start=st.integers(0, 2**34))
def test_rng_tiling_independence(cuts, seed, start):
    whole = rng.uniform(seed, 2, "a.weight", start, 3000)
    parts = torch.cat([rng.uniform(seed, 2, "a.weight", start + a, b - a) for a, b in _split(3000, cuts)])
    assert torch.equal(whole, parts)
    assert float(whole.min()) >= 0.0 and float(whole.max()) < 1.0


def test_rng_is_splitmix64_of_a_keyed_weyl_sequence():
    """Exact values against SplitMix64's output function in plain Python integers (Steele, Lea, Flood 2014), at
    indices below and above 2^32: the vectorised int64 version (wrapping products, masked logical shifts) is it."""
    m64 = (1 << 64) - 1
    key = rng.stream_key(7, 3, "model.layers.0.mlp.up_proj.weight")
    state0 = ((key << 32) | rng._hash32_int(key ^ 0x9E3779B9)) & m64

    def splitmix_top32(i):
        z = (state0 + i * 0x9E3779B97F4A7C15) & m64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m64
        return (z ^ (z >> 31)) >> 32

    for start in (0, 2**32 - 3, 2**40 + 11):
        got = rng.random_bits(7, 3, "model.layers.0.mlp.up_proj.weight", start, 6).tolist()
        assert got == [splitmix_top32(start + j) for j in range(6)]


def test_rng_keep_rate_and_independence_of_keys():
    n = 200_000
    for p in (0.1, 0.5, 0.9):
        rate = float(rng.keep_mask(0, 0, "t", 0, n, p).double().mean())
        assert abs(rate - p) < 5 * math.sqrt(p * (1 - p) / n)
    assert bool(rng.keep_mask(0, 0, "t", 0, 1000, 1.0).all()) and not bool(
        rng.keep_mask(0, 0, "t", 0, 1000, 0.0).any()
    )
    u = rng.uniform(0, 0, "t", 0, n)
    assert abs(float(u.mean()) - 0.5) < 0.005 and abs(float(u.var()) - 1 / 12) < 0.002
    # decorrelated across neighbouring elements, models, tensors, seeds
    assert abs(float(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1])) < 0.01
    for other in (rng.uniform(0, 1, "t", 0, n), rng.uniform(0, 0, "u", 0, n), rng.uniform(1, 0, "t", 0, n)):
        assert abs(float(torch.corrcoef(torch.stack([u, other]))[0, 1])) < 0.01
    # indices beyond 2^32 get fresh values
    assert not torch.equal(rng.uniform(0, 0, "t", 2**32, 100), rng.uniform(0, 0, "t", 0, 100))
    with pytest.raises(ValueError, match="density"):
        rng.keep_mask(0, 0, "t", 0, 10, 1.5)


def test_dare_expected_value_is_preserved():
    """The paper's rescale (`rescale_norm: inverse_density`): kept entries / density, so E[out] = τ."""
    v = torch.full((1, 100_000), 2.0)
    m = get_merge_method("dare_linear")
    params = m.resolve({"density": 0.25, "rescale_norm": "inverse_density"})
    out = m.combine(v, torch.ones(1), params, thresholds=None, tensor_name="x", offset=0, seed=3)
    kept = out != 0
    assert torch.all(out[kept] == 8.0)
    assert abs(float(out.mean()) - 2.0) < 0.05


def test_unbuilt_options_are_refused_not_ignored():
    """`granularity` other than per-tensor and a task-vector SLERP are not implemented: they must fail loudly."""
    from hf_stable.merging.methods import get_merge_method

    with pytest.raises(ValueError, match="`granularity`='global'"):
        get_merge_method("fisher_rao").validate({"granularity": "global"}, 2, False)
    get_merge_method("fisher_rao").validate({"granularity": "tensor"}, 2, False)
    with pytest.raises(ValueError, match="space"):
        get_merge_method("slerp").validate({"space": "task_vector"}, 2, True)


def test_apply_coefficients_in_place_is_bitwise_equal_to_the_out_of_place_form():
    """The engine scales its private tile buffer in place (no temporaries); the roundings must not change."""
    from hf_stable.merging.methods import apply_coefficients

    g = torch.Generator().manual_seed(0)
    v, base = torch.randn(5, 1001, generator=g), torch.randn(1001, generator=g)
    c = torch.rand(5, dtype=torch.float64, generator=g)
    expected = apply_coefficients(v, c, base)
    work = v.clone()
    assert torch.equal(apply_coefficients(work, c, base, inplace=True), expected)
    assert not torch.equal(work, v)  # the buffer was used as scratch
    assert torch.equal(apply_coefficients(v.clone(), c, None, inplace=True), apply_coefficients(v, c))
