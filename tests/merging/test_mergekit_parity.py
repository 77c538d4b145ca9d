"""Parity with mergekit 0.1.5 on its own recipes: hf_stable's output against mergekit's, committed as fixtures.

The recipes (`mergekit_parity/recipes/`) are the settings of mergekit's `examples/` (the README's TIES recipe is
`examples/ties.yml`) and one recipe per method, run over the tiny checkpoints of
`mergekit_parity/mergekit_models.py`. The fixtures are mergekit's outputs (`mergekit_parity/regenerate.py` rebuilds
them in mergekit's own venv). Both tools compute in float32 (`mergekit_models.prepare_recipe`) and round once to the
recipe's dtype.

* bitwise equal wherever the arithmetic is the same operations in the same order (TIES and its family, SLERP,
  NuSLERP, model stock, task arithmetic, Karcher at mergekit's iteration defaults, passthrough, Arcee Fusion);
* within one ulp of the output dtype where it differs: `linear` (mergekit divides the weighted sum by Σw, hf_stable
  sums `w_i/Σw · x_i`) and `multislerp` (mergekit adds its tangent-space step, zero up to float32 rounding);
* DARE and DELLA draw random masks: mergekit from `torch.bernoulli`, hf_stable from its counter-based RNG, so the
  masks differ draw by draw. They are compared on what the two must share: the kept fraction (per magnitude
  quartile for DELLA, whose keep probability depends on the rank) within binomial bounds, and the rescale rule
  (the L1 norm of the task vector, recovered exactly from each tool's own mask).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from hf_stable.merging import MergeConfig, merge


PARITY = Path(__file__).resolve().parent / "mergekit_parity"
sys.path.insert(0, str(PARITY))

from mergekit_models import build, prepare_recipe  # noqa: E402


RECIPES = sorted(p.stem for p in (PARITY / "recipes").glob("*.yml"))
WITHIN_ONE_ULP = {"example-linear", "multislerp", "multislerp_base"}
RANDOM = {"dare_linear", "dare_ties", "della", "della_linear"}
BITWISE = [r for r in RECIPES if r not in WITHIN_ONE_ULP | RANDOM]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return build(tmp_path_factory.mktemp("mergekit-models"))


def _run(name: str, folders, out: Path, **overrides) -> dict[str, torch.Tensor]:
    recipe = prepare_recipe(yaml.safe_load((PARITY / "recipes" / f"{name}.yml").read_text()), folders)
    recipe.update(overrides)
    merge(MergeConfig.from_dict(recipe), out, progress=False)
    return load_file(out / "model.safetensors")


def _fixture(name: str) -> dict[str, torch.Tensor]:
    return load_file(PARITY / "fixtures" / f"{name}.safetensors")


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a − b| in units of the spacing of the output dtype at max(|a|, |b|)."""
    bits = {torch.float16: 11, torch.bfloat16: 8, torch.float32: 24}[a.dtype]
    _, exponent = torch.frexp(torch.maximum(a.float().abs(), b.float().abs()))
    return (a.float() - b.float()).abs() / torch.ldexp(torch.ones_like(a, dtype=torch.float32), exponent - bits)


def test_every_example_recipe_and_method_is_covered():
    examples = {"arcee_fusion", "bio-merge", "gradient-slerp", "linear", "orcamini-platy-44layer", "ties"}
    assert {f"example-{e}" for e in examples} <= set(RECIPES)
    methods = {yaml.safe_load((PARITY / "recipes" / f"{r}.yml").read_text())["merge_method"] for r in RECIPES}
    wanted = {"multislerp", "nuslerp", "model_stock", "della", "della_linear", "breadcrumbs", "breadcrumbs_ties"}
    assert wanted | {"passthrough", "karcher", "ties", "dare_linear", "dare_ties", "slerp", "linear"} <= methods
    assert set(RECIPES) == {p.stem for p in (PARITY / "fixtures").glob("*.safetensors")}


@pytest.mark.parametrize("name", BITWISE)
def test_bitwise_equal_to_mergekit(name, folders, tmp_path):
    ours, theirs = _run(name, folders, tmp_path / name), _fixture(name)
    assert set(ours) == set(theirs)
    for key, expected in theirs.items():
        assert ours[key].dtype == expected.dtype and torch.equal(ours[key], expected), key


@pytest.mark.parametrize("name", sorted(WITHIN_ONE_ULP))
def test_within_one_ulp_of_mergekit(name, folders, tmp_path):
    ours, theirs = _run(name, folders, tmp_path / name), _fixture(name)
    assert set(ours) == set(theirs)
    worst = max(float(_ulps(ours[k], theirs[k]).max()) for k in theirs)
    assert worst <= 1.0


def test_gradient_parameters_outside_the_layers_are_evaluated_at_t0(folders, tmp_path):
    """mergekit's README TIES recipe: `density: [1, 0.7, 0.1]` and `weight: [0, 0.3, 0.7, 1]` are evaluated at
    t = 0 for the final norm and lm_head (mergekit 0.1.5 `plan_module`), so those tensors equal mergekit's; at
    t = 1 (hf_stable before) they would not."""
    from hf_stable.merging.reference import merge_tensors

    ours, theirs = _run("example-ties", folders, tmp_path / "ties"), _fixture("example-ties")
    load = {m: load_file(Path(folders[m]) / "model.safetensors") for m in ("base40", "orca40", "platypus40")}
    load["wizardmath40"] = load_file(Path(folders["wizardmath40"]) / "model.safetensors")
    for name in ("model.norm.weight", "lm_head.weight", "model.embed_tokens.weight"):
        assert torch.equal(ours[name], theirs[name]), name
        # the same merge with the end-of-gradient (t = 1) values differs from mergekit's output
        experts = [load[m][name] for m in ("orca40", "platypus40", "wizardmath40")]
        at_t1 = merge_tensors(
            "ties", experts, base=load["base40"][name], weights=[1.0, 1.0, 0.0], params={"density": [0.1, 0.5, 0.33]}
        ).to(torch.float16)
        assert not torch.equal(at_t1, theirs[name]), name


def test_ties_rescale_equals_mergekit(folders, tmp_path):
    """TIES `rescale: true` (refused before): the L1-norm rescale of mergekit 0.1.5, bitwise."""
    ours, theirs = _run("ties_rescale", folders, tmp_path / "ties_rescale"), _fixture("ties_rescale")
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    plain = _run("ties_rescale", folders, tmp_path / "plain", parameters={"rescale": False})
    assert not all(torch.equal(plain[k], theirs[k]) for k in theirs)


def _kept_and_factor(out: dict, base: dict, model: dict):
    """Per tensor: the kept mask (out ≠ base) and the factor of the kept entries, Σ|out − base| / Σ|τ_kept|, and
    the L1 rule's factor Σ|τ| / Σ|τ_kept| on that mask."""
    rows = []
    for key, o in out.items():
        b, x = base[key].double(), model[key].double()
        tau = x - b
        delta = o.double() - b
        kept = delta != 0
        if int(kept.sum()) == 0:
            continue
        factor = float(delta[kept].abs().sum() / tau[kept].abs().sum())
        l1_rule = float(tau.abs().sum() / tau[kept].abs().sum())
        rows.append((key, kept, tau, factor, l1_rule))
    return rows


@pytest.mark.parametrize("name", ["dare_linear", "dare_ties", "della", "della_linear"])
def test_random_methods_match_mergekit_statistically(name, folders, tmp_path):
    """The masks differ draw by draw; the kept fraction (per |τ| quartile) and the L1 rescale rule agree."""
    ours = _run(name, folders, tmp_path / name)
    theirs = _fixture(name)
    base = load_file(Path(folders["base"]) / "model.safetensors")
    orca = load_file(Path(folders["orca"]) / "model.safetensors")
    density = 0.4 if name.startswith("dare") else 0.5
    for tool in (ours, theirs):
        rows = _kept_and_factor(tool, base, orca)
        kept = torch.cat([r[1].reshape(-1) for r in rows]).double()
        n = kept.numel()
        assert abs(float(kept.mean()) - density) < 4 * math.sqrt(density * (1 - density) / n)
        for key, _, _, factor, l1_rule in rows:  # float32 outputs: the factor is recovered to ~1e-6
            assert factor == pytest.approx(l1_rule, rel=1e-4), key
    # DELLA keeps large |τ| more often: the kept fraction per |τ| quartile, the same in both tools
    quartiles = []
    for tool in (ours, theirs):
        rows = _kept_and_factor(tool, base, orca)
        kept = torch.cat([r[1].reshape(-1) for r in rows]).double()
        rank = torch.cat([torch.argsort(torch.argsort(r[2].abs().reshape(-1))).double() / r[2].numel() for r in rows])
        quartiles.append([float(kept[(rank >= q / 4) & (rank < (q + 1) / 4)].mean()) for q in range(4)])
    n_q = sum(t.numel() for t in theirs.values()) / 4
    for a, b in zip(*quartiles, strict=True):
        assert abs(a - b) < 4 * math.sqrt(2 * 0.25 / n_q)
    if name.startswith("della"):
        assert quartiles[0][3] > quartiles[0][0] + 0.1 and quartiles[1][3] > quartiles[1][0] + 0.1
