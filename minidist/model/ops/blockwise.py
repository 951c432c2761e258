"""Blockwise attention with the online softmax: the FlashAttention recurrence.

Dao et al. 2022, "FlashAttention: Fast and Memory-Efficient Exact Attention with IO-Awareness";
Rabe & Staats 2021, "Self-attention Does Not Need O(n^2) Memory"; the online softmax is from
Milakov & Gimelshein 2018.

Plain attention (``attention.py``) builds the T x T probability matrix and keeps it for
backward.  Here the queries and the keys are cut into blocks of ``block`` rows.  Each query
block meets the key blocks one at a time and carries, for every query row, the running
maximum ``m``, the running normaliser ``l`` and an unnormalised output ``acc``::

    S   = Q_i K_j^T * scale   (+ causal mask on the diagonal tile)
    m'  = max(m, rowmax(S))
    P~  = exp(S - m')
    l   = l * exp(m - m') + rowsum(P~)
    acc = acc * exp(m - m') + P~ V_j,      m = m'

and finally ``O = acc / l``.  Only ``O`` and the log-sum-exp ``L = m + log l`` (one number per
row) are kept.  Backward recomputes every tile's probabilities from ``L``::

    P = exp(S - L),  dV_j += P^T dO_i,  dS = P * (dO_i V_j^T - D_i)  with D = rowsum(dO * O),
    dQ_i += dS K_j * scale,  dK_j += dS^T Q_i * scale

Cost: the matmul FLOPs of plain attention plus one more Q K^T product in backward; memory
O(T * D) per head plus one block x block tile, instead of T x T.  With a causal mask the tiles
entirely above the diagonal are skipped (about half of them).

The two kernels :func:`forward_tiles` and :func:`backward_tiles` take the global position of
the first query and of the first key, so ring attention (``minidist.parallel.context``) reuses
them on the chunks of the sequence that meet on one rank.

This batched-matmul form (every (batch, head) pair in each product) is the reference.  On
CuPy, :func:`blockwise_attention` runs the same recurrence as fused CUDA kernels instead
(``cuda/flash.py``; ``MINIDIST_CUDA_KERNELS=off`` keeps this form), checked against it.  With
low-precision operands the products here run in that dtype and the running state, softmax
and gradients in float32.
"""

from __future__ import annotations

import math

from minidist.model.autograd import Tensor, make_tensor
from minidist.model.backend import xp
from minidist.model.ops import cuda
from minidist.model.ops.basic import reshape, split, transpose
from minidist.model.ops.cuda import gemm
from minidist.model.ops.precision import compute_dtype, gemm_operands, to_dtype

SKIP = "skip"  # a tile where no query sees any key


def check_block(block) -> int:
    """The block size as a positive int, or a ValueError naming the bad value."""
    if isinstance(block, bool) or not isinstance(block, int) or block <= 0:
        raise ValueError(f"attention block size must be a positive integer, got {block!r}")
    return block


def tile_mask(q_start, q_stop, k_start, k_stop, causal, dtype):
    """How the queries at global positions [q_start, q_stop) see the keys at [k_start, k_stop).

    ``None``: every query sees every key; ``SKIP``: none sees any (the tile is above the
    diagonal); otherwise the additive mask (0 where key <= query, -inf elsewhere).
    """
    if not causal or k_stop - 1 <= q_start:
        return None
    if k_start > q_stop - 1:
        return SKIP
    q = xp.arange(q_start, q_stop)[:, None]
    k = xp.arange(k_start, k_stop)[None, :]
    return xp.where(k > q, -xp.inf, 0.0).astype(dtype)


def tiles(tq, tk, q0, k0, block, causal, dtype):
    """(rows, cols, mask) of every tile that is not skipped; rows/cols are local slices."""
    for i0 in range(0, tq, block):
        rows = slice(i0, min(i0 + block, tq))
        for j0 in range(0, tk, block):
            cols = slice(j0, min(j0 + block, tk))
            mask = tile_mask(q0 + rows.start, q0 + rows.stop, k0 + cols.start, k0 + cols.stop, causal, dtype)
            if mask is SKIP:
                break  # causal: the later key blocks of this row block are skipped too
            yield rows, cols, mask


# ------------------------------------------------------------------ the two kernels (arrays)


def new_state(lead, tq, dv, dtype):
    """Running max m (-inf), normaliser l (0) and output acc (0) of ``tq`` query rows."""
    return (xp.full(lead + (tq, 1), -xp.inf, dtype=dtype), xp.zeros(lead + (tq, 1), dtype=dtype),
            xp.zeros(lead + (tq, dv), dtype=dtype))


def forward_tiles(qs, k, v, q0, k0, state, block, causal=True) -> int:
    """Fold the keys ``k``, values ``v`` (first key at global position ``k0``) into the running
    ``state`` = (m, l, acc) of the queries ``qs`` (first query at ``q0``; already scaled).

    Arrays are (..., T, D); the state is updated in place.  Returns the number of scores
    computed (the work), for the load-balance counts of ring attention.
    """
    m, l, acc = state
    work, cdt = 0, m.dtype  # the state's dtype: float32 when the operands are low precision
    for rows, cols, mask in tiles(qs.shape[-2], k.shape[-2], q0, k0, block, causal, cdt):
        s = to_dtype(gemm.matmul(qs[..., rows, :], k[..., cols, :].swapaxes(-1, -2)), cdt)
        if mask is not None:
            s += mask
        _online_softmax_step(s, v[..., cols, :], m[..., rows, :], l[..., rows, :], acc[..., rows, :])
        work += (rows.stop - rows.start) * (cols.stop - cols.start)
    return work


def _online_softmax_step(s, v, m, l, acc):
    """One tile of the recurrence, in place on the views m, l, acc; ``s`` is consumed."""
    m_new = xp.maximum(m, s.max(axis=-1, keepdims=True))
    m_ref = xp.where(xp.isneginf(m_new), 0.0, m_new)  # a row that has seen no key yet stays 0
    s -= m_ref
    p = xp.exp(s, out=s)
    alpha = xp.exp(m - m_ref)  # rescales what was accumulated under the old maximum
    l *= alpha
    l += p.sum(axis=-1, keepdims=True)
    acc *= alpha
    acc += gemm.matmul(to_dtype(p, v.dtype), v)  # low-precision operands: P rounded for the product
    m[...] = m_new


def finish(state):
    """(O, L) from the running state: O = acc / l and the log-sum-exp L = m + log l."""
    m, l, acc = state
    acc /= l
    return acc, m + xp.log(l)


def backward_tiles(qs, k, v, q0, k0, do, lse, delta, dq, dk, dv, block, causal=True):
    """Add the gradients of one (queries, keys) pair: ``dq`` (unscaled: multiply by the scale
    at the end), ``dk`` and ``dv``, recomputing each tile's probabilities from ``lse``.

    ``delta`` = rowsum(dO * O) of the query rows (FlashAttention-2's identity
    rowsum(dP * P) = rowsum(dO * O), so no T x T array is needed for the softmax backward).
    """
    low, cdt = qs.dtype, lse.dtype  # operands' dtype, and float32 when that is low precision
    for rows, cols, mask in tiles(qs.shape[-2], k.shape[-2], q0, k0, block, causal, cdt):
        q_i, do_i = qs[..., rows, :], to_dtype(do[..., rows, :], low)
        s = to_dtype(gemm.matmul(q_i, k[..., cols, :].swapaxes(-1, -2)), cdt)
        if mask is not None:
            s += mask
        s -= lse[..., rows, :]
        p = xp.exp(s, out=s)
        dv[..., cols, :] += gemm.matmul(to_dtype(p, low).swapaxes(-1, -2), do_i)
        ds = to_dtype(gemm.matmul(do_i, v[..., cols, :].swapaxes(-1, -2)), cdt)  # dP ...
        ds -= delta[..., rows, :]
        ds *= p  # ... turned into dS
        ds = to_dtype(ds, low)
        dq[..., rows, :] += gemm.matmul(ds, k[..., cols, :])
        dk[..., cols, :] += gemm.matmul(ds.swapaxes(-1, -2), q_i)


def rowsum_dot(do, o):
    """rowsum(dO * O) as (..., T, 1)."""
    return xp.einsum("...i,...i->...", do, o)[..., None]


# ------------------------------------------------------------------ autograd ops


def blockwise_attention(q: Tensor, k: Tensor, v: Tensor, block: int = 128, causal: bool = True,
                        scale=None) -> Tensor:
    """Attention of q (..., Tq, D) over k, v (..., Tk, D) in ``block`` x ``block`` tiles.

    Same result as :func:`minidist.model.ops.attention` (same causal convention: query i sees keys
    j <= i), without ever holding a Tq x Tk array.
    """
    block = check_block(block)
    if q.ndim < 2 or k.shape != v.shape or q.shape[:-2] != k.shape[:-2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"attention shapes do not fit: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if cuda.flash.why_not(q.shape[-1]) is None and q.shape[-2] and k.shape[-2]:
        return _flash_kernel_attention(q, k, v, causal, scale)
    (Q, K, V), out_dtype = gemm_operands(q.data, k.data, v.data)
    Qs = Q * scale
    cdt = compute_dtype(Qs.dtype)  # running state and gradients: float32 for low-precision operands
    state = new_state(Q.shape[:-2], Q.shape[-2], V.shape[-1], cdt)
    forward_tiles(Qs, K, V, 0, 0, state, block, causal)
    O, lse = finish(state)

    def backward(g):
        dO = to_dtype(g, O.dtype)
        dQ, dK, dV = xp.zeros(Qs.shape, cdt), xp.zeros(K.shape, cdt), xp.zeros(V.shape, cdt)
        backward_tiles(Qs, K, V, 0, 0, dO, lse, rowsum_dot(dO, O), dQ, dK, dV, block, causal)
        dQ *= scale
        return to_dtype(dQ, q.dtype), to_dtype(dK, k.dtype), to_dtype(dV, v.dtype)

    return make_tensor(to_dtype(O, out_dtype), (q, k, v), backward)


def _flash_kernel_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> Tensor:
    """:func:`blockwise_attention` as the fused CUDA kernels of ``cuda.flash`` (CuPy only).
    Low-precision operands are widened to float32, the dtype the reference's softmax and
    gradients run in (so backward holds float32 copies: twice the reference's bf16 operands);
    the output comes back in the autocast dtype like the reference's."""
    (Q, K, V), out_dtype = gemm_operands(q.data, k.data, v.data)
    cdt = compute_dtype(Q.dtype)
    Q, K, V = (xp.ascontiguousarray(to_dtype(a, cdt)) for a in (Q, K, V))  # once, for both passes
    O, lse = cuda.flash.forward(Q, K, V, scale, causal)

    def backward(g):
        dQ, dK, dV = cuda.flash.backward(Q, K, V, O, lse, to_dtype(g, cdt), scale, causal)
        return to_dtype(dQ, q.dtype), to_dtype(dK, k.dtype), to_dtype(dV, v.dtype)

    return make_tensor(to_dtype(O, out_dtype), (q, k, v), backward)


def split_heads(qkv: Tensor, n_head: int):
    """The fused projection (B, T, 3C) as three Tensors q, k, v of shape (B, H, T, D)."""
    if qkv.ndim != 3 or qkv.shape[-1] % 3:
        raise ValueError(f"attention needs qkv of shape (B, T, 3C), got {tuple(qkv.shape)}")
    B, T, C3 = qkv.shape
    C = C3 // 3
    if isinstance(n_head, bool) or not isinstance(n_head, int) or n_head <= 0 or C % n_head:
        raise ValueError(f"attention: n_head={n_head!r} does not divide C={C}")
    parts = split(reshape(qkv, (B, T, 3, n_head, C // n_head)), 3, axis=2)
    return [transpose(reshape(p, (B, T, n_head, C // n_head)), (0, 2, 1, 3)) for p in parts]


def merge_heads(y: Tensor) -> Tensor:
    """(B, H, T, D) -> (B, T, H * D), head h in columns [h * D, (h + 1) * D)."""
    B, H, T, D = y.shape
    return reshape(transpose(y, (0, 2, 1, 3)), (B, T, H * D))


def blockwise_self_attention(qkv: Tensor, n_head: int, causal: bool = True, block: int = 128) -> Tensor:
    """Drop-in for :func:`minidist.model.ops.self_attention`: (B, T, 3C) -> (B, T, C), blockwise."""
    q, k, v = split_heads(qkv, n_head)
    return merge_heads(blockwise_attention(q, k, v, block=block, causal=causal))
