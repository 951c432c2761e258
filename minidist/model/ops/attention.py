"""Scaled dot-product attention (Vaswani et al. 2017) as one fused node.

    S = scale * Q K^T (+ causal mask),   P = softmax(S),   O = P V

Forward keeps P (the attention probabilities, B*H*T*T values; fine at minidist's sizes;
``blockwise.py`` recomputes them tile by tile instead, as FlashAttention does).  Backward:

    dV = P^T dO
    dP = dO V^T
    dS = P * (dP - rowsum(dO * O))       # softmax backward; rowsum(dP * P) == rowsum(dO * O)
    dQ = scale * dS K,   dK = dS^T (scale * Q)

The identity rowsum(dP * P) = rowsum(dO * O) (used by FlashAttention-2, Dao 2023) lets the
softmax correction be computed on (T, D) arrays instead of (T, T) ones.

The plain form is :func:`_attend` / :func:`_attend_backward`: each line of the formulas is one
batched array call over every (batch, head) pair at once -- what a GPU wants (a handful of
big kernels) and what CuPy runs.  On a CPU (``tuning.tuned()``) the same math runs slab by
slab (one batch element at a time, see below), the slabs spread over the BLAS threads.

Two entry points share these kernels:

* :func:`attention` takes q, k, v laid out (..., H, T, D);
* :func:`self_attention` takes the fused QKV projection (B, T, 3C) as the GPT block makes
  it and returns (B, T, C).  It reads each head's Q, K, V as strided views of that array and
  writes each head's output straight into its columns of the (B, T, C) result, so the
  model needs no head-splitting transpose copies (three in forward, three in backward).
"""

from __future__ import annotations

import itertools
import math

from minidist.model.autograd import Tensor, make_tensor
from minidist.model.backend import xp
from minidist.model.ops import causal_blocks, cuda, tuning
from minidist.model.ops.blas_threads import parallel_for
from minidist.model.ops.cuda import gemm
from minidist.model.ops.fused import elementwise
from minidist.model.ops.nn_ops import _softmax_inplace
from minidist.model.ops.precision import compute_dtype, gemm_operands, to_dtype

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


# ------------------------------------------------------------------ whole-array kernels


def _attend(qs, k, v, causal, out=None):
    """(P, P_op, O) for q (already scaled), k, v of shape (..., T, D), as batched products; O
    is written into ``out`` when given (a strided view: the heads of a (B, T, C) array).

    Low-precision operands (mixed precision on CuPy): the products run in that dtype (tensor
    cores, fp32 accumulation), the scores are widened to float32 for the mask and softmax, and
    P is rounded back to the operands' dtype for P V: that is P_op, kept for backward's
    P^T dO too (P_op is P itself when the dtypes agree).  P is float32 (for the softmax's
    gradient).  On CuPy the softmax is one CUDA kernel (``cuda/softmax.py``) with the same
    arithmetic; it reads bfloat16 scores as they are, writes P_op, and keeps the scores and
    their rows' statistics as P (``cuda.softmax.Rows``), from which backward recomputes it.
    With the kernels, causal self-attention's products skip the masked blocks above the
    diagonal (causal_blocks.py), in backward too.
    """
    parts = _causal_parts(qs, k, causal)
    s = causal_blocks.lower_scores(qs, k, parts) if parts else gemm.matmul(qs, k.swapaxes(-1, -2))
    if cuda.source.is_bf16(s) and cuda.softmax.why_not(s) is None:
        p, p_op = cuda.softmax.softmax(s, causal)
        return p, p_op, _times(p_op, v, parts, out)
    s = to_dtype(s, compute_dtype(s.dtype))
    if cuda.softmax.why_not(s) is None:
        p = cuda.softmax.softmax(s, causal)
    else:
        if causal:
            s += causal_mask(s.shape[-2], s.shape[-1], s.dtype)
        p = _exp_shifted(s, s.max(axis=-1, keepdims=True))  # softmax: exp(s - rowmax) / rowsum
        p /= p.sum(axis=-1, keepdims=True)
    p_op = to_dtype(p, qs.dtype)
    return p, p_op, _times(p_op, v, parts, out)


def _causal_parts(qs, k, causal):
    """The query blocks (causal_blocks.py) in which causal self-attention's products skip the
    masked blocks above the diagonal, or None for whole products: only where the softmax
    kernels run, which never read those blocks' unwritten scores."""
    if not causal or qs.shape[-2] != k.shape[-2] or cuda.softmax.why_not(qs) is not None:
        return None
    parts = causal_blocks.blocks(qs.shape[-2])
    return parts if len(parts) > 1 else None


def _times(m, b, parts, out=None):
    """m @ b for the probabilities (or dS) m: on the blocks at and below the diagonal with parts."""
    return causal_blocks.lower_times(m, b, parts, out) if parts else gemm.matmul(m, b, out=out)


def _t_times(m, b, parts, out=None):
    """m^T @ b, likewise."""
    return causal_blocks.lower_t_times(m, b, parts, out) if parts else gemm.matmul(m.swapaxes(-1, -2), b, out=out)


@elementwise
def _exp_shifted(s, m):
    """exp(s - m): one pass over the T x T scores under CuPy (two as separate ops)."""
    return xp.exp(s - m)


@elementwise
def _softmax_grad(dp, delta, p):
    """dS = P * (dP - delta), delta = rowsum(dO * O): one pass under CuPy."""
    return p * (dp - delta)


def _attend_backward(qs, k, v, p, p_op, o, do, causal, out=(None, None, None)):
    """(dQ unscaled -- the caller multiplies by the scale --, dK, dV) of :func:`_attend`,
    written into the arrays of ``out`` where given.

    On CuPy the softmax gradient is one kernel (``cuda/softmax.py``) that reads dP in the
    products' dtype (bfloat16 under mixed precision) and writes dS in it; its delta is the
    row's sum of P * dP, equal to rowsum(dO * O) up to rounding."""
    low = qs.dtype  # dP = dO V^T comes out in it
    kernel = isinstance(p, cuda.softmax.Rows) or (cuda.softmax.why_not(qs) is None and p.dtype == low)
    # causal blocks leave dP's masked blocks unwritten: only the kernel, which never reads them, may use them
    parts = _causal_parts(qs, k, causal) if kernel else None
    dv = _t_times(p_op, do, parts, out[2])
    dp = causal_blocks.lower_scores(do, v, parts) if parts else gemm.matmul(do, v.swapaxes(-1, -2))
    if kernel:
        ds = cuda.softmax.softmax_grad(dp, p, causal)
    else:
        dp = to_dtype(dp, p.dtype)  # in float32
        delta = xp.einsum("...i,...i->...", to_dtype(do, p.dtype), to_dtype(o, p.dtype))[..., None]
        ds = to_dtype(_softmax_grad(dp, delta, p), low)
    return _times(ds, k, parts, out[0]), _t_times(ds, qs, parts, out[1]), dv


# ------------------------------------------------------------------ per-slab kernels (CPU tuning)
# A "slab" is all heads of one batch element: q, k, v, o are (H, T, D) arrays (possibly
# strided views), p is the (H, Tq, Tk) probability slab.  A slab's scores (256 KB at
# H=4, T=128) stay in cache through the softmax and the two products around it.
#
# Causal self-attention skips the tiles above the diagonal, as FlashAttention does: rows
# are cut into blocks of _CAUSAL_BLOCK queries, and query block [i0, i1) only ever meets
# keys [0, i1) -- the rest of its row is masked, its probabilities exactly 0.  With two
# blocks (T = 128) a quarter of every product and of the softmax is never computed; those
# tiles of P and dS are never written nor read.

_CAUSAL_BLOCK = 64


def _query_blocks(tq: int, tk: int, causal: bool):
    """(i0, i1, kk) triples: query rows [i0, i1) attend to keys [0, kk)."""
    if not causal or tq != tk:  # one block with every key (the mask does the causal part)
        return [(0, tq, tk)]
    return [(i0, min(i0 + _CAUSAL_BLOCK, tq), min(i0 + _CAUSAL_BLOCK, tq)) for i0 in range(0, tq, _CAUSAL_BLOCK)]


def _forward_slab(qs, k, v, p, o, mask, blocks):
    """p <- softmax(qs k^T + mask), o <- p v, by query blocks.  ``qs`` carries the scale."""
    for i0, i1, kk in blocks:
        pb = p[..., i0:i1, :kk]
        xp.matmul(qs[..., i0:i1, :], k[..., :kk, :].swapaxes(-1, -2), out=pb)
        if mask is not None:
            pb += mask[i0:i1, :kk]
        _softmax_inplace(pb, -1)
        xp.matmul(pb, v[..., :kk, :], out=o[..., i0:i1, :])


def _backward_slab(qs, k, v, p, o, do, dq, dk, dv, ds, blocks):
    """Write dq (unscaled: the caller multiplies by ``scale``), dk and dv of one slab.
    ``ds`` is a (H, Tq, Tk) scratch slab."""
    delta = xp.einsum("...i,...i->...", do, o)[..., None]  # rowsum(dO * O)
    for i0, i1, kk in blocks:  # dS and dQ, query block by query block
        dsb = ds[..., i0:i1, :kk]
        xp.matmul(do[..., i0:i1, :], v[..., :kk, :].swapaxes(-1, -2), out=dsb)  # dP ...
        dsb -= delta[..., i0:i1, :]
        dsb *= p[..., i0:i1, :kk]  # ... turned into dS in place
        xp.matmul(dsb, k[..., :kk, :], out=dq[..., i0:i1, :])
    # dK and dV, key block by key block: keys [j0, j1) are seen by queries j0.. only (with
    # one block: all keys, all queries; blocked: the grid is square, so j1 == that block's i1)
    for j0, _, j1 in blocks:
        xp.matmul(p[..., j0:, j0:j1].swapaxes(-1, -2), do[..., j0:, :], out=dv[..., j0:j1, :])
        xp.matmul(ds[..., j0:, j0:j1].swapaxes(-1, -2), qs[..., j0:, :], out=dk[..., j0:j1, :])


def _check_scale(D, scale):
    return 1.0 / math.sqrt(D) if scale is None else float(scale)


# ------------------------------------------------------------------ q, k, v entry point


def _chunks(lead_shape):
    """Index tuples over the leading axes except the last (the heads): one slab each."""
    return list(itertools.product(*(range(n) for n in lead_shape[:-1])))


def attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = True, scale=None) -> Tensor:
    """Attention for q (B, H, Tq, D), k and v (B, H, Tk, D) -> (B, H, Tq, D).

    ``scale`` defaults to 1/sqrt(D).  Any matching leading dims work (not only B, H).
    The work runs one batch element at a time (all heads together).
    """
    if q.ndim < 2 or k.shape != v.shape or q.shape[:-2] != k.shape[:-2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"attention shapes do not fit: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    scale = _check_scale(q.shape[-1], scale)
    (Q, K, V), out_dtype = gemm_operands(q.data, k.data, v.data)
    if tuning.tuned():  # the CPU-tuned slabs multiply in float32 for low-precision operands, on any backend
        Q, K, V = (to_dtype(a, compute_dtype(a.dtype)) for a in (Q, K, V))
    # scaling Q (T*D values) is cheaper than scaling the scores (T*T); a low-precision Q stays
    # so (CuPy computes bfloat16 * float in float32), or every product would run in float32
    Qs = to_dtype(Q * scale, Q.dtype)
    lead, Tq, Tk = Q.shape[:-2], Q.shape[-2], K.shape[-2]
    if not tuning.tuned():  # whole-array: a few batched products
        P, P_op, O = _attend(Qs, K, V, causal)

        def backward(g):
            dQ, dK, dV = _attend_backward(Qs, K, V, P, P_op, O, to_dtype(g, O.dtype), causal)
            dQ *= scale
            return to_dtype(dQ, q.dtype), to_dtype(dK, k.dtype), to_dtype(dV, v.dtype)

        return make_tensor(to_dtype(O, out_dtype), (q, k, v), backward)
    # CPU-tuned: one slab (all heads of one batch element) at a time, on the BLAS threads
    P = xp.empty(lead + (Tq, Tk), dtype=Qs.dtype)  # probabilities, kept for backward
    O = xp.empty(lead + (Tq, V.shape[-1]), dtype=Qs.dtype)
    mask = causal_mask(Tq, Tk, Qs.dtype) if causal else None
    blocks = _query_blocks(Tq, Tk, causal)
    chunks = _chunks(lead)
    parallel_for(chunks, lambda i: _forward_slab(Qs[i], K[i], V[i], P[i], O[i], mask, blocks))

    def backward(g):
        dO = to_dtype(g, O.dtype)
        dQ, dK, dV = xp.empty_like(Qs), xp.empty_like(Qs, shape=K.shape), xp.empty_like(Qs, shape=V.shape)

        def slab(i, ds):
            _backward_slab(Qs[i], K[i], V[i], P[i], O[i], dO[i], dQ[i], dK[i], dV[i], ds, blocks)

        parallel_for(chunks, slab, scratch=[(P[chunks[0]].shape, P.dtype)])
        dQ *= scale
        return to_dtype(dQ, q.dtype), to_dtype(dK, k.dtype), to_dtype(dV, v.dtype)

    return make_tensor(to_dtype(O, out_dtype), (q, k, v), backward)


# ------------------------------------------------------------------ fused-QKV entry point


def self_attention(qkv: Tensor, n_head: int, causal: bool = True, scale=None) -> Tensor:
    """Multi-head self-attention on a fused projection qkv (B, T, 3C) -> (B, T, C).

    Columns [0, C) of ``qkv`` are the queries, [C, 2C) the keys, [2C, 3C) the values; head h
    owns columns [h*D, (h+1)*D) of each part (D = C / n_head), the GPT-2 layout.  Same math
    as ``attention`` on the (B, H, T, D) split, without materialising that split.
    """
    if qkv.ndim != 3 or qkv.shape[-1] % 3:
        raise ValueError(f"self_attention needs qkv of shape (B, T, 3C), got {tuple(qkv.shape)}")
    B, T, C3 = qkv.shape
    C = C3 // 3
    if not isinstance(n_head, int) or n_head <= 0 or C % n_head:
        raise ValueError(f"self_attention: n_head={n_head!r} does not divide C={C}")
    H, D = n_head, C // n_head
    scale = _check_scale(D, scale)
    (X,), out_dtype = gemm_operands(qkv.data)
    if tuning.fused_attention(X.dtype, D):
        return _self_attention_flash(qkv, X, out_dtype, B, T, H, D, causal, scale)
    if not tuning.tuned():
        return _self_attention_whole(qkv, X, out_dtype, B, T, H, D, causal, scale)
    X = to_dtype(X, compute_dtype(X.dtype))  # the tuned slabs multiply in float32 (see attention)

    def heads(a, b, part):
        """Part (0 = Q, 1 = K, 2 = V, or the output for a (B, T, C) array) of batch element
        b as an (H, T, D) strided view: no copy."""
        return a[b, :, part * C:(part + 1) * C].reshape(T, H, D).transpose(1, 0, 2)

    P = xp.empty((B, H, T, T), dtype=X.dtype)  # probabilities, kept for backward
    Y = xp.empty((B, T, C), dtype=X.dtype)
    mask = causal_mask(T, T, X.dtype) if causal else None
    blocks = _query_blocks(T, T, causal)

    def forward(b, qs):
        xp.multiply(heads(X, b, 0), scale, out=qs)  # scale Q (T*D values), not the scores (T*T)
        _forward_slab(qs, heads(X, b, 1), heads(X, b, 2), P[b], heads(Y, b, 0), mask, blocks)

    parallel_for(range(B), forward, scratch=[((H, T, D), X.dtype)])

    def backward(g):
        G = to_dtype(g, Y.dtype)
        dX = xp.empty_like(X)

        def slab(b, qs, ds):
            xp.multiply(heads(X, b, 0), scale, out=qs)  # recomputed: cheaper than storing it
            dq = heads(dX, b, 0)
            _backward_slab(qs, heads(X, b, 1), heads(X, b, 2), P[b], heads(Y, b, 0), heads(G, b, 0),
                           dq, heads(dX, b, 1), heads(dX, b, 2), ds, blocks)
            dq *= scale

        parallel_for(range(B), slab, scratch=[((H, T, D), X.dtype), ((H, T, T), X.dtype)])
        return (to_dtype(dX, qkv.dtype),)

    return make_tensor(to_dtype(Y, out_dtype), (qkv,), backward)


def _self_attention_whole(qkv, X, out_dtype, B, T, H, D, causal, scale) -> Tensor:
    """:func:`self_attention` as batched products on the (B, H, T, D) split of ``X``.

    The split is a strided view, whose batch and head axes step through memory with two
    strides, so each product is a cuBLAS call per batch element (``cuda/gemm.py``).  With causal blocks,
    which multiply the calls by the blocks, the heads are copied contiguous first (one copy
    each way per layer): every block is then one call over all (batch, head) pairs."""
    C = H * D

    def heads(a, part):  # part (0 = Q, 1 = K, 2 = V) of a (B, T, 3C) array as (B, H, T, D)
        return a[..., part * C:(part + 1) * C].reshape(B, T, H, D).transpose(0, 2, 1, 3)

    if _causal_parts(heads(X, 0), heads(X, 1), causal):
        return _self_attention_copied(qkv, X, out_dtype, B, T, H, D, scale)
    Qs, K, V = to_dtype(heads(X, 0) * scale, X.dtype), heads(X, 1), heads(X, 2)  # as in attention()
    Y = xp.empty((B, T, C), dtype=X.dtype)  # P V lands in its heads: no copy merges them
    P, P_op, O = _attend(Qs, K, V, causal, out=heads(Y, 0))

    def backward(g):
        dO = to_dtype(g, O.dtype).reshape(B, T, H, D).transpose(0, 2, 1, 3)
        dX = xp.empty((B, T, 3 * C), dtype=X.dtype)  # dQ, dK, dV land in its three parts
        dQ, _, _ = _attend_backward(Qs, K, V, P, P_op, O, dO, causal, out=(heads(dX, 0), heads(dX, 1), heads(dX, 2)))
        dQ *= scale
        return (to_dtype(dX, qkv.dtype),)

    return make_tensor(to_dtype(Y, out_dtype), (qkv,), backward)


def _self_attention_flash(qkv, X, out_dtype, B, T, H, D, causal, scale) -> Tensor:
    """:func:`self_attention` as the tensor-core FlashAttention-2 kernels (``cuda/flash_mma.py``):
    Q, K and V read in place from ``X``, the output written into its heads' columns of (B, T, C),
    the gradients into (B, T, 3C); only the rows' log-sum-exp is kept for backward, no T x T array."""
    X = cuda.flash_mma.aligned(X)
    parts = [cuda.flash_mma.Layout.of_fused(X, i, H) for i in range(3)]
    Y = xp.empty((B, T, H * D), dtype=X.dtype)
    out = cuda.flash_mma.Layout.of_merged(Y, H)
    lse = cuda.flash_mma.forward(*parts, out, B, scale, causal)

    def backward(g):
        dO = cuda.flash_mma.aligned(to_dtype(g, X.dtype))  # read with O's layout
        dX = xp.empty_like(X)
        cuda.flash_mma.backward(*parts, out, dO, lse, dX, dX, dX, B, scale, causal)
        return (to_dtype(dX, qkv.dtype),)

    return make_tensor(to_dtype(Y, out_dtype), (qkv,), backward)


def _self_attention_copied(qkv, X, out_dtype, B, T, H, D, scale) -> Tensor:
    """Causal :func:`_self_attention_whole` on contiguous (3, B, H, T, D) copies of Q, K, V,
    their gradients likewise, merged back into (B, T, 3C) at the end."""
    QKV = xp.ascontiguousarray(X.reshape(B, T, 3, H, D).transpose(2, 0, 3, 1, 4))
    Qs, K, V = to_dtype(QKV[0] * scale, X.dtype), QKV[1], QKV[2]
    P, P_op, O = _attend(Qs, K, V, True)

    def backward(g):
        dO = xp.ascontiguousarray(to_dtype(g, O.dtype).reshape(B, T, H, D).transpose(0, 2, 1, 3))
        dQKV = xp.empty_like(QKV)
        _attend_backward(Qs, K, V, P, P_op, O, dO, True, out=tuple(dQKV))
        dQKV[0] *= scale
        return (to_dtype(dQKV.transpose(1, 3, 0, 2, 4).reshape(B, T, 3 * H * D), qkv.dtype),)

    return make_tensor(to_dtype(O.transpose(0, 2, 1, 3).reshape(B, T, H * D), out_dtype), (qkv,), backward)
