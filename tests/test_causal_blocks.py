"""minidist.model.ops.causal_blocks: causal attention's products on the blocks at and below the
diagonal, against the whole products (NumPy), and attention with and without them (CuPy)."""

import numpy as np
import pytest

from minidist.model import backend
from minidist.model.backend import BACKEND
from minidist.model.ops import causal_blocks as cb

RNG = np.random.default_rng(0)


def test_blocks_cut_the_queries_into_nearly_equal_parts(monkeypatch):
    monkeypatch.setattr(cb, "MIN_ROWS", 3)
    monkeypatch.setenv("MINIDIST_CAUSAL_BLOCKS", "4")
    assert cb.blocks(13) == [(0, 3), (3, 6), (6, 9), (9, 13)]
    assert cb.blocks(7) == [(0, 3), (3, 7)]  # a block has MIN_ROWS rows at least
    assert cb.blocks(2) == [(0, 2)]
    monkeypatch.setenv("MINIDIST_CAUSAL_BLOCKS", "1")
    assert cb.blocks(13) == [(0, 13)]


def _lower(m):
    return np.tril(m)


@pytest.mark.skipif(BACKEND != "numpy", reason="NumPy arrays")
@pytest.mark.parametrize("parts", [[(0, 3), (3, 6), (6, 9), (9, 13)], [(0, 13)], [(0, 1), (1, 13)]])
def test_the_three_products_equal_the_whole_ones(parts):
    B, H, T, D = 2, 3, 13, 4
    a, b = RNG.standard_normal((B, H, T, D)), RNG.standard_normal((B, H, T, D))
    s = cb.lower_scores(a, b, parts)
    full = a @ b.swapaxes(-1, -2)
    for i0, i1 in parts:  # what each block writes; right of it is left unset
        np.testing.assert_allclose(s[..., i0:i1, :i1], full[..., i0:i1, :i1], rtol=1e-13, atol=1e-13)
    m = _lower(RNG.standard_normal((B, H, T, T)))
    np.testing.assert_allclose(cb.lower_times(m, b, parts), m @ b, rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(cb.lower_t_times(m, b, parts), m.swapaxes(-1, -2) @ b, rtol=1e-13, atol=1e-13)


@pytest.mark.skipif(BACKEND != "numpy", reason="NumPy arrays")
@pytest.mark.parametrize("through", ["matmul", "cuBLAS's strided batched call (a NumPy model)"])
def test_products_into_the_heads_of_a_fused_array(through, monkeypatch):
    """As self-attention uses them: operands and outputs are head views of (B, T, 3C) arrays.
    On a GPU each block is a strided batched cuBLAS call per batch element (ops/cuda/gemm.py),
    modelled here as test_gemm.py models it."""
    if through != "matmul":
        from minidist.model.ops.cuda import gemm
        from test_gemm import numpy_gemm

        monkeypatch.setattr(gemm, "xp", np)
        monkeypatch.setattr(gemm, "_CUBLAS", True)
        monkeypatch.setattr(gemm, "_cublas_gemm", numpy_gemm)
    B, T, H, D = 2, 9, 3, 4
    parts = [(0, 4), (4, 9)]

    def heads(x, part):
        return x[..., part * H * D:(part + 1) * H * D].reshape(B, T, H, D).transpose(0, 2, 1, 3)

    X = RNG.standard_normal((B, T, 3 * H * D))
    q, k = heads(X, 0), heads(X, 1)
    m = _lower(RNG.standard_normal((B, H, T, T)))
    dX = np.full((B, T, 3 * H * D), np.nan)
    cb.lower_times(m, k, parts, out=heads(dX, 0))
    cb.lower_t_times(m, q, parts, out=heads(dX, 1))
    np.testing.assert_allclose(heads(dX, 0), m @ k, rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(heads(dX, 1), m.swapaxes(-1, -2) @ q, rtol=1e-13, atol=1e-13)
    assert np.isnan(heads(dX, 2)).all()  # the rest untouched


@pytest.mark.skipif(BACKEND != "cupy", reason="the blocks run with minidist's CUDA kernels (MINIDIST_BACKEND=cupy)")
@pytest.mark.parametrize("dtype, tol", [("float64", 1e-12), ("float32", 1e-5), ("bfloat16", 3e-2)])
def test_attention_with_and_without_the_blocks(monkeypatch, dtype, tol):
    """Values and every gradient of causal self-attention, and of attention on split heads, with
    the products in 4 query blocks and whole."""
    from minidist.model import ops
    from minidist.model.autograd import Tensor

    if dtype == "bfloat16" and backend.bfloat16 is None:
        pytest.skip("no bfloat16 here (ml_dtypes)")
    monkeypatch.setattr(cb, "MIN_ROWS", 2)
    calls = []

    class NanEmpty:  # the blocks' new arrays start as NaN: an unwritten entry that is read shows
        def __getattr__(self, name):
            return getattr(backend.xp, name)

        def empty(self, shape, dtype):
            calls.append(shape)
            return backend.xp.full(shape, np.nan, dtype=dtype)

    monkeypatch.setattr(cb, "xp", NanEmpty())
    B, T, H, D = 2, 11, 2, 4
    qkv0, g0 = RNG.standard_normal((B, T, 3 * H * D)), RNG.standard_normal((B, T, H * D))
    q0, k0, v0, go = (RNG.standard_normal((B, H, T, D)) for _ in range(4))
    out = {}
    for n in ("4", "1"):
        monkeypatch.setenv("MINIDIST_CAUSAL_BLOCKS", n)
        assert len(cb.blocks(T)) == int(n)
        qkv = Tensor(backend.from_host(qkv0).astype(dtype), requires_grad=True)
        y = ops.self_attention(qkv, H, causal=True)
        y.backward(backend.from_host(g0).astype(dtype))
        q, k, v = (Tensor(backend.from_host(a).astype(dtype), requires_grad=True) for a in (q0, k0, v0))
        o = ops.attention(q, k, v, causal=True)
        o.backward(backend.from_host(go).astype(dtype))
        out[n] = [backend.to_host(a.astype(np.float64)) for a in (y.data, qkv.grad, o.data, q.grad, k.grad, v.grad)]
    assert len(calls) == 9  # S and dP of each call, O of each; attention()'s dQ, dK, dV (self-attention writes its own)
    for name, a, b in zip(("y", "dqkv", "o", "dq", "dk", "dv"), out["4"], out["1"]):
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol, err_msg=name)
