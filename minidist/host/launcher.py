"""The ``mpiexec`` command line for this Python's MPI (no MPI import: it only builds a list).

The mpich wheel that ``make install`` puts into the virtual environment ships its own
``mpiexec`` next to the Python; a system MPI's is found on ``PATH``.  Open MPI refuses more
ranks than cores unless told ``--oversubscribe``, which the tests, the benchmarks and the
planner's calibration all need on small machines.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys


def mpiexec_command(nprocs: int) -> list[str]:
    """``[mpiexec, -n, N]`` (plus ``--oversubscribe`` for Open MPI); RuntimeError if none is found."""
    local = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    exe = local if os.path.exists(local) else shutil.which("mpiexec")
    if exe is None:
        raise RuntimeError("no mpiexec found: run `make install` (it installs the mpich wheel)")
    return [exe, "--oversubscribe", "-n", str(nprocs)] if open_mpi(exe) else [exe, "-n", str(nprocs)]


def open_mpi(exe: str) -> bool:
    """Whether the launcher ``exe`` is Open MPI's (it then needs ``--oversubscribe``)."""
    try:
        version = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "Open MPI" in version or "OpenRTE" in version
