"""The reducing collectives: all_reduce, reduce_scatter and reduce (re-exported by
:mod:`minidist.comm.collectives`, whose docstring has the table of algorithms).

Each picks a latency-optimal algorithm for small messages and a bandwidth-optimal one for
large ones, at thresholds measured on the development machine (module constants, with the
measurements beside them); ``algorithm=`` overrides the choice per call.  float16 and
bfloat16 accumulate in float32 (reduction.py).  Repeated small synchronous calls of
all_reduce and reduce_scatter run a plan cached on the group (fastpath.py).
"""

from __future__ import annotations

import math

import numpy as np

from minidist.comm import check, direct, fastpath, fastscatter, links, reduction, ring, stats, tree
from minidist.comm.group import Group
from minidist.comm.launch import (check_algorithm as _algorithm, check_group as _check_group,
                                  check_out as _check_out, host_array as _host, launch as _launch)
from minidist.comm.ring import chain_reduce, ring_all_reduce, ring_reduce_scatter, split_bounds

# All-reduce: recursive doubling up to these sizes, pairwise reduce-scatter + all-gather
# above (benchmarks/bench_collectives.py, crossover table; float32, median us of two
# launches, load 1.3-2.4), recursive doubling / pairwise:
#   2 ranks: 256 KB 91-95 / 128-132, 512 KB 162-166 / 192, 1 MB 356-368 / 297-312,
#            4 MB 2025-2133 / 1706-1750 (doubling sends X a round in one message but adds
#            all of it; pairwise adds only X/N per rank and pipelines the chunks)
#   4 ranks: 256 KB 417-456 / 505-600, 512 KB 748-788 / 723-790, 1 MB 1560-1736 / 1113-1242
# Earlier runs at load 4-6 put the crossover higher (every extra synchronisation may cost a
# scheduler time slice when ranks outnumber cores), so it moves with the load.
SMALL_ALL_REDUCE_BYTES = 512 << 10      # groups of 2
SMALL_ALL_REDUCE_BYTES_WIDE = 512 << 10  # groups of 3 or more
# reduce: binomial tree below, pipelined chain above.
SMALL_REDUCE_BYTES = 256 * 1024


def all_reduce(x, g, op: str = "sum", async_op: bool = False, *, algorithm: str = "auto", out=None):
    """Every rank gets the elementwise reduction (sum/avg/max/min) of all ranks' ``x``.

    Small messages (<= SMALL_ALL_REDUCE_BYTES[_WIDE]): recursive doubling, log2(N) rounds,
    log2(N) * X bytes per rank (Thakur, Rabenseifner & Gropp 2005).  Large ("pairwise"):
    reduce-scatter + all-gather, each by its fastest large-message algorithm
    (:func:`pairwise_all_reduce`), 2(N-1)/N * X bytes per rank, the bandwidth lower bound.
    ``algorithm=`` also offers the textbook ring (ring reduce-scatter + ring all-gather,
    2(N-1) steps; Patarasuk & Yuan 2009) and, on 2, 4, 8, ... ranks, Rabenseifner's
    halving + doubling (2 log2 N rounds; tree.rabenseifner_all_reduce).
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
    _algorithm(algorithm, ("auto", "recursive_doubling", "ring", "rabenseifner", "pairwise"), "all_reduce")
    if algorithm == "rabenseifner" and g.size > 1 and g.size & (g.size - 1):
        raise ValueError(f"all_reduce: algorithm='rabenseifner' needs a power-of-two group, "
                         f"but group {g.name!r} has {g.size} ranks")
    x = _host(x, "all_reduce")
    reduction.check_dtype(x.dtype, "all_reduce")
    out = _check_out(out, x, "all_reduce", x.shape)
    sig = ("all_reduce", x, dict(op=op))
    result = _launch("all_reduce", _all_reduce, g, x, sig, async_op, op, algorithm, out)
    if (key is not None and g.size > 1 and fastpath.plain(out, x.dtype)
            and reduction.accumulator_dtype(x.dtype) == x.dtype):
        chosen = _all_reduce_algorithm(g, x, algorithm)
        if chosen == "recursive_doubling" and x.nbytes <= fastpath.PLAN_MAX_BYTES:
            fastpath.store(g, key, fastpath.AllReducePlan(g, x.shape, x.dtype, op))
        elif chosen == "pairwise" and -(-x.size // g.size) * x.itemsize <= ring.PIPELINE_BYTES:
            fastpath.store(g, key, fastscatter.PairwiseAllReducePlan(g, x.shape, x.dtype, op))  # one chunk a step
    return result


def _all_reduce_algorithm(g, x, algorithm):
    if algorithm != "auto":
        return algorithm
    limit = SMALL_ALL_REDUCE_BYTES if g.size <= 2 else SMALL_ALL_REDUCE_BYTES_WIDE
    small = x.size * reduction.accumulator_dtype(x.dtype).itemsize <= limit or x.size < g.size
    return "recursive_doubling" if small else "pairwise"


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
        if algorithm == "pairwise":
            pairwise_all_reduce(g, reduction.to_accumulator(x), acc, ufunc)
        elif algorithm == "rabenseifner":
            tree.rabenseifner_all_reduce(g, reduction.to_accumulator(x), acc, ufunc)
        else:
            ring_all_reduce(g, reduction.to_accumulator(x), acc, ufunc)
    result = reduction.finish(acc, op, g.size, x.dtype).reshape(x.shape)
    if out is None:
        return result
    if not np.may_share_memory(result, out):  # computed in a float32 accumulator
        out[...] = result
    return out


def pairwise_all_reduce(g, x: np.ndarray, out: np.ndarray, ufunc) -> None:
    """All-reduce of flat ``x`` into flat ``out`` = reduce-scatter + all-gather in place
    (the identity the ZeRO and FSDP lectures start from), each half by the algorithm that
    measured fastest for large messages: pairwise exchange (ring.pairwise_reduce_scatter),
    then recursive doubling on 2, 4, 8, ... ranks (tree.recursive_doubling_all_gather), the
    ring otherwise.  2(N-1)/N * X bytes per rank.  Measured (float32, `out=`, ratio to MPI's
    Allreduce): 4 oversubscribed ranks 1 MB 0.97-1.00, 4 MB 1.25-1.29, 16 MB 1.86-1.90 (ring
    0.82 / 1.07 / 1.53, Rabenseifner 0.86 / 1.04 / 1.48); 2 ranks 1 MB 1.22 (ring 0.93).
    """
    bounds = split_bounds(x.size, g.size)
    lo, hi = bounds[g.rank]
    ring.pairwise_reduce_scatter(g, x, bounds, ufunc, out[lo:hi])
    if _halving(g.size) or g.size == 2:
        tree.recursive_doubling_all_gather(g, out, bounds)
    else:
        ring.ring_all_gather(g, out, bounds)


def reduce_scatter(x, g, op: str = "sum", async_op: bool = False, *, algorithm: str = "auto", out=None):
    """Reduce all ranks' ``x``, then rank i keeps part i of axis 0 (``np.array_split`` sizes).

    Up to DIRECT_BYTES: the one-shot exchange (direct.py), every block sent to its owner in
    a single round, the N copies of a block then added in rank order; each rank sends and
    receives (N-1)/N * X bytes.  Medium inputs: the ring, N-1 steps, the same bytes
    (Patarasuk & Yuan 2009); for N = 4, 8, 16, ... recursive halving, the same bytes in
    log2 N rounds.  From PAIRWISE_BYTES up on more than two ranks: pairwise exchange, the
    same bytes again in N-1 steps that do not wait for each other (ring.pairwise_reduce_scatter).
    float16/bfloat16 accumulate in float32.  Repeated calls run a cached plan while the
    messages are small.  ``algorithm="direct"``, ``"ring"``, ``"halving"`` (2, 4, 8... ranks)
    or ``"pairwise"`` forces one.  ``out=``: the caller's result array (its shape is this
    rank's part).
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
    _algorithm(algorithm, ("auto", "direct", "ring", "halving", "pairwise"), "reduce_scatter")
    if algorithm == "halving" and g.size & (g.size - 1):
        raise ValueError(f"reduce_scatter: algorithm='halving' needs a power-of-two group, got {g.size} ranks")
    x = _host(x, "reduce_scatter")
    check.need_axis0(x, "reduce_scatter")
    reduction.check_dtype(x.dtype, "reduce_scatter")
    first, last = split_bounds(x.shape[0], g.size)[g.rank]
    out = _check_out(out, x, "reduce_scatter", (last - first,) + x.shape[1:])
    sig = ("reduce_scatter", x, dict(op=op))
    result = _launch("reduce_scatter", _reduce_scatter, g, x, sig, async_op, op, algorithm, out)
    if (key is not None and g.size > 1 and reduction.accumulator_dtype(x.dtype) == x.dtype
            and fastpath.plain(out, x.dtype)):
        chosen = _reduce_scatter_algorithm(g.size, x.nbytes, "auto")
        if chosen == "direct":  # the plan owns 2X bytes of buffers: small calls only
            if x.nbytes <= fastpath.PLAN_MAX_BYTES:
                fastpath.store(g, key, fastscatter.DirectScatterPlan(g, x.shape, x.dtype, op))
        elif chosen == "halving":  # the plan owns X bytes of partial sums: small calls only
            if x.nbytes <= fastpath.PLAN_MAX_BYTES:
                fastpath.store(g, key, fastscatter.HalvingPlan(g, x.shape, x.dtype, op))
        elif chosen == "ring" and x.nbytes <= ring.PIPELINE_BYTES:  # one chunk a step, like the plan
            fastpath.store(g, key, fastscatter.ReduceScatterPlan(g, x.shape, x.dtype, op))
        elif chosen == "pairwise":
            biggest = -(-x.shape[0] // g.size) * (x.nbytes // max(x.shape[0], 1))  # bytes of the largest block
            if biggest <= ring.PIPELINE_BYTES:  # one chunk a step, like the plan
                fastpath.store(g, key, fastscatter.PairwisePlan(g, x.shape, x.dtype, op))
    return result


# reduce_scatter: pairwise exchange from this input size up, on more than two ranks.
# Measured on 4 and 3 oversubscribed ranks (2 cores, load ~2), ratio to MPI's
# Reduce_scatter_block, pairwise / halving (4 ranks) or ring (3 ranks), general path:
#   4 ranks: 256 KB 0.67 / 0.75, 1 MB 0.60 / 0.53, 16 MB 1.34 / 0.93
#   3 ranks: 256 KB 0.71 / 0.66, 1 MB 0.71 / 0.65, 16 MB 0.95 / 0.82
# (below 1 MB the cached halving and ring plans win by their lower per-call cost).
PAIRWISE_BYTES = 1 << 20
# reduce_scatter: the one-shot exchange (direct.py) up to this input size.  Measured with
# benchmarks/bench_collectives.py (crossover table; float32, cached plans, median us, load
# ~2), one-shot / the algorithm auto takes otherwise:
#   2 ranks: 16 KB 13.1 / 14.2, 64 KB 17.8 / 19.1, 256 KB 44.3 / 47.4, 1 MB 229 / 168
#   4 ranks: 16 KB 56.0 / 76.7, 64 KB 99.4 / 108, 256 KB 211 / 239, 1 MB 698 / 560
# (from 1 MB the pipelined algorithms win: every block is sent whole, and N-1 of them at
# once compete for the same memory bandwidth).
DIRECT_BYTES = 256 << 10


def _reduce_scatter_algorithm(n: int, nbytes: int, algorithm: str) -> str:
    if algorithm != "auto":
        return algorithm
    if nbytes <= DIRECT_BYTES:
        return "direct"
    if n > 2 and nbytes >= PAIRWISE_BYTES:
        return "pairwise"
    return "halving" if _halving(n) else "ring"


def _reduce_scatter(g, x, op, algorithm="auto", out=None):
    n, r = g.size, g.rank
    unit = math.prod(x.shape[1:])  # elements per row (math.prod: np.prod costs microseconds)
    bounds = split_bounds(x.shape[0], n, unit)
    xin = reduction.to_accumulator(x)
    lo, hi = bounds[r]
    # Work directly in the caller's out= when no float32 accumulator is needed.
    result = out.reshape(-1) if out is not None and out.dtype == xin.dtype else np.empty(hi - lo, xin.dtype)
    algorithm = _reduce_scatter_algorithm(n, x.nbytes, algorithm)
    if n == 1:
        result[...] = xin
    elif algorithm == "direct":
        stats.count_bytes(*direct.reduce_scatter(g, xin, bounds, reduction.UFUNCS[op], result))
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
        algorithm = "binomial" if x.size * acc_dtype.itemsize <= SMALL_REDUCE_BYTES else "chain"
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
