"""Reduction operators and the dtypes they accept.

``op`` is one of "sum", "avg", "max", "min".  Reductions of float16 and bfloat16 are computed
on a float32 copy and rounded once at the end: adding many low-precision numbers in low
precision loses the small ones (bfloat16 keeps 8 significant bits, so 256 + 1 == 256), while
a float32 accumulator keeps the result within one rounding of the exact sum.  The price is
that the messages carry float32, twice the bytes.  (NCCL reduces bf16 in bf16 to save
bandwidth; minidist, a reference, prefers the accurate answer.)

"avg" divides the sum by the group size in the accumulator dtype; for integers it is the
floor division ``sum // N``.
"""

from __future__ import annotations

import numpy as np

from minidist.model.backend import bfloat16, dtype_name

UFUNCS = {"sum": np.add, "avg": np.add, "max": np.maximum, "min": np.minimum}
_REDUCIBLE = {np.dtype(t) for t in ("float16", "float32", "float64", "int32", "int64")}
if bfloat16 is not None:
    _REDUCIBLE.add(bfloat16)
_LOW_PRECISION = {np.dtype("float16")} | ({bfloat16} if bfloat16 is not None else set())


def check_op(op, where: str) -> str:
    if op not in UFUNCS:
        raise ValueError(f"{where}: op={op!r} is not supported; choose one of {sorted(UFUNCS)}")
    return op


def check_dtype(dtype, where: str) -> np.dtype:
    dtype = np.dtype(dtype)
    if dtype not in _REDUCIBLE:
        names = sorted(dtype_name(d) for d in _REDUCIBLE)
        raise TypeError(f"{where}: cannot reduce dtype {dtype_name(dtype)}; supported: {names}")
    return dtype


def accumulator_dtype(dtype) -> np.dtype:
    """float32 for float16/bfloat16 inputs, the input dtype otherwise."""
    return np.dtype(np.float32) if np.dtype(dtype) in _LOW_PRECISION else np.dtype(dtype)


def to_accumulator(x: np.ndarray) -> np.ndarray:
    """``x`` as a flat array in the accumulator dtype (a view when no cast is needed)."""
    acc = accumulator_dtype(x.dtype)
    flat = x.reshape(-1)
    return flat if flat.dtype == acc else flat.astype(acc)


def finish(acc: np.ndarray, op: str, n: int, dtype) -> np.ndarray:
    """Turn an accumulated sum into the result: divide for "avg", round to ``dtype``.
    ``acc`` is owned by the caller and may be overwritten."""
    if op == "avg" and n > 1:
        if np.issubdtype(acc.dtype, np.integer):
            np.floor_divide(acc, n, out=acc)
        else:
            np.divide(acc, n, out=acc)
    return acc if acc.dtype == dtype else acc.astype(dtype)
