"""The collectives users call, each a short function built from point-to-point messages.

Every public function here takes and returns backend arrays (never modifying its input),
validates its arguments on every rank before sending anything, records itself in the
rank's recent-ops log, charges its traffic to its own name in ``comm.stats()``, and, with
``async_op=True``, runs on the group's progress thread and returns a handle whose
``wait()`` gives the result.

Algorithms (X = bytes of the input, N = group size; see ring.py and tree.py):

=============== ============================================ ==============================
collective      algorithm                                    sent per rank
=============== ============================================ ==============================
all_reduce      small: recursive doubling, log2 N rounds     log2(N) * X
                large: ring reduce-scatter + all-gather      2(N-1)/N * X
reduce_scatter  ring, N-1 steps                              (N-1)/N * X
all_gather      ring, N-1 steps (+ Bruck size exchange)      (N-1) * X_own
broadcast       small: binomial tree; large: pipelined chain tree: <= log2(N) X; chain: X
reduce          small: binomial tree; large: pipelined chain tree: X; chain: X
scatter/gather  linear at the root, N-1 messages             root: (N-1)/N * X
all_to_all      pairwise exchange, N-1 steps                 (N-1)/N * X
ppermute        one Isend + one Recv                         X (if it sends)
barrier         dissemination, ceil(log2 N) rounds           0
=============== ============================================ ==============================

The size thresholds between the latency- and bandwidth-optimal algorithms are module
constants, chosen from ``benchmarks/bench_collectives.py`` measurements on the development
machine (see the comments); ``algorithm=`` overrides them per call (the tests force each path).
"""

from __future__ import annotations

import numpy as np

from minidist.backend import bfloat16, from_host, to_host
from minidist.comm import check, reduction, stats, tree
from minidist.comm.group import Group
from minidist.comm.p2p import TAG_COLLECTIVE as TAG, TAG_META, _isend, _recv, _send, _sendrecv
from minidist.comm.ring import (chain_broadcast, chain_reduce, ring_all_gather, ring_all_reduce,
                                ring_reduce_scatter, split_bounds)
from mpi4py import MPI

# Measured crossover (benchmarks/bench_collectives.py, 2-core dev machine, float32): with 2
# ranks recursive doubling beats the ring up to 256 KB (110 vs 147 us at 64 KB, 210 vs 212 us
# at 256 KB, 599 vs 481 us at 1 MB); with 4 oversubscribed ranks it wins even at 1 MB.  Above
# 256 KB the ring's smaller traffic (2(N-1)/N vs log2 N times X) pays off on real links.
SMALL_ALL_REDUCE_BYTES = 256 * 1024
# Binomial tree below, pipelined chain above.
SMALL_BROADCAST_BYTES = 256 * 1024


# ------------------------------------------------------------------------ plumbing
def _host(x, where: str) -> np.ndarray:
    h = to_host(x)
    if isinstance(h, np.generic):  # a NumPy scalar, e.g. a loss value
        h = np.asarray(h)
    if not isinstance(h, np.ndarray):
        raise TypeError(f"{where}: expected an array, got {type(x).__name__}")
    if h.dtype.hasobject:
        raise TypeError(f"{where}: arrays of Python objects (dtype {h.dtype}) cannot be sent")
    return h if h.flags.c_contiguous else np.ascontiguousarray(h)


def _check_group(g, where: str) -> None:
    if not isinstance(g, Group):
        raise TypeError(f"{where}: expected a comm.Group as the group, got {type(g).__name__}")


def _launch(name: str, body, g, x, sig, async_op: bool, *args):
    """Run ``body(g, x, *args)`` here or on the group's progress thread.

    ``sig`` = (name, x, keyword arguments of check.signature); the signature is only built
    (and agreed on) in debug mode, keeping the default path cheap for small messages.
    """
    stats.note_op(name, g.name, None if x is None else x.shape, None if x is None else x.dtype,
                  "async" if async_op else "")
    sig = check.signature(sig[0], sig[1], **sig[2]) if check.check_enabled() else None
    if async_op:
        return g.submit(name, _run, name, body, x, sig, args)
    return _run(g, name, body, x, sig, args)


def _run(g, name, body, x, sig, args):
    with stats.scope(name):
        if sig is not None:
            check.agree(g, sig)
        result = body(g, x, *args)
    return None if result is None else from_host(result)


def _check_out(out, x, where: str, shape=None):
    """``out=``: a preallocated result array (C-contiguous NumPy, x's dtype), so repeated
    large collectives (gradient buckets, benchmarks) reuse memory instead of page-faulting
    a fresh result each call, just like MPI's caller-provided receive buffers."""
    if out is None:
        return None
    if not isinstance(out, np.ndarray) or not out.flags.c_contiguous or out.dtype != x.dtype:
        raise ValueError(f"{where}: out must be a C-contiguous host array of dtype {x.dtype}, got "
                         f"{type(out).__name__} {getattr(out, 'dtype', '')}")
    if shape is not None and out.shape != tuple(shape):
        raise ValueError(f"{where}: out.shape={out.shape} but the result has shape {tuple(shape)}")
    return out


def _algorithm(algorithm, choices, where: str):
    if algorithm not in choices:
        raise ValueError(f"{where}: algorithm={algorithm!r}; choose one of {list(choices)}")
    return algorithm


# ---------------------------------------------------------------- reductions
def all_reduce(x, g, op: str = "sum", async_op: bool = False, *, algorithm: str = "auto", out=None):
    """Every rank gets the elementwise reduction (sum/avg/max/min) of all ranks' ``x``.

    Small messages (<= SMALL_ALL_REDUCE_BYTES): recursive doubling, log2(N) rounds,
    log2(N) * X bytes per rank (Thakur, Rabenseifner & Gropp 2005).  Large: ring
    reduce-scatter + ring all-gather, 2(N-1) steps, 2(N-1)/N * X bytes per rank, the
    bandwidth lower bound (Patarasuk & Yuan 2009).  float16/bfloat16 accumulate in float32.
    """
    _check_group(g, "all_reduce")
    op = reduction.check_op(op, "all_reduce")
    _algorithm(algorithm, ("auto", "recursive_doubling", "ring"), "all_reduce")
    x = _host(x, "all_reduce")
    reduction.check_dtype(x.dtype, "all_reduce")
    out = _check_out(out, x, "all_reduce", x.shape)
    sig = ("all_reduce", x, dict(op=op))
    return _launch("all_reduce", _all_reduce, g, x, sig, async_op, op, algorithm, out)


def _all_reduce(g, x, op, algorithm, out=None):
    ufunc, acc_dtype = reduction.UFUNCS[op], reduction.accumulator_dtype(x.dtype)
    if algorithm == "auto":
        small = x.size * acc_dtype.itemsize <= SMALL_ALL_REDUCE_BYTES or x.size < g.size
        algorithm = "recursive_doubling" if small else "ring"
    # Work directly in the caller's out= when no float32 accumulator is needed.
    acc = out.reshape(-1) if out is not None and out.dtype == acc_dtype else None
    if g.size == 1 or algorithm == "recursive_doubling":
        if acc is None:
            acc = x.reshape(-1).astype(acc_dtype)  # a copy: the input is never modified
        else:
            acc[...] = x.reshape(-1)
        if g.size > 1:
            tree.recursive_doubling_all_reduce(g, acc, ufunc)
    else:
        acc = np.empty(x.size, acc_dtype) if acc is None else acc
        ring_all_reduce(g, reduction.to_accumulator(x), acc, ufunc)
    result = reduction.finish(acc, op, g.size, x.dtype).reshape(x.shape)
    if out is None:
        return result
    if not np.may_share_memory(result, out):  # computed in a float32 accumulator
        out[...] = result
    return out


def reduce_scatter(x, g, op: str = "sum", async_op: bool = False):
    """Reduce all ranks' ``x``, then rank i keeps part i of axis 0 (``np.array_split`` sizes).

    Ring: N-1 steps, each rank sends and receives (N-1)/N * X bytes (Patarasuk & Yuan
    2009).  float16/bfloat16 accumulate in float32.
    """
    _check_group(g, "reduce_scatter")
    op = reduction.check_op(op, "reduce_scatter")
    x = _host(x, "reduce_scatter")
    check.need_axis0(x, "reduce_scatter")
    reduction.check_dtype(x.dtype, "reduce_scatter")
    sig = ("reduce_scatter", x, dict(op=op))
    return _launch("reduce_scatter", _reduce_scatter, g, x, sig, async_op, op)


def _reduce_scatter(g, x, op):
    n, r = g.size, g.rank
    unit = int(np.prod(x.shape[1:], dtype=np.int64))
    bounds = split_bounds(x.shape[0], n, unit)
    xin = reduction.to_accumulator(x)
    lo, hi = bounds[r]
    result = np.empty(hi - lo, xin.dtype)
    if n == 1:
        result[...] = xin
    else:
        biggest = max(b - a for a, b in bounds)
        partial = [g.scratch("rs_partial0", biggest, xin.dtype), g.scratch("rs_partial1", biggest, xin.dtype)]

        def dest(block, step):
            size = bounds[block][1] - bounds[block][0]
            return result if step == n - 2 else partial[step % 2][:size]

        ring_reduce_scatter(g, xin, bounds, reduction.UFUNCS[op], dest)
    first, last = split_bounds(x.shape[0], n)[r]
    return reduction.finish(result, op, n, x.dtype).reshape((last - first,) + x.shape[1:])


def reduce(x, g, root: int = 0, op: str = "sum", async_op: bool = False, *, algorithm: str = "auto"):
    """The reduction of all ranks' ``x`` on ``root``; other ranks get None.

    Small: binomial tree, ceil(log2 N) rounds, each rank sends X at most once.  Large:
    pipelined chain towards the root, every rank sends X once while all links work at the
    same time (Thakur et al. 2005).  float16/bfloat16 accumulate in float32.
    """
    _check_group(g, "reduce")
    root = check.check_root(root, g, "reduce")
    op = reduction.check_op(op, "reduce")
    _algorithm(algorithm, ("auto", "binomial", "chain"), "reduce")
    x = _host(x, "reduce")
    reduction.check_dtype(x.dtype, "reduce")
    sig = ("reduce", x, dict(op=op, root=root))
    return _launch("reduce", _reduce, g, x, sig, async_op, root, op, algorithm)


def _reduce(g, x, root, op, algorithm):
    ufunc, acc_dtype = reduction.UFUNCS[op], reduction.accumulator_dtype(x.dtype)
    if algorithm == "auto":
        algorithm = "binomial" if x.size * acc_dtype.itemsize <= SMALL_BROADCAST_BYTES else "chain"
    if g.size == 1 or algorithm == "binomial":
        acc = x.reshape(-1).astype(acc_dtype)
        if g.size > 1:
            tree.binomial_reduce(g, acc, root, ufunc)
    else:
        acc = np.empty(x.size, acc_dtype) if g.rank == root else g.scratch("chain_acc", x.size, acc_dtype)
        chain_reduce(g, reduction.to_accumulator(x), acc, root, ufunc)
    if g.rank != root:
        return None
    return reduction.finish(acc, op, g.size, x.dtype).reshape(x.shape)


# ------------------------------------------------------------ data movement
def all_gather(x, g, async_op: bool = False, *, out=None):
    """Concatenate every rank's ``x`` along axis 0, on every rank (first dims may differ).

    A Bruck all-gather of the first dims (ceil(log2 N) tiny messages), then a ring:
    N-1 steps, each rank forwards every other rank's block once ((N-1)/N of the output).
    """
    _check_group(g, "all_gather")
    x = _host(x, "all_gather")
    check.need_axis0(x, "all_gather")
    out = _check_out(out, x, "all_gather")
    sig = ("all_gather", x, dict(rule="trailing"))
    return _launch("all_gather", _all_gather, g, x, sig, async_op, out)


def _all_gather(g, x, result=None):
    n = g.size
    if n == 1:
        return x.copy() if result is None else _fill(result, x)
    rows = tree.bruck_all_gather(g, np.array([x.shape[0]], np.int64).view(np.uint8)).view(np.int64).reshape(-1)
    unit = int(np.prod(x.shape[1:], dtype=np.int64))
    ends = np.cumsum(rows) * unit
    bounds = [(int(e - k * unit), int(e)) for e, k in zip(ends, rows)]
    shape = (int(rows.sum()),) + x.shape[1:]
    out = np.empty(shape, x.dtype) if result is None else _check_out(result, x, "all_gather", shape)
    flat = out.reshape(-1)
    lo, hi = bounds[g.rank]
    flat[lo:hi] = x.reshape(-1)
    ring_all_gather(g, flat, bounds)
    return out


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


def _meta(x) -> np.ndarray:
    """A fixed-size record of shape and dtype (reusing the check signature layout)."""
    return np.frombuffer(check.signature("meta", x).tobytes(), np.uint8).copy()


def _from_meta(raw: np.ndarray):
    sig = raw.view(check.SIGNATURE)[0]
    name = sig["dtype"].decode()
    dtype = bfloat16 if name == "bfloat16" else np.dtype(name)
    return tuple(int(v) for v in sig["shape"][:int(sig["ndim"])]), dtype


def scatter(x, g, root: int = 0):
    """Root's ``x`` split along axis 0 like ``np.array_split``; rank i gets part i.
    Non-root ranks may pass None.  Linear: the root sends N-1 messages (each preceded by a
    128-byte shape/dtype header, so receivers need not know the shape in advance)."""
    _check_group(g, "scatter")
    root = check.check_root(root, g, "scatter")
    if g.rank == root:
        x = _host(x, "scatter")
        check.need_axis0(x, "scatter")
        if x.ndim > check.MAX_DIMS:
            raise ValueError(f"scatter: at most {check.MAX_DIMS} dimensions, got shape {x.shape}")
    else:
        x = None
    sig = ("scatter", x, dict(root=root, rule="none"))
    return _launch("scatter", _scatter, g, x, sig, False, root)


def _scatter(g, x, root):
    if g.rank != root:
        shape, dtype = _from_meta(_recv(g.comm, np.empty(check.SIGNATURE.itemsize, np.uint8), root, TAG_META))
        return _recv(g.comm, np.empty(shape, dtype), root, TAG)
    parts = split_bounds(x.shape[0], g.size)
    requests = []
    for i, (lo, hi) in enumerate(parts):
        if i != root:
            requests += [_isend(g.comm, _meta(x[lo:hi]), i, TAG_META), _isend(g.comm, x[lo:hi], i, TAG)]
    MPI.Request.Waitall(requests)
    lo, hi = parts[root]
    return x[lo:hi].copy()


def gather(x, g, root: int = 0):
    """Root gets every rank's ``x`` concatenated along axis 0 (first dims may differ);
    others get None.  Linear: N-1 messages into the root, each after an 8-byte row count."""
    _check_group(g, "gather")
    root = check.check_root(root, g, "gather")
    x = _host(x, "gather")
    check.need_axis0(x, "gather")
    sig = ("gather", x, dict(root=root, rule="trailing"))
    return _launch("gather", _gather, g, x, sig, False, root)


def _gather(g, x, root):
    if g.rank != root:
        _send(g.comm, np.array([x.shape[0]], np.int64), root, TAG_META)
        _send(g.comm, x, root, TAG)
        return None
    rows = np.empty(g.size, np.int64)
    for i in range(g.size):
        rows[i] = x.shape[0] if i == root else _recv(g.comm, np.empty(1, np.int64), i, TAG_META)[0]
    out = np.empty((int(rows.sum()),) + x.shape[1:], x.dtype)
    start = 0
    for i in range(g.size):
        block = out[start:start + rows[i]]
        if i == root:
            block[...] = x
        else:
            _recv(g.comm, block, i, TAG)
        start += rows[i]
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
