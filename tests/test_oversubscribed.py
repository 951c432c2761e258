"""More ranks than cores: MPI's yield set when (and only when) a node is oversubscribed, and said
in the start-up line; every rank's BLAS pinned before NumPy loads (minidist/host/oversubscribed.py,
minidist/host/blas_env.py)."""
import os
import subprocess
import sys

import pytest

from minidist.host import oversubscribed
from minidist.host.launcher import mpiexec_command

TINY = ["--layers", "1", "--d-model", "16", "--heads", "2", "--seq-len", "16", "--batch-size", "8",
        "--steps", "1", "--eval-every", "0", "--peak-gflops", "10"]
VARS = [var for var, _ in oversubscribed.YIELD.values()]


@pytest.mark.parametrize("local, cores, user, expect", [
    ("8", 2, None, "1"),  # oversubscribed: set
    ("2", 2, None, None),  # a core per rank: left alone
    (None, 1, None, None),  # no launcher said: left alone
    ("8", 2, "0", "0"),  # the user's value wins
])
def test_prepare_sets_the_yield_only_when_oversubscribed(monkeypatch, local, cores, user, expect):
    monkeypatch.setattr(oversubscribed, "cores", lambda: cores)
    environ = {"MPI_LOCALNRANKS": local} if local else {}
    if user is not None:
        environ.update({var: user for var in VARS})
    oversubscribed.prepare(environ)
    assert all(environ.get(var) == expect for var in VARS), environ


def test_note_says_what_the_waits_do(monkeypatch):
    monkeypatch.setattr(oversubscribed, "cores", lambda: 2)
    assert oversubscribed.note(2, "MPICH Version: 5.0.2") is None
    monkeypatch.setenv("MPIR_CVAR_ENABLE_HEAVY_YIELD", "1")
    assert oversubscribed.note(8, "MPICH Version: 5.0.2") == \
        "oversubscribed: 8 ranks on this node's 2 cores, MPI's waits yield (MPIR_CVAR_ENABLE_HEAVY_YIELD=1)"
    monkeypatch.delenv("OMPI_MCA_mpi_yield_when_idle", raising=False)
    assert "set OMPI_MCA_mpi_yield_when_idle=1" in oversubscribed.note(3, "Open MPI v5.0.5")


def _start_line(cpus: set, env: dict) -> str:
    """The training command's start-up line on 2 ranks confined to ``cpus``."""
    full = {k: v for k, v in os.environ.items() if k not in VARS} | env | {"OMP_NUM_THREADS": "1"}
    cmd = mpiexec_command(2) + [sys.executable, "-m", "minidist.train", "--dp", "2", *TINY]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=full,
                       preexec_fn=lambda: os.sched_setaffinity(0, cpus))  # inherited by the ranks
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines()[0]


@pytest.mark.mpi
def test_the_start_line_says_when_ranks_outnumber_cores():
    cpus = sorted(os.sched_getaffinity(0))
    line = _start_line({cpus[0]}, {})  # 2 ranks on one core
    assert line.endswith("; oversubscribed: 2 ranks on this node's 1 cores, MPI's waits yield "
                         "(MPIR_CVAR_ENABLE_HEAVY_YIELD=1)"), line
    line = _start_line({cpus[0]}, {"MPIR_CVAR_ENABLE_HEAVY_YIELD": "0"})
    assert line.endswith("MPI's waits spin (MPIR_CVAR_ENABLE_HEAVY_YIELD=0 was set)"), line
    if len(cpus) >= 2:
        line = _start_line(set(cpus[:2]), {})  # a core per rank: nothing to say
        assert "oversubscribed" not in line and line.endswith("DDP over 2 ranks"), line


def test_the_training_command_pins_blas_threads_before_numpy_loads():
    """A BLAS started before its thread count is pinned runs a spinning thread per core in every
    rank: the README's 8 ranks on 2 cores ran 16x slower (docs/perf-notes.md)."""
    code = ("import sys, minidist.train.loop as t\n"
            "def validate(*a):\n"
            "    print('numpy' in sys.modules); raise SystemExit(0)\n"
            "t.validate = validate\n"
            "t.main([])\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "False", (r.stdout, r.stderr)
