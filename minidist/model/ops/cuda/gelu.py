"""GELU forward and backward as CUDA kernels that read and write the activation's own dtype.

``nn_ops.gelu``'s ``xp`` form is one fused kernel each way (``cupy.fuse``), but it computes in
the compute dtype: under mixed precision the MLP's hidden activation (the fc product, bfloat16,
4C wide: the largest activation of a block) is first cast to float32, and the result cast
back, forward and backward, four passes of their own over it.  These kernels convert in
registers instead: they read x (and the gradient) in float32, float64 or bfloat16, compute in
float32 (float64 for float64), and write the result in x's dtype.  Backward recomputes
t = tanh(u) from x rather than keeping it from forward: a GPU has arithmetic to spare, and not
storing t saves an activation-sized array per layer and a pass each way.

The formulas and their order of operations are ``nn_ops``'s; the rounding can differ a little
(the GPU's tanh, fused multiply-adds).  Switch: ``MINIDIST_CUDA_KERNELS=off``.  Tested on the
CPU through tests/cuda_on_cpu.py (tests/test_gelu_kernel.py) and compiled for an H100 where
nvcc is.
"""

from __future__ import annotations

from minidist.model.backend import xp
from minidist.model.ops.cuda import source

THREADS = 256  # threads per block
BLOCKS = 4096  # blocks at most: each thread strides over the rest ("grid-stride loop")

SOURCE = source.BF16 + r"""
// GELU_C = sqrt(2 / pi), GELU_A = 0.044715 (macros: the same numbers as nn_ops).  x, y, g, dx:
// n contiguous elements of REAL or bfloat16.

// t = tanh(u), u = GELU_C (v + GELU_A v^3): forward's and (recomputed) backward's
__device__ __forceinline__ REAL gelu_tanh(REAL v) { return tanh((REAL)GELU_C * v * (1 + (REAL)GELU_A * v * v)); }

template <class T>
__device__ void gelu_forward_t(const T* x, T* y, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const REAL v = load(x, i);
        store(y, i, (REAL)0.5 * v * (1 + gelu_tanh(v)));
    }
}

template <class T>
__device__ void gelu_backward_t(const T* x, const T* g, T* dx, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const REAL v = load(x, i);
        const REAL t = gelu_tanh(v);
        const REAL du = (REAL)GELU_C * (1 + (REAL)(3.0 * GELU_A) * v * v);
        store(dx, i, load(g, i) * ((REAL)0.5 * (1 + t) + (REAL)0.5 * v * (1 - t * t) * du));
    }
}

extern "C" __global__ void gelu_forward(const REAL* x, REAL* y, long long n) { gelu_forward_t(x, y, n); }
extern "C" __global__ void gelu_backward(const REAL* x, const REAL* g, REAL* dx, long long n) {
    gelu_backward_t(x, g, dx, n);
}
extern "C" __global__ void gelu_forward_bf16(const unsigned short* x, unsigned short* y, long long n) {
    gelu_forward_t(x, y, n);
}
extern "C" __global__ void gelu_backward_bf16(const unsigned short* x, const unsigned short* g, unsigned short* dx,
                                              long long n) {
    gelu_backward_t(x, g, dx, n);
}
"""

KERNELS = ("gelu_forward", "gelu_backward", "gelu_forward_bf16", "gelu_backward_bf16")


def why_not(x) -> str | None:
    """Why the kernels do not run for the activation ``x`` here (None when they do)."""
    if (reason := source.unavailable()) is not None:
        return reason
    if x.dtype not in (xp.float32, xp.float64) and not source.is_bf16(x):
        return f"an activation of dtype {x.dtype} (the kernels read float32, float64 or bfloat16)"
    if x.size == 0:
        return "an empty array"
    return None


def compiled(real: str, c: float, a: float) -> dict:
    """The kernels for ``real`` ('float' or 'double') and the constants (c, a), by name,
    compiled once (CuPy RawModule)."""
    return source.compiled(SOURCE, {"REAL": real, "GELU_C": repr(c), "GELU_A": repr(a)}, KERNELS)


def _launch(kernels, name, x, arrays):
    n = x.size
    kernel = kernels[name + ("_bf16" if source.is_bf16(x) else "")]
    kernel((min(BLOCKS, -(-n // THREADS)), 1), (THREADS,), (*arrays, xp.int64(n)))


def forward(x, c: float, a: float, kernels=None):
    """gelu(x) (tanh form, constants c and a) as a new array of x's dtype and shape."""
    x = source.contiguous(x)
    y = xp.empty_like(x)
    _launch(kernels or compiled(source.real(x.dtype), c, a), "gelu_forward", x, (x, y))
    return y


def backward(x, g, c: float, a: float, kernels=None):
    """g * gelu'(x), a new array of x's dtype (``g`` is taken in that dtype)."""
    if tuple(g.shape) != tuple(x.shape):
        raise ValueError(f"gelu backward: gradient shape {tuple(g.shape)} != input shape {tuple(x.shape)}")
    x = source.contiguous(x)
    g = source.contiguous(g if g.dtype == x.dtype else g.astype(x.dtype))
    dx = xp.empty_like(x)
    _launch(kernels or compiled(source.real(x.dtype), c, a), "gelu_backward", x, (x, g, dx))
    return dx
