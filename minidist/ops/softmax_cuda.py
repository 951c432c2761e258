"""Attention's (causal) softmax over the rows of the scores, as one CUDA kernel.

Plain attention (``attention._attend``) turns the T x T scores S into probabilities P: add the
causal mask, take each row's maximum, exponentiate the shifted scores, sum them, divide.
Written as ``xp`` operations that is five passes over a T x T array in device memory (plus
the T x T mask), and on a GPU those passes, not the products, take most of attention's
time: at GPT-2 small's shape a T x T float32 array of a layer is 400 MB.  Here a thread
block owns one row: it reads the row's scores, reduces their maximum and then their sum in
shared memory (the row stays in the cache between the reads), and writes the probabilities:
one pass in, one pass out.  The mask is the row's index, not an array: query i of a
(..., Tq, Tk) block sees keys j <= i (top-left aligned, as ``causal_mask``), and the
probabilities above the diagonal are written as zeros without reading their scores.

The arithmetic is the reference's (max, exp(s - max), their sum, a division), in the scores'
dtype, float32 or float64; only the order in which the sum adds up differs (a tree in shared
memory).  Switch: ``MINIDIST_CUDA_KERNELS=off`` keeps the ``xp`` form.  The source is tested
on a CPU through tests/cuda_on_cpu.py (tests/test_softmax_kernel.py) and, where ``nvcc``
exists, compiled for an H100.
"""

from __future__ import annotations

from .. import env
from ..backend import BACKEND, xp

THREADS = 128  # threads per row at most (a power of two: the reductions halve it)

SOURCE = r"""
// REAL: float or double; blockDim.x: a power of two, at most THREADS.  s, p: (rows, tk) contiguous;
// row r is query r % tq of its (tq, tk) block; with causal it sees keys j <= r % tq.
extern "C" __global__ void softmax_rows(const REAL* s, REAL* p, long long rows, int tq, int tk, int causal) {
    __shared__ REAL part[THREADS];
    const long long row = blockIdx.x + (long long)blockIdx.y * gridDim.x;
    if (row >= rows) return;  // the same row for every thread of the block: all return together
    const int t = threadIdx.x;
    const int seen = causal ? min((int)(row % tq) + 1, tk) : tk;  // keys [0, seen) are seen
    s += row * tk;
    p += row * tk;

    REAL m = s[0];  // key 0 is seen by every query
    for (int j = t; j < seen; j += blockDim.x) m = s[j] > m ? s[j] : m;
    part[t] = m;
    __syncthreads();
    for (int half = blockDim.x / 2; half > 0; half /= 2) {
        if (t < half && part[t + half] > part[t]) part[t] = part[t + half];
        __syncthreads();
    }
    m = part[0];
    __syncthreads();  // every thread has read the maximum before part is reused

    REAL l = 0;
    for (int j = t; j < seen; j += blockDim.x) l += exp(s[j] - m);
    part[t] = l;
    __syncthreads();
    for (int half = blockDim.x / 2; half > 0; half /= 2) {
        if (t < half) part[t] += part[t + half];
        __syncthreads();
    }
    l = part[0];

    for (int j = t; j < tk; j += blockDim.x) p[j] = j < seen ? exp(s[j] - m) / l : (REAL)0;
}
"""

GRID_X = 65535  # rows per grid row: the grid is (GRID_X, ceil(rows / GRID_X)) for many rows


def why_not(s) -> str | None:
    """Why the kernel does not run for scores ``s`` here (None when it does)."""
    if BACKEND != "cupy":
        return "the kernel runs on CuPy only"
    if env.get("MINIDIST_CUDA_KERNELS") == "off":
        return "MINIDIST_CUDA_KERNELS=off"
    if not hasattr(xp, "RawModule"):
        return "this CuPy has no RawModule"
    if s.dtype not in (xp.float32, xp.float64):
        return f"scores of dtype {s.dtype} (the kernel computes in float32 or float64)"
    if s.ndim < 2 or s.shape[-1] == 0 or s.size == 0:
        return "no rows of scores"
    return None


_kernels: dict = {}


def compiled(real: str):
    """The kernel for ``real`` ('float' or 'double'), compiled once with CuPy's RawModule."""
    if real not in _kernels:
        module = xp.RawModule(code=SOURCE, options=("-std=c++14", f"-DREAL={real}", f"-DTHREADS={THREADS}"))
        _kernels[real] = module.get_function("softmax_rows")
    return _kernels[real]


def softmax(s, causal: bool, kernel=None):
    """Softmax over the last axis of ``s`` (..., Tq, Tk), causal or not, as a new array of
    s's dtype.  ``kernel``: :func:`compiled`'s (the default) or a stand-in with the same call
    (the tests' CPU emulation)."""
    s = xp.ascontiguousarray(s) if not s.flags.c_contiguous else s
    tq, tk = s.shape[-2], s.shape[-1]
    rows = s.size // tk
    kernel = kernel or compiled("double" if s.dtype == xp.float64 else "float")
    p = xp.empty_like(s)
    grid = (min(rows, GRID_X), -(-rows // GRID_X))
    threads = min(THREADS, 1 << max(tk - 1, 1).bit_length())  # a short row needs fewer (a power of two)
    kernel(grid, (threads,), (s, p, xp.int64(rows), xp.int32(tq), xp.int32(tk), xp.int32(bool(causal))))
    return p
