"""FlashAttention as CUDA kernels: the blockwise recurrence of ``blockwise.py``, fused.

Dao et al. 2022, "FlashAttention"; the backward split into a dQ pass and a dK/dV pass is
FlashAttention-2's (Dao 2023).  ``blockwise.py`` is the reference: the same online softmax
written as batched matrix products over NumPy or CuPy arrays.  There, every key tile's scores
still go through device memory once per product, per elementwise step.  Here one kernel keeps
them in registers: a thread block owns a run of query rows of one (batch, head) pair, loads
each tile of keys and values once into shared memory, and every thread folds the tile into its
row's running max ``m``, normaliser ``l`` and output ``acc``.  Only ``O`` and the log-sum-exp
``L = m + log l`` reach device memory, as in the reference.

Backward recomputes the probabilities from ``L`` (no T x T array ever exists):

* ``dq`` kernel, a thread per query row:  P = exp(S - L),  dS = P * (dO V^T - D),  dQ = dS K;
* ``dkdv`` kernel, a thread per key row:   dV = P^T dO,     dK = dS^T Q,
  where D = rowsum(dO * O) comes from one ``xp`` expression.

The kernels compute in the operands' dtype, float32 or float64; low-precision operands are
widened to float32 first (the scores, softmax and gradients run in float32 in the reference
too), which costs one pass over Q, K and V, nothing next to the T^2 work.  They run on CUDA
cores, not tensor cores: a tensor-core version (``mma`` fragments) is the next step where the
profile asks for it.

What ptxas reports for an H100 (``nvcc -arch=sm_90 -Xptxas -v``): every kernel uses one
barrier and under 48 KiB of shared memory; registers are the limit.  For float and D = 64 (a
GPT-2-sized head) the forward does not spill, the dQ kernel spills 48 bytes and the dK/dV
kernel 420 bytes per thread; D = 128 and double spill kilobytes.  With 64 threads and about
48 KiB per block, few blocks share an SM.  So these kernels are a correct fused baseline, not
a tuned one: whether they beat the batched products is for ``bench_gpu.py`` to say.

Switch: ``MINIDIST_CUDA_KERNELS`` (``auto``: on CuPy for head sizes up to 128; ``off``: the
batched-product reference everywhere).  ``tests/test_flash_kernel.py`` checks the kernel
source on a CPU: compiled by a C++ compiler under a small emulation of CUDA's thread model
(the threads of a block as fibers that hand over at ``__syncthreads``), it equals the reference
forward and backward; where ``nvcc`` exists, the source also compiles for an H100 (sm_90).
"""

from __future__ import annotations

import math

from minidist.model.backend import xp
from minidist.model.ops.cuda import source

MAX_HEAD_DIM = 128
THREADS = 64  # query (or key) rows per thread block: one row per thread
SHARED_BYTES = 48 * 1024  # the static shared memory a thread block may declare

SOURCE = r"""
// REAL: float or double; HEAD_DIM: the head size; BLOCK_N: keys (or queries) per shared tile.
// Grid: x = one (batch, head) pair (up to 2^31 - 1 of them), y = a run of blockDim.x rows.
// q, k, v, o, do: (BH, T, HEAD_DIM) contiguous; lse, delta: (BH, T).  Query row i sits at
// global position q0 + i, key j at k0 + j; with causal, query i sees key j iff k0+j <= q0+i.

__device__ __forceinline__ bool sees(int qpos, int kpos, int causal) { return !causal || kpos <= qpos; }

// The keys [0, end) that some query row of this block may see (causal: none past its last row).
__device__ __forceinline__ int keys_end(int Tq, int Tk, int q0, int k0, int causal) {
    if (!causal) return Tk;
    int last_row = min((int)((blockIdx.y + 1) * blockDim.x), Tq) - 1;
    return max(0, min(Tk, q0 + last_row - k0 + 1));
}

// Copy rows [start, start + BLOCK_N) of a (T, HEAD_DIM) matrix into a shared tile (zeros past T).
__device__ __forceinline__ void load_tile(REAL tile[BLOCK_N][HEAD_DIM], const REAL* src, int start, int T,
                                          REAL factor) {
    for (int i = threadIdx.x; i < BLOCK_N * HEAD_DIM; i += blockDim.x) {
        int r = i / HEAD_DIM, d = i % HEAD_DIM;
        tile[r][d] = start + r < T ? src[(long)(start + r) * HEAD_DIM + d] * factor : (REAL)0;
    }
}

// Row ``row`` of a (T, HEAD_DIM) matrix times ``factor`` into registers (zeros for an idle thread).
__device__ __forceinline__ void load_row(REAL out[HEAD_DIM], const REAL* src, int row, bool active, REAL factor) {
    for (int d = 0; d < HEAD_DIM; ++d) out[d] = active ? src[(long)row * HEAD_DIM + d] * factor : (REAL)0;
}

extern "C" __global__ void flash_forward(const REAL* q, const REAL* k, const REAL* v, REAL* o, REAL* lse,
                                         int Tq, int Tk, int q0, int k0, REAL scale, int causal) {
    __shared__ REAL ks[BLOCK_N][HEAD_DIM];
    __shared__ REAL vs[BLOCK_N][HEAD_DIM];
    const long bh = blockIdx.x;
    const int row = blockIdx.y * blockDim.x + threadIdx.x;
    const bool active = row < Tq;
    q += bh * Tq * HEAD_DIM; k += bh * Tk * HEAD_DIM; v += bh * Tk * HEAD_DIM;
    REAL qr[HEAD_DIM], acc[HEAD_DIM];
    load_row(qr, q, row, active, scale);
    for (int d = 0; d < HEAD_DIM; ++d) acc[d] = 0;
    REAL m = 0, l = 0;
    bool seen = false;  // has this row met a key it sees yet?
    const int end = keys_end(Tq, Tk, q0, k0, causal);
    for (int start = 0; start < end; start += BLOCK_N) {
        __syncthreads();  // every thread is done with the previous tile
        load_tile(ks, k, start, Tk, (REAL)1);
        load_tile(vs, v, start, Tk, (REAL)1);
        __syncthreads();
        if (!active) continue;
        REAL s[BLOCK_N];
        REAL tile_max = 0;
        bool any = false;
        for (int j = 0; j < BLOCK_N; ++j) {
            bool ok = start + j < Tk && sees(q0 + row, k0 + start + j, causal);
            REAL dot = 0;
            if (ok) for (int d = 0; d < HEAD_DIM; ++d) dot += qr[d] * ks[j][d];
            s[j] = dot;
            if (ok && (!any || dot > tile_max)) tile_max = dot;
            any = any || ok;
        }
        if (!any) continue;
        REAL m_new = seen && m > tile_max ? m : tile_max;
        REAL alpha = seen ? exp(m - m_new) : (REAL)0;  // rescales what came under the old max
        l *= alpha;
        for (int d = 0; d < HEAD_DIM; ++d) acc[d] *= alpha;
        for (int j = 0; j < BLOCK_N; ++j) {
            if (!(start + j < Tk && sees(q0 + row, k0 + start + j, causal))) continue;
            REAL p = exp(s[j] - m_new);
            l += p;
            for (int d = 0; d < HEAD_DIM; ++d) acc[d] += p * vs[j][d];
        }
        m = m_new;
        seen = true;
    }
    if (!active) return;
    o += bh * Tq * HEAD_DIM;
    for (int d = 0; d < HEAD_DIM; ++d) o[(long)row * HEAD_DIM + d] = seen ? acc[d] / l : (REAL)0;
    lse[bh * Tq + row] = seen ? m + log(l) : log((REAL)0);  // -inf for a row that saw no key
}

extern "C" __global__ void flash_backward_dq(const REAL* q, const REAL* k, const REAL* v, const REAL* dout,
                                             const REAL* lse, const REAL* delta, REAL* dq,
                                             int Tq, int Tk, int q0, int k0, REAL scale, int causal) {
    __shared__ REAL ks[BLOCK_N][HEAD_DIM];
    __shared__ REAL vs[BLOCK_N][HEAD_DIM];
    const long bh = blockIdx.x;
    const int row = blockIdx.y * blockDim.x + threadIdx.x;
    const bool active = row < Tq;
    q += bh * Tq * HEAD_DIM; dout += bh * Tq * HEAD_DIM; k += bh * Tk * HEAD_DIM; v += bh * Tk * HEAD_DIM;
    REAL qr[HEAD_DIM], dor[HEAD_DIM], acc[HEAD_DIM];
    load_row(qr, q, row, active, scale);
    load_row(dor, dout, row, active, (REAL)1);
    for (int d = 0; d < HEAD_DIM; ++d) acc[d] = 0;
    const REAL L = active ? lse[bh * Tq + row] : (REAL)0, D = active ? delta[bh * Tq + row] : (REAL)0;
    const int end = keys_end(Tq, Tk, q0, k0, causal);
    for (int start = 0; start < end; start += BLOCK_N) {
        __syncthreads();
        load_tile(ks, k, start, Tk, (REAL)1);
        load_tile(vs, v, start, Tk, (REAL)1);
        __syncthreads();
        if (!active) continue;
        for (int j = 0; j < BLOCK_N; ++j) {
            if (!(start + j < Tk && sees(q0 + row, k0 + start + j, causal))) continue;
            REAL s = 0, dp = 0;
            for (int d = 0; d < HEAD_DIM; ++d) { s += qr[d] * ks[j][d]; dp += dor[d] * vs[j][d]; }
            REAL ds = exp(s - L) * (dp - D);
            for (int d = 0; d < HEAD_DIM; ++d) acc[d] += ds * ks[j][d];
        }
    }
    if (!active) return;
    dq += bh * Tq * HEAD_DIM;
    for (int d = 0; d < HEAD_DIM; ++d) dq[(long)row * HEAD_DIM + d] = acc[d] * scale;
}

extern "C" __global__ void flash_backward_dkdv(const REAL* q, const REAL* k, const REAL* v, const REAL* dout,
                                               const REAL* lse, const REAL* delta, REAL* dk, REAL* dv,
                                               int Tq, int Tk, int q0, int k0, REAL scale, int causal) {
    __shared__ REAL qs[BLOCK_N][HEAD_DIM];
    __shared__ REAL dos[BLOCK_N][HEAD_DIM];
    __shared__ REAL Ls[BLOCK_N], Ds[BLOCK_N];
    const long bh = blockIdx.x;
    const int key = blockIdx.y * blockDim.x + threadIdx.x;
    const bool active = key < Tk;
    q += bh * Tq * HEAD_DIM; dout += bh * Tq * HEAD_DIM; k += bh * Tk * HEAD_DIM; v += bh * Tk * HEAD_DIM;
    lse += bh * Tq; delta += bh * Tq;
    REAL kr[HEAD_DIM], vr[HEAD_DIM], dkr[HEAD_DIM], dvr[HEAD_DIM];
    load_row(kr, k, key, active, (REAL)1);
    load_row(vr, v, key, active, (REAL)1);
    for (int d = 0; d < HEAD_DIM; ++d) dkr[d] = dvr[d] = 0;
    // causal: the queries before this block's first key see none of its keys
    const int first = causal ? max(0, min(Tq, k0 + (int)(blockIdx.y * blockDim.x) - q0)) : 0;
    for (int start = first; start < Tq; start += BLOCK_N) {
        __syncthreads();
        load_tile(qs, q, start, Tq, scale);
        load_tile(dos, dout, start, Tq, (REAL)1);
        for (int i = threadIdx.x; i < BLOCK_N; i += blockDim.x) {
            Ls[i] = start + i < Tq ? lse[start + i] : (REAL)0;
            Ds[i] = start + i < Tq ? delta[start + i] : (REAL)0;
        }
        __syncthreads();
        if (!active) continue;
        for (int i = 0; i < BLOCK_N; ++i) {
            if (!(start + i < Tq && sees(q0 + start + i, k0 + key, causal))) continue;
            REAL s = 0, dp = 0;
            for (int d = 0; d < HEAD_DIM; ++d) { s += qs[i][d] * kr[d]; dp += dos[i][d] * vr[d]; }
            REAL p = exp(s - Ls[i]);
            REAL ds = p * (dp - Ds[i]);
            for (int d = 0; d < HEAD_DIM; ++d) { dvr[d] += p * dos[i][d]; dkr[d] += ds * qs[i][d]; }
        }
    }
    if (!active) return;
    dk += bh * Tk * HEAD_DIM; dv += bh * Tk * HEAD_DIM;
    for (int d = 0; d < HEAD_DIM; ++d) {
        dk[(long)key * HEAD_DIM + d] = dkr[d];
        dv[(long)key * HEAD_DIM + d] = dvr[d];
    }
}
"""

KERNELS = ("flash_forward", "flash_backward_dq", "flash_backward_dkdv")


def block_n(real_bytes: int, head_dim: int) -> int:
    """Keys (or queries) per shared-memory tile, at most 64: a kernel holds two tiles of
    ``head_dim`` columns and two of one column (dK/dV's L and D), within SHARED_BYTES."""
    return max(8, min(64, SHARED_BYTES // (2 * real_bytes * (head_dim + 1))))


def defines(real: str, head_dim: int) -> dict[str, str]:
    """The macros that specialise SOURCE for the compute type ``real`` ('float' or 'double')."""
    size = {"float": 4, "double": 8}[real]
    return {"REAL": real, "HEAD_DIM": str(head_dim), "BLOCK_N": str(block_n(size, head_dim))}


def why_not(head_dim: int) -> str | None:
    """Why the kernels do not run for this head size here (None when they do)."""
    if (reason := source.unavailable()) is not None:
        return reason
    if head_dim > MAX_HEAD_DIM:
        return f"head size {head_dim} > {MAX_HEAD_DIM}"
    return None


def compiled(real: str, head_dim: int) -> dict:
    """The kernels for (real, head_dim) by name, compiled once per process with CuPy's
    ``RawModule``; each is called as ``kernel(grid, block, args)``."""
    return source.compiled(SOURCE, defines(real, head_dim), KERNELS)


def _real(dtype) -> str:
    """The kernels' compute type for arrays of ``dtype``."""
    if dtype not in (xp.float32, xp.float64):
        raise TypeError(f"the flash kernels compute in float32 or float64, got {dtype}")
    return "double" if dtype == xp.float64 else "float"


def _check(q, *others):
    """q (..., Tq, D) and k, v, ... (..., T, D) of q's dtype and leading dims: the kernels
    read raw memory, so a mismatch must be an error here, not garbage there."""
    for a in others:
        if a.dtype != q.dtype or a.shape[:-2] != q.shape[:-2] or a.shape[-1] != q.shape[-1]:
            raise ValueError(f"flash kernels: {a.dtype}{tuple(a.shape)} does not fit q {q.dtype}{tuple(q.shape)}")


def _launch(kernel, rows: int, bh: int, arrays, Tq, Tk, q0, k0, scale, causal, dtype):
    """One kernel over ``bh`` (batch, head) pairs and ``rows`` rows of each, one row per thread."""
    tail = (xp.int32(Tq), xp.int32(Tk), xp.int32(q0), xp.int32(k0), dtype.type(scale), xp.int32(causal))
    kernel((bh, (rows + THREADS - 1) // THREADS), (THREADS,), tuple(arrays) + tail)


def forward(q, k, v, scale: float, causal: bool, q0: int = 0, k0: int = 0, kernels=None):
    """(O, L) of q (..., Tq, D) over k, v (..., Tk, D), float32 or float64: O like q and the
    log-sum-exp L (..., Tq, 1).  ``kernels``: :func:`compiled`'s (the default) or a stand-in
    with the same calls (the tests' CPU emulation).  Tq and Tk must be positive."""
    _check(q, k, v)
    *lead, Tq, D = q.shape
    Tk, bh = k.shape[-2], math.prod(lead)
    kernels = kernels or compiled(_real(q.dtype), D)
    q, k, v = (xp.ascontiguousarray(a) for a in (q, k, v))
    o, lse = xp.empty_like(q), xp.empty(tuple(lead) + (Tq, 1), dtype=q.dtype)
    _launch(kernels["flash_forward"], Tq, bh, (q, k, v, o, lse), Tq, Tk, q0, k0, scale, causal, q.dtype)
    return o, lse


def backward(q, k, v, o, lse, do, scale: float, causal: bool, q0: int = 0, k0: int = 0, kernels=None):
    """(dQ, dK, dV) of the attention :func:`forward` computed, given dO."""
    _check(q, k, v, o, do)
    *lead, Tq, D = q.shape
    Tk, bh = k.shape[-2], math.prod(lead)
    kernels = kernels or compiled(_real(q.dtype), D)
    q, k, v, do = (xp.ascontiguousarray(a) for a in (q, k, v, do))
    delta = xp.ascontiguousarray(xp.einsum("...i,...i->...", do, o))  # rowsum(dO * O), one per row
    dq, dk, dv = xp.empty_like(q), xp.empty_like(k), xp.empty_like(v)
    args = (Tq, Tk, q0, k0, scale, causal, q.dtype)
    _launch(kernels["flash_backward_dq"], Tq, bh, (q, k, v, do, lse, delta, dq), *args)
    _launch(kernels["flash_backward_dkdv"], Tk, bh, (q, k, v, do, lse, delta, dk, dv), *args)
    return dq, dk, dv
