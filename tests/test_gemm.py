"""minidist.model.ops.cuda.gemm: the strided batched GEMM's arguments, checked on the CPU against a NumPy
model of cuBLAS's call, and (on a GPU) cuBLAS's bfloat16 product against float32."""

import ctypes
import sys
import types

import numpy as np
import pytest
from numpy.lib.stride_tricks import as_strided

from minidist.model import backend
from minidist.model.ops.cuda import gemm

RNG = np.random.default_rng(0)


def numpy_gemm(transa, transb, m, n, k, A, lda, sa, B, ldb, sb, C, ldc, sc, batch):
    """What cublasGemmStridedBatchedEx computes, on NumPy views of the same memory: column-major
    matrices at A + i * sa (ld lda), op() transposing when the flag is set, A, B and C given as
    (array, offset in elements from its first element) pairs.  cuBLAS's own argument checks
    come first (a wrong leading dimension is an error there)."""
    assert transa in (0, 1) and transb in (0, 1) and min(m, n, k, batch) >= 1
    assert lda >= max(1, k if transa else m) and ldb >= max(1, n if transb else k) and ldc >= max(1, m)
    assert min(A[1], B[1], C[1]) >= 0
    assert not (np.may_share_memory(C[0], A[0]) or np.may_share_memory(C[0], B[0])), "C aliases an operand"

    def col_major(X, rows, cols, ld, stride):
        (X, offset), it = X, X[0].itemsize
        start = as_strided(X, shape=(offset + 1,), strides=(it,))[offset:]  # the memory from that element on
        return as_strided(start, shape=(batch, rows, cols), strides=(stride * it, it, ld * it))

    a = col_major(A, k, m, lda, sa).swapaxes(-1, -2) if transa else col_major(A, m, k, lda, sa)
    b = col_major(B, n, k, ldb, sb).swapaxes(-1, -2) if transb else col_major(B, k, n, ldb, sb)
    c = col_major(C, m, n, ldc, sc)
    c[...] = a.astype(c.dtype) @ b.astype(c.dtype)  # accumulated in C's dtype


def rand(*shape):
    return RNG.standard_normal(shape)


CASES = {
    "contiguous": lambda: (rand(2, 3, 4, 5), rand(2, 3, 5, 6)),
    "q @ k^T (a transposed view)": lambda: (rand(2, 3, 7, 5), rand(2, 3, 7, 5).swapaxes(-1, -2)),
    "p^T @ do": lambda: (rand(2, 3, 7, 7).swapaxes(-1, -2), rand(2, 3, 7, 5)),
    "tiles: rows of q, columns of k^T": lambda: (rand(2, 3, 9, 5)[..., 2:6, :],
                                                 rand(2, 3, 9, 5)[..., 1:8, :].swapaxes(-1, -2)),
    "a 2-d right operand (stride 0)": lambda: (rand(2, 3, 4, 5), rand(5, 6)),
    "batch dims of size 1 broadcast": lambda: (rand(1, 3, 4, 5), rand(2, 3, 5, 6)),
    "batch dims that do not collapse (copied)": lambda: (rand(4, 3, 4, 5)[::2], rand(2, 3, 5, 6)),
    "reversed rows (copied)": lambda: (rand(2, 4, 5)[:, ::-1, :], rand(2, 5, 3)),
    "single row and column": lambda: (rand(3, 1, 5), rand(3, 5, 1)),
    "one matrix": lambda: (rand(1, 4, 5), rand(1, 5, 6)),
    "heads of a fused QKV (batch axes that do not collapse)": lambda: _qkv_heads(),
}


def _qkv_heads(B=2, T=5, H=3, D=4):
    """Q and K^T of every (batch, head) as views into one (B, T, 3C) projection, as attention
    takes them: head stride D, batch stride T * 3C."""
    X = rand(B, T, 3 * H * D)

    def heads(part):
        return X[..., part * H * D:(part + 1) * H * D].reshape(B, T, H, D).transpose(0, 2, 1, 3)
    return heads(0), heads(1).swapaxes(-1, -2)


@pytest.mark.parametrize("case", list(CASES))
def test_strided_batched_arguments_give_matmul(case, monkeypatch):
    monkeypatch.setattr(gemm, "xp", np)
    a, b = CASES[case]()
    got = gemm.strided_batched(a, b, numpy_gemm)
    np.testing.assert_allclose(got, np.matmul(a, b), rtol=1e-13, atol=1e-13)


def test_head_views_loop_over_the_batch_axis_only(monkeypatch):
    """Heads of a fused QKV: one call per batch element (the head axis stays a cuBLAS batch)."""
    monkeypatch.setattr(gemm, "xp", np)
    calls = []
    q, kt = _qkv_heads(B=2, H=3)
    gemm.strided_batched(q, kt, lambda *args: calls.append(args[-1]) or numpy_gemm(*args))
    assert calls == [3, 3]


def test_a_plan_is_made_once_per_layout_and_keeps_no_data(monkeypatch):
    """The calls' arguments depend on the operands' layouts only: the second and third products
    of the same layouts reuse the first's plan, on new arrays, with the right results."""
    monkeypatch.setattr(gemm, "xp", np)
    gemm._plan.cache_clear()
    for _ in range(3):
        q, kt = _qkv_heads(B=3, H=2)
        offsets = []
        got = gemm.strided_batched(q, kt, lambda *args: offsets.append((args[5][1], args[8][1])) or numpy_gemm(*args))
        np.testing.assert_allclose(got, q @ kt, rtol=1e-13, atol=1e-13)
        # a batch element's K^T (cuBLAS's A: the operands are swapped) and Q start T * 3C further on
        assert offsets == [(b * 5 * 3 * 2 * 4, b * 5 * 3 * 2 * 4) for b in range(3)]
    info = gemm._plan.cache_info()
    assert (info.misses, info.hits) == (1, 2)


@pytest.mark.parametrize("layout", ["heads of a (B, T, C) output", "transposed (copied back)", "contiguous"])
def test_out_receives_the_product(layout, monkeypatch):
    monkeypatch.setattr(gemm, "xp", np)
    B, T, H, D = 2, 5, 3, 4
    p, v = rand(B, H, T, T), rand(B, H, T, D)
    if layout == "heads of a (B, T, C) output":
        Y = np.full((B, T, H * D), np.nan)
        out = Y.reshape(B, T, H, D).transpose(0, 2, 1, 3)
    elif layout == "transposed (copied back)":
        out = np.full((B, H, D, T), np.nan).swapaxes(-1, -2)
    else:
        out = np.full((B, H, T, D), np.nan)
    got = gemm.strided_batched(p, v, numpy_gemm, out=out)
    assert got is out
    np.testing.assert_allclose(out, p @ v, rtol=1e-13, atol=1e-13)


def test_out_that_is_an_operand_gets_the_product(monkeypatch):
    """cuBLAS's C must not alias A or B: an out= that is an operand is written after the product."""
    monkeypatch.setattr(gemm, "xp", np)
    a, b = rand(2, 4, 4), rand(2, 4, 4)
    want = a @ b
    assert gemm.strided_batched(a, b, numpy_gemm, out=a) is a
    np.testing.assert_allclose(a, want, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("case", ["contiguous", "p^T @ do", "a 2-d right operand (stride 0)", "one matrix"])
def test_a_float32_product_of_float16_operands(case, monkeypatch):
    """dtype=float32 with 16-bit operands: C is float32 (what mixed precision's gradients use:
    the float32 accumulator written out, not rounded to 16 bits first)."""
    monkeypatch.setattr(gemm, "xp", np)
    a, b = (x.astype(np.float16) for x in CASES[case]())
    got = gemm.strided_batched(a, b, numpy_gemm, dtype=np.float32)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, a.astype(np.float32) @ b.astype(np.float32), rtol=1e-6, atol=1e-6)
    out = np.full(got.shape[:-2] + got.shape[:-3:-1], np.nan, np.float32).swapaxes(-1, -2)  # not writable by C
    assert gemm.strided_batched(a, b, numpy_gemm, out=out, dtype=np.float32) is out
    np.testing.assert_array_equal(out, got)


def test_a_2d_weight_gradient_as_a_column_major_product(monkeypatch):
    """linear's dW = x^T dY: a transposed 2-d view times a 2-d array, one call, no copy."""
    monkeypatch.setattr(gemm, "xp", np)
    x, g = rand(9, 4), rand(9, 6)
    calls = []
    got = gemm.strided_batched(x.T, g, lambda *args: calls.append(args[:2]) or numpy_gemm(*args))
    np.testing.assert_allclose(got, x.T @ g, rtol=1e-13, atol=1e-13)
    assert calls == [(0, 1)]  # C^T = g^T (x^T)^T: g as it is, x^T's storage flagged transposed


class _HostArray:
    """A NumPy array dressed as a CuPy one for ``_cublas_gemm``: its address as ``data.ptr``."""

    def __init__(self, a):
        self.a, self.dtype, self.itemsize = a, a.dtype, a.itemsize
        self.data = types.SimpleNamespace(ptr=a.ctypes.data)


def _cublas_on_the_host(calls):
    """Stand-ins for the modules ``_cublas_gemm`` imports: a cuBLAS whose gemmStridedBatchedEx
    reads its arguments as cuBLAS does (addresses, CUDA data types, alpha and beta behind
    pointers) and multiplies in host memory."""
    kinds = {"float16": 2, "float32": 0, "float64": 1}
    cublas = types.SimpleNamespace(CUBLAS_COMPUTE_64F=70, CUBLAS_COMPUTE_32F=68, CUBLAS_COMPUTE_32F_FAST_TF32=77,
                                   CUBLAS_GEMM_DEFAULT=-1)
    runtime = types.SimpleNamespace(CUDA_R_16F=2, CUDA_R_32F=0, CUDA_R_64F=1, CUDA_R_16BF=14)
    device = types.SimpleNamespace(get_cublas_handle=lambda: "handle")

    def memory(ptr, kind, trans, rows, cols, ld, stride, batch):
        """The host memory at ``ptr`` that a (rows x cols, op() applied) batch spans, as
        numpy_gemm's (array, offset) pair."""
        dt = np.dtype({v: k for k, v in kinds.items()}[kind])
        rows, cols = (cols, rows) if trans else (rows, cols)  # as stored
        n = (batch - 1) * stride + (cols - 1) * ld + rows
        return np.frombuffer((ctypes.c_char * (n * dt.itemsize)).from_address(ptr), dtype=dt), 0

    def gemm_ex(handle, transa, transb, m, n, k, alpha, A, ta_kind, lda, sa, B, tb_kind, ldb, sb, beta, C, tc_kind,
                ldc, sc, batch, compute, algo):
        assert handle == "handle" and algo == -1 and ta_kind == tb_kind
        scalar = ctypes.c_double if compute == 70 else ctypes.c_float
        assert (scalar.from_address(alpha).value, scalar.from_address(beta).value) == (1, 0)
        numpy_gemm(transa, transb, m, n, k, memory(A, ta_kind, transa, m, k, lda, sa, batch), lda, sa,
                   memory(B, tb_kind, transb, k, n, ldb, sb, batch), ldb, sb,
                   memory(C, tc_kind, 0, m, n, ldc, sc, batch), ldc, sc, batch)
        calls.append(compute)

    cublas.gemmStridedBatchedEx = gemm_ex
    return {"cupy": types.ModuleType("cupy"), "cupy.cuda": types.SimpleNamespace(device=device, runtime=runtime),
            "cupy_backends": types.ModuleType("cupy_backends"), "cupy_backends.cuda": types.ModuleType("c"),
            "cupy_backends.cuda.libs": types.SimpleNamespace(cublas=cublas)}


@pytest.mark.parametrize("case", list(CASES))
def test_the_cublas_call_reads_the_operands_at_their_addresses(case, monkeypatch):
    """``_cublas_gemm`` itself, on a stand-in cuBLAS that reads host memory at the addresses it
    is given: each matrix's address (the array's plus its offset), the data types, the compute
    type and alpha and beta make the product, in float64 and float32, and float16 into float32."""
    monkeypatch.setattr(gemm, "xp", np)
    monkeypatch.setattr(gemm, "_constants", {})
    calls = []
    for name, module in _cublas_on_the_host(calls).items():
        monkeypatch.setitem(sys.modules, name, module)

    def on_the_host(*args):
        return gemm._cublas_gemm(*(( _HostArray(x[0]), x[1]) if isinstance(x, tuple) else x for x in args))

    for dt, out, compute in [(np.float64, None, 70), (np.float32, None, 68), (np.float16, np.float32, 68)]:
        a, b = (x.astype(dt) for x in CASES[case]())
        calls.clear()
        got = gemm.strided_batched(a, b, on_the_host, dtype=out)
        want = a.astype(np.float64) @ b.astype(np.float64)
        np.testing.assert_allclose(got, want, rtol=1e-12 if dt == np.float64 else 1e-5, atol=1e-5)
        assert calls and set(calls) == {compute}


class _NoBatched16:
    """NumPy as gemm's xp, except that matmul refuses batched 16-bit operands (CuPy 14 with
    bfloat16)."""

    def __getattr__(self, name):
        return getattr(np, name)

    @staticmethod
    def matmul(a, b, out=None):
        if max(a.ndim, b.ndim) > 2 and a.dtype.itemsize == 2:
            raise TypeError("batched 16-bit matmul")
        return np.matmul(a, b, out=out)


def test_with_the_switch_off_a_float32_batched_product_still_multiplies_16_bit_on_cublas(monkeypatch):
    """MINIDIST_CUBLAS_BATCHED=off: a float32 product of batched 16-bit operands is their
    product (cuBLAS, since the array library cannot batch them) cast to float32."""
    monkeypatch.setattr(gemm, "xp", _NoBatched16())
    monkeypatch.setattr(gemm, "_CUBLAS", True)
    monkeypatch.setattr(gemm, "_SWITCH", "off")
    monkeypatch.setattr(gemm, "_native_batched", {})
    monkeypatch.setattr(gemm, "_cublas_gemm", numpy_gemm)
    a, b = (x.astype(np.float16) for x in CASES["contiguous"]())
    assert not gemm.direct(np.float16, np.float32)
    got = gemm.matmul(a, b, dtype=np.float32)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, (a @ b).astype(np.float32))


@pytest.mark.skipif(backend.BACKEND != "numpy", reason="NumPy: no cuBLAS to write another dtype")
def test_without_cublas_a_change_of_dtype_casts_the_product():
    a, b = rand(3, 4).astype(np.float32), rand(4, 2).astype(np.float32)
    assert not gemm.direct(np.float16, np.float32)
    got = gemm.matmul(a, b, dtype=np.float64)
    assert got.dtype == np.float64
    np.testing.assert_array_equal(got, (a @ b).astype(np.float64))
    out = np.zeros((3, 2))
    assert gemm.matmul(a, b, out=out, dtype=np.float64) is out
    np.testing.assert_array_equal(out, got)


def test_shape_mismatch_names_both_shapes(monkeypatch):
    monkeypatch.setattr(gemm, "xp", np)
    with pytest.raises(ValueError, match=r"\(2, 4, 5\) @ \(2, 4, 6\)"):
        gemm.strided_batched(rand(2, 4, 5), rand(2, 4, 6), numpy_gemm)


def _cupy_with_cublas():
    if backend.BACKEND != "cupy":
        return "needs MINIDIST_BACKEND=cupy"
    try:
        import cupy_backends.cuda.libs.cublas  # noqa: F401
    except ImportError:
        return "no cuBLAS bindings here (the CuPy emulator)"
    return None


@pytest.mark.skipif(_cupy_with_cublas() is not None, reason=str(_cupy_with_cublas()))
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "float64"])
def test_cublas_batched_product(dtype):
    """cuBLAS's strided batched GEMM called directly equals CuPy's products in float32/float64
    (to 1e-12 in float64) and, in bf16/fp16 (fp32 accumulation), float32 products of the same
    rounded inputs to the output's rounding, on every layout of the CPU test."""
    dt = backend.dtype(dtype)
    tol = {"bfloat16": (2e-2, 5e-2), "float16": (2e-3, 5e-3), "float32": (1e-5, 1e-5), "float64": (1e-12, 1e-12)}[dtype]
    for case, make in CASES.items():
        a, b = make()
        A, B = backend.from_host(a).astype(dt), backend.from_host(b).astype(dt)
        want = backend.to_host(backend.xp.matmul(A.astype(np.float64), B.astype(np.float64)))
        for got in (gemm.strided_batched(A, B, gemm._cublas_gemm), gemm.matmul(A, B)):
            np.testing.assert_allclose(backend.to_host(got.astype(np.float64)), want, rtol=tol[0], atol=tol[1],
                                       err_msg=case)
    if dtype in ("bfloat16", "float16"):  # written as float32 straight from the accumulator
        for case, make in CASES.items():
            a, b = make()
            A, B = backend.from_host(a).astype(dt), backend.from_host(b).astype(dt)
            want = backend.to_host(backend.xp.matmul(A.astype(np.float64), B.astype(np.float64)))
            assert gemm.direct(dt, np.float32)
            got = gemm.matmul(A, B, dtype=np.float32)
            assert got.dtype == np.float32
            np.testing.assert_allclose(backend.to_host(got), want, rtol=1e-5, atol=1e-5, err_msg=case)
        g = backend.from_host(rand(300, 7)).astype(dt)  # a bias gradient: ones @ g into float32
        from minidist.model.ops.linalg import column_sums
        np.testing.assert_allclose(backend.to_host(column_sums(g)), backend.to_host(g.astype(np.float64).sum(axis=0)),
                                   rtol=1e-5, atol=1e-5)
    q, kt = (backend.from_host(x).astype(dt) for x in _qkv_heads())
    out = backend.xp.zeros((2, 5, 5, 3), dtype=dt).transpose(0, 3, 1, 2)  # (B, H, T, T), strided
    gemm.matmul(q, kt, out=out)
    want = backend.to_host(backend.xp.matmul(q.astype(np.float64), kt.astype(np.float64)))
    np.testing.assert_allclose(backend.to_host(out.astype(np.float64)), want, rtol=tol[0], atol=tol[1])
