"""Ctrl-C under mpiexec: rank 0 stops the job with exit code 130.

The launcher forwards SIGINT to every rank, each at a different point of its step.  A rank
stopped in the middle of a collective would leave its peers blocked in a wait that never
returns (Python runs its signal handler only between bytecodes, never inside MPI's wait), and
the launcher would then kill them without a word, reporting a kill (signal 9), not 130.  So
only rank 0 acts on Ctrl-C: the other ranks ignore SIGINT and keep training, which lets rank
0's own wait complete; rank 0 then says what happened, prints its summary and ends the job
with ``MPI_Abort(130)``, the one way to end every rank with a code the launcher passes on
(MPICH adds its own line saying that rank 0 called MPI_Abort).
"""

from __future__ import annotations

import os
import signal
import sys


def install() -> None:
    """Under mpiexec: rank 0 keeps Ctrl-C, the other ranks ignore it."""
    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_rank() != 0:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def stop_everyone() -> None:
    """Rank 0, after its message and summary: end every rank of the job with exit code 130."""
    from mpi4py import MPI

    sys.stdout.flush()
    sys.stderr.flush()
    if MPI.Is_initialized() and MPI.COMM_WORLD.Get_size() > 1:
        MPI.COMM_WORLD.Abort(130)
    os._exit(130)
