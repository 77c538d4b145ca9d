"""The unlearning subpackage: each method declared once and reachable from a config, the trainer dispatching on the
declarations (no per-method table), public import paths, file sizes."""

import ast
import os

import pytest

import hf_stable
from hf_stable.losses.unlearning import FORGET_LOSSES, RETAIN_LOSSES
from hf_stable.registry import declared_field_names, get_registry
from hf_stable.trainers import unlearning as package
from hf_stable.trainers.unlearning.methods import UNLEARNING_METHODS, forget_loss_name, scheme


PACKAGE_DIR = os.path.dirname(package.__file__)


def test_public_import_paths():
    from hf_stable.trainers.unlearning import UnlearningConfig, UnlearningTrainer, precompute_dmm_targets
    from hf_stable.trainers.unlearning.targets import precompute_dmm_targets as defined

    assert hf_stable.UnlearningTrainer is UnlearningTrainer and hf_stable.UnlearningConfig is UnlearningConfig
    assert precompute_dmm_targets is defined and set(package.__all__) >= {
        "UnlearningTrainer",
        "precompute_dmm_targets",
    }
    assert get_registry("unlearning_method") is UNLEARNING_METHODS


def test_every_file_is_at_most_400_lines():
    for name in os.listdir(PACKAGE_DIR):
        if name.endswith(".py"):
            with open(os.path.join(PACKAGE_DIR, name), encoding="utf-8") as f:
                assert len(f.read().splitlines()) <= 400, name


def _config(tmp_path, **kwargs):
    from hf_stable import UnlearningConfig

    return UnlearningConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", **kwargs)


# what each method needs to construct, beyond its name
REQUIRED = {"pdu": {"pdu_eps": 1.0}}


def test_every_declared_name_is_reachable_from_a_config(tmp_path):
    """Each method, each forget loss (directly or through PDU's/StableUN's choice) and each retain loss."""
    reached_forget, reached_retain = set(), set()
    for method in UNLEARNING_METHODS:
        config = _config(tmp_path, unlearn_method=method.name, **REQUIRED.get(method.name, {}))
        assert config.method is method and scheme(config) == method.extra["scheme"]
        reached_forget.add(forget_loss_name(config))
        source = method.extra.get("forget_loss_from")
        for loss in [] if source is None else FORGET_LOSSES.names():
            try:
                config = _config(
                    tmp_path, unlearn_method=method.name, **{source: loss}, **REQUIRED.get(method.name, {})
                )
            except ValueError as error:
                assert source in str(error)  # a loss this method cannot run is refused by its field's name
                continue
            reached_forget.add(forget_loss_name(config))
    for retain in RETAIN_LOSSES.names():
        reached_retain.add(_config(tmp_path, retain_loss_type=retain).retain_loss_type)
    assert reached_forget == set(FORGET_LOSSES.names()) and reached_retain == set(RETAIN_LOSSES.names())
    assert _config(tmp_path, unlearn_method="sga", sga_rate="auto").scheme == "auto_rate"


def test_declared_fields_are_generated_once():
    from hf_stable import UnlearningConfig

    generated = declared_field_names(UnlearningConfig)
    for registry in (UNLEARNING_METHODS, FORGET_LOSSES):
        for declared in registry.fields():
            assert generated[declared.name] == registry.family


def test_the_trainer_provides_every_declared_input_and_term():
    """Every loss input (``needs``) and objective term (``terms``) a declaration names has a provider in the
    trainer, and the trainer's source holds no method or loss name outside the declarations' own keys."""
    source = open(os.path.join(PACKAGE_DIR, "trainer.py"), encoding="utf-8").read()
    tree = ast.parse(source)
    inputs = next(
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "self._inputs"
    )
    provided = {key.value for key in inputs.keys}
    needed = {need for loss in (*FORGET_LOSSES, *RETAIN_LOSSES) for need in loss.extra["needs"]}
    assert needed == provided
    for method in UNLEARNING_METHODS:
        for term in method.extra.get("terms", ()):
            assert f"def _{term}(" in source
    strings = {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)}
    names = set(UNLEARNING_METHODS.names()) | set(FORGET_LOSSES.names()) - {"none"}
    assert not names & strings, names & strings  # no `if name == "npo"` dispatch


@pytest.mark.parametrize("module", ["hf_stable.trainers.unlearning_config", "hf_stable.trainers._unlearn_data"])
def test_former_module_paths_are_gone(module):
    """The shims were removed once nothing imported them: one import path per name."""
    import importlib.util

    assert importlib.util.find_spec(module) is None
