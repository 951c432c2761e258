"""Every op's whole-array path (what CuPy runs) equals its CPU-tuned path (ops/tuning.py).

Values and gradients in float64 to round-off, autocast (bf16) bit for bit (on NumPy), and a
few training steps of a tiny GPT on each path.  Under NumPy both paths run here; with
MINIDIST_BACKEND=cupy (``make test-gpu``) the same file checks them on the GPU.
"""
import numpy as np
import pytest

from minidist.model import ops
from minidist.model.autograd import Tensor, run_backward
from minidist.model.backend import BACKEND, dtype, from_host, to_host, xp
from minidist.model.ops import tuning

RNG = np.random.default_rng(7)


def rand(*shape):
    return RNG.standard_normal(shape)


def run(path, fn, inputs, upstream_seed=3):
    """Outputs and input gradients of ``fn(*tensors)`` on ops path ``path`` (float64, host)."""
    with tuning.use(path):
        tensors = [Tensor(from_host(a), requires_grad=True) if isinstance(a, np.ndarray) and a.dtype.kind == "f"
                   else a for a in inputs]
        out = fn(*tensors)
        outs = list(out) if isinstance(out, (list, tuple)) else [out]
        rng = np.random.default_rng(upstream_seed)
        weights = [from_host(rng.standard_normal(o.shape).astype(o.data.dtype)) for o in outs]
        run_backward(outs, weights)
    return ([to_host(o.data).astype(np.float64) for o in outs],
            [to_host(t.grad).astype(np.float64) for t in tensors if isinstance(t, Tensor)])


def same(fn, *inputs, rtol=1e-11, atol=1e-12):
    whole, tuned = run("whole", fn, inputs), run("tuned", fn, inputs)
    for a, b in zip(whole[0] + whole[1], tuned[0] + tuned[1]):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol)
    return whole


def test_default_path_follows_the_backend():
    assert tuning.default_path("numpy", "auto") == "tuned"
    assert tuning.default_path("cupy", "auto") == "whole"
    assert tuning.default_path("numpy", "whole") == "whole"
    assert tuning.default_path("cupy", "tuned") == "tuned"
    with pytest.raises(ValueError, match="'fast'"):
        tuning.default_path("numpy", "fast")
    before = tuning.current()
    with tuning.use("whole"):
        assert not tuning.tuned()
    assert tuning.current() == before


@pytest.mark.parametrize("shape", [(3, 5), (2, 70000)])  # the second spans two GELU blocks
def test_gelu(shape):
    same(ops.gelu, rand(*shape))


@pytest.mark.parametrize("affine", [(True, True), (True, False), (False, False)])
def test_layer_norm(affine):
    w = rand(8) if affine[0] else None
    b = rand(8) if affine[1] else None
    same(lambda x, *p: ops.layer_norm(x, *(list(p) + [None] * (2 - len(p)))), rand(2, 5, 8),
         *[a for a in (w, b) if a is not None])


def test_softmax_and_cross_entropy():
    same(ops.softmax, rand(4, 6))
    targets = RNG.integers(0, 7, (3, 5))
    same(lambda z: ops.cross_entropy(z, from_host(targets)), rand(3, 5, 7))
    same(lambda z: ops.cross_entropy(z, from_host(targets), ignore_index=2), rand(3, 5, 7))
    ignored = np.full((2, 3), 4)
    out, grads = same(lambda z: ops.cross_entropy(z, from_host(ignored), ignore_index=4), rand(2, 3, 7))
    assert out[0] == 0 and not grads[0].any()  # every token ignored: loss 0, gradient 0


def test_linear_and_matmul():
    same(ops.linear, rand(2, 3, 4), rand(4, 5), rand(5))
    same(ops.matmul, rand(2, 3, 4), rand(2, 4, 5))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("tq,tk", [(6, 6), (130, 130), (4, 9)])  # 130: two causal query blocks
def test_attention(causal, tq, tk):
    if causal and tq != tk:
        pytest.skip("causal attention is for self-attention shapes here")
    same(lambda q, k, v: ops.attention(q, k, v, causal=causal), rand(2, 3, tq, 4), rand(2, 3, tk, 4),
         rand(2, 3, tk, 4))


@pytest.mark.parametrize("causal", [True, False])
def test_self_attention(causal):
    same(lambda qkv: ops.self_attention(qkv, 2, causal=causal), rand(2, 70, 3 * 8))
    # and the whole-array path equals attention on the split heads
    qkv = rand(2, 5, 3 * 8)
    want, _ = run("tuned", lambda t: ops.blockwise_self_attention(t, 4, causal=causal, block=2), [qkv])
    got, _ = run("whole", lambda t: ops.self_attention(t, 4, causal=causal), [qkv])
    np.testing.assert_allclose(got[0], want[0], rtol=1e-11, atol=1e-12)


BF16_EPS = 2.0**-7  # bfloat16 keeps 8 significant bits


def test_autocast_bf16_paths_agree():
    """Mixed precision: both paths round the same inputs to bf16 and compute in fp32.

    On NumPy the two paths give the same bits as a rule (measured gap: 0); once, deep in a full
    suite run, two of w's gradients differed by one float32 ulp (the BLAS's summation order can
    follow its operands' alignment), so they must agree to float32 round-off.  Under
    CuPy the whole-array path multiplies bf16 natively on the tensor cores, in another order
    than the tuned path's fp32 products: there they must agree to 4 bf16 eps normwise, the
    allowance of test_ops.py's autocast tests (a chain of products, each rounding its operands
    and result to bf16, measured <= 1.4 eps from fp32).  That autocast took effect is checked
    on each path against plain fp32 (whose upstream gradient is not rounded to bf16: part of
    the allowance): the output is bf16, the gradients fp32, and the values within 4 bf16 eps
    of fp32's (measured <= 1.4 eps) yet farther from them than fp32 round-off (2**-24 per
    operation) could put them: more than 2**-12 of the largest value."""
    def fn(qkv, w):
        with ops.autocast("bfloat16"):
            return ops.gelu(ops.linear(ops.self_attention(qkv, 2), w))

    def plain(qkv, w):
        return ops.gelu(ops.linear(ops.self_attention(qkv, 2), w))

    inputs = [rand(2, 6, 12).astype(np.float32), rand(4, 4).astype(np.float32)]
    tensors = [Tensor(from_host(a), requires_grad=True) for a in inputs]
    y = fn(*tensors)
    y.backward(xp.ones(y.shape, dtype=y.dtype))
    assert y.dtype == dtype("bfloat16") and all(t.grad.dtype == xp.float32 for t in tensors)
    results = {}
    for path in ("whole", "tuned"):
        got, ref = run(path, fn, inputs), run(path, plain, inputs)
        for i, (a, b) in enumerate(zip(got[0] + got[1], ref[0] + ref[1])):
            err = np.max(np.abs(a - b)) / np.max(np.abs(b))
            assert 2.0**-12 < err <= 4 * BF16_EPS, (path, i, err)
        results[path] = got
    for a, b in zip(results["whole"][0] + results["whole"][1], results["tuned"][0] + results["tuned"][1]):
        if BACKEND == "numpy":
            assert np.max(np.abs(a - b)) <= 2.0**-20 * np.max(np.abs(b))  # a few float32 ulps
        else:
            assert np.max(np.abs(a - b)) <= 4 * BF16_EPS * np.max(np.abs(b))


def test_adamw_update_paths_agree():
    from minidist.model.optim.functional import adamw_update

    start, results = (rand(40000), rand(40000), rand(40000), np.abs(rand(40000))), {}
    for path in ("whole", "tuned"):
        p, g, m, v = (from_host(a.copy()) for a in start)
        with tuning.use(path):
            for step in (1, 2, 3):
                adamw_update(p, g, m, v, step, 1e-2, 0.9, 0.95, 1e-8, 0.1)
        results[path] = [to_host(a) for a in (p, m, v)]
    for a, b in zip(results["whole"], results["tuned"]):
        np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-15)



@pytest.mark.parametrize("path", ["whole", "tuned"])
def test_column_sums_share_one_row_of_ones_and_stay_exact(path):
    """The bias and LayerNorm gradients' column sums multiply by a cached row of ones: views of
    one buffer per dtype that grows to the longest call, sums equal to sum(axis=0)."""
    from minidist.model.ops import linalg

    with tuning.use(path):
        for rows in (3, 2000, 5, 2000):
            g = from_host(rand(rows, 7))
            np.testing.assert_allclose(to_host(linalg.column_sums(g)), to_host(g).sum(axis=0), rtol=1e-12, atol=1e-10)
    first, longer = linalg.ones_row(5, xp.float64), linalg.ones_row(2000, xp.float64)
    assert first.shape == (5,) and longer.shape == (2000,) and float(to_host(longer.sum())) == 2000
    again = linalg.ones_row(7, xp.float64)
    assert xp.may_share_memory(again, longer)  # no new row for a shorter call
    assert not xp.may_share_memory(linalg.ones_row(7, xp.float32), again)  # one per dtype

def test_training_steps_equal_on_both_paths():
    from minidist.train.config import RunConfig
    from minidist.train.testing import train_steps

    cfg = RunConfig().replace(model=dict(layers=2, d_model=16, heads=2, dtype="float64"),
                              data=dict(seq_len=16, batch_size=4)).resolved(1)
    out = {}
    for path in ("whole", "tuned"):
        with tuning.use(path):
            out[path] = train_steps(cfg, 3)
    np.testing.assert_allclose(out["whole"][0], out["tuned"][0], rtol=1e-11)
    for name, a in out["tuned"][1].items():
        np.testing.assert_allclose(out["whole"][1][name], a, rtol=1e-9, atol=1e-12, err_msg=name)


def finite_difference_check(fn, *inputs, eps=1e-6, rtol=1e-5, atol=1e-7):
    """Backward of sum(out * R) against central differences, every input, on the current
    ops path and backend (arrays go to the device and back: this runs under CuPy too)."""
    outs, grads = run(tuning.current(), fn, inputs)
    weights = np.random.default_rng(3).standard_normal(outs[0].shape)

    def objective(values):
        t = [Tensor(from_host(v)) for v in values]
        return float((to_host(fn(*t).data) * weights).sum())

    for i, (a, g) in enumerate(zip(inputs, grads)):
        num = np.zeros(a.size)
        for j in range(a.size):
            vals = [v.copy() for v in inputs]
            vals[i].reshape(-1)[j] += eps
            up = objective(vals)
            vals[i].reshape(-1)[j] -= 2 * eps
            num[j] = (up - objective(vals)) / (2 * eps)
        np.testing.assert_allclose(g.reshape(-1), num, rtol=rtol, atol=atol, err_msg=f"input {i}")


@pytest.mark.parametrize("path", ["whole", "tuned"])
def test_gradients_against_finite_differences(path):
    """The op gradient checks of the suite's GPU run (make test-gpu): float64, both paths."""
    targets = RNG.integers(0, 5, (2, 3))
    with tuning.use(path):
        finite_difference_check(ops.gelu, rand(2, 3))
        finite_difference_check(lambda x, w, b: ops.layer_norm(x, w, b), rand(2, 4), rand(4), rand(4))
        finite_difference_check(ops.softmax, rand(2, 4))
        finite_difference_check(lambda z: ops.cross_entropy(z, from_host(targets)), rand(2, 3, 5))
        finite_difference_check(ops.linear, rand(2, 3), rand(3, 2), rand(2))
        finite_difference_check(lambda q, k, v: ops.attention(q, k, v), rand(1, 2, 3, 2), rand(1, 2, 3, 2),
                                rand(1, 2, 3, 2))
        finite_difference_check(lambda qkv: ops.self_attention(qkv, 2), rand(1, 3, 6))
        finite_difference_check(lambda qkv: ops.blockwise_self_attention(qkv, 2, block=2), rand(1, 3, 6))


@pytest.mark.skipif(BACKEND != "cupy", reason="the fused CuPy kernels need MINIDIST_BACKEND=cupy")
def test_fused_kernels_equal_their_plain_functions():
    import importlib

    from minidist.model.ops import nn_ops
    from minidist.model.ops.fused import adamw_kernel

    attention = importlib.import_module("minidist.model.ops.attention")  # ops.attention is also the function
    from minidist.model.optim.functional import _adamw_block

    x, t, g = (xp.asarray(rand(40, 25)) for _ in range(3))
    row, col = xp.asarray(rand(40, 1)), xp.asarray(rand(25))
    cases = [(nn_ops._gelu_forward, (x,)), (nn_ops._gelu_backward, (x, xp.tanh(t), g)),
             (nn_ops._ln_affine, (x, xp.abs(row), col, col)), (nn_ops._ln_input_grad, (x, t, xp.abs(row), row, row)),
             (attention._exp_shifted, (x, row)), (attention._softmax_grad, (x, row, t))]
    for fused, args in cases:
        got, want = fused(*args), fused.plain(*args)
        for a, b in zip(got if isinstance(got, tuple) else [got], want if isinstance(want, tuple) else [want]):
            np.testing.assert_allclose(to_host(a), to_host(b), rtol=1e-12, atol=1e-14, err_msg=repr(fused))
    # AdamW: the kernel against the array passes it replaces
    p, m, v = (xp.asarray(a) for a in (rand(1000), rand(1000), np.abs(rand(1000))))
    q, n, w = p.copy(), m.copy(), v.copy()
    hyper = (1 - 1e-3, 0.9, 0.95, 1e-8, 1 - 0.95 ** 3, 1e-2 / (1 - 0.9 ** 3))
    _adamw_block(q, g.reshape(-1)[:1000], n, w, xp.empty_like(q), *hyper)
    decay, b1, b2, eps, bc2, step = hyper
    adamw_kernel()(g.reshape(-1)[:1000], decay, b1, b2, eps, 1 / bc2 ** 0.5, step, p, m, v)
    for a, b in ((p, q), (m, n), (v, w)):
        np.testing.assert_allclose(to_host(a), to_host(b), rtol=1e-12, atol=1e-14)


@pytest.mark.skipif(BACKEND != "cupy", reason="minidist's CUDA kernels need MINIDIST_BACKEND=cupy")
@pytest.mark.parametrize("low", ["bfloat16", "float32"])
def test_a_gpt_step_with_the_cuda_kernels_equals_one_without(monkeypatch, low):
    """The model's loss and every parameter's gradient, with minidist's kernels (softmax and its
    gradient, GELU, LayerNorm: under bf16 the ones that read and write bf16) and without them
    (the xp forms and their casts): the same to bf16's rounding (float32: to float32's)."""
    from minidist.model.backend import dtype
    from minidist.layout.model import ModelConfig
    from minidist.model.nn import GPT

    ids = np.random.default_rng(0).integers(0, 256, size=(2, 17))
    got = {}
    for mode in ("auto", "off"):
        monkeypatch.setenv("MINIDIST_CUDA_KERNELS", mode)
        model = GPT(ModelConfig(block_size=16, layers=2, heads=2, d_model=32, dtype="float32"))
        if low == "float32":
            loss = model(ids[:, :-1], ids[:, 1:])
        else:
            with ops.autocast(dtype(low)):
                loss = model(ids[:, :-1], ids[:, 1:])
        loss.backward()
        got[mode] = [float(to_host(loss.data))] + [to_host(p.grad) for _, p in model.named_parameters()]
    tol = 3e-2 if low == "bfloat16" else 1e-4
    np.testing.assert_allclose(got["auto"][0], got["off"][0], rtol=tol)
    for (name, _), a, b in zip(model.named_parameters(), got["auto"][1:], got["off"][1:]):
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol * np.abs(b).max(), err_msg=name)
