"""Bandwidth-optimal collectives: rings and pipelined chains, for large messages.

A ring (Patarasuk & Yuan 2009, "Bandwidth optimal all-reduce algorithms for clusters of
workstations") cuts the vector into N blocks and has every rank talk only to its two
neighbours, right = r+1 and left = r-1 (mod N).  Every link is busy in every step and no
rank ever sends more than (N-1)/N of the data per phase, which is the lower bound, so for
large X the time approaches 2(N-1)/N * X / bandwidth for an all-reduce however large N is.

Two details make it fast in practice:
* partial sums are written straight into their final place with ``ufunc(a, b, out=...)``
  (no temporary arrays, no extra copies), and received data lands in a reused scratch buffer;
* each step is cut into chunks of about ``PIPELINE_BYTES`` so the received chunk is still in
  cache when it is added, and the next chunk is already in flight while this one is added
  (for broadcast/reduce chains, the next rank forwards chunk k while chunk k+1 arrives).

PIPELINE_BYTES = 1 MB was measured (2 and 4 ranks, 1-64 MB all-reduce, chunks of 64 KB to
4 MB): over shared memory each message costs a rendezvous handshake, so 64-256 KB chunks were
10-40% slower than 1 MB ones; 1-2 MB chunks (about the 2 MB L2 cache) were best, whole
blocks no better.
"""

from __future__ import annotations

import math

import numpy as np
from mpi4py import MPI

from minidist.comm import links
from minidist.comm.errors import CommError
from minidist.comm.p2p import TAG_COLLECTIVE as TAG, _irecv, _isend, _recv, _sendrecv, _wait_recv

PIPELINE_BYTES = 1024 * 1024
BYTE = MPI.BYTE


def split_bounds(n: int, parts: int, unit: int = 1) -> list[tuple[int, int]]:
    """(start, stop) of ``parts`` pieces of ``n`` rows, sized like ``np.array_split``,
    in units of ``unit`` elements per row."""
    q, extra = divmod(n, parts)
    bounds, start = [], 0
    for i in range(parts):
        stop = start + q + (1 if i < extra else 0)
        bounds.append((start * unit, stop * unit))
        start = stop
    return bounds


def _chunks(n: int, nchunks: int) -> list[tuple[int, int]]:
    return split_bounds(n, nchunks) if nchunks > 1 else [(0, n)]


def _num_chunks(bounds, itemsize: int) -> int:
    """Same number of chunks per step on every rank (so the Sendrecv calls pair up)."""
    biggest = max(hi - lo for lo, hi in bounds) * itemsize
    return max(1, -(-biggest // PIPELINE_BYTES))


def ring_reduce_scatter(g, x: np.ndarray, bounds, ufunc, dest) -> None:
    """Ring reduce-scatter of flat ``x``: block b = x[bounds[b]]; rank r ends with block r
    reduced over all ranks, in ``dest(r, N-2)``.

    N-1 steps.  In step s rank r sends its partial sum of block (r-s-1) mod N to the right
    and receives the partial of block (r-s-2) mod N from the left, adds its own part and
    stores the sum in ``dest(block, s)`` (a flat array of the block's length).  Per rank:
    sends and receives (N-1)/N * X bytes (exactly, when N divides the length).

    Each step is pipelined in chunks of about PIPELINE_BYTES (:func:`_pipelined_step`).
    """
    n, r, comm = g.size, g.rank, g.comm
    right, left = (r + 1) % n, (r - 1) % n
    nchunks = _num_chunks(bounds, x.itemsize)
    biggest = max(hi - lo for lo, hi in bounds)
    per_chunk = -(-biggest // nchunks)
    tmp = (g.scratch("ring_recv0", per_chunk, x.dtype), g.scratch("ring_recv1", per_chunk, x.dtype))
    outgoing = None
    for s in range(n - 1):
        b_send, b_recv = (r - s - 1) % n, (r - s - 2) % n
        if outgoing is None:
            outgoing = x[bounds[b_send][0]:bounds[b_send][1]]
        mine = x[bounds[b_recv][0]:bounds[b_recv][1]]
        out = dest(b_recv, s)
        _pipelined_step(comm, outgoing, right, left, mine.size, nchunks, tmp,
                        lambda lo, hi, got: ufunc(mine[lo:hi], got, out=out[lo:hi]))
        outgoing = out


def _pipelined_step(comm, outgoing, dst, src, size, nchunks, tmp, combine) -> None:
    """One step of a pipelined ring or pairwise exchange: send ``outgoing`` to ``dst`` while
    receiving ``size`` elements from ``src``, both cut into ``nchunks`` chunks, into the two
    receive buffers ``tmp`` in turn.  Chunk c+1 is posted before ``combine(lo, hi, got)``
    reduces chunk c, so it is already moving while this rank computes (MPICH over shared
    memory lets the receiver copy straight out of the sender's memory), and each chunk is
    reduced while it is still in cache."""
    sends, recvs = _chunks(outgoing.size, nchunks), _chunks(size, nchunks)

    def post(c):
        got = tmp[c % 2][:recvs[c][1] - recvs[c][0]]
        return got, _irecv(comm, got, src, TAG), _isend(comm, outgoing[sends[c][0]:sends[c][1]], dst, TAG)

    pending = post(0)
    for c, (lo, hi) in enumerate(recvs):
        got, recv_req, send_req = pending
        if c + 1 < nchunks:
            pending = post(c + 1)  # in flight while chunk c is reduced below
        _wait_recv(comm, recv_req, src, TAG, got.nbytes)
        combine(lo, hi, got)
        send_req.Wait()


def pairwise_reduce_scatter(g, x: np.ndarray, bounds, ufunc, result: np.ndarray) -> None:
    """Reduce-scatter of flat ``x`` by pairwise exchange: block r, reduced over all ranks,
    lands in ``result`` (Thakur, Rabenseifner & Gropp 2005, sec. 4.3: MPICH's algorithm for
    long messages and commutative ops).

    N-1 steps; in step k rank r sends its own copy of block (r+k) to rank r+k, receives
    rank (r-k)'s copy of block r and adds it into ``result``.  Per rank: (N-1)/N * X bytes,
    like the ring, but every message comes straight from ``x``: no step waits for the sum
    of the step before (the ring forwards partial sums, so a late rank delays everyone
    behind it), and the running sum stays in one block-sized buffer, often in cache.
    Measured on 4 oversubscribed ranks against MPI's Reduce_scatter_block: 1 MB 1.02x,
    16 MB 1.05-1.09x, 64 MB 1.05-1.19x (recursive halving: 0.53-0.82x).  Each step is
    pipelined in chunks of about PIPELINE_BYTES, as in :func:`ring_reduce_scatter`.
    """
    n, r, comm = g.size, g.rank, g.comm
    lo, hi = bounds[r]
    mine = x[lo:hi]
    nchunks = _num_chunks(bounds, x.itemsize)
    recvs = _chunks(hi - lo, nchunks)
    tmp = (g.scratch("pw_recv0", recvs[0][1] - recvs[0][0], x.dtype),
           g.scratch("pw_recv1", recvs[0][1] - recvs[0][0], x.dtype))
    for k in range(1, n):
        dst, src = (r + k) % n, (r - k) % n
        outgoing = x[bounds[dst][0]:bounds[dst][1]]
        acc = mine if k == 1 else result  # the first step adds x's own block, later ones the sum so far
        if nchunks == 1:  # one blocking Sendrecv: measured 10% faster than Isend + Irecv + Waits
            ufunc(acc, _sendrecv(comm, outgoing, dst, tmp[0][:hi - lo], src, TAG), out=result)
        else:  # dst cuts its block (the same size) into the same chunks
            _pipelined_step(comm, outgoing, dst, src, hi - lo, nchunks, tmp,
                            lambda a, b, got: ufunc(acc[a:b], got, out=result[a:b]))
    if n == 1:
        result[...] = mine


def ring_all_gather(g, out: np.ndarray, bounds) -> None:
    """Ring all-gather in place: rank r's block out[bounds[r]] is already there; afterwards
    every block is everywhere.

    N-1 steps; in step s rank r forwards block (r-s) mod N to the right and receives block
    (r-s-1) mod N from the left, straight into its final place.  Per rank: sends and
    receives (N-1)/N * X bytes (exactly, when the blocks are equal).
    """
    n, r, comm = g.size, g.rank, g.comm
    right, left = (r + 1) % n, (r - 1) % n
    for s in range(n - 1):
        b_send, b_recv = (r - s) % n, (r - s - 1) % n
        _sendrecv(comm, out[bounds[b_send][0]:bounds[b_send][1]], right,
                  out[bounds[b_recv][0]:bounds[b_recv][1]], left, TAG)


ROWS_RULE = ("all_gather accepts row counts (axis 0) that differ by at most one between ranks, "
             "as np.array_split produces")


def pair_all_gather(g, x: np.ndarray, out: np.ndarray | None = None, status=None):
    """All-gather of ``x`` (rows along axis 0) on a group of 2: one ``Sendrecv``, and the
    peer's row count read from the size of its message.  Returns ``(result, bytes_sent,
    bytes_received)``; the caller does the accounting.

    Why it needs no size exchange: row counts may differ by at most one between ranks
    (np.array_split sharding; ROWS_RULE), so a receive buffer of ``rows + 1`` rows always
    fits the peer's block, and ``Status.Get_count`` then says how many rows it really had.
    A larger difference overflows that buffer (MPI reports truncation) on the rank with
    fewer rows and shows up in the count on the other one, so *both* ranks raise.
    Steps: rank 0 receives into the rows after its own block, rank 1 into the front of the
    result (its own block is copied in behind the peer's once the count is known).  With
    ``out=`` the peer's block lands straight in ``out`` (out's length gives the room).
    Without ``out=`` the result is a view of a buffer one row longer than needed.
    Per rank: sends X (its own block) and receives the peer's block, (N-1) * X for equal blocks.
    """
    r, comm = g.rank, g.comm
    rows, tail = x.shape[0], x.shape[1:]
    row_bytes = math.prod(tail) * x.itemsize
    if out is None:
        buf = np.empty((2 * rows + 1,) + tail, x.dtype)
        room = buf[rows:] if r == 0 else buf[:rows + 1]
    else:
        buf = out
        room = out[rows:] if r == 0 else out[:max(out.shape[0] - rows, 0)]
    status = MPI.Status() if status is None else status
    if links.enabled:
        links.delay(x.nbytes)
    peer = 1 - r
    try:
        comm.Sendrecv([x, BYTE], peer, TAG, [room, BYTE], peer, TAG, status)
    except MPI.Exception as err:
        raise _rows_error(g, x, f"a block longer than the {room.shape[0]} rows of room", out, err) from None
    nbytes = status.Get_count(BYTE)
    if nbytes % row_bytes:
        raise CommError(f"all_gather: rank {peer} of group {g.name!r} sent {nbytes} bytes, not a whole "
                        f"number of rows of shape {tail} {x.dtype} ({row_bytes} bytes each): the ranks "
                        f"passed different trailing shapes or dtypes")
    theirs = nbytes // row_bytes
    if abs(theirs - rows) > 1:
        raise _rows_error(g, x, f"{theirs} rows", out)
    total = rows + theirs
    if out is not None and out.shape[0] != total:
        raise ValueError(f"all_gather: out.shape={out.shape} but the result has shape {(total,) + tail}")
    result = buf[:total] if out is None else out
    if r == 0:
        result[:rows] = x
    else:
        result[theirs:] = x
    return result, x.nbytes, nbytes


def _rows_error(g, x, what, out=None, err=None) -> Exception:
    if err is not None and err.Get_error_class() != MPI.ERR_TRUNCATE:
        return CommError(f"all_gather: MPI error while receiving on group {g.name!r}: {err}")
    hint = f" (or out.shape={out.shape} is wrong)" if out is not None else ""
    return CommError(f"all_gather on group {g.name!r}: this rank has {x.shape[0]} rows but received {what}"
                     f"{hint}; {ROWS_RULE}.  Rerun with MINIDIST_CHECK_COLLECTIVES=1 to see what each "
                     f"rank called.")


def ring_all_reduce(g, x: np.ndarray, out: np.ndarray, ufunc) -> None:
    """All-reduce = ring reduce-scatter + ring all-gather (Patarasuk & Yuan 2009).

    2(N-1) steps; each rank sends and receives 2(N-1)/N * X bytes, the bandwidth lower
    bound.  ``x`` (flat) is only read; the result fills flat ``out``.
    """
    bounds = split_bounds(x.size, g.size)
    ring_reduce_scatter(g, x, bounds, ufunc, lambda b, s: out[bounds[b][0]:bounds[b][1]])
    ring_all_gather(g, out, bounds)


def chain_broadcast(g, buf: np.ndarray, root: int) -> None:
    """Pipelined chain (ring without the closing link) broadcast of flat ``buf`` from root.

    The data is cut into C chunks of about PIPELINE_BYTES; rank root+k receives chunk c
    from root+k-1 and forwards it to root+k+1 at once, so all links work at the same time:
    N-2+C chunk-steps, and every rank receives and sends X once (the root only sends, the
    last rank only receives).  Beats the binomial tree (log2(N) * X at the root) for large X.
    """
    n, comm = g.size, g.comm
    vr = (g.rank - root) % n
    prev, nxt = (g.rank - 1) % n, (g.rank + 1) % n
    requests = []
    for a, b in _chunks(buf.size, _num_chunks([(0, buf.size)], buf.itemsize)):
        if vr > 0:
            _recv(comm, buf[a:b], prev, TAG)
        if vr < n - 1:
            requests.append(_isend(comm, buf[a:b], nxt, TAG))
    MPI.Request.Waitall(requests)


def chain_reduce(g, x: np.ndarray, acc: np.ndarray, root: int, ufunc) -> None:
    """Pipelined chain reduce of flat ``x`` onto ``root`` (the broadcast chain run backwards).

    Partial sums flow root+N-1 -> root+N-2 -> ... -> root, chunk by chunk; each rank adds
    its own chunk into ``acc`` and forwards it while the next chunk arrives.  Every rank
    sends and receives X once.  On the root ``acc`` ends as the result.
    """
    n, comm = g.size, g.comm
    vr = (g.rank - root) % n
    upstream, downstream = (g.rank + 1) % n, (g.rank - 1) % n
    nchunks = _num_chunks([(0, x.size)], x.itemsize)
    tmp = g.scratch("chain_recv", -(-x.size // nchunks), x.dtype)
    requests = []
    for a, b in _chunks(x.size, nchunks):
        if vr < n - 1:
            got = tmp[:b - a]
            _recv(comm, got, upstream, TAG)
            ufunc(x[a:b], got, out=acc[a:b])
            part = acc[a:b]
        else:
            part = x[a:b]
        if vr > 0:
            requests.append(_isend(comm, part, downstream, TAG))
    MPI.Request.Waitall(requests)
