"""`docs/extending.md` followed literally: its worked examples (a GRPO advantage estimator, a merge method, an
unlearning loss) are added to a copy of the repository by the page's own rules ("Following this page"), and then, in a
fresh interpreter, the tests the blocks touch pass and `ruff check` is clean on every file they add to.

A block already in its file is not added again, so this stays green once the examples are added for real; nothing is
registered in this process, so the repository's own registries never see the examples twice.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ("A GRPO advantage estimator", "A merge method", "An unlearning loss")
# The tests the blocks add or whose tables they extend (the slow flag-effect cases of the new fields are left to CI's
# matrices; here the coverage checks prove the tables were extended)
TOUCHED = (
    "tests/losses/test_advantages.py::test_centred_estimator_trains_one_step",
    "tests/trainers/test_grpo_flags.py::test_every_grpo_field_is_covered",
    "tests/merging/test_methods.py::test_consensus_ta_keeps_the_entries_k_models_need",
    "tests/merging/test_param_effects.py::test_every_parameter_is_covered",
    "tests/merging/test_param_effects.py::test_changing_a_parameter_changes_the_merge_or_is_refused[consensus_ta.k]",
    "tests/merging/test_param_effects.py::test_changing_a_parameter_changes_the_merge_or_is_refused"
    "[consensus_ta.mask_lambda]",
    "tests/losses/test_unlearning.py::test_registries_names_papers_and_declared_fields",
    "tests/trainers/unlearning/test_unlearning_flags.py::test_every_field_is_covered",
    "tests/trainers/unlearning/test_unlearning_flags.py::test_ga_floor_trains_one_step",
)
_IMPORT = re.compile(r"from (\S+) import (.+)")


def blocks(section: str, page: Path = ROOT / "docs" / "extending.md") -> list[tuple[str, str]]:
    """`(file, code)` of the python blocks of one `## section` of the page, in order; the file is the block's first
    line (`# path`)."""
    body = page.read_text().split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    out = []
    for code in re.findall(r"```python\n(.*?)```", body, flags=re.S):
        first, _, rest = code.partition("\n")
        if first.startswith("# ") and first[2:].strip().endswith(".py"):
            out.append((first[2:].strip(), rest))
    return out


def _flat(text: str) -> str:
    return " ".join(text.split())


def _import_order(name: str) -> tuple:
    """ruff's isort order within one `from` import: constants, classes, then the rest."""
    kind = 0 if name.isupper() and len(name) > 1 else 1 if name[0].isupper() else 2
    return kind, name


def _merge_import(text: str, module: str, names: list[str]) -> str:
    """``text`` with ``names`` added to its one-line `from module import ...` (or added after its imports)."""
    pattern = re.compile(rf"^from {re.escape(module)} import ([^(\n]+)$", flags=re.M)
    found = pattern.search(text)
    if found is None:
        raise AssertionError(f"the page adds names to `from {module} import ...`, which the file does not have")
    have = [n.strip() for n in found.group(1).split(",")]
    merged = sorted(set(have) | set(names), key=_import_order)
    return text[: found.start()] + f"from {module} import {', '.join(merged)}" + text[found.end() :]


def apply_block(root: Path, path: str, code: str) -> bool:
    """Adds one block to ``root / path`` by the page's rules; False when it is already there."""
    lines = code.strip("\n").splitlines()
    imports = []
    while lines and _IMPORT.fullmatch(lines[0]):
        module, names = _IMPORT.fullmatch(lines.pop(0)).groups()
        imports.append((module, [n.strip() for n in names.split(",")]))
    while lines and not lines[0].strip():
        lines.pop(0)
    body = "\n".join(lines)
    file = root / path
    text = file.read_text()
    if _flat(body) in _flat(text):
        return False
    for module, names in imports:
        text = _merge_import(text, module, names)
    if path == "hf_stable/papers.py":  # a record at the end of the `PAPERS` tuple
        end = text.rindex("\n    )\n}")
        text = text[:end] + "\n" + textwrap.indent(body, " " * 8) + "," + text[end:]
    else:
        text = text.rstrip("\n") + "\n\n\n" + body + "\n"
    file.write_text(text)
    return True


def _copy(dst: Path) -> Path:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
    for name in ("hf_stable", "tests"):
        shutil.copytree(ROOT / name, dst / name, ignore=ignore)
    shutil.copy2(ROOT / "pyproject.toml", dst / "pyproject.toml")
    return dst


def _follow_the_page(root: Path) -> list[str]:
    changed = []
    for section in SECTIONS:
        for path, code in blocks(section):
            if apply_block(root, path, code) and path not in changed:
                changed.append(path)
    return changed


def _named() -> list[str]:
    """Every file the page adds to."""
    return sorted({path for section in SECTIONS for path, _ in blocks(section)})


def _env(root: Path) -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(root / "tests")]), "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def followed(tmp_path_factory):
    """A copy of the repository with the page's blocks added, and the files they changed (none once the examples
    are in the repository)."""
    root = _copy(tmp_path_factory.mktemp("repo"))
    return root, _follow_the_page(root)


def test_page_names_the_files_it_adds_to():
    for section in SECTIONS:
        paths = [path for path, _ in blocks(section)]
        assert "hf_stable/papers.py" in paths or section == "An unlearning loss", section
        assert any(p.startswith("tests/") for p in paths) and any(p.startswith("hf_stable/") for p in paths), section
        for path in paths:
            assert (ROOT / path).is_file(), path  # the files the examples extend exist


def test_following_the_page_twice_changes_nothing(tmp_path):
    """Once the examples are in the files (added for real, or by a first pass), the page adds nothing again."""
    root = _copy(tmp_path)
    _follow_the_page(root)
    snapshot = {path: (root / path).read_text() for path in _named()}
    assert _follow_the_page(root) == []
    assert {path: (root / path).read_text() for path in _named()} == snapshot


@pytest.mark.slow
def test_the_page_followed_literally_passes_ruff(followed):
    root, _ = followed
    ruff = shutil.which("ruff")
    command = [ruff] if ruff else [sys.executable, "-m", "ruff"]
    result = subprocess.run([*command, "check", *_named()], cwd=root, capture_output=True, text=True, timeout=120)
    if result.returncode and "No module named ruff" in result.stderr:
        pytest.skip("ruff is not installed (pip install -e '.[dev]')")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]


@pytest.mark.slow
def test_the_page_followed_literally_passes_its_tests(followed):
    """The touched tests pass in a fresh interpreter on the copy, and the page's claims hold: the new fields exist and
    a bad value is refused naming them."""
    root, _ = followed
    claims = textwrap.dedent(
        """
        import pytest
        from hf_stable import StableGRPOConfig, UnlearningConfig
        from hf_stable.merging import MergeConfig

        for config, field, bad in (
            (StableGRPOConfig, "centred_scale", {"advantage_estimator": "centred", "centred_scale": 0.0}),
            (UnlearningConfig, "ga_floor_prob", {"unlearn_method": "ga_floor", "ga_floor_prob": 2.0}),
        ):
            assert field in config.__dataclass_fields__
            with pytest.raises(ValueError, match=field):
                config(output_dir="out", use_cpu=True, report_to="none", **bad)
        with pytest.raises(ValueError, match="`k`"):
            MergeConfig.build("consensus_ta", ["a", "b"], base_model="c", parameters={"k": -1}).validate()
        print("CLAIMS HOLD")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", claims], cwd=root, env=_env(root), capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and "CLAIMS HOLD" in result.stdout, result.stderr[-3000:]
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TOUCHED]
    result = subprocess.run(command, cwd=root, env=_env(root), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert f"{len(TOUCHED)} passed" in result.stdout, result.stdout[-2000:]
