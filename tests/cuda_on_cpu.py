"""Run CUDA kernel source on a CPU, for tests on machines without a GPU.

A tiny emulation of CUDA's thread model, enough for kernels that use ``threadIdx``,
``blockIdx``, ``blockDim``, ``gridDim``, static ``__shared__`` arrays and ``__syncthreads``:
the kernel source is compiled as C++20 by the host compiler, and the ``blockDim.x`` threads
of a block run as fibers (``ucontext``) of one OS thread that share the block's
``__shared__`` arrays (static locals): each runs until its next ``__syncthreads``, then the
next thread, and a new phase starts when all have arrived.  The blocks of a grid run one
after another.  A source without ``__syncthreads`` (an elementwise kernel) runs each thread
to its end in turn, without fibers.
Launch arguments are passed as an array of pointers, as ``cuLaunchKernel`` takes them.

What it checks: the kernel's arithmetic, its indexing and its strided cooperative loops with
several threads per block.  What it cannot:
warp-level behaviour, timing, the GPU's float rounding of ``exp``/``log`` (the host's libm
is used), and races between barriers (the fibers never interleave there).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import hashlib
import os
import re
import shutil
import subprocess
import tempfile

import numpy as np
import pytest

PRELUDE = r"""
#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
#include <vector>
#include <ucontext.h>
using std::exp; using std::log; using std::max; using std::min; using std::sqrt; using std::tanh;
struct dim3 { unsigned x = 1, y = 1, z = 1; };
static dim3 threadIdx, blockIdx, blockDim, gridDim;
// The threads of a block are fibers of one OS thread (ucontext): __syncthreads hands control
// back to the scheduler, which resumes every thread of the block in turn until each has
// reached the barrier or finished, then the next phase.
static ucontext_t scheduler;
static std::vector<ucontext_t> fibers;
static std::vector<unsigned> barriers_met;  // per thread of the running block
static unsigned running;
static int uneven_barriers;  // a block whose threads met different numbers of barriers
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
static inline void __syncthreads() { ++barriers_met[running]; swapcontext(&fibers[running], &scheduler); }
"""

LAUNCHER = r"""
template <class... A, std::size_t... I>
static void call_packed(void (*kernel)(A...), void** args, std::index_sequence<I...>) {
    kernel(*static_cast<typename std::remove_reference<A>::type*>(args[I])...);
}
static std::function<void()> fiber_body;
static std::vector<char> finished;
static void fiber_main() {
    fiber_body();
    finished[running] = 1;  // returning resumes uc_link: the scheduler
}
template <class... A>
static void launch(void (*kernel)(A...), unsigned gx, unsigned gy, unsigned bx, void** args) {
    const std::size_t stack = 256 * 1024;
    gridDim = dim3{gx, gy, 1};
    blockDim = dim3{bx, 1, 1};
#ifdef CUDA_ON_CPU_NO_BARRIERS
    // no __syncthreads in the source: each thread runs to its end, one after another (no fibers)
    uneven_barriers = 0;
    for (unsigned y = 0; y < gy; ++y)
        for (unsigned x = 0; x < gx; ++x)
            for (unsigned t = 0; t < bx; ++t) {
                blockIdx = dim3{x, y, 0};
                threadIdx = dim3{t, 0, 0};
                call_packed(kernel, args, std::index_sequence_for<A...>{});
            }
    return;
#endif
    fibers.assign(bx, ucontext_t{});
    finished.assign(bx, 0);
    uneven_barriers = 0;
    std::unique_ptr<char[]> stacks(new char[stack * bx]);
    fiber_body = [=] { call_packed(kernel, args, std::index_sequence_for<A...>{}); };
    for (unsigned y = 0; y < gy; ++y)
        for (unsigned x = 0; x < gx; ++x) {
            blockIdx = dim3{x, y, 0};
            for (unsigned t = 0; t < bx; ++t) {
                getcontext(&fibers[t]);
                fibers[t].uc_stack.ss_sp = stacks.get() + t * stack;
                fibers[t].uc_stack.ss_size = stack;
                fibers[t].uc_link = &scheduler;
                makecontext(&fibers[t], fiber_main, 0);
                finished[t] = 0;
            }
            barriers_met.assign(bx, 0);
            // one phase: every unfinished thread up to its next barrier, in turn; the order
            // alternates between phases, so that a missing barrier shows in either direction
            for (unsigned phase = 0, busy = 1; busy; ++phase) {
                busy = 0;
                for (unsigned i = 0; i < bx; ++i) {
                    unsigned t = phase % 2 ? bx - 1 - i : i;
                    if (finished[t]) continue;
                    running = t;
                    threadIdx = dim3{t, 0, 0};
                    swapcontext(&scheduler, &fibers[t]);
                    busy = busy || !finished[t];
                }
            }
            for (unsigned t = 1; t < bx; ++t) uneven_barriers |= barriers_met[t] != barriers_met[0];
        }
}
extern "C" int cuda_on_cpu_uneven_barriers() { return uneven_barriers; }
"""


SCALARS = {np.dtype(np.int32): ctypes.c_int32, np.dtype(np.float32): ctypes.c_float,
           np.dtype(np.float64): ctypes.c_double, np.dtype(np.int64): ctypes.c_int64,
           np.dtype(np.uint32): ctypes.c_uint32, np.dtype(np.uint64): ctypes.c_uint64,
           np.dtype(np.bool_): ctypes.c_bool}


def compiler() -> str | None:
    """The host C++ compiler (g++ or clang++), or None."""
    return shutil.which("g++") or shutil.which("clang++")


def nvrtc_library() -> str | None:
    """libnvrtc, the CUDA compiler library CuPy's RawModule compiles with: from the
    ``nvidia-cuda-nvrtc-cu12`` wheel where it is installed (no GPU or driver needed), else the
    system's; None without either."""
    try:
        import nvidia.cuda_nvrtc as wheel  # a namespace package: no __init__, a __path__
        for folder in wheel.__path__:
            for lib in sorted(glob.glob(os.path.join(folder, "lib", "libnvrtc.so*"))):
                if "builtins" not in lib and ".alt." not in lib:
                    return lib
    except ImportError:
        pass
    return ctypes.util.find_library("nvrtc")


def cuda_compiler() -> str | None:
    """'nvcc' or 'nvrtc': what :func:`cuda_entries` compiles with here (None: neither)."""
    if shutil.which("nvcc"):
        return "nvcc"
    return "nvrtc" if nvrtc_library() else None


def cuda_entries(source: str, defines: dict, folder, arch: str = "90") -> list[str] | None:
    """Compile ``source`` for the GPU architecture ``arch`` (90: an H100) with ``defines`` as
    macros, with nvcc or else NVRTC, and return the names of the kernels in its PTX.  None
    without either; AssertionError with the compiler's message where compiling fails."""
    options = ["-std=c++14", *(f"-D{k}={v}" for k, v in defines.items())]
    if cuda_compiler() == "nvcc":
        src, out = os.path.join(folder, "kernels.cu"), os.path.join(folder, "kernels.ptx")
        with open(src, "w") as f:
            f.write(source)
        r = subprocess.run(["nvcc", *options, f"-arch=sm_{arch}", "-ptx", "-o", out, src],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        with open(out) as f:
            ptx = f.read()
    elif cuda_compiler() == "nvrtc":
        ptx = _nvrtc_ptx(source, options + [f"-arch=compute_{arch}"])
    else:
        return None
    return sorted(re.findall(r"\.entry\s+(\w+)", ptx))


needs_cuda_compiler = pytest.mark.skipif(  # a test's marker: it compiles CUDA source
    cuda_compiler() is None, reason="no CUDA compiler here (nvcc, or NVRTC: pip install nvidia-cuda-nvrtc-cu12)")


def _nvrtc_ptx(source: str, options: list[str]) -> str:
    """PTX of ``source`` from NVRTC (nvrtcCreateProgram, nvrtcCompileProgram, nvrtcGetPTX)."""
    lib = ctypes.CDLL(nvrtc_library())
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"kernels.cu", 0, None, None) == 0
    try:
        opts = (ctypes.c_char_p * len(options))(*(o.encode() for o in options))
        status = lib.nvrtcCompileProgram(prog, len(options), opts)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value + 1)
        lib.nvrtcGetProgramLog(prog, log)
        assert status == 0, f"NVRTC error {status}:\n{log.value.decode(errors='replace')}"
        lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
        ptx = ctypes.create_string_buffer(size.value + 1)
        assert lib.nvrtcGetPTX(prog, ptx) == 0
        return ptx.value.decode()
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def kernel_names(source: str) -> list[str]:
    return re.findall(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\(', source)


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
        if "__syncthreads" not in source:  # elementwise kernels: threads need not take turns
            defines = dict(defines, CUDA_ON_CPU_NO_BARRIERS=1)
        text = PRELUDE + "".join(f"#define {k} {v}\n" for k, v in defines.items()) + source + LAUNCHER + wrappers
        tag = hashlib.sha1(text.encode()).hexdigest()[:16]
        folder = os.path.join(tempfile.gettempdir(), "minidist-cuda-on-cpu")
        os.makedirs(folder, exist_ok=True)
        lib = os.path.join(folder, f"{tag}.so")
        if os.path.exists(lib) and not self._complete(lib, names):  # a damaged cache entry: build again
            os.remove(lib)
        if not os.path.exists(lib):
            # every file of this build is the process's own: ranks of one job compile the same
            # source at once, and one of them truncating a shared .cpp under another's
            # compiler once gave a library without launchers
            src = os.path.join(folder, f"{tag}.{os.getpid()}.cpp")
            with open(src, "w") as f:
                f.write(text)
            tmp = f"{lib}.{os.getpid()}.tmp"
            r = subprocess.run([cxx, "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-o", tmp, src],
                               capture_output=True, text=True)
            if r.returncode != 0:
                os.remove(src)
                raise RuntimeError(f"the kernel source does not compile as C++:\n{r.stderr[-4000:]}")
            os.remove(src)
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
        return all(hasattr(handle, f"launch_{n}") for n in names) and hasattr(handle, "cuda_on_cpu_uneven_barriers")

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
        if self._lib.cuda_on_cpu_uneven_barriers():
            raise RuntimeError(f"kernel {name}: the threads of a block met different numbers of __syncthreads "
                               "(on a GPU: undefined behaviour, often a hang)")
