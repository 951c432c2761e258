"""The graph of minidist's imports of its own modules has no cycle.

Every file under ``minidist/`` is read with ``ast`` (nothing is imported, so no MPI).  An
edge ``a -> b`` is an ``import``/``from ... import`` in module ``a`` of module ``b``, relative
imports resolved to full names; ``from pkg import name`` is an edge to ``pkg.name`` when that
is a submodule, else to ``pkg`` (a package ``__init__`` re-exporting its submodules has an
edge to each).  Parent packages that Python runs before a submodule are not edges: every
import would otherwise point back at ``minidist/__init__.py``.

Two graphs are checked: the imports at module level (run when the module is imported), and
all imports including those inside functions.  Both must be free of cycles, so a module
never reaches back up to a module that imports it, not even late inside a function.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "minidist"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _target(name: str, modules) -> str | None:
    """The module an import of ``name`` runs: itself, or the nearest package it lives in."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path, modules):
    """Yield (imported module, inside a function) for every minidist import in ``path``."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                for alias in child.names:
                    yield alias.name, inner
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")
                    base = base[:len(base) - (child.level - 1)]
                    source = ".".join(base + ([child.module] if child.module else []))
                else:
                    source = child.module
                for alias in child.names:
                    sub = f"{source}.{alias.name}"
                    yield (sub if sub in modules else source), inner
            yield from visit(child, inner)

    for name, in_function in visit(ast.parse(path.read_text(), str(path)), False):
        if name == "minidist" or name.startswith("minidist."):
            target = _target(name, modules)
            if target and target != module:
                yield target, in_function


@functools.cache
def _all_imports() -> dict[str, tuple]:
    modules = _modules()
    return {module: tuple(_imports(module, path, modules)) for module, path in modules.items()}


def _graph(include_functions: bool) -> dict[str, set[str]]:
    return {module: {target for target, in_function in imports if include_functions or not in_function}
            for module, imports in _all_imports().items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One shortest cycle through each strongly connected component that has one."""
    index, low, on_stack, stack, components = {}, {}, set(), [], []

    def connect(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    cycles = []
    for component in components:
        start = min(component)
        paths, queue = {start: [start]}, [start]
        while queue:
            v = queue.pop(0)
            for w in sorted(graph[v] & component):
                if w == start:
                    cycles.append(paths[v] + [start])
                    queue = []
                    break
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    queue.append(w)
    return sorted(cycles)


def _message(cycles) -> str:
    return "import cycles:\n" + "\n".join("  " + " -> ".join(c) for c in cycles)


def test_graph_is_read():
    graph = _graph(include_functions=True)
    assert "minidist.layout.simulate" in graph
    assert "minidist.layout.schedules" in graph["minidist.layout.simulate"]
    assert "minidist.plan.cost" in graph["minidist.plan"]  # a package re-export is an edge


def test_no_cycle_among_module_level_imports():
    cycles = _cycles(_graph(include_functions=False))
    assert not cycles, _message(cycles)


def test_no_cycle_with_imports_inside_functions():
    cycles = _cycles(_graph(include_functions=True))
    assert not cycles, _message(cycles)


def test_cycle_is_named():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _message(_cycles(graph)) == "import cycles:\n  a -> b -> c -> a"


def test_settings_import_no_minidist_module():
    """Every layer reads the model's and the mesh's settings, so they import no minidist module,
    and the run's configuration imports only them."""
    graph = _graph(include_functions=True)
    assert graph["minidist.layout.settings"] == graph["minidist.layout.model"] == set()
    assert graph["minidist.train.config"] == {"minidist.layout.model", "minidist.layout.settings"}


ARCHITECTURE = ROOT.parent / "docs" / "architecture.md"


def _layers() -> list[tuple[str, list[str]]]:
    """docs/architecture.md's table of layers, lowest first: (layer, [module or package, ...])."""
    text = ARCHITECTURE.read_text()
    table = text.split("<!-- layers: begin -->")[1].split("<!-- layers: end -->")[0]
    rows = [line.strip("| ").split(" | ") for line in table.strip().splitlines()[2:]]
    return [(layer, [f"minidist.{m.strip()}" for m in modules.split(",")]) for layer, modules in rows]


def _layer_of(module: str, layers) -> int | None:
    for i, (_, prefixes) in enumerate(layers):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    return None


def test_every_import_respects_the_layers_of_the_architecture_doc():
    """Each module imports only from its own layer or the layers below it in docs/architecture.md's
    table (inside functions too), and every module is in the table: the map cannot go stale."""
    layers = _layers()
    assert [name for name, _ in layers][:2] == ["host", "layout"], layers
    unplaced = [m for m in _all_imports() if m != "minidist" and _layer_of(m, layers) is None]
    assert not unplaced, f"modules in no layer of docs/architecture.md: {unplaced}"
    upward = []
    for module, imports in _all_imports().items():
        mine = _layer_of(module, layers)
        for target, _ in imports:
            theirs = _layer_of(target, layers)
            if mine is not None and theirs is not None and theirs > mine:
                upward.append(f"{module} ({layers[mine][0]}) -> {target} ({layers[theirs][0]})")
    assert not upward, "imports up a layer:\n  " + "\n  ".join(sorted(upward))


def test_top_level_is_a_few_documented_packages():
    """A reader opening minidist/ sees at most ten entries, and each package's ``__init__``
    says what it holds and which packages it may import."""
    entries = sorted(p.name for p in ROOT.iterdir() if p.name != "__pycache__")
    assert len(entries) <= 10, entries
    for package in (p for p in ROOT.iterdir() if (p / "__init__.py").exists()):
        doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text()))
        assert doc and "import" in doc.lower(), f"{package.name}/__init__.py does not say what it may import"
