"""Pairwise exchange: at step k every rank swaps a block with the ranks k away, N-1 steps.

Thakur, Rabenseifner & Gropp 2005 (sec. 4.3 and 4.5): MPICH's algorithm for long-message
reduce-scatter with commutative ops, and for all-to-all.  At step k rank r sends to r+k and
receives from r-k.  Unlike the ring, every message comes straight from the input: no step
waits for a partial sum made at the step before (a late rank in a ring delays everyone
behind it), and the running sum stays in one block-sized buffer, often in cache.

On two ranks the whole all-gather is one pairwise swap (:func:`pair_all_gather`).
:func:`pairwise_all_to_all_v` is the all-to-all with a row count per destination (MPI's
Alltoallv): the counts first, by the same pairwise exchange, then the rows.
"""

from __future__ import annotations

import math

import numpy as np

from minidist.comm.algorithms.blocks import partial_rows_error, rows_error
from minidist.layout.split import split_bounds
from minidist.comm.algorithms.pipelined import num_chunks, pipelined_step
from minidist.comm.p2p import TAG_COLLECTIVE as TAG, _exchange, _sendrecv


def pairwise_steps(n: int, r: int) -> list[tuple[int, int]]:
    """Rank r's (send to, receive from) at steps k = 1 .. N-1: (r+k, r-k) mod N."""
    return [((r + k) % n, (r - k) % n) for k in range(1, n)]


def pairwise_reduce_scatter(g, x: np.ndarray, bounds, ufunc, result: np.ndarray) -> None:
    """Reduce-scatter of flat ``x`` (block b = x[bounds[b]]): block r, reduced over all ranks,
    lands in ``result``.  At step k rank r sends its own copy of block r+k to rank r+k,
    receives rank r-k's copy of block r and adds it.  (N-1)/N * X bytes per rank, like the
    ring.  Steps longer than a pipeline chunk are pipelined (pipelined.py)."""
    n, r = g.size, g.rank
    lo, hi = bounds[r]
    mine = x[lo:hi]
    nchunks = num_chunks(bounds, x.itemsize)
    first = split_bounds(hi - lo, nchunks)[0]
    tmp = (g.scratch("pw_recv0", first[1] - first[0], x.dtype), g.scratch("pw_recv1", first[1] - first[0], x.dtype))
    for k, (dst, src) in enumerate(pairwise_steps(n, r)):
        outgoing = x[bounds[dst][0]:bounds[dst][1]]
        acc = mine if k == 0 else result  # the first step adds x's own block, later ones the sum so far
        if nchunks == 1:  # one blocking Sendrecv: measured faster than Isend + Irecv + Waits
            ufunc(acc, _sendrecv(g.comm, outgoing, dst, tmp[0][:hi - lo], src, TAG), out=result)
        else:  # dst cuts its block (the same size) into the same chunks
            pipelined_step(g.comm, outgoing, dst, src, hi - lo, nchunks, tmp,
                           lambda a, b, got, acc=acc: ufunc(acc[a:b], got, out=result[a:b]))
    if n == 1:
        result[...] = mine


def pairwise_all_to_all(g, x: np.ndarray) -> np.ndarray:
    """Axis 0 of ``x`` in N parts (np.array_split); part j goes to rank j, and the parts
    received are concatenated in rank order.  (N-1)/N * X bytes per rank."""
    n, r = g.size, g.rank
    parts = split_bounds(x.shape[0], n)
    mine = parts[r][1] - parts[r][0]
    out = np.empty((n * mine,) + x.shape[1:], x.dtype)
    out[r * mine:(r + 1) * mine] = x[parts[r][0]:parts[r][1]]
    for dst, src in pairwise_steps(n, r):
        _sendrecv(g.comm, x[parts[dst][0]:parts[dst][1]], dst, out[src * mine:(src + 1) * mine], src, TAG)
    return out


def pairwise_all_to_all_v(g, x: np.ndarray, counts: np.ndarray):
    """All-to-all with variable counts (MPI_Alltoallv; Thakur, Rabenseifner & Gropp 2005,
    sec. 4.5): rows ``x[sum(counts[:j]) : sum(counts[:j+1])]`` go to rank j.  Returns the
    rows received, concatenated in source-rank order, and how many came from each rank.

    Two pairwise exchanges of N-1 steps (step k: send to r+k, receive from r-k): first the
    counts (one int64 each way, so each rank knows what size to receive), then the rows.
    Sent per rank: 8(N-1) bytes of counts + the rows sent to the other ranks."""
    n, r = g.size, g.rank
    recv_counts = np.empty(n, np.int64)
    recv_counts[r] = counts[r]
    for dst, src in pairwise_steps(n, r):
        _sendrecv(g.comm, counts[dst:dst + 1], dst, recv_counts[src:src + 1], src, TAG)
    send_at = np.concatenate([[0], np.cumsum(counts)])
    recv_at = np.concatenate([[0], np.cumsum(recv_counts)])
    out = np.empty((int(recv_at[-1]),) + x.shape[1:], x.dtype)
    out[recv_at[r]:recv_at[r + 1]] = x[send_at[r]:send_at[r + 1]]
    for dst, src in pairwise_steps(n, r):
        _sendrecv(g.comm, x[send_at[dst]:send_at[dst + 1]], dst, out[recv_at[src]:recv_at[src + 1]], src, TAG)
    return out, recv_counts


def pair_all_gather(g, x: np.ndarray, out: np.ndarray | None = None, status=None) -> np.ndarray:
    """All-gather of ``x`` (rows along axis 0) on a group of 2: one swap, and the peer's row
    count read from the size of its message.  (N-1) * X bytes per rank for equal blocks.

    Why no size exchange is needed: row counts differ by at most one (ROWS_RULE), so a
    receive buffer of ``rows + 1`` rows always fits the peer's block, and the received size
    says how many rows it really had.  A larger difference overflows that buffer on the rank
    with fewer rows and shows in the count on the other, so *both* ranks raise.  Rank 0
    receives into the rows after its own block, rank 1 into the front of the result.  With
    ``out=`` the peer's block lands straight in ``out``; without, the result is a view of a
    buffer one row longer than needed.
    """
    r = g.rank
    rows, tail = x.shape[0], x.shape[1:]
    row_bytes = math.prod(tail) * x.itemsize
    if out is None:
        buf = np.empty((2 * rows + 1,) + tail, x.dtype)
        room = buf[rows:] if r == 0 else buf[:rows + 1]
    else:
        buf = out
        room = out[rows:] if r == 0 else out[:max(out.shape[0] - rows, 0)]
    peer = 1 - r
    nbytes = _exchange(g.comm, x, peer, room, peer, TAG, status)
    if type(nbytes) is str:
        raise rows_error(g, rows, f"a block longer than the {room.shape[0]} rows of room", out)
    if nbytes % row_bytes:
        raise partial_rows_error(g.name, peer, nbytes, tail, x.dtype, row_bytes)
    theirs = nbytes // row_bytes
    if abs(theirs - rows) > 1:
        raise rows_error(g, rows, f"{theirs} rows", out)
    total = rows + theirs
    if out is not None and out.shape[0] != total:
        raise ValueError(f"all_gather: out.shape={out.shape} but the result has shape {(total,) + tail}")
    result = buf[:total] if out is None else out
    if r == 0:
        result[:rows] = x
    else:
        result[theirs:] = x
    return result
