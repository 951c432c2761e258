"""Scaled dot-product attention (Vaswani et al. 2017) as one fused node.

    S = scale * Q K^T (+ causal mask),   P = softmax(S),   O = P V

Forward keeps P (the attention probabilities, B*H*T*T values; fine at minidist's sizes,
where FlashAttention would instead recompute them blockwise).  Backward:

    dV = P^T dO
    dP = dO V^T
    dS = P * (dP - rowsum(dO * O))       # softmax backward; rowsum(dP * P) == rowsum(dO * O)
    dQ = scale * dS K,   dK = dS^T (scale * Q)

The identity rowsum(dP * P) = rowsum(dO * O) (used by FlashAttention-2, Dao 2023) lets the
softmax correction be computed on (T, D) arrays instead of (T, T) ones.
"""

from __future__ import annotations

import itertools
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
        if hasattr(mask.flags, "writeable"):
            mask.flags.writeable = False  # shared between calls: guard against in-place use
        _MASKS[key] = mask
    return mask


def _chunks(lead_shape):
    """Index tuples over the leading axes except the last (the heads): each chunk is one
    (H, T, T) slab of scores, small enough to stay in cache through softmax and matmuls."""
    return itertools.product(*(range(n) for n in lead_shape[:-1]))


def attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = True, scale=None) -> Tensor:
    """Attention for q (B, H, Tq, D), k and v (B, H, Tk, D) -> (B, H, Tq, D).

    ``scale`` defaults to 1/sqrt(D).  Any matching leading dims work (not only B, H).
    The work runs one batch element at a time (all heads together), so the (H, T, T)
    scores stay in cache across their softmax and the two products around it.
    """
    if q.ndim < 2 or k.shape != v.shape or q.shape[:-2] != k.shape[:-2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"attention shapes do not fit: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    D = q.shape[-1]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    (Q, K, V), out_dtype = gemm_operands(q.data, k.data, v.data)
    Qs = Q * scale  # scaling Q (T*D values) is cheaper than scaling the scores (T*T)
    lead, Tq, Tk = Q.shape[:-2], Q.shape[-2], K.shape[-2]
    P = xp.empty(lead + (Tq, Tk), dtype=Qs.dtype)  # probabilities, kept for backward
    O = xp.empty(lead + (Tq, V.shape[-1]), dtype=Qs.dtype)
    mask = causal_mask(Tq, Tk, Qs.dtype) if causal else None
    for i in _chunks(lead):
        p = P[i]
        xp.matmul(Qs[i], K[i].swapaxes(-1, -2), out=p)
        if mask is not None:
            p += mask
        _softmax_inplace(p, -1)
        xp.matmul(p, V[i], out=O[i])

    def backward(g):
        dO = to_dtype(g, O.dtype)
        delta = xp.einsum("...i,...i->...", dO, O)[..., None]  # rowsum(dO * O)
        dQ, dK, dV = xp.empty_like(Qs), xp.empty_like(Qs, shape=K.shape), xp.empty_like(Qs, shape=V.shape)
        for i in _chunks(lead):
            p, do = P[i], dO[i]
            ds = do @ V[i].swapaxes(-1, -2)  # dP, turned into dS in place
            ds -= delta[i]
            ds *= p
            xp.matmul(p.swapaxes(-1, -2), do, out=dV[i])
            xp.matmul(ds, K[i], out=dQ[i])
            xp.matmul(ds.swapaxes(-1, -2), Qs[i], out=dK[i])  # Qs carries the scale
        dQ *= scale
        return to_dtype(dQ, q.dtype), to_dtype(dK, k.dtype), to_dtype(dV, v.dtype)

    return make_tensor(to_dtype(O, out_dtype), (q, k, v), backward)
