"""Scaled dot-product attention (Vaswani et al. 2017) as one fused node.

    S = scale * Q K^T (+ causal mask),   P = softmax(S),   O = P V

Forward keeps P (the attention probabilities, B*H*T*T values; fine at minidist's sizes,
where FlashAttention would instead recompute them blockwise).  Backward:

    dV = P^T dO
    dP = dO V^T
    dS = P * (dP - rowsum(dO * O))       # softmax backward; rowsum(dP * P) == rowsum(dO * O)
    dQ = scale * dS K,   dK = scale * dS^T Q

The identity rowsum(dP * P) = rowsum(dO * O) (used by FlashAttention-2, Dao 2023) lets the
softmax correction be computed on (T, D) arrays instead of (T, T) ones.  All products stay
batched over (B, H) so each is one call into BLAS per head.
"""

from __future__ import annotations

import math

from ..autograd import Tensor, make_tensor
from ..backend import xp
from .nn_ops import _softmax_inplace
from .precision import gemm_operands, to_dtype

_MASKS = {}  # (Tq, Tk, dtype) -> additive mask, 0 where allowed and -inf above the diagonal


def causal_mask(tq: int, tk: int, dtype):
    """Additive causal mask, cached: query i may attend to keys j <= i (top-left aligned,
    like ``torch.nn.functional.scaled_dot_product_attention(is_causal=True)``)."""
    key = (tq, tk, xp.dtype(dtype).str)
    mask = _MASKS.get(key)
    if mask is None:
        mask = xp.triu(xp.full((tq, tk), -xp.inf, dtype=dtype), k=1)
        mask.flags.writeable = False  # shared between calls
        _MASKS[key] = mask
    return mask


def attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = True, scale=None) -> Tensor:
    """Attention for q (B, H, Tq, D), k and v (B, H, Tk, D) -> (B, H, Tq, D).

    ``scale`` defaults to 1/sqrt(D).  Any matching leading dims work (not only B, H).
    """
    if q.ndim < 2 or k.shape != v.shape or q.shape[:-2] != k.shape[:-2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"attention shapes do not fit: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    D = q.shape[-1]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    (Q, K, V), out_dtype = gemm_operands(q.data, k.data, v.data)
    P = Q @ K.swapaxes(-1, -2)
    P *= scale
    if causal:
        P += causal_mask(Q.shape[-2], K.shape[-2], P.dtype)
    _softmax_inplace(P, -1)
    O = P @ V

    def backward(g):
        dO = to_dtype(g, O.dtype)
        dV = P.swapaxes(-1, -2) @ dO if v.requires_grad else None
        dS = dO @ V.swapaxes(-1, -2)  # dP, turned into dS in place below
        delta = xp.einsum("...i,...i->...", dO, O)[..., None]
        dS -= delta
        dS *= P
        dS *= scale
        dQ = dS @ K if q.requires_grad else None
        dK = dS.swapaxes(-1, -2) @ Q if k.requires_grad else None
        return to_dtype(dQ, q.dtype), to_dtype(dK, k.dtype), to_dtype(dV, v.dtype)

    return make_tensor(to_dtype(O, out_dtype), (q, k, v), backward)
