"""Mixed precision: ``autocast`` and the differentiable ``cast``.

Mixed-precision training (Micikevicius et al. 2018, "Mixed Precision Training") keeps fp32
*master* weights but runs the expensive matrix products on low-precision copies of their
inputs (float16 or bfloat16), accumulating in fp32, as tensor cores do.  NumPy has no fast
low-precision GEMM, so minidist *emulates* it: inputs are rounded to the low dtype (that is
where the precision is lost), the product is computed in float32, and the result is stored
in the low dtype.  Backward computes in float32 and returns each input's gradient in that
input's own dtype, so an fp32 master weight receives an fp32 gradient.

Ops that are numerically delicate (softmax, layer_norm, cross_entropy) always compute
internally in float32 when handed low-precision input; see :func:`compute_dtype`.

On CuPy the products really run in the low dtype: cuBLAS multiplies float16/bfloat16 inputs
on the tensor cores and accumulates in float32, the point of mixed precision (the emulation
would be slower than float32).  Where this CuPy cannot multiply bfloat16 matrices (its
bfloat16 support comes through ml_dtypes and is partial), :func:`native_low` finds out once
with a tiny product, says so in one line on stderr, and bfloat16 falls back to the emulation.
"""

from __future__ import annotations

import contextlib
import sys
import threading

from minidist.model.autograd import Tensor, make_tensor
from minidist.model.backend import BACKEND, dtype as _dtype_of, dtype_name, is_low_precision, xp

_state = threading.local()
FLOAT32 = xp.dtype(xp.float32)


def get_autocast_dtype():
    """The low-precision dtype of the active :func:`autocast` region, or ``None``."""
    return getattr(_state, "dtype", None)


@contextlib.contextmanager
def autocast(dtype="bfloat16"):
    """Inside this block matmul/linear/attention take low-precision inputs (thread-local).

    ``dtype``: 'bfloat16' or 'float16' (name or dtype object); ``None`` turns autocast off
    for a nested region.
    """
    dt = None
    if dtype is not None:
        dt = _dtype_of(dtype)
        if not is_low_precision(dt):
            raise ValueError(f"autocast dtype must be float16 or bfloat16, got {dtype!r}")
    prev = get_autocast_dtype()
    _state.dtype = dt
    try:
        yield dt
    finally:
        _state.dtype = prev


def compute_dtype(dt):
    """float32 for low-precision dtypes (we never do arithmetic in them), else ``dt``."""
    return FLOAT32 if is_low_precision(dt) else dt


def is_float(dt) -> bool:
    return xp.dtype(dt).kind == "f" or is_low_precision(dt)


_native = {}  # low dtype -> whether the backend multiplies it natively (probed once)


def native_low(dt) -> bool:
    """True when the backend runs matrix products in the low dtype ``dt`` itself: never on
    NumPy (no fast float16/bfloat16 GEMM: products are emulated in float32), on CuPy when a
    2x2 product in ``dt`` works."""
    dt = xp.dtype(dt)
    if BACKEND == "numpy":
        return False
    if dt not in _native:
        try:
            a = xp.ones((2, 2), dtype=dt)
            xp.matmul(a, a)
            _native[dt] = True
        except Exception as exc:  # noqa: BLE001 - any failure means: not supported here
            _native[dt] = False
            print(f"note: this CuPy cannot multiply {dtype_name(dt)} matrices ({type(exc).__name__}); "
                  f"{dtype_name(dt)} matmuls run in float32 on {dtype_name(dt)}-rounded inputs", file=sys.stderr)
    return _native[dt]


def gemm_operands(*arrays):
    """Prepare the inputs of a matrix-product op (matmul, linear, attention).

    Returns ``(operands, out_dtype)``.  Under autocast every float input is rounded to the
    autocast dtype and the output has that dtype.  Low-precision inputs are widened to
    float32 for the arithmetic (fp32 accumulation) unless the backend multiplies them
    natively (:func:`native_low`: CuPy's tensor cores).  Outside autocast with fp32/fp64
    inputs the arrays are returned untouched (no copies).  ``None`` entries pass through.
    """
    low = get_autocast_dtype()
    present = [a for a in arrays if a is not None]
    if low is not None:
        out_dtype = low
    else:
        out_dtype = xp.result_type(*[a.dtype for a in present])
    ops = []
    for a in arrays:
        if a is None:
            ops.append(None)
            continue
        if low is not None and is_float(a.dtype) and a.dtype != low:
            a = a.astype(low)  # the rounding that autocast is about
        if is_low_precision(a.dtype) and not native_low(a.dtype):
            a = a.astype(FLOAT32)
        ops.append(a)
    return ops, xp.dtype(out_dtype)


def to_dtype(a, dt):
    """``a`` as dtype ``dt`` (no copy when it already is)."""
    return a if a is None or a.dtype == dt else a.astype(dt)


def cast(x: Tensor, dtype) -> Tensor:
    """Differentiable dtype change; backward casts the gradient back to ``x``'s dtype."""
    dt = _dtype_of(dtype)
    src = x.dtype
    if src == dt:
        return make_tensor(x.data, (x,), lambda g: (g,))
    return make_tensor(x.data.astype(dt), (x,), lambda g: (g.astype(src),))
