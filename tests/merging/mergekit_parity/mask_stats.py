"""Recovering the random masks of a DARE or DELLA merge from its output, and the statistical checks of the parity
suite (`test_mergekit_parity.py::test_random_methods_match_mergekit_statistically`).

What the output shows (mergekit 0.1.5 `merge_methods/generalized_task_arithmetic.py` and `sparsify.py`, read, not
copied). Per element, with τ_i = x_i − θ_0 the task vector of model i and S the set of models whose entry the mask
kept, the output is θ_0 + D_S, where, with g_i the factor a lone kept entry of model i is multiplied by (λ·w_i·f_i,
or λ·f_i under `normalize`, f_i the rescale factor of that model on that tensor):

* no sign consensus (`dare_linear`, `della_linear`): D_S = Σ_{i∈S} g_i τ_i;
* sign consensus (`dare_ties`, `della`): the elected sign is that of Σ_{i∈S} e_i g_i τ_i (0 counts as +; e_i = w_i
  under `normalize`, else 1), A ⊆ S the kept models of that sign, and D = Σ_{i∈A} e_i g_i τ_i / (Σ_{i∈A} w_i under
  `normalize`, else 1): a lone kept entry, or the sum of kept entries of one sign, never of opposite signs.

The g_i of a tensor are recovered as the values of D/τ_i that explain the most elements (an exact value in float32,
within the tolerance below in bfloat16); each element's output then names the set A it came from. Model i's mask
bit is *identified* on an element when every S that gives the same A agrees on i ∈ S: always without consensus, and
with two models of opposite signs for the larger |e_i g_i τ_i| (the winner) but not the smaller one (kept or not,
the winner hides it). Identification depends on τ and the recovered factors, not on the element's own
mask bit, so the identified elements are an unbiased sample of the mask.

Tolerance. float32 recipes: D is recovered to a few float32 roundings of the output (2⁻²⁴ relative). bfloat16
recipes: the output is rounded to bfloat16 relative to |θ_0 + D| (up to 2⁻⁸ |out|, about 1% of |D| here, since
|τ| ≈ 0.4 |θ_0|), and mergekit rounds τ, the L1 sums, their ratio, the weighted entries, their sum and the λ product
to bfloat16 each (its weights too: 0.6 is 0.6016); so an element is matched to a candidate within
2⁻⁸ |out| + 8 · 2⁻⁸ Σ_i |g_i τ_i|, and is counted (*resolved*) only where the candidates of different sets are
more than twice that apart (elements of tiny |τ| are not: that too depends on τ, not on the mask).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import product

import torch


DEFAULTS = {  # mergekit 0.1.5 registry defaults of (normalize, consensus)
    "dare_linear": (False, False),
    "dare_ties": (False, True),
    "della": (True, True),
    "della_linear": (False, False),
}
Z = 4.0  # binomial standard deviations allowed
# With two models, a tensor of 8 entries (the norms) can show a model's factor only inside a sum or once, where
# another factor explains the output as well: tensors below this size are left out (chosen by size, not by outcome).
MIN_NUMEL = 32


@dataclass
class Setup:
    """The inputs of a random-mask recipe: per tensor the task vectors `(k, n)`, keep probabilities `(k, n)` and
    base `(n,)` (float64, from the inputs rounded to the recipe's dtype), and the recipe's parameters."""

    method: str
    weights: list[float]
    lam: float
    normalize: bool
    consensus: bool
    rescale: bool
    dtype: torch.dtype  # the recipe's arithmetic dtype
    unit: float  # its unit roundoff
    tau: dict[str, torch.Tensor] = field(default_factory=dict)
    prob: dict[str, torch.Tensor] = field(default_factory=dict)
    quartile: dict[str, torch.Tensor] = field(default_factory=dict)  # within-row |τ| rank quartile, 0…3
    base: dict[str, torch.Tensor] = field(default_factory=dict)


def _param(recipe: dict, entry: dict, key: str, default):
    return (entry.get("parameters") or {}).get(key, (recipe.get("parameters") or {}).get(key, default))


def setup(recipe: dict, load) -> Setup:
    """`load(name)` → a checkpoint's tensors; the recipe is the parity recipe as written (model names)."""
    method = recipe["merge_method"]
    normalize, consensus = DEFAULTS[method]
    dtype = getattr(torch, recipe.get("dtype") or "float32")
    models = recipe["models"]
    s = Setup(
        method=method,
        weights=[float(_param(recipe, m, "weight", 1.0)) for m in models],
        lam=float((recipe.get("parameters") or {}).get("lambda", 1.0)),
        normalize=bool((recipe.get("parameters") or {}).get("normalize", normalize)),
        consensus=consensus,
        rescale=bool((recipe.get("parameters") or {}).get("rescale", True)),
        dtype=dtype,
        unit=torch.finfo(dtype).eps / 2,
    )
    base = load(recipe["base_model"])
    xs = [load(m["model"]) for m in models]
    for key, b in base.items():
        if len(models) > 1 and b.numel() < MIN_NUMEL:
            continue
        b16 = b.to(dtype)
        tau16 = torch.stack([x[key].to(dtype) - b16 for x in xs])  # τ as the recipe's dtype holds it (ranks)
        s.base[key] = b16.double().reshape(-1)
        s.tau[key] = torch.stack([x[key].to(dtype).double() - s.base[key].reshape(b.shape) for x in xs]).reshape(
            len(xs), -1
        )
        probs, quart = [], []
        for m, t in zip(models, tau16, strict=True):
            d = float(_param(recipe, m, "density", 1.0))
            rows = t.abs().reshape(-1, t.shape[-1]) if t.dim() > 1 else t.abs().reshape(1, -1)
            n = rows.shape[1]
            rank = torch.argsort(torch.argsort(rows.float(), dim=1, stable=True), dim=1).double() / max(n - 1, 1)
            quart.append((rank.reshape(-1) * 4).clamp(max=3.999).floor().long())
            if method.startswith("della"):
                eps = float(_param(recipe, m, "epsilon", 0.15))
                probs.append(((d - eps) + 2 * eps * rank).reshape(-1))
            else:
                probs.append(torch.full((t.numel(),), d, dtype=torch.float64))
        s.prob[key], s.quartile[key] = torch.stack(probs), torch.stack(quart)
    return s


def candidates(s: Setup, tau: torch.Tensor, g: torch.Tensor):
    """Per subset S of kept models (bitmask 0…2^k−1): the output delta D_S `(2^k, n)` and the set A it shows
    `(2^k, n)` as a bitmask."""
    k, n = tau.shape
    e = torch.tensor(s.weights, dtype=torch.float64) if s.normalize else torch.ones(k, dtype=torch.float64)
    w = torch.tensor(s.weights, dtype=torch.float64)
    terms = (e * g)[:, None] * tau  # (k, n)
    outs, shown = [], []
    for bits in range(2**k):
        member = torch.tensor([(bits >> i) & 1 for i in range(k)], dtype=torch.bool)
        kept = terms * member[:, None]
        if s.consensus:
            sign = torch.where(kept.sum(0) >= 0, 1.0, -1.0).double()
            agree = member[:, None] & (torch.sign(tau) == sign)
        else:
            agree = member[:, None].expand(k, n)
        num = (terms * agree).sum(0)
        if s.normalize:
            den = (w[:, None] * agree).sum(0)
            num = num / torch.where(den == 0, 1.0, den)
        outs.append(num)
        shown.append((agree.long() << torch.arange(k)[:, None]).sum(0))
    return torch.stack(outs), torch.stack(shown)


def _tolerance(s: Setup, out: torch.Tensor, tau: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    return s.unit * out.abs() + 8 * s.unit * (g[:, None] * tau).abs().sum(0) + 1e-30


def _explained(s: Setup, delta, out, tau, g) -> int:
    cand, _ = candidates(s, tau, g)
    return int(((cand - delta).abs() <= _tolerance(s, out, tau, g)).any(0).sum())


def recover_g(s: Setup, delta: torch.Tensor, out: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """The per-model factors `(k,)` of one tensor: of the three most shared values of D/τ_i per model (delta, out:
    `(n,)`; tau: `(k, n)`), the combination that explains the most elements, refined to the median over the
    elements that show the model alone."""
    k = tau.shape[0]
    window = 16 * s.unit if s.unit > 1e-6 else 1e-5
    options = []
    for i in range(k):
        r = delta / tau[i]
        r = r[(r > 0) & torch.isfinite(r)]
        picks = []
        while r.numel() and len(picks) < 3:
            near = (r[None, :] - r[:, None]).abs() <= window * r[:, None]
            best = int(near.sum(1).argmax())
            picks.append(float(r[near[best]].median()))
            r = r[~near[best]]
        options.append(picks or [1.0])
    g = max((torch.tensor(c, dtype=torch.float64) for c in product(*options)),
            key=lambda c: _explained(s, delta, out, tau, c))  # fmt: skip
    cand, shown = candidates(s, tau, g)
    tol = _tolerance(s, out, tau, g)
    for i in range(k):  # refine on the elements that show model i alone, unambiguously
        alone = ((cand[1 << i] - delta).abs() <= tol) & (shown[1 << i] == (1 << i))
        others = [b for b in range(2**k) if b != 1 << i]
        alone &= ((cand[others] - cand[1 << i]).abs() > 2 * tol).all(0) & (tau[i].abs() > 0)
        if int(alone.sum()):
            g[i] = float((delta[alone] / tau[i][alone]).median())
    return g


@dataclass
class Recovered:
    """One tool's output read back: per tensor, g `(k,)`, and per element whether it is resolved and explained,
    the set A it shows (bitmask), and per model whether its mask bit is identified."""

    g: dict[str, torch.Tensor] = field(default_factory=dict)
    resolved: dict[str, torch.Tensor] = field(default_factory=dict)
    explained: dict[str, torch.Tensor] = field(default_factory=dict)
    shown: dict[str, torch.Tensor] = field(default_factory=dict)
    identified: dict[str, torch.Tensor] = field(default_factory=dict)  # (k, n)
    p_shown: dict[str, torch.Tensor] = field(default_factory=dict)  # (k, n): P(i ∈ A) under the mask model


def recover(s: Setup, output: dict[str, torch.Tensor]) -> Recovered:
    rec = Recovered()
    for key, tau in s.tau.items():
        k = tau.shape[0]
        out = output[key].double().reshape(-1)
        delta = out - s.base[key]
        g = recover_g(s, delta, out, tau)
        cand, shown = candidates(s, tau, g)
        tol = _tolerance(s, out, tau, g)
        close = (cand - delta).abs() <= tol
        # resolved: candidates showing different sets are more than 2·tol apart (depends on τ and g only)
        resolved = torch.ones_like(delta, dtype=torch.bool)
        for a, b in product(range(2**k), repeat=2):
            resolved &= (shown[a] == shown[b]) | ((cand[a] - cand[b]).abs() > 2 * tol)
        first = close.long().argmax(0)
        obs = shown.gather(0, first[None]).squeeze(0)
        member = [[(bits >> i) & 1 for bits in range(2**k)] for i in range(k)]
        ident, p_shown = [], []
        prob = s.prob[key]
        p_set = torch.stack([
            torch.stack([prob[i] if member[i][bits] else 1 - prob[i] for i in range(k)]).prod(0)
            for bits in range(2**k)
        ])  # fmt: skip
        for i in range(k):
            ok = torch.ones_like(resolved)
            for a, b in product(range(2**k), repeat=2):
                if member[i][a] != member[i][b]:
                    ok &= shown[a] != shown[b]
            ident.append(ok)
            p_shown.append(sum(p_set[bits] * ((shown[bits] >> i) & 1) for bits in range(2**k)))
        rec.g[key], rec.resolved[key], rec.explained[key] = g, resolved, close.any(0)
        rec.shown[key], rec.identified[key], rec.p_shown[key] = obs, torch.stack(ident), torch.stack(p_shown)
    return rec


def _z(observed: float, expected: float, var: float) -> float:
    return abs(observed - expected) / math.sqrt(max(var, 1e-12))


def check(s: Setup, rec: Recovered, other: Recovered | None = None) -> list[str]:
    """The failures (empty: the output passes) of one tool's output, and against the other tool's when given:

    * `structure`: every resolved element is θ_0 + D_S for some kept set S (for consensus recipes: never a sum of
      entries of opposite signs, and the larger one when both are kept);
    * `resolved`: at least 60% of the elements are resolved;
    * `kept`: per model, on its identified resolved elements, the kept count is within Z binomial standard deviations
      of Σ p (p the keep probability: `density`, or DELLA's rank-dependent one), overall and per within-row |τ|
      quartile for DELLA; and within Z standard deviations of the other tool's kept fraction;
    * `election`: per model, on its unidentified resolved elements (the smaller of two opposite signs), the count of
      elements showing it is within Z standard deviations of Σ P(i ∈ A) = Σ p_i (1 − p_j);
    * `rescale`: per tensor and model, f_i = g_i / (λ w_i) (g_i / λ under `normalize`; w_i rounded to the recipe's
      dtype, as both tools weight) equals the L1 rule ‖τ_i‖₁ / ‖m_i τ_i‖₁: the kept L1 it implies, ‖τ_i‖₁ / f_i,
      lies between the kept |τ_i| of the identified elements and that plus the |τ_i| of the others (exact where
      every bit is identified), within 1e-4 (float32) or 8 · 2⁻⁸ (bfloat16: the rounded sums, ratio and products);
      and, summed over the tensors, the part it implies on the unidentified elements is within Z standard
      deviations of a Bernoulli mask's Σ p |τ_i| there;
    * `independence`: the two tools' identified mask bits agree on Σ p² + (1 − p)² elements (independent draws).
    """
    fails = []
    keys = list(s.tau)
    k = s.tau[keys[0]].shape[0]
    cat = lambda d: torch.cat([d[key].reshape(-1) for key in keys])  # noqa: E731
    catk = lambda d, i: torch.cat([d[key][i] for key in keys])  # noqa: E731
    resolved, explained, shown = cat(rec.resolved), cat(rec.explained), cat(rec.shown)
    if not bool(explained[resolved].all()):
        fails.append(f"structure: {int((~explained & resolved).sum())} resolved elements match no kept set")
    if float(resolved.double().mean()) < 0.6:
        fails.append(f"resolved: only {float(resolved.double().mean()):.2f} of the elements are resolved")
    ok = resolved & explained
    quarters = range(4) if s.method.startswith("della") else ()
    for i in range(k):
        prob, ident, kept = catk(s.prob, i), catk(rec.identified, i) & ok, ((shown >> i) & 1).bool()
        groups = [("all", ident)] + [(f"quartile {q}", ident & (catk(s.quartile, i) == q)) for q in quarters]
        for label, sel in groups:
            obs, p = float(kept[sel].sum()), prob[sel]
            z = _z(obs, float(p.sum()), float((p * (1 - p)).sum()))
            if z > Z:
                fails.append(f"kept: model {i} {label}: {obs:.0f} kept of {int(sel.sum())}, expected "
                             f"{float(p.sum()):.1f} ({z:.1f} sd)")  # fmt: skip
            if other is not None:
                o_sel = (catk(other.identified, i) & cat(other.resolved) & cat(other.explained))
                if label != "all":
                    o_sel &= catk(s.quartile, i) == int(label[-1])
                o_kept = ((cat(other.shown) >> i) & 1).bool()
                fa, fb = obs / max(int(sel.sum()), 1), float(o_kept[o_sel].double().mean())
                pm = float(p.mean())
                sd = math.sqrt(pm * (1 - pm) * (1 / max(int(sel.sum()), 1) + 1 / max(int(o_sel.sum()), 1)))
                if abs(fa - fb) > Z * sd:
                    fails.append(f"kept: model {i} {label}: fraction {fa:.3f} vs the other tool's {fb:.3f}")
        hidden = ~catk(rec.identified, i) & ok
        if int(hidden.sum()):
            ps = catk(rec.p_shown, i)[hidden]
            obs = float(kept[hidden].sum())
            z = _z(obs, float(ps.sum()), float((ps * (1 - ps)).sum()))
            if z > Z:
                fails.append(f"election: model {i} shown on {obs:.0f} of {int(hidden.sum())} elements where it "
                             f"is the smaller opposite sign, expected {float(ps.sum()):.1f} ({z:.1f} sd)")  # fmt: skip
    rel = 1e-4 if s.unit < 1e-6 else 8 * s.unit
    w16 = torch.tensor(s.weights).to(s.dtype).double().tolist()  # both tools weight in the recipe's dtype
    for i in range(k if s.rescale else 0):
        hidden_kept = hidden_expected = hidden_var = 0.0
        for key in keys:
            tau, g, prob = s.tau[key][i], rec.g[key], s.prob[key][i]
            known = rec.identified[key][i] & rec.resolved[key] & rec.explained[key]
            kept = ((rec.shown[key] >> i) & 1).bool()
            lo = float(tau[known & kept].abs().sum())
            hi = lo + float(tau[~known].abs().sum())
            f = float(g[i]) / (s.lam if s.normalize else s.lam * w16[i])
            implied = float(tau.abs().sum()) / f
            if not lo * (1 - rel) <= implied <= hi * (1 + rel):
                fails.append(f"rescale: {key} model {i}: f = {f:.5g} implies kept L1 {implied:.5g}, the mask's is "
                             f"in [{lo:.5g}, {hi:.5g}]")  # fmt: skip
            hidden_kept += implied - lo
            hidden_expected += float((prob * tau.abs())[~known].sum())
            hidden_var += float((prob * (1 - prob) * tau**2)[~known].sum())
        if hidden_var > 0 and _z(hidden_kept, hidden_expected, hidden_var) > Z:
            fails.append(f"rescale: model {i}: the L1 rule implies a kept L1 of {hidden_kept:.4g} on the "
                         f"unidentified entries, a Bernoulli mask {hidden_expected:.4g} "
                         f"({_z(hidden_kept, hidden_expected, hidden_var):.1f} sd)")  # fmt: skip
    if other is not None:
        for i in range(k):
            both = catk(rec.identified, i) & ok & catk(other.identified, i) & cat(other.resolved) & cat(
                other.explained)
            a, b = ((shown >> i) & 1)[both], ((cat(other.shown) >> i) & 1)[both]
            p = catk(s.prob, i)[both]
            q = p**2 + (1 - p) ** 2
            z = _z(float((a == b).sum()), float(q.sum()), float((q * (1 - q)).sum()))
            if z > Z:
                fails.append(f"independence: model {i}: masks agree on {int((a == b).sum())} of {int(both.sum())}, "
                             f"expected {float(q.sum()):.1f} ({z:.1f} sd)")  # fmt: skip
    return fails


def simulate(s: Setup, seed: int, *, density_scale=1.0, flat=False, rescale="l1", consensus="default",
             dtype=torch.float32):  # fmt: skip
    """An implementation of the recipe written from the description above (float64 arithmetic, output rounded to
    `dtype`), with one thing changeable to make it wrong: the keep probabilities scaled or `flat` (DELLA's
    replaced by their mean, as DARE's), the rescale (`"l1"`,
    `"inverse_density"` or `None`), or the consensus (`"sum"`, `"count"`: the sign of Σ sign(τ̃_i), or `None`): the
    control of the parity suite."""
    gen = torch.Generator().manual_seed(seed)
    consensus = ("sum" if s.consensus else None) if consensus == "default" else consensus
    e = torch.tensor(s.weights, dtype=torch.float64) if s.normalize else torch.ones(len(s.weights))
    w = torch.tensor(s.weights, dtype=torch.float64)
    out = {}
    for key, tau in s.tau.items():
        prob = s.prob[key].mean(1, keepdim=True).expand_as(tau) if flat else s.prob[key]
        mask = torch.rand(tau.shape, generator=gen, dtype=torch.float64) < prob * density_scale
        f = torch.ones(len(tau), dtype=torch.float64)
        if rescale == "l1":
            f = tau.abs().sum(1) / (tau * mask).abs().sum(1).clamp_min(1e-30)
        elif rescale == "inverse_density":
            f = 1 / (prob * density_scale).mean(1)
        terms = (e * s.lam * f * (1 if s.normalize else w.double()))[:, None] * tau * mask
        agree = mask
        if consensus is not None:
            votes = terms.sum(0) if consensus == "sum" else torch.sign(terms).sum(0)
            agree = mask & (torch.sign(tau) == torch.where(votes >= 0, 1.0, -1.0).double())
        num = (terms * agree).sum(0)
        if s.normalize:
            den = (w[:, None] * agree).sum(0)
            num = num / torch.where(den == 0, 1.0, den)
        out[key] = (s.base[key] + num).to(dtype)
    return out
