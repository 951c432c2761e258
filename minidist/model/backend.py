"""The array backend: every module does its tensor math through ``xp``.

``xp`` is NumPy by default and CuPy when ``MINIDIST_BACKEND=cupy`` is set before minidist is
imported (``python -m minidist.train --backend cupy`` sets it for you).  Keeping one switch
here is what lets the same model and parallel code run on a laptop CPU or on GPUs.

MPI messages need host memory (unless the MPI library is CUDA-aware), so this module also
offers ``to_host``/``from_host`` staging helpers (pinned host memory under CuPy); with NumPy
they are free.  Under CuPy each rank uses the GPU of its node-local rank (``local_rank``,
``device_for``: ranks may share a GPU), selected when this module is imported.  A missing
CuPy or GPU is an ImportError whose one line names the wheels to install (docs/gpu.md).
``CUPY_TF32=1`` (``--tf32``) must be set before this module is imported to take effect.

Low-precision dtypes: NumPy has float16 but no bfloat16; ``ml_dtypes`` supplies one that
NumPy can store and cast (arithmetic on it is slow, so minidist computes in float32 and
rounds, as tensor cores do: low-precision inputs, fp32 accumulation).
"""

from __future__ import annotations

import os

import numpy as _np

from minidist.host import env

BACKEND = env.get("MINIDIST_BACKEND")  # "numpy" or "cupy"; EnvError (a ValueError) for anything else

CUPY_WHEELS = ("pip install cupy-cuda12x (CUDA 12.x) or cupy-cuda13x (CUDA 13.x), whichever matches "
               "the CUDA version nvidia-smi shows; or pip install -e '.[gpu]' (docs/gpu.md)")


def missing_cupy_message(reason) -> str:
    """The one line for ``--backend cupy`` without a usable CuPy, naming both wheels."""
    return f"the cupy backend needs CuPy and a CUDA GPU ({reason}): {CUPY_WHEELS}"


# Where MPI launchers put a rank's index among the ranks of its node (MPICH's Hydra, Open MPI,
# MVAPICH, Slurm's srun): read from the environment, so a rank picks its GPU before it
# allocates anything and before any message (comm/nodes.py finds the same by a collective).
LOCAL_RANK_VARIABLES = ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_RANK",
                        "SLURM_LOCALID", "LOCAL_RANK")


def local_rank(environ=None) -> int:
    """This process's rank among the ranks of its node, from the launcher (0 when not launched
    by one, or by one that does not say)."""
    environ = os.environ if environ is None else environ
    for name in LOCAL_RANK_VARIABLES:
        value = environ.get(name, "").strip()
        if value.isdigit():
            return int(value)
    return 0


def device_for(local: int, n_devices: int) -> int:
    """The GPU of node-local rank ``local`` among ``n_devices``: round-robin, so more ranks than
    GPUs share them (rank 2 of 3 on 2 GPUs shares GPU 0; fine for tests, slow for training)."""
    if n_devices < 1:
        raise ValueError(f"no CUDA device visible (device count {n_devices})")
    return local % n_devices


def _import_cupy():
    """CuPy, with this rank's GPU selected (device_for(local_rank(), device count))."""
    try:
        import cupy
    except ImportError as exc:
        raise ImportError(missing_cupy_message(exc)) from None
    try:
        cupy.cuda.Device(device_for(local_rank(), cupy.cuda.runtime.getDeviceCount())).use()
    except Exception as exc:  # CUDARuntimeError without a driver or a GPU
        raise ImportError(missing_cupy_message(f"{type(exc).__name__}: {exc}")) from None
    return cupy


def gpu_unavailable_reason() -> str | None:
    """Why the cupy backend cannot run here (one line: no CuPy, or no GPU), or None when it can.
    Imports CuPy only to look; ``make test-gpu`` asks this first and skips with the reason."""
    try:
        import cupy
    except ImportError as exc:
        return f"CuPy is not installed ({exc}); {CUPY_WHEELS}"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # no driver, no device
        return f"CuPy finds no CUDA GPU ({type(exc).__name__}: {exc})"
    return None if n > 0 else "CuPy finds no CUDA GPU (device count 0)"


if BACKEND == "cupy":
    xp = _import_cupy()  # optional dependency, imported only when asked for
else:
    xp = _np

# The host's array library, for the little index bookkeeping made on the CPU (a batch's token
# ids and targets as the sampler made them, a row's positions): an index checked on the host
# costs nothing, while checking it on a GPU reads it back (ops.basic.check_index).
host = _np

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
    # bfloat16 may be None (no ml_dtypes), and NumPy compares dtype(...) == None as float64
    return _np.dtype(dt) == _np.dtype(_np.float16) or (bfloat16 is not None and _np.dtype(dt) == bfloat16)


def on_host(a) -> bool:
    """True for a host (NumPy) array: always with NumPy, never a CuPy array."""
    return isinstance(a, _np.ndarray)


def on_device(a) -> bool:
    """True for an array in the backend's device memory (never with NumPy)."""
    return xp is not _np and isinstance(a, xp.ndarray)


# The running timeline (minidist/observe/trace.py sets it while --trace records, None otherwise): each
# copy between host and device below is then a "staging" span on it.
tracer = None


def _timed(kind: str, copy, a):
    tr = tracer  # read once: the tracer may stop on another thread meanwhile
    if tr is None:
        return copy(a)
    t0 = tr.clock()
    out = copy(a)
    tr.staging(kind, out.nbytes, t0)
    return out


def _pinned_copy(a):
    import cupyx

    out = cupyx.empty_pinned(a.shape, dtype=a.dtype)
    # not ascontiguousarray on a contiguous array: it turns a 0-d array (a loss) into shape (1,)
    (a if a.flags.c_contiguous else xp.ascontiguousarray(a)).get(out=out)
    return out


def host_empty(shape, dtype):
    """An uninitialised host array for copies to and from the device: page-locked (pinned)
    under CuPy, from CuPy's pinned pool, so that a copy runs on the DMA engines and may be
    queued on a stream without waiting (``ndarray.get(out=..., blocking=False)``, ``set``);
    plain NumPy otherwise.  The optimizer offload keeps its state in these (optim/offload.py):
    ``to_host(a, out=buffer, stream=s)`` and ``from_host(buffer, out=a, stream=s)`` queue copies."""
    if xp is _np:
        return _np.empty(shape, dtype)
    import cupyx

    return cupyx.empty_pinned(shape, dtype=dtype)


def to_host(a, kind: str = "to_host", out=None, stream=None):
    """The array as a host (NumPy) array, for MPI buffers, printing and saving.

    Under CuPy the copy lands in *pinned* (page-locked) host memory from CuPy's pinned pool:
    the GPU's DMA engine reads and writes pinned pages directly, about twice as fast as
    pageable memory, which the driver must first copy through a pinned bounce buffer of its
    own.  The pool takes the buffer back when the NumPy array is freed.

    ``out``: a host buffer of ``a``'s shape and dtype (``host_empty``) to copy into instead.
    With ``stream`` too, the copy of a contiguous device array is only queued on that stream:
    ``out`` holds the values once the stream's work so far is done (an event recorded after)."""
    if out is not None:
        if on_device(a):
            return _timed(kind, lambda x: x.get(out=out, stream=stream, blocking=stream is None), a)
        out[...] = a
        return out
    if xp is _np or isinstance(a, _np.ndarray):
        return a
    if not isinstance(a, xp.ndarray):
        return _np.asarray(a)  # a Python scalar or list
    return _timed(kind, _pinned_copy, a)


_host_reads: dict[str, int] = {}


def host_read(x, why: str):
    """``x``, a value the algorithm needs on the host (the loss, the overflow check, the
    clipping norm; the range of an index that is already on the device), brought there and
    counted under ``why``.

    On a GPU each such read waits for the device's queued work (a synchronisation), which
    stalls the launch queue; a step should make only the reads its algorithm needs.  The
    counts (:func:`host_reads`) go into each step's metrics record on either backend, so a
    read that creeps into a step's path shows up in a CPU test too."""
    _host_reads[why] = _host_reads.get(why, 0) + 1
    return to_host(x, "host read")


def host_reads() -> dict[str, int]:
    """How many :func:`host_read` calls there were so far, by reason (a copy)."""
    return dict(_host_reads)


def from_host(a, out=None, stream=None):
    """A host array moved to the backend's device (a no-op with NumPy).

    ``out``: a device array of ``a``'s shape and dtype to copy into instead (on NumPy: a
    copy); with ``stream`` the copy is queued there, asynchronous when ``a`` is pinned."""
    if out is not None:
        if on_device(out):
            _timed("from_host", lambda x: out.set(x, stream=stream) or out, a)
        else:
            out[...] = a
        return out
    if xp is _np or isinstance(a, xp.ndarray):
        return a
    return _timed("from_host", xp.asarray, a)


def current_device():
    """This thread's GPU id under CuPy; True on NumPy (one place, nothing to choose)."""
    return True if xp is _np else xp.cuda.Device().id


def using_device(device):
    """A context in which new device arrays land on GPU ``device`` (from :func:`current_device`).
    CUDA's current device is per thread: a helper thread (comm's progress thread) starts on
    GPU 0 and must select the GPU of the rank it works for."""
    import contextlib

    return contextlib.nullcontext() if device is True else xp.cuda.Device(device)


def device_memory() -> dict | None:
    """The GPU's name, total bytes and the bytes CuPy's memory pool holds now (None on NumPy)."""
    if xp is _np:
        return None
    dev = xp.cuda.Device()
    props = xp.cuda.runtime.getDeviceProperties(dev.id)
    name = props["name"]
    return {"device": dev.id, "name": name.decode() if isinstance(name, bytes) else str(name),
            "total_bytes": int(props["totalGlobalMem"]),
            "pool_used_bytes": int(xp.get_default_memory_pool().used_bytes())}


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
