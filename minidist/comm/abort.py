"""One rank's uncaught exception ends the whole MPI job, instead of leaving the others waiting.

A distributed program fails badly when one rank raises and the others wait for it forever
in a collective.  :func:`abort_on_exception` (installed by ``comm.world()``) turns that into
a fast failure: the failing rank prints its traceback, gives the other ranks a moment to
print theirs (ranks often fail together, each seeing the other's bad message), and calls
``MPI_Abort``, which ends every rank of the job.  A bad environment variable
(:class:`minidist.host.env.EnvError`) is reported as its one line, ``minidist: <message>``: its
traceback would only say where the variable was read.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback

from minidist.host.env import EnvError

ABORT_GRACE_S = 0.5  # how long a failing rank waits for the others' reports before aborting the job


def _world_rank() -> int:
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_rank()


def abort_on_exception():
    """Make an uncaught exception on this rank abort the whole MPI job (idempotent)."""
    if getattr(sys.excepthook, "_minidist", False):
        return

    def _abort(exc_type, exc, tb, where="main thread"):
        rank = _world_rank()
        if issubclass(exc_type, EnvError):
            report = f"[rank {rank}] minidist: {exc}\n"
        else:
            lines = traceback.format_exception(exc_type, exc, tb)
            report = f"[rank {rank}] uncaught exception in {where}, aborting the job:\n" + "".join(
                f"[rank {rank}] {ln}" for chunk in lines for ln in chunk.splitlines(True))
        # One write, so that a kill from another rank's abort cannot cut the report in two.
        sys.stderr.write(report)
        sys.stderr.flush()
        sys.stdout.flush()
        # Ranks often fail together (each sees the other's bad message); give them a moment to
        # print their own reports before the abort kills them.
        time.sleep(ABORT_GRACE_S)
        from mpi4py import MPI

        from minidist.comm import sentinel

        sentinel.before_abort()  # its own report names the cause: no sentinel speaks
        MPI.COMM_WORLD.Abort(1)

    def _thread_abort(args):
        if args.exc_type is SystemExit:
            return
        _abort(args.exc_type, args.exc_value, args.exc_traceback, f"thread {args.thread.name}")

    _abort._minidist = True
    sys.excepthook = _abort
    threading.excepthook = _thread_abort
