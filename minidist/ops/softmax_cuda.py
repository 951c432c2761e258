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
dtype, float32 or float64; the rounding can differ a little (the sum adds up as a tree in
shared memory, and the GPU's exp is not the host's).  Switch: ``MINIDIST_CUDA_KERNELS=off`` keeps the ``xp`` form.  The source is tested
on a CPU through tests/cuda_on_cpu.py (tests/test_softmax_kernel.py) and, where ``nvcc``
exists, compiled for an H100.
"""

from __future__ import annotations

from ..backend import bfloat16, xp
from . import cuda_source

THREADS = 128  # threads per row at most (a power of two: the reductions halve it)

SOURCE = r"""
// REAL: float or double; blockDim.x: a power of two, at most THREADS.  s, p: (rows, tk) contiguous;
// row r is query r % tq of its (tq, tk) block; with causal it sees keys j <= r % tq.

// bfloat16 is the top half of a float32's bits (stored as unsigned short: no bf16 type needed).
#ifdef __CUDACC__
__device__ __forceinline__ float bits_to_float(unsigned int u) { return __uint_as_float(u); }
__device__ __forceinline__ unsigned int float_to_bits(float f) { return __float_as_uint(f); }
#else
inline float bits_to_float(unsigned int u) { union { unsigned int u; float f; } c; c.u = u; return c.f; }
inline unsigned int float_to_bits(float f) { union { unsigned int u; float f; } c; c.f = f; return c.u; }
#endif
__device__ __forceinline__ REAL load(const REAL* s, long long j) { return s[j]; }
__device__ __forceinline__ float load(const unsigned short* s, long long j) { return bits_to_float((unsigned int)s[j] << 16); }
// float -> bfloat16, rounding to nearest even (as ml_dtypes and CuPy's astype); NaN stays NaN
__device__ __forceinline__ unsigned short to_bf16(float f) {
    unsigned int u = float_to_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
    return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// The row's maximum over the keys it sees, then the sum of exp(s - max); returns both.
template <class T>
__device__ void row_stats(const T* s, int seen, REAL* part, REAL& m, REAL& l) {
    const int t = threadIdx.x;
    m = load(s, 0);  // key 0 is seen by every query
    for (int j = t; j < seen; j += blockDim.x) m = load(s, j) > m ? load(s, j) : m;
    part[t] = m;
    __syncthreads();
    for (int half = blockDim.x / 2; half > 0; half /= 2) {
        if (t < half && part[t + half] > part[t]) part[t] = part[t + half];
        __syncthreads();
    }
    m = part[0];
    __syncthreads();  // every thread has read the maximum before part is reused
    l = 0;
    for (int j = t; j < seen; j += blockDim.x) l += exp(load(s, j) - m);
    part[t] = l;
    __syncthreads();
    for (int half = blockDim.x / 2; half > 0; half /= 2) {
        if (t < half) part[t] += part[t + half];
        __syncthreads();
    }
    l = part[0];
}

extern "C" __global__ void softmax_rows(const REAL* s, REAL* p, long long rows, int tq, int tk, int causal) {
    __shared__ REAL part[THREADS];
    const long long row = blockIdx.x + (long long)blockIdx.y * gridDim.x;
    if (row >= rows) return;  // the same row for every thread of the block: all return together
    const int seen = causal ? min((int)(row % tq) + 1, tk) : tk;  // keys [0, seen) are seen
    s += row * tk;
    p += row * tk;
    REAL m, l;
    row_stats(s, seen, part, m, l);
    for (int j = threadIdx.x; j < tk; j += blockDim.x) p[j] = j < seen ? exp(s[j] - m) / l : (REAL)0;
}

// Mixed precision (REAL float): bfloat16 scores in; P in float32 (kept for backward) and P
// rounded to bfloat16 (the operand of P V) out, in the same pass.
extern "C" __global__ void softmax_rows_bf16(const unsigned short* s, REAL* p, unsigned short* p_low, long long rows,
                                             int tq, int tk, int causal) {
    __shared__ REAL part[THREADS];
    const long long row = blockIdx.x + (long long)blockIdx.y * gridDim.x;
    if (row >= rows) return;
    const int seen = causal ? min((int)(row % tq) + 1, tk) : tk;
    s += row * tk;
    p += row * tk;
    p_low += row * tk;
    REAL m, l;
    row_stats(s, seen, part, m, l);
    for (int j = threadIdx.x; j < tk; j += blockDim.x) {
        REAL v = j < seen ? exp(load(s, j) - m) / l : (REAL)0;
        p[j] = v;
        p_low[j] = to_bf16(v);
    }
}
"""



def why_not(s) -> str | None:
    """Why the kernel does not run for scores ``s`` here (None when it does)."""
    if (reason := cuda_source.unavailable()) is not None:
        return reason
    if s.dtype not in (xp.float32, xp.float64) and not (bfloat16 is not None and s.dtype == bfloat16):
        return f"scores of dtype {s.dtype} (the kernel reads float32, float64 or bfloat16)"
    if s.ndim < 2 or s.shape[-1] == 0 or s.size == 0:
        return "no rows of scores"
    return None


KERNELS = ("softmax_rows", "softmax_rows_bf16")


def compiled(real: str) -> dict:
    """The kernels for ``real`` ('float' or 'double') by name, compiled once (CuPy RawModule)."""
    return cuda_source.compiled(SOURCE, {"REAL": real, "THREADS": THREADS}, KERNELS)


def _launch(kernel, s, arrays, causal):
    tq, tk = s.shape[-2], s.shape[-1]
    rows = s.size // tk
    args = (s, *arrays, xp.int64(rows), xp.int32(tq), xp.int32(tk), xp.int32(bool(causal)))
    kernel(*cuda_source.row_launch(rows, tk, THREADS), args)


def softmax(s, causal: bool, kernels=None):
    """Softmax over the last axis of ``s`` (..., Tq, Tk), causal or not: a new array of s's
    dtype, or for bfloat16 scores the pair (P in float32, P in bfloat16).  ``kernels``:
    :func:`compiled`'s (the default) or a stand-in with the same calls (the tests' CPU
    emulation)."""
    s = cuda_source.contiguous(s)
    kernels = kernels or compiled(cuda_source.real(s.dtype))
    if bfloat16 is not None and s.dtype == bfloat16:  # (no ml_dtypes: bfloat16 is None, never equal)
        p, p_low = xp.empty(s.shape, dtype=xp.float32), xp.empty_like(s)
        _launch(kernels["softmax_rows_bf16"], s, (p, p_low), causal)
        return p, p_low
    p = xp.empty_like(s)
    _launch(kernels["softmax_rows"], s, (p,), causal)
    return p
