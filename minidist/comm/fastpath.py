"""The small-message fast path: a collective as a cached *plan*, run with one MPI call per round.

For a 4 KB all-reduce the bytes cross shared memory in about a microsecond; what the caller
waits for is Python.  The general path in collectives.py validates every argument, chooses
an algorithm, computes partners and block bounds, looks up scratch buffers and charges every
message to a thread-local label: some 50 Python function calls, several times the cost of
MPI's own built-in.  MPI libraries meet the same problem by caching schedules (persistent
collectives in MPI-4, NCCL's plans); minidist does the same:

* the first synchronous call with a given key (collective, dtype, shape, op, algorithm) on a
  group goes through the general, fully checked path, and then stores a plan: the partner
  of every round, scratch buffers with their MPI descriptors already built, the exact byte
  counts for ``comm.stats()`` and an ``MPI.Status`` to reuse;
* later calls with the same key check only what can differ between calls (``out=`` fits)
  and run the plan: per round one ``Sendrecv`` and one in-place ufunc, per call one
  recent-ops entry and one update of the collective's counters (``stats.Call``).  A
  non-contiguous input goes to the general path, which copies it: a 1-D one is left to MPI
  to notice (it raises BufferError before sending from a strided buffer); an N-D one is
  checked, because MPI sends a Fortran-ordered array as it is, in column-major byte order.

Plans are used only where they give exactly the general path's answer (same algorithm, same
order of additions, so bit-identical results): synchronous calls on NumPy arrays with the
debug-mode signature check and the simulated link both off; for all_reduce (recursive
doubling up to PLAN_MAX_BYTES, here; the pairwise reduce-scatter + all-gather while every
block is one pipeline chunk, in fastscatter.py) and reduce_scatter (the one-shot exchange
up to reducing.DIRECT_BYTES, ring up to one pipeline chunk, recursive halving on 4, 8, ... ranks up
to PLAN_MAX_BYTES, pairwise exchange while every block is one chunk: fastscatter.py) in a
dtype that is its own accumulator (float32/float64/int32/int64); for all_gather
(fastgather.py), any dtype.  Everything else takes the general path.  The pairwise plans
matter on oversubscribed ranks: at 1 MB on 4 ranks sharing 2 cores
the general path's bookkeeping around the messages cost about 50 us a call (8x its cost on an
idle core), and the plans took reduce_scatter from 0.78-0.83x MPI to 1.00-1.01x and
all_reduce from 0.84-0.92x to 0.95-1.06x.

The one-shot plans (direct.py) go one step further: their single round is a set of MPI
persistent requests, so a whole collective is one ``Startall`` and one ``Waitall``, with no
per-message Python at all.  That took 4 KB on 4 oversubscribed ranks from 0.38-0.40x MPI's
Allgather and Reduce_scatter_block to 0.52-0.60x and 0.45-0.52x (direct.py has the
measurements).

Per call, what is left is Python calling MPI, so every attribute lookup counts: views and MPI
descriptors of the plan's own buffers are built once, the recent-ops entry is a tuple built
once, and ``stats.record_call`` takes no lock, adds to the counters in place and reads the
clock once.  Measured (4 KB float32, 2 ranks, us per call, MPI's built-in in brackets): a bare
mpi4py Sendrecv takes 3.0-3.2 and one plus a copy 4.2-4.4; all_reduce 8.2 (5.6), all_gather
6.7 (3.4), reduce_scatter 9.0 (4.8), down from 11.1 / 10.8 / 12.6 before the plans.  On 4
ranks sharing 2 cores every microsecond of Python costs about three: a busy-wait of 2 us
added to a hand-written recursive-doubling all-gather in plain mpi4py made it 6-7 us slower
(33.5 -> 39-40 us; MPI's Allgather: 19.4), and that plain loop reached only 0.57-0.6x MPI
at 4 KB: the ceiling of a round-by-round loop in Python, which the one-shot plans pass by
having no loop.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from minidist.comm import check, links, reduction, stats
from minidist.comm.errors import CommError
from minidist.comm.p2p import TAG_COLLECTIVE as TAG, _size_error, _truncated
from minidist.comm.tree import (EXCHANGE, GIVE, RESULT_IN, RESULT_OUT, TAKE,
                                recursive_doubling_schedule)

BYTE = MPI.BYTE
_clock = stats._clock  # time.perf_counter, one global lookup instead of two
_MAX_PLANS = 256  # per group; a training loop uses a handful of shapes, so this rarely fills
# An all-reduce plan owns a receive buffer of X bytes, so only small calls get one (256 plans
# of at most 512 KB); above that Python's per-call work is noise next to moving the bytes.
PLAN_MAX_BYTES = 512 * 1024


def usable(x, async_op: bool) -> bool:
    """Could a plan run this call?  (Inlined into the collectives' first lines, as the check
    costs about as much as a function call; kept here as the one place that says what.)"""
    return type(x) is np.ndarray and not (async_op or check._enabled or links.enabled)


def plain(out, dtype) -> bool:
    """Would a plan take this ``out=``?  (None, or a NumPy array, not a subclass, with the
    very dtype object of x: the plans test identity, which costs less than equality.)
    Only then is a plan worth storing: one that refuses every call would be rebuilt at
    every call."""
    return out is None or (type(out) is np.ndarray and out.dtype is dtype)


def store(g, key, plan) -> None:
    """Cache ``plan`` on ``g`` under ``key`` (at most _MAX_PLANS; a full cache is emptied)."""
    if len(g._plans) >= _MAX_PLANS:
        drop(g)
    old = g._plans.get(key)
    if old is not None:
        _close(old)
    g._plans[key] = plan


def drop(g) -> None:
    """Forget every plan of ``g``, freeing the MPI requests of those that hold some."""
    for plan in g._plans.values():
        _close(plan)
    g._plans.clear()


def _close(plan) -> None:
    close = getattr(plan, "close", None)
    if close is not None:
        close()


def _fail(what, g, x, status, src, expected, err=None) -> CommError:
    """The general path's error for a message of the wrong size (or a truncated one).  The
    call is logged now: the fast path only logs it at the end, when it succeeded."""
    stats.note_op(what, g.name, x.shape, x.dtype)
    comm = g.comm
    if err is not None:
        return _truncated(comm, src, TAG, expected, err, what)
    return _size_error(comm, src, TAG, expected, status.Get_count(BYTE), what)


class AllReducePlan:
    """Recursive doubling (see tree.recursive_doubling_schedule) of one (shape, dtype, op).

    Per call: log2(N) rounds of Sendrecv + ufunc into a fresh result (or ``out``), the first
    reading x directly (two more rounds when N is not a power of two), then the division for "avg".
    """

    __slots__ = ("steps", "peers", "tmp", "tmp_msg", "ufunc", "nbytes", "sent", "recv", "status", "divisor", "call")

    def __init__(self, g, shape, dtype, op):
        self.steps = recursive_doubling_schedule(g.size, g.rank)
        # Only exchanges (N a power of two): the partners alone, for the lean loop.
        self.peers = tuple(p for _, p in self.steps) if all(k is EXCHANGE for k, _ in self.steps) else None
        self.tmp = np.empty(shape, dtype)  # the partner's vector lands here; small by construction
        self.tmp_msg = [self.tmp, BYTE]
        self.ufunc = reduction.UFUNCS[op]
        self.nbytes = self.tmp.nbytes
        self.sent = self.nbytes * sum(kind in (EXCHANGE, GIVE, RESULT_OUT) for kind, _ in self.steps)
        self.recv = self.nbytes * sum(kind in (EXCHANGE, TAKE, RESULT_IN) for kind, _ in self.steps)
        self.status = MPI.Status()
        self.divisor = g.size if op == "avg" and g.size > 1 else None
        self.call = stats.Call("all_reduce", g.name, shape, self.tmp.dtype)  # its recent-ops entry and counters

    def run(self, g, x, out):
        """The all-reduce of ``x``, or None when ``out`` doesn't fit (the general path then
        raises its clear error) or x is not contiguous."""
        t0 = _clock()
        if x.ndim > 1 and not x.flags.c_contiguous:  # e.g. x.T: MPI would send its bytes column-major
            return None
        acc = _all_reduce_result(x, out)
        if acc is None:
            return None
        try:
            if self.peers is not None:
                self._doubling(g, x, acc)
            else:
                self._general(g, x, acc)
        except BufferError:  # a strided 1-D x: MPI refused it before its first message; the general path copies it
            return None
        if self.divisor is not None:
            reduction.finish(acc, "avg", self.divisor, acc.dtype)
        stats.record_call(self.call, self.sent, self.recv, t0)
        return acc

    def _doubling(self, g, x, acc):
        """N a power of two: every round one Sendrecv with ``peer`` and one reduction.
        The first round sends and reduces x itself (no copy into acc first; x is only
        read), later ones acc, exactly as tree.recursive_doubling_all_reduce(..., x) does."""
        comm, status, tmp, tmp_msg, ufunc, nbytes = g.comm, self.status, self.tmp, self.tmp_msg, self.ufunc, self.nbytes
        mine, msg = x, [x, BYTE]
        peer = None
        try:
            for peer in self.peers:
                comm.Sendrecv(msg, peer, TAG, tmp_msg, peer, TAG, status)
                if status.Get_count(BYTE) != nbytes:
                    raise _fail("all_reduce", g, x, status, peer, nbytes)
                ufunc(mine, tmp, out=acc)
                mine = acc
                msg[0] = acc
        except MPI.Exception as err:
            raise _fail("all_reduce", g, x, status, peer, nbytes, err) from None

    def _general(self, g, x, acc):
        """Any N: the paired-up extra ranks give their vector away and get the result back."""
        comm, status, tmp, tmp_msg, ufunc, nbytes = g.comm, self.status, self.tmp, self.tmp_msg, self.ufunc, self.nbytes
        mine, msg = x, [x, BYTE]
        peer = None
        try:
            for kind, peer in self.steps:
                if kind is EXCHANGE:
                    comm.Sendrecv(msg, peer, TAG, tmp_msg, peer, TAG, status)
                elif kind is TAKE:
                    comm.Recv(tmp_msg, peer, TAG, status)
                elif kind is RESULT_IN:
                    comm.Recv([acc, BYTE], peer, TAG, status)
                else:  # GIVE or RESULT_OUT
                    comm.Send(msg, peer, TAG)
                    continue
                if status.Get_count(BYTE) != nbytes:
                    raise _fail("all_reduce", g, x, status, peer, nbytes)
                if kind is not RESULT_IN:
                    ufunc(mine, tmp, out=acc)
                    if mine is x:
                        mine, msg = acc, [acc, BYTE]
        except MPI.Exception as err:
            raise _fail("all_reduce", g, x, status, peer, nbytes, err) from None


def _all_reduce_result(x, out):
    """An all-reduce plan's result array: a fresh one, or ``out`` when it fits (C-contiguous:
    later rounds send from it; writeable, or numpy would raise between two messages); None
    (the general path raises the clear error, before any message) otherwise."""
    if out is None:
        return np.empty(x.shape, x.dtype)
    if (type(out) is np.ndarray and out.shape == x.shape and out.dtype is x.dtype and out.flags.c_contiguous
            and out.flags.writeable):
        return out
    return None
