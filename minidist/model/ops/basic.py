"""Elementwise arithmetic, reductions and shape ops, each with a hand-written backward.

Every backward follows the chain rule for its op and returns one gradient per input, in
that input's shape and dtype.  Broadcasting (NumPy rules) is undone in backward by
:func:`unbroadcast`: an input that was stretched along an axis receives the *sum* of the
gradient along that axis, because each of its elements was used that many times.

Constants: Python scalars (and plain arrays) may appear on either side of an arithmetic
op; they receive no gradient.  NumPy scalars are turned into Python numbers so that, under
NumPy 2's promotion rules (NEP 50), a ``np.float64`` constant cannot silently promote a
float32 tensor to float64.
"""

from __future__ import annotations

import builtins

from minidist.model.autograd import Tensor, make_tensor
from minidist.model.backend import from_host, host, host_read, is_low_precision, on_device, xp
from minidist.model.ops import cuda, tuning

# ----------------------------------------------------------------------------- helpers

builtin_sum = builtins.sum  # this module defines its own differentiable `sum`


def unbroadcast(g, shape):
    """Sum ``g`` down to ``shape`` (the inverse of NumPy broadcasting), in g's dtype: a
    low-precision ``g`` is added in float32 and rounded once (``sum_in_float32``)."""
    if g.shape == tuple(shape):
        return g
    extra = g.ndim - len(shape)
    axes = tuple(range(extra)) + tuple(
        i + extra for i, n in enumerate(shape) if n == 1 and g.shape[i + extra] != 1
    )
    g = sum_in_float32(g, axes, keepdims=True) if axes else g
    return g.reshape(shape)


def sum_in_float32(a, axis, keepdims=False):
    """``a.sum(axis)`` in a's dtype, added in float32 when a is float16 or bfloat16 (other
    dtypes in their own): a sum of many terms added in bfloat16 keeps few of its digits
    (minidist does no arithmetic in low precision; the one rounding is the result's)."""
    if not is_low_precision(a.dtype):
        return a.sum(axis=axis, keepdims=keepdims)
    return a.sum(axis=axis, keepdims=keepdims, dtype=xp.float32).astype(a.dtype)


def _operand(v):
    """(array or python scalar, is_tensor) for an arithmetic operand."""
    if isinstance(v, Tensor):
        return v.data, True
    if hasattr(v, "dtype") and getattr(v, "shape", None) == ():
        # NumPy scalar or 0-d array (np.float64 is even a subclass of float): use a python
        # number, which is weakly typed under NEP 50 and so keeps float32 tensors float32.
        return v.item(), False
    if isinstance(v, (bool, int, float)):
        return v, False
    if hasattr(v, "shape") and hasattr(v, "dtype"):
        return v, False
    raise TypeError(f"arithmetic operand must be a Tensor, number or array, got {type(v).__name__}")


def _grad_for(g, x):
    """``g`` reduced to tensor ``x``'s shape and cast to its dtype."""
    g = unbroadcast(g, x.shape)
    return g if g.dtype == x.dtype else g.astype(x.dtype)


def _binary(a, b, forward, grad_a, grad_b):
    """Shared plumbing: ``grad_a(g, A, B)`` / ``grad_b(g, A, B)`` give full-shape grads."""
    A, a_is_t = _operand(a)
    B, b_is_t = _operand(b)
    out = forward(A, B)

    def backward(g):
        ga = _grad_for(grad_a(g, A, B), a) if a_is_t and a.requires_grad else None
        gb = _grad_for(grad_b(g, A, B), b) if b_is_t and b.requires_grad else None
        return ga, gb

    return make_tensor(out, (a, b), backward)


# ----------------------------------------------------------------------------- arithmetic


def add(a, b) -> Tensor:
    """a + b with broadcasting; d/da = d/db = 1."""
    return _binary(a, b, lambda A, B: A + B, lambda g, A, B: g, lambda g, A, B: g)


def sub(a, b) -> Tensor:
    """a - b with broadcasting."""
    return _binary(a, b, lambda A, B: A - B, lambda g, A, B: g, lambda g, A, B: -g)


def mul(a, b) -> Tensor:
    """a * b with broadcasting; d/da = b, d/db = a."""
    return _binary(a, b, lambda A, B: A * B, lambda g, A, B: g * B, lambda g, A, B: g * A)


def div(a, b) -> Tensor:
    """a / b with broadcasting; d/da = 1/b, d/db = -a/b^2."""
    return _binary(
        a, b, lambda A, B: A / B, lambda g, A, B: g / B, lambda g, A, B: -(g * A) / (B * B)
    )


def neg(x: Tensor) -> Tensor:
    return make_tensor(-x.data, (x,), lambda g: (-g,))


def exp(x: Tensor) -> Tensor:
    y = xp.exp(x.data)
    return make_tensor(y, (x,), lambda g: (g * y,))


def log(x: Tensor) -> Tensor:
    X = x.data
    return make_tensor(xp.log(X), (x,), lambda g: (g / X,))


def tanh(x: Tensor) -> Tensor:
    y = xp.tanh(x.data)
    return make_tensor(y, (x,), lambda g: (g * (1.0 - y * y),))


def sqrt(x: Tensor) -> Tensor:
    y = xp.sqrt(x.data)
    return make_tensor(y, (x,), lambda g: (g / (2.0 * y),))


# ----------------------------------------------------------------------------- reductions


def _norm_axes(axis, ndim):
    if axis is None:
        return tuple(range(ndim))
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    for a in axes:
        if not -ndim <= a < ndim:
            raise ValueError(f"axis {a} out of range for a {ndim}-d tensor")
    return tuple(sorted(a % ndim for a in axes))


def _expand_back(g, x_shape, axes, keepdims):
    """Broadcast a reduced gradient back over the reduced axes (a read-only view)."""
    if not keepdims:
        shape = [1 if i in axes else n for i, n in enumerate(x_shape)]
        g = g.reshape(shape)
    return xp.broadcast_to(g, x_shape)


def sum(x: Tensor, axis=None, keepdims=False) -> Tensor:  # noqa: A001 (mirrors np.sum)
    """Sum over ``axis`` (int, tuple or None = all); every input element gets the grad."""
    axes = _norm_axes(axis, x.ndim)
    out = x.data.sum(axis=axes, keepdims=keepdims)
    return make_tensor(xp.asarray(out), (x,), lambda g: (_expand_back(g, x.shape, axes, keepdims),))


def mean(x: Tensor, axis=None, keepdims=False) -> Tensor:
    """Mean over ``axis``; each element gets grad / (number of elements averaged)."""
    axes = _norm_axes(axis, x.ndim)
    n = 1
    for a in axes:
        n *= x.shape[a]
    out = x.data.mean(axis=axes, keepdims=keepdims)
    scale = 1.0 / n if n else 0.0
    return make_tensor(
        xp.asarray(out), (x,), lambda g: (_expand_back(g * scale, x.shape, axes, keepdims),)
    )


# ----------------------------------------------------------------------------- shape ops


def reshape(x: Tensor, shape) -> Tensor:
    """A view with a new shape (-1 allowed); backward reshapes the gradient back."""
    shape = tuple(shape) if not isinstance(shape, int) else (shape,)
    try:
        out = x.data.reshape(shape)
    except ValueError:
        raise ValueError(f"cannot reshape tensor of shape {tuple(x.shape)} into {shape}") from None
    return make_tensor(out, (x,), lambda g: (g.reshape(x.shape),))


def transpose(x: Tensor, axes=None) -> Tensor:
    """Permute axes like ``np.transpose`` (None reverses them); backward applies the inverse."""
    axes = tuple(range(x.ndim))[::-1] if axes is None else tuple(a % x.ndim for a in axes)
    if sorted(axes) != list(range(x.ndim)):
        raise ValueError(f"axes {axes} is not a permutation of the {x.ndim} axes")
    inverse = tuple(sorted(range(x.ndim), key=axes.__getitem__))
    return make_tensor(x.data.transpose(axes), (x,), lambda g: (g.transpose(inverse),))


def split(x: Tensor, sections, axis=0) -> list[Tensor]:
    """Cut ``x`` along ``axis``.

    ``sections`` is either an int N (N equal parts, like ``np.split``; must divide the
    axis) or a list of part *sizes* (like ``torch.split`` with a list; must sum to the
    axis length).  Each part is a view of ``x``; in backward the parts' gradients are
    written side by side into one gradient array for ``x``.
    """
    axis %= x.ndim
    n = x.shape[axis]
    if isinstance(sections, int):
        if sections <= 0 or n % sections:
            raise ValueError(f"split: {sections} equal sections do not divide axis {axis} of length {n}")
        sizes = [n // sections] * sections
    else:
        sizes = [int(s) for s in sections]
        if builtin_sum(sizes) != n or any(s < 0 for s in sizes):
            raise ValueError(f"split: sizes {sizes} do not sum to axis {axis} length {n}")
    # All parts write their gradients into ONE shared buffer for x (instead of each making
    # a full-size array of zeros that autograd then adds up).  The buffer hangs off a
    # hidden node between x and the parts; the first part to run backward allocates it and
    # hands it to that node, the others fill in their slices, and the hidden node (created
    # before the parts, so it runs after them) passes it on to x and releases it.
    shared = {}

    def hidden_backward(g):
        shared.clear()  # the next backward pass (retain_graph) starts a fresh buffer
        return (g,)

    hidden = make_tensor(x.data, (x,), hidden_backward)
    parts, start = [], 0
    for size in sizes:
        index = (slice(None),) * axis + (slice(start, start + size),)
        parts.append(make_tensor(x.data[index], (hidden,), _part_backward(shared, index, x)))
        start += size
    return parts


def _part_backward(shared, index, x):
    def backward(g):
        first = "buf" not in shared
        if first:
            shared["buf"] = xp.zeros_like(x.data)  # same memory layout as x (order='K')
        shared["buf"][index] = g
        return (shared["buf"] if first else None,)

    return backward


def concat(tensors, axis=0) -> Tensor:
    """Join tensors along ``axis``; each input's gradient is its slice of the output's."""
    tensors = list(tensors)
    if not tensors:
        raise ValueError("concat needs at least one tensor")
    axis %= tensors[0].ndim
    out = xp.concatenate([t.data for t in tensors], axis=axis)
    bounds, start = [], 0
    for t in tensors:
        bounds.append((start, start + t.shape[axis]))
        start += t.shape[axis]

    def backward(g):
        pre = (slice(None),) * axis
        return tuple(
            _grad_for(g[pre + (slice(lo, hi),)], t) for t, (lo, hi) in zip(tensors, bounds)
        )

    return make_tensor(out, tuple(tensors), backward)


def _is_advanced(key) -> bool:
    keys = key if isinstance(key, tuple) else (key,)
    return any(hasattr(k, "dtype") or isinstance(k, (list, Tensor)) for k in keys)


def getitem(x: Tensor, key) -> Tensor:
    """``x[key]``: basic slicing gives a view and its backward writes into zeros; integer
    array indexing (possibly repeated) scatter-adds in backward."""
    if isinstance(key, Tensor):
        key = key.data
    if isinstance(key, tuple):
        key = tuple(k.data if isinstance(k, Tensor) else k for k in key)
    out = x.data[key]
    advanced = _is_advanced(key)

    def backward(g):
        gx = xp.zeros_like(x.data)  # keeps x's memory layout, so a later transpose is free
        if advanced:
            xp.add.at(gx, key, g)  # repeated indices must accumulate
        else:
            gx[key] = g
        return (gx,)

    return make_tensor(out, (x,), backward)


def check_range(idx, n, what="index"):
    """``idx`` (where it lies: a list becomes a host array) after checking that it is an
    integer array whose values lie in [0, n); a clear error otherwise.

    Where the check runs matters on a GPU.  A host array -- the batch as the sampler made it,
    a row's positions -- is checked where it lies, for free.  A device array's range has to be
    read back: a counted ``host_read``, one synchronisation that drains the GPU's queue.  So
    the training path hands the ops host batches and never pays it (with NumPy both cases are
    the first)."""
    idx = idx.data if isinstance(idx, Tensor) else idx
    device = on_device(idx)
    if not device:
        idx = host.asarray(idx)
    if idx.dtype.kind not in "iu":
        raise TypeError(f"{what} must be an integer array, got dtype {idx.dtype}")
    if idx.size:
        if device:
            lo, hi = (int(v) for v in host_read(xp.stack([idx.min(), idx.max()]), "index range"))  # one transfer
        else:
            lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= n:
            bad = lo if lo < 0 else hi
            raise IndexError(f"{what} value {bad} out of range [0, {n})")
    return idx


def check_index(idx, n, what="index"):
    """:func:`check_range`, then the index on the backend's device, ready to index with."""
    return from_host(check_range(idx, n, what))


def scatter_add_rows(idx, g, num_rows, dtype):
    """zeros((num_rows, *row_shape)) with the rows of ``g`` added at ``idx`` (repeats add up).

    Whole-array: ``add.at``, one scatter-add.  CPU-tuned: sort-and-segment-sum: sorting the
    indices groups the repeats, ``add.reduceat`` sums each group in one vectorised pass, and
    each distinct row is then written once.  (It is several times faster than ``np.add.at``,
    which handles one row at a time.)  On a GPU ``add.at`` is atomic adds, whose order, and
    so whose rounding, changes from run to run; ``cuda.scatter`` sums each row's repeats in
    index order instead, as ``add.at`` does on a CPU.
    """
    row_shape = tuple(g.shape[idx.ndim:])
    out = xp.zeros((num_rows,) + row_shape, dtype=dtype)
    flat = idx.reshape(-1)
    if flat.size == 0:
        return out
    if cuda.scatter.why_not(out) is None:
        return cuda.scatter.add_rows(flat, g, out)
    if not tuning.tuned() or not hasattr(xp.add, "reduceat"):  # the plain scatter-add (atomics on a GPU)
        xp.add.at(out, flat, g.reshape((-1,) + row_shape))
        return out
    order = xp.argsort(flat, kind="stable")
    rows = flat[order]
    starts = xp.flatnonzero(xp.concatenate([xp.ones(1, dtype=bool), rows[1:] != rows[:-1]]))
    sums = xp.add.reduceat(g.reshape((-1,) + row_shape)[order], starts, axis=0)
    out[rows[starts]] = sums
    return out


def index_rows(x: Tensor, idx) -> Tensor:
    """``x[idx]`` along axis 0 for an int array ``idx`` of any shape; backward scatter-adds."""
    idx = check_index(idx, x.shape[0], "index_rows idx")
    out = x.data[idx]
    return make_tensor(
        out, (x,), lambda g: (scatter_add_rows(idx, g, x.shape[0], x.dtype),)
    )
