"""Cached reduce-scatter plans: the one-shot exchange, the ring, recursive halving and the
pairwise exchange of the general path with the per-call Python pared down (read
fast/__init__.py first: when plans are made and used, and why they pay).

Every plan gives exactly the general path's answer (the same additions in the same order)
and sends the same messages, each step's from the algorithm's own schedule; it takes
``out=``; a strided 1-D x is refused by MPI (BufferError) before the first message, and the
plan hands the call back to the general path.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from mpi4py import MPI

from minidist.comm import reduction, stats
from minidist.layout.split import split_bounds
from minidist.comm.algorithms.doubling import halving_steps
from minidist.comm.algorithms.oneshot import add_in_rank_order, operands, peers
from minidist.comm.algorithms.pairwise import pairwise_steps
from minidist.comm.algorithms.ring import ring_steps
from minidist.comm.fast.common import BYTE, TAG, clock, fail, result_array, tags
from minidist.comm.fast.exchange import Exchange
from minidist.comm.p2p import _size_error


class _ScatterPlan:
    """What every reduce-scatter plan knows: this rank's part (shape and dtype), every
    rank's block of the flat vector (``bounds``, in elements), how to reduce (ufunc, the
    divisor of "avg"), and its recent-ops entry and counters.

    :meth:`run` is that of the ring, halving and pairwise plans: each gives only
    :meth:`reduce`, its loop of messages (DirectScatterPlan has a run of its own)."""

    __slots__ = ("shape", "one_d", "bounds", "dtype", "ufunc", "divisor", "status", "call", "tag", "rtag", "sent",
                 "recv")
    ALGORITHM = None  # what the general path calls the algorithm the plan runs (in its identity tag)

    def __init__(self, g, shape, dtype, op, name="reduce_scatter"):
        first, last = split_bounds(shape[0], g.size)[g.rank]  # in rows, as the general path
        self.shape = (last - first,) + tuple(shape[1:])
        self.bounds = split_bounds(shape[0], g.size, math.prod(shape[1:]))
        self.one_d = len(shape) == 1
        self.dtype, self.ufunc, self.status = np.dtype(dtype), reduction.UFUNCS[op], MPI.Status()
        self.divisor = g.size if op == "avg" and g.size > 1 else None
        self.call = stats.Call("reduce_scatter", g.name, shape, self.dtype)
        # The identity of the call whose messages these are (an all-reduce's, for its reduce-scatter half).
        self.tag, self.rtag = tags(name, op, self.dtype, math.prod(shape) * self.dtype.itemsize, self.ALGORITHM)

    def result(self, out):
        """common.result_array for this rank's part."""
        return result_array(out, self.shape, self.dtype)

    def run(self, g, x, out=None):
        """This rank's part, or None when ``out`` doesn't fit (the general path then
        raises its clear error) or x is a strided 1-D array (MPI refuses to send it:
        BufferError before the first message; an N-D x is flattened, i.e. copied to C
        order when it is not already)."""
        t0 = clock()
        result = self.result(out)
        if result is None:
            return None
        try:  # 1-D arrays skip the reshape: it costs as much as a small add
            self.reduce(g, x, x if self.one_d else x.reshape(-1), result if self.one_d else result.reshape(-1))
        except BufferError:  # only the first Sendrecv sends from x
            return None
        return self.finish(result, self.sent, self.recv, t0)

    def finish(self, result, sent, received, t0):
        if self.divisor is not None:
            reduction.finish(result, "avg", self.divisor, result.dtype)
        stats.record_call(self.call, sent, received, t0)
        return result


class _BoundInput(NamedTuple):
    """Persistent requests bound to a caller's x: x, the round, the blocks to add."""
    x: np.ndarray
    exchange: Exchange
    operands: list


class DirectScatterPlan(_ScatterPlan):
    """oneshot.one_shot_reduce_scatter for one small (shape, dtype, op), the round as persistent
    requests (Exchange: one ``Startall``, one ``Waitall``), then the N copies of
    this rank's block added in rank order: the general path's additions in its order.

    The sends start on a buffer of the plan's own, into which a call copies x.  When the
    same x array comes twice in a row (a gradient buffer), the plan binds a second set of
    requests to it, and later calls with that very array send from it without the copy
    (one array bound at a time, kept alive by the requests; small arrays only)."""

    __slots__ = ("src", "exchange", "operands", "expect", "stage", "bound", "seen", "fit")
    ALGORITHM = "direct"

    def __init__(self, g, shape, dtype, op):
        super().__init__(g, shape, dtype, op)
        n, r = g.size, g.rank
        lo, hi = self.bounds[r]
        self.stage = np.empty((n - 1, hi - lo), dtype)
        self.src = np.empty(shape, dtype)  # x is copied here, whatever its memory layout
        self.exchange, self.operands = self._exchange(g, self.src.reshape(-1))
        self.expect = self.stage[0].nbytes
        self.sent = (self.bounds[-1][1] - (hi - lo)) * self.stage.itemsize
        self.recv = self.stage.nbytes
        self.bound = self.seen = None  # a _BoundInput or None; the x of the last call that copied
        self.fit = None  # the last out found to fit and to lie outside the bound x

    def _exchange(self, g, flat):
        """The round sending from flat, and the operands to add (this rank's from flat)."""
        bounds, stage, n, r = self.bounds, self.stage, g.size, g.rank
        to, frm = peers(n, r)
        exchange = Exchange(g.comm, [(stage[k], s) for k, s in enumerate(frm)],
                            [(flat[bounds[d][0]:bounds[d][1]], d) for d in to], tag=self.tag, rtag=self.rtag)
        return exchange, operands(stage, frm, flat[bounds[r][0]:bounds[r][1]], r)

    def run(self, g, x, out=None):
        """This rank's part, or None when ``out`` doesn't fit (the general path then raises
        its clear error)."""
        t0 = clock()
        bound = self.bound
        # The bound lane (the 4 KB path of a training loop): every check here is paid many
        # times over on oversubscribed ranks (docs/perf-notes.md, "Per-call costs"), so an
        # out that passed the checks once is remembered.
        if bound is not None and bound.x is x and (out is None or out is self.fit and out.shape == self.shape
                                                   and out.flags.writeable or self._fits_bound(out, x)):
            result = np.empty(self.shape, self.dtype) if out is None else out
            wrong, operands = bound.exchange.run(self.expect), bound.operands
        else:
            result = self.result(out)
            if result is None:
                return None
            self.src[...] = x
            wrong, operands = self.exchange.run(self.expect), self.operands
            self._bind(g, x)
        if wrong is not None:
            stats.note_op("reduce_scatter", g.name, x.shape, x.dtype)
            raise _size_error(g.comm, wrong[0], TAG, self.expect, wrong[1], "reduce_scatter")
        add_in_rank_order(self.ufunc, operands, result if self.one_d else result.reshape(-1))
        if self.divisor is not None:  # self.finish, inlined (see above)
            reduction.finish(result, "avg", self.divisor, result.dtype)
        stats.record_call(self.call, self.sent, self.recv, t0)
        return result

    def _fits_bound(self, out, x) -> bool:
        """May the bound lane write into ``out``: does it fit, and lie outside x?  (The bound
        lane adds x's own block straight from x: in place, with out inside x, the first add
        would overwrite it; the copying lane reads the copy.)"""
        if self.result(out) is None or np.may_share_memory(out, x):
            return False
        self.fit = out
        return True

    def _bind(self, g, x):
        """Bind requests to x if it came in the previous call too (and is C-contiguous)."""
        seen, self.seen = self.seen, x
        if seen is not x or not x.flags.c_contiguous:
            return
        self.close_bound()
        self.bound, self.seen, self.fit = _BoundInput(x, *self._exchange(g, x.reshape(-1))), None, None

    def close_bound(self) -> None:
        if self.bound is not None:
            self.bound.exchange.close()
            self.bound = None

    def close(self) -> None:
        self.exchange.close()
        self.close_bound()
        self.seen = None


class ReduceScatterPlan(_ScatterPlan):
    """Ring reduce-scatter (ring.ring_steps; pipelined.pipelined_ring_reduce_scatter) of one small (shape, dtype, op),
    every step a single Sendrecv (no pipeline chunks: the whole message fits in cache)."""

    __slots__ = ("steps", "first", "right", "left")
    ALGORITHM = "pipelined_ring"

    def __init__(self, g, shape, dtype, op):
        super().__init__(g, shape, dtype, op)
        n, r, bounds = g.size, g.rank, self.bounds
        biggest = max(b - a for a, b in bounds)
        tmp = np.empty(biggest, dtype)
        partial = [np.empty(biggest, dtype), np.empty(biggest, dtype)]
        # Step s: send block (r-s-1) [x's own part at s=0, then the partial sum just made],
        # receive block (r-s-2)'s partial from the left into tmp, add x's part of it into
        # a partial buffer (or, in the last step, the result).  Views and MPI descriptors
        # of the plan's own buffers are made here, once: per step (x's part to add, the
        # receive view and descriptor, its size, where the sum goes [None: the result],
        # and the descriptor of the next step's message: that sum).
        schedule = ring_steps(n, r, "reduce_scatter")
        self.first = bounds[schedule[0][0]]  # the step-0 message: x's own part of that block
        self.steps = []
        for s, (_, b) in enumerate(schedule):
            ra, rb = bounds[b]
            got = tmp[:rb - ra]
            dest = None if s == n - 2 else partial[s % 2][:rb - ra]
            self.steps.append((ra, rb, got, [got, BYTE], got.nbytes, dest, None if dest is None else [dest, BYTE]))
        self.steps = tuple(self.steps)
        self.sent = sum(bounds[b][1] - bounds[b][0] for b, _ in schedule) * tmp.itemsize
        self.recv = sum(rb - ra for ra, rb, *_ in self.steps) * tmp.itemsize
        self.right, self.left = (r + 1) % n, (r - 1) % n

    def reduce(self, g, x, flat, into):
        """The ring's steps: this rank's block of the reduction of every rank's ``flat``
        lands in ``into``."""
        comm, status, ufunc, right, left, tag, rtag = g.comm, self.status, self.ufunc, self.right, self.left, self.tag, self.rtag
        sa, sb = self.first
        msg = [flat[sa:sb], BYTE]
        nbytes = 0
        try:
            for ra, rb, got, got_msg, nbytes, dest, next_msg in self.steps:
                comm.Sendrecv(msg, right, tag, got_msg, left, rtag, status)
                if status.Get_count(BYTE) != nbytes or status.Get_tag() != tag:
                    raise fail("reduce_scatter", g, x, status, left, nbytes, None, tag)
                ufunc(flat[ra:rb], got, out=into if dest is None else dest)
                msg = next_msg
        except MPI.Exception as err:
            raise fail("reduce_scatter", g, x, status, left, nbytes, err, tag) from None


class HalvingPlan(_ScatterPlan):
    """Recursive-halving reduce-scatter (doubling.recursive_halving_reduce_scatter) of one small
    (shape, dtype, op) on 4, 8, 16, ... ranks, with the plan's own partial-sum buffer.

    Round 0 sends x's half the partner keeps and adds the received half into ``acc``;
    later rounds send a prefix or suffix of acc and add in place; the last adds into the
    result.  All the acc views and MPI descriptors are made once, here, so a round is one
    Sendrecv, one size check and one ufunc, the same additions in the same order as the
    general path (bit-identical results).
    """

    __slots__ = ("first", "rounds")
    ALGORITHM = "halving"

    def __init__(self, g, shape, dtype, op):
        super().__init__(g, shape, dtype, op)
        steps = halving_steps(g.size, g.rank, self.bounds)
        peer, s_lo, s_hi, k_lo, k_hi = steps[0]
        acc, tmp = np.empty(k_hi - k_lo, dtype), np.empty(k_hi - k_lo, dtype)
        base = k_lo  # acc[0] is element k_lo of the flat vector
        # Round 0 reads x: (peer, x's send range, x's kept range, receive view and descriptor, size, sum into).
        got = tmp[:k_hi - k_lo]
        self.first = (peer, s_lo, s_hi, k_lo, k_hi, got, [got, BYTE], got.nbytes, acc[:k_hi - k_lo])
        # Later rounds: (peer, send descriptor, receive view and descriptor, size, kept part of acc).
        rounds = []
        for peer, s_lo, s_hi, k_lo, k_hi in steps[1:]:
            got = tmp[:k_hi - k_lo]
            rounds.append((peer, [acc[s_lo - base:s_hi - base], BYTE], got, [got, BYTE], got.nbytes,
                           acc[k_lo - base:k_hi - base]))
        self.rounds = tuple(rounds)
        itemsize = np.dtype(dtype).itemsize
        self.sent = sum(s_hi - s_lo for _, s_lo, s_hi, _, _ in steps) * itemsize
        self.recv = sum(k_hi - k_lo for _, _, _, k_lo, k_hi in steps) * itemsize

    def reduce(self, g, x, flat, last_into):
        """The rounds: this rank's block of the reduction of every rank's ``flat`` lands
        in ``last_into``."""
        comm, status, ufunc, tag, rtag = g.comm, self.status, self.ufunc, self.tag, self.rtag
        peer, s_lo, s_hi, k_lo, k_hi, got, got_msg, nbytes, into = self.first
        try:
            comm.Sendrecv([flat[s_lo:s_hi], BYTE], peer, tag, got_msg, peer, rtag, status)
            if status.Get_count(BYTE) != nbytes or status.Get_tag() != tag:
                raise fail("reduce_scatter", g, x, status, peer, nbytes, None, tag)
            ufunc(flat[k_lo:k_hi], got, out=into)
            last = len(self.rounds) - 1
            for i, (peer, msg, got, got_msg, nbytes, mine) in enumerate(self.rounds):
                comm.Sendrecv(msg, peer, tag, got_msg, peer, rtag, status)
                if status.Get_count(BYTE) != nbytes or status.Get_tag() != tag:
                    raise fail("reduce_scatter", g, x, status, peer, nbytes, None, tag)
                ufunc(mine, got, out=last_into if i == last else mine)
        except MPI.Exception as err:
            raise fail("reduce_scatter", g, x, status, peer, nbytes, err, tag) from None


class PairwisePlan(_ScatterPlan):
    """pairwise.pairwise_reduce_scatter of one (shape, dtype, op) on more than two ranks, for
    blocks of at most one pipeline chunk (then the general path does one Sendrecv a step
    too): per step one Sendrecv straight from x and one ufunc into the result, the same
    additions in the same order.  Worth it at 1 MB on oversubscribed ranks
    (docs/perf-notes.md, "Pairwise plans")."""

    __slots__ = ("mine", "steps", "tmp", "tmp_msg", "nbytes")
    ALGORITHM = "pairwise"

    def __init__(self, g, shape, dtype, op, name="reduce_scatter"):
        super().__init__(g, shape, dtype, op, name)
        n, r, bounds = g.size, g.rank, self.bounds
        self.mine = bounds[r]
        self.tmp = np.empty(bounds[r][1] - bounds[r][0], dtype)
        self.tmp_msg, self.nbytes = [self.tmp, BYTE], self.tmp.nbytes
        # Step k: (rank to send to, x's block for it, rank to receive from).
        self.steps = tuple((dst, *bounds[dst], src) for dst, src in pairwise_steps(n, r))
        self.sent = sum(b - a for _, a, b, _ in self.steps) * self.tmp.itemsize
        self.recv = (n - 1) * self.nbytes

    def reduce(self, g, x, flat, into, what="reduce_scatter"):
        """The steps: this rank's block of the reduction of every rank's ``flat`` lands in
        ``into``.  A strided x raises BufferError at the first Sendrecv, before any message."""
        comm, status, tmp, tmp_msg, ufunc, nbytes = g.comm, self.status, self.tmp, self.tmp_msg, self.ufunc, self.nbytes
        tag, rtag = self.tag, self.rtag
        lo, hi = self.mine
        acc, src = flat[lo:hi], None
        try:
            for dst, a, b, src in self.steps:
                comm.Sendrecv([flat[a:b], BYTE], dst, tag, tmp_msg, src, rtag, status)
                if status.Get_count(BYTE) != nbytes or status.Get_tag() != tag:
                    raise fail(what, g, x, status, src, nbytes, None, tag)
                ufunc(acc, tmp, out=into)
                acc = into
        except MPI.Exception as err:
            raise fail(what, g, x, status, src, nbytes, err, tag) from None
