"""The autograd core: accumulation, upstream grads, no_grad, grad hooks, checkpointing."""
import numpy as np
import pytest

from minidist.model import ops
from minidist.model.autograd import Parameter, Tensor, checkpoint, no_grad

RNG = np.random.default_rng(1)


def param(*shape, name=None):
    return Parameter(RNG.standard_normal(shape), name=name)


def test_diamond_graph_accumulates():
    # y = a*x + b*x uses x twice (and z = x*x uses it twice as the same op input).
    x = param(3)
    a, b = 2.0, -0.5
    y = ops.mul(x, a) + ops.mul(x, b) + x * x
    y.sum().backward()
    np.testing.assert_allclose(x.grad, a + b + 2 * x.data)


def test_deeper_diamond_through_shared_intermediate():
    x = param(4)
    h = ops.tanh(x)  # h feeds two branches that meet again
    out = (ops.exp(h) * h).sum()
    out.backward()
    t = np.tanh(x.data)
    np.testing.assert_allclose(x.grad, (np.exp(t) * t + np.exp(t)) * (1 - t * t))


def test_backward_with_upstream_grad_on_non_scalar():
    x, w = param(2, 3), param(3, 4)
    y = ops.matmul(x, w)
    g = RNG.standard_normal((2, 4))
    y.backward(g)
    np.testing.assert_allclose(x.grad, g @ w.data.T)
    np.testing.assert_allclose(w.grad, x.data.T @ g)
    with pytest.raises(ValueError, match="needs a grad"):
        ops.matmul(x, w).backward()
    with pytest.raises(ValueError, match=r"\(4, 2\)"):
        ops.matmul(x, w).backward(np.ones((4, 2)))


def test_grad_accumulates_across_backward_calls():
    x, w = param(3, 5), param(5, 2)
    targets = np.array([0, 1, 1])
    loss = ops.cross_entropy(ops.matmul(x, w), targets)
    loss.backward(retain_graph=True)
    first = w.grad.copy()
    loss.backward()  # same graph again: the gradient doubles
    np.testing.assert_allclose(w.grad, 2 * first)
    ops.cross_entropy(ops.matmul(x, w), targets).backward()  # a freshly built graph adds once more
    np.testing.assert_allclose(w.grad, 3 * first)
    w.zero_grad()
    assert w.grad is None


def test_no_grad_records_nothing():
    x = param(3)
    with no_grad():
        y = ops.exp(x) * 2.0
        z = ops.sum(y)
    assert not y.requires_grad and y._ctx is None and z._ctx is None
    y2 = ops.exp(x)  # grad mode is back on afterwards
    assert y2.requires_grad and y2._ctx is not None


def test_constants_do_not_require_grad():
    c = Tensor(np.ones(3))
    y = ops.exp(c) * 3.0
    assert not y.requires_grad and y._ctx is None


def _mlp_with_hooks():
    """x -> w1 -> tanh -> w2 -> (+ w1 again: tied) ; records hook calls."""
    w1, w2, w3 = param(4, 4, name="w1"), param(4, 4, name="w2"), param(4, 1, name="w3")
    calls = []

    def hook(p):
        calls.append((p.name, p.grad.copy()))

    for p in (w1, w2, w3):
        p.register_grad_hook(hook)
    return w1, w2, w3, calls


def test_grad_hooks_fire_once_after_full_gradient_in_reverse_use_order():
    w1, w2, w3, calls = _mlp_with_hooks()
    x = Tensor(RNG.standard_normal((5, 4)))
    h = ops.tanh(ops.matmul(x, w1))
    h = ops.tanh(ops.matmul(h, w2))
    h = ops.matmul(h, w1) + h  # w1 used a second time, late in forward
    out = ops.matmul(h, w3).sum()
    out.backward()
    names = [n for n, _ in calls]
    assert sorted(names) == ["w1", "w2", "w3"], "each hook exactly once"
    # w3 was used last, then w1 (second use), w2; w1's gradient is complete only after its
    # first use has been reached, i.e. after w2's, so the order is w3, w2, w1.
    assert names == ["w3", "w2", "w1"]
    for name, g in calls:
        p = {"w1": w1, "w2": w2, "w3": w3}[name]
        np.testing.assert_array_equal(g, p.grad)  # the hook saw the final, summed gradient
    # A second backward fires every hook once more.
    ops.matmul(ops.tanh(ops.matmul(x, w1)), w3).sum().backward()
    assert [n for n, _ in calls[3:]] == ["w3", "w1"]


def test_grad_hooks_fire_in_reverse_forward_order_across_parallel_branches():
    ws = [param(3, name=f"w{i}") for i in range(4)]
    order = []
    for w in ws:
        w.register_grad_hook(lambda p: order.append(p.name))
    x = Tensor(RNG.standard_normal(3))
    branches = [ops.mul(x, w) for w in ws]  # independent branches, used in order w0..w3
    total = branches[0]
    for b in branches[1:]:
        total = total + b
    total.sum().backward()
    assert order == ["w3", "w2", "w1", "w0"]


def test_hook_removal():
    w = param(2)
    seen = []
    remove = w.register_grad_hook(lambda p: seen.append(1))
    (w * 2.0).sum().backward()
    remove()
    (w * 2.0).sum().backward()
    assert seen == [1]


def _block(h, w1, w2):
    return ops.matmul(ops.gelu(ops.matmul(h, w1)), w2) + h


def test_checkpoint_gives_identical_gradients_and_keeps_no_graph():
    w1, w2 = param(4, 6), param(6, 4)
    x0 = RNG.standard_normal((3, 4))

    def run(use_checkpoint):
        for p in (w1, w2):
            p.zero_grad()
        x = Tensor(x0, requires_grad=True)
        inner = []

        def fn(h):
            out = _block(h, w1, w2)
            inner.append(out)
            return out

        h = ops.tanh(x)
        h = checkpoint(fn, h) if use_checkpoint else fn(h)
        loss = (h * h).sum()
        if use_checkpoint:
            assert inner[0]._ctx is None and not inner[0].requires_grad, "graph kept inside fn"
        loss.backward()
        return x.grad.copy(), w1.grad.copy(), w2.grad.copy(), loss.item()

    plain, ckpt = run(False), run(True)
    for a, b in zip(plain, ckpt):
        np.testing.assert_array_equal(a, b)


def test_checkpoint_fires_inner_parameter_hooks_once():
    w1, w2 = param(4, 6, name="w1"), param(6, 4, name="w2")
    fired = []
    for p in (w1, w2):
        p.register_grad_hook(lambda p: fired.append(p.name))
    x = Tensor(RNG.standard_normal((2, 4)))  # input needs no grad; params inside do
    out = checkpoint(_block, x, w1, w2)
    out.sum().backward()
    assert sorted(fired) == ["w1", "w2"]
    assert w1.grad is not None and w2.grad is not None


def test_checkpoint_hands_parameter_grads_to_outer_graph():
    """A weight used inside a checkpointed function AND outside it (tied weights) gets one
    complete gradient, equal to the plain run's, and its hook fires exactly once."""
    w = param(4, 4, name="w")
    x = Tensor(RNG.standard_normal((3, 4)))

    class Inner:
        def parameters(self):
            return [w]

        def __call__(self, h):
            return ops.gelu(h @ w)

    def run(use_checkpoint):
        w.grad, fired = None, []
        remove = w.register_grad_hook(lambda p: fired.append(p.grad.copy()))
        h = checkpoint(Inner(), x) if use_checkpoint else Inner()(x)
        (h @ w).sum().backward()  # w used again outside the checkpoint
        remove()
        return w.grad.copy(), fired

    plain, plain_fired = run(False)
    ckpt, ckpt_fired = run(True)
    np.testing.assert_allclose(ckpt, plain, rtol=1e-12)
    assert len(plain_fired) == 1 and len(ckpt_fired) == 1
    np.testing.assert_allclose(ckpt_fired[0], plain, rtol=1e-12)
