"""``cupy.RawModule`` / ``cupy.RawKernel`` of the emulator: CUDA source run on the CPU.

The source is compiled as C++ by ``tests/cuda_on_cpu.py`` (each thread block's threads as
fibers handing over at ``__syncthreads``, static ``__shared__`` arrays, ``extern "C"`` kernels only) with
the ``-DNAME=VALUE`` options as macros; other compiler options (``-std=...``, ``-arch``...) are
ignored, the host compiler builds C++20.  Compiled libraries are cached by source hash in the
temp directory, so only the first run of a source pays for the compiler.

A kernel is called as CuPy calls it, ``kernel(grid, block, args, shared_mem=0)``: ``grid`` and
``block`` tuples of 1 to 3 ints; ``args`` device arrays (passed as pointers to their memory,
which the kernel reads and writes in place), NumPy scalars (by value, in their own type) and
Python scalars (as CuPy converts them: int to int64, float to float64, bool to bool).  As in
CuPy, a ``numpy.ndarray`` argument raises ``TypeError: Unsupported type``.  Every launch is
recorded in ``cupy._emulator`` (direction ``'launch'``, kind ``'RawKernel:NAME'``), so a test
can tell that a kernel path was taken, and counted as one device operation.  An array argument
on another device than the current one is recorded as a cross-device use; CuPy does not check
it: the kernel runs where peer access is enabled and faults (here: CUDADriverError) without.

Stricter than CuPy, or missing: array arguments must be C-contiguous (CuPy hands any array's
pointer over; a kernel indexing it as contiguous would read the wrong elements); ``grid`` may
not use z, ``block`` only x (what cuda_on_cpu runs); no dynamic shared memory, no ``path``
(cubin/ptx), no ``name_expressions`` (templates), no cooperative groups.
"""

from __future__ import annotations

import importlib.util
import os
import re

import numpy as _np

from . import _emulator

_CUDA_ON_CPU = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                            "cuda_on_cpu.py")  # tests/cuda_on_cpu.py
_loaded = None


def _cuda_on_cpu():
    global _loaded
    if _loaded is None:
        spec = importlib.util.spec_from_file_location("_emulated_cuda_on_cpu", _CUDA_ON_CPU)
        _loaded = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(_loaded)
    return _loaded


class CUDADriverError(RuntimeError):
    """cupy.cuda.driver.CUDADriverError."""


_DEFINE = re.compile(r"^(?:-D|--define-macro=?)(\w+)(?:=(.*))?$", re.S)


def defines_of(options) -> dict:
    """The macros of NVRTC/NVCC options: ``-DNAME=VALUE``, ``-DNAME`` (1), ``--define-macro=...``;
    ``-D NAME=VALUE`` as two options too.  Other options are ignored."""
    out, pending = {}, False
    for opt in options:
        if pending or opt in ("-D", "--define-macro"):
            if pending:
                m = re.match(r"^(\w+)(?:=(.*))?$", opt, re.S)
                if not m:
                    raise ValueError("bad macro definition %r" % opt)
                out[m.group(1)] = "1" if m.group(2) is None else m.group(2)
            pending = not pending
            continue
        m = _DEFINE.match(opt)
        if m:
            out[m.group(1)] = "1" if m.group(2) is None else m.group(2)
    if pending:
        raise ValueError("a -D option without a macro")
    return out


class RawModule:
    """CuPy's RawModule for ``code`` (CUDA C with ``extern "C" __global__`` kernels), compiled
    for the CPU when a kernel is first asked for."""

    def __init__(self, code=None, *, path=None, options=(), backend="nvrtc", translate_cucomplex=False,
                 enable_cooperative_groups=False, name_expressions=None, jitify=False):
        if path is not None or code is None:
            raise NotImplementedError("emulated RawModule: only code=, not path= (cubin/ptx)")
        if name_expressions:
            raise NotImplementedError("emulated RawModule: name_expressions (template kernels) are not supported")
        if enable_cooperative_groups:
            raise NotImplementedError("emulated RawModule: cooperative groups are not supported")
        if backend not in ("nvrtc", "nvcc"):
            raise ValueError("backend must be 'nvrtc' or 'nvcc', got %r" % (backend,))
        self.code, self.options, self.backend = code, tuple(options), backend
        self.name_expressions = name_expressions
        self.defines = defines_of(self.options)
        self._module = None

    @property
    def module(self):
        """The cuda_on_cpu.Module (compiled on first use, as CuPy compiles on first use)."""
        if self._module is None:
            self._module = _cuda_on_cpu().Module(self.code, self.defines)
            _emulator.record("compile", "RawModule", 0)
        return self._module

    def get_function(self, name):
        if name not in self.module.names:
            raise CUDADriverError("CUDA_ERROR_NOT_FOUND: named symbol not found (%s)" % name)
        return RawKernel._of(self, name)


def _dims(what, t):
    if not isinstance(t, tuple):
        raise TypeError("%s must be a tuple, got %s" % (what, type(t)))
    if not 1 <= len(t) <= 3 or not all(isinstance(n, (int, _np.integer)) and n >= 1 for n in t):
        raise ValueError("%s must be a tuple of 1 to 3 positive ints, got %r" % (what, t))
    return tuple(int(n) for n in t) + (1,) * (3 - len(t))


def _argument(x):
    from . import ndarray  # the package's device array (this module is imported by it)

    if isinstance(x, ndarray):
        a = x._a
        if not a.flags.c_contiguous:
            raise ValueError("emulated RawKernel: array arguments must be C-contiguous (CuPy would pass "
                             "the pointer of a strided array, which a kernel indexing it densely misreads)")
        return a  # the device buffer itself: the kernel writes into it in place
    if isinstance(x, bool):
        return _np.bool_(x)
    if isinstance(x, int):
        return _np.int64(x)
    if isinstance(x, float):
        return _np.float64(x)
    if isinstance(x, _np.generic) and not isinstance(x, (_np.complexfloating, _np.object_)):
        return x
    raise TypeError("Unsupported type %s" % type(x))


class RawKernel:
    """A kernel of a :class:`RawModule` (CuPy's ``RawKernel`` from ``get_function``)."""

    def __init__(self, code, name, options=(), backend="nvrtc", translate_cucomplex=False, *,
                 enable_cooperative_groups=False, jitify=False):
        self._raw = RawModule(code=code, options=options, backend=backend,
                              enable_cooperative_groups=enable_cooperative_groups)
        self.code, self.name, self.options = code, name, tuple(options)

    @classmethod
    def _of(cls, module, name):
        k = cls.__new__(cls)
        k._raw, k.code, k.name, k.options = module, module.code, name, module.options
        return k

    def __call__(self, grid, block, args, *, shared_mem=0):
        gx, gy, gz = _dims("grid", grid)
        bx, by, bz = _dims("block", block)
        if bx * by * bz > 1024:
            raise CUDADriverError("CUDA_ERROR_INVALID_VALUE: invalid argument (block of %d threads)" % (bx * by * bz))
        if gz != 1 or by != 1 or bz != 1:
            raise NotImplementedError("emulated RawKernel: grid (x, y) and block (x,) only, got %r, %r" % (grid, block))
        if shared_mem:
            raise NotImplementedError("emulated RawKernel: no dynamic shared memory")
        if not isinstance(args, (tuple, list)):
            raise TypeError("args must be a tuple, got %s" % type(args))
        values = [_argument(x) for x in args]
        module = self._raw.module
        if self.name not in module.names:
            raise CUDADriverError("CUDA_ERROR_NOT_FOUND: named symbol not found (%s)" % self.name)
        from . import _arrays, _check_devices, _device_op

        kind = "RawKernel:" + self.name
        _check_devices(_arrays(args, []), kind, raw=True)  # CuPy checks nothing: the kernel faults
        _emulator.record("launch", kind, 0)
        _device_op(kind, (), lambda: module.launch(self.name, (gx, gy), bx, values), check=False)
