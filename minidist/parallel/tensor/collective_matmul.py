"""Collective matmuls: an all-gather or reduce-scatter hidden behind the matmuls it feeds.

Sequence-parallel tensor parallelism (parallel/tensor/) all-gathers the sequence before a
column-parallel matmul and reduce-scatters it after a row-parallel one.  The textbook way is
one collective, then the matmul (or the matmul, then one collective): :func:`gather_once`
and :func:`matmul_then_reduce_scatter`.  Wang et al. 2022 ("Overlap Communication with
Dependent Computation via Decomposition in Large Deep Learning Models"), used by ViT-22B
(Dehghani et al. 2023), cut both collectives into the N-1 steps of a ring (``ppermute`` to
the next rank) and run each step while a chunk already present is multiplied:

* **all-gather** (:func:`ring_all_gather`): at step s rank r holds the chunk of rank
  (r - s) mod N; it sends it on to the right while using it.
* **reduce-scatter after a matmul** (:func:`matmul_reduce_scatter`): the partial sum of
  chunk c travels to the right and ends at rank c; each rank adds its own product of the
  chunk passing by, computed while the previous partial sum was on its way.

Per rank and collective: N-1 messages of one chunk, the bytes of the ring all-gather /
reduce-scatter; N-1 of the N chunk matmuls can each hide a step.  The **bidirectional**
variants send the first half of every chunk's rows around to the right and the second
half to the left (two progress threads, one per direction), so each step moves half the
bytes per link direction.

The all-gathers take a ``visit(rows, chunk)`` callback: ``chunk`` holds the rows ``rows``
(a slice of axis 1 of the gathered array) and is used while the next chunk travels, so one
loop serves every use (y = X @ W chunk by chunk, dW += X_c^T dY_c, ...).  Chunks are along
axis 1 (the sequence) of (B, T, C) arrays.  The ring steps run on the group's progress
thread (``comm.ppermute(async_op=True)``); :func:`record_timeline` records when each step
and each chunk matmul ran, which the tests use to check that they overlap.
"""

from __future__ import annotations

import contextlib
import time

from minidist import comm
from minidist.model.backend import xp
from minidist.model.ops.cuda import gemm
from minidist.model.ops.precision import compute_dtype, gemm_operands

_timeline = None  # a list while record_timeline() is active: (kind, start, end) per event


@contextlib.contextmanager
def record_timeline():
    """Record ``(kind, start, end)`` (time.perf_counter) of the collective matmuls run inside
    the block: "matmul" for every chunk matmul, "ppermute" for every ring step (timed on the
    progress thread that moves the data) and "wait" for the time the caller then blocks on
    a step's result (the exposed part of the communication)."""
    global _timeline
    previous, _timeline = _timeline, []
    try:
        yield _timeline
    finally:
        _timeline = previous


def mm(a, w):
    """``a @ w`` for a (B, n, K) chunk and a (K, M) matrix, in the compute dtype (timed)."""
    t0 = time.perf_counter() if _timeline is not None else 0.0
    (a,), _ = gemm_operands(a)
    y = (a.reshape(-1, a.shape[-1]) @ w).reshape(a.shape[:-1] + (w.shape[-1],))
    if _timeline is not None:
        _timeline.append(("matmul", t0, time.perf_counter()))
    return y


def mm_t(a, b):
    """``a^T b`` summed over the rows of (B, n, K) a and (B, n, M) b: a (K, M) weight gradient,
    in float32 for low-precision operands (a sum over every token, as linear's)."""
    t0 = time.perf_counter() if _timeline is not None else 0.0
    (a, b), _ = gemm_operands(a, b)
    y = gemm.matmul(a.reshape(-1, a.shape[-1]).T, b.reshape(-1, b.shape[-1]), dtype=compute_dtype(a.dtype))
    if _timeline is not None:
        _timeline.append(("matmul", t0, time.perf_counter()))
    return y


def _rows(c, n):
    return slice(c * n, (c + 1) * n)


# ------------------------------------------------------------------ the textbook: one collective


def gather_once(x, g, visit):
    """All-gather ``x`` (B, n, K) along axis 1 in one collective, then ``visit`` all of it."""
    gathered = comm.all_gather(xp.ascontiguousarray(xp.moveaxis(x, 1, 0)), g)
    visit(slice(None), xp.moveaxis(gathered, 0, 1))


def matmul_then_reduce_scatter(h, w, g):
    """``reduce_scatter(h @ w, axis=1)``: one matmul, then one collective."""
    partial = mm(h, w)
    mine = comm.reduce_scatter(xp.ascontiguousarray(xp.moveaxis(partial, 1, 0)), g)
    return xp.ascontiguousarray(xp.moveaxis(mine, 0, 1))


# ------------------------------------------------------------------ the ring


def _timed_ppermute(twin, x, perm, log):
    t0 = time.perf_counter()
    out = comm.ppermute(x, twin, perm)
    log.append(("ppermute", t0, time.perf_counter()))
    return out


def _start_shift(x, g, step: int):
    """Start sending ``x`` to rank (r + step) mod N while receiving from (r - step) mod N."""
    perm = [(i, (i + step) % g.size) for i in range(g.size)]
    x = xp.ascontiguousarray(x)
    if _timeline is None:
        handle = comm.ppermute(x, g, perm, async_op=True)
    else:
        handle = g.submit("ppermute", _timed_ppermute, x, perm, _timeline)  # the same call, timed
    # Let go of the GIL for a moment so that the progress thread starts the transfer now,
    # not only once the matmul that follows releases it (measured: up to ~8 ms later on a
    # busy machine, a whole chunk's matmul).
    time.sleep(0)
    return handle


def _wait(handle):
    """A ring step's result; the time the caller blocks here is exposed communication."""
    if _timeline is None:
        return handle.wait()
    t0 = time.perf_counter()
    out = handle.wait()
    _timeline.append(("wait", t0, time.perf_counter()))
    return out


def ring_all_gather(x, g, visit):
    """All-gather ``x`` (B, n, K) along axis 1 in N-1 ring steps; ``visit(rows, chunk)``
    uses each chunk while the next one travels."""
    N, r, n = g.size, g.rank, x.shape[1]
    here = x
    for s in range(N):
        moving = _start_shift(here, g, +1) if s < N - 1 else None
        visit(_rows((r - s) % N, n), here)
        if moving is not None:
            here = _wait(moving)


def matmul_reduce_scatter(h, w, g):
    """``reduce_scatter(h @ w, axis=1)`` in N-1 ring steps, for h (B, N n, K), w (K, M):
    this rank's rows (B, n, M).  At step s rank r adds its product of chunk (r - s - 1)
    mod N to the partial sum arriving from the left."""
    N, r = g.size, g.rank
    n = h.shape[1] // N
    partial = mm(h[:, _rows((r - 1) % N, n)], w)
    for s in range(1, N):
        moving = _start_shift(partial, g, +1)
        mine = mm(h[:, _rows((r - s - 1) % N, n)], w)
        partial = _wait(moving) + mine
    return partial


# ------------------------------------------------------------------ both directions at once


def _halves(rows: slice, n: int):
    """The first and the second half of the ``n`` rows starting at ``rows.start``."""
    k = (n + 1) // 2
    return slice(rows.start, rows.start + k), slice(rows.start + k, rows.stop)


def bidirectional_all_gather(x, g, reverse, visit):
    """:func:`ring_all_gather` with the first half of each chunk's rows going right (on
    ``g``) and the second half going left (on ``reverse``, a second group of the same ranks)."""
    N, r, n = g.size, g.rank, x.shape[1]
    if n < 2:
        return ring_all_gather(x, g, visit)
    k = (n + 1) // 2
    here = {+1: x[:, :k], -1: x[:, k:]}
    for s in range(N):
        moving = {d: _start_shift(here[d], g if d > 0 else reverse, d) for d in here} if s < N - 1 else {}
        for d, half in ((+1, 0), (-1, 1)):
            visit(_halves(_rows((r - d * s) % N, n), n)[half], here[d])
        here = {d: _wait(m) for d, m in moving.items()}


def bidirectional_matmul_reduce_scatter(h, w, g, reverse):
    """:func:`matmul_reduce_scatter` with each chunk's first half of rows summed on the way
    right (on ``g``) and its second half on the way left (on ``reverse``)."""
    N, r = g.size, g.rank
    n = h.shape[1] // N
    if n < 2:
        return matmul_reduce_scatter(h, w, g)

    def product(c, d):
        return mm(h[:, _halves(_rows(c, n), n)[0 if d > 0 else 1]], w)

    partial = {d: product((r - d) % N, d) for d in (+1, -1)}
    for s in range(1, N):
        moving = {d: _start_shift(partial[d], g if d > 0 else reverse, d) for d in partial}
        mine = {d: product((r - d * (s + 1)) % N, d) for d in partial}
        partial = {d: _wait(moving[d]) + mine[d] for d in partial}
    return xp.concatenate([partial[+1], partial[-1]], axis=1)
