"""Run CUDA kernel source on a CPU, for tests on machines without a GPU.

A tiny emulation of CUDA's thread model, enough for kernels that use ``threadIdx``,
``blockIdx``, ``blockDim``, ``gridDim``, static ``__shared__`` arrays and ``__syncthreads``:
the kernel source is compiled as C++20 by the host compiler, each thread block runs as
``blockDim.x`` OS threads that share the block's ``__shared__`` arrays (static locals) and
meet at ``__syncthreads`` on a ``std::barrier``; the blocks of a grid run one after another
on the same threads.
Launch arguments are passed as an array of pointers, as ``cuLaunchKernel`` takes them.

What it checks: the kernel's arithmetic, its indexing and its strided cooperative loops with
several threads per block.  What it cannot: warp-level behaviour, timing, the GPU's float
rounding of ``exp``/``log`` (the host's libm is used), and races that the OS threads happen
not to hit.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile

import numpy as np

PRELUDE = r"""
#include <algorithm>
#include <barrier>
#include <cmath>
#include <thread>
#include <vector>
using std::exp; using std::log; using std::max; using std::min;
struct dim3 { unsigned x = 1, y = 1, z = 1; };
static thread_local dim3 threadIdx, blockIdx;
static dim3 blockDim, gridDim;
static std::barrier<>* block_barrier;
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
static inline void __syncthreads() { block_barrier->arrive_and_wait(); }
"""

LAUNCHER = r"""
template <class... A, std::size_t... I>
static void call_packed(void (*kernel)(A...), void** args, std::index_sequence<I...>) {
    kernel(*static_cast<typename std::remove_reference<A>::type*>(args[I])...);
}
template <class... A>
static void launch(void (*kernel)(A...), unsigned gx, unsigned gy, unsigned bx, void** args) {
    gridDim = dim3{gx, gy, 1};
    blockDim = dim3{bx, 1, 1};
    std::barrier<> bar(bx);
    block_barrier = &bar;
    // One OS thread per thread of a block, kept for the whole grid: each runs its thread of
    // every block in turn, and the block's threads meet once more when it ends, so that the
    // next block finds its __shared__ arrays (static locals) free.
    std::vector<std::thread> threads;
    for (unsigned t = 0; t < bx; ++t)
        threads.emplace_back([=, &bar] {
            threadIdx = dim3{t, 0, 0};
            for (unsigned y = 0; y < gy; ++y)
                for (unsigned x = 0; x < gx; ++x) {
                    blockIdx = dim3{x, y, 0};
                    call_packed(kernel, args, std::index_sequence_for<A...>{});
                    bar.arrive_and_wait();
                }
        });
    for (auto& th : threads) th.join();
}
"""


SCALARS = {np.dtype(np.int32): ctypes.c_int32, np.dtype(np.float32): ctypes.c_float,
           np.dtype(np.float64): ctypes.c_double, np.dtype(np.int64): ctypes.c_int64,
           np.dtype(np.uint32): ctypes.c_uint32, np.dtype(np.uint64): ctypes.c_uint64,
           np.dtype(np.bool_): ctypes.c_bool}


def compiler() -> str | None:
    """The host C++ compiler (g++ or clang++), or None."""
    return shutil.which("g++") or shutil.which("clang++")


def kernel_names(source: str) -> list[str]:
    return re.findall(r'extern\s+"C"\s+__global__\s+void\s+(\w+)\s*\(', source)


class Module:
    """``source`` (CUDA C) compiled for the CPU with ``defines``; call kernels by name."""

    def __init__(self, source: str, defines: dict[str, str]):
        cxx = compiler()
        if cxx is None:
            raise RuntimeError("no C++ compiler (g++ or clang++) to emulate CUDA kernels with")
        names = kernel_names(source)
        wrappers = "".join(
            f'extern "C" void launch_{n}(unsigned gx, unsigned gy, unsigned bx, void** args) '
            f"{{ launch({n}, gx, gy, bx, args); }}\n" for n in names)
        text = PRELUDE + "".join(f"#define {k} {v}\n" for k, v in defines.items()) + source + LAUNCHER + wrappers
        tag = hashlib.sha1(text.encode()).hexdigest()[:16]
        folder = os.path.join(tempfile.gettempdir(), "minidist-cuda-on-cpu")
        os.makedirs(folder, exist_ok=True)
        lib = os.path.join(folder, f"{tag}.so")
        if os.path.exists(lib) and not self._complete(lib, names):  # a damaged cache entry: build again
            os.remove(lib)
        if not os.path.exists(lib):
            src = os.path.join(folder, f"{tag}.cpp")
            with open(src, "w") as f:
                f.write(text)
            tmp = f"{lib}.{os.getpid()}.tmp"
            r = subprocess.run([cxx, "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-o", tmp, src],
                               capture_output=True, text=True)
            if r.returncode != 0:
                raise RuntimeError(f"the kernel source does not compile as C++:\n{r.stderr[-4000:]}")
            os.replace(tmp, lib)  # atomic: parallel test processes may compile the same module
        self._lib = ctypes.CDLL(lib)
        self.names = names

    @staticmethod
    def _complete(lib: str, names) -> bool:
        """Does the compiled library ``lib`` export a launcher for every kernel?"""
        try:
            handle = ctypes.CDLL(os.path.abspath(lib), mode=ctypes.RTLD_LOCAL)
        except OSError:
            return False
        return all(hasattr(handle, f"launch_{n}") for n in names)

    def launch(self, name: str, grid, block: int, args):
        """Run kernel ``name`` on ``grid`` = (gx, gy) blocks of ``block`` threads.  ``args``:
        C-contiguous NumPy arrays (passed as device pointers) and NumPy scalars (by value)."""
        keep, pointers = [], []
        for a in args:
            if isinstance(a, np.ndarray):
                if not a.flags.c_contiguous:
                    raise ValueError("kernel arrays must be C-contiguous")
                slot = ctypes.c_void_p(a.ctypes.data)
            else:
                scalar = np.asarray(a)
                slot = SCALARS[scalar.dtype](scalar.item())
            keep.append(slot)
            pointers.append(ctypes.cast(ctypes.pointer(slot), ctypes.c_void_p))
        packed = (ctypes.c_void_p * len(pointers))(*pointers)
        gx, gy = grid
        getattr(self._lib, f"launch_{name}")(ctypes.c_uint(gx), ctypes.c_uint(gy), ctypes.c_uint(block), packed)
