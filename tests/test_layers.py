"""hf_stable's layers, read from the source with `ast`: every import points down the stack, and no modules import
each other in a cycle.

The layer map below is the one place it is written (docs/extending.md, "Layers", explains it). Bottom to top:

- **core**: the declaration API (`registry`, `_validation`), the paper records, model-card text, process helpers and
  the constants that `import hf_stable` needs without loading torch or PEFT. Imports nothing else of hf_stable.
- **math**: pure functions and the modules that hold them: losses, advantage estimators and loss modes; stability
  statistics; the merge methods and the streaming merge engine; rewards; the LoRA variants (PEFT layer code).
- **evaluation**: metrics and benchmarks that score a model; no trainer.
- **hooks**: the `transformers` callbacks, and the hook that teaches stock PEFT to load hf_stable adapters.
- **trainers**: the `Stable*Trainer`s and their configs, which put the layers below together.
- **testing**: tiny models, tasks and fixtures for tests, the demo and the experiments; the library never uses them.
- **entry points**: the lazy public API (`hf_stable/__init__.py`), the scripts and the `hf-stable` CLI (its demo uses
  `testing`), and the Hub push plan of the commands.

An import may point to its own layer or a lower one. Within a layer, modules still may not import each other in a
cycle. Imports inside functions are checked like the others: they are allowed, but only to defer an expensive load
(`import hf_stable` loads no torch, a command imports its trainer when it runs), never to point up the stack or to
break a cycle, so they obey the same two rules. Imports under `if TYPE_CHECKING:` count too.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "hf_stable"

# Bottom to top. An entry names a module and everything under it; the bare package name names only its __init__.
LAYERS = (
    (
        "core",
        (
            "hf_stable._adapter_variants",
            "hf_stable._files",
            "hf_stable._validation",
            "hf_stable._version",
            "hf_stable.cards",
            "hf_stable.distributed",
            "hf_stable.papers",
            "hf_stable.registry",
        ),
    ),
    (
        "math",
        ("hf_stable.adapters", "hf_stable.losses", "hf_stable.merging", "hf_stable.rewards", "hf_stable.stability"),
    ),
    ("evaluation", ("hf_stable.evaluation",)),
    ("hooks", ("hf_stable._peft_hook", "hf_stable._vllm_cpu", "hf_stable.callbacks")),
    ("trainers", ("hf_stable.trainers",)),
    ("testing", ("hf_stable.testing",)),
    (
        "entry points",
        ("hf_stable", "hf_stable.accelerate_configs", "hf_stable.cli", "hf_stable.hub_plan", "hf_stable.scripts"),
    ),
)

# Upward imports tolerated while a change that removes them is under way (none today). The test below fails when an
# entry here no longer exists, so one cannot be forgotten.
PENDING: set[tuple[str, str]] = set()


def module_names(root: Path, package: str) -> dict[str, Path]:
    """`dotted name -> file` of every module of the package under ``root`` (a package is named by its `__init__`)."""
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def imports(root: Path, package: str) -> dict[str, dict[str, int]]:
    """`module -> {imported module of the package: first line}`, from every import statement of each module (module
    level, inside functions and classes, under `if`/`try`), relative ones resolved. ``from x import y`` is an import
    of the module ``x.y`` when that is a module, else of ``x``."""
    modules = module_names(root, package)
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        edges = graph.setdefault(name, {})
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = here[: len(here) - node.level + 1]
                    base = ".".join([*parent, *([node.module] if node.module else [])])
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in modules and (target == package or target.startswith(package + ".")):
                    target = target.rpartition(".")[0]  # `import a.b.c` where c is a name, not a module
                if target in modules and target != name:
                    edges.setdefault(target, node.lineno)
    return graph


def layer_of(module: str, layers=LAYERS, package: str = PACKAGE) -> int | None:
    """Index of the layer that holds ``module`` (the longest entry that names it), or None."""
    best, best_len = None, -1
    for index, (_, entries) in enumerate(layers):
        for entry in entries:
            names = module == entry or (entry != package and module.startswith(entry + "."))
            if names and len(entry) > best_len:
                best, best_len = index, len(entry)
    return best


def upward(graph, layers=LAYERS, package: str = PACKAGE) -> list[tuple[str, str, int]]:
    """`(importer, imported, line)` of every import that points to a higher layer."""
    out = []
    for module, edges in sorted(graph.items()):
        for target, line in sorted(edges.items()):
            if layer_of(target, layers, package) > layer_of(module, layers, package):
                out.append((module, target, line))
    return out


def cycles(graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _describe(violations, layers=LAYERS, package: str = PACKAGE) -> str:
    def layer(module):
        return layers[layer_of(module, layers, package)][0]

    return "\n".join(f"{a} (layer {layer(a)}) imports {b} (layer {layer(b)}), line {n}" for a, b, n in violations)


def test_every_module_has_a_layer():
    unplaced = [name for name in module_names(ROOT, PACKAGE) if layer_of(name) is None]
    assert not unplaced, f"place these modules in LAYERS (tests/test_layers.py and docs/extending.md): {unplaced}"


def test_imports_point_down():
    found = upward(imports(ROOT, PACKAGE))
    unexpected = [v for v in found if (v[0], v[1]) not in PENDING]
    assert not unexpected, "upward imports:\n" + _describe(unexpected)
    stale = PENDING - {(a, b) for a, b, _ in found}
    assert not stale, f"these PENDING upward imports are gone: remove them from PENDING: {sorted(stale)}"


def test_no_import_cycles():
    assert cycles(imports(ROOT, PACKAGE)) == []


def test_the_library_does_not_use_the_test_fixtures():
    """`hf_stable.testing` sits above the library: only the entry points (the CLI's demo) import it."""
    graph = imports(ROOT, PACKAGE)
    names = [name for name, _ in LAYERS]
    assert names.index("testing") == len(LAYERS) - 2
    users = {m for m, edges in graph.items() if any(t.startswith("hf_stable.testing") for t in edges)}
    library = {m for m in users if layer_of(m) < names.index("testing")}
    edges = [(m, t, n) for m in sorted(library) for t, n in graph[m].items() if t.startswith("hf_stable.testing")]
    assert library == set(), "\n" + _describe(edges)


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def test_control_the_checker_reports_a_cycle_and_an_upward_import(tmp_path):
    """The checker on a small package with one cycle (relative imports, one of them inside a function) and one upward
    import (absolute, inside a function): it reports exactly those; after the fix, nothing."""
    layers = (("low", ("toy.low", "toy.a", "toy.b")), ("high", ("toy", "toy.high")))
    _write(
        tmp_path,
        {
            "toy/__init__.py": "from . import high\n",
            "toy/high.py": "HIGH = 1\n",
            "toy/low.py": "import os\n\n\ndef f():\n    import toy.high.g\n    return os\n",
            "toy/a.py": "from .b import y\n\nx = 1\n",
            "toy/b.py": "y = 2\n\n\ndef z():\n    from . import a\n    return a.x\n",
        },
    )
    graph = imports(tmp_path, "toy")
    assert graph["toy.low"] == {"toy.high": 5}  # `import toy.high.g`: `g` is not a module, so `toy.high`
    assert upward(graph, layers, "toy") == [("toy.low", "toy.high", 5)]
    assert cycles(graph) == [["toy.a", "toy.b"]]
    report = _describe(upward(graph, layers, "toy"), layers, "toy")
    assert report == "toy.low (layer low) imports toy.high (layer high), line 5"

    _write(tmp_path, {"toy/low.py": "import os\n", "toy/b.py": "y = 2\n"})
    graph = imports(tmp_path, "toy")
    assert upward(graph, layers, "toy") == [] and cycles(graph) == []
    assert layer_of("toy.other", layers, "toy") is None  # an unplaced module is reported, not put anywhere
