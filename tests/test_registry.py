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


def _toy_registry(family: str) -> Registry:
    from hf_stable._validation import choice, number
    from hf_stable.registry import Field, Requires

    registry = Registry(family, "toy methods", builtin=("off",))
    shared = Field("toy_index", None, "Shared by both.", type=int | None)
    registry.register(
        "scaled",
        paper="A paper",
        fields=[Field("scaled_tau", 1.0, "τ in (0, 10].", check=number(low=0, high=10, low_open=True), param="tau"),
                shared],
        reads={"scale": "host_scale"},
        requires=[Requires("host_beta", lambda v: v == 0, "set host_beta=0")],
    )(lambda x, tau, scale: x * tau)
    registry.register(
        "picked", paper="Another", fields=[Field("picked_kind", "a", "Kind.", check=choice("a", "b")), shared]
    )(lambda x: x)
    return registry


def test_declared_fields_become_dataclass_fields_with_validation():
    import dataclasses

    from hf_stable.registry import declare_fields, declared_field_names

    registry = _toy_registry("toy_declared")

    @dataclasses.dataclass
    @declare_fields(registry)
    class Config:
        """A toy config."""

        toy_declared: str = "off"
        host_scale: str = "group"
        host_beta: float = 0.0

        def __post_init__(self):
            registry.validate(self)

    config = Config(toy_declared="scaled", scaled_tau=2.0)
    method = registry.active(config)
    assert method.params_from(config) == {"tau": 2.0, "scale": "group"}
    assert method(3.0, **method.params_from(config)) == 6.0
    assert declared_field_names(Config) == {n: "toy_declared" for n in ("scaled_tau", "toy_index", "picked_kind")}
    assert "scaled_tau (`float`, *optional*, defaults to `1.0`)" in Config.__doc__
    assert "Read by `scaled`, `picked`." in Config.__doc__  # the shared field is listed once, with both readers
    assert registry.active(Config()) is None  # a host built-in
    with pytest.raises(ValueError, match=r"`scaled_tau` must be a finite number in \(0, 10\], got 0"):
        Config(scaled_tau=0)
    with pytest.raises(ValueError, match=r"`picked_kind`='c' is not valid"):
        Config(picked_kind="c")
    with pytest.raises(ValueError, match=r"`toy_declared`='nope' is not valid. Allowed values: 'off', 'scaled'"):
        Config(toy_declared="nope")
    with pytest.raises(ValueError, match=r"toy_declared='scaled' cannot be combined with: host_beta=0.1 \(set host"):
        Config(toy_declared="scaled", host_beta=0.1)
    Config(toy_declared="picked", host_beta=0.1)  # the requirement binds only while its method is active


def test_a_declared_field_cannot_be_written_twice():
    import dataclasses

    from hf_stable.registry import declare_fields

    registry = _toy_registry("toy_twice")
    with pytest.raises(TypeError, match="scaled_tau comes from toy_twice"):

        @dataclasses.dataclass
        @declare_fields(registry)
        class Config:
            scaled_tau: float = 1.0
