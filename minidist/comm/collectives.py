"""The collectives users call, each a short function built from point-to-point messages.

Every public function here takes and returns backend arrays (never modifying its input),
validates its arguments on every rank before sending anything, records itself in the
rank's recent-ops log, charges its traffic to its own name in ``comm.stats()``, and, with
``async_op=True``, runs on the group's progress thread and returns a handle whose
``wait()`` gives the result.

Algorithms (X = bytes of the input, N = group size; see ring.py, tree.py, evengather.py;
all_reduce, reduce_scatter and reduce live in reducing.py):

=============== ============================================ ==============================
collective      algorithm                                    sent per rank
=============== ============================================ ==============================
all_reduce      small: recursive doubling, log2 N rounds     log2(N) * X
                large: pairwise reduce-scatter, then         2(N-1)/N * X
                all-gather (doubling on 2^k ranks, or ring)
reduce_scatter  small: one-shot, N-1 messages in one round   (N-1)/N * X
                medium: ring, N-1 steps; N=4,8,..: halving
                large, N>2: pairwise exchange, N-1 steps     (N-1)/N * X
                (on 2 ranks every one of them is one exchange)
all_gather      out= of N equal blocks, small (any size on   (N-1) * X_own
                up to 4 ranks): one-shot, every block to every
                rank in one round; else, N>2: doubling (2^k)
                or ring, into out
                otherwise, N=2: one Sendrecv                 (N-1) * X_own
                otherwise: Bruck with row counts, log2 N     (N-1) * (X_own + 8)
broadcast       small: binomial tree; large: pipelined chain tree: <= log2(N) X; chain: X
reduce          small: binomial tree; large: pipelined chain tree: X; chain: X
scatter/gather  linear at the root, N-1 messages             root: (N-1)/N * X
all_to_all      pairwise exchange, N-1 steps                 (N-1)/N * X
ppermute        one Isend + one Recv                         X (if it sends)
barrier         dissemination, ceil(log2 N) rounds           0
=============== ============================================ ==============================

Every algorithm can be forced with ``algorithm=`` (the textbook ring for all_reduce,
reduce_scatter and all_gather; Rabenseifner's halving + doubling for all_reduce).
The size thresholds between the latency- and bandwidth-optimal algorithms are module
constants, chosen from ``benchmarks/bench_collectives.py`` measurements on the development
machine (see the comments); ``algorithm=`` overrides them per call (the tests force each path).

Repeated synchronous calls of all_reduce, reduce_scatter and all_gather with the same shape
and dtype run a plan cached on the group (fastpath.py): the same algorithm and result with a
fraction of the per-call Python work, which dominates the cost of small messages.
"""

from __future__ import annotations

import math

import numpy as np

from minidist.comm import check, evengather, fastgather, fastpath, links, ring, stats, tree
from minidist.comm.errors import CommError
from minidist.comm.group import Group
from minidist.comm.launch import (check_algorithm as _algorithm, check_group as _check_group,
                                  check_out as _check_out, host_array as _host, launch as _launch)
from minidist.comm.p2p import TAG_COLLECTIVE as TAG, _isend, _recv, _sendrecv
from minidist.comm.reducing import all_reduce, reduce, reduce_scatter
from minidist.comm.rooted import gather, scatter
from minidist.comm.ring import chain_broadcast, pair_all_gather, ring_all_gather, split_bounds

# Binomial tree below, pipelined chain above (broadcast; reduce has its own, reducing.py).
SMALL_BROADCAST_BYTES = 256 * 1024


# ------------------------------------------------------------ data movement
def all_gather(x, g, async_op: bool = False, *, out=None, algorithm: str = "auto"):
    """Concatenate every rank's ``x`` along axis 0, on every rank.

    The first dims may differ, by at most one row between any two ranks (as np.array_split
    produces; ring.ROWS_RULE): a larger difference raises a CommError on every rank.

    Which algorithm (``"auto"``):
    * ``out=`` given with N dividing out.shape[0] (so every block has out.shape[0]/N rows):
      straight into ``out`` with no row counts on the wire (evengather.py): small results,
      and all on up to 4 ranks (evengather.DIRECT_BYTES, DIRECT_MAX_RANKS), in one round, every block to
      every rank at once (direct.py); otherwise by recursive doubling (log2 N rounds)
      when N is a power of two, else by the ring (N-1 steps); (N-1)/N * X bytes per rank.
      ``out=`` must then have the same shape on every rank;
    * otherwise, two ranks: one Sendrecv; the receiver learns the other's row count from
      the message size (ring.pair_all_gather);
    * otherwise a Bruck all-gather, ceil(log2 N) rounds, each block sent behind its row
      count (tree.bruck_all_gather_rows); every rank receives every other block once.

    ``algorithm="ring"`` forces the textbook ring (N-1 steps, (N-1)/N * X bytes per rank,
    Patarasuk & Yuan 2009), after a Bruck exchange of the row counts (8 bytes a rank) unless
    ``out=`` already fixes them; ``"direct"`` forces the one-shot exchange and
    ``"doubling"`` recursive doubling (both need such an ``out=``, doubling also N a power
    of two); ``"bruck"`` forces the Bruck all-gather.
    Repeated calls with the same shape skip the argument checks (fastpath.py).
    """
    if algorithm == "auto" and type(x) is np.ndarray and not (async_op or check._enabled or links.enabled):
        key = ("all_gather", x.dtype, x.shape, None if out is None else getattr(out, "shape", None))
        plan = g._plans.get(key) if type(g) is Group else None
        result = None if plan is None else plan.run(g, x, out)
        if result is not None:
            return result
    _check_group(g, "all_gather")
    _algorithm(algorithm, ("auto", "ring", "direct", "doubling", "bruck"), "all_gather")
    x = _host(x, "all_gather")
    check.need_axis0(x, "all_gather")
    out = _check_out(out, x, "all_gather")
    if algorithm in ("direct", "doubling") and g.size > 1 and not (
            evengather.applies(g.size, x, out) and (algorithm == "direct" or g.size & (g.size - 1) == 0)):
        raise ValueError(f"all_gather: algorithm={algorithm!r} needs out= whose first dim is a multiple of the "
                         f"group size{' (a power of two)' if algorithm == 'doubling' else ''}; got {g.size} ranks "
                         f"and out.shape={None if out is None else out.shape}")
    # out's shape is part of the signature: it picks the algorithm, so ranks must agree on it.
    sig = ("all_gather", x, dict(rule="trailing", extra=None if out is None else out.shape))
    result = _launch("all_gather", _all_gather, g, x, sig, async_op, out, algorithm)
    if algorithm == "auto" and type(x) is np.ndarray and not async_op and fastpath.plain(out, x.dtype):
        plan = fastgather.make_plan(g, x.shape, x.dtype, out)
        if plan is not None:
            fastpath.store(g, ("all_gather", x.dtype, x.shape, None if out is None else out.shape), plan)
    return result


def _all_gather(g, x, result=None, algorithm="auto"):
    n = g.size
    if n == 1:
        return x.copy() if result is None else _fill(result, x)
    if result is not None and result.shape[1:] != x.shape[1:]:
        raise ValueError(f"all_gather: out.shape={result.shape} but the rows have shape {x.shape[1:]}")
    if algorithm != "bruck" and evengather.applies(n, x, result) and not _pair_lane(n, result, algorithm):
        out, sent, received = evengather.even_all_gather(g, x, result, algorithm)
    elif algorithm == "ring":
        return _ring_all_gather_rows(g, x, result)
    elif n == 2 and 0 not in x.shape[1:] and algorithm == "auto":
        out, sent, received = pair_all_gather(g, x, result)
    else:
        # More ranks: Bruck with the row counts inside the records, ceil(log2 N) rounds.
        # Measured against the former size exchange + ring on 4 oversubscribed ranks
        # (2 cores, load 3-5; ratio to MPI's Allgather): 4 KB 0.93 vs 0.49, 64 KB 0.95 vs
        # 0.31, 1 MB 2.0 vs 0.82 (every ring step may wait a scheduler time slice for a
        # neighbour), but 16 MB 0.62-0.77 vs 0.78-0.80 and 64 MB 0.57-0.62 vs 0.82-0.86:
        # there the packing (own block in, whole output out: one extra pass) costs more
        # than the rounds save.  One algorithm for all sizes all the same, because the
        # choice must agree on every rank and row counts may differ by one, so no size
        # threshold is safe without an exchange.
        out, sent, received = tree.bruck_all_gather_rows(g, x, result)
    stats.count_bytes(sent, received)
    return out


def _pair_lane(n, out, algorithm) -> bool:
    """Two ranks, results above the one-shot size: the pair exchange, one Sendrecv from x
    (ring.pair_all_gather).  It sends the same single message each way as the one-shot
    round, so it agrees with the cached plan (directgather.DirectGatherPlan), which holds
    persistent requests once the same arrays come back and otherwise sends the same way:
    with a different out each call, posting the one-shot round from out measured 1.4-1.6x
    slower at 1 MB."""
    return n == 2 and algorithm == "auto" and out.nbytes > evengather.DIRECT_BYTES


def _ring_all_gather_rows(g, x, result):
    """Row counts first (a Bruck all-gather of one int64 per rank), then the ring in place."""
    rows = tree.bruck_all_gather(g, np.array([x.shape[0]], np.int64).view(np.uint8)).view(np.int64)[:, 0]
    if rows.max() - rows.min() > 1:
        raise CommError(f"all_gather: row counts {rows.tolist()} break the rule: {ring.ROWS_RULE}")
    unit = math.prod(x.shape[1:])  # elements per row (math.prod: np.prod costs microseconds)
    edges = np.concatenate([[0], np.cumsum(rows)]) * unit
    bounds = [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:])]
    shape = (int(rows.sum()),) + x.shape[1:]
    if result is None:
        result = np.empty(shape, x.dtype)
    elif result.shape != shape:
        raise ValueError(f"all_gather: out.shape={result.shape}, expected {shape}")
    # Move bytes: the ring works on a flat byte view, so any dtype (bfloat16 too) travels as is.
    flat, isz = result.reshape(-1).view(np.uint8), x.dtype.itemsize
    byte_bounds = [(a * isz, b * isz) for a, b in bounds]
    lo, hi = byte_bounds[g.rank]
    flat[lo:hi] = np.ascontiguousarray(x).reshape(-1).view(np.uint8)
    ring_all_gather(g, flat, byte_bounds)
    return result


def _fill(out, value):
    out[...] = value
    return out


def broadcast(x, g, root: int = 0, async_op: bool = False, *, algorithm: str = "auto"):
    """Every rank gets a copy of root's ``x`` (others pass any array of that shape/dtype).

    Small: binomial tree, ceil(log2 N) rounds.  Large: pipelined chain, N-2+C chunk steps
    for C chunks; every rank receives and sends X once (Thakur et al. 2005).
    """
    _check_group(g, "broadcast")
    root = check.check_root(root, g, "broadcast")
    _algorithm(algorithm, ("auto", "binomial", "chain"), "broadcast")
    x = _host(x, "broadcast")
    sig = ("broadcast", x, dict(root=root))
    return _launch("broadcast", _broadcast, g, x, sig, async_op, root, algorithm)


def _broadcast(g, x, root, algorithm):
    out = x.copy() if g.rank == root else np.empty(x.shape, x.dtype)
    if g.size == 1:
        return out
    if algorithm == "auto":
        algorithm = "binomial" if x.nbytes <= SMALL_BROADCAST_BYTES else "chain"
    flat = out.reshape(-1)
    if algorithm == "binomial":
        tree.binomial_broadcast(g, flat, root)
    else:
        chain_broadcast(g, flat, root)
    return out


def all_to_all(x, g, async_op: bool = False):
    """Axis 0 of ``x`` in N parts (``np.array_split``); part j goes to rank j; the result is
    the received parts concatenated in rank order.  Pairwise exchange: N-1 steps, in step k
    rank r sends to r+k and receives from r-k; (N-1)/N * X bytes per rank.  All ranks must
    pass the same shape."""
    _check_group(g, "all_to_all")
    x = _host(x, "all_to_all")
    check.need_axis0(x, "all_to_all")
    sig = ("all_to_all", x, dict())
    return _launch("all_to_all", _all_to_all, g, x, sig, async_op)


def _all_to_all(g, x):
    n, r = g.size, g.rank
    parts = split_bounds(x.shape[0], n)
    mine = parts[r][1] - parts[r][0]
    out = np.empty((n * mine,) + x.shape[1:], x.dtype)
    out[r * mine:(r + 1) * mine] = x[parts[r][0]:parts[r][1]]
    for k in range(1, n):
        dst, src = (r + k) % n, (r - k) % n
        _sendrecv(g.comm, x[parts[dst][0]:parts[dst][1]], dst, out[src * mine:(src + 1) * mine], src, TAG)
    return out


def ppermute(x, g, perm, async_op: bool = False):
    """Send ``x`` along the (src, dst) pairs of ``perm`` (each rank sends and receives at
    most once); ranks that receive nothing get zeros.  One message per pair, all at once,
    so a cyclic shift [(i, (i+1) % N)] is one ring step."""
    _check_group(g, "ppermute")
    pairs = check.check_perm(perm, g)
    x = _host(x, "ppermute")
    sig = ("ppermute", x, dict(extra=pairs))
    return _launch("ppermute", _ppermute, g, x, sig, async_op, pairs)


def _ppermute(g, x, pairs):
    r = g.rank
    dst = next((d for s, d in pairs if s == r), None)
    src = next((s for s, d in pairs if d == r), None)
    if src == r:
        return x.copy()
    out = np.zeros_like(x)
    request = _isend(g.comm, x, dst, TAG) if dst is not None else None
    if src is not None:
        _recv(g.comm, out, src, TAG)
    if request is not None:
        request.Wait()
    return out


def barrier(g, async_op: bool = False):
    """Return only after every rank of ``g`` has called barrier (dissemination algorithm,
    Hensgen, Finkel & Manber 1988: ceil(log2 N) rounds of empty messages)."""
    _check_group(g, "barrier")
    sig = ("barrier", None, dict(rule="none"))
    return _launch("barrier", lambda grp, _x: tree.dissemination_barrier(grp), g, None, sig, async_op)


__all__ = ["all_reduce", "reduce_scatter", "reduce", "all_gather", "broadcast", "scatter",
           "gather", "all_to_all", "ppermute", "barrier"]
