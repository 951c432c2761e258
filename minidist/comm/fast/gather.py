"""Cached all-gather plans: the general path's algorithms with the per-call Python pared down
(read fast/__init__.py first: when plans are made and used, and why they pay).

A plan runs later calls with the same algorithm and the same messages as the general path,
so results are bit-identical:

* :class:`PairGatherPlan` (2 ranks): pairwise.pair_all_gather, one ``Sendrecv``, the peer's
  row count read from the message size;
* :class:`BruckGatherPlan` (more ranks): bruck.bruck_all_gather_rows, every record = a row
  count followed by the rows, ceil(log2 N) rounds;
* :class:`EvenGatherPlan`: evengather.even_all_gather (doubling or ring), straight from
  ``out`` to ``out``;
* directgather.DirectGatherPlan: the one-shot round on persistent requests.

What a plan saves is everything that depends only on the shape: row sizes, partners, the
packing buffer with this rank's row count already written into it, the MPI status.  Row
counts still come from the messages every call, so ranks whose blocks differ by a row (each
with its own plan) still gather right, and a broken row rule raises the general path's
errors.
"""

from __future__ import annotations

import math
import struct

import numpy as np
from mpi4py import MPI

from minidist.comm import stats
from minidist.comm.algorithms import evengather
from minidist.comm.algorithms.blocks import partial_rows_error, rows_error
from minidist.comm.algorithms.bruck import bruck_steps, read_records, records_error, unpack_records
from minidist.comm.errors import CommError
from minidist.comm.fast.common import ANY_TAG, BYTE, mismatch_error, tags

_COUNT = struct.Struct("=q")  # a record's row count: native int64, as the general path writes it


class _GatherPlan:
    """What every all-gather plan knows: the block and row sizes, the group, and the ``out=``
    it was made for (plans are cached per (x shape, dtype, out shape), None meaning no out)."""

    __slots__ = ("rows", "tail", "row_bytes", "nbytes", "dtype", "status", "comm", "rank", "n", "name", "call",
                 "out_shape", "tag", "rtag")
    ALGORITHM = None  # set by each plan (EvenGatherPlan: its tags per instance)

    def __init__(self, g, shape, dtype, out=None):
        self.out_shape = None if out is None else out.shape
        self.rows, self.tail, self.dtype = shape[0], tuple(shape[1:]), np.dtype(dtype)
        self.row_bytes = math.prod(self.tail) * self.dtype.itemsize
        self.nbytes = self.rows * self.row_bytes
        self.status, self.comm, self.rank, self.n, self.name = MPI.Status(), g.comm, g.rank, g.size, g.name
        self.call = stats.Call("all_gather", g.name, shape, self.dtype)  # its recent-ops entry and counters
        # No size (row counts may differ by one); the algorithm the general path calls what the plan runs.
        self.tag, self.rtag = tags("all_gather", "", self.dtype, None, self.ALGORITHM)

    def check_tag(self, peer, err=None) -> None:
        """Raise CollectiveMismatchError if the message just received (or truncated: ``err``)
        belongs to another call."""
        if err is not None and err.Get_error_class() != MPI.ERR_TRUNCATE:
            return
        got = self.status.Get_tag()
        if got != self.tag:
            stats.note_op("all_gather", self.name, (self.rows,) + self.tail, self.dtype)
            nbytes = f"more than {self.status.Get_count(BYTE)}" if err is not None else self.status.Get_count(BYTE)
            raise mismatch_error(self.comm, peer, self.tag, got, nbytes)

    def fits(self, out) -> bool:
        """Is ``out`` what the plan was made for: None, or a NumPy array of exactly that shape
        and dtype?  Otherwise the general path takes the call (and raises its clear error
        about a wrong out).  Non-contiguous arrays are caught later: MPI raises BufferError
        before sending from or into a strided one (the pair plan, which also checks that an
        N-D x is not Fortran-ordered, as MPI would send that as it is), or the plan checks
        ``out.flags`` (the others, which view out as blocks).  Each check here costs a
        measurable part of a 4 KB call."""
        return out is None or (type(out) is np.ndarray and out.shape == self.out_shape and out.dtype is self.dtype
                               and out.flags.writeable)


class PairGatherPlan(_GatherPlan):
    """pairwise.pair_all_gather with the row size and partner precomputed, and with ``out=``
    (whose shape the plan was made for) the slices of out to receive into and copy x to,
    and the size of the expected message: a call is then one Sendrecv, one size check and
    one copy."""

    __slots__ = ("peer", "room", "own", "expect")
    ALGORITHM = "pair"

    def __init__(self, g, shape, dtype, out=None):
        super().__init__(g, shape, dtype, out)
        rows, r, self.peer = self.rows, self.rank, 1 - self.rank
        if out is not None:  # the peer has out.shape[0] - rows rows, or the call fails
            theirs = out.shape[0] - rows
            self.room = slice(rows, None) if r == 0 else slice(0, max(theirs, 0))
            self.own = slice(0, rows) if r == 0 else slice(max(theirs, 0), None)
            self.expect = theirs * self.row_bytes

    def run(self, g, x, out):
        """The gathered array, or None when the general path must take the call.  Without
        out=, the result is a view of a fresh buffer one row longer than needed, as the peer
        may have a row more (pairwise.pair_all_gather)."""
        if x.ndim > 1 and not x.flags.c_contiguous:  # e.g. x.T: MPI would send its bytes column-major
            return None
        t0 = stats._clock()
        rows, r = self.rows, self.rank
        if out is None:
            buf = np.empty((2 * rows + 1,) + self.tail, self.dtype)
            room = buf[rows:] if r == 0 else buf[:rows + 1]
        elif self.fits(out):
            room = out[self.room]
        else:
            return None
        status, peer = self.status, self.peer
        try:
            self.comm.Sendrecv([x, BYTE], peer, self.tag, [room, BYTE], peer, self.rtag, status)
        except BufferError:  # x or out is strided: nothing was sent, the general path copies x or rejects out
            return None
        except MPI.Exception as err:
            self.check_tag(peer, err)
            raise _mpi_error(g, err) or rows_error(g, rows, f"a block longer than the {room.shape[0]} rows "
                                                            "of room", out) from None
        nbytes = status.Get_count(BYTE)
        # Without out=, the size says how many rows the peer had; with it, they were known.
        if out is None or nbytes != self.expect or status.Get_tag() != self.tag:
            self.check_tag(peer)
            theirs, odd = divmod(nbytes, self.row_bytes)
            if odd or abs(theirs - rows) > 1:  # the general path words each error
                return self._fail(g, x, out, nbytes, theirs, odd)
            if out is not None:
                raise ValueError(f"all_gather: out.shape={out.shape} but the result has shape "
                                 f"{(rows + theirs,) + self.tail}")
            result, own = buf[:rows + theirs], (slice(0, rows) if r == 0 else slice(theirs, None))
        else:
            result, own = out, self.own
        result[own] = x
        stats.record_call(self.call, self.nbytes, nbytes, t0)
        return result

    def _fail(self, g, x, out, nbytes, theirs, odd):
        stats.note_op("all_gather", self.name, x.shape, self.dtype)
        if odd:
            raise partial_rows_error(self.name, self.peer, nbytes, self.tail, self.dtype, self.row_bytes)
        raise rows_error(g, self.rows, f"{theirs} rows", out)


class BruckGatherPlan(_GatherPlan):
    """bruck.bruck_all_gather_rows with a packing buffer of its own, this rank's row count
    already in its first 8 bytes (receives land after this rank's record, never on it).

    Two lanes.  While every record holds ``rows`` rows (the usual case: equal shards) the
    records sit at fixed offsets, so each round's send and receive descriptors, the size to
    expect and where the counts lie are all precomputed, and the rows reach the output in
    two copies (the records are in rank order r, r+1, ..., so the output is their rotation).
    The first record of another size hands the call to :meth:`_walk`, the general path's
    record-by-record loop, from that round on: same messages, so ranks on either lane agree.
    """

    __slots__ = ("buf", "own", "record", "rounds", "full_shape", "blocks_shape", "front", "back")
    ALGORITHM = "bruck"

    def __init__(self, g, shape, dtype, out=None):
        super().__init__(g, shape, dtype, out)
        n, r, rows = self.n, self.rank, self.rows
        buf = self.buf = np.empty(n * (8 + (rows + 1) * self.row_bytes), np.uint8)
        buf[:8].view(np.int64)[0] = rows
        self.own = buf[8:8 + self.nbytes].view(self.dtype).reshape(shape)
        rec = self.record = 8 + self.nbytes
        # Per round: records to send, send to, receive from, and for the even lane the send
        # and receive descriptors, the bytes to expect and the offsets of the counts.
        self.rounds = tuple((cnt, dest, source, [buf[:cnt * rec], BYTE], [buf[have * rec:], BYTE], cnt * rec,
                             tuple(have * rec + j * rec for j in range(cnt)))
                            for have, cnt, dest, source in bruck_steps(n, r))
        self.full_shape = (n * rows,) + self.tail
        self.blocks_shape = (n, rows) + self.tail
        # The rows of every record, as an (n, rows, *tail) view of buf: position j is rank (r+j)%n.
        blocks = buf[:n * rec].reshape(n, rec)[:, 8:].view(self.dtype).reshape(self.blocks_shape)
        self.front, self.back = blocks[:n - r], blocks[n - r:]  # ranks r..n-1, then 0..r-1

    def run(self, g, x, out):
        """The gathered array, or None when the general path must take the call."""
        if not self.fits(out) or (out is not None and not out.flags.c_contiguous):
            return None
        t0 = stats._clock()
        buf, comm, status, rows, tag, rtag = self.buf, self.comm, self.status, self.rows, self.tag, self.rtag
        self.own[...] = x
        unpack = _COUNT.unpack_from
        sent = received = 0
        for k, (cnt, dest, source, send_msg, recv_msg, expect, heads) in enumerate(self.rounds):
            try:
                comm.Sendrecv(send_msg, dest, tag, recv_msg, source, rtag, status)
            except MPI.Exception as err:
                self.check_tag(source, err)
                raise self._fail(g, _mpi_error(g, err) or rows_error(
                    g, rows, f"more than {buf.nbytes - heads[0]} bytes of records")) from None
            if status.Get_tag() != tag:
                self.check_tag(source)
            nbytes = status.Get_count(BYTE)
            sent, received = sent + expect, received + nbytes
            even = nbytes == expect
            for h in heads:
                even = even and unpack(buf, h)[0] == rows
            if not even:
                return self._walk(g, x, out, k, nbytes, sent, received, t0)
        if out is None:
            out = np.empty(self.full_shape, self.dtype)
        elif out.shape != self.full_shape:
            raise ValueError(f"all_gather: out.shape={out.shape} but the result has shape {self.full_shape}")
        blocks = out.reshape(self.blocks_shape)
        r = self.rank
        blocks[r:] = self.front
        if r:
            blocks[:r] = self.back
        stats.record_call(self.call, sent, received, t0)
        return out

    def _walk(self, g, x, out, k, nbytes, sent, received, t0):
        """The general record walk, from round ``k`` (whose ``nbytes`` just arrived) on."""
        buf, comm, status, rows, row_bytes, rec = self.buf, self.comm, self.status, self.rows, self.row_bytes, self.record
        have = sum(cnt for cnt, *_ in self.rounds[:k]) + 1
        starts, counts = [j * rec for j in range(have)], [rows] * have  # the even rounds so far
        end = have * rec
        bad = None
        for cnt, dest, source, *_ in self.rounds[k:]:
            if len(counts) > have:  # a later round: send this round's prefix, receive
                have = len(counts)
                outgoing = buf[:starts[cnt] if cnt < have else end]
                try:
                    comm.Sendrecv([outgoing, BYTE], dest, self.tag, [buf[end:], BYTE], source, self.rtag, status)
                except MPI.Exception as err:
                    self.check_tag(source, err)
                    raise self._fail(g, _mpi_error(g, err) or rows_error(
                        g, rows, f"more than {buf.nbytes - end} bytes of records")) from None
                self.check_tag(source)
                nbytes = status.Get_count(BYTE)
                sent, received = sent + outgoing.nbytes, received + nbytes
            end, c = read_records(buf, end, end + nbytes, cnt, rows, row_bytes, starts, counts)
            if end is None:
                raise self._fail(g, records_error(self.name, nbytes, source, cnt, self.tail, self.dtype))
            bad = c if c is not None else bad  # keep going, so the other ranks get their records
        if bad is not None:
            raise self._fail(g, rows_error(g, rows, f"a block of {bad} rows"))
        result = self._unpack(starts, counts, out)
        stats.record_call(self.call, sent, received, t0)
        return result

    def _unpack(self, starts, counts, out):
        return unpack_records(self.buf, starts, counts, self.rank, self.row_bytes, self.tail, self.dtype, out)

    def _fail(self, g, err):
        stats.note_op("all_gather", self.name, (self.rows,) + self.tail, self.dtype)
        return err


class EvenGatherPlan(_GatherPlan):
    """evengather.even_all_gather for one (x shape, out shape): the byte ranges of every
    round precomputed, so a call is one copy of x into out and one Sendrecv per round.
    A message of the wrong size hands the remaining rounds to evengather.exchange, which
    sends empty messages so that every rank raises (see evengather.py)."""

    __slots__ = ("own", "rounds", "sent", "received")

    def __init__(self, g, shape, dtype, out, algorithm):
        super().__init__(g, shape, dtype, out)
        chosen = "doubling" if algorithm == "doubling" else "even_ring"  # the general path's name for it
        self.tag, self.rtag = tags("all_gather", "", self.dtype, None, chosen)
        self.own = slice(self.rank * self.rows, (self.rank + 1) * self.rows)
        self.rounds = evengather.byte_rounds(self.n, self.rank, algorithm, self.nbytes)
        self.sent = sum(shi - slo for _, slo, shi, *_ in self.rounds)
        self.received = sum(rhi - rlo for *_, rlo, rhi in self.rounds)

    def run(self, g, x, out):
        """The gathered array, or None when the general path must take the call."""
        if out is None or not self.fits(out) or not out.flags.c_contiguous:
            return None
        t0 = stats._clock()
        out[self.own] = x
        flat = out.reshape(-1).view(np.uint8)
        comm, status, tag, rtag = self.comm, self.status, self.tag, self.rtag
        mismatch = None
        for k, (dest, slo, shi, source, rlo, rhi) in enumerate(self.rounds):
            try:
                comm.Sendrecv([flat[slo:shi], BYTE], dest, tag, [flat[rlo:rhi], BYTE], source, rtag, status)
                got = status.Get_count(BYTE)
            except MPI.Exception as err:
                error = _mpi_error(g, err)
                if error is not None:
                    raise error from None
                got = f"more than {rhi - rlo}"
            if status.Get_tag() != tag:  # another call's message: handled as one of the wrong size
                mismatch = mismatch_error(comm, source, tag, status.Get_tag(), got, rhi - rlo)
                got = f"{got} bytes of another call"
            if got != rhi - rlo:  # finish the rounds with empty messages, so that every rank raises
                bad = f"rank {source} sent {got} bytes where {rhi - rlo} were expected"
                stats.note_op("all_gather", self.name, x.shape, self.dtype)
                with stats.scope("all_gather", None if rtag != ANY_TAG else tag, self.name):  # the rest carry its identity too
                    evengather.exchange(g, flat, self.rounds[k + 1:], bad, status)
                raise mismatch or evengather.error(g, out, bad)
        stats.record_call(self.call, self.sent, self.received, t0)
        return out


def _mpi_error(g, err):
    """A CommError for an MPI error other than a truncated receive (which the caller words), or None."""
    if err.Get_error_class() == MPI.ERR_TRUNCATE:
        return None
    return CommError(f"all_gather: MPI error while receiving on group {g.name!r}: {err}")
