"""Groups: a set of ranks that run collectives together (an MPI communicator plus state).

A :class:`Group` wraps an mpi4py communicator and adds what minidist's hand-written
collectives need: the caller's rank and the group size, the world rank of every member (for
printing meshes and traces), reusable scratch buffers (so large collectives don't allocate
and page-fault fresh memory on every call) and, for ``async_op=True``, a progress thread with
its own duplicate communicator (see :mod:`minidist.comm.progress`).

Collective traffic runs on a duplicate of the communicator (``Group.comm``), users'
point-to-point messages on the communicator itself (``Group.user_comm``): collective
receives take the next message from their source with any tag and check its identity tag
(identity.identity), which must never meet a user's message.

Creating a Group is collective over its communicator (it duplicates it), like the
``Split`` that usually produced that communicator: every member must create it, in the same
order as the other members.  Every group is watched by the watchdog (comm/watchdog.py).
"""

from __future__ import annotations

import threading

import numpy as np
from mpi4py import MPI

from minidist.comm import identity, sentinel, watchdog
from minidist.comm.abort import abort_on_exception
from minidist.comm.progress import ProgressWorker

_world = None
_world_lock = threading.Lock()


class Group:
    """A communicator and the per-group state of minidist's collectives.

    Attributes: ``rank`` (this process's rank in the group), ``size``, ``name``,
    ``comm`` (the mpi4py communicator synchronous collectives use: a duplicate of the one
    given), ``user_comm`` (the one given: comm.send/recv) and ``world_ranks`` (the
    COMM_WORLD rank of each member, in group-rank order).  ``busy`` is the cached plan
    running now, for the watchdog (set by fast.run).
    """

    def __init__(self, mpi_comm, name: str | None = None, *, _async_twin: bool = True):
        if not isinstance(mpi_comm, MPI.Comm) or mpi_comm == MPI.COMM_NULL:
            raise ValueError(f"Group needs a valid mpi4py communicator, got {mpi_comm!r}")
        # The twin (below) gets a communicator of its own already: it needs no second one.
        self.user_comm = mpi_comm
        self.comm = mpi_comm.Dup() if _async_twin else mpi_comm
        self.busy = None
        self.rank = mpi_comm.Get_rank()
        self.size = mpi_comm.Get_size()
        self.name = name if name is not None else f"group{self.size}"
        self.world_ranks = _world_ranks(mpi_comm)
        self._scratch: dict[str, np.ndarray] = {}
        self._plans: dict = {}  # cached plans of repeated calls, see comm/fast/
        self._worker = None
        self._worker_lock = threading.Lock()
        # The twin runs this group's async collectives on a duplicate communicator, so
        # they can never match messages of synchronous ones.  Dup is collective: done now,
        # while every member is known to be here, rather than lazily.
        self._twin = Group(mpi_comm.Dup(), self.name, _async_twin=False) if _async_twin else None
        identity.name_comm(self.comm, self.name)
        watchdog.watch(self)

    def __repr__(self) -> str:
        return f"Group({self.name!r}, rank={self.rank}, size={self.size}, world_ranks={self.world_ranks})"

    def scratch(self, key: str, count: int, dtype) -> np.ndarray:
        """A reusable flat host buffer of ``count`` elements (contents undefined).

        Collectives running on this Group object never run concurrently (sync ones on the
        caller's thread, async ones on the twin's worker), so one buffer per key is enough.
        """
        dtype = np.dtype(dtype)
        nbytes = count * dtype.itemsize
        buf = self._scratch.get(key)
        if buf is None or buf.nbytes < nbytes:
            buf = np.empty(max(nbytes, 64), np.uint8)
            self._scratch[key] = buf
        return buf[:nbytes].view(dtype)

    def submit(self, name: str, fn, *args, **kwargs):
        """Queue ``fn(twin_group, *args, **kwargs)`` on this group's progress thread."""
        if self._twin is None:
            raise RuntimeError(f"group {self.name!r} is an async twin; it cannot submit work")
        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise RuntimeError("async_op=True needs MPI initialised with MPI_THREAD_MULTIPLE")
        with self._worker_lock:
            if self._worker is None:
                self._worker = ProgressWorker(self.name)
        return self._worker.submit(name, fn, self._twin, *args, **kwargs)


def _world_ranks(mpi_comm) -> tuple:
    mine, world = mpi_comm.Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        return tuple(int(r) for r in MPI.Group.Translate_ranks(mine, list(range(mpi_comm.Get_size())), world))
    finally:
        mine.Free()
        world.Free()


def world() -> Group:
    """The group of all processes (cached).  Also makes an exception on any rank abort the
    whole MPI job instead of leaving the other ranks waiting forever, and (like any first
    Group) starts the watchdog, which aborts it when a wait makes no progress for
    MINIDIST_TIMEOUT_S / comm.set_timeout seconds (comm/watchdog.py), and this rank's
    sentinel, which names it if it is killed (comm/sentinel.py)."""
    global _world
    with _world_lock:
        if _world is None:
            abort_on_exception()
            sentinel.start(MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size())
            _world = Group(MPI.COMM_WORLD, "world")
        return _world
