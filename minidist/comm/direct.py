"""One-shot ("direct") all-gather and reduce-scatter: every message of the collective posted at once.

Recursive doubling, halving and the ring move a small message in log2 N or N-1 rounds, and
in every round a rank waits for one partner before it may go on.  For a few kilobytes the
bytes cost nothing and those waits are the whole price; on ranks that share cores each wait
may also cost a scheduler switch.  The one-shot schedule has a single round: a rank posts a
receive from every other rank and a send to every other rank, then waits once for all of
them.  Thakur, Rabenseifner & Gropp (2005) use the same idea for MPICH's medium-size
all-to-all ("post all the Irecvs and Isends, then Waitall").

* all-gather: rank r sends its block to each other rank and receives each other block
  straight into its place in ``out``;
* reduce-scatter: rank r sends block j of its input to rank j and receives the N-1 copies of
  its own block, then adds the N of them in rank order (block of rank 0 + rank 1 + ...).

Both send and receive (N-1)/N * X bytes per rank (X = gathered or pre-scatter size), the
same as the ring, in N-1 messages each way.  Where it is chosen (thresholds measured in
evengather.py and reducing.py): the all-gather into ``out=`` for small results, and at
every size on up to 4 ranks (a single wait also spares oversubscribed ranks the stalls of
a descheduled partner between rounds); the reduce-scatter for small inputs (large ones
keep the pipelined algorithms, which add each chunk while the next one travels).

A single round also makes a whole collective two MPI calls when the buffers are fixed:
``Startall`` and ``Waitall`` on persistent requests (``Send_init``/``Recv_init``, MPI 1.1).
:class:`Exchange` holds such a round.  The cached plans (directgather.DirectGatherPlan,
fastscatter.DirectScatterPlan) run one on buffers of their own, copying the input in and
the result out, and bind a second one to the caller's arrays when the same ones come back
(large all-gather results: on the caller's arrays only, held by weak reference).

Why it pays, measured on this project's 2-core machine: with ranks sharing cores, each
microsecond of Python around the messages showed up several (up to about ten) times over
in a call's time, while a rank running Python delays partners that spin in MPI.  At 4 KB
(ratio to MPI's built-in, 2 / 4 ranks, the same arrays every call) all_gather went from
0.53 / 0.38-0.40 with one Sendrecv per round to 0.57-0.58 / 0.55-0.57, reduce_scatter
from 0.51 / 0.39 to 0.60-0.62 / 0.50-0.53 (two full benchmark runs).  On 4 ranks what remains is mostly the N-1
additions after the wait and the per-call bookkeeping (recent-ops log, counters).

Wrong input never hangs: there is only one round, so no rank can wait for another that
gave up.  Every received size is checked, and a rank whose own all-gather block has the
wrong size sends empty messages, so that every other rank sees the mismatch too.  Some
mismatches still pass unseen on ranks whose own messages happen to fit (a reduce-scatter
input one element longer on one rank changes only some blocks' sizes): debug mode,
``MINIDIST_CHECK_COLLECTIVES=1``, compares every rank's call before any message.
"""

from __future__ import annotations

import atexit
import weakref

import numpy as np
from mpi4py import MPI

from minidist.comm import links
from minidist.comm.errors import CommError
from minidist.comm.p2p import TAG_COLLECTIVE as TAG, _size_error

BYTE = MPI.BYTE
_EMPTY = np.empty(0, np.uint8)


def peers(n: int, r: int):
    """Rank r's partners in posting order: sends go to r+1, r+2, ..., receives come from
    r-1, r-2, ..., so that the N ranks do not all start with the same rank."""
    return [(r + k) % n for k in range(1, n)], [(r - k) % n for k in range(1, n)]


def post(comm, recvs, sends) -> list:
    """Post the round: an Irecv per (buffer, source), then an Isend per (buffer, dest)."""
    reqs = [comm.Irecv([buf, BYTE], src, TAG) for buf, src in recvs]
    for buf, dest in sends:
        if links.enabled:
            links.delay(buf.nbytes)
        reqs.append(comm.Isend([buf, BYTE], dest, TAG))
    return reqs


def wait(reqs, statuses, nrecv: int) -> list:
    """Wait for the whole round; the byte count of each of the first ``nrecv`` requests (the
    receives), or the text "more than K" for one that got a longer message than its K-byte
    buffer."""
    try:
        _waitall(reqs, statuses)
    except MPI.Exception as err:
        return _settle(err, reqs, statuses, nrecv)
    return [statuses[i].Get_count(BYTE) for i in range(nrecv)]


def _settle(err, reqs, statuses, nrecv) -> list:
    """After a Waitall that failed: a truncated receive makes it stop and leave the later
    requests pending (MPI_ERR_IN_STATUS).  Complete those one by one (each may be
    truncated too), so that nothing of the round stays in flight, then give the counts."""
    if err.Get_error_class() not in (MPI.ERR_IN_STATUS, MPI.ERR_TRUNCATE):
        raise CommError(f"MPI error in a one-shot exchange: {err}") from None
    counts = []
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
            got = status.Get_count(BYTE)
            counts.append(f"more than {got}" if kind == MPI.ERR_TRUNCATE else got)
    return counts


def first_wrong(counts, expected, sources):
    """(source, count) of the first receive whose count is not ``expected`` bytes, or None."""
    for got, src in zip(counts, sources):
        if got != expected:
            return src, got
    return None


def describe(wrong, expected: int) -> str:
    """:func:`first_wrong`'s answer in words."""
    return f"rank {wrong[0]} sent {wrong[1]} bytes where {expected} were expected"


def all_gather(g, x: np.ndarray, out: np.ndarray):
    """Every rank's ``x`` (T/N rows each, T = out.shape[0]) into ``out``, one round.
    Returns ``(out, bytes_sent, bytes_received, bad)``: ``bad`` describes the first wrong
    size seen (this rank's block, or a message), None if all was well."""
    n, r = g.size, g.rank
    per = out.shape[0] // n
    flat = out.reshape(-1).view(np.uint8)
    bad = None
    if x.shape[0] == per:
        out[r * per:(r + 1) * per] = x  # first: measured faster than copying while the messages fly
    else:  # empty messages tell everybody else that something is wrong
        bad = f"this rank's block has {x.shape[0]} rows"
    sent, received, wrong = gather_round(g.comm, flat, n, r, bad is not None)
    return out, sent, received, bad or (wrong and describe(wrong, flat.nbytes // n))


def gather_round(comm, flat: np.ndarray, n: int, r: int, empty: bool = False):
    """The one round of the all-gather on the flat bytes of the result (N blocks, this
    rank's already in place; ``empty``: send empty messages instead).  Returns (bytes sent,
    bytes received, None or the (source, count) of the first wrong size received)."""
    block = flat.nbytes // n
    mine = _EMPTY if empty else flat[r * block:(r + 1) * block]
    to, frm = peers(n, r)
    reqs = post(comm, [(flat[s * block:(s + 1) * block], s) for s in frm], [(mine, d) for d in to])
    counts = wait(reqs, [MPI.Status() for _ in reqs], n - 1)
    wrong = first_wrong(counts, block, frm)
    received = sum(c for c in counts if type(c) is int)
    return mine.nbytes * (n - 1), received, wrong


def reduce_scatter(g, x: np.ndarray, bounds, ufunc, result: np.ndarray) -> tuple:
    """Flat ``x`` in N blocks (``bounds``, element ranges); this rank's block, summed over
    the ranks in rank order, into flat ``result``.  Returns (bytes sent, bytes received);
    raises CommError (naming the rank and sizes) on a message of the wrong size."""
    n, r = g.size, g.rank
    lo, hi = bounds[r]
    stage = g.scratch("direct_rs", (n - 1) * (hi - lo), x.dtype).reshape(n - 1, hi - lo)
    to, frm = peers(n, r)
    reqs = post(g.comm, [(stage[k], s) for k, s in enumerate(frm)], [(x[bounds[d][0]:bounds[d][1]], d) for d in to])
    counts = wait(reqs, [MPI.Status() for _ in reqs], n - 1)
    wrong = first_wrong(counts, stage[0].nbytes, frm)
    if wrong is not None:
        raise _size_error(g.comm, wrong[0], TAG, stage[0].nbytes, wrong[1], "reduce_scatter")
    own = x[lo:hi]
    if np.may_share_memory(own, result):  # in place (out= is x's own block): the first add would overwrite it
        own = own.copy()
    add_in_rank_order(ufunc, operands(stage, frm, own, r), result)
    sent = sum(bounds[d][1] - bounds[d][0] for d in to) * x.itemsize
    return sent, stage.nbytes


def operands(stage, frm, own, r):
    """The N blocks in rank order: row k of ``stage`` came from rank frm[k]; r's is ``own``."""
    rows = [None] * (len(frm) + 1)
    rows[r] = own
    for k, s in enumerate(frm):
        rows[s] = stage[k]
    return rows


def add_in_rank_order(ufunc, operands, result) -> None:
    """result = ((op0 + op1) + op2) + ...: the same order on every path, so the general
    path and the cached plan give bit-identical sums."""
    ufunc(operands[0], operands[1], result)  # out= positionally: a keyword costs ~0.1 us a call
    for operand in operands[2:]:
        ufunc(result, operand, result)


# -------------------------------------------------------------- persistent rounds
_live = weakref.WeakSet()  # every open Exchange, freed before MPI_Finalize (see close_all)
_startall, _waitall = MPI.Prequest.Startall, MPI.Request.Waitall


class Exchange:
    """One round on fixed buffers as persistent requests: :meth:`run` is one ``Startall``
    and one ``Waitall``, with an optional local copy (``during``: a (dst, src) pair of
    arrays) done while the messages travel.  Requests hold the buffers' addresses: their
    owner keeps the buffers alive, or (a held all-gather round,
    directgather.DirectGatherPlan) runs the round only while they live.  Once closed, it
    still works: it posts the same round afresh each time (a collective run from a late
    exit hook, say)."""

    __slots__ = ("comm", "recvs", "sends", "reqs", "during", "statuses", "received", "sources", "__weakref__")

    def __init__(self, comm, recvs, sends, during=None):
        self.comm, self.recvs, self.sends, self.during = comm, recvs, sends, during
        self.reqs = [comm.Recv_init([buf, BYTE], src, TAG) for buf, src in recvs]
        self.reqs += [comm.Send_init([buf, BYTE], dest, TAG) for buf, dest in sends]
        self.statuses = [MPI.Status() for _ in self.reqs]
        self.received = self.statuses[:len(recvs)]
        self.sources = [src for _, src in recvs]
        _live.add(self)

    def run(self, expect: int):
        """Start the round, make the ``during`` copy, wait.  None when every receive
        brought ``expect`` bytes, else the (source, byte count or "more than K") of the
        first that did not.  One method, not a start and a finish: on oversubscribed ranks
        each Python call costs several times its own time (4-rank reduce_scatter at 4 KB,
        four launches each: 0.49-0.52x MPI in one method, 0.47-0.51x calling two)."""
        reqs = self.reqs
        if reqs is None:
            reqs = post(self.comm, self.recvs, self.sends)
        else:
            _startall(reqs)
        if self.during is not None:
            dst, src = self.during
            dst[...] = src
        try:
            _waitall(reqs, self.statuses)
        except MPI.Exception as err:
            return first_wrong(_settle(err, reqs, self.statuses, len(self.sources)), expect, self.sources)
        for status in self.received:
            if status.Get_count(BYTE) != expect:
                return first_wrong([s.Get_count(BYTE) for s in self.received], expect, self.sources)
        return None

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
