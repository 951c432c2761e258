"""The all-to-all-v plan: the row counts ride just ahead of the rows, in one round (read
algorithms/oneshot.py's ``one_shot_all_to_all_v`` first: the same messages).

Both textbook forms wait for every count before they send a single row: pairwise.py's N-1
count steps, or oneshot.py's count round, and then the rows.  But a sender knows what it
sends from the start; only the *receiver* needs the counts, to size its result.  So this
plan posts at once the N-1 count receives, the N-1 count sends and the N-1 row sends; waits
for the counts alone; posts the N-1 row receives into a result of the right size; copies its
own block while the rows travel; and waits for the rest.  The rows leave with the counts
(small ones have arrived by the time their receive is posted: MPI holds them until then;
large ones have announced themselves), so a call waits twice, for the counts and for the
rest, where oneshot.py waits for two whole rounds and pairwise.py for 2(N-1) partners.

The messages are the textbook's -- between each pair, 8 bytes of count, then the rows, with
the same identity tag, in that order -- so ``comm.stats()`` and layout/expert_traffic.py read
the same, and ranks on either path still pair up (MPI keeps the order of two messages from
one rank to another on one communicator: a count receive, posted first, takes the count).

What a plan caches, per (group, dtype), is what does not change with the counts: the count
buffers on persistent requests (MPI 1.1's ``Send_init`` / ``Recv_init``: one ``Startall``),
the partners, the identity tag, the statuses.  The rows' requests are posted afresh each
call (their addresses and sizes change), each described as ``[array, (bytes, byte offset),
MPI.BYTE]``, so no NumPy view is made per message: each microsecond of Python costs a
call more than a microsecond on ranks that share cores (measured: docs/perf-notes.md,
"All-to-all-v").

Wrong input: counts that are not N non-negative ints summing to the rows, a 0-d or strided
``x``, go to the general path, which raises its clear error before any message.  Rows of
another trailing shape or dtype on another rank arrive with another size (or identity tag);
the round is completed first (nothing stays in flight), then the general path's error is
raised.  A count message of another collective altogether raises at once.
"""

from __future__ import annotations

import math

import numpy as np
from mpi4py import MPI

from minidist.comm import stats
from minidist.comm.algorithms.oneshot import peers
from minidist.comm.fast.common import BYTE, clock, mismatch_error, tags
from minidist.comm.fast.exchange import Exchange
from minidist.comm.identity import describe_tag
from minidist.comm.p2p import _size_error
from minidist.comm.p2p.rounds import check_tags, received

_startall, _waitall, _prod = MPI.Prequest.Startall, MPI.Request.Waitall, math.prod
COUNT = 8  # an int64 row count, as the general path sends it


class AllToAllVPlan:
    """``comm.all_to_all_v`` on a group, for rows of one dtype (any trailing shape, any counts)."""

    __slots__ = ("n", "rank", "comm", "name", "to", "peers", "tag", "rtag", "sent", "got", "counts", "count_recvs",
                 "count_sends", "first", "rest", "call", "pending")

    def __init__(self, g, dtype):
        n, r = g.size, g.rank
        self.n, self.rank, self.comm, self.name = n, r, g.comm, g.name
        self.to, frm = peers(n, r)
        self.peers = tuple(frm)  # the watchdog's report names them
        self.tag, self.rtag = tags("all_to_all_v", "", dtype)
        self.sent, self.got = np.zeros(n, np.int64), np.zeros(n, np.int64)
        self.counts = Exchange(g.comm, [(self.got[s:s + 1], s) for s in frm], [(self.sent[d:d + 1], d) for d in self.to],
                               tag=self.tag, rtag=self.rtag)
        self.count_recvs, self.count_sends = self.counts.reqs[:n - 1], self.counts.reqs[n - 1:]
        self.first = [MPI.Status() for _ in range(n - 1)]      # the count receives'
        self.rest = [MPI.Status() for _ in range(3 * (n - 1))]  # the row receives' first
        self.call = stats.Call("all_to_all_v", g.name, (), dtype)
        self.pending = None  # the sends of a call that raised at its counts, kept alive

    def run(self, g, x, counts):
        """``(rows received, counts received)``, or None: the general path takes the call."""
        t0 = clock()
        n, r = self.n, self.rank
        if type(counts) is np.ndarray and counts.ndim == 1 and counts.dtype.kind in "iu":
            counts = counts.tolist()
        elif type(counts) is not list:
            return None
        if len(counts) != n or not x.ndim or not x.flags.c_contiguous or self.counts.reqs is None:
            return None
        at, total = [0], 0
        for c in counts:
            if type(c) is not int or c < 0:
                return None
            total += c
            at.append(total)
        if total != x.shape[0]:
            return None
        row = x.itemsize * _prod(x.shape[1:])
        comm, tag, rtag = self.comm, self.tag, self.rtag
        self.sent[:] = counts
        _startall(self.counts.reqs)
        sends = [comm.Isend([x, (counts[d] * row, at[d] * row), BYTE], d, tag) for d in self.to]
        try:
            _waitall(self.count_recvs, self.first)
            failed = None
        except MPI.Exception as err:
            failed = err
        if failed is not None or not all(st.Get_count(BYTE) == COUNT and st.Get_tag() == tag for st in self.first):
            counted = received(self.first, self.count_recvs, n - 1, failed)
            self._count_error(x, sends, *counted)  # raises, or returns when the round can go on
        else:
            counted = None
        got = self.got
        got[r] = counts[r]
        back = got.tolist()
        into = [0]
        for c in back:
            into.append(into[-1] + c)
        out = np.empty((into[-1],) + x.shape[1:], x.dtype)
        reqs = [comm.Irecv([out, (back[s] * row, into[s] * row), BYTE], s, rtag) for s in self.peers]
        if counts[r]:
            out[into[r]:into[r + 1]] = x[at[r]:at[r + 1]]
        reqs += self.count_sends
        reqs += sends
        try:
            _waitall(reqs, self.rest)
            failed = None
        except MPI.Exception as err:  # a message longer than its receive: complete the round, then raise
            failed = err
        if failed is not None or counted is not None or \
                not all(st.Get_count(BYTE) == back[s] * row and st.Get_tag() == tag for st, s in zip(self.rest, self.peers)):
            self._rows_error(x, [back[s] * row for s in self.peers], counted, received(self.rest, reqs, n - 1, failed))
        sent = (total - counts[r]) * row + COUNT * (n - 1)
        stats.record_call(self._op(x), sent, (into[-1] - back[r]) * row + COUNT * (n - 1), t0)
        return out, got.copy()

    def _op(self, x):
        """The call's recent-ops entry and counters (its shape changes from call to call)."""
        call = self.call
        call.op = ("all_to_all_v", self.name, x.shape, x.dtype, "")
        return call

    def _count_error(self, x, sends, sizes, tags) -> None:
        """A count message of the wrong size or identity.  Another rank's all_to_all_v with
        rows of another dtype (its tag says so) sends its rows after it: the round goes on,
        and :meth:`_rows_error` raises the mismatch.  Anything else raises now; the rows sent
        stay in flight (kept alive here), and the abort hook of comm.world() ends the job."""
        for s, got, tag in zip(self.peers, sizes, tags):
            if got != COUNT or not describe_tag(tag).startswith("all_to_all_v("):
                self.pending = (x, sends)
                stats.note_op("all_to_all_v", self.name, x.shape, x.dtype)
                if tag != self.tag:
                    raise mismatch_error(self.comm, s, self.tag, tag, got, COUNT)
                raise _size_error(self.comm, s, self.tag, COUNT, got, "all_to_all_v counts")

    def _rows_error(self, x, want, counted, rows) -> None:
        """The round is complete; raise the general path's error for its first wrong message:
        another call's identity (a count's first: the cause), else a wrong size."""
        stats.note_op("all_to_all_v", self.name, x.shape, x.dtype)
        for (sizes, tags), expected in ((counted or ([], [])), COUNT), (rows, None):
            check_tags(self.comm, self.peers, self.tag, tags, sizes, expected)
        for s, got, expected in zip(self.peers, rows[0], want):
            if got != expected:
                raise _size_error(self.comm, s, self.tag, expected, got, "all_to_all_v rows")

    def close(self) -> None:
        self.counts.close()
