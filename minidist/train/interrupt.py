"""Ctrl-C and SIGTERM under mpiexec: rank 0 stops the job with exit code 130 (143 for SIGTERM).

SIGTERM is how a scheduler preempts a job (Slurm, Kubernetes), and it is handled as Ctrl-C
is: a stop, not a crash.  MPICH's launcher forwards both to every rank (measured: a rank's
handler sees SIGINT, SIGTERM and SIGUSR1 sent to mpiexec; docs/multinode.md), each at a
different point of its step.  A rank stopped in the middle of a collective would leave its
peers blocked in a wait that never returns (Python runs its signal handler only between
bytecodes, never inside MPI's wait), and the launcher would then kill them without a word,
reporting a kill, not 130 or 143.  So only rank 0 acts on either signal: the other ranks
ignore both and keep training, which lets rank 0's own wait complete; rank 0 then says what
happened, prints its summary and ends the job with ``MPI_Abort(code)``, the one way to end
every rank with a code the launcher passes on (MPICH adds its own line saying that rank 0
called MPI_Abort).  With ``--save`` the first signal is kept for the end of the step
(:func:`defer`, :func:`requested`): every rank then writes a final checkpoint before the job
stops.  The exit codes are the shell's, 128 + the signal's number.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

SIGNALS = (signal.SIGINT, signal.SIGTERM)
_requested = 0  # the signal seen (SIGINT or SIGTERM), to be acted on at the end of the step; 0: none
_received = signal.SIGINT  # the signal that stopped (or stops) the run: its name and exit code


def _terminate(signum, frame):
    """SIGTERM without --save: stop at once, as Ctrl-C does (KeyboardInterrupt), remembering which."""
    global _received
    _received = signum
    raise KeyboardInterrupt


def install(world_size: int) -> None:
    """Rank 0 (or the one process) stops on SIGTERM as on Ctrl-C; under mpiexec the other
    ranks ignore both signals."""
    if world_size > 1:
        from mpi4py import MPI

        if MPI.COMM_WORLD.Get_rank() != 0:
            for s in SIGNALS:
                signal.signal(s, signal.SIG_IGN)
            return
    signal.signal(signal.SIGTERM, _terminate)


def defer(is_rank0: bool) -> None:
    """With ``--save``: a first Ctrl-C or SIGTERM on rank 0 (or on a single process) only asks
    for a stop at the end of the step, so that every rank can write a final checkpoint there;
    a second one stops at once."""
    def ask(signum, frame):
        global _requested, _received
        if _requested:
            raise KeyboardInterrupt
        _requested = _received = signum

    if is_rank0:
        for s in SIGNALS:
            signal.signal(s, ask)


def requested(world) -> bool:
    """Has a stop been asked for?  Agreed by every rank (one scalar all-reduce over ``world``,
    None for a single process), so that all of them stop after the same step."""
    if world is None:
        return bool(_requested)
    from minidist.parallel.data import any_rank

    return any_rank(bool(_requested), world)


def received() -> tuple[str, int]:
    """What stopped the run: ``("interrupted", 130)`` for Ctrl-C, ``("stopped by SIGTERM",
    143)`` for SIGTERM (the words of the one line rank 0 prints, and the exit code)."""
    if _received == signal.SIGTERM:
        return "stopped by SIGTERM", 128 + signal.SIGTERM
    return "interrupted", 128 + signal.SIGINT


@contextlib.contextmanager
def held():
    """Ctrl-C and SIGTERM held back while the block runs, handed to their handlers at its end.

    For bookkeeping that must not be cut in half: a step's metrics record is kept in memory
    and written to the metrics file together, so the summary printed after a stop and the
    file always count the same finished steps.  Whatever handler is installed (Python's,
    which raises KeyboardInterrupt, or --save's deferring one) gets each signal that came
    meanwhile; on other threads, or where a signal is ignored, the block just runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in SIGNALS if callable(signal.getsignal(s))}
    pending = []
    for s in previous:
        signal.signal(s, lambda signum, frame: pending.append((signum, frame)))
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for signum, frame in pending:
            previous[signum](signum, frame)


def stop_everyone(code: int) -> None:
    """Rank 0, after its message and summary: end every rank of the job with exit code ``code``."""
    from mpi4py import MPI

    sys.stdout.flush()
    sys.stderr.flush()
    if MPI.Is_initialized() and MPI.COMM_WORLD.Get_size() > 1:
        from minidist.comm import sentinel

        sentinel.before_abort()  # its own report names the cause: no sentinel speaks
        MPI.COMM_WORLD.Abort(code)
    os._exit(code)
