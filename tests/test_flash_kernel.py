"""The FlashAttention CUDA kernels (minidist/model/ops/cuda/flash.py) against the blockwise reference.

No GPU is needed: the kernel source runs on the CPU under tests/cuda_on_cpu.py (each thread
block as fibers handing over at __syncthreads), called through cuda.flash's own forward/backward
wrappers.  Where nvcc exists, the same source is also compiled for an H100 (sm_90), which
catches what a host compiler accepts but CUDA does not.
"""

from __future__ import annotations

import numpy as np
import pytest

from minidist.model.backend import BACKEND
from minidist.model.ops import blockwise, cuda

import cuda_on_cpu  # noqa: E402  (tests/cuda_on_cpu.py)
if cuda_on_cpu.compiler() is None:
    pytest.skip("no C++ compiler to run CUDA kernels on the CPU", allow_module_level=True)


# The CPU emulation of the kernels takes NumPy arrays: under MINIDIST_BACKEND=cupy the compiled
# kernels are tested instead (test_compiled_kernels_equal_the_reference_in_training).
on_numpy = pytest.mark.skipif(BACKEND != "numpy", reason="the CPU emulation of the kernels runs on NumPy arrays")


def emulated(real: str, head_dim: int, block_n: int | None = None) -> dict:
    """The kernels compiled for the CPU, callable like CuPy's: kernel(grid, block, args)."""
    defines = cuda.flash.defines(real, head_dim)
    if block_n is not None:
        defines["BLOCK_N"] = str(block_n)
    module = cuda_on_cpu.Module(cuda.flash.SOURCE, defines)
    return {name: (lambda grid, block, args, name=name: module.launch(name, grid, block[0], args))
            for name in cuda.flash.KERNELS}


def reference(q, k, v, do, scale, causal, q0, k0):
    """O, L and the gradients from blockwise.py's tiles (NumPy), for the same global positions."""
    state = blockwise.new_state(q.shape[:-2], q.shape[-2], v.shape[-1], q.dtype)
    blockwise.forward_tiles(q * scale, k, v, q0, k0, state, block=5, causal=causal)
    o, lse = blockwise.finish(state)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    blockwise.backward_tiles(q * scale, k, v, q0, k0, do, lse, blockwise.rowsum_dot(do, o), dq, dk, dv,
                             block=5, causal=causal)
    return o, lse, dq * scale, dk, dv


@on_numpy
@pytest.mark.parametrize("dtype, tol", [(np.float64, 1e-12), (np.float32, 2e-5)])
@pytest.mark.parametrize("causal, tq, tk, q0, k0", [
    (True, 13, 13, 0, 0),      # self-attention, rows not a multiple of the block or the tile
    (False, 9, 14, 0, 0),      # cross shapes
    (True, 8, 8, 16, 8),       # a ring-attention pair: these queries see every one of these keys
    (True, 10, 10, 20, 20),    # the diagonal pair of a later chunk
])
def test_kernels_equal_the_blockwise_reference(monkeypatch, dtype, tol, causal, tq, tk, q0, k0):
    monkeypatch.setattr(cuda.flash, "THREADS", 4)  # several blocks and threads at these sizes
    rng = np.random.default_rng(0)
    B, H, D = 2, 3, 8
    q, do = (rng.standard_normal((B, H, tq, D)).astype(dtype) for _ in range(2))
    k, v = (rng.standard_normal((B, H, tk, D)).astype(dtype) for _ in range(2))
    scale = 1 / np.sqrt(D)
    kernels = emulated("double" if dtype == np.float64 else "float", D, block_n=3)
    o, lse = cuda.flash.forward(q, k, v, scale, causal, q0, k0, kernels=kernels)
    dq, dk, dv = cuda.flash.backward(q, k, v, o, lse, do, scale, causal, q0, k0, kernels=kernels)
    want = reference(q, k, v, do, scale, causal, q0, k0)
    for name, got, ref in zip(("O", "L", "dQ", "dK", "dV"), (o, lse, dq, dk, dv), want):
        assert got.dtype == dtype and got.shape == ref.shape, name
        np.testing.assert_allclose(got, ref, rtol=tol, atol=tol, err_msg=name)


@on_numpy
def test_a_query_that_sees_no_key_gets_zeros_and_minus_infinity(monkeypatch):
    """A ring-attention pair where the keys all lie after the queries: nothing is seen."""
    monkeypatch.setattr(cuda.flash, "THREADS", 4)
    q = np.ones((1, 1, 4, 8))
    o, lse = cuda.flash.forward(q, q, q, 0.5, True, q0=0, k0=4, kernels=emulated("double", 8))
    assert not o.any() and np.isneginf(lse).all()


def test_tiles_fit_the_shared_memory_of_a_block():
    """Two tiles per kernel within the 48 KiB a block may declare statically."""
    for real, size in (("float", 4), ("double", 8)):
        for d in (16, 64, 128):
            n = cuda.flash.block_n(size, d)
            assert 2 * n * d * size + 2 * n * size <= 48 * 1024 and n >= 8


@cuda_on_cpu.needs_cuda_compiler
@pytest.mark.parametrize("real, head_dim", [("float", 64), ("double", 64), ("float", 128), ("double", 128)])
def test_source_compiles_for_an_h100(tmp_path, real, head_dim):
    defines = cuda.flash.defines(real, head_dim)
    assert cuda_on_cpu.cuda_entries(cuda.flash.SOURCE, defines, tmp_path) == sorted(cuda.flash.KERNELS)


@pytest.mark.skipif(cuda.flash.why_not(16) is not None, reason="the kernels run under MINIDIST_BACKEND=cupy "
                    "(make test-gpu; or the CuPy emulator of tests/emulated_gpu)")
@pytest.mark.parametrize("dtype, tol", [("float64", 1e-12), ("float32", 2e-5)])
def test_compiled_kernels_equal_the_reference_in_training(dtype, tol):
    """On CuPy (a GPU, or the emulator): blockwise attention's forward and gradients through
    the compiled kernels equal the batched-product reference (MINIDIST_CUDA_KERNELS's off)."""
    from minidist.model import ops
    from minidist.model.autograd import Tensor
    from minidist.model.backend import from_host, to_host

    rng = np.random.default_rng(1)
    q, k, v, g = (rng.standard_normal((2, 3, 40, 16)).astype(dtype) for _ in range(4))

    def run(kernel_off: bool):
        ts = [Tensor(from_host(a), requires_grad=True) for a in (q, k, v)]
        before = cuda.flash.why_not
        if kernel_off:
            cuda.flash.why_not = lambda head_dim: "off for the reference"
        try:
            y = ops.blockwise_attention(*ts, block=16)
        finally:
            cuda.flash.why_not = before
        (y * Tensor(from_host(g))).sum().backward()
        return [to_host(y.data)] + [to_host(t.grad) for t in ts]

    for name, got, want in zip(("O", "dQ", "dK", "dV"), run(False), run(True)):
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=name)


@pytest.mark.parametrize("exit_early", [False, True])
def test_the_cpu_emulation_shares_a_block_and_refuses_uneven_barriers(exit_early):
    """tests/cuda_on_cpu.py itself: a block's threads see each other's __shared__ writes after
    __syncthreads, and a thread that leaves before a barrier the others meet is an error (on a
    GPU, undefined behaviour, often a hang)."""
    src = r"""
    extern "C" __global__ void rotate(double* out, int exit_early) {
        __shared__ double tile[8];
        tile[threadIdx.x] = threadIdx.x + 10 * blockIdx.x;
        if (exit_early && threadIdx.x == 0) return;
        __syncthreads();
        out[blockIdx.x * blockDim.x + threadIdx.x] = tile[(threadIdx.x + 1) % blockDim.x];
    }
    """
    module = cuda_on_cpu.Module(src, {})
    out = np.zeros(16)
    if exit_early:
        with pytest.raises(RuntimeError, match="rotate: the threads of a block met different numbers"):
            module.launch("rotate", (2, 1), 8, (out, np.int32(1)))
        return
    module.launch("rotate", (2, 1), 8, (out, np.int32(0)))
    want = [(t + 1) % 8 + 10 * b for b in range(2) for t in range(8)]
    np.testing.assert_array_equal(out, want)
