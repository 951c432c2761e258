"""What minidist's own CUDA kernels share: whether they can run here, and their compilation.

Each kernel module of this package (``flash``, ``softmax``, ``gelu``, ``layernorm``,
``multi_tensor``) holds its CUDA C source as a string; the ``xp`` form it replaces is in
``minidist.model.ops``.  Its macros (the compute type ``REAL``, block sizes) specialise the source; CuPy's
``RawModule`` compiles it with NVRTC on first use, once per process and set of macros, and
caches the binary on disk.  The same source runs on a CPU under tests/cuda_on_cpu.py.
Pieces of source several kernels use are here: bfloat16 loads and stores (``BF16``) and the
row-per-block reductions (``ROWS``).
"""

from __future__ import annotations

from minidist.host import env
from minidist.model.backend import BACKEND, bfloat16, xp


def unavailable() -> str | None:
    """Why no kernel of minidist's runs here (None when they can): not CuPy, switched off
    (``MINIDIST_CUDA_KERNELS=off``), or a CuPy without ``RawModule``."""
    if BACKEND != "cupy":
        return "the kernels run on CuPy only"
    if env.get("MINIDIST_CUDA_KERNELS") == "off":
        return "MINIDIST_CUDA_KERNELS=off"
    if not hasattr(xp, "RawModule"):
        return "this CuPy has no RawModule"
    return None


_compiled: dict = {}


def compiled(source: str, defines: dict, names) -> dict:
    """The kernels ``names`` of ``source`` with the macros ``defines``, by name, compiled once
    per process (CuPy's RawModule); each is called as ``kernel(grid, block, args)``."""
    key = (source, tuple(sorted(defines.items())))
    if key not in _compiled:
        options = ("-std=c++14",) + tuple(f"-D{name}={value}" for name, value in defines.items())
        module = xp.RawModule(code=source, options=options)
        _compiled[key] = {name: module.get_function(name) for name in names}
    return _compiled[key]


GRID_X = 65535  # blocks in a grid row: a grid of more rows is (GRID_X, ceil(rows / GRID_X))


def row_launch(rows: int, width: int, max_threads: int):
    """(grid, block) of a kernel with one thread block per row of ``width`` elements: enough
    grid rows for ``rows`` blocks, and the smallest power of two of threads that covers a row
    (a short row needs few), at most ``max_threads``.  The kernel returns for rows >= rows."""
    threads = min(max_threads, 1 << max(width - 1, 1).bit_length())
    return (min(rows, GRID_X), -(-rows // GRID_X)), (threads,)


def contiguous(a):
    """``a`` itself when C-contiguous (a kernel indexes it densely), else a C-ordered copy."""
    return a if a.flags.c_contiguous else xp.ascontiguousarray(a)


def real(dtype) -> str:
    """The kernels' compute type, 'double' for float64 arrays and 'float' otherwise."""
    return "double" if dtype == xp.float64 else "float"


def is_bf16(a) -> bool:
    """Is ``a`` a bfloat16 array?  (Without ml_dtypes ``bfloat16`` is None and never equal.)"""
    return bfloat16 is not None and a.dtype == bfloat16


# Loads and stores of bfloat16 for kernels that read or write it, with REAL (float or
# double) the compute type: a kernel's source starts with this text.  bfloat16 is the top
# half of a float32's bits, stored here as unsigned short, so no bf16 header or type is
# needed (NVRTC's cuda_bf16.h, or the CPU emulation's compiler).  ``load`` and ``store``
# are overloaded on the element type, so one templated kernel body serves REAL and bfloat16.
BF16 = r"""
#ifdef __CUDACC__
__device__ __forceinline__ float bits_to_float(unsigned int u) { return __uint_as_float(u); }
__device__ __forceinline__ unsigned int float_to_bits(float f) { return __float_as_uint(f); }
#else
inline float bits_to_float(unsigned int u) { union { unsigned int u; float f; } c; c.u = u; return c.f; }
inline unsigned int float_to_bits(float f) { union { unsigned int u; float f; } c; c.f = f; return c.u; }
#endif
// float -> bfloat16, rounding to nearest even (as ml_dtypes and CuPy's astype); NaN stays NaN
__device__ __forceinline__ unsigned short to_bf16(float f) {
    unsigned int u = float_to_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
    return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
__device__ __forceinline__ REAL load(const REAL* a, long long i) { return a[i]; }
__device__ __forceinline__ float load(const unsigned short* a, long long i) { return bits_to_float((unsigned int)a[i] << 16); }
__device__ __forceinline__ void store(REAL* a, long long i, REAL v) { a[i] = v; }
__device__ __forceinline__ void store(unsigned short* a, long long i, REAL v) { a[i] = to_bf16((float)v); }
"""


# What the kernels with a thread block per row share (REAL the compute type, THREADS the
# most threads a block has, blockDim.x a power of two): the block's row, and the sum and the
# maximum of the threads' values through a shared array of THREADS slots.
ROWS = r"""
#define ROW_OF_BLOCK                                                                          \
    __shared__ REAL part[THREADS];                                                            \
    const long long row = blockIdx.x + (long long)blockIdx.y * gridDim.x;                     \
    if (row >= rows) return; /* the same row for every thread of the block: all return */

__device__ REAL block_sum(REAL v, REAL* part) {
    const int t = threadIdx.x;
    part[t] = v;
    __syncthreads();
    for (int half = blockDim.x / 2; half > 0; half /= 2) {
        if (t < half) part[t] += part[t + half];
        __syncthreads();
    }
    v = part[0];
    __syncthreads();  // every thread has read the result before part is reused
    return v;
}

__device__ REAL block_max(REAL v, REAL* part) {
    const int t = threadIdx.x;
    part[t] = v;
    __syncthreads();
    for (int half = blockDim.x / 2; half > 0; half /= 2) {
        if (t < half && part[t + half] > part[t]) part[t] = part[t + half];
        __syncthreads();
    }
    v = part[0];
    __syncthreads();
    return v;
}
"""
