"""Every op against central finite differences (float64), PyTorch parity, dtypes, autocast.

``check_grad`` makes all inputs and the upstream gradient read-only, so an op that
modified an input or its grad_out in place fails loudly here.
"""
import numpy as np
import pytest

from minidist import ops
from minidist.autograd import Tensor, run_backward
from minidist.backend import bfloat16

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
    check_grad(lambda a, b, c: ops.concat([a, b, c], axis=1), rand(2, 1, 3), rand(2, 4, 3), rand(2, 2, 3))
    check_grad(lambda a, b: ops.concat([a, b], axis=-1), rand(3, 2), rand(3, 5))


def test_indexing_grads():
    x = rand(5, 4)
    check_grad(lambda t: t[:, 1:3], x)
    check_grad(lambda t: t[1::2, -1], x)
    check_grad(lambda t: t[np.array([0, 2, 2, 4, 0])], x)
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


def test_cast_grad():
    x = Tensor(rand(3, 2), requires_grad=True)
    y = ops.cast(x, "float32")
    assert y.dtype == np.float32
    (y * 2.0).sum().backward()
    assert x.grad.dtype == np.float64
    np.testing.assert_array_equal(x.grad, 2.0)
    check_grad(lambda t: ops.cast(t, np.float64) * t, rand(3))
