"""What minidist's own CUDA kernels share: whether they can run here, and their compilation.

Each kernel module (``flash_cuda``, ``softmax_cuda``, ``layernorm_cuda``,
``multi_tensor_cuda``) holds its CUDA C source as a string beside the ``xp`` form it replaces.
Its macros (the compute type ``REAL``, block sizes) specialise the source; CuPy's
``RawModule`` compiles it with NVRTC on first use, once per process and set of macros, and
caches the binary on disk.  The same source runs on a CPU under tests/cuda_on_cpu.py.
"""

from __future__ import annotations

from .. import env
from ..backend import BACKEND, xp


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
