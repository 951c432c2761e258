"""A round of messages as MPI persistent requests: one ``Startall``, one ``Waitall`` a call.

The one-shot schedule (algorithms/oneshot.py) has a single round, so when its buffers are
fixed a whole collective can be two MPI calls on persistent requests (``Send_init`` /
``Recv_init``, MPI 1.1), with no per-message Python at all.  The one-shot plans
(scatter.DirectScatterPlan, directgather.DirectGatherPlan) hold their rounds as
:class:`Exchange` objects.
"""

from __future__ import annotations

import atexit
import weakref

from mpi4py import MPI

from minidist.comm.algorithms.oneshot import first_wrong
from minidist.comm.p2p import TAG_COLLECTIVE as TAG
from minidist.comm.p2p.rounds import check_tags, persistent_round, received

BYTE = MPI.BYTE
_live = weakref.WeakSet()  # every open Exchange, freed before MPI_Finalize (see close_all)
_startall, _waitall = MPI.Prequest.Startall, MPI.Request.Waitall


class Exchange:
    """One round on fixed buffers as persistent requests: :meth:`run` is one ``Startall``
    and one ``Waitall``, with an optional local copy (``during``: a (dst, src) pair of
    arrays) made while the messages travel.  Requests hold the buffers' addresses: their
    owner keeps the buffers alive, or (a held all-gather round) runs the round only while
    they live.  Once closed, it still works: it posts the same round afresh each time (a
    collective run from a late exit hook, say)."""

    __slots__ = ("comm", "recvs", "sends", "reqs", "during", "statuses", "received", "sources", "tag", "rtag",
                 "__weakref__")

    def __init__(self, comm, recvs, sends, during=None, tag=TAG, rtag=TAG):
        """``tag``: the call's identity tag, sent; ``rtag``: ANY_TAG, or TAG with identity tags off."""
        self.comm, self.recvs, self.sends, self.during = comm, recvs, sends, during
        self.tag, self.rtag = tag, rtag
        self.reqs = persistent_round(comm, recvs, sends, tag, rtag)
        self.statuses = [MPI.Status() for _ in self.reqs]
        self.received = self.statuses[:len(recvs)]
        self.sources = [src for _, src in recvs]
        _live.add(self)

    def run(self, expect: int):
        """Start the round, make the ``during`` copy, wait.  None when every receive
        brought ``expect`` bytes, else the (source, byte count or "more than K") of the
        first that did not.  A message of another call (its tag is not this round's) raises
        CollectiveMismatchError once the round is complete.  One method, not a start and a
        finish: on oversubscribed ranks each Python call costs several times its own time
        (docs/perf-notes.md)."""
        reqs = self.reqs
        if reqs is None:  # closed: the same round posted afresh (the plan does the accounting)
            reqs = [self.comm.Irecv([buf, BYTE], src, self.rtag) for buf, src in self.recvs]
            reqs += [self.comm.Isend([buf, BYTE], dest, self.tag) for buf, dest in self.sends]
        else:
            _startall(reqs)
        if self.during is not None:
            dst, src = self.during
            dst[...] = src
        tag = self.tag
        try:
            _waitall(reqs, self.statuses)
        except MPI.Exception as err:
            return self._wrong(reqs, expect, err)
        for status in self.received:
            if status.Get_count(BYTE) != expect or status.Get_tag() != tag:
                return self._wrong(reqs, expect)
        return None

    def _wrong(self, reqs, expect, err=None):
        """run's answer for a complete round with a message of the wrong size or identity."""
        counts, tags = received(self.statuses, reqs, len(self.sources), err)
        check_tags(self.comm, self.sources, self.tag, tags, counts, expect)
        return first_wrong(counts, expect, self.sources)

    def close(self) -> None:
        """Free the requests: MPI warns at exit about persistent requests left open."""
        if self.reqs is not None and not MPI.Is_finalized():
            for req in self.reqs:
                if req != MPI.REQUEST_NULL:
                    req.Free()
        self.reqs = None
        _live.discard(self)

    # An Exchange dropped with its plan (the cache evicted it, a test cleared it) frees its
    # requests then, instead of leaving them to the exit hook.
    __del__ = close


@atexit.register  # runs before mpi4py's MPI_Finalize, which Python calls after atexit's hooks
def close_all() -> None:
    for exchange in list(_live):
        exchange.close()
