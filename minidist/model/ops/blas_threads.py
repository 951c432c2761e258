"""Run many small independent pieces of work (attention slabs, blocks of elementwise
work) on all the BLAS cores.

A multithreaded BLAS splits each matrix product across its threads.  That pays off for the
model's big GEMMs, but attention is many *small* products (one (T, D) x (D, T) per head):
splitting each of them costs more in thread hand-offs than it saves, and on a busy machine,
where a BLAS thread may be descheduled while the others spin-wait for it, it is many times
slower than one thread.  Attention's elementwise work (softmax) is single-threaded NumPy anyway.

So :func:`parallel_for` hands whole slabs to threads instead: with N BLAS threads it runs the
items on N Python threads, each calling a one-thread BLAS.  NumPy releases the GIL inside
matrix products and large ufunc loops, so the slabs really do run in parallel, softmax
included.  Every item writes its own disjoint part of the outputs, so the result does not
depend on how items are shared out.

NumPy's elementwise ufuncs are single-threaded, so the same helper also spreads the
cache-sized blocks of GELU and the row chunks of LayerNorm over those threads (PyTorch runs
such ops on all its threads too).  With one BLAS thread everything runs inline, in order.

The BLAS thread count is read and limited through ``threadpoolctl`` when it is installed;
without it (or with a non-NumPy backend) the items simply run one after another.

This is CPU tuning: only the CPU-tuned path of the ops calls it (``ops/tuning.py`` decides
which path runs; on CuPy the ops run whole-array and never cut their work into items).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from minidist.model.backend import BACKEND, xp

_state = {"controller": None, "pool": None}


def _blas_controller():
    """The threadpoolctl view of the BLAS libraries NumPy loaded (None if unavailable)."""
    if _state["controller"] is None:
        try:
            from threadpoolctl import ThreadpoolController
        except ImportError:
            _state["controller"] = False
        else:
            _state["controller"] = ThreadpoolController().select(user_api="blas")
    return _state["controller"] or None


def blas_threads() -> int:
    """How many threads the BLAS would use for one matrix product now (1 if unknown)."""
    if BACKEND != "numpy":
        return 1
    ctl = _blas_controller()
    if ctl is None or not ctl.lib_controllers:
        return 1
    return max(lib.num_threads for lib in ctl.lib_controllers)


def _run_share(items, fn, scratch):
    buffers = [xp.empty(shape, dtype) for shape, dtype in scratch]  # one set per thread, reused
    for item in items:
        fn(item, *buffers)


def parallel_for(items, fn, scratch=()):
    """Call ``fn(item, *buffers)`` for every item, on as many threads as the BLAS has.

    ``scratch`` lists (shape, dtype) pairs: each thread allocates those buffers once and
    passes them to every call it makes (so ``fn`` may overwrite them freely).  Exceptions
    raised by ``fn`` propagate to the caller.
    """
    items = list(items)
    n = min(blas_threads(), len(items))
    if n <= 1:
        _run_share(items, fn, scratch)
        return
    if _state["pool"] is None or _state["pool"]._max_workers < n - 1:
        _state["pool"] = ThreadPoolExecutor(max_workers=n - 1, thread_name_prefix="minidist-slab")
    with _blas_controller().limit(limits=1):
        # item i goes to thread i mod n; the calling thread takes share 0 itself
        futures = [_state["pool"].submit(_run_share, items[w::n], fn, scratch) for w in range(1, n)]
        try:
            _run_share(items[0::n], fn, scratch)
        finally:
            for f in futures:
                f.result()


def row_chunks(n_rows: int):
    """``n_rows`` cut into one contiguous slice per BLAS thread (one slice with one thread).

    Per-row results may then differ in the last bit between thread counts: a BLAS row sum
    (GEMV) can order its additions differently at the edge of a chunk."""
    n = max(1, min(blas_threads(), n_rows))
    bounds = [n_rows * i // n for i in range(n + 1)]
    return [slice(lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:])]
