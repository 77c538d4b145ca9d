"""The experiments' code digest leaves out the CLI layer; that is only sound while nothing an experiment runs imports
it. These checks read the sources (an import inside a function counts too)."""

import ast
import json
import re
import sys
from pathlib import Path

import pytest


REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "experiments"))
import _harness  # noqa: E402


def _imported_modules(path: Path) -> set[str]:
    """Absolute names of every module ``path`` imports, relative imports resolved against its package."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


EXCLUDED = tuple(p.rstrip("/").replace("/", ".") for p in _harness.NOT_IN_DIGEST)


@pytest.mark.parametrize(
    "path",
    [*_harness.library_sources(), *sorted((REPO / "experiments").glob("*.py"))],
    ids=lambda p: p.relative_to(REPO).as_posix(),
)
def test_no_digested_code_imports_the_cli_layer(path):
    bad = {m for m in _imported_modules(path) if m.startswith(EXCLUDED)}
    assert not bad, f"{path.relative_to(REPO)} imports {sorted(bad)}, which the experiments' code digest leaves out"


def test_the_checker_sees_relative_imports():
    """A control that must fail: the demo's own module imports the CLI layer (relatively)."""
    assert any(m.startswith(EXCLUDED) for m in _imported_modules(REPO / "hf_stable" / "cli" / "demo.py"))


def test_digest_follows_library_code_not_the_cli(tmp_path, monkeypatch):
    script = tmp_path / "exp.py"
    script.write_text("x = 1\n")
    before = _harness._sources_digest(str(script))
    assert _harness._sources_digest(str(script)) == before
    script.write_text("x = 2\n")
    assert _harness._sources_digest(str(script)) != before
    sources = _harness.library_sources()
    names = [p.relative_to(REPO).as_posix() for p in sources]
    assert names and not any(n.startswith(("hf_stable/cli/", "hf_stable/scripts/")) for n in names)
    assert any(p.as_posix().endswith("hf_stable/losses/__init__.py") for p in sources)


def test_stale_results_follow_the_code(tmp_path, monkeypatch):
    scripts = tmp_path / "experiments"
    scripts.mkdir()
    script = scripts / "toy.py"
    script.write_text("x = 1\n")
    monkeypatch.setattr(_harness, "REPO", tmp_path)
    (tmp_path / "hf_stable").mkdir()
    (tmp_path / "hf_stable" / "core.py").write_text("y = 1\n")
    results = tmp_path / "results"
    results.mkdir()
    command = "OMP_NUM_THREADS=1 .venv/bin/python experiments/toy.py --quick"
    digest = _harness._sources_digest(str(script))
    (results / "toy.json").write_text(json.dumps({"command": command, "code_digest": digest}))
    (results / "old.json").write_text(json.dumps({"command": command}))
    assert _harness.stale_results(results) == {"old": "no digest", "toy": "fresh"}
    (tmp_path / "hf_stable" / "core.py").write_text("y = 2\n")  # a library change makes it stale
    assert _harness.stale_results(results)["toy"] == "stale"
    (tmp_path / "hf_stable" / "core.py").write_text("y = 1\n")
    (tmp_path / "hf_stable" / "cli").mkdir()
    (tmp_path / "hf_stable" / "cli" / "main.py").write_text("z = 1\n")  # the CLI layer does not
    assert _harness.stale_results(results)["toy"] == "fresh"


def test_digest_follows_the_experiment_scripts_a_script_imports(tmp_path, monkeypatch):
    """A script that imports another experiment script (its arms, its verdict rule) goes stale when that one changes;
    one that does not import it stays fresh."""
    monkeypatch.setattr(_harness, "ROOT", tmp_path)
    (tmp_path / "base_exp.py").write_text("ARMS = {'a': 1}\n")
    user = tmp_path / "user_exp.py"
    user.write_text("from base_exp import ARMS\n")
    loner = tmp_path / "loner_exp.py"
    loner.write_text("import json\n")
    assert _harness.sibling_sources(str(user)) == [tmp_path / "base_exp.py"]
    assert _harness.sibling_sources(str(loner)) == []
    before_user, before_loner = _harness._sources_digest(str(user)), _harness._sources_digest(str(loner))
    (tmp_path / "base_exp.py").write_text("ARMS = {'a': 2}\n")
    assert _harness._sources_digest(str(user)) != before_user
    assert _harness._sources_digest(str(loner)) == before_loner


def test_digest_follows_what_an_imported_script_imports(tmp_path, monkeypatch):
    """Transitively: a script importing `middle`, which imports `leaf` and the testbeds, depends on both and on the
    testbeds, although it imports neither itself."""
    monkeypatch.setattr(_harness, "ROOT", tmp_path)
    monkeypatch.setattr(_harness, "TESTBEDS", tmp_path / "testbeds")
    (tmp_path / "testbeds").mkdir()
    (tmp_path / "testbeds" / "bed.py").write_text("X = 1\n")
    (tmp_path / "leaf.py").write_text("Y = 1\n")
    (tmp_path / "middle.py").write_text("from leaf import Y\nfrom testbeds import bed\n")
    top = tmp_path / "top.py"
    top.write_text("from middle import Y\n")
    assert _harness.sibling_sources(str(top)) == [tmp_path / "leaf.py", tmp_path / "middle.py"]
    assert _harness.testbed_sources(str(top)) == [tmp_path / "testbeds" / "bed.py"]
    before = _harness._sources_digest(str(top))
    (tmp_path / "testbeds" / "bed.py").write_text("X = 2\n")
    assert _harness._sources_digest(str(top)) != before


def _toy_repo(tmp_path, monkeypatch, deps: dict | None):
    """A repository with two library files and one script; `deps`, when given, is its `library_deps.json`."""
    monkeypatch.setattr(_harness, "REPO", tmp_path)
    monkeypatch.setattr(_harness, "ROOT", tmp_path / "experiments")
    monkeypatch.setattr(_harness, "DEPS", tmp_path / "experiments" / "library_deps.json")
    (tmp_path / "hf_stable" / "merging").mkdir(parents=True)
    (tmp_path / "hf_stable" / "losses.py").write_text("a = 1\n")
    (tmp_path / "hf_stable" / "merging" / "engine.py").write_text("b = 1\n")
    (tmp_path / "experiments").mkdir()
    script = tmp_path / "experiments" / "toy.py"
    script.write_text("from hf_stable import losses\n")
    if deps is not None:
        _harness.DEPS.write_text(json.dumps(deps))
    return script


def test_digest_follows_the_library_files_a_script_loads(tmp_path, monkeypatch):
    """With a `library_deps.json` entry, a change to a library file the script loads makes its results stale, a
    change to one it does not load leaves them fresh, and a file joining its entry changes the digest too."""
    script = _toy_repo(tmp_path, monkeypatch, {"experiments/toy.py": ["hf_stable/losses.py"]})
    assert _harness.library_sources(str(script)) == [tmp_path / "hf_stable" / "losses.py"]
    before = _harness._sources_digest(str(script))
    (tmp_path / "hf_stable" / "merging" / "engine.py").write_text("b = 2\n")
    assert _harness._sources_digest(str(script)) == before
    (tmp_path / "hf_stable" / "losses.py").write_text("a = 2\n")
    changed = _harness._sources_digest(str(script))
    assert changed != before
    both = ["hf_stable/losses.py", "hf_stable/merging/engine.py"]
    _harness.DEPS.write_text(json.dumps({"experiments/toy.py": both}))
    assert _harness._sources_digest(str(script)) != changed


def test_a_script_without_an_entry_follows_every_library_file(tmp_path, monkeypatch):
    """The control: no entry (a new script, or no `library_deps.json`) means every library file counts."""
    script = _toy_repo(tmp_path, monkeypatch, {"experiments/other.py": []})
    assert len(_harness.library_sources(str(script))) == 2
    before = _harness._sources_digest(str(script))
    (tmp_path / "hf_stable" / "merging" / "engine.py").write_text("b = 2\n")
    assert _harness._sources_digest(str(script)) != before


def test_loaded_library_files_lists_what_this_process_imported():
    import hf_stable.merging.rng  # noqa: F401

    files = _harness.loaded_library_files()
    assert "hf_stable/merging/rng.py" in files and "hf_stable/__init__.py" in files
    assert not any(f.startswith(("hf_stable/cli/", "hf_stable/scripts/")) for f in files)


def test_every_committed_result_has_a_deps_entry():
    """Every result's script is in `library_deps.json`, and every listed file exists (`python experiments/_deps.py`
    rewrites it); the quick runs in test_experiment_scripts.py check that no run loads a file its entry lacks."""
    deps = json.loads(_harness.DEPS.read_text())
    scripts = set()
    for path in _harness.RESULTS.glob("*.json"):
        scripts.update(re.findall(r"experiments/\w+\.py", json.loads(path.read_text()).get("command", "")))
    assert scripts and scripts <= set(deps), sorted(scripts - set(deps))
    assert all((REPO / f).is_file() for files in deps.values() for f in files)


def test_digest_follows_only_the_testbeds_a_script_uses(tmp_path, monkeypatch):
    """A new testbed, or a change to one the script does not import, leaves its digest alone; the testbed it imports
    (here through a relative import inside the testbeds) and the package's `__init__` count."""
    monkeypatch.setattr(_harness, "ROOT", tmp_path)
    monkeypatch.setattr(_harness, "TESTBEDS", tmp_path / "testbeds")
    beds = tmp_path / "testbeds"
    beds.mkdir()
    (beds / "__init__.py").write_text("")
    (beds / "recipe.py").write_text("from .core import X\n")
    (beds / "core.py").write_text("X = 1\n")
    (beds / "other.py").write_text("Y = 1\n")
    script = tmp_path / "exp.py"
    script.write_text("def f():\n    from testbeds.recipe import X\n")
    assert _harness.testbed_sources(str(script)) == [beds / "__init__.py", beds / "core.py", beds / "recipe.py"]
    before = _harness._sources_digest(str(script))
    (beds / "other.py").write_text("Y = 2\n")
    (beds / "new.py").write_text("Z = 1\n")
    assert _harness._sources_digest(str(script)) == before
    (beds / "core.py").write_text("X = 2\n")
    assert _harness._sources_digest(str(script)) != before


def test_the_rl_run_cache_follows_what_the_rl_scripts_load(tmp_path, monkeypatch):
    """The RL testbed's run cache (`testbeds.rl.code_digest`) is keyed by the library files its scripts' entries list:
    a change to a file no RL script loads keeps the finished runs, one to a listed file drops them; the control
    (a script on the testbed without an entry) follows every file."""
    from testbeds import rl

    script = _toy_repo(tmp_path, monkeypatch, {"experiments/toy.py": ["hf_stable/losses.py"]})
    script.write_text("from testbeds import rl\n")
    (tmp_path / "experiments" / "merge_toy.py").write_text("from testbeds import skills\n")
    beds = tmp_path / "experiments" / "testbeds"
    beds.mkdir()
    (beds / "__init__.py").write_text("")
    (beds / "rl.py").write_text("R = 1\n")
    monkeypatch.setattr(rl, "HERE", beds)
    monkeypatch.setattr(rl, "EXPERIMENTS", tmp_path / "experiments")
    monkeypatch.syspath_prepend(str(tmp_path / "experiments"))
    assert rl.testbed_scripts() == [script]
    before = rl.code_digest()
    (tmp_path / "hf_stable" / "merging" / "engine.py").write_text("b = 2\n")
    assert rl.code_digest() == before
    (tmp_path / "hf_stable" / "losses.py").write_text("a = 2\n")
    assert rl.code_digest() != before
    _harness.DEPS.write_text(json.dumps({}))
    without_entry = rl.code_digest()
    (tmp_path / "hf_stable" / "merging" / "engine.py").write_text("b = 3\n")
    assert rl.code_digest() != without_entry
