"""Adding rows at repeated indices, in the same order on every run: the embedding's gradient.

``ops.basic.scatter_add_rows`` (``out[idx[i]] += g[i]``, repeats adding up) is, in its ``xp``
form, one ``add.at``; on a GPU that is a kernel of atomic adds, and the order in which the
threads' adds land on a row that several tokens share changes from run to run.  Floating-point
addition is not associative, so the embedding's gradient, and with it every later step, came
out a few ulps different each time: a run resumed from a checkpoint was not bit-exact with
the run it continued, nor a deferred weight gradient (zero-bubble's W) with the joint one.

Here the indices are sorted first (a stable sort keeps repeats in their order), and one thread
per (run of equal indices, column) adds that run's rows in that order, starting from zero, and
writes the sum once: no two threads touch one element, so no atomics, and the sum is
``add.at``'s own, ``((0 + g[i0]) + g[i1]) + ...`` with i0 < i1 < ... -- the CPU's result, bit
for bit.  Rows no index names stay zero.  Switch: ``MINIDIST_CUDA_KERNELS=off`` (atomics
again).  Tested on the CPU through tests/cuda_on_cpu.py (tests/test_scatter_kernel.py).
"""

from __future__ import annotations

from minidist.model.backend import xp
from minidist.model.ops.cuda import source

THREADS = 256  # threads per block
BLOCKS = 4096  # blocks at most: each thread strides over the rest ("grid-stride loop")

SOURCE = r"""
// order: the n positions of idx in stable sorted order; sorted: idx[order]; g: (n, width)
// REAL rows; out: (rows, width) REAL zeros.  Element (k, col) of the sorted list is a thread's:
// the first of a run of equal indices sums the run's rows in order; the others have nothing
// to do.
extern "C" __global__ void add_rows(const long long* order, const long long* sorted, const REAL* g, REAL* out,
                                    long long n, long long width) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n * width;
         i += (long long)gridDim.x * blockDim.x) {
        const long long k = i / width, col = i - k * width, row = sorted[k];
        if (k > 0 && sorted[k - 1] == row) continue;
        REAL acc = 0;
        for (long long j = k; j < n && sorted[j] == row; ++j) acc += g[order[j] * width + col];
        out[row * width + col] = acc;
    }
}
"""

KERNELS = ("add_rows",)


def why_not(out) -> str | None:
    """Why the kernel does not fill ``out`` here (None when it does)."""
    if (reason := source.unavailable()) is not None:
        return reason
    if out.dtype not in (xp.float32, xp.float64):
        return f"rows of dtype {out.dtype} (the kernel adds float32 or float64)"
    return None


def add_rows(idx, g, out, kernels=None):
    """``out`` (zeros of shape (rows, ...)) with ``g[i]`` added into row ``idx[i]`` for every i
    of the flattened ``idx``, in increasing i; ``g`` is (idx.size, ...) rows, taken in out's
    dtype.  Returns ``out``."""
    flat = idx.reshape(-1)
    if flat.size == 0 or out.size == 0:
        return out
    order = xp.argsort(flat, kind="stable").astype(xp.int64, copy=False)
    ordered = source.contiguous(flat[order].astype(xp.int64, copy=False))
    rows = source.contiguous(g.reshape(flat.size, -1).astype(out.dtype, copy=False))
    n, width = rows.shape
    kernels = kernels or source.compiled(SOURCE, {"REAL": source.real(out.dtype)}, KERNELS)
    blocks = min(BLOCKS, -(-(n * width) // THREADS))
    kernels["add_rows"]((blocks, 1), (THREADS,), (order, ordered, rows, out, xp.int64(n), xp.int64(width)))
    return out
