"""A CuPy emulator on NumPy, for running minidist's CuPy code paths on a machine without a GPU.

Put ``tests/emulated_gpu`` first on ``PYTHONPATH`` and set ``MINIDIST_BACKEND=cupy``: minidist
then imports this package as ``cupy`` and runs its real CuPy branches, unchanged.

What it emulates (the semantics of real CuPy that catch host/device mix-ups):

* ``cupy.ndarray`` wraps a NumPy array and is *not* a ``numpy.ndarray``.  ``__array__`` raises
  CuPy's TypeError (implicit conversion to NumPy is not allowed); a ``numpy.ndarray`` (ndim >= 1)
  handed to a ufunc, an operator or a function together with device arrays raises
  ``TypeError: Unsupported type <class 'numpy.ndarray'>``; NumPy functions applied to device
  arrays dispatch to this module (``__array_ufunc__``, ``__array_function__``) and so return
  device arrays.  Reductions and scalar indexing give 0-d device arrays, not NumPy scalars.
  A NumPy array may index a device array (copied to the device, as CuPy does) but may not be
  assigned through basic slicing (CuPy's ``fill`` refuses it).
* Every device->host transfer is allowed and recorded with its call site (``cupy._emulator``):
  ``.get()``, ``asnumpy``, ``float/int/bool/complex/index()``, ``.item()``, ``.tolist()``,
  ``repr``/``str``/``format``; so are the implicit synchronisations of data-dependent shapes
  (boolean-mask indexing, ``nonzero``, ``flatnonzero``, ``argwhere``, ``unique``, ...).
* ``ufunc`` objects with ``at`` (add/subtract/maximum/minimum, CuPy's scatter dtypes only),
  ``reduce``, ``accumulate``, ``reduceat``, ``outer`` (CuPy >= 13 has all five).
* ``cupy.fuse`` (the function itself, no tracing), ``cupy.ElementwiseKernel`` for straight-line
  C bodies (translated to NumPy; control flow and ``raw`` parameters are refused).
* ``cupy.RawModule`` / ``cupy.RawKernel`` (``_raw.py``): CUDA source compiled as C++ for the CPU
  by ``tests/cuda_on_cpu.py`` (a block's threads as fibers that meet at __syncthreads), called with device arrays,
  which the kernel reads and writes in place; every launch is recorded in ``cupy._emulator``.
* ``cupy.cuda``: ``Device``, ``runtime.getDeviceCount`` (``MINIDIST_EMULATED_GPUS``, default
  1), ``getDevice``/``setDevice``, ``getDeviceProperties``, streams, ``MemoryHook``;
  ``get_default_memory_pool`` counts the bytes of live device buffers (weakref finalizers) of
  the current device, so peak-memory reports are plausible.
* Devices as CUDA has them: the current device is per host thread (``threading.local``; every
  new thread starts on device 0, ``Device(i).use()`` and ``with Device(i):`` change only the
  calling thread's), and every array lives on the device it was allocated on
  (``ndarray.device``; a view on its buffer's).  A kernel (ufunc, operator, reduction,
  copying function or method, setitem, fused function, ElementwiseKernel) given an array on
  another device than the current one does what CuPy's ``_check_peer_access`` does: a
  ``PerformanceWarning`` and the kernel runs (peer access, the default), or a ``ValueError``
  with ``MINIDIST_EMULATED_PEER_ACCESS=0``; a RawKernel is not checked by CuPy (it runs with
  peer access, faults without: CUDADriverError).  Every such use is recorded
  (``_emulator.cross_device()``).  ``asarray``/``array``/``copy`` of another device's array
  copy it to the current device, as CuPy does (recorded as 'd2d'); ``get()`` reads any device.
* Device operations are counted (``_emulator.operations()``): every call that launches work,
  once, however it is built (a fused function's body is not counted again).  See _emulator.
* ``cupyx.empty_pinned`` / ``zeros_pinned`` (plain NumPy arrays), ``cupyx.scatter_add``.
* A CUDA-aware MPI, with ``MINIDIST_EMULATED_CUDA_AWARE_MPI=1``: arrays export
  ``__cuda_array_interface__`` (and no ``__dlpack__``, which mpi4py would try first), so mpi4py
  hands their memory to MPI as it hands a CuPy array's to a CUDA-aware MPI.  MPI works outside
  the stream's order, so the export is refused while the calling thread has device work queued
  since it last synchronized (a stream or device ``synchronize()``, or a blocking copy to the
  host): the rule a program must follow on a GPU, where breaking it is a silent race.  Without
  the variable arrays export nothing, and handing one to MPI fails.

What it does not: no kernels of its own (RawModule's run on the CPU), no asynchrony, no
speed, no device memory limit, no streams per device (a matmul's operands are checked like an
elementwise kernel's, as CuPy's cuBLAS path may not); results are NumPy's bit for bit
(cuBLAS/cuDNN rounding, TF32, atomics' order are not modelled); functions NumPy has and CuPy
lacks are not refused; ``fuse`` does not restrict the body to what CuPy can trace.  It exists
to catch host/device mix-ups, hidden synchronisations and arrays on the wrong GPU without one.
"""

from __future__ import annotations

import ast
import numbers
import os
import re
import sys
import threading
import types
import warnings
import weakref

import numpy as _np

from . import _emulator

__version__ = "13.3.0"  # the CuPy API mirrored (ufunc methods, fuse, ElementwiseKernel)
EMULATED = True
# The MPI beside this CuPy reads device memory (a CUDA-aware MPI): arrays then export
# __cuda_array_interface__ (host memory here, which the real MPI reads and writes), so that a
# program's CUDA-aware path runs; otherwise they export nothing and a device array handed to
# MPI is an error (as it would be a crash with an MPI that is not CUDA-aware).
_CUDA_AWARE_MPI = os.environ.get("MINIDIST_EMULATED_CUDA_AWARE_MPI", "0") == "1"

# --------------------------------------------------------------------------- memory pool


class _Local(threading.local):
    """Per host thread, as CUDA has it: the current device (0 in every new thread), the
    Device context stack, the op bookkeeping (nesting depth, buffers allocated so far), and
    whether the thread has issued device work since it last waited for its stream."""
    device = 0
    depth = 0
    allocs = 0
    queued = False

    def __init__(self):
        self.stack = []


_tls = _Local()


def _current():
    """This thread's current device."""
    return _tls.device


class _Pool:
    """Device memory pool: bytes of live device buffers (each NumPy base buffer once), per
    device; as CuPy's default pool, the byte counts are the current device's."""

    def __init__(self):
        self._live = {}  # id(base buffer) -> (bytes, device)
        self._bytes = {}  # device -> bytes of its live buffers
        self._high = {}  # device -> high-water mark of used bytes

    def _used(self, dev):
        return self._bytes.get(dev, 0)

    def used_bytes(self):
        return self._used(_current())

    def total_bytes(self):
        dev = _current()
        return max(self._high.get(dev, 0), self._used(dev))

    def free_bytes(self):
        return self.total_bytes() - self.used_bytes()

    def free_all_blocks(self, stream=None):
        dev = _current()
        self._high[dev] = self._used(dev)

    def n_free_blocks(self):
        return 0

    def set_limit(self, size=None, fraction=None):
        pass

    def get_limit(self):
        return 0

    def _track(self, a):
        """The device of ``a``'s memory: its buffer's, or (a new buffer, now counted) the
        current device."""
        base = a
        while isinstance(base.base, _np.ndarray):
            base = base.base
        key = id(base)
        known = self._live.get(key)
        if known is not None:
            return known[1]  # a view of a buffer counted already: where that buffer lives
        dev = _tls.device
        if base.base is not None:
            return dev  # memory NumPy does not own (a buffer we cannot follow)
        size = base.nbytes
        for h in _hooks:
            h.malloc_preprocess(device_id=dev, size=size, mem_size=size)
        self._live[key] = (size, dev)
        used = self._bytes[dev] = self._bytes.get(dev, 0) + size
        self._high[dev] = max(self._high.get(dev, 0), used)
        _tls.allocs += 1
        weakref.finalize(base, self._free, key)
        for h in _hooks:
            h.malloc_postprocess(device_id=dev, size=size, mem_size=size, mem_ptr=key, pmem_id=0)
        return dev

    def _free(self, key):
        size, dev = self._live.pop(key, (0, _current()))
        self._bytes[dev] = self._bytes.get(dev, 0) - size
        for h in list(_hooks):
            h.free_postprocess(device_id=dev, mem_size=size, mem_ptr=key, pmem_id=0)


class _PinnedPool:
    def used_bytes(self):
        return 0

    def total_bytes(self):
        return 0

    def free_all_blocks(self):
        pass

    def n_free_blocks(self):
        return 0


_pool = _Pool()
_pinned_pool = _PinnedPool()
_hooks: list = []


def get_default_memory_pool():
    return _pool


def get_default_pinned_memory_pool():
    return _pinned_pool


# --------------------------------------------------------------------------- wrapping

_SCALARS = (numbers.Number, _np.generic, bool)


def _wrap(r):
    """NumPy results as device arrays (NumPy scalars become 0-d arrays, as CuPy returns), each
    on the device of its memory (a new buffer: the current device; a view: its buffer's)."""
    if isinstance(r, _np.ndarray):
        out = ndarray.__new__(ndarray)
        out._a = r
        out._dev = _pool._track(r)
        return out
    if isinstance(r, _np.generic):
        return _wrap(_np.asarray(r))
    if isinstance(r, tuple):
        return tuple(_wrap(x) for x in r)
    if isinstance(r, list):
        return [_wrap(x) for x in r]
    return r


def _unsupported(x):
    return TypeError("Unsupported type %s" % type(x))


def _unwrap(x, allow_host=False):
    """A device array's NumPy array; a NumPy array of ndim >= 1 is refused as CuPy refuses it,
    unless ``allow_host`` (where CuPy copies host data to the device: indices, asarray)."""
    if isinstance(x, ndarray):
        return x._a
    if isinstance(x, _np.ndarray):
        if x.ndim == 0 or allow_host:
            if x.ndim:
                _emulator.record("h2d", "implicit", x.nbytes)
            return x
        raise _unsupported(x)
    if isinstance(x, (list, tuple)):
        return type(x)(_unwrap(v, allow_host) for v in x)
    return x


def _unwrap_kwargs(kw):
    return {k: _unwrap(v) for k, v in kw.items()}


def _to_host(a, kind, nbytes=None):
    _emulator.record("d2h", kind, a._a.nbytes if nbytes is None else nbytes)
    _tls.queued = False  # a blocking copy to the host waits for the stream's queued work
    return a._a


def _synchronized():
    _tls.queued = False


def _sync(kind, nbytes=8):
    _emulator.record("d2h", "sync:" + kind, nbytes)
    _tls.queued = False  # a data-dependent shape read waits for the stream's queued work


def _check_out(kw):
    out = kw.get("out")
    if isinstance(out, tuple):
        if len(out) != 1:
            raise ValueError("The 'out' tuple must have exactly one entry")
        out = kw["out"] = out[0]
    if out is not None and not isinstance(out, ndarray):
        raise TypeError("out must be a cupy.ndarray, got %s" % type(out))
    return out


# --------------------------------------------------------------------------- devices and ops

class PerformanceWarning(RuntimeWarning):
    """cupy._util.PerformanceWarning (also there)."""


def _peer_access():
    """Whether the emulated GPUs can access each other's memory (``MINIDIST_EMULATED_PEER_ACCESS``,
    default 1: as on NVLink or PCIe peer-to-peer nodes; 0: as where peer access is unavailable)."""
    return os.environ.get("MINIDIST_EMULATED_PEER_ACCESS", "1") != "0"


def _arrays(obj, found):
    """The device arrays in ``obj`` (arguments: nested lists, tuples, dicts), into ``found``."""
    if isinstance(obj, ndarray):
        found.append(obj)
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            _arrays(x, found)
    elif isinstance(obj, dict):
        for x in obj.values():
            _arrays(x, found)
    return found


def _caller_level():
    """warnings.warn's stacklevel of the first frame outside the emulator."""
    f, level = sys._getframe(2), 2
    while f is not None and os.path.abspath(f.f_code.co_filename).startswith(_emulator._HERE):
        f, level = f.f_back, level + 1
    return level


def _check_devices(arrays, what, raw=False):
    """CuPy's check of a kernel's array arguments (``_check_peer_access``): an array on another
    device than the current one is a ValueError where peer access is unavailable, else a
    PerformanceWarning ('Peer access has been activated automatically') and the kernel runs.
    A RawKernel's arguments are not checked by CuPy: the kernel faults on the pointer of another
    device's memory without peer access, and runs (no warning) with it.  Every such use is
    recorded (direction 'cross-device'), whichever way it goes."""
    dev = _tls.device
    for a in arrays:
        if a._dev != dev:
            _emulator.record("cross-device", "%s: array on device %d, current device %d" % (what, a._dev, dev),
                             a.nbytes)
            msg = "The device where the array resides (%d) is different from the current device (%d)." % (a._dev, dev)
            if _peer_access():
                if not raw:
                    warnings.warn(msg + " Peer access has been activated automatically.", PerformanceWarning,
                                  stacklevel=_caller_level())
            elif raw:
                from ._raw import CUDADriverError

                raise CUDADriverError("CUDA_ERROR_ILLEGAL_ADDRESS: an illegal memory access was encountered "
                                      "(%s: %s)" % (what, msg))
            else:
                raise ValueError(msg + " Peer access is unavailable between these devices.")


def _device_op(kind, inputs, compute, kernel=True, writes=False, check=True):
    """``compute()`` as one device operation named ``kind``, counted in ``cupy._emulator``
    unless it runs inside another (a fused function's body, a function built on others) or
    launches nothing: ``kernel`` (always one launch: ufuncs, kernels), else one when it
    ``writes`` a device array (out=, setitem) or allocates a new buffer (not a view, not
    ``empty``).  ``inputs``: its arguments, whose devices must be the current one where it
    launches (a kernel's checked before it runs, the others after)."""
    t = _tls
    depth = t.depth
    if depth:
        return compute()
    if kernel and check:
        _check_devices(_arrays(inputs, []), kind)
    allocs = t.allocs
    t.depth = 1
    try:
        r = compute()
    finally:
        t.depth = 0
    if kernel or writes or t.allocs != allocs:
        if check and not kernel:
            _check_devices(_arrays(inputs, []), kind)
        _emulator.count_op(kind)
        t.queued = True
    return r


# --------------------------------------------------------------------------- ufuncs

# CuPy's scatter kernels (ufunc.at, cupyx.scatter_add) take only these dtypes.
_SCATTER_ADD = tuple(_np.dtype(t) for t in ("int32", "float16", "float32", "float64", "uint32", "uint64"))
_SCATTER_MINMAX = tuple(_np.dtype(t) for t in ("int32", "float32", "float64", "uint32", "uint64"))


def _scatter(a, indices, value, op):
    if not isinstance(a, ndarray):
        raise TypeError("ufunc.at needs a cupy.ndarray, got %s" % type(a))
    allowed = _SCATTER_ADD if op in ("add", "subtract") else _SCATTER_MINMAX
    if a.dtype not in allowed:
        raise TypeError("scatter_%s only supports %s as data type" % (
            "add" if op in ("add", "subtract") else op[:3], ", ".join(d.name for d in allowed)))

    def run():
        getattr(_np, op).at(a._a, _index(indices), _unwrap(value, allow_host=True))
    _device_op("scatter_" + op, (a, indices, value), run)


class ufunc:
    """A CuPy ufunc: device arrays and scalars only; methods at/reduce/accumulate/reduceat/outer."""

    def __init__(self, npufunc):
        self._f = npufunc
        self.__name__ = self.name = npufunc.__name__
        self.nin, self.nout, self.nargs = npufunc.nin, npufunc.nout, npufunc.nargs
        self.types = npufunc.types
        self.__doc__ = npufunc.__doc__

    def __repr__(self):
        return "<ufunc '%s'>" % self.__name__

    @staticmethod
    def _arg(x):
        if isinstance(x, (list, tuple)):  # CuPy's kernels take no sequences
            raise _unsupported(x)
        return _unwrap(x)

    def __call__(self, *args, **kw):
        n = self.nin
        ins, outs = args[:n], args[n:]
        if outs:
            kw["out"] = outs if len(outs) > 1 else outs[0]
        out = kw.get("out")
        if isinstance(out, tuple) and len(out) > 1:
            for o in out:
                if not isinstance(o, ndarray):
                    raise TypeError("out must be a cupy.ndarray")
            kw["out"] = tuple(o._a for o in out)
        else:
            out = _check_out(kw)
            if out is not None:
                kw["out"] = out._a
        def run():
            r = self._f(*[self._arg(x) for x in ins], **_unwrap_kwargs({k: v for k, v in kw.items() if k != "out"}),
                        **({"out": kw["out"]} if "out" in kw else {}))
            if out is None and self.__name__ == "matmul":  # CuPy (cuBLAS): 16-bit in, same 16-bit out
                dts = {x.dtype for x in ins if isinstance(x, ndarray)}
                if len(dts) == 1 and (dt := dts.pop()).name in ("float16", "bfloat16"):
                    r = r.astype(dt)
            return out if out is not None else _wrap(r)
        return _device_op("ufunc:" + self.__name__, (ins, args[n:], out), run)

    def at(self, a, indices, b=None):
        if self.__name__ not in ("add", "subtract", "maximum", "minimum"):
            raise NotImplementedError("cupy.%s.at is not supported" % self.__name__)
        if b is None:
            raise ValueError("second operand needed for ufunc")
        _scatter(a, indices, b, self.__name__)

    def _method(self, name, array, *args, **kw):
        out = _check_out(kw)
        if out is not None:
            kw["out"] = out._a
        def run():
            r = getattr(self._f, name)(self._arg(array), *[_unwrap(x) for x in args], **_unwrap_kwargs(kw))
            return out if out is not None else _wrap(r)
        return _device_op("ufunc.%s:%s" % (name, self.__name__), (array, args, out), run)

    def reduce(self, array, axis=0, dtype=None, out=None, keepdims=False):
        return self._method("reduce", array, axis=axis, dtype=dtype, out=out, keepdims=keepdims)

    def accumulate(self, array, axis=0, dtype=None, out=None):
        return self._method("accumulate", array, axis=axis, dtype=dtype, out=out)

    def reduceat(self, array, indices, axis=0, dtype=None, out=None):
        return self._method("reduceat", array, _wrap(_unwrap(indices, allow_host=True)), axis=axis,
                            dtype=dtype, out=out)

    def outer(self, A, B, **kw):
        return self._method("outer", A, B, **kw)


_ufuncs: dict = {}


def _ufunc(npufunc):
    u = _ufuncs.get(npufunc.__name__)
    if u is None:
        u = _ufuncs[npufunc.__name__] = ufunc(npufunc)
    return u


# --------------------------------------------------------------------------- functions

# Data-dependent output shapes: CuPy reads a count back from the device (a synchronisation).
_SYNCING = {"nonzero", "flatnonzero", "argwhere", "unique", "extract", "compress", "bincount",
            "unique_counts", "unique_inverse", "unique_values", "unique_all", "trim_zeros"}
# NumPy answers these with Python bools/ints; CuPy with 0-d device arrays.
_DEVICE_SCALAR = {"allclose", "array_equal", "array_equiv", "count_nonzero"}
# CuPy copies host data given to these (creation from host data, index arguments).
_HOST_OK = {"take": (1,), "put": (1, 2), "choose": (), "searchsorted": ()}


# Allocation without a kernel (CuPy's empty*: memory from the pool, nothing launched).
_ALLOCATE_ONLY = {"empty", "empty_like"}


def _function(name, npfunc, kind=None):
    kind = kind or "function:" + name

    def fn(*args, **kw):
        if name == "where" and len(args) + len(kw) == 1:
            _sync("where")
        elif name in _SYNCING:
            _sync(name)
        out = _check_out(kw)
        if out is not None:
            kw["out"] = out._a
        host_ok = _HOST_OK.get(name, ())

        def run():
            a = [_unwrap(x, allow_host=i in host_ok) for i, x in enumerate(args)]
            r = npfunc(*a, **_unwrap_kwargs(kw))
            if out is not None:
                return out
            if name in _DEVICE_SCALAR:
                r = _np.asarray(r)
            return _wrap(r)
        if name in _ALLOCATE_ONLY:
            return run()
        return _device_op(kind, (args, kw, out), run, kernel=False, writes=out is not None)

    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = npfunc.__doc__
    return fn


_functions: dict = {}


def _lookup(np_module, name, cache_prefix=""):
    obj = getattr(np_module, name)
    if isinstance(obj, _np.ufunc):
        return _ufunc(obj)
    if callable(obj) and not isinstance(obj, type):
        key = cache_prefix + name
        f = _functions.get(key)
        if f is None:
            f = _functions[key] = _function(name, obj, "function:" + key)
        return f
    return obj  # dtypes, scalar types, constants (cupy.float32 is numpy.float32)


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    if name in ("linalg", "fft", "random"):
        mod = _Submodule(name, getattr(_np, name))
        globals()[name] = mod
        return mod
    try:
        return _lookup(_np, name)
    except AttributeError:
        raise AttributeError("module 'cupy' (emulated) has no attribute %r" % name) from None


class _Submodule(types.ModuleType):
    def __init__(self, name, npmod):
        super().__init__("cupy." + name)
        self._np = npmod

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _lookup(self._np, name, self.__name__ + ".")


def _to_current_device(a, kind):
    """A device array on another device than the current one, copied to the current one (as
    CuPy's asarray/array/copy do: a device-to-device copy, recorded with direction 'd2d')."""
    _emulator.record("d2d", kind, a.nbytes)
    return _device_op("d2d:" + kind, (), lambda: _wrap(_np.array(a._a, copy=True)), check=False)


def asarray(a, dtype=None, order=None, blocking=False):
    if isinstance(a, ndarray):
        if a._dev != _tls.device:
            a = _to_current_device(a, "asarray")
        return a if dtype is None or a.dtype == _np.dtype(dtype) else a.astype(dtype)

    def run():
        r = _np.array(a, dtype=dtype, order=order or "K", copy=True)
        _emulator.record("h2d", "asarray", r.nbytes)
        return _wrap(r)
    return _device_op("h2d:asarray", (), run, check=False)


def array(obj, dtype=None, copy=True, order="K", subok=False, ndmin=0, blocking=False):
    if isinstance(obj, ndarray):
        if obj._dev != _tls.device:
            obj = _to_current_device(obj, "array")
            copy = False  # copied already

        def run():
            r = _np.array(obj._a, dtype=dtype, copy=copy, order=order, ndmin=ndmin)
            return obj if r is obj._a else _wrap(r)
        return _device_op("function:array", (obj,), run, kernel=False)

    def run():
        o = _unwrap(obj, allow_host=True) if isinstance(obj, (list, tuple)) else obj
        r = _np.array(o, dtype=dtype, order=order, ndmin=ndmin, copy=True)
        _emulator.record("h2d", "array", r.nbytes)
        return _wrap(r)
    return _device_op("h2d:array", (), run, check=False)


def asnumpy(a, stream=None, order="C", out=None, blocking=True):
    if isinstance(a, ndarray):
        return a.get(stream=stream, order=order, out=out, blocking=blocking)
    return _np.asarray(a, order=order)


def ascontiguousarray(a, dtype=None):
    if not isinstance(a, ndarray):
        raise TypeError("Argument 'a' has incorrect type (expected cupy.ndarray, got %s)" % type(a).__name__)

    def run():
        r = a._a if dtype is None else a._a.astype(dtype, copy=False)
        if r.ndim == 0:  # as CuPy (and NumPy): the result has at least one dimension
            return _wrap(r.reshape(1).copy())
        return a if (r is a._a and r.flags.c_contiguous) else _wrap(_np.array(r, order="C", copy=True))
    return _device_op("function:ascontiguousarray", (a,), run, kernel=False)


def get_array_module(*args):
    return sys.modules[__name__] if any(isinstance(a, ndarray) for a in args) else _np


def fuse(*args, kernel_name=None):
    """CuPy's kernel fusion: here the function itself, run on device arrays."""

    def deco(f):
        return Fusion(f, kernel_name or f.__name__)

    if len(args) == 1 and callable(args[0]) and kernel_name is None:
        return deco(args[0])
    return deco


class Fusion:
    def __init__(self, func, name):
        self.func, self.name, self.__name__ = func, name, name

    def __call__(self, *args):
        for x in args:  # CuPy's fused kernels take device arrays and scalars only
            if not isinstance(x, (ndarray,) + _SCALARS):
                raise TypeError("Unsupported type %s" % type(x))
        return _device_op("fuse:" + self.name, args, lambda: self.func(*args))  # one kernel, whatever its body


# --------------------------------------------------------------------------- indexing


def _index(key):
    """An index for the NumPy array: device and host arrays accepted (host ones copied to the
    device, as CuPy does); a boolean array makes CuPy count its True entries on the host."""
    items = key if isinstance(key, tuple) else (key,)
    out = []
    for s in items:
        if isinstance(s, ndarray):
            s = s._a
        elif isinstance(s, (list, _np.ndarray)):
            s = _np.asarray(s)
            _emulator.record("h2d", "index", s.nbytes)
        if isinstance(s, _np.ndarray) and s.dtype == _np.bool_:
            _sync("boolean mask index")
        out.append(s)
    return tuple(out) if isinstance(key, tuple) else out[0]


def _is_advanced(key):
    items = key if isinstance(key, tuple) else (key,)
    return any(isinstance(s, (ndarray, _np.ndarray, list)) for s in items)


# --------------------------------------------------------------------------- ndarray

_TO_HOST_METHODS = {"tolist", "item", "tobytes", "tofile", "dump", "dumps"}
_HOST_ARG_METHODS = {"take", "put", "repeat", "choose", "compress"}


class ndarray:
    """cupy.ndarray: a NumPy array standing for device memory (not a numpy.ndarray)."""

    __slots__ = ("_a", "_dev", "__weakref__")  # _dev: the device the memory was allocated on
    __array_priority__ = 100

    def __init__(self, shape, dtype=float, memptr=None, strides=None, order="C"):
        self._a = _np.empty(shape, dtype=dtype, order=order)
        self._dev = _pool._track(self._a)

    # -- host interop
    def __array__(self, *args, **kw):
        raise TypeError("Implicit conversion to a NumPy array is not allowed. "
                        "Please use `.get()` to construct a NumPy array explicitly.")

    @property
    def data(self):
        return _MemoryPointer(self._a)

    def get(self, stream=None, order="C", out=None, blocking=True):
        if out is not None:
            if not isinstance(out, _np.ndarray):
                raise TypeError("Only numpy.ndarray can be obtained from cupy.ndarray")
            if out.dtype != self.dtype:
                raise TypeError("{} array cannot be obtained from {} array".format(out.dtype, self.dtype))
            if out.shape != self.shape:
                raise ValueError("Shape mismatch. Expected shape: {}, actual shape: {}".format(out.shape, self.shape))
            if not (out.flags.c_contiguous or out.flags.f_contiguous):
                raise RuntimeError("Cannot set to non-contiguous array")
            out[...] = _to_host(self, "get")
            return out
        return _np.array(_to_host(self, "get"), order=order, copy=True)

    def set(self, arr, stream=None):
        if not isinstance(arr, _np.ndarray):
            raise TypeError("Only numpy.ndarray can be set to cupy.ndarray")
        if arr.dtype != self.dtype or arr.shape != self.shape:
            raise ValueError("dtype or shape mismatch in set()")
        _emulator.record("h2d", "set", arr.nbytes)

        def run():
            self._a[...] = arr
        _device_op("h2d:set", (), run, check=False)

    def __array_ufunc__(self, uf, method, *inputs, **kw):
        mine = _ufunc(uf)
        if method == "__call__":
            return mine(*inputs, **kw)
        if method == "at":
            return mine.at(*inputs, **kw)
        return getattr(mine, method)(*inputs, **kw)

    def __array_function__(self, func, types_, args, kwargs):
        mod = sys.modules[__name__]
        for part in func.__module__.split(".")[1:]:
            if part.startswith("_"):
                continue
            mod = getattr(mod, part)
        return getattr(mod, func.__name__)(*args, **kwargs)

    def _scalar(self, kind, conv):
        return conv(_to_host(self, kind, self.dtype.itemsize))

    def __float__(self):
        return self._scalar("float()", float)

    def __int__(self):
        return self._scalar("int()", int)

    def __complex__(self):
        return self._scalar("complex()", complex)

    def __bool__(self):
        return self._scalar("bool()", bool)

    def __index__(self):
        return self._scalar("index()", _np.ndarray.__index__)

    def __repr__(self):
        return repr(_to_host(self, "repr()"))

    def __str__(self):
        return str(_to_host(self, "str()"))

    def __format__(self, spec):
        return format(_to_host(self, "format()"), spec)

    def __reduce__(self):  # pickling copies to the host, as CuPy does
        return (array, (self.get(),))

    # -- attributes
    shape = property(lambda self: self._a.shape)

    @shape.setter
    def shape(self, value):
        self._a.shape = value

    dtype = property(lambda self: self._a.dtype)
    ndim = property(lambda self: self._a.ndim)
    size = property(lambda self: self._a.size)
    nbytes = property(lambda self: self._a.nbytes)
    itemsize = property(lambda self: self._a.itemsize)
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: self._a.flags)
    T = property(lambda self: _wrap(self._a.T))
    mT = property(lambda self: _wrap(_np.swapaxes(self._a, -1, -2)))
    real = property(lambda self: _wrap(self._a.real))
    imag = property(lambda self: _wrap(self._a.imag))
    base = property(lambda self: None if self._a.base is None else _wrap(self._a.base))
    device = property(lambda self: cuda.Device(self._dev))  # where the memory is, not the current device

    def __len__(self):
        if self.ndim == 0:
            raise TypeError("len() of unsized object")
        return self._a.shape[0]

    def __iter__(self):
        if self.ndim == 0:
            raise TypeError("iteration over a 0-d array")
        return (self[i] for i in range(self._a.shape[0]))

    def __getitem__(self, key):
        # basic indexing is a view (no kernel, no device check); advanced indexing a gather kernel
        return _device_op("getitem", (self, key), lambda: _wrap(self._a[_index(key)]), kernel=False)

    def __setitem__(self, key, value):
        if isinstance(value, _np.ndarray) and value.ndim and not _is_advanced(key):
            raise ValueError("non-scalar numpy.ndarray cannot be used for fill")
        if isinstance(value, (list, tuple)) and not _is_advanced(key):
            raise TypeError("Unsupported type %s" % type(value))

        def run():
            self._a[_index(key)] = _unwrap(value, allow_host=True)
        _device_op("setitem", (self, key, value), run)

    def fill(self, value):
        if isinstance(value, (ndarray, _np.ndarray)) and value.ndim:
            raise ValueError("non-scalar %s cannot be used for fill" % type(value).__module__.split(".")[0]
                             + ".ndarray")
        v = value._a if isinstance(value, ndarray) else value
        _device_op("method:fill", (self, value), lambda: self._a.fill(v))

    def __getattr__(self, name):
        if name.startswith("__"):  # no __array_interface__ & co.: NumPy must not see the memory
            raise AttributeError(name)
        attr = getattr(self._a, name)  # AttributeError as NumPy's
        if not callable(attr):
            return _wrap(attr)
        if name in _TO_HOST_METHODS:
            def to_host(*args, **kw):
                return getattr(_to_host(self, name + "()"), name)(*args, **kw)
            return to_host
        host_ok = name in _HOST_ARG_METHODS

        if name == "copy":
            return self._copy
        kind = "method:" + name

        def method(*args, **kw):
            out = _check_out(kw)
            if out is not None:
                kw["out"] = out._a

            def run():
                r = attr(*[_unwrap(x, allow_host=host_ok) for x in args], **_unwrap_kwargs(kw))
                return out if out is not None else _wrap(r)
            return _device_op(kind, (self, args, kw, out), run, kernel=False, writes=out is not None)
        method.__name__ = name
        return method

    def _copy(self, order="C"):
        """ndarray.copy: a copy on the current device, from whichever device the array is on."""
        if self._dev != _tls.device:
            _emulator.record("d2d", "copy", self.nbytes)
        return _device_op("method:copy", (), lambda: _wrap(self._a.copy(order=order)), check=False)

    def __copy__(self):
        return self._copy()

    def __deepcopy__(self, memo):
        return self._copy()

    @property
    def __dlpack__(self):
        if _CUDA_AWARE_MPI:  # absent, so that mpi4py takes __cuda_array_interface__ (it tries DLPack first)
            raise AttributeError("__dlpack__")

        def refuse(*a, **k):
            raise TypeError("the emulated cupy.ndarray has no DLPack export")
        return refuse

    @property
    def __cuda_array_interface__(self):
        """Only with MINIDIST_EMULATED_CUDA_AWARE_MPI=1 (see the module's docstring): the
        array's memory, for MPI to read and write as a CUDA-aware MPI does device memory, and
        only once the calling thread has waited for the device work it queued."""
        if not _CUDA_AWARE_MPI:
            raise AttributeError("__cuda_array_interface__")
        if _tls.queued:
            raise RuntimeError(
                "a device array was handed to MPI while this thread's queued device work may still "
                "be running: MPI reads and writes device memory outside the stream's order (and the "
                "memory pool may have given this array memory that queued kernels still read); "
                "synchronize the stream first")
        a = self._a
        return {"shape": a.shape, "typestr": a.dtype.str, "data": (a.__array_interface__["data"][0], False),
                "strides": None if a.flags.c_contiguous else a.strides, "version": 3, "stream": None}


def _binary(name, reflected=False, inplace=False):
    def op(self, other):
        if not isinstance(other, (ndarray, _np.ndarray) + _SCALARS):
            return NotImplemented
        u = _ufuncs.get(name) or _ufunc(getattr(_np, name))
        if inplace:
            return u(self, other, out=self)
        return u(other, self) if reflected else u(self, other)
    return op


for _op, _uf in [("add", "add"), ("sub", "subtract"), ("mul", "multiply"), ("truediv", "true_divide"),
                 ("floordiv", "floor_divide"), ("mod", "remainder"), ("pow", "power"),
                 ("matmul", "matmul"), ("and", "bitwise_and"), ("or", "bitwise_or"),
                 ("xor", "bitwise_xor"), ("lshift", "left_shift"), ("rshift", "right_shift")]:
    setattr(ndarray, "__%s__" % _op, _binary(_uf))
    setattr(ndarray, "__r%s__" % _op, _binary(_uf, reflected=True))
    setattr(ndarray, "__i%s__" % _op, _binary(_uf, inplace=True))
for _op, _uf in [("eq", "equal"), ("ne", "not_equal"), ("lt", "less"), ("le", "less_equal"),
                 ("gt", "greater"), ("ge", "greater_equal")]:
    setattr(ndarray, "__%s__" % _op, _binary(_uf))
for _op, _uf in [("neg", "negative"), ("pos", "positive"), ("abs", "absolute"), ("invert", "invert")]:
    setattr(ndarray, "__%s__" % _op, (lambda u: lambda self: _ufunc(getattr(_np, u))(self))(_uf))
ndarray.__hash__ = None
ndarray.__divmod__ = lambda self, o: _ufunc(_np.divmod)(self, o)

# --------------------------------------------------------------------------- RawModule

from ._raw import RawKernel, RawModule  # noqa: E402  (CUDA source on the CPU, tests/cuda_on_cpu.py)

# --------------------------------------------------------------------------- ElementwiseKernel

_C_FUNCS = {"sqrt": _np.sqrt, "exp": _np.exp, "log": _np.log, "tanh": _np.tanh, "abs": _np.abs,
            "fabs": _np.abs, "max": _np.maximum, "min": _np.minimum, "fmax": _np.fmax,
            "fmin": _np.fmin, "pow": _np.power, "rsqrt": lambda x: 1 / _np.sqrt(x),
            "sin": _np.sin, "cos": _np.cos, "erf": None, "log1p": _np.log1p, "expm1": _np.expm1}
_C_FUNCS = {k: v for k, v in _C_FUNCS.items() if v is not None}
_REFUSE = re.compile(r"\b(if|else|for|while|do|switch|return|goto|break|continue)\b|[{}?\[\]&|<>!%~^]|->|\+\+|--")
_DECL = re.compile(r"^(?:const\s+)?([A-Za-z_]\w*)\s+([A-Za-z_]\w*)\s*=\s*(.+)$", re.S)
_ASSIGN = re.compile(r"^([A-Za-z_]\w*)\s*([-+*/]?=)\s*(.+)$", re.S)
_NUM = re.compile(r"(?<![\w.])(\d+\.\d*|\.\d+|\d+)([eE][-+]?\d+)?([fF])?(?![\w.])")


def _params(spec):
    out = []
    for p in filter(None, (s.strip() for s in spec.split(","))):
        parts = p.split()
        if parts[0] == "raw":
            raise NotImplementedError("emulated ElementwiseKernel: 'raw' parameters are not supported (%r)" % p)
        if len(parts) != 2:
            raise ValueError("bad kernel parameter %r" % p)
        out.append((parts[0], parts[1]))
    return out


class ElementwiseKernel:
    """CuPy's user kernel, for straight-line C bodies: statements ``TYPE x = expr;``,
    ``x = expr;`` and ``x op= expr;`` with + - * / ( ) literals and math functions, run as
    whole-array NumPy expressions (each statement on every element before the next, which is
    the same as per element when no statement reads another element).  Anything else
    (control flow, indexing, raw parameters, casts, ternaries) raises NotImplementedError."""

    def __init__(self, in_params, out_params, operation, name="kernel", reduce_dims=True,
                 preamble="", no_return=False, return_tuple=False, **kwargs):
        self.in_params, self.out_params = _params(in_params), _params(out_params)
        self.name, self.no_return, self.return_tuple = name, no_return, return_tuple
        self.nin, self.nout = len(self.in_params), len(self.out_params)
        self.nargs = self.nin + self.nout
        self._stmts = self._translate(operation)

    def _translate(self, body):
        body = re.sub(r"//[^\n]*|/\*.*?\*/", "", body, flags=re.S)
        names = {n for _, n in self.in_params + self.out_params}
        outs = {n for _, n in self.out_params}
        stmts, local = [], set()
        for raw in body.split(";"):
            s = raw.strip()
            if not s:
                continue
            if _REFUSE.search(s):
                raise NotImplementedError("emulated ElementwiseKernel %s: only straight-line arithmetic is "
                                          "supported, not %r" % (self.name, s))
            m = _DECL.match(s)
            if m:
                ctype, target, expr, op = m.group(1), m.group(2), m.group(3), "="
                local.add(target)
            else:
                m = _ASSIGN.match(s)
                if not m:
                    raise NotImplementedError("emulated ElementwiseKernel %s: cannot translate %r" % (self.name, s))
                ctype, (target, op, expr) = None, m.groups()
                if target not in outs and target not in local:
                    raise NotImplementedError("emulated ElementwiseKernel %s: assignment to %r, which is neither an "
                                              "output nor a local" % (self.name, target))
            py = _NUM.sub(self._literal, expr)
            if op != "=":
                py = "%s %s (%s)" % (target, op[0], py)
            tree = ast.parse(py.strip(), mode="eval")
            self._check(tree, names | local, s)
            stmts.append((target, ctype, compile(tree, "<%s>" % self.name, "eval")))
        return stmts

    @staticmethod
    def _literal(m):
        whole, exp, f = m.group(1), m.group(2) or "", m.group(3)
        if "." in whole or exp:  # C: a double literal, or float with the f suffix
            return "_f32(%s%s)" % (whole, exp) if f else "_f64(%s%s)" % (whole, exp)
        return whole  # an int literal: takes the other operand's type

    def _check(self, tree, names, src):
        for node in ast.walk(tree):
            ok = isinstance(node, (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Add, ast.Sub, ast.Mult, ast.Div,
                                   ast.USub, ast.UAdd, ast.Load, ast.Constant, ast.Name, ast.Call))
            if isinstance(node, ast.Name):
                ok = node.id in names or node.id in _C_FUNCS or node.id in ("_f32", "_f64")
            if isinstance(node, ast.Call):
                ok = isinstance(node.func, ast.Name) and not node.keywords
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
                if all(isinstance(x, ast.Constant) and isinstance(x.value, int) for x in (node.left, node.right)):
                    ok = False  # C integer division
            if not ok:
                raise NotImplementedError("emulated ElementwiseKernel %s: cannot translate %r" % (self.name, src))

    def __call__(self, *args, size=None, block_size=None, stream=None):
        if len(args) not in (self.nin, self.nargs):
            raise TypeError("Wrong number of arguments for %s" % self.name)
        return _device_op("ElementwiseKernel:" + self.name, args, lambda: self._launch(args))

    def _launch(self, args):
        for x in args:
            if isinstance(x, _np.ndarray) and x.ndim:
                raise _unsupported(x)
        types_ = {}
        for (ctype, pname), x in zip(self.in_params + self.out_params, args):
            if isinstance(x, ndarray) and len(ctype) == 1:
                if ctype in types_ and types_[ctype] != x.dtype:
                    raise TypeError("Type is mismatched. %s %s %s" % (pname, types_[ctype], x.dtype))
                types_[ctype] = x.dtype

        def dt(ctype):
            if len(ctype) == 1:
                if ctype not in types_:
                    raise TypeError("Cannot determine the type %s of %s" % (ctype, self.name))
                return types_[ctype]
            return _np.dtype({"float": "float32", "double": "float64", "int": "int32", "bool": "bool",
                              "long long": "int64", "size_t": "uint64"}.get(ctype, ctype))

        env = {"_f32": _np.float32, "_f64": _np.float64, **_C_FUNCS}
        arrays = [x._a for x in args if isinstance(x, ndarray)]
        shape = _np.broadcast_shapes(*[a.shape for a in arrays]) if arrays else ()
        for (ctype, pname), x in zip(self.in_params, args):
            env[pname] = x._a.astype(dt(ctype), copy=False) if isinstance(x, ndarray) else dt(ctype).type(x)
        outs = []
        for i, (ctype, pname) in enumerate(self.out_params):
            if len(args) == self.nargs:
                o = args[self.nin + i]
                if not isinstance(o, ndarray):
                    raise TypeError("Output of %s must be a cupy.ndarray" % self.name)
                if o.shape != shape:
                    raise ValueError("Out shape is mismatched")
            else:
                o = ndarray(shape, dt(ctype))
            outs.append(o)
            env[pname] = o._a
        outnames = {p for _, p in self.out_params}
        for target, ctype, code in self._stmts:
            value = eval(code, {"__builtins__": {}}, env)
            if target in outnames:
                env[target][...] = value
            else:
                env[target] = _np.asarray(value).astype(dt(ctype), copy=False) if ctype else value
        if self.no_return:
            return None
        if len(outs) == 1 and not self.return_tuple:
            return outs[0]
        return tuple(outs)


# --------------------------------------------------------------------------- cupy.cuda

def _device_count():
    return int(os.environ.get("MINIDIST_EMULATED_GPUS", "1"))


class CUDARuntimeError(RuntimeError):
    pass


def _valid(dev):
    if not 0 <= dev < _device_count():
        raise CUDARuntimeError("cudaErrorInvalidDevice: invalid device ordinal")
    return dev


class _Device:
    """cupy.cuda.Device.  The current device is per host thread, as in CUDA: every thread
    starts on device 0, ``use()`` and ``with Device(i):`` change the calling thread's only."""

    def __init__(self, device=None):
        self.id = _tls.device if device is None else int(device)

    def use(self):
        _tls.device = _valid(self.id)

    def synchronize(self):
        _synchronized()

    compute_capability = property(lambda self: "90")

    def __enter__(self):
        prev = _tls.device
        self.use()
        _tls.stack.append(prev)
        return self

    def __exit__(self, *exc):
        _tls.device = _tls.stack.pop()

    def __int__(self):
        return self.id

    def __eq__(self, other):
        return isinstance(other, _Device) and other.id == self.id

    def __hash__(self):
        return self.id

    def __repr__(self):
        return "<CUDA Device %d>" % self.id


def _set_device(dev):
    _tls.device = _valid(int(dev))


class _MemoryPointer:
    """``ndarray.data``: ``ptr`` is the address of the array's first element (host memory here,
    which the emulated RawKernels read as device memory)."""

    def __init__(self, a):
        self.ptr = a.__array_interface__["data"][0]
        self.device_id = _tls.device


class _Stream:
    def __init__(self, null=False, non_blocking=False, ptds=False):
        self.ptr = 0

    def synchronize(self):
        _synchronized()

    def use(self):
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def record(self, event=None):
        return event or _Event()


class _Event:
    def __init__(self, block=False, disable_timing=False, interprocess=False):
        pass

    def record(self, stream=None):
        pass

    def synchronize(self):
        pass

    done = property(lambda self: True)


class MemoryHook:
    """cupy.cuda.MemoryHook: subclasses override the *_preprocess/*_postprocess methods; the
    emulated pool calls malloc_* and free_postprocess on every device buffer it counts."""
    name = "MemoryHook"

    def __enter__(self):
        if any(h.name == self.name for h in _hooks):
            raise RuntimeError("hook %s already exists" % self.name)
        _hooks.append(self)
        return self

    def __exit__(self, *exc):
        _hooks.remove(self)

    def alloc_preprocess(self, **kw):
        pass

    def alloc_postprocess(self, **kw):
        pass

    def malloc_preprocess(self, **kw):
        pass

    def malloc_postprocess(self, **kw):
        pass

    def free_preprocess(self, **kw):
        pass

    def free_postprocess(self, **kw):
        pass


def _properties(i):
    if not 0 <= int(i) < _device_count():
        raise CUDARuntimeError("cudaErrorInvalidDevice: invalid device ordinal")
    return {"name": b"Emulated GPU", "totalGlobalMem": 80 * 2 ** 30, "multiProcessorCount": 132,
            "major": 9, "minor": 0}


cuda = types.ModuleType("cupy.cuda")
cuda.Device = _Device
cuda.Stream = _Stream
cuda.Event = _Event
cuda.MemoryHook = MemoryHook
cuda.get_current_stream = lambda device=None: _Stream()
cuda.is_available = lambda: _device_count() > 0
cuda.runtime = types.ModuleType("cupy.cuda.runtime")
cuda.runtime.getDeviceCount = _device_count
cuda.runtime.getDevice = _current
cuda.runtime.setDevice = _set_device
cuda.runtime.getDeviceProperties = _properties
cuda.runtime.deviceSynchronize = _synchronized
cuda.runtime.CUDARuntimeError = CUDARuntimeError
cuda.runtime.runtimeGetVersion = lambda: 12040
cuda.runtime.driverGetVersion = lambda: 12040
cuda.memory = types.ModuleType("cupy.cuda.memory")
cuda.memory.OutOfMemoryError = type("OutOfMemoryError", (MemoryError,), {})
cuda.memory.MemoryPool = _Pool
Stream = _Stream
Stream.null = _Stream()
sys.modules["cupy.cuda"] = cuda
sys.modules["cupy.cuda.runtime"] = cuda.runtime
sys.modules["cupy.cuda.memory"] = cuda.memory

newaxis = None
inf, nan, pi, e = _np.inf, _np.nan, _np.pi, _np.e
dtype = _np.dtype
