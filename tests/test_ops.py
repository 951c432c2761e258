"""Every op against central finite differences (float64), PyTorch parity, dtypes, autocast.

``check_grad`` makes all inputs and the upstream gradient read-only, so an op that
modified an input or its grad_out in place fails loudly here.
"""
import numpy as np
import pytest

from minidist.model import ops
from minidist.model.autograd import Tensor, run_backward
from minidist.model.backend import bfloat16

RNG = np.random.default_rng(0)


def rand(*shape, lo=None):
    a = RNG.standard_normal(shape)
    return np.abs(a) + lo if lo is not None else a


def _outputs(fn, tensors):
    out = fn(*tensors)
    return list(out) if isinstance(out, (list, tuple)) else [out]


def check_grad(fn, *inputs, eps=1e-6, rtol=1e-6, atol=1e-8):
    """Backward of sum(out * R) (R random) vs central differences, for every float input.

    Non-float inputs (int index arrays, python scalars) are passed through unchanged.
    """
    arrays = [np.array(a, dtype=np.float64) if _is_float(a) else a for a in inputs]
    for a in arrays:
        if isinstance(a, np.ndarray):
            a.flags.writeable = False
    tensors = [Tensor(a, requires_grad=True) if _is_float(a) else a for a in arrays]
    outs = _outputs(fn, tensors)
    weights = [RNG.standard_normal(o.shape) for o in outs]
    for w in weights:
        w.flags.writeable = False
    run_backward(outs, weights)

    def objective(vals):
        res = _outputs(fn, [Tensor(v) if _is_float(v) else v for v in vals])
        return sum(float((o.data * w).sum()) for o, w in zip(res, weights))

    for i, a in enumerate(arrays):
        if not _is_float(a):
            continue
        num = np.zeros(a.shape)
        base = list(arrays)
        for j in np.ndindex(a.shape):
            plus, minus = a.copy(), a.copy()
            plus[j] += eps
            minus[j] -= eps
            base[i] = plus
            f_plus = objective(base)
            base[i] = minus
            num[j] = (f_plus - objective(base)) / (2 * eps)
        got = tensors[i].grad
        assert got is not None, f"input {i} got no gradient"
        assert got.shape == a.shape and got.dtype == np.float64
        np.testing.assert_allclose(got, num, rtol=rtol, atol=atol, err_msg=f"input {i}")


def _is_float(a):
    return isinstance(a, np.ndarray) and a.dtype.kind == "f"


# ----------------------------------------------------------------- finite differences

ARITH_CASES = [
    ((3, 4), (3, 4)),
    ((3, 4), (4,)),
    ((2, 1, 4), (3, 1)),
    ((1,), (2, 3)),
]


@pytest.mark.parametrize("op", [ops.add, ops.sub, ops.mul, ops.div])
def test_arithmetic_broadcasting_grads(op):
    for sa, sb in ARITH_CASES:
        b = rand(*sb, lo=0.5) if op is ops.div else rand(*sb)
        check_grad(op, rand(*sa), b)


def test_arithmetic_with_scalars_and_sugar():
    x = rand(2, 3, lo=0.5)
    check_grad(lambda t: 2.0 - t * 3 + 1 / t - t / 4.0 + (-t), x)
    check_grad(lambda t: np.float64(2.0) * t + t - 0.5, x)
    check_grad(lambda a, b: a @ b, rand(2, 3), rand(3, 2))


@pytest.mark.parametrize("op,lo", [(ops.neg, None), (ops.exp, None), (ops.log, 0.5), (ops.tanh, None), (ops.sqrt, 0.5)])
def test_unary_grads(op, lo):
    check_grad(op, rand(3, 4, lo=lo))


@pytest.mark.parametrize("reduce", [ops.sum, ops.mean])
def test_reduction_grads(reduce):
    x = rand(2, 3, 4)
    for axis in (None, 0, -1, (0, 2)):
        for keepdims in (False, True):
            check_grad(lambda t: reduce(t, axis=axis, keepdims=keepdims), x)
    check_grad(lambda t: t.sum(1) * 2 + t.mean(), x)


def test_shape_op_grads():
    x = rand(2, 3, 4)
    check_grad(lambda t: ops.reshape(t, (4, -1)), x)
    check_grad(lambda t: t.reshape(3, 8), x)
    check_grad(lambda t: ops.transpose(t, (1, 2, 0)), x)
    check_grad(lambda t: t.transpose(), x)
    check_grad(lambda t: t.transpose(2, 0, 1), x)


def test_split_concat_grads():
    x = rand(2, 6, 3)
    check_grad(lambda t: ops.split(t, 3, axis=1), x)
    check_grad(lambda t: ops.split(t, [1, 4, 1], axis=-2), x)
    parts = ops.split(Tensor(x), [2, 4], axis=1)
    assert [p.shape for p in parts] == [(2, 2, 3), (2, 4, 3)]
    # Only some parts used, one part used twice.
    check_grad(lambda t: ops.split(t, 3, axis=1)[1] * 2.0 + ops.split(t, 3, axis=1)[1], x)
    check_grad(lambda t: [*ops.split(t, 2, axis=1), t * 2.0], x)  # x also used directly
    t = Tensor(x, requires_grad=True)
    parts = ops.split(t, 3, axis=1)
    out = parts[0] * 2.0 + parts[2]
    out.backward(np.ones(out.shape), retain_graph=True)
    out.backward(np.ones(out.shape))  # a second pass must not reuse the first pass's buffer
    expected = np.zeros(x.shape)
    expected[:, 0:2], expected[:, 4:6] = 4.0, 2.0
    np.testing.assert_array_equal(t.grad, expected)
    check_grad(lambda a, b, c: ops.concat([a, b, c], axis=1), rand(2, 1, 3), rand(2, 4, 3), rand(2, 2, 3))
    check_grad(lambda a, b: ops.concat([a, b], axis=-1), rand(3, 2), rand(3, 5))


def test_indexing_grads():
    x = rand(5, 4)
    check_grad(lambda t: t[:, 1:3], x)
    check_grad(lambda t: t[1::2, -1], x)
    check_grad(lambda t: t[np.array([0, 2, 2, 4, 0])], x)
    check_grad(lambda t: t[Tensor(np.array([3, 3])), 1:], x)
    check_grad(lambda t: t[x > 0.1], x)
    idx = np.array([[1, 1], [3, 1], [0, 4]])
    check_grad(lambda t: ops.index_rows(t, idx), x)
    check_grad(lambda t: ops.index_rows(t, np.array([2, 2, 2])), rand(4, 2, 3))


def test_matmul_grads_with_broadcasting():
    check_grad(ops.matmul, rand(3, 4), rand(4, 2))
    check_grad(ops.matmul, rand(2, 3, 4), rand(4, 5))
    check_grad(ops.matmul, rand(2, 3, 4), rand(2, 4, 5))
    check_grad(ops.matmul, rand(2, 1, 3, 4), rand(3, 4, 2))
    check_grad(ops.matmul, rand(3, 4), rand(2, 4, 2))


def test_linear_grads():
    check_grad(ops.linear, rand(2, 3, 4), rand(4, 5), rand(5))
    check_grad(ops.linear, rand(3, 4), rand(4, 2))
    check_grad(lambda x, w, b: ops.linear(x.transpose(1, 0, 2), w, b), rand(3, 2, 4), rand(4, 3), rand(3))


def test_add_bias_grads_and_its_low_precision_bias_gradient_in_float32():
    check_grad(ops.add_bias, rand(2, 3, 4), rand(4))
    # tensor parallelism adds the row-parallel bias after the summed products: its gradient,
    # a sum over every token, stays float32 (as linear's) where the activations are bfloat16
    g = rand(64, 32, 8).astype(bfloat16)
    y = Tensor(g * 0, requires_grad=True)
    b = Tensor(rand(8).astype(np.float32), requires_grad=True)
    out = ops.add_bias(y, b)
    assert out.dtype == bfloat16
    run_backward([out], [g])
    assert b.grad.dtype == np.float32
    np.testing.assert_allclose(b.grad, g.astype(np.float64).sum(axis=(0, 1)), rtol=1e-6)


def test_nn_op_grads():
    check_grad(ops.gelu, rand(3, 5) * 2)
    check_grad(ops.softmax, rand(2, 3, 4))
    check_grad(lambda t: ops.softmax(t, axis=0), rand(3, 4))
    check_grad(ops.layer_norm, rand(2, 3, 5), rand(5), rand(5))
    check_grad(lambda x: ops.layer_norm(x, None, None, eps=1e-3), rand(4, 6))
    check_grad(lambda x, w: ops.layer_norm(x, w, None), rand(4, 6), rand(6))
    ids = np.array([[1, 3, 1], [0, 1, 3]])
    check_grad(lambda w: ops.embedding(w, ids), rand(5, 4))


def test_cross_entropy_grads():
    targets = np.array([[0, 3, 2], [1, 1, 4]])
    check_grad(lambda z: ops.cross_entropy(z, targets), rand(2, 3, 5) * 3)
    ignored = np.array([[0, -100, 2], [-100, 1, 4]])
    check_grad(lambda z: ops.cross_entropy(z, ignored, ignore_index=-100), rand(2, 3, 5))
    all_ignored = np.full((2,), 7)
    z = Tensor(rand(2, 3), requires_grad=True)
    loss = ops.cross_entropy(z, all_ignored, ignore_index=7)
    loss.backward()
    assert loss.item() == 0.0 and not z.grad.any()


@pytest.mark.parametrize("causal", [True, False])
def test_attention_grads(causal):
    q, k, v = rand(2, 2, 4, 3), rand(2, 2, 4, 3), rand(2, 2, 4, 3)
    check_grad(lambda a, b, c: ops.attention(a, b, c, causal=causal), q, k, v)
    check_grad(lambda a, b, c: ops.attention(a, b, c, causal=causal, scale=0.3), q, rand(2, 2, 5, 3), rand(2, 2, 5, 3))
    check_grad(lambda a, b, c: ops.attention(a, b, c, causal=causal), rand(2, 4, 3), rand(2, 4, 3), rand(2, 4, 3))
    check_grad(lambda a, b, c: ops.attention(a, b, c, causal=causal), *(rand(2, 1, 2, 3, 2) for _ in range(3)))


def _split_heads(qkv, n_head):
    """The reference (B, T, 3C) -> three (B, H, T, D) arrays, by explicit transpose."""
    B, T, C3 = qkv.shape
    return qkv.reshape(B, T, 3, n_head, C3 // 3 // n_head).transpose(2, 0, 3, 1, 4)


@pytest.mark.parametrize("causal", [True, False])
def test_self_attention_grads_and_equals_split_attention(causal):
    check_grad(lambda x: ops.self_attention(x, 2, causal=causal), rand(2, 4, 12))
    check_grad(lambda x: ops.self_attention(x, 1, causal=causal, scale=0.3), rand(1, 3, 6))
    # same values and gradient as attention() on the explicitly split heads
    x = Tensor(rand(3, 5, 24), requires_grad=True)
    y = ops.self_attention(x, 4, causal=causal)
    g = rand(3, 5, 8)
    y.backward(g)
    q, k, v = (Tensor(np.ascontiguousarray(a), requires_grad=True) for a in _split_heads(x.data, 4))
    ref = ops.attention(q, k, v, causal=causal)
    ref.backward(g.reshape(3, 5, 4, 2).transpose(0, 2, 1, 3))
    np.testing.assert_allclose(y.data, ref.data.transpose(0, 2, 1, 3).reshape(3, 5, 8), rtol=1e-12, atol=1e-12)
    dx = np.stack([q.grad, k.grad, v.grad]).transpose(1, 3, 0, 2, 4).reshape(3, 5, 24)
    np.testing.assert_allclose(x.grad, dx, rtol=1e-12, atol=1e-12)


def test_causal_attention_skips_masked_tiles_exactly(monkeypatch):
    """With query blocks smaller than T (3 blocks of 2, 2, 1 rows here) the causal path
    computes only the tiles on and below the diagonal: gradients still match finite
    differences and values and gradients match the one-block computation."""
    import sys

    att = sys.modules["minidist.model.ops.attention"]
    x0 = rand(2, 5, 12)
    g = rand(2, 5, 4)
    results = {}
    for block in (2, 64):
        monkeypatch.setattr(att, "_CAUSAL_BLOCK", block)
        assert len(att._query_blocks(5, 5, True)) == (3 if block == 2 else 1)
        x = Tensor(x0, requires_grad=True)
        y = ops.self_attention(x, 2)
        y.backward(g)
        q, k, v = (Tensor(np.ascontiguousarray(a), requires_grad=True) for a in _split_heads(x0, 2))
        o = ops.attention(q, k, v)
        o.backward(g.reshape(2, 5, 2, 2).transpose(0, 2, 1, 3))
        results[block] = [y.data, x.grad, o.data, q.grad, k.grad, v.grad]
        if block == 2:
            check_grad(lambda a: ops.self_attention(a, 2), x0)
            check_grad(lambda a, b, c: ops.attention(a, b, c), *(rand(1, 2, 5, 3) for _ in range(3)))
    for a, b in zip(results[2], results[64]):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


def test_self_attention_bad_input():
    with pytest.raises(ValueError, match=r"\(B, T, 3C\)"):
        ops.self_attention(Tensor(rand(2, 3, 7)), 1)
    with pytest.raises(ValueError, match="n_head=3"):
        ops.self_attention(Tensor(rand(2, 3, 12)), 3)


def test_parallel_for_threads_match_serial():
    """Work shared out over threads (2 BLAS threads) gives the results of one thread, and
    an exception in a worker reaches the caller."""
    threadpoolctl = pytest.importorskip("threadpoolctl")
    from minidist.model.ops import blas_threads

    cases = [  # (op, input shape, output shape): gelu gets several cache blocks
        (lambda t: ops.self_attention(t, 2), (5, 16, 24), (5, 16, 8)),
        (ops.gelu, (3, 70001), (3, 70001)),
        (lambda t: ops.layer_norm(t, w, b), (7, 5, 16), (7, 5, 16)),
    ]
    w, b = (Tensor(rand(16).astype(np.float32), requires_grad=True) for _ in range(2))
    for op, in_shape, out_shape in cases:
        x = Tensor(rand(*in_shape).astype(np.float32), requires_grad=True)
        g = rand(*out_shape).astype(np.float32)
        results = []
        for n in (1, 2):
            with threadpoolctl.threadpool_limits(limits=n, user_api="blas"):
                assert blas_threads.blas_threads() == n or n == 1
                x.grad = w.grad = b.grad = None
                y = op(x)
                y.backward(g)
                results.append((y.data.copy(), x.grad.copy()))
        for mine, ref in zip(*results):
            # row chunks per thread may change the last bit of a BLAS row sum (layer_norm)
            np.testing.assert_allclose(mine, ref, rtol=2e-6, atol=1e-7)

    def boom(item, buf):
        buf[...] = item
        if item == 3:
            raise RuntimeError("slab 3 failed")

    with threadpoolctl.threadpool_limits(limits=2, user_api="blas"):
        with pytest.raises(RuntimeError, match="slab 3"):
            blas_threads.parallel_for(range(6), boom, scratch=[((2,), np.float32)])


def test_cast_grad():
    x = Tensor(rand(3, 2), requires_grad=True)
    y = ops.cast(x, "float32")
    assert y.dtype == np.float32
    (y * 2.0).sum().backward()
    assert x.grad.dtype == np.float64
    np.testing.assert_array_equal(x.grad, 2.0)
    check_grad(lambda t: ops.cast(t, np.float64) * t, rand(3))


# ----------------------------------------------------------------- PyTorch parity (float64)


def _torch_pair(*arrays):
    torch = pytest.importorskip("torch")
    mine = [Tensor(a, requires_grad=True) for a in arrays]
    theirs = [torch.tensor(a, requires_grad=True) for a in arrays]
    return torch, mine, theirs


PARITY_TOL = 1e-12  # float64 round-off is 1.1e-16 per operation; the worst measured here is 1.2e-15


def _normwise(got, want):
    """max |got - want| / max |want|: per tensor, not per element -- some gradient elements are
    exactly 0 in exact arithmetic (causal attention's first query, GELU's derivative at its
    minimum) and hold only round-off in both programs, which no elementwise rtol bounds."""
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-300))


def _assert_same(out, ref, mine, theirs):
    """Value and every input's gradient equal PyTorch's to 1e-12 normwise relative."""
    err = _normwise(out.data, ref.detach().numpy())
    assert err <= PARITY_TOL, ("value", err)
    g = RNG.standard_normal(out.shape)
    out.backward(g)
    import torch

    ref.backward(torch.tensor(g))
    for i, (m, t) in enumerate(zip(mine, theirs)):
        err = _normwise(m.grad, t.grad.numpy())
        assert err <= PARITY_TOL, (f"gradient of input {i}", err)


def test_torch_parity_gelu_softmax():
    torch, (x,), (tx,) = _torch_pair(rand(4, 7) * 3)
    _assert_same(ops.gelu(x), torch.nn.functional.gelu(tx, approximate="tanh"), [x], [tx])
    torch, (x,), (tx,) = _torch_pair(rand(3, 4, 5))
    _assert_same(ops.softmax(x, axis=1), torch.softmax(tx, dim=1), [x], [tx])


def test_torch_parity_layer_norm():
    torch, mine, theirs = _torch_pair(rand(2, 3, 8), rand(8), rand(8))
    ref = torch.nn.functional.layer_norm(theirs[0], (8,), theirs[1], theirs[2], eps=1e-5)
    _assert_same(ops.layer_norm(*mine, eps=1e-5), ref, mine, theirs)


def test_torch_parity_cross_entropy():
    torch, (z,), (tz,) = _torch_pair(rand(3, 4, 6) * 2)
    targets = np.array([[0, 5, 2, -1], [3, -1, -1, 1], [4, 4, 0, 2]])
    loss = ops.cross_entropy(z, targets, ignore_index=-1)
    ref = torch.nn.functional.cross_entropy(
        tz.reshape(-1, 6), torch.tensor(targets.reshape(-1)), ignore_index=-1
    )
    _assert_same(loss, ref, [z], [tz])
    torch, (z,), (tz,) = _torch_pair(rand(5, 6))
    t = np.array([1, 0, 5, 5, 2])
    _assert_same(ops.cross_entropy(z, t), torch.nn.functional.cross_entropy(tz, torch.tensor(t)), [z], [tz])


@pytest.mark.parametrize("causal", [True, False])
def test_torch_parity_attention(causal):
    torch, mine, theirs = _torch_pair(rand(2, 3, 6, 4), rand(2, 3, 6, 4), rand(2, 3, 6, 4))
    ref = torch.nn.functional.scaled_dot_product_attention(*theirs, is_causal=causal)
    _assert_same(ops.attention(*mine, causal=causal), ref, mine, theirs)


# ----------------------------------------------------------------- the Llama family's ops
def test_llama_op_grads():
    check_grad(lambda x, w: ops.rms_norm(x, w, eps=1e-5), rand(2, 3, 6), rand(6))
    positions = np.array([0, 7, 3, 12])  # any order: a context-parallel rank's zig-zag places
    check_grad(lambda x: ops.rotary(x, 3, 4, positions, 10.0), rand(2, 4, 5 * 4))
    check_grad(ops.swiglu, rand(2, 3, 10) * 2)
    for kv in (1, 2, 4):  # multi-query, grouped, multi-head (the identity)
        check_grad(lambda x, kv=kv: ops.repeat_kv(x, 4, kv), rand(2, 3, (4 + 2 * kv) * 3))


def _torch_rotate(torch, x, positions, theta):
    """Hugging Face Llama's rotary embedding (rotate_half), in float64."""
    D = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    angles = torch.tensor(positions, dtype=torch.float64)[:, None] * inv[None, :]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    x1, x2 = x[..., :D // 2], x[..., D // 2:]
    return x * cos[:, None, :] + torch.cat([-x2, x1], -1) * sin[:, None, :]


def test_torch_parity_llama_ops():
    torch, mine, theirs = _torch_pair(rand(2, 3, 8), rand(8))
    t, w = theirs
    ref = t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-5) * w
    _assert_same(ops.rms_norm(*mine, eps=1e-5), ref, mine, theirs)
    torch, (h,), (th,) = _torch_pair(rand(2, 3, 10) * 2)
    _assert_same(ops.swiglu(h), torch.nn.functional.silu(th[..., :5]) * th[..., 5:], [h], [th])
    # q and k heads turned, v heads as they were; B=2, T=4, 2 q + 1 k + 1 v heads of 6
    positions = [5, 0, 9, 2]
    torch, (x,), (tx,) = _torch_pair(rand(2, 4, 4 * 6))
    qk = tx[..., :18].reshape(2, 4, 3, 6)
    ref = torch.cat([_torch_rotate(torch, qk, positions, 500000.0).reshape(2, 4, 18), tx[..., 18:]], -1)
    _assert_same(ops.rotary(x, 3, 6, np.array(positions), 500000.0), ref, [x], [tx])
    # repeat_kv as Hugging Face's repeat_kv: query head h reads key/value head h // (H / K)
    torch, (x,), (tx,) = _torch_pair(rand(2, 3, (4 + 2 * 2) * 5))
    q, k, v = tx[..., :20], tx[..., 20:30].reshape(2, 3, 2, 5), tx[..., 30:].reshape(2, 3, 2, 5)
    ref = torch.cat([q, k.repeat_interleave(2, dim=2).reshape(2, 3, 20), v.repeat_interleave(2, dim=2).reshape(2, 3, 20)], -1)
    _assert_same(ops.repeat_kv(x, 4, 2), ref, [x], [tx])


def test_llama_ops_bad_input():
    with pytest.raises(ValueError, match=r"rms_norm weight shape \(5,\)"):
        ops.rms_norm(Tensor(rand(2, 4)), Tensor(rand(5)))
    with pytest.raises(ValueError, match="head dimension must be even"):
        ops.rotary(Tensor(rand(1, 2, 9)), 3, 3, np.arange(2), 10.0)
    with pytest.raises(ValueError, match="even last axis"):
        ops.swiglu(Tensor(rand(2, 5)))
    with pytest.raises(ValueError, match="not 4 query and 2 x 3 key/value heads"):
        ops.repeat_kv(Tensor(rand(1, 2, 30)), 4, 3)


def test_torch_parity_embedding_and_linear():
    torch, (w,), (tw,) = _torch_pair(rand(7, 3))
    ids = np.array([[1, 6, 1], [1, 0, 2]])
    _assert_same(ops.embedding(w, ids), torch.nn.functional.embedding(torch.tensor(ids), tw), [w], [tw])
    torch, mine, theirs = _torch_pair(rand(2, 3, 4), rand(4, 5), rand(5))
    ref = theirs[0] @ theirs[1] + theirs[2]
    _assert_same(ops.linear(*mine), ref, mine, theirs)


# ----------------------------------------------------------------- dtype discipline


def _f32(*shape, lo=None):
    return Tensor(rand(*shape, lo=lo).astype(np.float32), requires_grad=True)


FLOAT32_CASES = {
    "arith": lambda: ops.div(ops.mul(_f32(3, 4), 2.5) + np.float64(1.5), _f32(4, lo=1.0)) - 1,
    "unary": lambda: ops.sqrt(ops.exp(ops.tanh(_f32(3)))) + ops.log(_f32(3, lo=1.0)),
    "reduce": lambda: ops.mean(_f32(2, 3), axis=0) + ops.sum(_f32(2, 3), axis=0),
    "shape": lambda: ops.concat(ops.split(_f32(2, 4).transpose().reshape(2, 4), [1, 3], axis=1), axis=1)[:, 1:],
    "index": lambda: ops.index_rows(_f32(4, 2), np.array([0, 0, 3])),
    "matmul": lambda: ops.matmul(_f32(2, 3, 4), _f32(4, 2)),
    "linear": lambda: ops.linear(_f32(2, 3, 4), _f32(4, 2), _f32(2)),
    "gelu": lambda: ops.gelu(_f32(3, 4)),
    "softmax": lambda: ops.softmax(_f32(3, 4)),
    "layer_norm": lambda: ops.layer_norm(_f32(3, 4), _f32(4), _f32(4)),
    "embedding": lambda: ops.embedding(_f32(5, 3), np.array([[1, 2], [1, 4]])),
    "cross_entropy": lambda: ops.cross_entropy(_f32(3, 5), np.array([0, 4, 4])),
    "attention": lambda: ops.attention(_f32(1, 2, 4, 3), _f32(1, 2, 4, 3), _f32(1, 2, 4, 3)),
    "self_attention": lambda: ops.self_attention(_f32(2, 4, 6), 2),
    "rms_norm": lambda: ops.rms_norm(_f32(2, 3, 4), _f32(4)),
    "rotary": lambda: ops.rotary(_f32(2, 3, 12), 2, 4, np.arange(3), 10.0),
    "swiglu": lambda: ops.swiglu(_f32(2, 3, 8)),
    "repeat_kv": lambda: ops.repeat_kv(_f32(2, 3, 16), 2, 1),
}


def _leaves(t, seen=None):
    seen = set() if seen is None else seen
    if id(t) in seen or not isinstance(t, Tensor):
        return []
    seen.add(id(t))
    if t._ctx is None:
        return [t]
    return [leaf for p in t._ctx[0] for leaf in _leaves(p, seen)]


@pytest.mark.parametrize("name", sorted(FLOAT32_CASES))
def test_float32_in_float32_out_and_grads(name):
    out = FLOAT32_CASES[name]()
    assert out.dtype == np.float32, name
    leaves = _leaves(out)
    out.backward(np.ones(out.shape, dtype=np.float32))
    for leaf in leaves:
        assert leaf.grad is not None and leaf.grad.dtype == np.float32, (name, leaf)


# ----------------------------------------------------------------- autocast


# Each low dtype's machine epsilon (the gap above 1.0): bfloat16 keeps 8 significant bits,
# float16 11.
LOW = [pytest.param(bfloat16, 2.0**-7, id="bfloat16"), pytest.param(np.dtype(np.float16), 2.0**-10, id="float16")]
# Autocast rounds a product's operands to the low dtype (relative error <= eps/2 each) and its
# result (eps/2 more); a backward chains two or three such products (attention: dP = dO V^T,
# dS rounded, dQ = dS K), so output and gradients differ from the float32 computation by a
# few eps, normwise.  Measured over 300 random draws of these shapes: <= 1.4 eps.  Allowed: 4 eps.
AUTOCAST_EPS = 4


def _against_float32(fn, inputs, low, eps):
    """``fn`` under ``autocast(low)`` and in plain float32, on copies of the same float32
    inputs and with the same upstream gradient (random, exactly representable in ``low``).

    The autocast output is in ``low``, every input's gradient in float32 (the master
    weight's dtype), and output and gradients are within AUTOCAST_EPS * eps of float32's,
    normwise (max |error| / max |float32 value| per array).  Returns the autocast output and
    input tensors."""
    upstream, runs = None, []
    for mode in (None, low):
        tensors = [Tensor(a.data.copy(), requires_grad=True) for a in inputs]
        with ops.autocast(mode):
            out = fn(*tensors)
        if upstream is None:
            upstream = RNG.standard_normal(out.shape).astype(low)
        out.backward(upstream.astype(out.dtype))
        runs.append((out, tensors))
    (ref, ref_in), (got, got_in) = runs
    assert ref.dtype == np.float32 and got.dtype == low
    pairs = [("output", got.data.astype(np.float32), ref.data)]
    for i, (a, b) in enumerate(zip(got_in, ref_in)):
        assert a.grad.dtype == np.float32, (i, a.grad.dtype)
        pairs.append((f"gradient of input {i}", a.grad, b.grad))
    for what, a, b in pairs:
        err = _normwise(a, b)
        assert err <= AUTOCAST_EPS * eps, (what, f"{err / eps:.2f} eps")
    return got, got_in


@pytest.mark.parametrize("low,eps", LOW)
def test_autocast_matmul_linear(low, eps):
    """linear and matmul under autocast: values and the gradients of x, w and b within 4 eps
    of the float32 computation (see AUTOCAST_EPS); then low-precision activations with an
    fp32 master weight."""
    x, w, b = _f32(4, 8, 32), _f32(32, 16), _f32(16)
    assert ops.get_autocast_dtype() is None
    with ops.autocast(low) as active:
        assert active == low and ops.get_autocast_dtype() == low
        with ops.autocast(None):
            assert ops.get_autocast_dtype() is None
        assert ops.get_autocast_dtype() == low
    assert ops.get_autocast_dtype() is None
    _against_float32(ops.linear, [x, w, b], low, eps)
    _against_float32(ops.matmul, [x, w], low, eps)
    # Low-precision activations in, fp32 master weight: grads come back in each input's dtype.
    xl = Tensor(x.data.astype(low), requires_grad=True)
    with ops.autocast(low):
        out = ops.linear(xl, w)
    out.backward(np.ones(out.shape, dtype=low))
    assert xl.grad.dtype == low and w.grad.dtype == np.float32
    # x is already in the low dtype, so dw = x^T @ ones is computed exactly in fp32.
    exact = xl.data.astype(np.float32).reshape(-1, 32).sum(0)[:, None] * np.ones(16, dtype=np.float32)
    np.testing.assert_allclose(w.grad, exact, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("low,eps", LOW)
def test_autocast_self_attention(low, eps):
    """Output and the gradient of qkv within 4 eps of float32's (see AUTOCAST_EPS)."""
    _against_float32(lambda t: ops.self_attention(t, 2), [_f32(2, 8, 12)], low, eps)


@pytest.mark.parametrize("low,eps", LOW)
def test_autocast_attention_and_fp32_internal_ops(low, eps):
    """attention's output and the gradients of q, k and v within 4 eps of float32's (see
    AUTOCAST_EPS); softmax, layer_norm and cross_entropy keep low-precision inputs' dtype."""
    _against_float32(ops.attention, [_f32(1, 2, 8, 4), _f32(1, 2, 8, 4), _f32(1, 2, 8, 4)], low, eps)
    xl = Tensor(rand(3, 6).astype(low), requires_grad=True)
    assert ops.softmax(xl).dtype == low
    ln = ops.layer_norm(xl, _f32(6), _f32(6))
    assert ln.dtype == low
    loss = ops.cross_entropy(xl, np.array([0, 5, 2]))
    assert loss.dtype == np.float32
    loss.backward()
    assert xl.grad.dtype == low


@pytest.mark.parametrize("low,eps", LOW)
def test_low_precision_sums_in_backward_are_added_in_float32(low, eps):
    """minidist does no arithmetic in low precision: a gradient that is a sum of many
    low-precision numbers is added in float32 and rounded once, within one eps (normwise) of
    the exact sum of the same terms.  Added in bfloat16, the 2,048 terms of a gate's row
    (MoE's gate times its expert's output) lost several bits, and repeat_kv's 64 query heads
    reading one key/value head (multi-query attention) two."""
    x, g = rand(64, 2048).astype(low), rand(64, 2048).astype(low)
    gate = Tensor(rand(64, 1).astype(low), requires_grad=True)
    run_backward([ops.mul(Tensor(x), gate)], [g])
    exact = (g * x).astype(np.float64).sum(axis=1, keepdims=True)  # the op's products, rounded as it rounds them
    assert gate.grad.dtype == low and _normwise(gate.grad.astype(np.float64), exact) <= eps

    H, D = 64, 4
    qkv = Tensor(rand(2, 8, (H + 2) * D).astype(low), requires_grad=True)
    up = rand(2, 8, 3 * H * D).astype(low)
    run_backward([ops.repeat_kv(qkv, H, 1)], [up])
    exact = up.astype(np.float64).reshape(2, 8, 3, H, D)[:, :, 1:].sum(axis=3).reshape(2, 8, 2 * D)
    assert qkv.grad.dtype == low and _normwise(qkv.grad[..., H * D:].astype(np.float64), exact) <= eps


@pytest.mark.parametrize("low,eps", LOW)
def test_swiglu_computes_in_float32_under_low_precision(low, eps):
    """SwiGLU of low-precision activations returns their dtype and computes in float32, as
    gelu: in float16 exp(-a) overflows below a = -11.1, and the backward of a gate at -12 and a
    large upstream gradient (a loss scaled by 2**16) was NaN."""
    h = Tensor(np.array([[-12.0, -3.0, 0.5, 4.0, 1.0, 2.0, -1.5, 0.25]]).astype(low), requires_grad=True)
    out = ops.swiglu(h)
    assert out.dtype == low
    up = np.full(out.shape, 6000.0).astype(low)
    run_backward([out], [up])
    ref = Tensor(h.data.astype(np.float64), requires_grad=True)
    run_backward([ops.swiglu(ref)], [up.astype(np.float64)])
    assert h.grad.dtype == low and np.isfinite(h.grad.astype(np.float64)).all()
    assert _normwise(h.grad.astype(np.float64), ref.grad) <= eps
    assert _normwise(out.data.astype(np.float64), ops.swiglu(Tensor(h.data.astype(np.float64))).data) <= eps


def test_autocast_is_thread_local():
    import threading

    seen = []
    with ops.autocast("bfloat16"):
        worker = threading.Thread(target=lambda: seen.append(ops.get_autocast_dtype()))
        worker.start()
        worker.join()
        assert ops.get_autocast_dtype() == bfloat16
    assert seen == [None]


def test_autocast_rejects_bad_dtype():
    with pytest.raises(ValueError, match="float32"):
        with ops.autocast("float32"):
            pass


# ----------------------------------------------------------------- bad input


def test_bad_input_errors_name_the_value():
    x = Tensor(rand(3, 4))
    with pytest.raises(IndexError, match="7"):
        ops.embedding(Tensor(rand(5, 2)), np.array([1, 7]))
    with pytest.raises(IndexError, match="-2"):
        ops.index_rows(x, np.array([0, -2]))
    with pytest.raises(IndexError, match="9"):
        ops.cross_entropy(x, np.array([0, 9, 1]))
    with pytest.raises(ValueError, match=r"\(2,\)"):
        ops.cross_entropy(x, np.array([0, 1]))
    with pytest.raises(ValueError, match="5"):
        ops.split(x, 5, axis=1)
    with pytest.raises(ValueError, match=r"\[1, 2\]"):
        ops.split(x, [1, 2], axis=1)
    with pytest.raises(ValueError, match=r"\(3, 4\) @ \(3, 4\)"):
        ops.matmul(x, x)
    with pytest.raises(ValueError, match=r"\(5, 2\)"):
        ops.linear(x, Tensor(rand(5, 2)))
    with pytest.raises(TypeError, match="float"):
        ops.embedding(Tensor(rand(5, 2)), np.array([1.0]))
    with pytest.raises(ValueError, match="axis 3"):
        ops.sum(x, axis=3)
