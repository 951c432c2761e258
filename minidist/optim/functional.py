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

from minidist.backend import xp


def _scratch(p, scratch):
    if scratch is None:
        return xp.empty_like(p)
    if scratch.shape != p.shape:
        raise ValueError(f"scratch buffer shape {scratch.shape} != parameter shape {p.shape}")
    return scratch


def _sub_scaled(p, alpha, x, scratch):
    """p -= alpha * x, through ``scratch`` (which may be ``x`` itself: it is then overwritten)."""
    xp.multiply(x, alpha, out=scratch)
    p -= scratch


def adamw_update(p, g, m, v, step, lr, beta1, beta2, eps, wd, scratch=None):
    """One AdamW step (Loshchilov & Hutter 2019, "Decoupled Weight Decay Regularization").

    ``step`` counts from 1 (the bias corrections divide by 1 - beta**step).  With
    m_hat = m / (1 - beta1**step) and v_hat = v / (1 - beta2**step)::

        p <- p * (1 - lr * wd)                      # decay the weights, not the gradient
        m <- beta1 * m + (1 - beta1) * g            # first moment (momentum)
        v <- beta2 * v + (1 - beta2) * g * g        # second moment
        p <- p - lr * m_hat / (sqrt(v_hat) + eps)

    The last line is evaluated as PyTorch does: lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps).
    """
    if step < 1:
        raise ValueError(f"AdamW step must count from 1, got {step!r}")
    buf = _scratch(p, scratch)
    if wd:
        p *= 1.0 - lr * wd
    # m += (1 - beta1) * (g - m)  is  beta1 * m + (1 - beta1) * g  without a second buffer
    xp.subtract(g, m, out=buf)
    buf *= 1.0 - beta1
    m += buf
    v *= beta2
    xp.multiply(g, g, out=buf)
    buf *= 1.0 - beta2
    v += buf
    bias_correction1 = 1.0 - beta1**step
    bias_correction2 = 1.0 - beta2**step
    xp.sqrt(v, out=buf)
    buf /= math.sqrt(bias_correction2)
    buf += eps
    xp.divide(m, buf, out=buf)
    _sub_scaled(p, lr / bias_correction1, buf, buf)


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
