"""Ctrl-C under mpiexec: rank 0 stops the job with exit code 130.

The launcher forwards SIGINT to every rank, each at a different point of its step.  A rank
stopped in the middle of a collective would leave its peers blocked in a wait that never
returns (Python runs its signal handler only between bytecodes, never inside MPI's wait), and
the launcher would then kill them without a word, reporting a kill (signal 9), not 130.  So
only rank 0 acts on Ctrl-C: the other ranks ignore SIGINT and keep training, which lets rank
0's own wait complete; rank 0 then says what happened, prints its summary and ends the job
with ``MPI_Abort(130)``, the one way to end every rank with a code the launcher passes on
(MPICH adds its own line saying that rank 0 called MPI_Abort).  With ``--save`` the first
Ctrl-C is kept for the end of the step (:func:`defer`, :func:`requested`): every rank then
writes a final checkpoint before the job stops.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

_requested = False  # Ctrl-C seen, to be acted on at the end of the step (a final checkpoint)


def install() -> None:
    """Under mpiexec: rank 0 keeps Ctrl-C, the other ranks ignore it."""
    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_rank() != 0:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def defer(is_rank0: bool) -> None:
    """With ``--save``: a first Ctrl-C on rank 0 (or on a single process) only asks for a stop
    at the end of the step, so that every rank can write a final checkpoint there; a second
    Ctrl-C stops at once."""
    def ask(signum, frame):
        global _requested
        if _requested:
            raise KeyboardInterrupt
        _requested = True

    if is_rank0:
        signal.signal(signal.SIGINT, ask)


def requested(world) -> bool:
    """Has Ctrl-C been asked for?  Agreed by every rank (one scalar all-reduce over ``world``,
    None for a single process), so that all of them stop after the same step."""
    if world is None:
        return _requested
    from minidist.parallel.data import any_rank

    return any_rank(_requested, world)


@contextlib.contextmanager
def held():
    """Ctrl-C held back while the block runs, handed to the SIGINT handler at its end.

    For bookkeeping that must not be cut in half: a step's metrics record is kept in memory
    and written to the metrics file together, so the summary printed after Ctrl-C and the
    file always count the same finished steps.  Whatever handler is installed (Python's,
    which raises KeyboardInterrupt, or --save's deferring one) gets each signal that came
    meanwhile; on other threads, or where SIGINT is ignored, the block just runs."""
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or not callable(previous):
        yield
        return
    pending = []
    signal.signal(signal.SIGINT, lambda signum, frame: pending.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        for frame in pending:
            previous(signal.SIGINT, frame)


def stop_everyone() -> None:
    """Rank 0, after its message and summary: end every rank of the job with exit code 130."""
    from mpi4py import MPI

    sys.stdout.flush()
    sys.stderr.flush()
    if MPI.Is_initialized() and MPI.COMM_WORLD.Get_size() > 1:
        from minidist.comm import sentinel

        sentinel.before_abort()  # its own report names the cause: no sentinel speaks
        MPI.COMM_WORLD.Abort(130)
    os._exit(130)
