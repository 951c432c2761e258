"""The array backend: every module does its tensor math through ``xp``.

``xp`` is NumPy by default and CuPy when ``MINIDIST_BACKEND=cupy`` is set before minidist is
imported (``python -m minidist.train --backend cupy`` sets it for you).  Keeping one switch
here is what lets the same model and parallel code run on a laptop CPU or on GPUs.

MPI messages need host memory (unless the MPI library is CUDA-aware), so this module also
offers ``to_host``/``from_host`` staging helpers; with NumPy they are free.

Low-precision dtypes: NumPy has float16 but no bfloat16; ``ml_dtypes`` supplies one that
NumPy can store and cast (arithmetic on it is slow, so minidist computes in float32 and
rounds, as tensor cores do: low-precision inputs, fp32 accumulation).
"""

from __future__ import annotations

import numpy as _np

from minidist import env

BACKEND = env.get("MINIDIST_BACKEND")  # "numpy" or "cupy"; EnvError (a ValueError) for anything else

if BACKEND == "cupy":
    import cupy as xp  # noqa: F401  (optional dependency, imported only when asked for)
else:
    xp = _np

try:
    import ml_dtypes as _ml_dtypes

    bfloat16 = _np.dtype(_ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is a declared dependency
    bfloat16 = None

_DTYPES = {
    "float64": _np.dtype(_np.float64),
    "float32": _np.dtype(_np.float32),
    "float16": _np.dtype(_np.float16),
    "bfloat16": bfloat16,
    "int32": _np.dtype(_np.int32),
    "int64": _np.dtype(_np.int64),
}


def dtype(name) -> _np.dtype:
    """The dtype called ``name`` ('float32', 'float64', 'float16', 'bfloat16', ...)."""
    if not isinstance(name, str):
        return _np.dtype(name)
    try:
        dt = _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose from {sorted(_DTYPES)}") from None
    if dt is None:
        raise ValueError("bfloat16 needs the ml_dtypes package")
    return dt


def dtype_name(dt) -> str:
    """Inverse of :func:`dtype`: the short name of a dtype."""
    dt = _np.dtype(dt)
    return "bfloat16" if dt == bfloat16 else dt.name


def is_low_precision(dt) -> bool:
    return _np.dtype(dt) in (_np.dtype(_np.float16), bfloat16)


def to_host(a):
    """The array as a host (NumPy) array, for MPI buffers, printing and saving."""
    if xp is _np or isinstance(a, _np.ndarray):
        return a
    return xp.asnumpy(a)


def from_host(a):
    """A host array moved to the backend's device (a no-op with NumPy)."""
    if xp is _np:
        return a
    return xp.asarray(a)


def synchronize():
    """Wait for queued device work (a no-op with NumPy); timers call this before reading."""
    if xp is not _np:
        xp.cuda.get_current_stream().synchronize()


def seeded_normal(seed: int, name: str, shape, std: float, dtype) -> "xp.ndarray":
    """N(0, std²) values for the parameter ``name`` of *global* shape ``shape``.

    Drawn on the host in float64 from a generator keyed by (seed, name) alone, so a weight's
    values never depend on the backend, the dtype, the order parameters are created in, or how
    the weight is later sharded: a sharded run slices exactly the numbers a serial run uses.
    """
    import zlib

    rng = _np.random.default_rng([int(seed), zlib.crc32(name.encode())])
    values = rng.standard_normal(tuple(shape)) * float(std)
    return from_host(values.astype(dtype))
