"""The GELU CUDA kernels (minidist/model/ops/cuda/gelu.py) against nn_ops' xp form.

On the CPU the source runs under tests/cuda_on_cpu.py on NumPy arrays; where nvcc exists it
also compiles for an H100.  On CuPy (make test-gpu, or the emulator) gelu's values and
gradients with the kernels equal those without them, bfloat16 included.
"""

from __future__ import annotations

import numpy as np
import pytest

from minidist.model import backend
from minidist.model.backend import BACKEND
from minidist.model.ops import cuda, nn_ops

import cuda_on_cpu  # noqa: E402  (tests/cuda_on_cpu.py)

on_numpy = pytest.mark.skipif(BACKEND != "numpy" or cuda_on_cpu.compiler() is None,
                              reason="the CPU emulation of the kernels runs on NumPy arrays, with a C++ compiler")
C, A = nn_ops._GELU_C, nn_ops._GELU_A


def emulated(real: str) -> dict:
    module = cuda_on_cpu.Module(cuda.gelu.SOURCE, {"REAL": real, "GELU_C": repr(C), "GELU_A": repr(A)})
    return {name: (lambda grid, block, args, name=name: module.launch(name, grid, block[0], args))
            for name in cuda.gelu.KERNELS}


def reference(x, g):
    """nn_ops' fused forms unfused (``.plain``), in x's dtype (float32 for bfloat16)."""
    y, t = nn_ops._gelu_forward.plain(x)
    return y, nn_ops._gelu_backward.plain(x, t, g)


@on_numpy
@pytest.mark.parametrize("dtype, real, tol", [(np.float64, "double", 1e-13), (np.float32, "float", 1e-5)])  # tanh near -1: cancellation
@pytest.mark.parametrize("shape", [(3, 5, 7), (1,), (2, 700)])  # one block; several, the grid striding
def test_kernels_equal_the_reference(monkeypatch, dtype, real, tol, shape):
    monkeypatch.setattr(cuda.gelu, "THREADS", 8)
    monkeypatch.setattr(cuda.gelu, "BLOCKS", 5)  # 40 threads stride over 1400 elements
    rng = np.random.default_rng(0)
    x, g = (rng.standard_normal(shape).astype(dtype) * 3 for _ in range(2))
    kernels = emulated(real)
    y, dx = cuda.gelu.forward(x, C, A, kernels=kernels), cuda.gelu.backward(x, g, C, A, kernels=kernels)
    for name, got, want in zip(("y", "dx"), (y, dx), reference(x, g)):
        assert got.dtype == dtype and got.shape == shape, name
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=name)


@on_numpy
def test_bfloat16_in_and_out_is_the_float32_result_rounded():
    """bf16 x and g in, bf16 out: the float32 kernel's result on the widened inputs, rounded
    once to nearest even, as nn_ops' cast after its float32 arithmetic."""
    bf16 = backend.bfloat16
    rng = np.random.default_rng(1)
    x, g = (rng.standard_normal((4, 33)).astype(bf16) for _ in range(2))
    kernels = emulated("float")
    y, dx = cuda.gelu.forward(x, C, A, kernels=kernels), cuda.gelu.backward(x, g, C, A, kernels=kernels)
    assert y.dtype == dx.dtype == bf16
    y32 = cuda.gelu.forward(x.astype(np.float32), C, A, kernels=kernels)
    dx32 = cuda.gelu.backward(x.astype(np.float32), g.astype(np.float32), C, A, kernels=kernels)
    np.testing.assert_array_equal(y.view(np.uint16), y32.astype(bf16).view(np.uint16))
    np.testing.assert_array_equal(dx.view(np.uint16), dx32.astype(bf16).view(np.uint16))
    want = reference(x.astype(np.float32), g.astype(np.float32))
    np.testing.assert_allclose(y.astype(np.float32), want[0], rtol=1e-2, atol=1e-6)
    np.testing.assert_allclose(dx.astype(np.float32), want[1], rtol=1e-2, atol=1e-6)


def test_backward_refuses_a_gradient_of_another_shape():
    with pytest.raises(ValueError, match=r"gradient shape \(3,\) != input shape \(4,\)"):
        cuda.gelu.backward(np.zeros(4), np.zeros(3), C, A, kernels={})


@cuda_on_cpu.needs_cuda_compiler
@pytest.mark.parametrize("real", ["float", "double"])
def test_source_compiles_for_an_h100(tmp_path, real):
    defines = {"REAL": real, "GELU_C": repr(C), "GELU_A": repr(A)}
    assert cuda_on_cpu.cuda_entries(cuda.gelu.SOURCE, defines, tmp_path) == sorted(cuda.gelu.KERNELS)


@pytest.mark.skipif(BACKEND != "cupy", reason="the compiled kernels run under MINIDIST_BACKEND=cupy (make test-gpu)")
@pytest.mark.parametrize("dtype, tol", [("float64", 1e-13), ("float32", 1e-5), ("bfloat16", 1e-2)])
def test_gelu_equals_with_and_without_the_kernels(monkeypatch, dtype, tol):
    from minidist.model.autograd import Tensor
    from minidist.model.ops import gelu

    if dtype == "bfloat16" and backend.bfloat16 is None:
        pytest.skip("no bfloat16 here (ml_dtypes)")
    dt = backend.dtype(dtype)
    rng = np.random.default_rng(2)
    x0, g0 = rng.standard_normal((2, 7, 96)) * 3, rng.standard_normal((2, 7, 96))
    out = {}
    for mode in ("auto", "off"):
        monkeypatch.setenv("MINIDIST_CUDA_KERNELS", mode)
        x = Tensor(backend.from_host(x0).astype(dt), requires_grad=True)
        assert (cuda.gelu.why_not(x.data) is None) == (mode == "auto")
        y = gelu(x)
        assert y.dtype == dt
        y.backward(backend.from_host(g0).astype(dt))
        assert x.grad.dtype == dt
        out[mode] = [backend.to_host(a.astype(backend.xp.float64)) for a in (y.data, x.grad)]
    for name, a, b in zip(("y", "dx"), out["auto"], out["off"]):
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol, err_msg=name)
