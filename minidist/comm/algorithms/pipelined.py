"""Pipelining: large messages cut into chunks, so that sending, receiving and adding overlap.

The same algorithms as ring.py and pairwise.py, and chains for broadcast and reduce, with
each step cut into chunks of about ``PIPELINE_BYTES`` (Thakur, Rabenseifner & Gropp 2005
use pipelined chains for long-message broadcasts):

* the received chunk is added while it is still in cache, straight into its final place
  with ``ufunc(a, b, out=...)`` (no temporaries), and received data lands in two reused
  scratch buffers in turn;
* chunk c+1 is already in flight while chunk c is added (MPICH over shared memory lets the
  receiver copy straight out of the sender's memory);
* in a chain (a ring without its closing link) rank k forwards chunk c while chunk c+1
  arrives, so all links work at once: N-2+C chunk-steps for C chunks instead of (N-1) C.

Chunks give exactly the plain algorithms' sums (the same additions, element by element).
PIPELINE_BYTES: see docs/perf-notes.md ("Pipeline chunk").
"""

from __future__ import annotations

import numpy as np

from minidist.comm.algorithms.ring import ring_steps
from minidist.comm.p2p import TAG_COLLECTIVE as TAG, _abandon, _irecv, _isend, _recv, _wait_recv, _waitall, _withdraw
from minidist.layout.split import split_bounds

PIPELINE_BYTES = 1024 * 1024


def num_chunks(bounds, itemsize: int) -> int:
    """Chunks per step for blocks ``bounds``: the same on every rank (so the messages pair up)."""
    biggest = max(hi - lo for lo, hi in bounds) * itemsize
    return max(1, -(-biggest // PIPELINE_BYTES))


def pipelined_step(comm, outgoing, dst, src, size, nchunks, tmp, combine) -> None:
    """One step of a pipelined ring or pairwise exchange: send ``outgoing`` to ``dst`` while
    receiving ``size`` elements from ``src``, both cut into ``nchunks`` chunks, into the two
    receive buffers ``tmp`` in turn; ``combine(lo, hi, got)`` reduces chunk [lo, hi) while
    the next one travels."""
    sends, recvs = split_bounds(outgoing.size, nchunks), split_bounds(size, nchunks)

    def post(c):
        got = tmp[c % 2][:recvs[c][1] - recvs[c][0]]
        return got, _irecv(comm, got, src, TAG), _isend(comm, outgoing[sends[c][0]:sends[c][1]], dst, TAG)

    pending = post(0)
    send_req = None
    try:
        for c, (lo, hi) in enumerate(recvs):
            got, recv_req, send_req = pending
            if c + 1 < nchunks:
                pending = post(c + 1)  # in flight while chunk c is reduced below
            _wait_recv(comm, recv_req, src, TAG, got.nbytes)
            combine(lo, hi, got)
            _waitall([send_req])
    except BaseException:  # a mismatch (or any error): the next chunk's receive must not stay
        _withdraw([pending[1]])  # posted, and the sends in flight keep their memory
        _abandon([req for req in (send_req, pending[2]) if req is not None])
        raise


def pipelined_ring_reduce_scatter(g, x: np.ndarray, bounds, ufunc, result: np.ndarray) -> None:
    """ring.ring_reduce_scatter with every step pipelined, the partial sums in two reused
    scratch buffers (the last step adds into ``result``)."""
    n, r = g.size, g.rank
    nchunks = num_chunks(bounds, x.itemsize)
    biggest = max(hi - lo for lo, hi in bounds)
    per_chunk = -(-biggest // nchunks)
    tmp = (g.scratch("ring_recv0", per_chunk, x.dtype), g.scratch("ring_recv1", per_chunk, x.dtype))
    partial = [g.scratch("rs_partial0", biggest, x.dtype), g.scratch("rs_partial1", biggest, x.dtype)]
    outgoing = x[bounds[(r - 1) % n][0]:bounds[(r - 1) % n][1]]
    for s, (_, b) in enumerate(ring_steps(n, r, "reduce_scatter")):
        mine = x[bounds[b][0]:bounds[b][1]]
        out = result if s == n - 2 else partial[s % 2][:mine.size]

        def add(lo, hi, got, mine=mine, out=out):
            ufunc(mine[lo:hi], got, out=out[lo:hi])

        pipelined_step(g.comm, outgoing, (r + 1) % n, (r - 1) % n, mine.size, nchunks, tmp, add)
        outgoing = out
    if n == 1:
        result[...] = outgoing


def chain_broadcast(g, buf: np.ndarray, root: int) -> None:
    """Pipelined chain broadcast of flat ``buf`` from ``root``: rank root+k receives chunk c
    from root+k-1 and forwards it to root+k+1 at once.  N-2+C chunk-steps; every rank
    receives and sends X once (the root only sends, the last rank only receives), against
    log2(N) * X sent by the root of a binomial tree."""
    n = g.size
    vr = (g.rank - root) % n
    prev, nxt = (g.rank - 1) % n, (g.rank + 1) % n
    requests = []
    for a, b in split_bounds(buf.size, num_chunks([(0, buf.size)], buf.itemsize)):
        if vr > 0:
            _recv(g.comm, buf[a:b], prev, TAG)
        if vr < n - 1:
            requests.append(_isend(g.comm, buf[a:b], nxt, TAG))
    _waitall(requests)


def chain_reduce(g, x: np.ndarray, acc: np.ndarray, root: int, ufunc) -> None:
    """Pipelined chain reduce of flat ``x`` onto ``root`` (the broadcast chain run backwards):
    partial sums flow root+N-1 -> ... -> root chunk by chunk, each rank adding its own chunk
    into ``acc`` and forwarding it while the next arrives.  Every rank sends and receives X
    once; on the root ``acc`` ends as the result."""
    n = g.size
    vr = (g.rank - root) % n
    upstream, downstream = (g.rank + 1) % n, (g.rank - 1) % n
    nchunks = num_chunks([(0, x.size)], x.itemsize)
    tmp = g.scratch("chain_recv", -(-x.size // nchunks), x.dtype)
    requests = []
    for a, b in split_bounds(x.size, nchunks):
        if vr < n - 1:
            got = tmp[:b - a]
            _recv(g.comm, got, upstream, TAG)
            ufunc(x[a:b], got, out=acc[a:b])
            part = acc[a:b]
        else:
            part = x[a:b]
        if vr > 0:
            requests.append(_isend(g.comm, part, downstream, TAG))
    _waitall(requests)
