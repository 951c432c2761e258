"""Matrix products: ``matmul`` and ``linear`` (the GEMMs that dominate training time).

For C = A @ B the chain rule gives dA = dC @ B^T and dB = A^T @ dC.  ``linear`` flattens
all leading dimensions of its input so that the forward pass and each gradient is ONE
large GEMM (BLAS is far more efficient on one (B*T, in) x (in, out) product than on B
small ones).  Under :func:`~minidist.model.ops.precision.autocast` the inputs are rounded to the
low dtype and the products are computed in float32 (NumPy) or in the low dtype with float32
accumulation (CuPy's tensor cores; see precision.py).
"""

from __future__ import annotations

from minidist.model.autograd import Tensor, make_tensor, weight_grad
from minidist.model.backend import BACKEND, current_device, is_low_precision, xp
from minidist.model.ops import tuning
from minidist.model.ops.basic import unbroadcast
from minidist.model.ops.cuda import gemm
from minidist.model.ops.precision import compute_dtype, gemm_operands, to_dtype


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` for a (..., M, K) and b (..., K, N) or (K, N); batch dims broadcast."""
    if a.ndim < 2 or b.ndim < 2:
        raise ValueError(f"matmul needs >= 2-d inputs, got shapes {tuple(a.shape)} and {tuple(b.shape)}")
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(f"matmul shape mismatch: {tuple(a.shape)} @ {tuple(b.shape)}")
    (A, B), out_dtype = gemm_operands(a.data, b.data)
    flat = b.ndim == 2  # (..., M, K) @ (K, N): one GEMM on the flattened rows
    if flat:
        out = (A.reshape(-1, A.shape[-1]) @ B).reshape(A.shape[:-1] + (B.shape[-1],))
    else:
        out = gemm.matmul(A, B)

    def backward(g):
        g = g if g.dtype == A.dtype else g.astype(A.dtype)
        ga = gb = None
        if a.requires_grad:  # each gradient written in its input's dtype (gemm.matmul's dtype=)
            ga = unbroadcast(gemm.matmul(g, B.swapaxes(-1, -2), dtype=a.dtype), a.shape)
        if b.requires_grad:
            if flat:
                gb = gemm.matmul(A.reshape(-1, A.shape[-1]).T, g.reshape(-1, g.shape[-1]), dtype=b.dtype)
            else:
                gb = unbroadcast(gemm.matmul(A.swapaxes(-1, -2), g, dtype=b.dtype), b.shape)
        return ga, gb

    return make_tensor(to_dtype(out, out_dtype), (a, b), backward)


def add_bias(y: Tensor, b: Tensor) -> Tensor:
    """``y + b`` for y (..., out) and b (out,), in y's dtype: a bias added after the product
    (tensor parallelism's row-parallel layer adds it after the partial products are summed).
    Its gradient is :func:`linear`'s: the column sums of the output's gradient, in float32 for
    a low-precision one (a sum over every token in bfloat16 would lose most of its digits),
    then in b's dtype, and deferred to W like linear's."""
    if tuple(b.shape) != (y.shape[-1],):
        raise ValueError(f"add_bias: bias shape {tuple(b.shape)} != ({y.shape[-1]},)")
    b_dtype = b.dtype

    def backward(g):
        gb = weight_grad(lambda: to_dtype(column_sums(g.reshape(-1, g.shape[-1])), b_dtype)) if b.requires_grad else None
        return g, gb

    return make_tensor(y.data + b.data.astype(y.dtype), (y, b), backward)


def column_sums(g2d):
    """The sums of the columns of a (rows, C) array (a bias gradient), in float32 for a
    low-precision array.

    As a matrix-vector product (ones @ g) on a CPU and on CuPy: BLAS reads the array once at
    full speed, where NumPy's and CuPy's sum(axis=0) read it column by column, a row's stride
    apart (docs/gpu.md has the GPU's figures).  A low-precision array is multiplied by cuBLAS
    into a float32 result (exact products, float32 accumulation); where that is not available
    it is summed with sum's dtype=float32."""
    if tuning.tuned() or (BACKEND == "cupy" and not is_low_precision(g2d.dtype)):
        return ones_row(g2d.shape[0], g2d.dtype) @ g2d
    cdt = compute_dtype(g2d.dtype)
    if gemm.direct(g2d.dtype, cdt) and cdt != g2d.dtype:
        return gemm.matmul(ones_row(g2d.shape[0], g2d.dtype)[None], g2d, dtype=cdt)[0]
    return g2d.sum(axis=0, dtype=cdt)


_ones: dict = {}  # (dtype, device) -> the longest row of ones made so far


def ones_row(n: int, dtype):
    """n ones of ``dtype``: a view of one cached row per dtype and device (callers only read
    it).  A step takes the column sums of a dozen gradients per layer, and on a GPU a fresh
    row of ones is a kernel launch each time."""
    key = (xp.dtype(dtype), current_device())
    row = _ones.get(key)
    if row is None or row.shape[0] < n:
        row = _ones[key] = xp.ones(max(n, 1024), dtype=dtype)
    return row[:n]


def linear(x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
    """``x @ w + b`` for x (..., in), w (in, out), b (out,) or None.

    Forward is one GEMM on x flattened to (rows, in); backward is one GEMM for dx
    (g @ w^T), one for dw (x2d^T @ g2d) and a column sum for db.  Under
    ``autograd.deferred_weight_grads`` dw and db wait for W (zero-bubble pipelines).
    """
    if w.ndim != 2 or x.shape[-1] != w.shape[0]:
        raise ValueError(f"linear: x {tuple(x.shape)} does not match weight {tuple(w.shape)} (in, out)")
    if b is not None and tuple(b.shape) != (w.shape[1],):
        raise ValueError(f"linear: bias shape {tuple(b.shape)} != ({w.shape[1]},)")
    (X, W, Bias), out_dtype = gemm_operands(x.data, w.data, None if b is None else b.data)
    lead = x.shape[:-1]
    x2d = X.reshape(-1, X.shape[-1])
    y = x2d @ W
    if Bias is not None:
        y += Bias  # y is our own fresh array: add in place
    y = to_dtype(y, out_dtype).reshape(lead + (W.shape[1],))
    w_dtype, b_dtype = w.dtype, None if b is None else b.dtype  # now: ZeRO-3 frees .data before W

    def backward(g):
        g2d = g.reshape(-1, g.shape[-1])
        if g2d.dtype != x2d.dtype:
            g2d = g2d.astype(x2d.dtype)
        # each gradient in its input's dtype: under mixed precision on CuPy, cuBLAS writes the
        # float32 ones (the master weight's, a float32 input's) straight from its accumulator
        gx = gemm.matmul(g2d, W.T, dtype=x.dtype).reshape(x.shape) if x.requires_grad else None
        gw = weight_grad(lambda: gemm.matmul(x2d.T, g2d, dtype=w_dtype)) if w.requires_grad else None
        gb = None
        if b is not None and b.requires_grad:
            gb = weight_grad(lambda: to_dtype(column_sums(g2d), b_dtype))
        return gx, gw, gb

    return make_tensor(y, (x, w, b), backward)
