"""The method registry: lookup, errors that list valid names, and `list_methods`."""

import io

import pytest

from hf_stable import get_registry, list_methods
from hf_stable.registry import Registry


def test_unknown_name_lists_valid_names():
    registry = get_registry("sft_objective")
    with pytest.raises(ValueError) as error:
        registry.get("nlll")
    message = str(error.value)
    assert "Unknown sft_objective 'nlll'" in message
    for name in registry.names():
        assert name in message


def test_unknown_family_lists_families():
    with pytest.raises(ValueError, match="sft_objective"):
        get_registry("no_such_family")


def test_register_and_call():
    registry = Registry("test_family_register")
    registry.register("double", paper="A paper", url="https://example.org", factor=2)(lambda x, factor=2: x * factor)
    method = registry.get("double")
    assert method(3) == 6 and method.defaults == {"factor": 2} and "double" in registry and len(registry) == 1
    with pytest.raises(ValueError, match="already registered"):
        registry.register("double", paper="", url="")(lambda x: x)


def test_list_methods_prints_every_family():
    out = io.StringIO()
    listing = list_methods(file=out)
    text = out.getvalue()
    for family in ("sft_objective", "sft_threshold", "sft_sequence_objective", "sft_sample_reweighting"):
        assert f"{family}:" in text and listing[family]
    assert "prob_power" in text and "2510.00526" in text and "redi" in text and "feasible" in text


def test_list_methods_one_family():
    out = io.StringIO()
    assert list(list_methods("sft_threshold", file=out)) == ["sft_threshold"]
    assert "sft_objective:" not in out.getvalue()
