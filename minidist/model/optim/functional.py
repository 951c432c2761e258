"""The update rules as in-place array functions, one call per parameter (or per flat shard).

Keeping the math apart from the optimizer classes means a ZeRO optimizer (Rajbhandari et al.
2020), which owns only a flat slice of every parameter, can apply exactly the same rule to its
slice.  The functions update ``p`` and the state buffers in place and never modify ``g``.

They run every step on every parameter, so they write through ``out=`` and in-place operators
into one ``scratch`` buffer (same shape as ``p``; allocated if not given) instead of creating a
temporary per arithmetic operation.  Hyperparameters are Python floats, so a float32 ``p``
stays float32.
"""

from __future__ import annotations

import math

from minidist.model.backend import xp
from minidist.model.ops import tuning
from minidist.model.ops.fused import adamw_kernel


def _scratch(p, scratch):
    if scratch is None:
        return xp.empty_like(p)
    if scratch.shape != p.shape:
        raise ValueError(f"scratch buffer shape {scratch.shape} != parameter shape {p.shape}")
    return scratch


def _sub_scaled(p, alpha, x, scratch, lib=xp):
    """p -= alpha * x, through ``scratch`` (which may be ``x`` itself: it is then overwritten)."""
    lib.multiply(x, alpha, out=scratch)
    p -= scratch


# AdamW makes ~14 passes over p, g, m and v.  Done array by array, every pass streams
# megabytes through main memory; done block by block, one block of all four arrays stays in
# the L2 cache for all 14 passes, so memory is read and written about once.  32K elements
# (128 KB per array, ~0.6 MB for the five arrays touched) fit a 1-2 MB L2 with room to spare.
_ADAM_BLOCK = 1 << 15


def _flat_view(a):
    """``a`` as a 1-d view (no copy), or ``None`` when its memory is not contiguous."""
    return a.reshape(-1) if a.flags.c_contiguous else None


def adamw_hyper(step, lr, beta1, beta2, wd):
    """(decay, 1/sqrt(bias correction 2), step size) of an AdamW step: the per-array numbers
    the fused kernels take (ops.fused.adamw_kernel, ops.cuda.multi_tensor.adamw)."""
    return 1.0 - lr * wd, 1.0 / math.sqrt(1.0 - beta2**step), lr / (1.0 - beta1**step)


def adamw_update(p, g, m, v, step, lr, beta1, beta2, eps, wd, scratch=None):
    """One AdamW step (Loshchilov & Hutter 2019, "Decoupled Weight Decay Regularization").

    ``step`` counts from 1 (the bias corrections divide by 1 - beta**step).  With
    m_hat = m / (1 - beta1**step) and v_hat = v / (1 - beta2**step)::

        p <- p * (1 - lr * wd)                      # decay the weights, not the gradient
        m <- beta1 * m + (1 - beta1) * g            # first moment (momentum)
        v <- beta2 * v + (1 - beta2) * g * g        # second moment
        p <- p - lr * m_hat / (sqrt(v_hat) + eps)

    The last line is evaluated as PyTorch does: lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps).
    Whole-array (``ops.tuning``): under CuPy one fused kernel (``ops.fused.adamw_kernel``),
    on NumPy the passes of ``_adamw_block`` over the whole arrays.  CPU-tuned: contiguous
    arrays are updated in cache-sized blocks (see ``_ADAM_BLOCK``).
    """
    if step < 1:
        raise ValueError(f"AdamW step must count from 1, got {step!r}")
    if g.shape != p.shape:
        raise ValueError(f"AdamW gradient shape {g.shape} != parameter shape {p.shape}")
    kernel = None if tuning.tuned() else adamw_kernel()
    if kernel is not None:  # whole-array under CuPy: one fused kernel
        t = p.dtype.type
        decay, inv_sqrt_bc2, step_size = adamw_hyper(step, lr, beta1, beta2, wd)
        kernel(g, t(decay), t(beta1), t(beta2), t(eps), t(inv_sqrt_bc2), t(step_size), p, m, v)
        return
    hyper = adamw_block_hyper(step, lr, beta1, beta2, eps, wd)
    if not tuning.tuned():  # whole-array on NumPy: the passes over the whole arrays
        _adamw_block(p, g, m, v, _scratch(p, scratch), *hyper)
        return
    flats = [_flat_view(a) for a in (p, m, v)]
    if any(f is None for f in flats):  # strided state (rare): one "block", the whole array
        _adamw_block(p, g, m, v, _scratch(p, scratch), *hyper)
        return
    P, M, V = flats
    G = g.reshape(-1)  # read only: a copy is fine if g is strided (e.g. a transposed grad)
    # the scratch only ever holds one block: a small buffer that stays in cache
    B = _scratch(p, scratch).reshape(-1) if scratch is not None else xp.empty(min(P.size, _ADAM_BLOCK), P.dtype)
    adamw_flat(P, G, M, V, B, hyper)


def adamw_block_hyper(step, lr, beta1, beta2, eps, wd):
    """The numbers :func:`adamw_flat` takes: (decay, beta1, beta2, eps, bias correction 2,
    step size)."""
    return 1.0 - lr * wd, beta1, beta2, eps, 1.0 - beta2**step, lr / (1.0 - beta1**step)


def adamw_flat(P, G, M, V, B, hyper, lib=xp):
    """AdamW on flat contiguous arrays in cache-sized blocks (``_ADAM_BLOCK``), through the
    scratch ``B`` (at least one block long); ``hyper`` from :func:`adamw_block_hyper`.
    ``lib`` is the arrays' module: ``xp``, or the host's NumPy for an offloaded step
    (optim/offload.py), which so runs the same passes in the same order."""
    for start in range(0, P.size, _ADAM_BLOCK):
        b = slice(start, start + _ADAM_BLOCK)
        pb = P[b]
        _adamw_block(pb, G[b], M[b], V[b], B[: pb.size], *hyper, lib=lib)


def _adamw_block(p, g, m, v, buf, decay, beta1, beta2, eps, bias_correction2, step_size, lib=xp):
    """The AdamW arithmetic on one block, in place, through the scratch ``buf``."""
    if decay != 1.0:
        p *= decay
    # m += (1 - beta1) * (g - m)  is  beta1 * m + (1 - beta1) * g  without a second buffer
    lib.subtract(g, m, out=buf)
    buf *= 1.0 - beta1
    m += buf
    v *= beta2
    lib.multiply(g, g, out=buf)
    buf *= 1.0 - beta2
    v += buf
    lib.sqrt(v, out=buf)
    buf /= math.sqrt(bias_correction2)
    buf += eps
    lib.divide(m, buf, out=buf)
    _sub_scaled(p, step_size, buf, buf, lib)


def sgd_update(p, g, buf, lr, momentum=0.0, wd=0.0, nesterov=False, scratch=None):
    """One step of SGD with (heavy-ball or Nesterov) momentum and L2 weight decay.

    Same rule as ``torch.optim.SGD`` with dampening 0 (Sutskever et al. 2013 for the Nesterov
    form used in deep learning)::

        d   <- g + wd * p                 # L2 penalty folded into the gradient
        buf <- momentum * buf + d         # buf starts at zero, so the first buf is d
        p   <- p - lr * (d + momentum * buf)   if nesterov
        p   <- p - lr * buf                     otherwise (or p - lr * d without momentum)

    ``buf`` (the momentum buffer) may be ``None`` when ``momentum == 0``.
    """
    if nesterov and not momentum:
        raise ValueError("Nesterov momentum needs momentum > 0")
    scratch = _scratch(p, scratch)
    d = g
    if wd:
        xp.multiply(p, wd, out=scratch)
        scratch += g
        d = scratch
    if momentum:
        if buf is None:
            raise ValueError("sgd_update with momentum needs a momentum buffer")
        buf *= momentum
        buf += d
        if nesterov:
            _sub_scaled(p, lr, d, scratch)  # the `d` part; then the `momentum * buf` part below
            _sub_scaled(p, lr * momentum, buf, scratch)
            return
        d = buf
    _sub_scaled(p, lr, d, scratch)
