"""The layout's arithmetic, the planner's cost model, the schedule simulator and the run's
memory estimate import without starting MPI (mpi4py.MPI initialises MPI when imported): they
import neither mpi4py nor minidist.comm, so the planner and the checks before a launch run on
one process without mpiexec.  minidist.layout imports nothing from minidist but itself and
minidist.train.config."""
import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import minidist.layout

LAYOUT = [f"minidist.layout.{m.name}" for m in pkgutil.iter_modules(minidist.layout.__path__)]
OTHERS = ["minidist.plan.cost", "minidist.plan.search", "minidist.train.flags"]


def test_layout_has_its_modules():
    assert {"minidist.layout.mesh", "minidist.layout.split", "minidist.layout.thresholds", "minidist.layout.grid",
            "minidist.layout.collective_bytes", "minidist.layout.traffic", "minidist.layout.memory",
            "minidist.layout.schedules", "minidist.layout.simulate"} <= set(LAYOUT)


def test_layout_imports_only_itself_and_config():
    for name in LAYOUT:
        path = Path(minidist.layout.__path__[0]) / f"{name.rpartition('.')[2]}.py"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                assert node.level == 1, (name, node.module)  # inside layout/
                continue
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) else []
            for imported in names:
                if imported.startswith("minidist"):
                    assert imported == "minidist.train.config" or imported.startswith("minidist.layout"), (name, imported)


def test_importing_them_does_not_start_mpi():
    code = ("import sys\n"
            f"for name in {LAYOUT + OTHERS!r}:\n"
            "    __import__(name)\n"
            "print(sorted(m for m in sys.modules if m.startswith(('mpi4py', 'minidist.comm'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", f"imported: {out.strip()}"
