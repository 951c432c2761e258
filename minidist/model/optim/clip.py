"""Gradient clipping by global norm (Pascanu et al. 2013, "On the difficulty of training RNNs").

All gradients are scaled by one factor so that their joint L2 norm is at most ``max_norm``;
the direction of the update is kept.  The norm is split into two steps so that a distributed
trainer can insert a sum across ranks in the middle::

    sq = grad_norm_sq(my_params)              # local sum of squares (float64)
    sq = all_reduce(sq)                       # distributed only: over ranks holding different grads
    total = sq ** 0.5
    scale_grads(my_params, clip_coefficient(total, max_norm))
"""

from __future__ import annotations

import math

from minidist.model.backend import host_read, xp
from minidist.model.ops.cuda import multi_tensor


def grad_norm_sq(params) -> float:
    """Sum of squares of all present gradients, accumulated in float64.

    float64 matters: summing millions of fp16/fp32 squares in their own precision loses
    digits and can overflow fp16.  Parameters with ``grad is None`` contribute nothing.
    """
    return total_sum_of_squares(p.grad for p in params if p.grad is not None)


def _squares(a):
    """The sum of the squares of an array's elements, accumulated in float64, as a 0-d array
    (on the device under CuPy: no host synchronisation)."""
    g = a.reshape(-1).astype(xp.float64, copy=False)
    return xp.dot(g, g)


def sum_of_squares(a) -> float:
    """The sum of the squares of an array's elements, accumulated in float64."""
    return float(_squares(a))


def total_sum_of_squares(arrays) -> float:
    """The sum of the squares of every array's elements (float64), brought to the host once:
    on a GPU one synchronisation per step instead of one per gradient (the same additions in
    the same order as summing :func:`sum_of_squares` of each).  On CuPy, arrays of one dtype
    go through one multi-tensor kernel (ops.cuda.multi_tensor: the same squares in float64,
    added in another order) instead of a few launches each."""
    arrays = list(arrays)
    if multi_tensor.why_not(arrays) is None:
        return float(host_read(multi_tensor.sum_of_squares(arrays), "gradient norm"))
    total = None
    for a in arrays:
        s = _squares(a)
        total = s if total is None else total + s
    return 0.0 if total is None else float(host_read(total, "gradient norm"))


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """The factor min(1, max_norm / (total_norm + 1e-6)) (1e-6 as in PyTorch, avoiding 0/0)."""
    return min(1.0, max_norm / (total_norm + 1e-6))


def scale_grads(params, factor: float):
    """Multiply every present gradient by ``factor`` in place (skipped when factor is 1)."""
    if factor == 1.0:
        return
    grads = [p.grad for p in params if p.grad is not None]
    if multi_tensor.why_not(grads) is None:
        multi_tensor.scale(grads, factor)  # one launch for all of them
        return
    for g in grads:
        g *= factor


def clip_grad_norm(params, max_norm: float) -> float:
    """Scale gradients so their global L2 norm is at most ``max_norm``; return the norm before.

    A non-finite norm (an overflowed fp16 gradient) is returned and the gradients are left as
    they are: scaling by 0 would turn inf into nan and hide the cause.  The loss scaler's
    ``found_inf`` check is what decides to skip such a step.
    """
    max_norm = float(max_norm)
    if not max_norm > 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm!r}")
    params = list(params)
    total = math.sqrt(grad_norm_sq(params))
    if math.isfinite(total):
        scale_grads(params, clip_coefficient(total, max_norm))
    return total
