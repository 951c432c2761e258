"""The collectives users call: check the arguments, pick an algorithm, run it.

Every public function here takes and returns backend arrays (never modifying its input),
validates its arguments on every rank before sending anything, records itself in the
rank's recent-ops log, charges its traffic to its own name in ``comm.stats()``, and, with
``async_op=True``, runs on the group's progress thread and returns a handle whose
``wait()`` gives the result.  all_reduce, reduce_scatter and reduce live in reducing.py,
scatter and gather in rooted.py; this module re-exports them.

The path of a call, e.g. ``comm.all_reduce(x, g)``:
1. ``fast.run`` (fast/__init__.py): a plan cached for this (collective, arguments, dtype,
   shape) runs the call and returns, unless the fast path is off (MINIDIST_FAST_PATH=0);
2. otherwise the general path: argument checks (launch.py, check.py), the algorithm for
   this size (the thresholds below and in reducing.py), and ``launch.launch``, which runs the
   algorithm (algorithms/) here or on the progress thread, inside its stats scope;
3. ``fast.remember`` caches the plan for the algorithm that ran, for the next call;
4. every message goes through p2p.py to MPI's point-to-point calls.

Algorithms (X = bytes of the input, N = group size):

=============== ============================================ ==============================
collective      algorithm (module in algorithms/)            sent per rank
=============== ============================================ ==============================
all_reduce      small: recursive doubling (doubling.py)      log2(N) * X
                large: pairwise reduce-scatter, then         2(N-1)/N * X
                all-gather (doubling on 2^k ranks, or ring)
                algorithm="ring": the textbook ring (ring.py) 2(N-1)/N * X
reduce_scatter  small: one-shot (oneshot.py)                 (N-1)/N * X
                medium: halving on 4, 8, ... ranks, else the
                pipelined ring; large, N>2: pairwise
all_gather      out= of N equal blocks (evengather.py):      (N-1) * X_own
                small or on up to 4 ranks: one-shot; else
                doubling (2^k) or ring
                otherwise, N=2: one swap (pairwise.py)        (N-1) * X_own
                otherwise: Bruck with row counts (bruck.py)  (N-1) * (X_own + 8)
broadcast       small: binomial tree; large: pipelined chain tree: <= log2(N) X; chain: X
reduce          small: binomial tree; large: pipelined chain tree: X; chain: X
scatter/gather  linear at the root, N-1 messages             root: (N-1)/N * X
all_to_all      pairwise exchange, N-1 steps                 (N-1)/N * X
all_to_all_v    pairwise exchange of the counts, then of     8(N-1) + the rows sent to
                the rows (2(N-1) steps); or each exchange    the other ranks
                one round posted at once; fast path: the
                rows sent with the counts, one round
ppermute        one Isend + one Recv                         X (if it sends)
barrier         dissemination, ceil(log2 N) rounds           0
=============== ============================================ ==============================

``algorithm=`` forces one (the tests force each).  Each threshold between the latency- and
the bandwidth-optimal algorithms is a constant of minidist/layout/thresholds.py; its
measurements are in docs/perf-notes.md.
"""

from __future__ import annotations

import math

import numpy as np

from minidist.comm import check, fast
from minidist.model.backend import on_device
from minidist.comm.algorithms import bruck, evengather, oneshot, pairwise, pipelined, ring, trees
from minidist.comm.algorithms.blocks import ROWS_RULE
from minidist.comm.errors import CommError
from minidist.comm.launch import (check_algorithm as _algorithm, check_group as _check_group,
                                  check_out as _check_out, host_array as _host, launch as _launch)
from minidist.comm.p2p import TAG_COLLECTIVE as TAG, _isend, _recv, _waitall
from minidist.comm.reducing import all_reduce, reduce, reduce_scatter
from minidist.comm.rooted import gather, scatter
# Read as this module's names, so that a test or a benchmark can move one for the comm layer alone.
from minidist.layout.thresholds import (ALL_GATHER_ONE_SHOT_BYTES, ALL_TO_ALL_V_ONE_SHOT_BYTES, ONE_SHOT_MAX_RANKS,
                                       SMALL_BROADCAST_BYTES)



# ------------------------------------------------------------ data movement
def all_gather(x, g, async_op: bool = False, *, out=None, algorithm: str = "auto"):
    """Concatenate every rank's ``x`` along axis 0, on every rank.

    The first dims may differ, by at most one row between any two ranks (as np.array_split
    produces; ROWS_RULE): a larger difference raises a CommError on every rank.  ``out=``
    (the same shape on every rank) with N dividing out.shape[0] fixes every block's size,
    and the blocks then go straight into ``out`` (evengather.py).  See
    :func:`all_gather_algorithm` for the choice; ``algorithm=`` forces "ring" (the textbook
    ring, after a Bruck exchange of the row counts unless ``out=`` fixes them), "direct"
    (one-shot) or "doubling" (both need such an ``out=``, doubling also N a power of two),
    or "bruck".
    """
    call = ("all_gather", None if out is None else getattr(out, "shape", None))
    result = fast.run(g, x, out, async_op, call) if algorithm == "auto" else None
    if result is not None:
        return result
    _check_group(g, "all_gather")
    _algorithm(algorithm, ("auto", "ring", "direct", "doubling", "bruck"), "all_gather")
    xh = _host(x, "all_gather")
    check.need_axis0(xh, "all_gather")
    out = _check_out(out, xh, "all_gather")
    if algorithm in ("direct", "doubling") and g.size > 1 and not (
            evengather.applies(g.size, out) and (algorithm == "direct" or g.size & (g.size - 1) == 0)):
        raise ValueError(f"all_gather: algorithm={algorithm!r} needs out= whose first dim is a multiple of the "
                         f"group size{' (a power of two)' if algorithm == 'doubling' else ''}; got {g.size} ranks "
                         f"and out.shape={None if out is None else out.shape}")
    if out is not None and g.size > 1 and out.shape[1:] != xh.shape[1:]:
        raise ValueError(f"all_gather: out.shape={out.shape} but the rows have shape {xh.shape[1:]}")
    chosen = all_gather_algorithm(g.size, xh, out, algorithm)
    # out's shape is part of the signature: it picks the algorithm, so ranks must agree on it.
    sig = ("all_gather", xh, dict(rule="trailing", extra=None if out is None else out.shape))
    result = _launch("all_gather", _all_gather, g, xh, sig, async_op, out, chosen, algorithm=chosen,
                     device=on_device(x))
    if algorithm == "auto":
        fast.remember(g, x, out, async_op, call, chosen)
    return result


def all_gather_algorithm(n: int, x, out, algorithm: str = "auto") -> str:
    """Which all-gather runs, the same on every rank (it depends on shapes only):
    "copy" (one rank); with an ``out=`` of N equal blocks, "direct" (one-shot round: small
    results, and every size on up to ONE_SHOT_MAX_RANKS ranks), "doubling" (N a power of
    two) or "even_ring", except that two ranks above ALL_GATHER_ONE_SHOT_BYTES swap their
    blocks
    straight from x ("pair_even": the one-shot round's messages, which its cached plan sends
    on persistent requests); otherwise "pair" (two ranks, one swap), "ring_rows" (forced
    ring) or "bruck"."""
    if n == 1:
        return "copy"
    if algorithm != "bruck" and evengather.applies(n, out):
        if algorithm == "auto":
            small = out.nbytes <= ALL_GATHER_ONE_SHOT_BYTES
            if n == 2 and not small:  # the swap straight from x: the one-shot round's messages, no copy
                return "pair_even" if n <= ONE_SHOT_MAX_RANKS else "pair"
            algorithm = "direct" if small or n <= ONE_SHOT_MAX_RANKS else "doubling" if n & (n - 1) == 0 else "ring"
        return "even_ring" if algorithm == "ring" else algorithm
    if algorithm == "ring":
        return "ring_rows"
    if n == 2 and 0 not in x.shape[1:] and algorithm == "auto":
        return "pair"
    return "bruck"


def _all_gather(g, x, out, chosen):
    if chosen == "copy":
        return x.copy() if out is None else _fill(out, x)
    if chosen in ("direct", "doubling", "even_ring"):
        return evengather.even_all_gather(g, x, out, chosen.replace("even_", ""))
    if chosen in ("pair", "pair_even"):
        return pairwise.pair_all_gather(g, x, out)
    if chosen == "ring_rows":
        return _ring_all_gather_rows(g, x, out)
    return bruck.bruck_all_gather_rows(g, x, out)


def _ring_all_gather_rows(g, x, result):
    """Row counts first (a Bruck all-gather of one int64 per rank), then the ring in place."""
    rows = bruck.bruck_all_gather(g, np.array([x.shape[0]], np.int64).view(np.uint8)).view(np.int64)[:, 0]
    if rows.max() - rows.min() > 1:
        raise CommError(f"all_gather: row counts {rows.tolist()} break the rule: {ROWS_RULE}")
    unit = math.prod(x.shape[1:])  # elements per row (math.prod: np.prod costs microseconds)
    edges = np.concatenate([[0], np.cumsum(rows)]) * unit * x.itemsize
    shape = (int(rows.sum()),) + x.shape[1:]
    if result is None:
        result = np.empty(shape, x.dtype)
    elif result.shape != shape:
        raise ValueError(f"all_gather: out.shape={result.shape}, expected {shape}")
    # The ring works on a flat byte view, so any dtype (bfloat16 too) travels as is.
    flat, bounds = result.reshape(-1).view(np.uint8), [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:])]
    lo, hi = bounds[g.rank]
    flat[lo:hi] = np.ascontiguousarray(x).reshape(-1).view(np.uint8)
    ring.ring_all_gather(g, flat, bounds)
    return result


def _fill(out, value):
    out[...] = value
    return out


def broadcast(x, g, root: int = 0, async_op: bool = False, *, algorithm: str = "auto"):
    """Every rank gets a copy of root's ``x`` (others pass any array of that shape/dtype).

    Small: binomial tree, ceil(log2 N) rounds (trees.py).  Large: pipelined chain, N-2+C
    chunk steps for C chunks; every rank receives and sends X once (pipelined.py).
    """
    _check_group(g, "broadcast")
    root = check.check_root(root, g, "broadcast")
    _algorithm(algorithm, ("auto", "binomial", "chain"), "broadcast")
    device, x = on_device(x), _host(x, "broadcast")
    if algorithm == "auto":
        algorithm = "binomial" if x.nbytes <= SMALL_BROADCAST_BYTES else "chain"
    sig = ("broadcast", x, dict(root=root))
    return _launch("broadcast", _broadcast, g, x, sig, async_op, root, algorithm, algorithm=algorithm,
                   device=device)


def _broadcast(g, x, root, algorithm):
    out = x.copy() if g.rank == root else np.empty(x.shape, x.dtype)
    if g.size == 1:
        return out
    if algorithm == "binomial":
        trees.binomial_broadcast(g, out.reshape(-1), root)
    else:
        pipelined.chain_broadcast(g, out.reshape(-1), root)
    return out


def all_to_all(x, g, async_op: bool = False):
    """Axis 0 of ``x`` in N parts (``np.array_split``); part j goes to rank j; the result is
    the received parts concatenated in rank order.  Pairwise exchange: N-1 steps, in step k
    rank r sends to r+k and receives from r-k; (N-1)/N * X bytes per rank.  All ranks must
    pass the same shape."""
    _check_group(g, "all_to_all")
    device, x = on_device(x), _host(x, "all_to_all")
    check.need_axis0(x, "all_to_all")
    sig = ("all_to_all", x, dict())
    return _launch("all_to_all", pairwise.pairwise_all_to_all, g, x, sig, async_op, device=device)


def all_to_all_v(x, counts, g, async_op: bool = False, *, algorithm: str = "auto"):
    """Rows of ``x`` (axis 0) to each rank, a different number to each (MPI's Alltoallv).

    ``counts[j]`` rows go to rank j, in order: rank 0 gets the first ``counts[0]`` rows,
    rank 1 the next ``counts[1]``, ... (``sum(counts) == x.shape[0]``; any count may be 0).
    Returns ``(y, recv_counts)``: the rows received, concatenated in source-rank order, and
    ``recv_counts[j]``, how many came from rank j (an int64 array).  The trailing shape and
    the dtype must agree on every rank; the counts need not.  The counts are exchanged
    first, then the rows: "pairwise" (the textbook, pairwise.py: N-1 steps each) or
    "direct" (oneshot.py: each exchange one round of messages posted at once; the same
    messages); "auto" runs "direct" with the fast path on, on three or more ranks, from
    ALL_TO_ALL_V_ONE_SHOT_BYTES of rows up, and "pairwise" otherwise.  With ``async_op=True`` the
    handle's ``wait()`` returns the pair.  Its differentiable form is
    ``comm.functional.all_to_all_v``.  With the fast path on, "auto" on host arrays, not
    async, runs the group's cached plan instead, at every size (fast/alltoallv.py: the same
    messages, the rows sent along with the counts, one round)."""
    result = fast.all_to_all_v(g, x, counts, async_op) if algorithm == "auto" else None
    if result is not None:
        return result
    _check_group(g, "all_to_all_v")
    _algorithm(algorithm, ("auto", "pairwise", "direct"), "all_to_all_v")
    device, x = on_device(x), _host(x, "all_to_all_v")
    check.need_axis0(x, "all_to_all_v")
    counts = check.check_counts(counts, g, x.shape[0], "all_to_all_v")
    if algorithm == "auto":
        big = g.size > 2 and x.nbytes >= ALL_TO_ALL_V_ONE_SHOT_BYTES
        algorithm = "direct" if fast.fast_path_enabled() and big else "pairwise"
    sig = ("all_to_all_v", x, dict(rule="trailing"))
    body = oneshot.one_shot_all_to_all_v if algorithm == "direct" else pairwise.pairwise_all_to_all_v
    # launch moves the rows only (the counts stay on the host)
    return _launch("all_to_all_v", body, g, x, sig, async_op, counts, algorithm=algorithm, device=device)


def ppermute(x, g, perm, async_op: bool = False):
    """Send ``x`` along the (src, dst) pairs of ``perm`` (each rank sends and receives at
    most once); ranks that receive nothing get zeros.  One message per pair, all at once,
    so a cyclic shift [(i, (i+1) % N)] is one ring step."""
    _check_group(g, "ppermute")
    pairs = check.check_perm(perm, g)
    device, x = on_device(x), _host(x, "ppermute")
    sig = ("ppermute", x, dict(extra=pairs))
    return _launch("ppermute", _ppermute, g, x, sig, async_op, pairs, device=device)


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
        _waitall([request])
    return out


def barrier(g, async_op: bool = False):
    """Return only after every rank of ``g`` has called barrier (dissemination algorithm,
    Hensgen, Finkel & Manber 1988: ceil(log2 N) rounds of empty messages)."""
    _check_group(g, "barrier")
    sig = ("barrier", None, dict(rule="none"))
    return _launch("barrier", lambda grp, _x: trees.dissemination_barrier(grp), g, None, sig, async_op,
                   device=False)


__all__ = ["all_reduce", "reduce_scatter", "reduce", "all_gather", "broadcast", "scatter",
           "gather", "all_to_all", "all_to_all_v", "ppermute", "barrier"]


# ------------------------------------------------------------------------------- tracing
_untraced = {name: globals()[name] for name in __all__}


def trace_calls(wrap) -> None:
    """Time every public collective (minidist/observe/trace.py): ``wrap(name, fn)`` gives the traced
    function, installed here and in ``minidist.comm`` (where callers find them: ``comm.X``);
    ``trace_calls(None)`` puts the plain functions back.  Swapped only while a tracer runs, so
    an untraced call costs nothing more than before."""
    import sys

    package = sys.modules["minidist.comm"]  # the package that re-exports these (loaded: it loads this module)
    for name, fn in _untraced.items():
        f = fn if wrap is None else wrap(name, fn)
        globals()[name] = f
        setattr(package, name, f)
