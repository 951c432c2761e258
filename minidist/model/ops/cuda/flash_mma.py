"""FlashAttention-2 on tensor cores: bf16 or fp16 operands, float32 accumulation.

Dao 2023, "FlashAttention-2".  ``flash.py`` is the textbook fused kernel (a thread per row, on
CUDA cores); this is the same online-softmax recurrence written the way a GPU's matrix units
want it.  A thread block of four warps owns 64 query rows of one (batch, head) pair, 16 per
warp.  For each tile of 64 keys (loaded once into shared memory), a warp

* multiplies its Q rows by the tile's K^T with ``mma.sync.m16n8k16`` (16 x 8 x 16 products,
  bf16/fp16 in, float32 out), the scores landing in registers in the instruction's
  accumulator layout: lane ``(g, t)`` (g = lane / 4, t = lane % 4) holds rows g and g + 8,
  columns 2t and 2t + 1 of every 8-column tile;
* masks (causal, and keys past T), takes each row's maximum across the four lanes that share
  it (two shuffles), rescales its running sums and output, and exponentiates (base 2, the
  scale times log2(e) folded into one multiply);
* multiplies P by the tile's V, P rounded to bf16/fp16 straight from the accumulator
  registers: two adjacent 8-column accumulator tiles are exactly the operand layout of the
  next 16-deep product, so P never leaves the registers.

Only O and the log-sum-exp L reach device memory.  Backward recomputes the probabilities
from L, split as in ``flash.py`` so that no two blocks add into one array: a ``dq`` kernel
(a warp per 16 query rows: S, dP = dO V^T, dS = P (dP - D), dQ += dS K) and a ``dkdv`` kernel
(a warp per 16 key rows: S^T, dP^T, dV += P^T dO, dK += dS^T Q), with D = rowsum(dO * O)
from a small kernel of its own.  No T x T array exists in forward or backward.

The kernels read Q, K and V through strides (a batch, a head and a row stride, and an offset
from the array they are given), so the fused QKV projection (B, T, 3C) is read in place and
the gradients land in place in its gradient, and O is written straight into its heads'
columns of the (B, T, C) output: no head-splitting copies.  Head sizes 64 and 128.

Without a GPU: inline PTX cannot run on a CPU, so the two warp-level operations the kernels use
(the ``mma`` and the shuffle) come from ``mma.py`` with a CPU form that exchanges the lanes'
registers through a static array between two ``__syncthreads``, which tests/cuda_on_cpu.py runs.  That
checks the fragment layouts and the indexing against the batched-product reference
(tests/test_flash_mma_kernel.py); NVRTC compiles the GPU form for sm_90 in the same test.

Chosen by ``tuning.fused_attention`` (the one place that picks the ops' path): on CuPy, for
bf16/fp16 operands and head sizes 64 and 128, unless ``MINIDIST_FLASH_MMA=off``.
"""

from __future__ import annotations

from minidist.host import env
from minidist.model.backend import bfloat16, xp
from minidist.model.ops.cuda import mma, source

HEAD_DIMS = (64, 128)
ROWS = 64  # query (or key) rows per thread block: four warps of 16
THREADS = 128

SOURCE = mma.SOURCE + r"""
// HEAD_DIM: 64 or 128.
#define TILE 64                     // keys (or queries) per shared tile
#define PITCH (HEAD_DIM + 8)        // a shared row, padded by 16 bytes against bank conflicts
#define KSTEPS (HEAD_DIM / 16)      // 16-deep products along the head dimension
#define DTILES (HEAD_DIM / 8)       // 8-wide accumulator tiles along the head dimension

struct alignas(16) V4 { unsigned x, y, z, w; };

__device__ __forceinline__ unsigned word(const E* p) { return *(const unsigned*)p; }
// two elements of one column, rows r and r + 1 of a shared tile, as one operand register
__device__ __forceinline__ unsigned column_pair(const E (*tile)[PITCH], int r, int c) {
    return (unsigned)tile[r][c] | ((unsigned)tile[r + 1][c] << 16);
}

// rows [start, start + TILE) of one head's (T, HEAD_DIM) matrix (row stride st) into a shared tile
__device__ __forceinline__ void load_tile(E (*tile)[PITCH], const E* src, long long st, int start, int T) {
    for (int i = threadIdx.x; i < TILE * (HEAD_DIM / 8); i += blockDim.x) {
        const int r = i / (HEAD_DIM / 8), c = (i % (HEAD_DIM / 8)) * 8;
        V4 val = {0u, 0u, 0u, 0u};
        if (start + r < T) val = *(const V4*)(src + (long long)(start + r) * st + c);
        *(V4*)&tile[r][c] = val;
    }
}

// A-operand fragments (16 rows x HEAD_DIM) of rows r0 .. r0 + 15 of a head, from device memory
__device__ __forceinline__ void load_rows(unsigned f[KSTEPS][4], const E* src, long long st, int r0, int T) {
    const int lane = threadIdx.x & 31, g = lane >> 2, tg = lane & 3;
    for (int kk = 0; kk < KSTEPS; ++kk)
        for (int i = 0; i < 4; ++i) {
            const int r = r0 + g + 8 * (i & 1), c = kk * 16 + 2 * tg + 8 * (i >> 1);
            f[kk][i] = r < T ? word(src + (long long)r * st + c) : 0u;
        }
}

// acc (16 x 8 tiles) = A (16 x HEAD_DIM) times the tile's rows as B^T: a row of the tile per column
__device__ __forceinline__ void times_rows(float acc[TILE / 8][4], const unsigned a[KSTEPS][4], const E (*tile)[PITCH]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, tg = lane & 3;
    for (int n = 0; n < TILE / 8; ++n) {
        for (int e = 0; e < 4; ++e) acc[n][e] = 0.f;
        for (int kk = 0; kk < KSTEPS; ++kk) {
            const unsigned b[2] = {word(&tile[n * 8 + g][kk * 16 + 2 * tg]), word(&tile[n * 8 + g][kk * 16 + 8 + 2 * tg])};
            mma(acc[n], a[kk], b);
        }
    }
}

// out (16 x HEAD_DIM) += P (16 x TILE, accumulator layout, rounded here) times the tile (TILE x HEAD_DIM)
__device__ __forceinline__ void add_times_tile(float out[DTILES][4], const float p[TILE / 8][4], const E (*tile)[PITCH]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, tg = lane & 3;
    for (int j = 0; j < TILE / 16; ++j) {
        // two adjacent accumulator tiles are one A operand: the FlashAttention-2 register reuse
        const unsigned a[4] = {pack(p[2 * j][0], p[2 * j][1]), pack(p[2 * j][2], p[2 * j][3]),
                               pack(p[2 * j + 1][0], p[2 * j + 1][1]), pack(p[2 * j + 1][2], p[2 * j + 1][3])};
        for (int n = 0; n < DTILES; ++n) {
            const unsigned b[2] = {column_pair(tile, j * 16 + 2 * tg, n * 8 + g), column_pair(tile, j * 16 + 8 + 2 * tg, n * 8 + g)};
            mma(out[n], a, b);
        }
    }
}

// The last key a block's rows may see, plus one (causal), or T.
__device__ __forceinline__ int keys_end(int T, int causal) {
    return causal ? min(T, (int)(blockIdx.y + 1) * TILE) : T;
}

__device__ __forceinline__ bool visible(int row, int col, int T, int causal) {
    return row < T && col < T && (!causal || col <= row);
}

#define HEAD_BASES                                                                            \
    const long long bh = blockIdx.x, b = bh / H, h = bh % H;                                  \
    const long long in_base = b * sb + h * sh, out_base = b * ob + h * oh;                    \
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tg = lane & 3; \
    const float c = scale * 1.4426950408889634f; /* scores in base 2 */

extern "C" __global__ void __launch_bounds__(128) flash_mma_forward(
        const E* q, const E* k, const E* v, E* o, float* lse, long long qo, long long ko, long long vo,
        int H, int T, long long sb, long long sh, long long st, long long ob, long long oh, long long ot,
        float scale, int causal) {
    alignas(16) __shared__ E ks[TILE][PITCH];
    alignas(16) __shared__ E vs[TILE][PITCH];
    HEAD_BASES
    q += qo + in_base; k += ko + in_base; v += vo + in_base; o += out_base;
    const int r0 = blockIdx.y * TILE + warp * 16;  // this warp's first query row
    unsigned qf[KSTEPS][4];
    load_rows(qf, q, st, r0, T);
    float acc[DTILES][4], m[2] = {neg_inf(), neg_inf()}, l[2] = {0.f, 0.f};
    for (int n = 0; n < DTILES; ++n) for (int e = 0; e < 4; ++e) acc[n][e] = 0.f;
    const int end = keys_end(T, causal);
    for (int start = 0; start < end; start += TILE) {
        __syncthreads();  // every warp is done with the previous tile
        load_tile(ks, k, st, start, T);
        load_tile(vs, v, st, start, T);
        __syncthreads();
        float s[TILE / 8][4];
        times_rows(s, qf, ks);
        for (int half = 0; half < 2; ++half) {  // rows g and g + 8
            const int row = r0 + g + 8 * half;
            float mx = neg_inf();
            for (int n = 0; n < TILE / 8; ++n)
                for (int e = 2 * half; e < 2 * half + 2; ++e) {
                    const int col = start + n * 8 + 2 * tg + (e & 1);
                    s[n][e] = visible(row, col, T, causal) ? s[n][e] * c : neg_inf();
                    mx = fmaxf(mx, s[n][e]);
                }
            mx = fmaxf(mx, shfl_xor(mx, 1));
            mx = fmaxf(mx, shfl_xor(mx, 2));  // the four lanes of the row agree
            const float m_new = fmaxf(m[half], mx);
            const float base = m_new == neg_inf() ? 0.f : m_new;  // a row that has seen no key yet
            const float alpha = exp2f(m[half] - base);
            l[half] *= alpha;
            for (int n = 0; n < DTILES; ++n) { acc[n][2 * half] *= alpha; acc[n][2 * half + 1] *= alpha; }
            for (int n = 0; n < TILE / 8; ++n)
                for (int e = 2 * half; e < 2 * half + 2; ++e) { s[n][e] = exp2f(s[n][e] - base); l[half] += s[n][e]; }
            m[half] = m_new;
        }
        add_times_tile(acc, s, vs);
    }
    for (int half = 0; half < 2; ++half) {
        l[half] += shfl_xor(l[half], 1);
        l[half] += shfl_xor(l[half], 2);
        const int row = r0 + g + 8 * half;
        if (row >= T) continue;
        const float inv = l[half] > 0.f ? 1.f / l[half] : 0.f;
        for (int n = 0; n < DTILES; ++n)
            *(unsigned*)(o + (long long)row * ot + n * 8 + 2 * tg) = pack(acc[n][2 * half] * inv, acc[n][2 * half + 1] * inv);
        if (tg == 0) lse[bh * T + row] = l[half] > 0.f ? (m[half] + log2f(l[half])) * 0.6931471805599453f : neg_inf();
    }
}

// D = rowsum(dO * O) in float32, a thread per row
extern "C" __global__ void flash_mma_delta(const E* o, const E* dout, float* delta, int H, int T,
                                           long long ob, long long oh, long long ot, long long rows) {
    const long long row = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= rows) return;
    const long long bh = row / T, b = bh / H, h = bh % H, i = row % T;
    const long long at = b * ob + h * oh + i * ot;
    float sum = 0.f;
    for (int d = 0; d < HEAD_DIM; ++d) sum += to_float(o[at + d]) * to_float(dout[at + d]);
    delta[row] = sum;
}

// dS = P (dP - D) for a warp's 16 x TILE block, P recomputed from the base-2 scores and L
__device__ __forceinline__ void scores_to_ds(float s[TILE / 8][4], float dp[TILE / 8][4], int qrow0, int kcol0,
                                             bool transposed, const float* L2, const float* Dl, float c, int T, int causal) {
    const int lane = threadIdx.x & 31, g = lane >> 2, tg = lane & 3;
    for (int n = 0; n < TILE / 8; ++n)
        for (int e = 0; e < 4; ++e) {
            const int r = g + 8 * (e >> 1), cc = n * 8 + 2 * tg + (e & 1);
            // untransposed: rows are queries, columns keys; transposed (dK/dV): the other way round
            const int qi = transposed ? cc : r, kj = transposed ? r : cc;
            const int qrow = qrow0 + qi, kcol = kcol0 + kj;
            const float p = visible(qrow, kcol, T, causal) ? exp2f(s[n][e] * c - L2[qi]) : 0.f;
            s[n][e] = p;
            dp[n][e] = p * (dp[n][e] - Dl[qi]);  // dS, in dP's registers
        }
}

extern "C" __global__ void __launch_bounds__(128) flash_mma_backward_dq(
        const E* q, const E* k, const E* v, const E* dout, const float* lse, const float* delta, E* dq,
        long long qo, long long ko, long long vo, int H, int T, long long sb, long long sh, long long st,
        long long ob, long long oh, long long ot, float scale, int causal) {
    alignas(16) __shared__ E ks[TILE][PITCH];
    alignas(16) __shared__ E vs[TILE][PITCH];
    __shared__ float L2s[TILE], Dls[TILE];
    HEAD_BASES
    q += qo + in_base; k += ko + in_base; v += vo + in_base; dq += qo + in_base; dout += out_base;
    const int r0 = blockIdx.y * TILE + warp * 16;
    unsigned qf[KSTEPS][4], df[KSTEPS][4];
    load_rows(qf, q, st, r0, T);
    load_rows(df, dout, ot, r0, T);
    for (int i = threadIdx.x; i < TILE; i += blockDim.x) {
        const int row = blockIdx.y * TILE + i;
        L2s[i] = row < T ? lse[bh * T + row] * 1.4426950408889634f : 0.f;
        Dls[i] = row < T ? delta[bh * T + row] : 0.f;
    }
    float acc[DTILES][4];
    for (int n = 0; n < DTILES; ++n) for (int e = 0; e < 4; ++e) acc[n][e] = 0.f;
    const int end = keys_end(T, causal);
    for (int start = 0; start < end; start += TILE) {
        __syncthreads();
        load_tile(ks, k, st, start, T);
        load_tile(vs, v, st, start, T);
        __syncthreads();
        float s[TILE / 8][4], dp[TILE / 8][4];
        times_rows(s, qf, ks);
        times_rows(dp, df, vs);
        scores_to_ds(s, dp, r0, start, false, L2s + warp * 16, Dls + warp * 16, c, T, causal);
        add_times_tile(acc, dp, ks);  // dQ += dS K
    }
    for (int half = 0; half < 2; ++half) {
        const int row = r0 + g + 8 * half;
        if (row >= T) continue;
        for (int n = 0; n < DTILES; ++n)
            *(unsigned*)(dq + (long long)row * st + n * 8 + 2 * tg) = pack(acc[n][2 * half] * scale, acc[n][2 * half + 1] * scale);
    }
}

extern "C" __global__ void __launch_bounds__(128) flash_mma_backward_dkdv(
        const E* q, const E* k, const E* v, const E* dout, const float* lse, const float* delta, E* dk, E* dv,
        long long qo, long long ko, long long vo, int H, int T, long long sb, long long sh, long long st,
        long long ob, long long oh, long long ot, float scale, int causal) {
    alignas(16) __shared__ E qs[TILE][PITCH];
    alignas(16) __shared__ E dos[TILE][PITCH];
    __shared__ float L2s[TILE], Dls[TILE];
    HEAD_BASES
    q += qo + in_base; k += ko + in_base; v += vo + in_base; dk += ko + in_base; dv += vo + in_base;
    dout += out_base;
    const int r0 = blockIdx.y * TILE + warp * 16;  // this warp's first key row
    unsigned kf[KSTEPS][4], vf[KSTEPS][4];
    load_rows(kf, k, st, r0, T);
    load_rows(vf, v, st, r0, T);
    float dka[DTILES][4], dva[DTILES][4];
    for (int n = 0; n < DTILES; ++n) for (int e = 0; e < 4; ++e) dka[n][e] = dva[n][e] = 0.f;
    // causal: the query tiles before this block's first key see none of its keys
    for (int start = causal ? (int)blockIdx.y * TILE : 0; start < T; start += TILE) {
        __syncthreads();
        load_tile(qs, q, st, start, T);
        load_tile(dos, dout, ot, start, T);
        for (int i = threadIdx.x; i < TILE; i += blockDim.x) {
            L2s[i] = start + i < T ? lse[bh * T + start + i] * 1.4426950408889634f : 0.f;
            Dls[i] = start + i < T ? delta[bh * T + start + i] : 0.f;
        }
        __syncthreads();
        float s[TILE / 8][4], dp[TILE / 8][4];
        times_rows(s, kf, qs);   // S^T: this warp's keys against the tile's queries
        times_rows(dp, vf, dos);  // dP^T = V dO^T
        scores_to_ds(s, dp, start, r0, true, L2s, Dls, c, T, causal);
        add_times_tile(dva, s, dos);  // dV += P^T dO
        add_times_tile(dka, dp, qs);  // dK += dS^T Q
    }
    for (int half = 0; half < 2; ++half) {
        const int row = r0 + g + 8 * half;
        if (row >= T) continue;
        for (int n = 0; n < DTILES; ++n) {
            *(unsigned*)(dk + (long long)row * st + n * 8 + 2 * tg) = pack(dka[n][2 * half] * scale, dka[n][2 * half + 1] * scale);
            *(unsigned*)(dv + (long long)row * st + n * 8 + 2 * tg) = pack(dva[n][2 * half], dva[n][2 * half + 1]);
        }
    }
}
"""

KERNELS = ("flash_mma_forward", "flash_mma_delta", "flash_mma_backward_dq", "flash_mma_backward_dkdv")


def defines(low: str, head_dim: int) -> dict[str, str]:
    """The macros for operands of the 16-bit type ``low`` ('bf16' or 'fp16') and a head size."""
    return {"HEAD_DIM": str(head_dim), "IS_BF16": "1" if low == "bf16" else "0"}


def low_name(dtype) -> str | None:
    """'bf16', 'fp16' or None (not a type these kernels take)."""
    if bfloat16 is not None and dtype == bfloat16:
        return "bf16"
    return "fp16" if dtype == xp.float16 else None


def why_not(dtype, head_dim: int) -> str | None:
    """Why these kernels do not run for operands of ``dtype`` and this head size (None: they do)."""
    if (reason := source.unavailable()) is not None:
        return reason
    if env.get("MINIDIST_FLASH_MMA") == "off":
        return "MINIDIST_FLASH_MMA=off"
    if low_name(dtype) is None:
        return f"operands of {xp.dtype(dtype).name}: the tensor-core kernels take bf16 or fp16"
    if head_dim not in HEAD_DIMS:
        return f"head size {head_dim} is not one of {HEAD_DIMS}"
    return None


def compiled(low: str, head_dim: int) -> dict:
    return source.compiled(SOURCE, defines(low, head_dim), KERNELS)


class Layout:
    """Where a (B, H, T, D) operand's rows are in the C-contiguous array a kernel is handed:
    an element offset, and the batch, head and row strides in elements (a row's D values
    contiguous).  The kernels load rows 16 bytes at a time, so offsets and strides must be
    multiples of 8 elements (true for D = 64 and 128 in all three layouts below)."""

    def __init__(self, array, offset: int, strides, H: int, T: int, D: int):
        self.array, self.offset, self.strides, self.H, self.T, self.D = array, offset, tuple(strides), H, T, D

    @classmethod
    def of_fused(cls, X, part: int, H: int):
        """Part (0 = Q, 1 = K, 2 = V) of a fused projection (B, T, 3C), head h in columns
        [part C + h D, part C + (h + 1) D)."""
        B, T, C3 = X.shape
        C = C3 // 3
        return cls(X, part * C, (T * C3, C // H, C3), H, T, C // H)

    @classmethod
    def of_merged(cls, Y, H: int):
        """The heads of a (B, T, C) array, head h in columns [h D, (h + 1) D)."""
        B, T, C = Y.shape
        return cls(Y, 0, (T * C, C // H, C), H, T, C // H)

    @classmethod
    def of_split(cls, A):
        """A (..., H, T, D) array."""
        *lead, H, T, D = A.shape
        return cls(A, 0, (H * T * D, T * D, D), H, T, D)


def aligned(a):
    """``a`` as the kernels read it: C-contiguous, starting on a 16-byte boundary (rows are
    loaded 16 bytes at a time); a copy only where ``a`` is not already so."""
    a = xp.ascontiguousarray(a)
    return a if a.data.ptr % 16 == 0 else a.copy()


def _int64(*values):
    return tuple(xp.int64(v) for v in values)


def _tail(q: Layout, o: Layout, scale: float, causal: bool) -> tuple:
    """The arguments every attention kernel ends with: offsets, sizes, strides, scale, mask."""
    return (xp.int32(q.H), xp.int32(q.T)) + _int64(*q.strides, *o.strides) + (xp.float32(scale), xp.int32(causal))


def forward(q: Layout, k: Layout, v: Layout, o: Layout, batch: int, scale: float, causal: bool, kernels=None):
    """Write O = softmax(scale Q K^T) V through the layout ``o`` and return L, the rows'
    log-sum-exp (batch * H * T values, float32).  Q, K and V share one layout but the offset
    (their arrays may differ); ``kernels``: :func:`compiled`'s, or the tests' CPU stand-in."""
    kernels = kernels or compiled(low_name(q.array.dtype), q.D)
    lse = xp.empty(batch * q.H * q.T, dtype=xp.float32)
    grid = (batch * q.H, -(-q.T // ROWS))
    kernels["flash_mma_forward"](grid, (THREADS,), (q.array, k.array, v.array, o.array, lse)
                                 + _int64(q.offset, k.offset, v.offset) + _tail(q, o, scale, causal))
    return lse


def backward(q: Layout, k: Layout, v: Layout, o: Layout, do_array, lse, dq_array, dk_array, dv_array,
             batch: int, scale: float, causal: bool, kernels=None):
    """Write dQ, dK and dV into ``dq_array``, ``dk_array``, ``dv_array``, each at the offset
    and strides of its operand (one array may take all three, as the fused projection's
    gradient does); dO has O's layout."""
    kernels = kernels or compiled(low_name(q.array.dtype), q.D)
    rows = batch * q.H * q.T
    delta = xp.empty(rows, dtype=xp.float32)  # D = rowsum(dO * O)
    kernels["flash_mma_delta"](((rows + THREADS - 1) // THREADS, 1), (THREADS,),
                               (o.array, do_array, delta, xp.int32(q.H), xp.int32(q.T)) + _int64(*o.strides, rows))
    grid = (batch * q.H, -(-q.T // ROWS))
    tail = _int64(q.offset, k.offset, v.offset) + _tail(q, o, scale, causal)
    kernels["flash_mma_backward_dq"](grid, (THREADS,), (q.array, k.array, v.array, do_array, lse, delta, dq_array) + tail)
    kernels["flash_mma_backward_dkdv"](grid, (THREADS,),
                                       (q.array, k.array, v.array, do_array, lse, delta, dk_array, dv_array) + tail)
