"""`docs/extending.md`'s worked example runs: its three code blocks (a paper record, a GRPO advantage estimator and
its declaration, a test) are executed as they are written, in a fresh process, as if added to their files, and the
toy estimator trains one step."""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]


def _blocks(section: str = "A GRPO advantage estimator") -> dict[str, str]:
    """The python blocks of one `## section` of the page, keyed by the file named on their first line (`# path`)."""
    text = (ROOT / "docs" / "extending.md").read_text()
    body = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    blocks = {}
    for code in re.findall(r"```python\n(.*?)```", body, flags=re.S):
        first, _, rest = code.partition("\n")
        if first.startswith("# ") and first[2:].strip().endswith(".py"):
            blocks[first[2:].strip()] = rest
    return blocks


def test_page_names_the_files_it_adds_to():
    blocks = _blocks()
    assert set(blocks) >= {"hf_stable/papers.py", "hf_stable/losses/advantages.py", "tests/losses/test_advantages.py"}
    for path in blocks:
        assert (ROOT / path).is_file(), path  # the files the example extends exist


@pytest.mark.slow
def test_toy_estimator_of_the_page_trains_one_step(tmp_path):
    blocks = _blocks()
    script = textwrap.dedent(
        """
        import sys
        from pathlib import Path

        import torch

        import hf_stable.papers as papers
        paper = eval(PAPER, vars(papers))  # the new entry of the PAPERS tuple
        papers.PAPERS[paper.key] = paper

        import hf_stable.losses.advantages as advantages
        exec(ESTIMATOR, vars(advantages))  # as written in the module, before any config class is built

        from hf_stable import StableGRPOConfig
        assert "centred_scale" in StableGRPOConfig.__dataclass_fields__
        try:
            StableGRPOConfig(output_dir=OUT, use_cpu=True, report_to="none", advantage_estimator="centred",
                             centred_scale=0.0)
        except ValueError as error:
            assert "centred_scale" in str(error)
        else:
            raise AssertionError("centred_scale=0 was accepted")

        namespace = {"torch": torch}
        exec(TEST, namespace)
        namespace["test_centred_estimator_trains_one_step"](Path(OUT))
        print("TRAINED")
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]), "OMP_NUM_THREADS": "1"}
    header = (
        f"PAPER = {blocks['hf_stable/papers.py'].strip()!r}\n"
        f"ESTIMATOR = {blocks['hf_stable/losses/advantages.py']!r}\n"
        f"TEST = {blocks['tests/losses/test_advantages.py']!r}\nOUT = {str(tmp_path)!r}\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", header + script], env=env, capture_output=True, text=True, timeout=600, cwd=ROOT
    )
    assert result.returncode == 0 and "TRAINED" in result.stdout, result.stderr[-3000:]


def test_page_names_the_unlearning_files_it_adds_to():
    blocks = _blocks("An unlearning loss")
    for path in (
        "hf_stable/losses/unlearning.py",
        "hf_stable/trainers/unlearning/methods.py",
        "tests/trainers/unlearning/test_unlearning_flags.py",
    ):
        assert path in blocks and (ROOT / path).is_file(), path


@pytest.mark.slow
def test_unlearning_loss_of_the_page_trains_one_step(tmp_path):
    """The unlearning example: the loss and its method are declared before `UnlearningConfig` is built, the
    config validates the new field by name, and the page's test (GA equivalence at floor 0) passes."""
    blocks = _blocks("An unlearning loss")
    script = textwrap.dedent(
        """
        from pathlib import Path

        import hf_stable.losses.unlearning as losses
        exec(LOSS, vars(losses))  # as written in the module, before the config class is built
        import hf_stable.trainers.unlearning.methods as methods
        exec(METHOD, vars(methods))

        from hf_stable import UnlearningConfig
        assert "ga_floor_prob" in UnlearningConfig.__dataclass_fields__
        try:
            UnlearningConfig(output_dir=OUT, use_cpu=True, report_to="none", unlearn_method="ga_floor",
                             ga_floor_prob=2.0)
        except ValueError as error:
            assert "ga_floor_prob" in str(error)
        else:
            raise AssertionError("ga_floor_prob=2 was accepted")

        namespace = {}
        exec(TEST, namespace)
        namespace["test_ga_floor_trains_one_step"](Path(OUT))
        print("TRAINED")
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]), "OMP_NUM_THREADS": "1"}
    header = (
        f"LOSS = {blocks['hf_stable/losses/unlearning.py']!r}\n"
        f"METHOD = {blocks['hf_stable/trainers/unlearning/methods.py']!r}\n"
        f"TEST = {blocks['tests/trainers/unlearning/test_unlearning_flags.py']!r}\nOUT = {str(tmp_path)!r}\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", header + script], env=env, capture_output=True, text=True, timeout=600, cwd=ROOT
    )
    assert result.returncode == 0 and "TRAINED" in result.stdout, result.stderr[-3000:]


def test_page_names_the_merge_files_it_adds_to():
    blocks = _blocks("A merge method")
    paths = ("hf_stable/papers.py", "hf_stable/merging/methods/task_arithmetic.py", "tests/merging/test_methods.py")
    for path in paths:
        assert path in blocks and (ROOT / path).is_file(), path


def test_merge_method_of_the_page_merges(tmp_path, monkeypatch):
    """The merge example: the paper and the method class are declared as written, a bad parameter is refused by
    name, and the page's test (hand-worked case, float64 reference, engine = in-memory reference) passes."""
    import hf_stable.merging.methods.task_arithmetic as module
    import hf_stable.papers as papers
    from hf_stable.merging.methods.base import MERGE_METHODS

    monkeypatch.syspath_prepend(str(ROOT / "tests" / "merging"))  # the page's test imports `merge_helpers`
    blocks = _blocks("A merge method")
    paper = eval(blocks["hf_stable/papers.py"].strip(), vars(papers))
    namespace = dict(vars(module))
    try:
        papers.PAPERS[paper.key] = paper
        exec(blocks["hf_stable/merging/methods/task_arithmetic.py"], namespace)
        from hf_stable.merging import MergeConfig

        with pytest.raises(ValueError, match="`k`"):
            MergeConfig.build("consensus_ta", ["a", "b"], base_model="c", parameters={"k": -1}).validate()
        test = {}
        exec(blocks["tests/merging/test_methods.py"], test)
        test["test_consensus_ta_keeps_the_entries_k_models_need"](tmp_path)
    finally:
        MERGE_METHODS._methods.pop("consensus_ta", None)
        papers.PAPERS.pop(paper.key, None)
