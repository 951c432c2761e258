"""Backward in two parts (zero-bubble pipelines): B, the activations' gradients, then W, the
weights' gradients (``autograd.deferred_weight_grads``).  B then W must give the joint
backward's gradients bit for bit (float64), and each gradient hook must fire once, with the
complete gradient, in the order the joint backward fires them.  Under ``MINIDIST_BACKEND=cupy``
the inputs go to the GPU (``_normal``) and the gradients are compared on the host."""
import numpy as np
import pytest

from minidist.model import backend, ops
from minidist.model.autograd import Parameter, Tensor, deferred_weight_grads
from minidist.layout.model import ModelConfig
from minidist.model.nn import GPT
from minidist.model.ops import tuning

RNG = np.random.default_rng(7)


def _normal(shape):
    """Standard normal values drawn on the host, on the backend's device."""
    return backend.from_host(RNG.standard_normal(shape))


def _equal(a, b, **kw):
    np.testing.assert_array_equal(backend.to_host(a), backend.to_host(b), **kw)


def _leaves(*shapes):
    return [Parameter(_normal(s), name=f"p{i}") for i, s in enumerate(shapes)]


def _backward(build, params, x, g, deferred):
    """x.grad, the params' grads and the hook calls [(name, grad)] of ``build()``'s backward,
    joint or B (checked: x's gradient done, no parameter's touched) then W."""
    calls = []
    for p in params:
        p.grad, p._grad_hooks = None, [lambda q: calls.append((q.name, q.grad.copy()))]
    x.grad = None
    out = build()
    if not deferred:
        out.backward(g)
    else:
        with deferred_weight_grads() as w:
            out.backward(g)
        assert x.grad is not None, "B computes the input's gradient"
        assert all(p.grad is None for p in params) and not calls, "B leaves the weights to W"
        assert len(w) == len(params)
        w.run()
    return x.grad, [p.grad for p in params], calls


def _check_split(build, params, x, g):
    joint, split = (_backward(build, params, x, g, deferred) for deferred in (False, True))
    _equal(split[0], joint[0])
    for a, b in zip(split[1], joint[1]):
        _equal(a, b)
    assert [n for n, _ in split[2]] == [n for n, _ in joint[2]], "each hook once, in the joint order"
    for (_, a), (_, b) in zip(split[2], joint[2]):
        _equal(a, b)


@pytest.mark.parametrize("path", ["whole", "tuned"])
def test_each_op_with_weights_b_then_w_equals_joint(path):
    with tuning.use(path):
        x = Tensor(_normal((3, 5, 4)), requires_grad=True)
        w, b = _leaves((4, 6), (6,))
        _check_split(lambda: ops.linear(x, w, b), [w, b], x, _normal((3, 5, 6)))
        _check_split(lambda: ops.linear(x, w), [w], x, _normal((3, 5, 6)))
        gain, shift = _leaves((4,), (4,))
        _check_split(lambda: ops.layer_norm(x, gain, shift), [gain, shift], x, _normal((3, 5, 4)))
        _check_split(lambda: ops.rms_norm(x, gain), [gain], x, _normal((3, 5, 4)))
        table, = _leaves((10, 4))
        ids = np.array([[1, 2, 1], [9, 0, 1]])  # repeated ids: the scatter-add sums them
        _check_split(lambda: ops.embedding(table, ids) * x[:2, :3], [table], x, _normal((2, 3, 4)))


def test_weight_only_nodes_wait_for_w_and_a_weight_used_twice_sums_in_order():
    """A tied head (linear through transpose(w)) and a weight used by three ops: the
    contributions are added in the joint backward's order (bitwise, with 3 terms)."""
    x = Tensor(_normal((4, 6)), requires_grad=True)
    w, = _leaves((5, 6))

    def build():
        h = ops.linear(x, ops.transpose(w, (1, 0)))          # (4, 5): deferred through transpose
        h = ops.tanh(ops.linear(ops.tanh(h), w))              # (4, 6): w again, directly
        return ops.linear(h, ops.transpose(w, (1, 0))) * 0.5  # and a third time
    _check_split(build, [w], x, _normal((4, 5)))


def test_a_deferred_gradient_reaching_an_activation_is_computed_in_b():
    """An activation used only as linear's weight: its gradient (and x's behind it) must not wait."""
    x = Tensor(_normal((4, 4)), requires_grad=True)
    a, = _leaves((3, 4))
    _check_split(lambda: ops.linear(a, ops.tanh(x)), [], x, _normal((3, 4)))


def _stage_run(model, h, y, deferred):
    """A pipeline stage's B (and W): blocks from a received activation, then the head's loss."""
    x_in = Tensor(h, requires_grad=True)
    loss = model.loss(model.head(model.run_blocks(x_in)), y)
    if not deferred:
        loss.backward()
        return x_in, None
    with deferred_weight_grads() as work:
        loss.backward()
    return x_in, work


@pytest.mark.parametrize("arch,checkpointing", [("gpt2", False), ("gpt2", True), ("llama", False)])
def test_whole_stage_and_model_b_then_w_equals_joint(arch, checkpointing):
    cfg = dict(vocab_size=32, block_size=6, layers=2, heads=2, d_model=8, dtype="float64", arch=arch)
    model = GPT(ModelConfig(**cfg))
    model.checkpoint_activations = checkpointing
    params = model.parameters()
    ids = RNG.integers(0, 32, size=(2, 7))
    x, y = ids[:, :-1], ids[:, 1:]
    h = _normal((2, 6, 8))

    def grads(deferred, whole):
        calls = []
        for p in params:
            p.grad, p._grad_hooks = None, [lambda q: calls.append(q.name)]
        if whole:  # the whole model, tied embedding used by the lookup and the head
            x_in = None
            if deferred:
                with deferred_weight_grads() as work:
                    model(x, y).backward()
            else:
                model(x, y).backward()
        else:
            x_in, work = _stage_run(model, h, y, deferred)
        if deferred:
            assert x_in is None or x_in.grad is not None
            assert not calls, f"hooks fired in B: {calls}"  # every parameter's gradient waits for W
            work.run()
        return (None if x_in is None else x_in.grad), [p.grad for p in params], calls

    for whole in (False, True):
        a, b = grads(False, whole), grads(True, whole)
        if a[0] is not None:
            _equal(a[0], b[0])
        for ga, gb, p in zip(a[1], b[1], params):
            assert (ga is None) == (gb is None), p.name
            if ga is not None:
                _equal(ga, gb, err_msg=p.name)
        assert b[2] == a[2], "every hook once, in the joint backward's order"
        assert len(b[2]) == len(set(b[2]))
