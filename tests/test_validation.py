"""The one validation helper: every message names the field, the value and what is allowed."""

import math

import pytest

from hf_stable._validation import (
    check_bool,
    check_choice,
    check_int,
    check_length,
    check_number,
    check_pattern,
    choice,
    number,
)


@pytest.mark.parametrize(
    ("value", "kwargs", "ok"),
    [
        (0.0, {"low": 0}, True),
        (0.0, {"low": 0, "low_open": True}, False),
        (0.5, {"high": 0.5}, True),
        (0.5, {"high": 0.5, "high_open": True}, False),
        (math.nan, {}, False),
        (math.inf, {}, False),
        (True, {}, False),
        ("1", {}, False),
        (None, {}, False),
        (None, {"allow_none": True}, True),
        (3, {"low": 1, "high": 3}, True),
    ],
)
def test_check_number(value, kwargs, ok):
    if ok:
        check_number("x", value, **kwargs)
    else:
        with pytest.raises(ValueError, match=r"`x` must be a finite number in"):
            check_number("x", value, **kwargs)


def test_bounds_are_written_as_intervals():
    with pytest.raises(ValueError, match=r"in \[0, 0.5\), got 0.5"):
        number(low=0, high=0.5, high_open=True)("sgrpo_noise_p", 0.5)
    with pytest.raises(ValueError, match=r"merge_method 'ties': `density` must be a finite number in \(0, 1\]"):
        check_number("density", 0, low=0, high=1, low_open=True, where="merge_method 'ties'")


def test_check_int_refuses_floats_and_bools():
    check_int("n", 2, low=1)
    for bad in (2.0, True, 0):
        with pytest.raises(ValueError, match=r"`n` must be an integer in \[1, inf\)"):
            check_int("n", bad, low=1)


def test_check_choice_lists_allowed_values():
    check_choice("mode", "a", ["a", "b"])
    with pytest.raises(ValueError, match=r"`mode`='c' is not valid. Allowed values: 'a', 'b'."):
        choice("a", "b")("mode", "c")
    with pytest.raises(ValueError, match="not valid"):
        check_choice("mode", ["unhashable"], {"a"})


def test_check_bool_length_pattern():
    check_bool("flag", False)
    with pytest.raises(TypeError, match="`flag` must be true or false, got 1"):
        check_bool("flag", 1)
    check_length("w", [1, 2], 2)
    check_length("w", None, 2)
    with pytest.raises(ValueError, match=r"`w` must have 3 entries \(one per reward function\), got 2"):
        check_length("w", [1, 2], 3, of="reward function")
    check_pattern("re", r"\.weight$")
    with pytest.raises(ValueError, match="not a valid regular expression"):
        check_pattern("re", "(")
