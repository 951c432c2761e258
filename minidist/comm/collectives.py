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
                large, N=4,8,..: Rabenseifner, 2 log2 N      2(N-1)/N * X
reduce_scatter  ring, N-1 steps; N=4,8,..: halving, log2 N   (N-1)/N * X
all_gather      N=2: one Sendrecv; N>2: Bruck, log2 N rounds (N-1) * X_own (N>2: + 8(N-1))
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

Repeated synchronous calls of all_reduce, reduce_scatter and all_gather with the same shape
and dtype run a plan cached on the group (fastpath.py): the same algorithm and result with a
fraction of the per-call Python work, which dominates the cost of small messages.
"""

from __future__ import annotations

import numpy as np

from minidist.comm import check, evengather, fastgather, fastpath, links, reduction, ring, stats, tree
from minidist.comm.errors import CommError
from minidist.comm.group import Group
from minidist.comm.launch import (check_algorithm as _algorithm, check_group as _check_group,
                                  check_out as _check_out, host_array as _host, launch as _launch)
from minidist.comm.p2p import TAG_COLLECTIVE as TAG, _isend, _recv, _sendrecv
from minidist.comm.rooted import gather, scatter
from minidist.comm.ring import (chain_broadcast, chain_reduce, pair_all_gather, ring_all_gather,
                                ring_all_reduce, ring_reduce_scatter, split_bounds)

# All-reduce: recursive doubling up to these sizes, the ring (Rabenseifner on 4, 8, ...
# ranks) above.  Measured on the 2-core machine, quiet (load ~1.5), float32, `out=`, median
# us of back-to-back calls, recursive doubling / ring / MPI's Allreduce:
#   2 ranks: 512 KB 150 / 196 / 175, 1 MB 374 / 313 / 338, 2 MB 1010 / 639 / 788,
#            4 MB 2743 / 1762 / 1997 (rd sends X per round in one message but adds all of it;
#            the ring adds only half and pipelines the chunks)
#   4 ranks: 256 KB 410 / 607 (Rabenseifner 482) / 293, 1 MB 1790 / 1510 (1477) / 1161,
#            4 MB 10637 / 6495 (6727) / 6601
# Earlier runs at load 4-6 put the crossover higher (every extra synchronisation of the ring
# may cost a scheduler time slice when ranks outnumber cores), so it moves with the load.
SMALL_ALL_REDUCE_BYTES = 512 << 10      # groups of 2
SMALL_ALL_REDUCE_BYTES_WIDE = 512 << 10  # groups of 3 or more
# Binomial tree below, pipelined chain above.
SMALL_BROADCAST_BYTES = 256 * 1024


# ---------------------------------------------------------------- reductions
def all_reduce(x, g, op: str = "sum", async_op: bool = False, *, algorithm: str = "auto", out=None):
    """Every rank gets the elementwise reduction (sum/avg/max/min) of all ranks' ``x``.

    Small messages (<= SMALL_ALL_REDUCE_BYTES[_WIDE]): recursive doubling, log2(N) rounds,
    log2(N) * X bytes per rank (Thakur, Rabenseifner & Gropp 2005).  Large: ring
    reduce-scatter + ring all-gather, 2(N-1) steps, 2(N-1)/N * X bytes per rank, the
    bandwidth lower bound (Patarasuk & Yuan 2009); on 4, 8, 16, ... ranks the same bytes
    in 2 log2(N) rounds by Rabenseifner's algorithm (tree.rabenseifner_all_reduce), which on
    4 oversubscribed ranks measured 0.82-1.08x MPI at 1-16 MB against the ring's 0.36-0.92x.
    float16/bfloat16 accumulate in float32.  Repeated small calls run a cached plan.
    """
    key = None
    if type(x) is np.ndarray and not (async_op or check._enabled or links.enabled):  # fastpath.usable
        key = ("all_reduce", x.dtype, x.shape, op, algorithm)
        plan = g._plans.get(key) if type(g) is Group and type(op) is str and type(algorithm) is str else None
        result = None if plan is None else plan.run(g, x, out)
        if result is not None:
            return result
    _check_group(g, "all_reduce")
    op = reduction.check_op(op, "all_reduce")
    _algorithm(algorithm, ("auto", "recursive_doubling", "ring", "rabenseifner"), "all_reduce")
    if algorithm == "rabenseifner" and g.size > 1 and g.size & (g.size - 1):
        raise ValueError(f"all_reduce: algorithm='rabenseifner' needs a power-of-two group, "
                         f"but group {g.name!r} has {g.size} ranks")
    x = _host(x, "all_reduce")
    reduction.check_dtype(x.dtype, "all_reduce")
    out = _check_out(out, x, "all_reduce", x.shape)
    sig = ("all_reduce", x, dict(op=op))
    result = _launch("all_reduce", _all_reduce, g, x, sig, async_op, op, algorithm, out)
    if (key is not None and g.size > 1 and _all_reduce_algorithm(g, x, algorithm) == "recursive_doubling"
            and reduction.accumulator_dtype(x.dtype) == x.dtype
            and x.nbytes <= fastpath.PLAN_MAX_BYTES):
        fastpath.store(g, key, fastpath.AllReducePlan(g, x.shape, x.dtype, op))
    return result


def _all_reduce_algorithm(g, x, algorithm):
    if algorithm != "auto":
        return algorithm
    limit = SMALL_ALL_REDUCE_BYTES if g.size <= 2 else SMALL_ALL_REDUCE_BYTES_WIDE
    small = x.size * reduction.accumulator_dtype(x.dtype).itemsize <= limit or x.size < g.size
    return "recursive_doubling" if small else "rabenseifner" if _halving(g.size) else "ring"


def _all_reduce(g, x, op, algorithm, out=None):
    ufunc, acc_dtype = reduction.UFUNCS[op], reduction.accumulator_dtype(x.dtype)
    algorithm = _all_reduce_algorithm(g, x, algorithm)
    # Work directly in the caller's out= when no float32 accumulator is needed.
    acc = out.reshape(-1) if out is not None and out.dtype == acc_dtype else None
    if g.size == 1 or algorithm == "recursive_doubling":
        if x.dtype != acc_dtype:  # float16/bfloat16: reduce a float32 copy
            acc = x.reshape(-1).astype(acc_dtype)
            tree.recursive_doubling_all_reduce(g, acc, ufunc)
        else:  # the first round reads x itself (the input is never modified)
            acc = np.empty(x.size, acc_dtype) if acc is None else acc
            tree.recursive_doubling_all_reduce(g, acc, ufunc, x.reshape(-1))
    else:
        acc = np.empty(x.size, acc_dtype) if acc is None else acc
        if algorithm == "rabenseifner":
            tree.rabenseifner_all_reduce(g, reduction.to_accumulator(x), acc, ufunc)
        else:
            ring_all_reduce(g, reduction.to_accumulator(x), acc, ufunc)
    result = reduction.finish(acc, op, g.size, x.dtype).reshape(x.shape)
    if out is None:
        return result
    if not np.may_share_memory(result, out):  # computed in a float32 accumulator
        out[...] = result
    return out


def reduce_scatter(x, g, op: str = "sum", async_op: bool = False, *, algorithm: str = "auto", out=None):
    """Reduce all ranks' ``x``, then rank i keeps part i of axis 0 (``np.array_split`` sizes).

    Small inputs: the ring, N-1 steps, each rank sends and receives (N-1)/N * X bytes
    (Patarasuk & Yuan 2009); for N = 4, 8, 16, ... recursive halving, the same bytes in
    log2 N rounds.  From PAIRWISE_BYTES up on more than two ranks: pairwise exchange, the
    same bytes again in N-1 steps that do not wait for each other (ring.pairwise_reduce_scatter).
    float16/bfloat16 accumulate in float32.  Repeated small calls run a cached plan (ring or
    halving).  ``algorithm="ring"``, ``"halving"`` (2, 4, 8... ranks) or ``"pairwise"``
    forces one.  ``out=``: the caller's result array (its shape is this rank's part).
    """
    key = None
    if algorithm == "auto" and type(x) is np.ndarray and not (async_op or check._enabled or links.enabled):
        key = ("reduce_scatter", x.dtype, x.shape, op)
        plan = g._plans.get(key) if type(g) is Group and type(op) is str else None
        result = None if plan is None else plan.run(g, x, out)
        if result is not None:
            return result
    _check_group(g, "reduce_scatter")
    op = reduction.check_op(op, "reduce_scatter")
    _algorithm(algorithm, ("auto", "ring", "halving", "pairwise"), "reduce_scatter")
    if algorithm == "halving" and g.size & (g.size - 1):
        raise ValueError(f"reduce_scatter: algorithm='halving' needs a power-of-two group, got {g.size} ranks")
    x = _host(x, "reduce_scatter")
    check.need_axis0(x, "reduce_scatter")
    reduction.check_dtype(x.dtype, "reduce_scatter")
    first, last = split_bounds(x.shape[0], g.size)[g.rank]
    out = _check_out(out, x, "reduce_scatter", (last - first,) + x.shape[1:])
    sig = ("reduce_scatter", x, dict(op=op))
    result = _launch("reduce_scatter", _reduce_scatter, g, x, sig, async_op, op, algorithm, out)
    if key is not None and g.size > 1 and reduction.accumulator_dtype(x.dtype) == x.dtype:
        chosen = _reduce_scatter_algorithm(g.size, x.nbytes, "auto")
        if chosen == "halving":  # the plan owns X bytes of partial sums: small calls only
            if x.nbytes <= fastpath.PLAN_MAX_BYTES:
                fastpath.store(g, key, fastpath.HalvingPlan(g, x.shape, x.dtype, op))
        elif chosen == "ring" and x.nbytes <= ring.PIPELINE_BYTES:  # one chunk a step, like the plan
            fastpath.store(g, key, fastpath.ReduceScatterPlan(g, x.shape, x.dtype, op))
    return result


# reduce_scatter: pairwise exchange from this input size up, on more than two ranks.
# Measured on 4 and 3 oversubscribed ranks (2 cores, load ~2), ratio to MPI's
# Reduce_scatter_block, pairwise / halving (4 ranks) or ring (3 ranks), general path:
#   4 ranks: 256 KB 0.67 / 0.75, 1 MB 0.60 / 0.53, 16 MB 1.34 / 0.93
#   3 ranks: 256 KB 0.71 / 0.66, 1 MB 0.71 / 0.65, 16 MB 0.95 / 0.82
# (below 1 MB the cached halving and ring plans win by their lower per-call cost).
PAIRWISE_BYTES = 1 << 20


def _reduce_scatter_algorithm(n: int, nbytes: int, algorithm: str) -> str:
    if algorithm != "auto":
        return algorithm
    if n > 2 and nbytes >= PAIRWISE_BYTES:
        return "pairwise"
    return "halving" if _halving(n) else "ring"


def _reduce_scatter(g, x, op, algorithm="auto", out=None):
    n, r = g.size, g.rank
    unit = int(np.prod(x.shape[1:], dtype=np.int64))
    bounds = split_bounds(x.shape[0], n, unit)
    xin = reduction.to_accumulator(x)
    lo, hi = bounds[r]
    # Work directly in the caller's out= when no float32 accumulator is needed.
    result = out.reshape(-1) if out is not None and out.dtype == xin.dtype else np.empty(hi - lo, xin.dtype)
    algorithm = _reduce_scatter_algorithm(n, x.nbytes, algorithm)
    if n == 1:
        result[...] = xin
    elif algorithm == "pairwise":
        ring.pairwise_reduce_scatter(g, xin, bounds, reduction.UFUNCS[op], result)
    elif algorithm == "halving":
        tree.recursive_halving_reduce_scatter(g, xin, bounds, reduction.UFUNCS[op], result)
    else:
        biggest = max(b - a for a, b in bounds)
        partial = [g.scratch("rs_partial0", biggest, xin.dtype), g.scratch("rs_partial1", biggest, xin.dtype)]

        def dest(block, step):
            size = bounds[block][1] - bounds[block][0]
            return result if step == n - 2 else partial[step % 2][:size]

        ring_reduce_scatter(g, xin, bounds, reduction.UFUNCS[op], dest)
    first, last = split_bounds(x.shape[0], n)[r]
    result = reduction.finish(result, op, n, x.dtype).reshape((last - first,) + x.shape[1:])
    if out is None:
        return result
    if not np.may_share_memory(result, out):  # computed in a float32 accumulator
        out[...] = result
    return out


def _halving(n: int) -> bool:
    """reduce_scatter algorithm: recursive halving for 4, 8, 16 ... ranks (log2 N rounds),
    the ring otherwise (for 2 ranks they are the same single exchange).  Measured on 4
    oversubscribed ranks (2 cores, load ~5), ratio to MPI's Reduce_scatter_block, halving
    vs ring: 4 KB 0.91 vs 0.82, 64 KB 0.96 vs 0.34, 1 MB 1.9 vs 0.77, 16 MB 0.95 vs 0.75.
    Both send (N-1)/N * X; halving needs log2 N synchronisations instead of N-1."""
    return n > 2 and n & (n - 1) == 0


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
def all_gather(x, g, async_op: bool = False, *, out=None, algorithm: str = "auto"):
    """Concatenate every rank's ``x`` along axis 0, on every rank.

    The first dims may differ, by at most one row between any two ranks (as np.array_split
    produces; ring.ROWS_RULE): a larger difference raises a CommError on every rank.

    Which algorithm (``"auto"``):
    * two ranks: one Sendrecv; the receiver learns the other's row count from the message
      size (ring.pair_all_gather);
    * ``out=`` given with N dividing out.shape[0] (so every block has out.shape[0]/N rows):
      straight from ``out`` to ``out`` with no row counts on the wire (evengather.py),
      by recursive doubling (log2 N rounds) when N is a power of two, else by the ring
      (N-1 steps); (N-1)/N * X bytes per rank.  ``out=`` must then have the same shape on
      every rank;
    * otherwise a Bruck all-gather, ceil(log2 N) rounds, each block sent behind its row
      count (tree.bruck_all_gather_rows); every rank receives every other block once.

    ``algorithm="ring"`` forces the textbook ring (N-1 steps, (N-1)/N * X bytes per rank,
    Patarasuk & Yuan 2009), after a Bruck exchange of the row counts (8 bytes a rank) unless
    ``out=`` already fixes them; ``"doubling"`` forces recursive doubling (needs such an
    ``out=`` and N a power of two); ``"bruck"`` forces the Bruck all-gather.
    Repeated calls with the same shape skip the argument checks (fastpath.py).
    """
    if algorithm == "auto" and type(x) is np.ndarray and not (async_op or check._enabled or links.enabled):
        key = ("all_gather", x.dtype, x.shape, None if out is None else getattr(out, "shape", None))
        plan = g._plans.get(key) if type(g) is Group else None
        result = None if plan is None else plan.run(g, x, out)
        if result is not None:
            return result
    _check_group(g, "all_gather")
    _algorithm(algorithm, ("auto", "ring", "doubling", "bruck"), "all_gather")
    x = _host(x, "all_gather")
    check.need_axis0(x, "all_gather")
    out = _check_out(out, x, "all_gather")
    if algorithm == "doubling" and not (evengather.applies(g.size, x, out) and g.size & (g.size - 1) == 0):
        raise ValueError(f"all_gather: algorithm='doubling' needs a power-of-two group and out= whose first "
                         f"dim is a multiple of it; got {g.size} ranks and out.shape="
                         f"{None if out is None else out.shape}")
    # out's shape is part of the signature: it picks the algorithm, so ranks must agree on it.
    sig = ("all_gather", x, dict(rule="trailing", extra=None if out is None else out.shape))
    result = _launch("all_gather", _all_gather, g, x, sig, async_op, out, algorithm)
    if algorithm == "auto" and type(x) is np.ndarray and not async_op:
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
    if algorithm != "bruck" and evengather.applies(n, x, result) and not (n == 2 and algorithm == "auto"):
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


def _ring_all_gather_rows(g, x, result):
    """Row counts first (a Bruck all-gather of one int64 per rank), then the ring in place."""
    rows = tree.bruck_all_gather(g, np.array([x.shape[0]], np.int64).view(np.uint8)).view(np.int64)[:, 0]
    if rows.max() - rows.min() > 1:
        raise CommError(f"all_gather: row counts {rows.tolist()} break the rule: {ring.ROWS_RULE}")
    unit = int(np.prod(x.shape[1:], dtype=np.int64))
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
