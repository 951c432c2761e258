"""Batched matrix products, with cuBLAS's strided batched GEMM called directly for bfloat16.

Attention multiplies a batch of matrices at once (Q K^T and P V over every (batch, head)
pair).  ``xp.matmul`` does that in one call on both backends, except for one gap: CuPy 14
multiplies *2-d* bfloat16 matrices on the tensor cores (cuBLAS's GemmEx) but hands a
*batched* bfloat16 product to its integer fallback kernel, which does not know the type
("data type 'E' not understood").  :func:`matmul` is ``xp.matmul`` wherever that works;
where it does not (probed once with a tiny product) it calls cuBLAS's
``cublasGemmStridedBatchedEx`` itself: bfloat16 operands and output, float32 accumulation,
the whole batch in one launch, as CuPy does for float16.

cuBLAS is column-major.  A row-major (M, K) @ (K, N) = (M, N) product is, read in column
order, C^T = B^T A^T: the same buffers with the operands swapped.  A transposed *view* (k
with its last two axes swapped, as in Q K^T) needs no copy: its storage read in column order
is the matrix itself, so it is passed with the "transpose" flag.  :func:`strided_batched`
works out these flags, leading dimensions and batch strides from the arrays' strides; it is
plain Python over any ``gemm`` callable, so a CPU test checks it against NumPy with a NumPy
model of the cuBLAS call.
"""

from __future__ import annotations

import math

from ..backend import BACKEND, bfloat16, host, xp

_native_batched: dict = {}  # dtype -> xp.matmul multiplies batches of it


def matmul(a, b):
    """``a @ b`` for arrays of shape (..., M, K) and (..., K, N), M, K, N >= 1 (batch dims
    broadcast)."""
    if BACKEND == "numpy" or a.dtype != b.dtype or max(a.ndim, b.ndim) <= 2 or _batches_natively(a.dtype):
        return xp.matmul(a, b)
    return strided_batched(a, b, _cublas_gemm)


def _batches_natively(dt) -> bool:
    dt = xp.dtype(dt)
    if dt not in _native_batched:
        try:
            xp.matmul(xp.ones((2, 2, 2), dtype=dt), xp.ones((2, 2, 2), dtype=dt))
            _native_batched[dt] = True
        except Exception:  # noqa: BLE001 - any failure means: not this CuPy's matmul
            _native_batched[dt] = False
    return _native_batched[dt]


def _operand(x):
    """(x, transposed, leading dimension, batch stride) of one operand in cuBLAS's terms,
    in elements; ``x`` is copied to C order only when its strides fit no GEMM layout."""
    for attempt in (x, None):
        if attempt is None:
            x = xp.ascontiguousarray(x)
        *lead, r, c = x.shape
        s = [st // x.itemsize for st in x.strides]
        if any(st < 0 for st in s) or any(st % x.itemsize for st in x.strides):
            continue
        if s[-1] == 1 and (r == 1 or s[-2] >= c):
            trans, ld = 0, (s[-2] if r > 1 else c)  # rows contiguous: read in column order, x^T
        elif s[-2] == 1 and (c == 1 or s[-1] >= r):
            trans, ld = 1, (s[-1] if c > 1 else r)  # columns contiguous: a transposed view
        else:
            continue
        batch = [(n, st) for n, st in zip(lead, s[:len(lead)]) if n > 1]
        if all(s1 == s2 * n2 for (_, s1), (n2, s2) in zip(batch, batch[1:])):
            return x, trans, ld, (batch[-1][1] if batch else 0)
    raise AssertionError("a C-ordered array always fits")  # pragma: no cover


def strided_batched(a, b, gemm):
    """``a @ b`` through ``gemm``, a strided batched GEMM with cuBLAS's arguments
    ``(transa, transb, m, n, k, A, lda, strideA, B, ldb, strideB, C, ldc, strideC, batch)``
    (arrays for the pointers, strides in elements)."""
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(f"matmul shape mismatch: {tuple(a.shape)} @ {tuple(b.shape)}")
    lead = tuple(host.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
    ops = []
    for x in (a, b):
        if x.shape[:-2] != lead and math.prod(x.shape[:-2]) > 1:  # a real broadcast: materialise
            x = xp.ascontiguousarray(xp.broadcast_to(x, lead + x.shape[-2:]))
        ops.append(_operand(x))
    (A, ta, lda, sa), (B, tb, ldb, sb) = ops
    M, K, N = a.shape[-2], a.shape[-1], b.shape[-1]
    out = xp.empty(lead + (M, N), dtype=a.dtype)
    if out.size == 0 or K == 0:
        out[...] = 0
        return out
    # C^T (N x M, column-major) = op(B)^T-storage x op(A)^T-storage: operands swapped
    gemm(tb, ta, N, M, K, B, ldb, sb, A, lda, sa, out, N, M * N, math.prod(lead))
    return out


def _cublas_gemm(transa, transb, m, n, k, A, lda, sa, B, ldb, sb, C, ldc, sc, batch):
    """cublasGemmStridedBatchedEx on CuPy's handle and stream: 16-bit operands, fp32 compute."""
    import numpy
    from cupy.cuda import device, runtime
    from cupy_backends.cuda.libs import cublas

    kind = {bfloat16: getattr(runtime, "CUDA_R_16BF", 14), xp.dtype(xp.float16): runtime.CUDA_R_16F}[C.dtype]
    one, zero = numpy.ones((), numpy.float32), numpy.zeros((), numpy.float32)
    cublas.gemmStridedBatchedEx(
        device.get_cublas_handle(), transa, transb, m, n, k, one.ctypes.data,
        A.data.ptr, kind, lda, sa, B.data.ptr, kind, ldb, sb, zero.ctypes.data,
        C.data.ptr, kind, ldc, sc, batch, cublas.CUBLAS_COMPUTE_32F, cublas.CUBLAS_GEMM_DEFAULT)
