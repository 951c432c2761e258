"""Batched matrix products on CuPy through cuBLAS's strided batched GEMM, without copies.

Attention multiplies a batch of matrices at once: Q K^T and P V over every (batch, head)
pair, and in backward P^T dO, dO V^T, dS K and dS^T Q.  ``xp.matmul`` does that in one call,
but on CuPy it first copies every operand that is not C-contiguous, and attention's operands
rarely are: K^T, P^T and dS^T are transposed views (P^T and dS^T are T x T, the largest
arrays of a step), and a head's Q, K and V are strided views into the fused QKV projection.
cuBLAS itself needs none of those copies: a matrix is a pointer, a leading dimension and a
"transposed" flag, and a batch is a stride between matrices.  :func:`matmul` passes the views
as they are (``cublasGemmStridedBatchedEx``); it also writes into a strided ``out`` (a head's
slice of the (B, T, C) output), which saves the copy that merges the heads.  It also fills a
gap of CuPy 14, which multiplies 2-d bfloat16 matrices on the tensor cores but sends a
*batched* bfloat16 product to an integer kernel that does not know the type.

Mixed precision wants one more thing CuPy's matmul cannot give: a float32 product of bfloat16
(or float16) operands.  cuBLAS accumulates in float32 anyway; ``matmul(..., dtype=float32)``
has it write that accumulator out instead of rounding it to 16 bits, which a cast back to
float32 would then read and write again.  The gradients of linear layers take it: a master
weight's gradient, the gradient of a float32 input (a LayerNorm's output), a bias gradient
(``linalg.column_sums``).

cuBLAS is column-major.  A row-major (M, K) @ (K, N) = (M, N) product read in column order is
C^T = B^T A^T: the same buffers with the operands swapped.  A transposed view's storage read in
column order is the matrix itself, passed with the "transpose" flag.  Batch axes whose strides
do not collapse into one (a head's view: batch stride T*3C, head stride D) become a loop of
calls over the outer axes, each matrix an offset from its array's address (no views made).
:func:`strided_batched` works all this out from the arrays' shapes and strides, once per
layout (:func:`_plan`; a step repeats the same few dozen), since the host's time per product
is what a fast GPU waits on; it is plain Python over any ``gemm`` callable, so a CPU test
checks it against NumPy with a NumPy model of the cuBLAS call.

The switch: ``MINIDIST_CUBLAS_BATCHED=off`` uses ``xp.matmul`` (CuPy's copies) except where
CuPy cannot multiply at all (batched bfloat16).  NumPy always uses ``xp.matmul``.
"""

from __future__ import annotations

import functools
import itertools
import math
import os

from minidist.host import env
from minidist.model.backend import BACKEND, host, xp

_SWITCH = env.get("MINIDIST_CUBLAS_BATCHED")
_native_batched: dict = {}  # dtype -> xp.matmul multiplies batches of it
_GEMM_DTYPES = ("float16", "bfloat16", "float32", "float64")
_LAYOUTS_KEPT = 4096  # layouts whose analysis is remembered (bounded: generation meets a new T per token)


def _has_cublas() -> bool:
    """CuPy's cuBLAS bindings are there (not under NumPy, nor under the CuPy emulator)."""
    if BACKEND == "numpy":
        return False
    try:
        from cupy_backends.cuda.libs import cublas  # noqa: F401
    except ImportError:
        return False
    return True


_CUBLAS = _has_cublas()


def matmul(a, b, out=None, dtype=None):
    """``a @ b`` for arrays of shape (..., M, K) and (..., K, N) (batch dims broadcast), into
    ``out`` (any strides) when given, as ``dtype`` (default: the operands').  cuBLAS writes a
    float32 product of 16-bit operands directly from its float32 accumulator (:func:`direct`);
    any other change of dtype is a cast of the product."""
    want = a.dtype if dtype is None else xp.dtype(dtype)
    if _uses_cublas(a, b, want):
        return strided_batched(a, b, _cublas_gemm, out, want)
    if dtype is None or a.dtype == b.dtype == want:
        return xp.matmul(a, b, out=out)
    c = matmul(a, b)  # in the operands' dtype: through cuBLAS where CuPy cannot batch it
    c = c if c.dtype == want else c.astype(want)
    if out is None:
        return c
    out[...] = c
    return out


def _uses_cublas(a, b, dtype) -> bool:
    """Does :func:`matmul` call cuBLAS itself for ``a @ b`` written as ``dtype``?  For a float32
    product of 16-bit operands, yes (CuPy's matmul writes the operands' dtype).  For a product
    in the operands' dtype: 2-d ones stay CuPy's (one cuBLAS call there too);
    batched ones come here unless ``MINIDIST_CUBLAS_BATCHED=off``, and then still where CuPy
    cannot batch the dtype."""
    if a.dtype != b.dtype or min(a.ndim, b.ndim) < 2 or not direct(a.dtype, dtype):
        return False
    if dtype != a.dtype:
        return True
    if max(a.ndim, b.ndim) <= 2:
        return False
    return _SWITCH != "off" or not _batches_natively(a.dtype)


def direct(operands, dtype) -> bool:
    """Does :func:`matmul` hand operands of dtype ``operands`` to cuBLAS, writing ``dtype``?
    Yes for the dtypes cuBLAS multiplies, into their own dtype or, for float16 and bfloat16,
    into float32; not under NumPy, nor with ``MINIDIST_CUBLAS_BATCHED=off`` for a change of
    dtype (a cast of the product then)."""
    operands, dtype = xp.dtype(operands), xp.dtype(dtype)
    if not _CUBLAS or operands.name not in _GEMM_DTYPES:
        return False
    if dtype == operands:
        return True
    return _SWITCH != "off" and operands.name in ("float16", "bfloat16") and dtype.name == "float32"


def _batches_natively(dt) -> bool:
    dt = xp.dtype(dt)
    if dt not in _native_batched:
        try:
            xp.matmul(xp.ones((2, 2, 2), dtype=dt), xp.ones((2, 2, 2), dtype=dt))
            _native_batched[dt] = True
        except Exception:  # noqa: BLE001 - any failure means: not this CuPy's matmul
            _native_batched[dt] = False
    return _native_batched[dt]


def _layout(x):
    """What a plan depends on: shape, strides (bytes) and item size, not the data."""
    return x.shape, x.strides, x.itemsize


@functools.lru_cache(maxsize=_LAYOUTS_KEPT)
def _matrix(shape, strides, itemsize):
    """(transposed, leading dimension) of the matrices of an array of this layout in cuBLAS's
    terms (elements), or None when they fit no GEMM layout -- or when any stride, a batch
    axis's too, is negative or not a whole number of elements: such an operand is copied
    (an output, written through a copy), so :func:`_plan` only meets strides >= 0."""
    r, c = shape[-2:]
    if any(st < 0 or st % itemsize for st in strides):
        return None
    s0, s1 = strides[-2] // itemsize, strides[-1] // itemsize
    if (s1 == 1 or c == 1) and (r == 1 or s0 >= c):
        return 0, (s0 if r > 1 else c)  # rows contiguous: read in column order it is x^T
    if (s0 == 1 or r == 1) and (c == 1 or s1 >= r):
        return 1, (s1 if c > 1 else r)  # columns contiguous: a transposed view
    return None


def _batch_strides(lead, shape, strides, itemsize):
    """The strides (elements) of an operand's batch axes once broadcast to ``lead``: 0 where it
    is broadcast (a missing axis or one of length 1)."""
    pad = len(lead) - (len(shape) - 2)
    return tuple(0 if i < pad or shape[i - pad] == 1 else strides[i - pad] // itemsize for i in range(len(lead)))


def _collapses(lead, steps, n) -> bool:
    """Do batch axes n.. (those longer than 1) step through memory with one stride?"""
    inner = [(lead[i], steps[i]) for i in range(n, len(lead)) if lead[i] > 1]
    return all(s1 == s2 * n2 for (_, s1), (n2, s2) in zip(inner, inner[1:]))


@functools.lru_cache(maxsize=_LAYOUTS_KEPT)
def _plan(lead, la, lb, lc):
    """The cuBLAS calls of C = A @ B for operands and result of layouts ``la``, ``lb``, ``lc``
    (:func:`_layout`; A and B fit a GEMM layout, C is untransposed), batch dims ``lead``:
    (transposed, leading dimension, batch stride) of A, the same of B, (leading dimension,
    batch stride) of C, the batch of each call, and one (offset of A, of B, of C) in elements
    per call.

    A plan depends on the layouts only, so it is made once per shape and kept: a step asks
    for the same few dozen layouts again and again, and the analysis below costs the host
    tens of microseconds a product, more than the calls themselves."""
    steps = [_batch_strides(lead, *x) for x in (la, lb, lc)]
    # loop over the fewest outer batch axes that leave one stride per operand inside
    outer = next(n for n in range(len(lead) + 1) if all(_collapses(lead, st, n) for st in steps))
    inner = [i for i in range(outer, len(lead)) if lead[i] > 1]
    sa, sb, sc = (st[inner[-1]] if inner else 0 for st in steps)
    (ta, lda), (tb, ldb), (_, ldc) = (_matrix(*x) for x in (la, lb, lc))
    offsets = tuple(tuple(sum(i * s for i, s in zip(idx, st)) for st in steps)
                    for idx in itertools.product(*(range(n) for n in lead[:outer])))
    return ta, lda, sa, tb, ldb, sb, ldc, sc, math.prod(lead[outer:]), offsets


def _writable_output(out, dtype) -> bool:
    """Can cuBLAS write the product straight into ``out``?  (C is never transposed.)"""
    layout = _matrix(*_layout(out)) if out.dtype == dtype else None
    return layout is not None and layout[0] == 0


def strided_batched(a, b, gemm, out=None, dtype=None):
    """``a @ b`` through ``gemm``, a strided batched GEMM with cuBLAS's arguments
    ``(transa, transb, m, n, k, A, lda, strideA, B, ldb, strideB, C, ldc, strideC, batch)``,
    where A, B and C are (array, offset of the first matrix in elements) pairs (strides in
    elements too), written as ``dtype`` (default a's)."""
    dtype = xp.dtype(a.dtype if dtype is None else dtype)
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(f"matmul shape mismatch: {tuple(a.shape)} @ {tuple(b.shape)}")
    lead = tuple(host.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
    M, K, N = a.shape[-2], a.shape[-1], b.shape[-1]
    if out is not None and tuple(out.shape) != lead + (M, N):
        raise ValueError(f"matmul out has shape {tuple(out.shape)}, not {lead + (M, N)}")
    a, b = (x if _matrix(*_layout(x)) is not None else xp.ascontiguousarray(xp.broadcast_to(x, lead + x.shape[-2:]))
            for x in (a, b))
    into_out = out is not None and _writable_output(out, dtype) and not (
        xp.may_share_memory(out, a) or xp.may_share_memory(out, b))  # cuBLAS's C must not alias A or B
    c = out if into_out else xp.empty(lead + (M, N), dtype=dtype)
    if c.size and K == 0:
        c[...] = 0
    elif c.size:
        ta, lda, sa, tb, ldb, sb, ldc, sc, batch, offsets = _plan(lead, _layout(a), _layout(b), _layout(c))
        for oa, ob, oc in offsets:
            # C^T (N x M, column-major) = B^T A^T: the operands swapped
            gemm(tb, ta, N, M, K, (b, ob), ldb, sb, (a, oa), lda, sa, (c, oc), ldc, sc, batch)
    if out is None:
        return c
    if c is not out:
        out[...] = c
    return out


def _cublas_gemm(transa, transb, m, n, k, A, lda, sa, B, ldb, sb, C, ldc, sc, batch):
    """cublasGemmStridedBatchedEx on CuPy's handle and stream, A, B and C (array, offset) pairs.
    16-bit operands accumulate in float32 (tensor cores) and C is theirs or float32; float32
    uses TF32 tensor cores only with CUPY_TF32=1 (--tf32), as CuPy's own matmul does."""
    from cupy.cuda import device
    from cupy_backends.cuda.libs import cublas

    (a, oa), (b, ob), (c, oc) = A, B, C
    compute, one, zero, kind_a, kind_c = _call_constants(a.dtype, c.dtype)
    cublas.gemmStridedBatchedEx(
        device.get_cublas_handle(), transa, transb, m, n, k, one,
        a.data.ptr + oa * a.itemsize, kind_a, lda, sa, b.data.ptr + ob * b.itemsize, kind_a, ldb, sb, zero,
        c.data.ptr + oc * c.itemsize, kind_c, ldc, sc, batch, compute, cublas.CUBLAS_GEMM_DEFAULT)


_constants: dict = {}
_scalars: list = []  # the host scalars whose addresses _constants holds, kept alive


def _call_constants(a_dtype, c_dtype):
    """(compute type, alpha's and beta's addresses, A's and B's data type, C's data type) of a
    call, made once per dtype pair (this runs for every product: the host's time per call
    counts)."""
    tf32 = os.environ.get("CUPY_TF32", "0") not in ("", "0")
    key = (a_dtype, c_dtype, tf32)
    if key not in _constants:
        from cupy.cuda import runtime
        from cupy_backends.cuda.libs import cublas

        kinds = {"bfloat16": getattr(runtime, "CUDA_R_16BF", 14), "float16": runtime.CUDA_R_16F,
                 "float32": runtime.CUDA_R_32F, "float64": runtime.CUDA_R_64F}
        name = xp.dtype(a_dtype).name
        if name == "float64":
            compute, scalar = cublas.CUBLAS_COMPUTE_64F, host.float64
        elif name == "float32" and tf32:
            compute, scalar = cublas.CUBLAS_COMPUTE_32F_FAST_TF32, host.float32
        else:
            compute, scalar = cublas.CUBLAS_COMPUTE_32F, host.float32
        one, zero = host.ones((), scalar), host.zeros((), scalar)  # alpha, beta: host scalars cuBLAS reads
        _scalars.extend((one, zero))
        _constants[key] = (compute, one.ctypes.data, zero.ctypes.data, kinds[name], kinds[xp.dtype(c_dtype).name])
    return _constants[key]
