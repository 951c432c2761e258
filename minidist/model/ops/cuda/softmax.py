"""Attention's (causal) softmax over the rows of the scores, and its gradient, as CUDA kernels.

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

Backward, dS = P * (dP - delta) with delta a row's sum of P * dP, is the same shape of
kernel: a block reduces its row's delta, then writes dS.  The ``xp`` form takes delta as
rowsum(dO * O) instead (FlashAttention's identity: the same number, from the (T, D) arrays),
because a row-by-row reduction over the T x T arrays is slow as ``xp`` operations; inside a
kernel that holds the row anyway it costs nothing and saves the (T, D) pass.  Under mixed
precision the kernels read and write the bfloat16 arrays of the products (S, dP; P and dS as
their operands) directly, converting in registers, so no T x T array is ever cast as a pass
of its own; the arithmetic stays float32.  There no float32 P is written at all: backward
keeps the bfloat16 scores and each row's maximum and sum (:class:`Rows`), and the gradient
kernel recomputes P from them with the forward's expression, so it gets the same bits while
a layer keeps 2 bytes a score instead of 4 and moves 6 fewer bytes a score in all.

The arithmetic is the reference's (max, exp(s - max), their sum, a division), in the scores'
dtype, float32 or float64; the rounding can differ a little (sums add up as a tree in shared
memory, and the GPU's exp is not the host's).  Switch: ``MINIDIST_CUDA_KERNELS=off`` keeps
the ``xp`` form.  The source is tested on a CPU through tests/cuda_on_cpu.py
(tests/test_softmax_kernel.py) and, where ``nvcc`` exists, compiled for an H100.
"""
from __future__ import annotations

from typing import NamedTuple

from minidist.model.backend import xp
from minidist.model.ops.cuda import source

THREADS = 128  # threads per row at most (a power of two: the reductions halve it)

SOURCE = source.BF16 + source.ROWS + r"""
// REAL: float or double; blockDim.x: a power of two, at most THREADS.  s, p: (rows, tk) contiguous;
// row r is query r % tq of its (tq, tk) block; with causal it sees keys j <= r % tq.

// The keys [0, seen) that row `row` sees.
__device__ int seen_keys(long long row, int tq, int tk, int causal) {
    return causal ? min((int)(row % tq) + 1, tk) : tk;
}

// A row's probability of key j from its maximum m and its sum l of exp(s - m): the one
// expression both the softmax and (under mixed precision) its gradient use, so the gradient's
// recomputed P has the forward's bits.
template <class S>
__device__ __forceinline__ REAL prob(const S* s, int j, REAL m, REAL l) { return exp(load(s, j) - m) / l; }

// The maximum m and the sum l of exp(s - m) of one row's scores over the keys it sees.
template <class S>
__device__ void row_stats(const S* s, int seen, REAL* part, REAL* m_out, REAL* l_out) {
    REAL m = load(s, 0);  // key 0 is seen by every query
    for (int j = threadIdx.x; j < seen; j += blockDim.x) m = load(s, j) > m ? load(s, j) : m;
    m = block_max(m, part);
    REAL l = 0;
    for (int j = threadIdx.x; j < seen; j += blockDim.x) l += exp(load(s, j) - m);
    *m_out = m;
    *l_out = block_sum(l, part);
}

// Softmax of one row of scores s (REAL) into p: the row's statistics, then the division.
extern "C" __global__ void softmax_rows(const REAL* s, REAL* p, long long rows, int tq, int tk, int causal) {
    ROW_OF_BLOCK
    const int seen = seen_keys(row, tq, tk, causal);
    s += row * tk;
    p += row * tk;
    REAL m, l;
    row_stats(s, seen, part, &m, &l);
    for (int j = threadIdx.x; j < tk; j += blockDim.x) p[j] = j < seen ? prob(s, j, m, l) : (REAL)0;
}

// Mixed precision (REAL float): bfloat16 scores in; P rounded to bfloat16 (the operand of P V)
// and the row's (m, l) out.  No float32 P: the gradient recomputes it from the scores and
// (m, l), reading 2 bytes a score instead of 4 and saving the forward's 4-byte write.
extern "C" __global__ void softmax_rows_bf16(const unsigned short* s, REAL* stats, unsigned short* p_low,
                                             long long rows, int tq, int tk, int causal) {
    ROW_OF_BLOCK
    const int seen = seen_keys(row, tq, tk, causal);
    s += row * tk;
    p_low += row * tk;
    REAL m, l;
    row_stats(s, seen, part, &m, &l);
    if (threadIdx.x == 0) {
        stats[2 * row] = m;
        stats[2 * row + 1] = l;
    }
    for (int j = threadIdx.x; j < tk; j += blockDim.x) p_low[j] = to_bf16(j < seen ? prob(s, j, m, l) : (REAL)0);
}

// The softmax's gradient for one row: dS = P * (dP - delta), delta = sum_j P_j dP_j over the
// keys the row sees (above the diagonal P is 0, and so is dS: written without reading dP).
extern "C" __global__ void softmax_grad_rows(const REAL* dp, const REAL* p, REAL* ds, long long rows, int tq, int tk,
                                             int causal) {
    ROW_OF_BLOCK
    const int seen = seen_keys(row, tq, tk, causal);
    dp += row * tk;
    p += row * tk;
    ds += row * tk;
    REAL delta = 0;
    for (int j = threadIdx.x; j < seen; j += blockDim.x) delta += p[j] * dp[j];
    delta = block_sum(delta, part);
    for (int j = threadIdx.x; j < tk; j += blockDim.x) ds[j] = j < seen ? p[j] * (dp[j] - delta) : (REAL)0;
}

// Mixed precision: dP in bfloat16 (the product dO V^T); P recomputed from the bfloat16 scores
// and the forward's (m, l) by the forward's expression; dS rounded to bfloat16 (the operand of
// dS K and dS^T Q); the arithmetic in float32.
extern "C" __global__ void softmax_grad_rows_bf16(const unsigned short* dp, const unsigned short* s,
                                                  const REAL* stats, unsigned short* ds, long long rows, int tq,
                                                  int tk, int causal) {
    ROW_OF_BLOCK
    const int seen = seen_keys(row, tq, tk, causal);
    dp += row * tk;
    s += row * tk;
    ds += row * tk;
    const REAL m = stats[2 * row], l = stats[2 * row + 1];
    REAL delta = 0;
    for (int j = threadIdx.x; j < seen; j += blockDim.x) delta += prob(s, j, m, l) * load(dp, j);
    delta = block_sum(delta, part);
    for (int j = threadIdx.x; j < tk; j += blockDim.x)
        store(ds, j, j < seen ? prob(s, j, m, l) * (load(dp, j) - delta) : (REAL)0);
}
"""


def why_not(s) -> str | None:
    """Why the kernels do not run for scores (or their gradient) ``s`` here (None when they do)."""
    if (reason := source.unavailable()) is not None:
        return reason
    if s.dtype not in (xp.float32, xp.float64) and not source.is_bf16(s):
        return f"scores of dtype {s.dtype} (the kernels read float32, float64 or bfloat16)"
    if s.ndim < 2 or s.shape[-1] == 0 or s.size == 0:
        return "no rows of scores"
    return None


KERNELS = ("softmax_rows", "softmax_rows_bf16", "softmax_grad_rows", "softmax_grad_rows_bf16")


def compiled(real: str) -> dict:
    """The kernels for ``real`` ('float' or 'double') by name, compiled once (CuPy RawModule)."""
    return source.compiled(SOURCE, {"REAL": real, "THREADS": THREADS}, KERNELS)


def _launch(kernel, s, arrays, causal):
    tq, tk = s.shape[-2], s.shape[-1]
    rows = s.size // tk
    args = (*arrays, xp.int64(rows), xp.int32(tq), xp.int32(tk), xp.int32(bool(causal)))
    kernel(*source.row_launch(rows, tk, THREADS), args)


class Rows(NamedTuple):
    """The probabilities of bfloat16 scores, kept for backward as the scores themselves and each
    row's (maximum, sum of exp(s - maximum)): float32 (rows, 2).  P in float32 would take twice
    the bytes of the scores; the gradient kernel recomputes it bit for bit instead."""
    s: object
    stats: object


def softmax(s, causal: bool, kernels=None):
    """Softmax over the last axis of ``s`` (..., Tq, Tk), causal or not: a new array of s's
    dtype; for bfloat16 scores the pair (:class:`Rows` of s, P in bfloat16).  ``kernels``:
    :func:`compiled`'s (the default) or a stand-in with the same calls (the tests' CPU
    emulation)."""
    s = source.contiguous(s)
    kernels = kernels or compiled(source.real(s.dtype))
    if source.is_bf16(s):
        stats, p_low = xp.empty((s.size // max(s.shape[-1], 1), 2), dtype=xp.float32), xp.empty_like(s)
        _launch(kernels["softmax_rows_bf16"], s, (s, stats, p_low), causal)
        return Rows(s, stats), p_low
    p = xp.empty_like(s)
    _launch(kernels["softmax_rows"], s, (s, p), causal)
    return p


def softmax_grad(dp, p, causal: bool, kernels=None):
    """dS = P * (dP - rowsum(P * dP)) for the gradient ``dp`` of the probabilities ``p`` of
    :func:`softmax`, as a new array of dp's dtype: float32/float64 with p an array of the same
    dtype and shape, or bfloat16 with p the :class:`Rows` of bfloat16 scores (mixed
    precision).  ``kernels`` as in :func:`softmax`."""
    bf16 = source.is_bf16(dp)
    if bf16 != isinstance(p, Rows) or (bf16 and not source.is_bf16(p.s)) or (not bf16 and p.dtype != dp.dtype):
        got = f"the Rows of {p.s.dtype} scores" if isinstance(p, Rows) else f"P of dtype {p.dtype}"
        raise ValueError(f"softmax_grad: {got} with dP of dtype {dp.dtype} (bfloat16 dP takes the Rows of "
                         f"bfloat16 scores, float32/float64 dP a P of its dtype)")
    shape = p.s.shape if bf16 else p.shape
    if tuple(dp.shape) != tuple(shape):
        raise ValueError(f"softmax_grad: dP shape {tuple(dp.shape)} != P shape {tuple(shape)}")
    dp = source.contiguous(dp)
    kernels = kernels or compiled(source.real(dp.dtype))
    ds = xp.empty_like(dp)
    if bf16:
        _launch(kernels["softmax_grad_rows_bf16"], dp, (dp, p.s, p.stats, ds), causal)
    else:
        _launch(kernels["softmax_grad_rows"], dp, (dp, source.contiguous(p), ds), causal)
    return ds
