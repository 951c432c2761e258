"""The LayerNorm CUDA kernels (minidist/model/ops/cuda/layernorm.py) against the formulas' xp form.

On the CPU the source runs under tests/cuda_on_cpu.py on NumPy arrays; where nvcc exists it
also compiles for an H100.  On CuPy (make test-gpu, or the emulator) layer_norm's values and
gradients with the kernels equal those without them.
"""

from __future__ import annotations

import numpy as np
import pytest

from minidist.model import backend
from minidist.model.backend import BACKEND
from minidist.model.ops.cuda import layernorm as ln, source

import cuda_on_cpu  # noqa: E402  (tests/cuda_on_cpu.py)

on_numpy = pytest.mark.skipif(BACKEND != "numpy" or cuda_on_cpu.compiler() is None,
                              reason="the CPU emulation of the kernels runs on NumPy arrays, with a C++ compiler")


def emulated(real: str, threads: int) -> dict:
    module = cuda_on_cpu.Module(ln.SOURCE, {"REAL": real, "THREADS": str(threads)})
    return {name: (lambda grid, block, args, name=name: module.launch(name, grid, block[0], args))
            for name in ln.KERNELS}


def reference(x, w, b, g, eps):
    """nn_ops.layer_norm's whole-array lines, in NumPy."""
    xc = x - x.mean(axis=-1, keepdims=True)
    rstd = 1.0 / np.sqrt((xc * xc).mean(axis=-1, keepdims=True) + eps)
    xhat = xc * rstd
    gh = g * w
    dx = rstd * (gh - gh.mean(axis=-1, keepdims=True) - xhat * (gh * xhat).mean(axis=-1, keepdims=True))
    return xhat, xhat * w + b, rstd[:, 0], dx


@on_numpy
@pytest.mark.parametrize("dtype, real, tol", [(np.float64, "double", 1e-13), (np.float32, "float", 1e-5)])
@pytest.mark.parametrize("rows, C", [(9, 13), (3, 2), (5, 40)])  # rows shorter and longer than the block
def test_kernels_equal_the_reference(monkeypatch, dtype, real, tol, rows, C):
    monkeypatch.setattr(ln, "THREADS", 8)
    monkeypatch.setattr(source, "GRID_X", 4)  # several grid rows, the last partly idle
    rng = np.random.default_rng(0)
    x, g = (rng.standard_normal((rows, C)).astype(dtype) * 3 + 1 for _ in range(2))
    w, b = (rng.standard_normal(C).astype(dtype) for _ in range(2))
    kernels = emulated(real, 8)
    xhat, y, rstd = ln.forward(x, w, b, 1e-5, kernels=kernels)
    dx = ln.backward(g, w, xhat, rstd, kernels=kernels)
    for name, got, want in zip(("xhat", "y", "rstd", "dx"), (xhat, y, rstd, dx), reference(x, w, b, g, 1e-5)):
        assert got.dtype == dtype and got.shape == want.shape, name
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=name)


@on_numpy
def test_bfloat16_rows_in_and_out(monkeypatch):
    """Mixed precision: bf16 rows in, y in bf16 (the float32 y rounded once, to nearest even),
    xhat and rstd in float32; backward takes g in float32 and writes dx rounded to bf16."""
    monkeypatch.setattr(ln, "THREADS", 8)
    bf16 = backend.bfloat16
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((6, 19)) * 3 + 1).astype(bf16)
    g = rng.standard_normal((6, 19)).astype(np.float32)
    w, b = (rng.standard_normal(19).astype(np.float32) for _ in range(2))
    kernels = emulated("float", 8)
    xhat, y, rstd = ln.forward(x, w, b, 1e-5, kernels=kernels)
    assert (xhat.dtype, y.dtype, rstd.dtype) == (np.float32, bf16, np.float32)
    xhat32, y32, rstd32 = ln.forward(x.astype(np.float32), w, b, 1e-5, kernels=kernels)
    np.testing.assert_array_equal(xhat, xhat32)
    np.testing.assert_array_equal(rstd, rstd32)
    np.testing.assert_array_equal(y.view(np.uint16), y32.astype(bf16).view(np.uint16))
    dx = ln.backward(g, w, xhat, rstd, bf16, kernels=kernels)
    assert dx.dtype == bf16
    dx32 = ln.backward(g, w, xhat, rstd, kernels=kernels)
    np.testing.assert_array_equal(dx.view(np.uint16), dx32.astype(bf16).view(np.uint16))
    want = reference(x.astype(np.float32), w, b, g, 1e-5)
    np.testing.assert_allclose(dx32, want[3], rtol=1e-5, atol=1e-5)
    assert ln.backward(g, w, xhat, rstd, np.float16, kernels=kernels).dtype == np.float32  # only bf16 is narrowed


@cuda_on_cpu.needs_cuda_compiler
@pytest.mark.parametrize("real", ["float", "double"])
def test_source_compiles_for_an_h100(tmp_path, real):
    assert cuda_on_cpu.cuda_entries(ln.SOURCE, {"REAL": real, "THREADS": ln.THREADS}, tmp_path) == sorted(ln.KERNELS)


@pytest.mark.skipif(BACKEND != "cupy", reason="the compiled kernels run under MINIDIST_BACKEND=cupy (make test-gpu)")
def test_layer_norm_equals_with_and_without_the_kernels(monkeypatch):
    from minidist.model.autograd import Parameter, Tensor
    from minidist.model.ops import layer_norm

    rng = np.random.default_rng(1)
    x0, g0 = rng.standard_normal((2, 7, 48)), rng.standard_normal((2, 7, 48))
    w0, b0 = rng.standard_normal(48), rng.standard_normal(48)
    out = {}
    for mode in ("auto", "off"):
        monkeypatch.setenv("MINIDIST_CUDA_KERNELS", mode)
        x = Tensor(backend.from_host(x0), requires_grad=True)
        w, b = Parameter(backend.from_host(w0)), Parameter(backend.from_host(b0))
        assert (ln.why_not(x.data.reshape(-1, 48), w.data, b.data) is None) == (mode == "auto")
        y = layer_norm(x, w, b)
        y.backward(backend.from_host(g0))
        out[mode] = [backend.to_host(a) for a in (y.data, x.grad, w.grad, b.grad)]
    for name, a, b in zip(("y", "dx", "dw", "db"), out["auto"], out["off"]):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12, err_msg=name)


@pytest.mark.skipif(BACKEND != "cupy" or backend.bfloat16 is None,
                    reason="the compiled kernels run under MINIDIST_BACKEND=cupy (make test-gpu), with bfloat16")
def test_bfloat16_layer_norm_equals_with_and_without_the_kernels(monkeypatch):
    """bf16 activations with float32 parameters, as under mixed precision: the kernels read and
    write bf16 and give what the xp form's casts around its float32 arithmetic give."""
    from minidist.model.autograd import Parameter, Tensor
    from minidist.model.ops import layer_norm

    rng = np.random.default_rng(2)
    x0, g0 = rng.standard_normal((2, 7, 48)) * 3, rng.standard_normal((2, 7, 48))
    w0, b0 = rng.standard_normal(48), rng.standard_normal(48)
    out = {}
    for mode in ("auto", "off"):
        monkeypatch.setenv("MINIDIST_CUDA_KERNELS", mode)
        x = Tensor(backend.from_host(x0).astype(backend.bfloat16), requires_grad=True)
        w, b = (Parameter(backend.from_host(a).astype(np.float32)) for a in (w0, b0))
        y = layer_norm(x, w, b)
        assert y.dtype == backend.bfloat16
        y.backward(backend.from_host(g0).astype(backend.bfloat16))
        assert x.grad.dtype == backend.bfloat16 and w.grad.dtype == np.float32
        out[mode] = [backend.to_host(a.astype(np.float64)) for a in (y.data, x.grad, w.grad, b.grad)]
    for name, a, b in zip(("y", "dx", "dw", "db"), out["auto"], out["off"]):
        np.testing.assert_allclose(a, b, rtol=2e-2, atol=2e-2, err_msg=name)
