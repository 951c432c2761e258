"""The reducing collectives: all_reduce, reduce_scatter and reduce (re-exported by
:mod:`minidist.comm.collectives`, whose docstring has the table of algorithms and the path
of a call).

Each picks a latency-optimal algorithm for small messages and a bandwidth-optimal one for
large ones, at thresholds measured on the development machine (minidist/layout/thresholds.py;
their measurements are in docs/perf-notes.md); ``algorithm=`` overrides the choice per call.
float16 and bfloat16 accumulate in float32 (reduction.py).
"""

from __future__ import annotations

import math

import numpy as np

from minidist.model.backend import on_device
from minidist.comm import check, fast, reduction
from minidist.comm.algorithms import doubling, oneshot, pairwise, pipelined, ring, trees
from minidist.comm.launch import (check_algorithm as _algorithm, check_group as _check_group,
                                  check_out as _check_out, host_array as _host, launch as _launch)
from minidist.layout.split import split_bounds
# The thresholds are read as this module's names, so that a test or a benchmark can move one
# for the comm layer alone.
from minidist.layout.thresholds import (PAIRWISE_BYTES, REDUCE_SCATTER_ONE_SHOT_BYTES, SMALL_ALL_REDUCE_BYTES,
                                        SMALL_ALL_REDUCE_BYTES_WIDE, SMALL_REDUCE_BYTES)


def all_reduce(x, g, op: str = "sum", async_op: bool = False, *, algorithm: str = "auto", out=None):
    """Every rank gets the elementwise reduction (sum/avg/max/min) of all ranks' ``x``.

    Small messages (<= SMALL_ALL_REDUCE_BYTES[_WIDE]): recursive doubling, log2(N) rounds,
    log2(N) * X bytes per rank (Thakur, Rabenseifner & Gropp 2005).  Large ("pairwise"):
    reduce-scatter + all-gather, each by its fastest large-message algorithm
    (:func:`pairwise_all_reduce`), 2(N-1)/N * X bytes per rank, the bandwidth lower bound.
    ``algorithm="ring"`` runs the textbook ring (algorithms/ring.py: ring reduce-scatter +
    ring all-gather, 2(N-1) steps; Patarasuk & Yuan 2009) and ``"rabenseifner"``, on 2, 4,
    8, ... ranks, halving + doubling (2 log2 N rounds).  float16/bfloat16 accumulate in float32.
    """
    call = ("all_reduce", op, algorithm)
    result = fast.run(g, x, out, async_op, call)
    if result is not None:
        return result
    _check_group(g, "all_reduce")
    op = reduction.check_op(op, "all_reduce")
    _algorithm(algorithm, ("auto", "recursive_doubling", "ring", "rabenseifner", "pairwise"), "all_reduce")
    if algorithm == "rabenseifner" and g.size > 1 and g.size & (g.size - 1):
        raise ValueError(f"all_reduce: algorithm='rabenseifner' needs a power-of-two group, "
                         f"but group {g.name!r} has {g.size} ranks")
    xh = _host(x, "all_reduce")
    reduction.check_dtype(xh.dtype, "all_reduce")
    out = _check_out(out, xh, "all_reduce", xh.shape)
    chosen = all_reduce_algorithm(g.size, xh, algorithm)
    sig = ("all_reduce", xh, dict(op=op))
    result = _launch("all_reduce", _all_reduce, g, xh, sig, async_op, op, chosen, out, algorithm=chosen,
                     device=on_device(x))
    fast.remember(g, x, out, async_op, call, chosen)
    return result


def all_reduce_algorithm(n: int, x, algorithm: str = "auto") -> str:
    """"recursive_doubling" up to SMALL_ALL_REDUCE_BYTES[_WIDE] (of the accumulator), else
    "pairwise"; a forced ``algorithm`` as it is."""
    if algorithm != "auto":
        return algorithm
    limit = SMALL_ALL_REDUCE_BYTES if n <= 2 else SMALL_ALL_REDUCE_BYTES_WIDE
    small = x.size * reduction.accumulator_dtype(x.dtype).itemsize <= limit or x.size < n
    return "recursive_doubling" if small else "pairwise"


def _all_reduce(g, x, op, algorithm, out=None):
    ufunc, acc_dtype = reduction.UFUNCS[op], reduction.accumulator_dtype(x.dtype)
    # Work directly in the caller's out= when no float32 accumulator is needed.
    acc = out.reshape(-1) if out is not None and out.dtype == acc_dtype else None
    if g.size == 1 or algorithm == "recursive_doubling":
        if x.dtype != acc_dtype:  # float16/bfloat16: reduce a float32 copy
            acc = x.reshape(-1).astype(acc_dtype)
            doubling.recursive_doubling_all_reduce(g, acc, ufunc)
        else:  # the first round reads x itself (the input is never modified)
            acc = np.empty(x.size, acc_dtype) if acc is None else acc
            doubling.recursive_doubling_all_reduce(g, acc, ufunc, x.reshape(-1))
    else:
        acc = np.empty(x.size, acc_dtype) if acc is None else acc
        run = {"pairwise": pairwise_all_reduce, "rabenseifner": doubling.rabenseifner_all_reduce,
               "ring": ring.ring_all_reduce}[algorithm]
        run(g, reduction.to_accumulator(x), acc, ufunc)
    result = reduction.finish(acc, op, g.size, x.dtype).reshape(x.shape)
    if out is None:
        return result
    if not np.may_share_memory(result, out):  # computed in a float32 accumulator
        out[...] = result
    return out


def pairwise_all_reduce(g, x: np.ndarray, out: np.ndarray, ufunc) -> None:
    """All-reduce of flat ``x`` into flat ``out`` = reduce-scatter + all-gather in place
    (the identity the ZeRO and FSDP lectures start from), each half by the algorithm that
    measured fastest for large messages: pairwise exchange, then recursive doubling on 2, 4,
    8, ... ranks, the ring otherwise.  2(N-1)/N * X bytes per rank."""
    bounds = split_bounds(x.size, g.size)
    lo, hi = bounds[g.rank]
    pairwise.pairwise_reduce_scatter(g, x, bounds, ufunc, out[lo:hi])
    if g.size & (g.size - 1) == 0:
        doubling.recursive_doubling_all_gather(g, out, bounds)
    else:
        ring.ring_all_gather(g, out, bounds)


def reduce_scatter(x, g, op: str = "sum", async_op: bool = False, *, algorithm: str = "auto", out=None):
    """Reduce all ranks' ``x``, then rank i keeps part i of axis 0 (``np.array_split`` sizes).

    Every algorithm sends and receives (N-1)/N * X bytes per rank; they differ in rounds.
    Up to REDUCE_SCATTER_ONE_SHOT_BYTES: the one-shot exchange (oneshot.py), every block sent to its
    owner
    in a single round, the N copies of a block then added in rank order.  Medium inputs:
    recursive halving on 4, 8, 16, ... ranks (log2 N rounds), else the pipelined ring (N-1
    steps; Patarasuk & Yuan 2009).  From PAIRWISE_BYTES up on more than two ranks: pairwise
    exchange, N-1 steps that do not wait for each other.  float16/bfloat16 accumulate in
    float32.  ``algorithm=`` forces "direct", "ring" (the textbook ring), "pipelined_ring",
    "halving" (2, 4, 8... ranks) or "pairwise".  ``out=``: the caller's result array (its
    shape is this rank's part).
    """
    call = ("reduce_scatter", op)
    result = fast.run(g, x, out, async_op, call) if algorithm == "auto" else None
    if result is not None:
        return result
    _check_group(g, "reduce_scatter")
    op = reduction.check_op(op, "reduce_scatter")
    _algorithm(algorithm, ("auto", "direct", "ring", "pipelined_ring", "halving", "pairwise"), "reduce_scatter")
    if algorithm == "halving" and g.size & (g.size - 1):
        raise ValueError(f"reduce_scatter: algorithm='halving' needs a power-of-two group, got {g.size} ranks")
    xh = _host(x, "reduce_scatter")
    check.need_axis0(xh, "reduce_scatter")
    reduction.check_dtype(xh.dtype, "reduce_scatter")
    first, last = split_bounds(xh.shape[0], g.size)[g.rank]
    out = _check_out(out, xh, "reduce_scatter", (last - first,) + xh.shape[1:])
    chosen = reduce_scatter_algorithm(g.size, xh.nbytes, algorithm)
    sig = ("reduce_scatter", xh, dict(op=op))
    result = _launch("reduce_scatter", _reduce_scatter, g, xh, sig, async_op, op, chosen, out, algorithm=chosen,
                     device=on_device(x))
    if algorithm == "auto":
        fast.remember(g, x, out, async_op, call, chosen)
    return result


def reduce_scatter_algorithm(n: int, nbytes: int, algorithm: str = "auto") -> str:
    """The reduce-scatter for an input of ``nbytes`` on ``n`` ranks (see reduce_scatter)."""
    if algorithm != "auto":
        return algorithm
    if nbytes <= REDUCE_SCATTER_ONE_SHOT_BYTES:
        return "direct"
    if n > 2 and nbytes >= PAIRWISE_BYTES:
        return "pairwise"
    return "halving" if n > 2 and n & (n - 1) == 0 else "pipelined_ring"


_REDUCE_SCATTERS = {"direct": oneshot.one_shot_reduce_scatter, "ring": ring.ring_reduce_scatter,
                    "pipelined_ring": pipelined.pipelined_ring_reduce_scatter,
                    "halving": doubling.recursive_halving_reduce_scatter,
                    "pairwise": pairwise.pairwise_reduce_scatter}


def _reduce_scatter(g, x, op, algorithm, out=None):
    n, r = g.size, g.rank
    bounds = split_bounds(x.shape[0], n, math.prod(x.shape[1:]))
    xin = reduction.to_accumulator(x)
    lo, hi = bounds[r]
    # Work directly in the caller's out= when no float32 accumulator is needed.
    result = out.reshape(-1) if out is not None and out.dtype == xin.dtype else np.empty(hi - lo, xin.dtype)
    if n == 1:
        result[...] = xin
    else:
        _REDUCE_SCATTERS[algorithm](g, xin, bounds, reduction.UFUNCS[op], result)
    first, last = split_bounds(x.shape[0], n)[r]
    result = reduction.finish(result, op, n, x.dtype).reshape((last - first,) + x.shape[1:])
    if out is None:
        return result
    if not np.may_share_memory(result, out):  # computed in a float32 accumulator
        out[...] = result
    return out


def reduce(x, g, root: int = 0, op: str = "sum", async_op: bool = False, *, algorithm: str = "auto"):
    """The reduction of all ranks' ``x`` on ``root``; other ranks get None.

    Small: binomial tree, ceil(log2 N) rounds, each rank sends X at most once (trees.py).
    Large: pipelined chain towards the root, every rank sends X once while all links work
    at the same time (pipelined.py).  float16/bfloat16 accumulate in float32.
    """
    _check_group(g, "reduce")
    root = check.check_root(root, g, "reduce")
    op = reduction.check_op(op, "reduce")
    _algorithm(algorithm, ("auto", "binomial", "chain"), "reduce")
    device, x = on_device(x), _host(x, "reduce")
    reduction.check_dtype(x.dtype, "reduce")
    if algorithm == "auto":
        small = x.size * reduction.accumulator_dtype(x.dtype).itemsize <= SMALL_REDUCE_BYTES
        algorithm = "binomial" if small else "chain"
    sig = ("reduce", x, dict(op=op, root=root))
    return _launch("reduce", _reduce, g, x, sig, async_op, root, op, algorithm, algorithm=algorithm, device=device)


def _reduce(g, x, root, op, algorithm):
    ufunc, acc_dtype = reduction.UFUNCS[op], reduction.accumulator_dtype(x.dtype)
    if g.size == 1 or algorithm == "binomial":
        acc = x.reshape(-1).astype(acc_dtype)
        if g.size > 1:
            trees.binomial_reduce(g, acc, root, ufunc)
    else:
        acc = np.empty(x.size, acc_dtype) if g.rank == root else g.scratch("chain_acc", x.size, acc_dtype)
        pipelined.chain_reduce(g, reduction.to_accumulator(x), acc, root, ufunc)
    if g.rank != root:
        return None
    return reduction.finish(acc, op, g.size, x.dtype).reshape(x.shape)
