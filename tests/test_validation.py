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


def test_a_merge_parameter_is_a_registry_field_read_and_checked_like_a_config_field():
    """One parameter system: merge methods declare `registry.Field`s with `_validation` checks; a number written as a
    string (YAML's "1e-5") is read as one, per model too, and a string that is no number is refused by name."""
    from hf_stable.merging.methods import get_merge_method
    from hf_stable.merging.methods.base import MERGE_METHODS
    from hf_stable.registry import Field

    for name in MERGE_METHODS.names():
        assert all(isinstance(p, Field) for p in get_merge_method(name).params), name
    dare = get_merge_method("dare_ties")
    density = dare.param("density")
    assert density.per_model and density.check.parse is float
    assert dare.resolve({"density": ["0.5", " 1e-1 ", 0.25], "lambda": "2"}) == {
        **dare.param_defaults,
        "density": [0.5, 0.1, 0.25],
        "lambda": 2.0,
    }
    assert get_merge_method("karcher").resolve({"max_iter": "7"})["max_iter"] == 7
    with pytest.raises(ValueError, match=r"merge_method 'dare_ties': `lambda` must be a finite number"):
        dare.validate({"lambda": "two"}, 2, True)
    # the true/false check raises TypeError for a config field, a ValueError (a bad value) in a recipe
    with pytest.raises(ValueError, match=r"merge_method 'dare_ties': `rescale` must be true or false, got 'yes'"):
        dare.validate({"rescale": "yes"}, 2, True)
