"""One round of many messages at once: every receive and send of a step posted together.

Algorithms whose step exchanges with many peers (the one-shot all-gather, pairwise exchanges)
post a *round*: an ``Irecv`` per (buffer, source), then an ``Isend`` per (buffer, dest), and
wait for all of them in one ``Waitall``, so no message waits behind another.  The cached
plans of ``comm.fast`` make the same round once as persistent requests and restart it.

Like every message of ``p2p``, a round counts its bytes, carries the collective's identity
in its tag (checked on arrival), notes its wait for the watchdog, and shows on the timeline.
"""

from __future__ import annotations

from mpi4py import MPI

from minidist.comm import links, p2p
from minidist.comm.errors import CommError
from minidist.comm.identity import _wire, mismatch_error
from minidist.comm.p2p import ANY_TAG, BYTE, _charge, _tls


class Round(list):
    """The requests of a round (receives first), and what :func:`wait_round` checks."""

    __slots__ = ("comm", "sources", "wire")


def post_round(comm, recvs, sends, tag: int) -> list:
    """Post a round: an Irecv per (buffer, source), then an Isend per (buffer, dest).
    Complete it with :func:`wait_round`."""
    tr = p2p.trace  # read once: trace.stop() on another thread may clear it meanwhile
    t0 = tr.clock() if tr is not None else 0.0
    state = _tls.state
    wire, rtag = _wire(state, tag)
    reqs = Round(comm.Irecv([buf, BYTE], src, rtag) for buf, src in recvs)
    reqs.comm, reqs.sources, reqs.wire = comm, [src for _, src in recvs], wire if rtag == ANY_TAG else None
    sent = 0
    for buf, dest in sends:
        if links.enabled:
            links.delay(buf.nbytes, comm, dest)
        reqs.append(comm.Isend([buf, BYTE], dest, wire))
        sent += buf.nbytes
    _charge(state, sent, 0)
    if t0 and tr is not None:
        tr.message("post round", [dest for _, dest in sends], sent, 0, t0)
    return reqs


def wait_round(reqs, nrecv: int) -> list:
    """Wait for a whole round; the byte count of each of the first ``nrecv`` requests (the
    receives), or the text "more than K" for one that got more than its K-byte buffer.
    A message of another collective raises CollectiveMismatchError (once all are done)."""
    tr = p2p.trace  # read once: trace.stop() on another thread may clear it meanwhile
    t0 = tr.clock() if tr is not None else 0.0
    statuses = [MPI.Status() for _ in reqs]
    state = _tls.state
    state.wait = ("round", getattr(reqs, "comm", None), getattr(reqs, "sources", None), None)
    try:
        MPI.Request.Waitall(reqs, statuses)
        counts, tags = received(statuses, reqs, nrecv)
    except MPI.Exception as err:
        counts, tags = received(statuses, reqs, nrecv, err)
    finally:
        state.wait = None
    wire = getattr(reqs, "wire", None)
    if wire is not None:
        check_tags(reqs.comm, reqs.sources, wire, tags, counts)
    _charge(state, 0, sum(c for c in counts if type(c) is int))
    if t0 and tr is not None:
        tr.message("wait round", getattr(reqs, "sources", None), 0, sum(c for c in counts if type(c) is int), t0)
    return counts


def received(statuses, reqs, nrecv, err=None) -> tuple:
    """(byte counts, tags) of the first ``nrecv`` requests (the receives) of a round now
    complete, a count "more than K" for a receive truncated at K bytes.  After a Waitall
    that failed (``err``): a truncated receive makes it stop and leave the later requests
    pending (MPI_ERR_IN_STATUS).  Complete those one by one (each may be truncated too), so
    that nothing of the round stays in flight."""
    if err is None:
        return [s.Get_count(BYTE) for s in statuses[:nrecv]], [s.Get_tag() for s in statuses[:nrecv]]
    if err.Get_error_class() not in (MPI.ERR_IN_STATUS, MPI.ERR_TRUNCATE):
        raise CommError(f"MPI error in a round of messages: {err}") from None
    counts, tags = [], []
    for i, req in enumerate(reqs):
        status, code = statuses[i], statuses[i].Get_error()
        kind = MPI.SUCCESS if code == MPI.SUCCESS else MPI.Get_error_class(code)
        if kind == MPI.ERR_PENDING or err.Get_error_class() == MPI.ERR_TRUNCATE:
            status = MPI.Status()
            try:
                req.Wait(status)
                kind = MPI.SUCCESS
            except MPI.Exception as again:
                kind = again.Get_error_class()
        if i < nrecv:
            tags.append(status.Get_tag())
            got = status.Get_count(BYTE)
            counts.append(f"more than {got}" if kind == MPI.ERR_TRUNCATE else got)
    return counts, tags


def check_tags(comm, sources, wire, tags, counts, expected=None) -> None:
    """Raise CollectiveMismatchError for the first receive of a finished round whose tag is
    not ``wire``, this call's identity (``counts``: their sizes, of ``expected`` bytes)."""
    for src, tag, count in zip(sources, tags, counts):
        if tag != wire:
            raise mismatch_error(comm, src, wire, tag, count, expected)


def persistent_round(comm, recvs, sends, tag: int, rtag: int) -> list:
    """The same round as persistent requests (``Recv_init``/``Send_init``, MPI 1.1): made
    once, then started and completed as often as needed (see fast/exchange.py).  ``tag``
    is sent; receives match ``rtag``."""
    reqs = [comm.Recv_init([buf, BYTE], src, rtag) for buf, src in recvs]
    return reqs + [comm.Send_init([buf, BYTE], dest, tag) for buf, dest in sends]
