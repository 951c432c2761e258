"""LayerNorm's row computations as two CUDA kernels: forward, and the input's gradient.

``nn_ops.layer_norm`` writes each line of the formulas as one array expression: on a GPU the
forward is eight kernels (mean, centring, square, mean, add, sqrt, divide, the affine step),
each a pass over the (rows, C) activation, and the input's gradient five more.  A row of
GPT-2 small is 768 numbers, a few KB: here a thread block owns a row, reduces its sums in
shared memory and writes every output of the row in one pass:

* forward: mean, variance (of the centred row, two reductions as in the reference), rstd,
  xhat = (x - mean) * rstd (saved for backward) and y = xhat * w + b;
* backward: gh = g * w, the two row means of gh and gh * xhat, and
  dx = rstd * (gh - mean(gh) - xhat * mean(gh * xhat)).

Under mixed precision the activations between layers are bfloat16: the forward kernel reads
bf16 rows and writes y in bf16, and the backward one writes dx in bf16, converting in
registers, where the ``xp`` form casts the rows to float32 and the results back, a pass each.
The arithmetic, xhat and rstd stay float32.  The parameters' gradients are column sums over
the rows (``linalg.column_sums``), left to BLAS.  The reference's formulas in float32 or
float64; the rounding can differ a little (the order of the sums, the GPU compiler's fused
multiply-adds).  Switch: ``MINIDIST_CUDA_KERNELS=off``.  Tested on the CPU through
tests/cuda_on_cpu.py (tests/test_layernorm_kernel.py) and compiled for an H100 where nvcc is.
"""

from __future__ import annotations

from minidist.model.backend import bfloat16, xp
from minidist.model.ops.cuda import source

THREADS = 256  # threads per row at most (a power of two: the reductions halve it)

SOURCE = source.BF16 + source.ROWS + r"""
// REAL: float or double; blockDim.x a power of two, at most THREADS.  Arrays are (rows, C)
// contiguous, w and b (C,), rstd (rows,).  Block r works on row r.

// One row: x and y in T (REAL, or bfloat16 under mixed precision: read and written as such,
// the arithmetic in REAL), xhat and rstd in REAL for backward.
template <class T>
__device__ void forward_row(const T* x, const REAL* w, const REAL* b, REAL* xhat, T* y, REAL* rstd, long long row,
                            int C, REAL eps, REAL* part) {
    x += row * C; xhat += row * C; y += row * C;
    REAL s = 0;
    for (int j = threadIdx.x; j < C; j += blockDim.x) s += load(x, j);
    const REAL mean = block_sum(s, part) / C;
    REAL q = 0;
    for (int j = threadIdx.x; j < C; j += blockDim.x) q += (load(x, j) - mean) * (load(x, j) - mean);
    const REAL r = 1 / sqrt(block_sum(q, part) / C + eps);
    for (int j = threadIdx.x; j < C; j += blockDim.x) {
        REAL h = (load(x, j) - mean) * r;
        xhat[j] = h;
        store(y, j, h * w[j] + b[j]);
    }
    if (threadIdx.x == 0) rstd[row] = r;
}

// One row's input gradient, written in T (g arrives in REAL: the weight's gradient needs it so).
template <class T>
__device__ void backward_row(const REAL* g, const REAL* w, const REAL* xhat, const REAL* rstd, T* dx, long long row,
                             int C, REAL* part) {
    g += row * C; xhat += row * C; dx += row * C;
    REAL s = 0, t = 0;
    for (int j = threadIdx.x; j < C; j += blockDim.x) {
        REAL gh = g[j] * w[j];
        s += gh;
        t += gh * xhat[j];
    }
    const REAL mean_gh = block_sum(s, part) / C;
    const REAL mean_ghx = block_sum(t, part) / C;
    const REAL r = rstd[row];
    for (int j = threadIdx.x; j < C; j += blockDim.x) store(dx, j, r * (g[j] * w[j] - mean_gh - xhat[j] * mean_ghx));
}

extern "C" __global__ void layer_norm_forward(const REAL* x, const REAL* w, const REAL* b, REAL* xhat, REAL* y,
                                              REAL* rstd, long long rows, int C, REAL eps) {
    ROW_OF_BLOCK
    forward_row(x, w, b, xhat, y, rstd, row, C, eps, part);
}

extern "C" __global__ void layer_norm_forward_bf16(const unsigned short* x, const REAL* w, const REAL* b, REAL* xhat,
                                                   unsigned short* y, REAL* rstd, long long rows, int C, REAL eps) {
    ROW_OF_BLOCK
    forward_row(x, w, b, xhat, y, rstd, row, C, eps, part);
}

extern "C" __global__ void layer_norm_backward(const REAL* g, const REAL* w, const REAL* xhat, const REAL* rstd,
                                               REAL* dx, long long rows, int C) {
    ROW_OF_BLOCK
    backward_row(g, w, xhat, rstd, dx, row, C, part);
}

extern "C" __global__ void layer_norm_backward_bf16(const REAL* g, const REAL* w, const REAL* xhat, const REAL* rstd,
                                                    unsigned short* dx, long long rows, int C) {
    ROW_OF_BLOCK
    backward_row(g, w, xhat, rstd, dx, row, C, part);
}
"""

KERNELS = ("layer_norm_forward", "layer_norm_forward_bf16", "layer_norm_backward", "layer_norm_backward_bf16")


def why_not(x2d, w, b) -> str | None:
    """Why the kernels do not run for these arrays here (None when they do): x2d float32 or
    float64 with w and b alike, or x2d bfloat16 with float32 w and b (mixed precision)."""
    if (reason := source.unavailable()) is not None:
        return reason
    if w is None or b is None:
        return "no weight or no bias (the kernels apply both)"
    real = xp.float32 if source.is_bf16(x2d) else x2d.dtype
    if real not in (xp.float32, xp.float64) or w.dtype != real or b.dtype != real:
        return (f"dtypes {x2d.dtype}, {w.dtype}, {b.dtype} (float32 or float64 throughout, or bfloat16 "
                f"with float32 parameters, needed)")
    if x2d.shape[0] == 0 or x2d.shape[1] == 0:
        return "an empty array"
    return None


def compiled(real: str) -> dict:
    """The kernels for ``real`` ('float' or 'double') by name, compiled once (CuPy RawModule)."""
    return source.compiled(SOURCE, {"REAL": real, "THREADS": THREADS}, KERNELS)


def _launch(kernel, rows: int, C: int, args):
    kernel(*source.row_launch(rows, C, THREADS), args)


def forward(x2d, w, b, eps: float, kernels=None):
    """(xhat, y, rstd) of the rows of ``x2d`` (rows, C): y in x2d's dtype, xhat and rstd (shape
    (rows,)) in the parameters' (float32 for bfloat16 rows)."""
    x2d, w, b = source.contiguous(x2d), source.contiguous(w), source.contiguous(b)
    rows, C = x2d.shape
    kernels = kernels or compiled(source.real(w.dtype))
    xhat, y, rstd = xp.empty(x2d.shape, dtype=w.dtype), xp.empty_like(x2d), xp.empty(rows, dtype=w.dtype)
    _launch(kernels["layer_norm_forward" + ("_bf16" if source.is_bf16(x2d) else "")], rows, C,
            (x2d, w, b, xhat, y, rstd, xp.int64(rows), xp.int32(C), w.dtype.type(eps)))
    return xhat, y, rstd


def backward(g2d, w, xhat, rstd, dtype=None, kernels=None):
    """dx of the rows, given the output's gradient ``g2d`` and forward's xhat and rstd (all in
    the parameters' dtype): in bfloat16 when ``dtype`` is bfloat16 (the kernel rounds), else in
    g2d's dtype."""
    g2d = source.contiguous(g2d)
    rows, C = g2d.shape
    kernels = kernels or compiled(source.real(g2d.dtype))
    low = bfloat16 is not None and dtype == bfloat16
    dx = xp.empty(g2d.shape, dtype=bfloat16 if low else g2d.dtype)
    _launch(kernels["layer_norm_backward" + ("_bf16" if low else "")], rows, C,
            (g2d, source.contiguous(w), xhat, rstd, dx, xp.int64(rows), xp.int32(C)))
    return dx
