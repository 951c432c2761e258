"""Cached all-reduce plans: recursive doubling for small messages, and the pairwise
reduce-scatter + all-gather while every block is one pipeline chunk (read fast/__init__.py
first: when plans are made and used, and why they pay)."""

from __future__ import annotations

import math

import numpy as np
from mpi4py import MPI

from minidist.comm import reduction, stats
from minidist.layout.split import split_bounds
from minidist.comm.algorithms.doubling import (EXCHANGE, GIVE, RESULT_IN, RESULT_OUT, TAKE, doubling_gather_steps,
                                               recursive_doubling_schedule)
from minidist.comm.algorithms.ring import ring_steps
from minidist.comm.fast.common import BYTE, clock, fail, result_array, tags
from minidist.comm.fast.scatter import PairwisePlan


class AllReducePlan:
    """Recursive doubling (doubling.recursive_doubling_schedule) of one (shape, dtype, op).

    Per call: log2(N) rounds of Sendrecv + ufunc into a fresh result (or ``out``), the first
    reading x directly (two more rounds when N is not a power of two), then the division for "avg".
    """

    __slots__ = ("steps", "tmp", "tmp_msg", "ufunc", "nbytes", "sent", "recv", "status", "divisor", "call",
                 "tag", "rtag")

    def __init__(self, g, shape, dtype, op):
        self.steps = recursive_doubling_schedule(g.size, g.rank)
        self.tmp = np.empty(shape, dtype)  # the partner's vector lands here; small by construction
        self.tmp_msg = [self.tmp, BYTE]
        self.ufunc = reduction.UFUNCS[op]
        self.nbytes = self.tmp.nbytes
        self.sent = self.nbytes * sum(kind in (EXCHANGE, GIVE, RESULT_OUT) for kind, _ in self.steps)
        self.recv = self.nbytes * sum(kind in (EXCHANGE, TAKE, RESULT_IN) for kind, _ in self.steps)
        self.status = MPI.Status()
        self.divisor = g.size if op == "avg" and g.size > 1 else None
        self.call = stats.Call("all_reduce", g.name, shape, self.tmp.dtype)  # its recent-ops entry and counters
        # The general path's identity for the same call.
        self.tag, self.rtag = tags("all_reduce", op, self.tmp.dtype, self.nbytes, "recursive_doubling")

    def run(self, g, x, out):
        """The all-reduce of ``x``, or None when ``out`` doesn't fit (the general path then
        raises its clear error) or x is not contiguous."""
        t0 = clock()
        if x.ndim > 1 and not x.flags.c_contiguous:  # e.g. x.T: MPI would send its bytes column-major
            return None
        acc = result_array(out, x.shape, x.dtype)
        if acc is None:
            return None
        try:
            self._general(g, x, acc)
        except BufferError:  # a strided 1-D x: MPI refused it before its first message; the general path copies it
            return None
        if self.divisor is not None:
            reduction.finish(acc, "avg", self.divisor, acc.dtype)
        stats.record_call(self.call, self.sent, self.recv, t0)
        return acc

    def _general(self, g, x, acc):
        """Any N: the paired-up extra ranks give their vector away and get the result back.
        The first round sends and reduces x itself (no copy into acc first; x is only
        read), later ones acc, exactly as doubling.recursive_doubling_all_reduce(..., x) does."""
        comm, status, tmp, tmp_msg, ufunc, nbytes = g.comm, self.status, self.tmp, self.tmp_msg, self.ufunc, self.nbytes
        tag, rtag = self.tag, self.rtag
        mine, msg = x, [x, BYTE]
        peer = None
        try:
            for kind, peer in self.steps:
                if kind is EXCHANGE:
                    comm.Sendrecv(msg, peer, tag, tmp_msg, peer, rtag, status)
                elif kind is TAKE:
                    comm.Recv(tmp_msg, peer, rtag, status)
                elif kind is RESULT_IN:
                    comm.Recv([acc, BYTE], peer, rtag, status)
                else:  # GIVE or RESULT_OUT
                    comm.Send(msg, peer, tag)
                    continue
                if status.Get_count(BYTE) != nbytes or status.Get_tag() != tag:
                    raise fail("all_reduce", g, x, status, peer, nbytes, None, tag)
                if kind is not RESULT_IN:
                    ufunc(mine, tmp, out=acc)
                    if mine is x:
                        mine, msg = acc, [acc, BYTE]
        except MPI.Exception as err:
            raise fail("all_reduce", g, x, status, peer, nbytes, err, tag) from None


class PairwiseAllReducePlan:
    """The general path's pairwise all-reduce (reducing.pairwise_all_reduce) of one (shape,
    dtype, op) whose blocks fit one pipeline chunk: the steps of a :class:`PairwisePlan`
    over the flat vector into this rank's block of the result, then the in-place all-gather
    (recursive doubling on 2, 4, 8, ... ranks, the ring otherwise), every round one
    Sendrecv on precomputed ranges of the flat result."""

    __slots__ = ("scatter", "rounds", "itemsize", "sent", "recv", "call", "tag", "rtag")

    def __init__(self, g, shape, dtype, op):
        size = math.prod(shape)
        self.scatter = PairwisePlan(g, (size,), dtype, op, "all_reduce")  # its divisor applies to the whole result
        self.rounds = gather_rounds(g.size, g.rank, split_bounds(size, g.size))
        self.itemsize = np.dtype(dtype).itemsize
        self.sent = self.scatter.sent + self.itemsize * sum(hi - lo for _, lo, hi, *_ in self.rounds)
        self.recv = self.scatter.recv + self.itemsize * sum(b - a for *_, a, b in self.rounds)
        self.call = stats.Call("all_reduce", g.name, shape, np.dtype(dtype))
        self.tag, self.rtag = self.scatter.tag, self.scatter.rtag

    def run(self, g, x, out):
        """As AllReducePlan.run (an N-D x in Fortran order is flattened, i.e. copied, first)."""
        t0 = clock()
        acc = result_array(out, x.shape, x.dtype)
        if acc is None:
            return None
        flat, res = x.reshape(-1), acc.reshape(-1)
        lo, hi = self.scatter.mine
        try:
            self.scatter.reduce(g, x, flat, res[lo:hi], "all_reduce")
        except BufferError:  # only the first Sendrecv can meet a strided x
            return None
        comm, status, src, nbytes, tag, rtag = g.comm, self.scatter.status, None, 0, self.tag, self.rtag
        try:
            for dst, a, b, src, c, d in self.rounds:
                nbytes = (d - c) * self.itemsize
                comm.Sendrecv([res[a:b], BYTE], dst, tag, [res[c:d], BYTE], src, rtag, status)
                if status.Get_count(BYTE) != nbytes or status.Get_tag() != tag:
                    raise fail("all_reduce", g, x, status, src, nbytes, None, tag)
        except MPI.Exception as err:
            raise fail("all_reduce", g, x, status, src, nbytes, err, tag) from None
        divisor = self.scatter.divisor
        if divisor is not None:
            reduction.finish(acc, "avg", divisor, acc.dtype)
        stats.record_call(self.call, self.sent, self.recv, t0)
        return acc


def gather_rounds(n, r, bounds) -> tuple:
    """The in-place all-gather of the pairwise all-reduce as (dest, send lo, send hi, source,
    receive lo, receive hi) element ranges, from the algorithms' own schedules: recursive
    doubling on 2, 4, 8, ... ranks, the ring otherwise (the same messages in the same order)."""
    if n & (n - 1) == 0:
        return tuple((peer, bounds[s0][0], bounds[s1 - 1][1], peer, bounds[r0][0], bounds[r1 - 1][1])
                     for peer, (s0, s1), (r0, r1) in doubling_gather_steps(n, r))
    return tuple(((r + 1) % n, *bounds[s], (r - 1) % n, *bounds[b]) for s, b in ring_steps(n, r, "all_gather"))
