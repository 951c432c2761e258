"""Collective matmuls: an all-gather or reduce-scatter hidden behind the matmul it feeds.

Sequence-parallel tensor parallelism (parallel/tensor.py) all-gathers the sequence before a
column-parallel matmul and reduce-scatters it after a row-parallel one.  Wang et al. 2022
("Overlap Communication with Dependent Computation via Decomposition in Large Deep Learning
Models"), used by ViT-22B (Dehghani et al. 2023), cut both collectives into the N-1 steps
of a ring (``ppermute`` to the next rank) and run each step while the matmul of a chunk
already present computes:

* **all-gather, then matmul** (:func:`all_gather_matmul`): at step s rank r holds the input
  chunk of rank (r - s) mod N; it sends it on to the right while multiplying it.
* **matmul, then reduce-scatter** (:func:`matmul_reduce_scatter`): the partial sum of
  chunk c travels to the right and ends at rank c; each rank adds its own product of the
  chunk passing by, computed while the previous partial sum was on its way.

Per rank and collective: N-1 messages of one chunk, the bytes of the ring all-gather /
reduce-scatter; up to N-1 of the N chunk matmuls hide a step each.  The **bidirectional**
variants send the first half of every chunk's rows around to the right and the second
half to the left (two progress threads, one per direction), so each step moves half the
bytes per link direction.

The ring steps run on the group's progress thread (``comm.ppermute(async_op=True)``).
:func:`record_timeline` records when each step and each chunk matmul ran, which the tests
use to check that they overlap.  Chunks are along axis 1 (the sequence) of (B, T, C) arrays.
"""

from __future__ import annotations

import contextlib
import time

from minidist import comm
from minidist.backend import xp
from minidist.ops.precision import gemm_operands

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


def _mm(a, w):
    """``a @ w`` for a (B, n, K) chunk and a (K, M) matrix, in the compute dtype."""
    t0 = time.perf_counter() if _timeline is not None else 0.0
    (a,), _ = gemm_operands(a)
    y = (a.reshape(-1, a.shape[-1]) @ w).reshape(a.shape[:-1] + (w.shape[-1],))
    if _timeline is not None:
        _timeline.append(("matmul", t0, time.perf_counter()))
    return y


def _chunk(a, c, n):
    return a[:, c * n:(c + 1) * n]


# ------------------------------------------------------------------ the ring (textbook)


def all_gather_matmul(x, w, g):
    """``all_gather(x, axis=1) @ w`` on a ring, for x (B, n, K) and w (K, M).

    Returns (y (B, N n, M), the gathered x (B, N n, K)).  N-1 ring steps; step s sends the
    chunk of rank (r - s) mod N onward while multiplying it.
    """
    N, r = g.size, g.rank
    xs, ys = [None] * N, [None] * N
    here = x
    for s in range(N):
        moving = _start_shift(here, g, +1) if s < N - 1 else None
        owner = (r - s) % N
        xs[owner], ys[owner] = here, _mm(here, w)
        if moving is not None:
            here = _wait(moving)
    return xp.concatenate(ys, axis=1), xp.concatenate(xs, axis=1)


def matmul_reduce_scatter(h, w, g):
    """``reduce_scatter(h @ w, axis=1)`` on a ring, for h (B, N n, K) and w (K, M):
    this rank's rows (B, n, M).  N-1 ring steps; at step s rank r adds its product of chunk
    (r - s - 1) mod N to the partial sum arriving from the left."""
    N, r = g.size, g.rank
    n = h.shape[1] // N
    partial = _mm(_chunk(h, (r - 1) % N, n), w)
    for s in range(1, N):
        moving = _start_shift(partial, g, +1)
        mine = _mm(_chunk(h, (r - s - 1) % N, n), w)
        partial = _wait(moving) + mine
    return partial


# ------------------------------------------------------------------ both directions at once


def _halves(a):
    """The first and second half of the rows (axis 1) of a chunk."""
    k = (a.shape[1] + 1) // 2
    return a[:, :k], a[:, k:]


def bidirectional_all_gather_matmul(x, w, g, reverse):
    """:func:`all_gather_matmul` with each chunk's first half of rows going right (on ``g``)
    and its second half going left (on ``reverse``, a second group over the same ranks)."""
    N, r = g.size, g.rank
    if x.shape[1] < 2:
        return all_gather_matmul(x, w, g)
    parts = {d: [[None] * N, [None] * N] for d in (+1, -1)}  # direction -> [xs, ys]
    here = dict(zip((+1, -1), _halves(x)))
    for s in range(N):
        moving = {d: _start_shift(here[d], g if d > 0 else reverse, d) for d in here} if s < N - 1 else {}
        for d, (xs, ys) in parts.items():
            owner = (r - d * s) % N
            xs[owner], ys[owner] = here[d], _mm(here[d], w)
        here = {d: _wait(m) for d, m in moving.items()}
    order = [parts[d][i][c] for i in (1, 0) for c in range(N) for d in (+1, -1)]  # ys, then xs
    return xp.concatenate(order[:2 * N], axis=1), xp.concatenate(order[2 * N:], axis=1)


def bidirectional_matmul_reduce_scatter(h, w, g, reverse):
    """:func:`matmul_reduce_scatter` with each chunk's first half of rows summed on the way
    right (on ``g``) and its second half on the way left (on ``reverse``)."""
    N, r = g.size, g.rank
    n = h.shape[1] // N
    if n < 2:
        return matmul_reduce_scatter(h, w, g)

    def rows(c, d):
        return _halves(_chunk(h, c, n))[0 if d > 0 else 1]

    partial = {d: _mm(rows((r - d) % N, d), w) for d in (+1, -1)}
    for s in range(1, N):
        moving = {d: _start_shift(partial[d], g if d > 0 else reverse, d) for d in partial}
        mine = {d: _mm(rows((r - d * (s + 1)) % N, d), w) for d in partial}
        partial = {d: _wait(moving[d]) + mine[d] for d in partial}
    return xp.concatenate([partial[+1], partial[-1]], axis=1)
