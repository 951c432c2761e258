"""Fused elementwise kernels: the math written once as ``xp`` code, one GPU kernel under CuPy.

A chain of array expressions such as ``0.5 * x * (1 + tanh(c * x * (1 + a * x * x)))`` makes
one pass over memory (and, on a GPU, one kernel launch) per operation, each writing a
temporary.  Kernel fusion runs the whole chain per element in one pass: the intermediates
live in registers.  On a GPU, where elementwise ops are bound by memory bandwidth, that is a
several-fold speed-up of GELU, the optimizer update and the like (what ``torch.compile`` and
hand-written CUDA kernels do).

* :func:`elementwise` takes a function of arrays written with ``xp`` ufuncs.  On NumPy it is
  the function itself (one pass per operation; the CPU-tuned ops in ``nn_ops`` block the
  passes for the cache instead).  Under CuPy it is ``cupy.fuse(fn)``: CuPy traces the ufuncs
  once per dtype and compiles one kernel.  The plain function stays at ``.plain``, so a test
  on a GPU compares the fused kernel with it.
* :func:`adamw_kernel` is the AdamW update as a CuPy ``ElementwiseKernel`` (in-place on the
  parameter and both moments, which ``cupy.fuse`` does not write to); ``None`` on NumPy.
"""

from __future__ import annotations

from minidist.model.backend import BACKEND, xp

FUSED = BACKEND == "cupy"  # kernels are compiled only under CuPy


def elementwise(fn):
    """``fn`` (arrays -> array or tuple of arrays, elementwise ``xp`` math only) as one fused
    kernel under CuPy; on NumPy ``fn`` itself.  ``.plain`` is always the unfused function."""
    if not FUSED:
        fn.plain = fn
        return fn
    fused = xp.fuse(kernel_name="minidist_" + fn.__name__.strip("_"))(fn)
    try:
        fused.plain = fn
    except AttributeError:  # a Fusion object without a __dict__: wrap it
        inner = fused

        def fused(*args):
            return inner(*args)

        fused.plain = fn
    return fused


_kernels = {}


def adamw_kernel():
    """The AdamW update as one CuPy elementwise kernel (None on NumPy), built on first use.

    Inputs: g and the scalars (decay = 1 - lr*wd, beta1, beta2, eps, 1/sqrt(bias correction 2),
    step size = lr / bias correction 1); in-place outputs p, m, v.  Same order of operations
    as ``optim.functional._adamw_block`` (PyTorch's): p -= step * m / (sqrt(v)/sqrt(bc2) + eps).
    Scalars are passed in the parameter's dtype (``T``), so float32 runs in float32.
    """
    if not FUSED:
        return None
    k = _kernels.get("adamw")
    if k is None:
        k = _kernels["adamw"] = xp.ElementwiseKernel(
            "T g, T decay, T beta1, T beta2, T eps, T inv_sqrt_bc2, T step_size",
            "T p, T m, T v",
            """
            p = p * decay;
            m = m + (g - m) * (1 - beta1);
            v = v * beta2 + g * g * (1 - beta2);
            p = p - step_size * (m / (sqrt(v) * inv_sqrt_bc2 + eps));
            """,
            "minidist_adamw",
        )
    return k
