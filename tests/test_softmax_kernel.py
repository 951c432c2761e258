"""The causal softmax CUDA kernel (minidist/model/ops/cuda/softmax.py) against the xp reference.

No GPU is needed: the kernel source runs on the CPU under tests/cuda_on_cpu.py, called through
cuda.softmax.softmax itself; where nvcc exists the source also compiles for an H100 (sm_90).
On CuPy (make test-gpu, or the emulator) the compiled kernel is compared too.
"""

from __future__ import annotations

import numpy as np
import pytest

from minidist.model import backend
from minidist.model.backend import BACKEND
from minidist.model.ops import cuda

import cuda_on_cpu  # noqa: E402  (tests/cuda_on_cpu.py)

on_numpy = pytest.mark.skipif(BACKEND != "numpy", reason="the CPU emulation of the kernel runs on NumPy arrays")
needs_cxx = pytest.mark.skipif(cuda_on_cpu.compiler() is None, reason="no C++ compiler to run CUDA kernels on the CPU")


def reference(s, causal):
    """The xp form the kernel replaces (NumPy): the mask of attention.causal_mask, the row max,
    exp of the shifted scores, divided by their sum."""
    x = s + np.triu(np.full(s.shape[-2:], -np.inf, dtype=s.dtype), k=1) if causal else s.copy()
    p = np.exp(x - x.max(axis=-1, keepdims=True))
    return p / p.sum(axis=-1, keepdims=True)


def emulated(real: str, threads: int) -> dict:
    module = cuda_on_cpu.Module(cuda.softmax.SOURCE, {"REAL": real, "THREADS": str(threads)})
    return {name: (lambda grid, block, args, name=name: module.launch(name, grid, block[0], args))
            for name in cuda.softmax.KERNELS}


@on_numpy
@needs_cxx
@pytest.mark.parametrize("dtype, tol", [(np.float64, 1e-14), (np.float32, 2e-7)])
@pytest.mark.parametrize("shape, causal", [
    ((2, 3, 13, 13), True),   # self-attention; rows longer than the block's 4 threads
    ((2, 9, 14), False),      # cross shapes, no mask
    ((1, 1, 5, 7), True),     # more keys than queries: top-left aligned, as causal_mask
    ((3, 2, 2), True),        # rows shorter than the block
])
def test_kernel_equals_the_reference(monkeypatch, dtype, tol, shape, causal):
    monkeypatch.setattr(cuda.softmax, "THREADS", 4)
    monkeypatch.setattr(cuda.source, "GRID_X", 7)  # several grid rows, the last one partly idle
    s = np.random.default_rng(0).standard_normal(shape).astype(dtype) * 4
    got = cuda.softmax.softmax(s, causal, kernels=emulated("double" if dtype == np.float64 else "float", 4))
    want = reference(s, causal)
    assert got.dtype == dtype and got.shape == s.shape
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    if causal:  # above the diagonal: exact zeros, written without reading the scores there
        assert not np.triu(got[..., :, :], k=1).any()


@on_numpy
@needs_cxx
@pytest.mark.parametrize("causal", [True, False])
def test_bfloat16_scores_give_p_in_bfloat16_and_their_rows_statistics(monkeypatch, causal):
    """Mixed precision: bf16 scores in, P rounded to bf16 exactly as astype rounds the float32
    P of the widened scores (to nearest even), and for backward the scores themselves with
    each row's maximum and sum of exp(s - max) over the keys it sees."""
    monkeypatch.setattr(cuda.softmax, "THREADS", 4)
    bf16 = backend.bfloat16
    s = (np.random.default_rng(2).standard_normal((2, 3, 9, 9)) * 4).astype(bf16)
    rows, p_low = cuda.softmax.softmax(s, causal, kernels=emulated("float", 4))
    assert isinstance(rows, cuda.softmax.Rows) and rows.s is s and p_low.dtype == bf16
    p32 = cuda.softmax.softmax(s.astype(np.float32), causal, kernels=emulated("float", 4))
    np.testing.assert_array_equal(p_low.view(np.uint16), p32.astype(bf16).view(np.uint16))
    np.testing.assert_allclose(p_low.astype(np.float32), reference(s.astype(np.float32), causal), rtol=1e-2, atol=1e-6)
    x = s.astype(np.float64).reshape(-1, 9)
    if causal:
        x = np.where(np.triu(np.ones((9, 9), bool), k=1)[np.arange(x.shape[0]) % 9], -np.inf, x)
    m = x.max(axis=1)
    assert rows.stats.dtype == np.float32 and rows.stats.shape == (x.shape[0], 2)
    np.testing.assert_array_equal(rows.stats[:, 0], m.astype(np.float32))
    np.testing.assert_allclose(rows.stats[:, 1], np.exp(x - m[:, None]).sum(axis=1), rtol=1e-6)


def reference_grad(dp, p):
    """The softmax's gradient as attention's xp form computes it: dS = P * (dP - delta), here
    with delta = rowsum(P * dP) (equal to the rowsum(dO * O) that attention uses)."""
    return p * (dp - (p * dp).sum(axis=-1, keepdims=True))


@on_numpy
@needs_cxx
@pytest.mark.parametrize("dtype, tol", [(np.float64, 1e-13), (np.float32, 1e-6)])
@pytest.mark.parametrize("shape, causal", [((2, 3, 13, 13), True), ((2, 9, 14), False), ((1, 1, 5, 7), True),
                                           ((3, 2, 2), True)])
def test_gradient_kernel_equals_the_reference(monkeypatch, dtype, tol, shape, causal):
    monkeypatch.setattr(cuda.softmax, "THREADS", 4)
    monkeypatch.setattr(cuda.source, "GRID_X", 7)
    rng = np.random.default_rng(3)
    p = reference(rng.standard_normal(shape).astype(dtype) * 4, causal)
    dp = rng.standard_normal(shape).astype(dtype)
    got = cuda.softmax.softmax_grad(dp, p, causal, kernels=emulated("double" if dtype == np.float64 else "float", 4))
    assert got.dtype == dtype and got.shape == shape
    np.testing.assert_allclose(got, reference_grad(dp, p), rtol=tol, atol=tol)
    if causal:  # dS is exactly 0 where P is, whatever dP holds there
        dp_nan = np.where(np.triu(np.ones(shape[-2:], bool), k=1), np.nan, dp)
        got = cuda.softmax.softmax_grad(dp_nan, p, causal, kernels=emulated("float", 4) if dtype == np.float32
                                        else emulated("double", 4))
        np.testing.assert_allclose(got, reference_grad(dp, p), rtol=tol, atol=tol)


@on_numpy
@needs_cxx
@pytest.mark.parametrize("causal", [True, False])
def test_bfloat16_gradient_recomputes_p_with_the_forwards_bits(monkeypatch, causal):
    """Mixed precision: dP in bf16 and the forward's Rows (bf16 scores, row statistics) in, dS
    in bf16 out.  The recomputed P is the float32 P of the widened scores bit for bit, so dS is
    the float32 kernel's result on (widened dP, that P) rounded once (to nearest even)."""
    monkeypatch.setattr(cuda.softmax, "THREADS", 4)
    monkeypatch.setattr(cuda.source, "GRID_X", 7)
    kernels = emulated("float", 4)
    bf16 = backend.bfloat16
    rng = np.random.default_rng(4)
    s = (rng.standard_normal((2, 3, 9, 9)) * 4).astype(bf16)
    dp = rng.standard_normal((2, 3, 9, 9)).astype(bf16)
    rows, p_low = cuda.softmax.softmax(s, causal, kernels=kernels)
    ds = cuda.softmax.softmax_grad(dp, rows, causal, kernels=kernels)
    assert ds.dtype == bf16
    p = cuda.softmax.softmax(s.astype(np.float32), causal, kernels=kernels)
    ds32 = cuda.softmax.softmax_grad(dp.astype(np.float32), p, causal, kernels=kernels)
    np.testing.assert_array_equal(ds.view(np.uint16), ds32.astype(bf16).view(np.uint16))
    np.testing.assert_allclose(ds.astype(np.float32), reference_grad(dp.astype(np.float32), p), rtol=1e-2, atol=1e-6)
    if causal:  # the scores and dP above the diagonal are never read
        hidden = np.triu(np.ones((9, 9), bool), k=1)
        s_nan, dp_nan = (np.where(hidden, np.nan, a.astype(np.float32)).astype(bf16) for a in (s, dp))
        rows_nan, p_low_nan = cuda.softmax.softmax(s_nan, causal, kernels=kernels)
        np.testing.assert_array_equal(rows_nan.stats, rows.stats)
        np.testing.assert_array_equal(p_low_nan.view(np.uint16), p_low.view(np.uint16))
        got = cuda.softmax.softmax_grad(dp_nan, rows_nan, causal, kernels=kernels)
        np.testing.assert_array_equal(got.view(np.uint16), ds.view(np.uint16))


def test_gradient_refuses_mismatched_inputs():
    p = np.zeros((2, 4, 4), np.float32)
    with pytest.raises(ValueError, match=r"dP shape \(2, 4, 5\) != P shape \(2, 4, 4\)"):
        cuda.softmax.softmax_grad(np.zeros((2, 4, 5), np.float32), p, True, kernels={})
    with pytest.raises(ValueError, match="P of dtype float64 with dP of dtype float32"):
        cuda.softmax.softmax_grad(p, p.astype(np.float64), True, kernels={})
    if backend.bfloat16 is not None:  # bfloat16 dP takes the forward's Rows, not a float32 P
        with pytest.raises(ValueError, match="P of dtype float32 with dP of dtype bfloat16"):
            cuda.softmax.softmax_grad(p.astype(backend.bfloat16), p, True, kernels={})
        rows = cuda.softmax.Rows(p.astype(backend.bfloat16), np.zeros((8, 2), np.float32))
        with pytest.raises(ValueError, match="the Rows of bfloat16 scores with dP of dtype float32"):
            cuda.softmax.softmax_grad(p, rows, True, kernels={})


@cuda_on_cpu.needs_cuda_compiler
@pytest.mark.parametrize("real", ["float", "double"])
def test_source_compiles_for_an_h100(tmp_path, real):
    defines = {"REAL": real, "THREADS": cuda.softmax.THREADS}
    assert cuda_on_cpu.cuda_entries(cuda.softmax.SOURCE, defines, tmp_path) == sorted(cuda.softmax.KERNELS)


@pytest.mark.skipif(BACKEND != "cupy", reason="the compiled kernel runs under MINIDIST_BACKEND=cupy (make test-gpu)")
@pytest.mark.parametrize("dtype, tol", [("float64", 1e-14), ("float32", 2e-7)])
def test_compiled_kernel_equals_the_reference(dtype, tol):
    s = np.random.default_rng(1).standard_normal((2, 3, 200, 200)).astype(dtype) * 4
    assert cuda.softmax.why_not(backend.from_host(s)) is None
    for causal in (True, False):
        got = backend.to_host(cuda.softmax.softmax(backend.from_host(s), causal))
        np.testing.assert_allclose(got, reference(s, causal), rtol=tol, atol=tol)
    if dtype == "float32":  # bf16 scores: P in bf16 and the Rows, from one kernel
        low = backend.from_host(s).astype(backend.bfloat16)
        rows, p_low = cuda.softmax.softmax(low, True)
        p32 = cuda.softmax.softmax(low.astype(np.float32), True)
        np.testing.assert_array_equal(backend.to_host(p_low.view("uint16")),
                                      backend.to_host(p32.astype(backend.bfloat16).view("uint16")))
    p = reference(s, True)
    dp = np.random.default_rng(5).standard_normal(s.shape).astype(dtype)
    got = cuda.softmax.softmax_grad(backend.from_host(dp), backend.from_host(p), True)
    np.testing.assert_allclose(backend.to_host(got), reference_grad(dp, p), rtol=tol * 10, atol=tol * 10)
    if dtype == "float32":  # bf16 dP: dS in bf16, the float32 kernel's result on the same P rounded
        low = backend.from_host(dp).astype(backend.bfloat16)
        got = cuda.softmax.softmax_grad(low, rows, True)
        want = cuda.softmax.softmax_grad(low.astype(np.float32), p32, True).astype(backend.bfloat16)
        np.testing.assert_array_equal(backend.to_host(got.view("uint16")), backend.to_host(want.view("uint16")))
