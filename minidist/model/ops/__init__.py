"""Differentiable ops with hand-written backward passes, written as NumPy (``xp``) code.

The ops: ``basic`` (arithmetic with broadcasting, reductions, shape ops, indexing),
``linalg`` (matmul, linear, add_bias), ``nn_ops`` (gelu, softmax, layer_norm, embedding,
cross_entropy), ``llama_ops`` (rms_norm, rotary, swiglu, repeat_kv), ``attention``
(fused scaled dot-product attention), ``blockwise`` (the same
attention in tiles with the online softmax, FlashAttention) and ``precision``
(autocast, cast).  Importing this package also attaches operator sugar to
:class:`~minidist.model.autograd.Tensor` (``a + b``, ``a @ b``, ``x[:, 1:3]``, ``x.sum()``...).

How they run: ``tuning`` picks whole-array or CPU-tuned for the whole process; the CPU-tuned
path spreads work over the BLAS threads (``blas_threads``); ``fused`` makes elementwise
``xp`` code one kernel under CuPy, and ``causal_blocks`` skips causal attention's masked
blocks.  The GPU speed-ups are in ``cuda/``: minidist's CUDA kernels and cuBLAS's strided
batched GEMM, each replacing a piece of an op above on CuPy (its docstring says when).
"""

from __future__ import annotations

from minidist.model.autograd import Tensor
from minidist.model.ops.attention import attention, causal_mask, self_attention
from minidist.model.ops.blockwise import blockwise_attention, blockwise_self_attention, check_block
from minidist.model.ops.basic import (
    add,
    concat,
    div,
    exp,
    getitem,
    index_rows,
    log,
    mean,
    mul,
    neg,
    reshape,
    split,
    sqrt,
    sub,
    sum,
    tanh,
    transpose,
    unbroadcast,
)
from minidist.model.ops.linalg import add_bias, linear, matmul
from minidist.model.ops.llama_ops import repeat_kv, rms_norm, rotary, swiglu
from minidist.model.ops.nn_ops import cross_entropy, embedding, gelu, layer_norm, softmax
from minidist.model.ops.precision import autocast, cast, get_autocast_dtype

__all__ = [
    "add", "sub", "mul", "div", "neg", "exp", "log", "tanh", "sqrt", "sum", "mean",
    "reshape", "transpose", "split", "concat", "getitem", "index_rows", "unbroadcast",
    "matmul", "linear", "add_bias", "gelu", "softmax", "layer_norm", "embedding", "cross_entropy",
    "attention", "self_attention", "causal_mask", "blockwise_attention", "blockwise_self_attention",
    "check_block", "cast", "autocast", "get_autocast_dtype", "rms_norm", "rotary", "swiglu", "repeat_kv",
]


def _shape_args(args):
    """Allow both ``x.reshape(2, 3)`` and ``x.reshape((2, 3))``."""
    return tuple(args[0]) if len(args) == 1 and isinstance(args[0], (tuple, list)) else args


def _attach_operator_sugar():
    T = Tensor
    T.__add__ = lambda a, b: add(a, b)
    T.__radd__ = lambda a, b: add(b, a)
    T.__sub__ = lambda a, b: sub(a, b)
    T.__rsub__ = lambda a, b: sub(b, a)
    T.__mul__ = lambda a, b: mul(a, b)
    T.__rmul__ = lambda a, b: mul(b, a)
    T.__truediv__ = lambda a, b: div(a, b)
    T.__rtruediv__ = lambda a, b: div(b, a)
    T.__neg__ = lambda a: neg(a)
    T.__matmul__ = lambda a, b: matmul(a, b)
    T.__rmatmul__ = lambda a, b: matmul(b if isinstance(b, Tensor) else Tensor(b), a)
    T.__getitem__ = lambda a, key: getitem(a, key)
    T.reshape = lambda a, *shape: reshape(a, _shape_args(shape))
    T.transpose = lambda a, *axes: transpose(a, _shape_args(axes) if axes else None)
    T.sum = lambda a, axis=None, keepdims=False: sum(a, axis, keepdims)
    T.mean = lambda a, axis=None, keepdims=False: mean(a, axis, keepdims)


_attach_operator_sugar()
