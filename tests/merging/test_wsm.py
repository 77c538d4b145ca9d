"""WSM schedule math (spec merging.md §4.1–4.2): the worked k = 8 table, the c ↔ w inverse, the delta identity."""

import itertools
import math

import pytest
import torch

from hf_stable.merging.wsm import c_to_w, decay_curve, merge_snapshots, merge_window, w_to_c, wsm_weights


# docs/merging.md, WSM weights for k = 8, rows c_0..c_8 (3 decimals)
TABLE = {
    ("linear", "left"): [0, 0.125, 0.125, 0.125, 0.125, 0.125, 0.125, 0.125, 0.125],
    ("linear", "mid"): [0.062, 0.125, 0.125, 0.125, 0.125, 0.125, 0.125, 0.125, 0.062],
    ("cosine", "mid"): [0.010, 0.075, 0.138, 0.180, 0.195, 0.180, 0.138, 0.075, 0.010],
    ("1-sqrt", "left"): [0, 0.354, 0.146, 0.112, 0.095, 0.083, 0.075, 0.069, 0.065],
    ("1-sqrt", "mid"): [0.250, 0.183, 0.126, 0.102, 0.089, 0.079, 0.072, 0.067, 0.032],
    ("inv_sqrt(8)", "mid"): [0.184, 0.184, 0.098, 0.063, 0.045, 0.034, 0.027, 0.022, 0.343],
    ("wsd(0.5, 1-sqrt)", "mid"): [0, 0, 0, 0, 0.354, 0.259, 0.178, 0.145, 0.065],
    ("ema(0.7)", "mid"): [0.058, 0.025, 0.035, 0.050, 0.072, 0.103, 0.147, 0.210, 0.300],
}


@pytest.mark.parametrize(("schedule", "quadrature"), sorted(TABLE))
def test_worked_table_k8(schedule, quadrature):
    w, c = wsm_weights(schedule, 8, quadrature=quadrature)
    assert len(w) == 8 and len(c) == 9
    for j, (got, want) in enumerate(zip(c, TABLE[schedule, quadrature], strict=True)):
        # half a unit in the 3rd decimal (.0625 is printed .062)
        assert abs(got - want) <= 5e-4 + 1e-12, f"{schedule}/{quadrature} c_{j}: {got:.5f} vs table {want}"
    assert math.isclose(sum(c), 1.0, abs_tol=1e-12)
    assert min(c) >= 0


def test_independent_closed_forms():
    # linear/left: w_i = 1 − (i−1)/k, so c = (0, 1/k, ..., 1/k): "mean over θ^(1..k) = linear decay"
    w, c = wsm_weights("linear", 5, quadrature="left")
    assert w == pytest.approx([1, 0.8, 0.6, 0.4, 0.2]) and c == pytest.approx([0, 0.2, 0.2, 0.2, 0.2, 0.2])
    # uniform: w_i = (k−i+1)/(k+1), c_j = 1/(k+1)
    w, c = wsm_weights("uniform", 4)
    assert w == pytest.approx([4 / 5, 3 / 5, 2 / 5, 1 / 5]) and c == pytest.approx([0.2] * 5)
    # ema: implied w_i = 1 − a^{k−i+1}
    w, _ = wsm_weights("ema:0.5", 3)
    assert w == pytest.approx([1 - 0.5**3, 1 - 0.5**2, 1 - 0.5])
    # interval_mean of linear is the midpoint value exactly
    assert wsm_weights("linear", 6, "interval_mean")[0] == pytest.approx(wsm_weights("linear", 6, "mid")[0])
    # interval mean of 1-sqrt over [0, 1/k]: k ∫ (1 − √τ) = 1 − (2/3) √(1/k)
    assert wsm_weights("1-sqrt", 4, "interval_mean")[0][0] == pytest.approx(1 - 2 / 3 * 0.5, abs=2e-3)


def test_floor_lifts_curve():
    w0, _ = wsm_weights("cosine", 4)
    w, c = wsm_weights("cosine", 4, floor=0.2)
    assert w == pytest.approx([0.2 + 0.8 * x for x in w0])
    assert c[-1] == pytest.approx(w[-1]) and sum(c) == pytest.approx(1)


@pytest.mark.parametrize(
    "schedule",
    ["linear", "cosine", "1-sqrt", "inverse-sqrt", "inv_sqrt:2", "exp:3", "wsd:0.25", "wsd:0.5:cosine", "ema:0.9"],
)
@pytest.mark.parametrize("k", [1, 3, 8])
def test_round_trip_and_properties(schedule, k):
    for quadrature in ("left", "mid", "interval_mean"):
        w, c = wsm_weights(schedule, k, quadrature=quadrature)
        assert all(a >= b - 1e-15 for a, b in itertools.pairwise(w)) and 0 <= w[-1] and w[0] <= 1
        assert min(c) >= 0 and sum(c) == pytest.approx(1, abs=1e-12)
        assert c_to_w(c) == pytest.approx(w, abs=1e-12)
        assert w_to_c(c_to_w(c)) == pytest.approx(c, abs=1e-12)


def test_callable_schedule_and_checks():
    w, _ = wsm_weights(lambda t: 1 - t * t, 4)
    assert w == pytest.approx([1 - ((i - 0.5) / 4) ** 2 for i in range(1, 5)])
    with pytest.raises(ValueError, match="non-increasing"):
        wsm_weights(lambda t: t, 4)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        decay_curve(lambda t: 2 - t)
    with pytest.raises(ValueError, match="Unknown WSM `schedule`"):
        wsm_weights("cosin", 4)
    with pytest.raises(ValueError, match="quadrature"):
        wsm_weights("linear", 4, quadrature="right")
    with pytest.raises(ValueError, match="`k`"):
        wsm_weights("linear", 0)
    with pytest.raises(ValueError, match="floor"):
        wsm_weights("linear", 4, floor=1.0)
    with pytest.raises(ValueError, match="EMA decay"):
        wsm_weights("ema:1.5", 4)
    with pytest.raises(ValueError, match=r"non-increasing|w_1"):
        w_to_c([0.5, 0.7])
    with pytest.raises(ValueError, match="weights"):
        decay_curve("uniform")


def test_curves_match_formulas():
    t = 0.3
    assert decay_curve("cosine")(t) == pytest.approx(0.5 * (1 + math.cos(math.pi * t)))
    assert decay_curve("1-sqrt")(t) == pytest.approx(1 - math.sqrt(t))
    assert decay_curve("inverse-sqrt")(t) == pytest.approx(1 / math.sqrt(1 + 8 * t))
    assert decay_curve("inv_sqrt(3)")(t) == pytest.approx(1 / math.sqrt(1 + 3 * t))
    assert decay_curve("exp:2")(t) == pytest.approx(math.exp(-0.6))
    f = decay_curve("wsd(0.4, linear)")
    assert f(0.5) == 1 and f(0.8) == pytest.approx(1 - (0.8 - 0.6) / 0.4)
    assert decay_curve("wsd:0.4:inv_sqrt:8")(1.0) == pytest.approx(1 / 3)


@pytest.mark.parametrize("schedule", ["1-sqrt", "cosine", "ema:0.7", "uniform", "wsd:0.5:1-sqrt"])
def test_delta_identity(schedule):
    """B + Σ w_i Δ_i == Σ c_j θ^(j) for a random trajectory (fp32 deltas, compared with an fp64 direct average)."""
    k = 6
    g = torch.Generator().manual_seed(0)
    snaps = [{"a": torch.randn(7, 5, generator=g), "b": torch.randn(3, generator=g)}]
    for _ in range(k):
        snaps.append({n: t + 0.1 * torch.randn(t.shape, generator=g) for n, t in snaps[-1].items()})
    deltas = [{n: snaps[i][n] - snaps[i - 1][n] for n in snaps[0]} for i in range(1, k + 1)]
    w, c = wsm_weights(schedule, k)
    merged = merge_window(snaps[0], deltas, w)
    direct = merge_snapshots(snaps, c)
    for name in snaps[0]:
        assert merged[name].dtype == torch.float32
        torch.testing.assert_close(merged[name].double(), direct[name], atol=1e-6, rtol=0)
