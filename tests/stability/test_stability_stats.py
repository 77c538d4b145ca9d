import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_stable.stability.stats import GRAD_RULE, LOSS_RULE, LocalLevelFilter, RobustWindow, SpikeRule


finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False)


@given(st.lists(finite, min_size=1, max_size=200), st.integers(min_value=1, max_value=64))
@settings(max_examples=200, deadline=None)
def test_median_and_mad_match_numpy_on_the_last_w_values(values, size):
    window = RobustWindow(size=size, min_history=1)
    for v in values:
        window.push(v)
    kept = np.asarray(values[-size:], dtype=np.float64)
    assert len(window) == len(kept)
    assert window.median() == pytest.approx(np.median(kept), rel=1e-12, abs=1e-9)
    assert window.mad() == pytest.approx(np.median(np.abs(kept - np.median(kept))), rel=1e-12, abs=1e-9)


@given(st.lists(finite, min_size=0, max_size=50), finite)
@settings(max_examples=100, deadline=None)
def test_z_is_finite_for_finite_input_and_infinite_for_infinite_input(values, x):
    window = RobustWindow(size=64, min_history=1)
    for v in values:
        window.push(v)
    assert math.isfinite(window.z(x, floor=1e-6))
    assert window.z(math.inf, floor=1e-6) == (math.inf if values else 0.0)
    assert math.isnan(window.z(math.nan, floor=1e-6)) or not values


def test_equal_values_use_the_floor_instead_of_dividing_by_zero():
    window = RobustWindow(size=8, min_history=1)
    for _ in range(8):
        window.push(2.0)
    assert window.mad() == 0.0
    assert window.scale(floor=0.5) == 0.5
    assert window.z(3.0, floor=0.5) == pytest.approx(2.0)


def test_non_finite_values_never_enter_the_window():
    window = RobustWindow(size=8, min_history=1)
    for bad in (math.nan, math.inf, -math.inf):
        with pytest.raises(ValueError, match="finite"):
            window.push(bad)
    assert len(window) == 0


def _noisy_window(rule, level, noise, n=128, seed=0):
    rng = np.random.default_rng(seed)
    window = RobustWindow(size=n, min_history=20)
    for v in level * np.exp(noise * rng.standard_normal(n)) if rule.log else level + noise * rng.standard_normal(n):
        window.push(rule.transform(float(v)))
    return window


def test_loss_rule_flags_a_10x_outlier_not_a_1_1x_value():
    window = _noisy_window(LOSS_RULE, level=2.0, noise=0.05)
    assert LOSS_RULE.test(window, 20.0)[0]
    assert not LOSS_RULE.test(window, 2.2)[0]


def test_grad_rule_flags_a_10x_outlier_not_a_1_1x_value():
    window = _noisy_window(GRAD_RULE, level=0.8, noise=0.1)
    assert GRAD_RULE.test(window, 8.0)[0]
    assert not GRAD_RULE.test(window, 0.88)[0]


def test_ratio_condition_kills_a_false_alarm_on_a_flat_curve():
    # z is huge (tiny MAD), but the value is only 10% above the level: the ratio test (1.25) refuses it
    window = RobustWindow(size=64, min_history=20)
    for i in range(64):
        window.push(1.0 + 1e-5 * (i % 3))
    spike, z = LOSS_RULE.test(window, 1.1)
    assert z > 6 and not spike


def test_ratio_condition_on_a_negative_median_uses_its_magnitude():
    rule = SpikeRule(z_threshold=3.0, ratio=1.25, floor_abs=1e-6)
    window = RobustWindow(size=64, min_history=5)
    for i in range(64):
        window.push(-4.0 + 0.01 * (i % 5 - 2))
    assert not rule.test(window, -3.5)[0]  # 0.5 above a level of -4: less than 25% of |m|
    assert rule.test(window, -2.5)[0]  # 1.5 above: more than 25% of |m| and z large


def test_no_detection_before_min_history():
    window = RobustWindow(size=64, min_history=20)
    for _ in range(19):
        window.push(1.0)
    assert not LOSS_RULE.test(window, 100.0)[0]
    window.push(1.0)
    assert LOSS_RULE.test(window, 100.0)[0]


def test_window_state_round_trips_through_json():
    window = _noisy_window(LOSS_RULE, level=3.0, noise=0.2)
    restored = RobustWindow(size=128, min_history=20)
    restored.load_state(json.loads(json.dumps(window.state())))
    assert restored.values() == window.values()
    assert restored.median() == window.median() and restored.mad() == window.mad()


def test_local_level_filter_matches_a_hand_kalman_step_and_rejects_a_jump():
    filt = LocalLevelFilter(threshold=10.83, n_init=3)
    for y in (1.0, 1.2, 0.9):
        assert filt.update(y) == (False, 0.0)
    assert filt.level == pytest.approx((1.0 + 1.2 + 0.9) / 3)
    # r from the first differences (0.2, -0.3): median -0.05, MAD 0.25
    r = (1.4826 * 0.25) ** 2 / 2
    assert filt.variance == pytest.approx(r)
    q = 0.01 * r
    prior = r + q
    y = 1.05
    innovation = y - filt.level
    s = prior + r
    level = filt.level + prior / s * innovation
    bad, nis = filt.update(y)
    assert not bad and nis == pytest.approx(innovation**2 / s)
    assert filt.level == pytest.approx(level)
    assert filt.update(50.0)[0]  # a destabilising jump is rejected: the level stays
    assert filt.level == pytest.approx(level)
    assert not filt.update(-50.0)[0]  # a drop is not destabilising (one-sided)
    state = json.loads(json.dumps(filt.state()))
    other = LocalLevelFilter()
    other.load_state(state)
    assert other.level == filt.level and list(other.accepted) == list(filt.accepted)
