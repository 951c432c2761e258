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
  cache when it is added (and, for broadcast/reduce chains, so the next rank can already
  forward chunk k while chunk k+1 arrives: pipelining).
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from minidist.comm.p2p import TAG_COLLECTIVE as TAG, _isend, _recv, _sendrecv

PIPELINE_BYTES = 256 * 1024


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
    """
    n, r, comm = g.size, g.rank, g.comm
    right, left = (r + 1) % n, (r - 1) % n
    nchunks = _num_chunks(bounds, x.itemsize)
    biggest = max(hi - lo for lo, hi in bounds)
    tmp = g.scratch("ring_recv", -(-biggest // nchunks), x.dtype)
    outgoing = None
    for s in range(n - 1):
        b_send, b_recv = (r - s - 1) % n, (r - s - 2) % n
        if outgoing is None:
            outgoing = x[bounds[b_send][0]:bounds[b_send][1]]
        mine = x[bounds[b_recv][0]:bounds[b_recv][1]]
        out = dest(b_recv, s)
        for (a, b), (c, d) in zip(_chunks(outgoing.size, nchunks), _chunks(mine.size, nchunks)):
            got = tmp[:d - c]
            _sendrecv(comm, outgoing[a:b], right, got, left, TAG)
            ufunc(mine[c:d], got, out=out[c:d])
        outgoing = out


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
