"""The ordered scatter-add kernel (minidist/model/ops/cuda/scatter.py) against ``add.at``.

On the CPU the source runs under tests/cuda_on_cpu.py on NumPy arrays and must give
``np.add.at``'s result bit for bit (the same additions in the same order); where nvcc or NVRTC
is, it also compiles for an H100.  On CuPy (make test-gpu, or the emulator) the embedding's
gradient through ``scatter_add_rows`` equals the host's ``add.at`` bit for bit, run after
run: atomic adds, the kernel's replacement, gave a different last bit on most runs.
"""

from __future__ import annotations

import numpy as np
import pytest

from minidist.model import backend
from minidist.model.backend import BACKEND
from minidist.model.ops import cuda

import cuda_on_cpu  # noqa: E402  (tests/cuda_on_cpu.py)

on_numpy = pytest.mark.skipif(BACKEND != "numpy" or cuda_on_cpu.compiler() is None,
                              reason="the CPU emulation of the kernels runs on NumPy arrays, with a C++ compiler")


def emulated(real: str) -> dict:
    module = cuda_on_cpu.Module(cuda.scatter.SOURCE, {"REAL": real})
    return {name: (lambda grid, block, args, name=name: module.launch(name, grid, block[0], args))
            for name in cuda.scatter.KERNELS}


def _case(rng, idx_shape, rows, row_shape, dtype):
    idx = rng.integers(0, rows, size=idx_shape)
    g = (rng.standard_normal(idx_shape + row_shape) * 10.0 ** rng.integers(-3, 4, size=idx_shape + row_shape))
    return idx, g.astype(dtype)


@on_numpy
@pytest.mark.parametrize("dtype, real", [(np.float64, "double"), (np.float32, "float")])
@pytest.mark.parametrize("idx_shape, rows, row_shape", [
    ((4, 9), 5, (3,)),       # repeats everywhere, some rows never named
    ((40,), 1, (2, 3)),      # one row named 40 times: one long run, rows of two axes
    ((1,), 6, (7,)),         # a single index
    ((3, 5), 64, (1,)),      # mostly distinct indices, width 1
])
def test_kernel_is_add_at_bit_for_bit(monkeypatch, dtype, real, idx_shape, rows, row_shape):
    monkeypatch.setattr(cuda.scatter, "THREADS", 8)
    monkeypatch.setattr(cuda.scatter, "BLOCKS", 3)  # 24 threads stride over every (index, column)
    idx, g = _case(np.random.default_rng(len(idx_shape) * rows), idx_shape, rows, row_shape, dtype)
    want = np.zeros((rows,) + row_shape, dtype=dtype)
    np.add.at(want, idx.reshape(-1), g.reshape((-1,) + row_shape))
    out = np.zeros((rows,) + row_shape, dtype=dtype)
    got = cuda.scatter.add_rows(idx, g, out, kernels=emulated(real))
    assert got is out
    np.testing.assert_array_equal(got, want)


@on_numpy
def test_rows_of_another_dtype_are_added_in_the_output_dtype():
    idx, g = _case(np.random.default_rng(3), (6,), 3, (4,), np.float32)
    want = np.zeros((3, 4))
    np.add.at(want, idx, g.astype(np.float64))
    got = cuda.scatter.add_rows(idx, g, np.zeros((3, 4)), kernels=emulated("double"))
    np.testing.assert_array_equal(got, want)


def test_empty_indices_leave_the_zeros():
    out = np.zeros((3, 2))
    assert cuda.scatter.add_rows(np.zeros((0,), dtype=np.int64), np.zeros((0, 2)), out, kernels={}) is out
    assert not out.any()


def test_the_kernel_says_why_it_does_not_run():
    if BACKEND == "numpy":
        assert cuda.scatter.why_not(np.zeros(2)) == "the kernels run on CuPy only"
    elif backend.bfloat16 is not None:
        assert "bfloat16" in cuda.scatter.why_not(backend.xp.zeros(2, dtype=backend.bfloat16))


@cuda_on_cpu.needs_cuda_compiler
@pytest.mark.parametrize("real", ["float", "double"])
def test_source_compiles_for_an_h100(tmp_path, real):
    assert cuda_on_cpu.cuda_entries(cuda.scatter.SOURCE, {"REAL": real}, tmp_path) == sorted(cuda.scatter.KERNELS)


@pytest.mark.skipif(BACKEND != "cupy", reason="the compiled kernel runs under MINIDIST_BACKEND=cupy (make test-gpu)")
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_the_embedding_gradient_is_the_same_on_every_run(dtype):
    """4096 tokens of 8 kinds into 64-wide rows: 512 adds on each row, the case where atomic adds
    land in a different order each time.  Five runs, each add.at's result on the host."""
    from minidist.model.autograd import Tensor
    from minidist.model.ops import embedding

    dt = backend.dtype(dtype)
    rng = np.random.default_rng(4)
    ids, g = rng.integers(0, 8, size=(8, 512)), rng.standard_normal((8, 512, 64))
    want = np.zeros((10, 64), dtype=dt)
    np.add.at(want, ids.reshape(-1), g.astype(dt).reshape(-1, 64))
    for _ in range(5):
        w = Tensor(backend.from_host(np.zeros((10, 64))).astype(dt), requires_grad=True)
        embedding(w, backend.from_host(ids)).backward(backend.from_host(g).astype(dt))
        np.testing.assert_array_equal(backend.to_host(w.grad), want)
