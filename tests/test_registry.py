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
        fields=[
            Field("scaled_tau", 1.0, "τ in (0, 10].", check=number(low=0, high=10, low_open=True), param="tau"),
            shared,
        ],
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


# ---------------------------------------------------------------------------------------------------------------------
# The shipped SFT/GRPO families: every declaration is reachable, consistent with its callable, and dispatched to


def _shipped():
    from hf_stable import StableGRPOConfig, StableSFTConfig
    from hf_stable.losses.sft import SFT_OBJECTIVES, SFT_THRESHOLDS
    from hf_stable.trainers.grpo_config import GRPO_REGISTRIES
    from hf_stable.trainers.sft_config import SFT_REGISTRIES

    grpo = {"num_generations": 4, "per_device_train_batch_size": 4}
    cases = [(StableGRPOConfig, registry, grpo, {}) for registry in GRPO_REGISTRIES]
    cases += [(StableSFTConfig, registry, {}, {}) for registry in SFT_REGISTRIES]
    # `threshold_kind` selects within `sft_objective="threshold"`
    cases.append((StableSFTConfig, SFT_THRESHOLDS, {}, SFT_OBJECTIVES.activation("threshold")))
    return cases


def _build(config_cls, tmp_path, **values):
    return config_cls(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", **values)


def test_every_registered_name_is_reachable_from_a_config(tmp_path):
    """Each registered method of the SFT/GRPO families becomes the active one of a config built from its declaration
    (`Registry.activation`), and the config's `params_from` gives its callable every keyword it declares."""
    from hf_stable.losses.sft import SFT_OBJECTIVES, SFT_THRESHOLDS

    seen = 0
    for config_cls, registry, base, outer in _shipped():
        for method in registry:
            config = _build(config_cls, tmp_path, **{**base, **outer, **registry.activation(method.name)})
            if registry is SFT_THRESHOLDS:  # dispatched by the threshold objective's `kind`
                assert SFT_OBJECTIVES.get("threshold").params_from(config)["kind"] == method.name
            else:
                assert registry.active(config) is method, (registry.family, method.name)
            assert set(method.params_from(config)) == {f.param for f in method.fields if f.param} | set(method.reads)
            seen += 1
    assert seen >= 25


def test_declared_fields_match_the_callables():
    """Every declared keyword is a parameter of the method's callable, with the same default where the callable has
    one; every declared default passes its own check; every host option read or required exists on the config."""
    import dataclasses
    import inspect

    for config_cls, registry, _, _ in _shipped():
        options = {f.name for f in dataclasses.fields(config_cls)}
        for method in registry:
            for f in method.fields:
                if f.check is not None:
                    f.check(f.name, f.default)
            assert set(method.reads.values()) <= options and {r.option for r in method.requires} <= options
            if method.fn is None:
                continue
            fn = method.fn.__init__ if isinstance(method.fn, type) else method.fn
            params = inspect.signature(fn).parameters
            for keyword, default in [(f.param, f.default) for f in method.fields if f.param] + [
                (k, inspect.Parameter.empty) for k in method.reads
            ]:
                assert keyword in params, f"{registry.family} {method.name}: {keyword} is not a parameter"
                if params[keyword].default is not inspect.Parameter.empty and default is not inspect.Parameter.empty:
                    assert params[keyword].default == default, (registry.family, method.name, keyword)


TRAINER_MODULES = ("grpo.py", "sft.py", "_sft_probe.py", "_sft_data.py", "_base.py")
CONFIG_MODULES = ("grpo_config.py", "sft_config.py")


def test_no_trainer_holds_a_per_method_table():
    """Trainers dispatch through the registries: no literal table (dict/set/list/tuple) naming two or more registered
    methods anywhere in the SFT/GRPO trainer and config modules, and no comparison of a selector with a method name in
    the trainer modules (the config modules may state a composition rule by name)."""
    import ast
    from pathlib import Path

    import hf_stable.trainers as package

    names = {m.name for _, registry, _, _ in _shipped() for m in registry}
    selectors = {registry.selector for _, registry, _, _ in _shipped()}
    folder = Path(package.__file__).parent

    def named(node):  # a selector compared with a method name: a per-method branch
        if not any(isinstance(n, ast.Attribute) and n.attr in selectors for n in ast.walk(node)):
            return set()
        return {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and n.value in names}

    for module in TRAINER_MODULES + CONFIG_MODULES:
        tree = ast.parse((folder / module).read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Dict, ast.Set, ast.List, ast.Tuple)):
                elements = node.keys if isinstance(node, ast.Dict) else node.elts
                found = {e.value for e in elements if isinstance(e, ast.Constant) and e.value in names}
                assert len(found) < 2, f"{module}:{node.lineno} holds a method table {sorted(found)}"
            if module in TRAINER_MODULES and isinstance(node, ast.Compare):
                assert not named(node), f"{module}:{node.lineno} compares with {sorted(named(node))}"
