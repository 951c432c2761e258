"""Reverse-mode automatic differentiation on backend arrays.

A :class:`Tensor` holds an array (``.data``), its gradient (``.grad``) and, when it was made
by a differentiable op, the op's *context*: the input tensors and a function mapping the
output's gradient to the inputs' gradients.  ``backward()`` walks that graph once in reverse
topological order (the chain rule, as in any tape-based autograd).

Two things distributed training needs from autograd are built in here:

* **Gradient hooks** (:meth:`Parameter.register_grad_hook`): a hook fires the moment a
  parameter's gradient for this backward pass is complete, i.e. when the last op that used
  the parameter has delivered its contribution.  Data parallelism uses this to start the
  all-reduce of a gradient bucket while the backward pass continues (PyTorch DDP, Li et al.
  2020); ZeRO-2/3 use it to reduce-scatter and free gradients early.
* **Activation checkpointing** (:func:`checkpoint`; Chen et al. 2016, "Training Deep Nets
  with Sublinear Memory Cost"): run a function without recording its graph, keep only its
  inputs, and recompute the graph during backward.  Trades one extra forward for memory.
* **Backward in two parts** (:func:`deferred_weight_grads`; Qi et al. 2023, "Zero Bubble
  Pipeline Parallelism"): B, the gradients of the activations, now; W, the weights'
  gradients, later.  Zero-bubble pipeline schedules fill their idle time with the W's.

Parameters know their *global* shape and how they are sliced (``global_shape``,
``sharding``) so that sharding strategies and checkpoints can reassemble them.
"""

from __future__ import annotations

import contextlib
import itertools
import threading

from minidist.model.backend import xp

_state = threading.local()
_creation_counter = itertools.count()  # orders tensors by creation: a valid topological order


def is_grad_enabled() -> bool:
    return getattr(_state, "grad_enabled", True)


@contextlib.contextmanager
def set_grad_enabled(mode: bool):
    prev = is_grad_enabled()
    _state.grad_enabled = bool(mode)
    try:
        yield
    finally:
        _state.grad_enabled = prev


def no_grad():
    """Context manager: ops inside record no graph (evaluation, optimizer updates)."""
    return set_grad_enabled(False)


def enable_grad():
    return set_grad_enabled(True)


class Tensor:
    """An array with an optional gradient and the op that produced it."""

    __array_priority__ = 100  # so `ndarray + Tensor` defers to Tensor.__radd__

    def __init__(self, data, requires_grad: bool = False, name: str | None = None):
        self.data = data if hasattr(data, "dtype") and hasattr(data, "shape") else xp.asarray(data)
        self.grad = None
        self.requires_grad = bool(requires_grad)
        self.name = name
        self._ctx = None  # (parents, backward_fn) for op outputs; None for leaves
        self._seq = next(_creation_counter)  # parents are always created before their outputs

    # -- array-like conveniences -------------------------------------------------------
    shape = property(lambda self: self.data.shape)
    dtype = property(lambda self: self.data.dtype)
    ndim = property(lambda self: self.data.ndim)
    size = property(lambda self: self.data.size)

    def item(self) -> float:
        return float(self.data.reshape(-1)[0]) if self.data.size == 1 else float(self.data)

    def detach(self) -> "Tensor":
        """The same data as a new leaf, cut off from the graph."""
        return Tensor(self.data)

    def zero_grad(self):
        self.grad = None

    def __repr__(self):
        label = f" name={self.name!r}" if self.name else ""
        return f"Tensor(shape={tuple(self.shape)}, dtype={self.dtype}{label}, requires_grad={self.requires_grad})"

    def __len__(self):
        return len(self.data)

    def backward(self, grad=None, retain_graph: bool = False):
        """Accumulate d(self)/d(leaf) * grad into every leaf's ``.grad``.

        ``grad`` may be omitted only for a scalar (it is then 1).  Pipeline stages pass the
        gradient received from the next stage here.
        """
        if grad is None:
            if self.data.size != 1:
                raise ValueError(f"backward() of a non-scalar tensor {tuple(self.shape)} needs a grad")
            grad = xp.ones_like(self.data)
        grad = grad.data if isinstance(grad, Tensor) else grad
        if tuple(grad.shape) != tuple(self.shape):
            raise ValueError(f"grad shape {tuple(grad.shape)} != tensor shape {tuple(self.shape)}")
        run_backward([self], [grad], retain_graph=retain_graph)

    # Operator sugar (`a + b`, `a @ b`, ...) is attached by minidist.model.ops, which defines the ops.


class Parameter(Tensor):
    """A trainable leaf tensor.

    ``global_shape`` is the shape of the full (unsharded) parameter; ``sharding`` describes
    how this rank's ``data`` was cut from it (``None``: not sharded).  Later parallel
    strategies fill ``sharding``; the optimizer and checkpoints read it.
    """

    def __init__(self, data, name: str | None = None, global_shape=None, sharding=None):
        super().__init__(data, requires_grad=True, name=name)
        self.global_shape = tuple(global_shape) if global_shape is not None else tuple(self.data.shape)
        self.sharding = sharding
        self._grad_hooks = []

    def register_grad_hook(self, fn):
        """Call ``fn(param)`` each time this parameter's gradient of a backward pass is final.

        Returns a callable that removes the hook.
        """
        self._grad_hooks.append(fn)
        return lambda: self._grad_hooks.remove(fn)

    def __repr__(self):
        return "Parameter" + super().__repr__()[len("Tensor"):]


# ------------------------------------------------------------- backward in two parts (B, W)
class Deferred:
    """A gradient not computed yet: calling it computes it (once) and returns the array.

    Under :func:`deferred_weight_grads` the ops with weights (``linear``, ``layer_norm``,
    ``rms_norm``, ``embedding``, the sequence-parallel linears) return one of these for each
    weight instead of its gradient (:func:`weight_grad`)."""

    __slots__ = ("_fn", "_value")

    def __init__(self, fn):
        self._fn, self._value = fn, None

    def __call__(self):
        if self._fn is not None:
            self._value, self._fn = self._fn(), None
        return self._value


class WeightGradients:
    """The W of one backward call: the parameters whose gradients were deferred, each with
    its contributions in the order the joint backward would have added them.

    :meth:`run` computes them and finalizes each parameter through the same path as the joint
    backward (``.grad`` accumulation, then its hooks, in the order B would have fired them),
    so B then W gives the joint backward's gradients bit for bit, and each hook fires once."""

    def __init__(self):
        self._leaves = []  # [(parameter, [contributions: arrays and Deferred])]

    def __len__(self):
        return len(self._leaves)

    def add(self, leaf, contributions):
        self._leaves.append((leaf, contributions))

    def run(self):
        leaves, self._leaves = self._leaves, []
        for leaf, contributions in leaves:
            g, owned = _sum_contributions(contributions)
            _finalize_leaf(leaf, g, owned)


def _sum_contributions(contributions):
    """The sum of a node's gradient contributions, in order, with the joint backward's exact
    arithmetic (the first one borrowed, then ``a + b``, then ``+=``): (array or None, owned)."""
    total, owned = None, False
    for c in contributions:
        g = c() if isinstance(c, Deferred) else c
        if g is None:
            continue
        if total is None:
            total = g
        elif owned:
            total += g
        else:
            total, owned = total + g, True
    return total, owned


@contextlib.contextmanager
def deferred_weight_grads():
    """Context manager: backward calls inside compute only B, the activations' gradients;
    the weights' gradients are collected into the :class:`WeightGradients` it yields, W.

    The ops with weights hand back a :class:`Deferred` per weight (:func:`weight_grad`); the
    engine keeps them instead of adding them, and defers whole nodes that only lead to weights
    (``transpose(wte)`` of a tied head, ``concat`` of the q/k/v weights); a deferred gradient
    that reaches an activation after all is computed on the spot, so nothing is ever wrong,
    only earlier.  A parameter whose gradient has any deferred part is finalized (``.grad``,
    hooks) by ``run()``, i.e. in W; the others as usual in B.  Activation checkpointing defers
    through its recomputation; ZeRO-3's per-block backward computes its blocks' W inside B
    (it reduce-scatters them right there)."""
    work = WeightGradients()
    prev = getattr(_state, "deferred", None)
    _state.deferred = work
    try:
        yield work
    finally:
        _state.deferred = prev


def deferring() -> bool:
    """Whether backward calls now defer the weights' gradients (:func:`deferred_weight_grads`)."""
    return getattr(_state, "deferred", None) is not None


def weight_grad(fn):
    """A weight's gradient: ``fn()`` now, or ``Deferred(fn)`` under :func:`deferred_weight_grads`.
    ``fn`` must only read arrays that stay unchanged until W (the saved input, the output's
    gradient; not the weight's ``.data``, which ZeRO-3 frees)."""
    return Deferred(fn) if deferring() else fn()


def make_tensor(data, parents, backward_fn) -> Tensor:
    """The output of a differentiable op.

    ``backward_fn(grad_out)`` returns one gradient (or ``None``) per entry of ``parents``.
    The graph is recorded only when grad mode is on and some parent needs a gradient.
    """
    out = Tensor(data)
    if is_grad_enabled() and any(isinstance(p, Tensor) and p.requires_grad for p in parents):
        out.requires_grad = True
        out._ctx = (parents, backward_fn)
    return out


def _topological_order(roots):
    """Nodes reachable from ``roots`` that need gradients, parents before children,
    and for each node how many graph edges will deliver a gradient to it."""
    order, pending, seen = [], {}, set()
    stack = [(r, False) for r in roots if r.requires_grad]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if id(node) in seen:
            continue
        seen.add(id(node))
        stack.append((node, True))
        if node._ctx is not None:
            for p in node._ctx[0]:
                if isinstance(p, Tensor) and p.requires_grad:
                    pending[id(p)] = pending.get(id(p), 0) + 1
                    if id(p) not in seen:
                        stack.append((p, False))
    return order, pending


def _finalize_leaf(leaf: Tensor, g, owned: bool):
    """Store a leaf's complete gradient of this pass and fire its hooks."""
    if g is not None:
        if g.dtype != leaf.dtype:
            g, owned = g.astype(leaf.dtype), True
        if leaf.grad is None:
            # Copy borrowed arrays: an op may hand the same array to several inputs.
            leaf.grad = g if owned else g.copy()
        else:
            leaf.grad += g
    for hook in getattr(leaf, "_grad_hooks", ()):
        hook(leaf)


def run_backward(roots, grads, retain_graph: bool = False, capture=(), defer_captured: bool = False):
    """Backpropagate ``grads`` (arrays) from ``roots`` (tensors) through the recorded graph.

    Leaves listed in ``capture`` are not finalized: their gradients are returned instead, as
    ``{id(leaf): grad}`` (activation checkpointing hands them on to the outer graph); with
    ``defer_captured`` a parameter's deferred gradient is returned as a :class:`Deferred`.
    """
    order, pending = _topological_order(roots)
    # Run op nodes in reverse creation order (a valid reverse topological order, since a
    # node is created after its inputs).  Unlike the DFS order, this makes gradients become
    # final -- and hooks fire -- in reverse order of use in forward, as DDP buckets expect.
    order.sort(key=lambda node: node._seq)
    acc = {}  # id(node) -> [grad array, owned?]
    # id(node) -> its contributions in order, once one of them is Deferred (W: deferred_weight_grads)
    lazy = {}
    captured, capture_ids = {}, {id(t) for t in capture}
    work = getattr(_state, "deferred", None)

    def finalize(leaf):
        contributions = lazy.pop(id(leaf), None)
        if contributions is None:
            g, owned = acc.pop(id(leaf), (None, False))
            if id(leaf) in capture_ids:
                captured[id(leaf)] = g
            else:
                _finalize_leaf(leaf, g, owned)
        elif not isinstance(leaf, Parameter) or (work is None and id(leaf) not in capture_ids):
            # an activation (the stage's input) is B's result: whatever was deferred, now
            g, owned = _sum_contributions(contributions)
            if id(leaf) in capture_ids:
                captured[id(leaf)] = g
            else:
                _finalize_leaf(leaf, g, owned)
        elif id(leaf) in capture_ids:
            captured[id(leaf)] = (Deferred(lambda: _sum_contributions(contributions)[0]) if defer_captured
                                  else _sum_contributions(contributions)[0])
        else:
            work.add(leaf, contributions)

    def deliver(node, g):
        if g is None:
            return
        contributions = lazy.get(id(node))
        if contributions is not None:
            contributions.append(g)
            return
        slot = acc.get(id(node))
        if isinstance(g, Deferred):  # from now on keep the contributions as they come
            lazy[id(node)] = ([] if slot is None or slot[0] is None else [slot[0]]) + [g]
            acc.pop(id(node), None)
        elif slot is None or slot[0] is None:
            acc[id(node)] = [g, False]
        elif slot[1]:
            slot[0] += g  # our own buffer: accumulate in place
        else:
            acc[id(node)] = [slot[0] + g, True]

    for r, g in zip(roots, grads):
        if r.requires_grad:
            deliver(r, g)
    for r in roots:
        if r.requires_grad and r._ctx is None and pending.get(id(r), 0) == 0:
            finalize(r)

    for node in reversed(order):
        if node._ctx is None:
            continue  # leaves are finalized when their last consumer has run
        parents, backward_fn = node._ctx
        contributions = lazy.pop(id(node), None)
        if contributions is not None and all(isinstance(c, Deferred) for c in contributions):
            # only weights' gradients flow through this node (transpose(wte), concat of
            # weights): its backward waits for W too, run once for all its parents
            both = Deferred(lambda fn=backward_fn, cs=contributions: fn(_sum_contributions(cs)[0]))
            parent_grads = [Deferred(lambda i=i, both=both: both()[i]) for i in range(len(parents))]
        else:
            g = (_sum_contributions(contributions)[0] if contributions is not None
                 else acc.pop(id(node), (None, False))[0])
            parent_grads = backward_fn(g) if g is not None else (None,) * len(parents)
        if not retain_graph:
            node._ctx = None  # frees the saved activations as soon as possible
        for p, pg in zip(parents, parent_grads):
            if not (isinstance(p, Tensor) and p.requires_grad):
                continue
            deliver(p, pg)
            pending[id(p)] -= 1
            if pending[id(p)] == 0 and p._ctx is None:
                finalize(p)
    return captured


def checkpoint(fn, *args, params=None):
    """Run ``fn(*args)`` without keeping its activations; recompute them in backward.

    ``fn`` must return one Tensor and be deterministic.  The parameters ``fn`` uses
    (``params``, by default ``fn.parameters()`` when ``fn`` is a module) become inputs of
    the checkpoint in the graph: the recomputation hands their gradients to the outer
    backward, so a parameter used both inside and outside ``fn`` (tied weights) still gets
    one complete gradient and fires its hooks once.  Parameters not listed receive their
    gradients (and fire their hooks) during the recomputation.
    """
    if not is_grad_enabled():
        return fn(*args)
    if params is None:
        params = fn.parameters() if hasattr(fn, "parameters") else ()
    params = [p for p in params if p.requires_grad]
    with no_grad():
        out = fn(*args)
    if not isinstance(out, Tensor):
        raise TypeError("checkpoint(fn, ...) needs fn to return a single Tensor")

    def backward_fn(g):
        inputs = [Tensor(a.data, requires_grad=a.requires_grad) if isinstance(a, Tensor) else a for a in args]
        tensor_inputs = [i for i in inputs if isinstance(i, Tensor)]
        with enable_grad():
            recomputed = fn(*inputs)
        grads = run_backward([recomputed], [g], capture=tensor_inputs + params, defer_captured=True)
        return tuple(grads.get(id(t)) for t in tensor_inputs + params)

    result = Tensor(out.data)
    result.requires_grad = True  # even if no input needs a gradient: parameters inside may
    result._ctx = (tuple(a for a in args if isinstance(a, Tensor)) + tuple(params), backward_fn)
    return result
