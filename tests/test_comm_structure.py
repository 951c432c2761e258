"""The shape of minidist.comm that its docs promise: the textbook algorithms apart from the
speed-ups, one-way imports, every message through p2p.py (or a documented bypass)."""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "minidist"
COMM = ROOT / "comm"


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules(root: pathlib.Path) -> dict:
    return {_module_name(p): p for p in root.rglob("*.py")}


def _imports(path: pathlib.Path, known: dict) -> set:
    """Every module of ``known`` that ``path`` imports, at any depth of the file (a late
    import inside a function closes a cycle just as well)."""
    me = _module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            # "from pkg import sub" imports the submodule pkg.sub when there is one
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        found.update(n for n in names if n in known and n != me)
    return found


def test_comm_has_no_import_cycle():
    known = _modules(COMM)
    graph = {name: _imports(path, known) for name, path in known.items()}
    # A submodule importing its own package's __init__ is a cycle too: the package imports it.
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycle = stack[stack.index(nxt):] + [nxt]
                pytest.fail("import cycle in minidist.comm: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name)


def test_algorithms_never_import_the_fast_path_or_mpi():
    known = _modules(COMM)
    for name, path in known.items():
        if name.startswith("minidist.comm.algorithms"):
            deps = _imports(path, known)
            assert not [d for d in deps if d.startswith("minidist.comm.fast")], (name, deps)
            assert "mpi4py" not in path.read_text(), f"{name} talks to MPI directly; use p2p.py"


def test_only_p2p_and_the_fast_path_make_mpi_data_calls():
    """Every message goes through the p2p package (p2p/: single messages, and rounds of many
    at once); the fast/ plans are the documented bypass (p2p's docstring names them).  Communicator management (Dup, Split) and Abort are not messages."""
    calls = ("Send(", "Recv(", "Sendrecv(", "Isend(", "Irecv(", "Send_init(", "Recv_init(", "Startall", "Waitall",
             "Probe(", "Ssend(", "Bsend(")
    allowed = set((COMM / "p2p").rglob("*.py")) | set((COMM / "fast").rglob("*.py"))
    offenders = []
    for path in COMM.rglob("*.py"):
        if path in allowed:
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if any(f".{c}" in code for c in calls):
                offenders.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not offenders, "MPI data calls outside p2p/ and fast/:\n" + "\n".join(offenders)
    doc = (COMM / "p2p" / "__init__.py").read_text().split('"""')[1]
    assert "fast" in doc and "bypass" in doc, "p2p.py's docstring must say which calls bypass it"


def test_the_library_never_imports_its_test_helper():
    known = _modules(ROOT)
    for name, path in known.items():
        if name != "minidist.train.testing":
            assert "minidist.train.testing" not in _imports(path, known), f"{name} imports minidist.train.testing"


def test_the_textbook_ring_fits_on_one_screen():
    text = (COMM / "algorithms" / "ring.py").read_text()
    assert len(text.splitlines()) <= 60
    assert "2(N-1)/N" in text


def test_comm_docs_name_every_module():
    docs = (COMM / "__init__.py").read_text().split('"""')[1]
    arch = (ROOT.parent / "docs" / "architecture.md").read_text()
    for path in COMM.rglob("*.py"):
        if path.name == "__init__.py":
            continue
        rel = path.relative_to(COMM).as_posix()
        assert path.name in docs, f"comm/__init__.py's docstring does not name {rel}"
        assert path.name in arch, f"docs/architecture.md does not name {rel}"


def test_comm_modules_import_only_those_listed_above_them_in_the_architecture_doc():
    """docs/architecture.md lists comm/'s modules "from the wire up"; the list stays true."""
    arch = (ROOT.parent / "docs" / "architecture.md").read_text()
    block = arch.split("`comm/` in detail", 1)[1].split("```")[1]
    order, package = [], ""
    for line in block.splitlines():
        if not line.strip() or line.startswith("    "):  # blank or a continuation line
            continue
        name = line.split()[0]
        if name.endswith("/"):
            package = name[:-1] + "."
            order.append(f"minidist.comm.{name[:-1]}")
            continue
        if not line.startswith("  "):
            package = ""
        if name != "__init__.py":  # a folder's own line stands for its __init__.py
            order.append(f"minidist.comm.{package}{name[:-3]}")
    known = _modules(COMM)
    assert set(order) == set(known) - {"minidist.comm"}, set(known) ^ set(order)
    rank = {name: i for i, name in enumerate(order)}
    for name in order:
        late = [d for d in _imports(known[name], known)  # a package's __init__ may import its own parts
                if d != "minidist.comm" and rank[d] > rank[name] and not d.startswith(name + ".")]
        assert not late, f"{name} imports {late}, listed below it in docs/architecture.md"
