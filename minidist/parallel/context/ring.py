"""Ring attention (Liu et al. 2023, "Ring Attention with Blockwise Transformers for
Near-Infinite Context"): the key/value blocks travel around the ring of cp ranks.

``C - 1`` ppermute steps, the next block in flight while the current one is folded into the
online softmax of :mod:`minidist.model.ops.blockwise`.  Backward sends the key/value blocks
round again, with their gradients travelling alongside and arriving home after ``C`` steps.
No rank ever holds the whole sequence.  Per rank and step: ``2 * B * T/C * C_model`` values
sent.

Causal attention makes the work uneven: with contiguous slices rank ``r`` meets ``r + 1``
blocks of keys, so the last rank works ``C`` times as much as the first.  **Zig-zag**
(load-balanced) layout: cut the sequence into ``2C`` chunks and give rank ``r`` the chunks
``r`` and ``2C - 1 - r``, one from each end: every rank then computes the same number of
scores (:func:`ring_work` counts them).
"""

from __future__ import annotations

import math

from minidist import comm
from minidist.model.autograd import Tensor, make_tensor
from minidist.model.backend import from_host, to_host, xp
from minidist.model.ops import blockwise as bw
from minidist.model.ops.precision import compute_dtype, gemm_operands, to_dtype
from minidist.layout.grid import chunk_starts, ring_tiles


def _ring(n):
    return [(i, (i + 1) % n) for i in range(n)]


def _pairs(my_starts, their_starts, c):
    """(local query rows, local key rows, global query start, global key start) of every chunk pair."""
    for a, qa in enumerate(my_starts):
        for b, kb in enumerate(their_starts):
            yield slice(a * c, (a + 1) * c), slice(b * c, (b + 1) * c), qa, kb


def _send(a, group, async_op=True):
    return comm.ppermute(to_host(a), group, _ring(group.size), async_op=async_op)


def ring_attention(q: Tensor, k: Tensor, v: Tensor, group, zigzag: bool = True, block=None, scale=None,
                   work: dict | None = None) -> Tensor:
    """Causal attention of this rank's queries over the keys of the whole ring.

    q, k, v are (B, H, T/C, D): the tokens this rank holds (see :func:`positions`).  ``block``
    is the tile of the online softmax (default: a whole chunk).  ``work["scores"]`` (when given)
    is increased by the number of attention scores this rank computes in forward (per
    sequence and head).
    """
    n, r = group.size, group.rank
    (Q, K, V), out_dtype = gemm_operands(q.data, k.data, v.data)
    scale = 1.0 / math.sqrt(Q.shape[-1]) if scale is None else float(scale)
    seq_len = Q.shape[-2] * n
    my_starts, c = chunk_starts(r, n, seq_len, zigzag)
    block = c if block is None else bw.check_block(block)
    Qs = Q * scale
    KV = xp.stack([K, V])  # one message per step carries both

    cdt = compute_dtype(Qs.dtype)  # state and gradients in float32 when the operands are low precision
    state = bw.new_state(Q.shape[:-2], Q.shape[-2], V.shape[-1], cdt)
    kv, scores = KV, 0
    for step in range(n):
        src = (r - step) % n  # whose keys we hold now
        pending = _send(kv, group) if step + 1 < n else None  # the next block, in flight meanwhile
        for rows, cols, qa, kb in _pairs(my_starts, chunk_starts(src, n, seq_len, zigzag)[0], c):
            view = tuple(s[..., rows, :] for s in state)
            scores += bw.forward_tiles(Qs[..., rows, :], kv[0][..., cols, :], kv[1][..., cols, :], qa, kb,
                                       view, block)
        if pending is not None:
            kv = from_host(pending.wait())
    O, lse = bw.finish(state)
    if work is not None:
        work["scores"] = work.get("scores", 0) + scores

    def backward(g):
        dO = to_dtype(g, O.dtype)
        delta = bw.rowsum_dot(dO, O)
        dQ = xp.zeros(Qs.shape, cdt)
        kv, travelling = KV, None  # travelling: the gradient of the block we hold, on its way home
        for step in range(n):
            src = (r - step) % n
            pending = _send(kv, group) if step + 1 < n else None
            dkv = xp.zeros(kv.shape, cdt)
            for rows, cols, qa, kb in _pairs(my_starts, chunk_starts(src, n, seq_len, zigzag)[0], c):
                bw.backward_tiles(Qs[..., rows, :], kv[0][..., cols, :], kv[1][..., cols, :], qa, kb,
                                  dO[..., rows, :], lse[..., rows, :], delta[..., rows, :], dQ[..., rows, :],
                                  dkv[0][..., cols, :], dkv[1][..., cols, :], block)
            if travelling is not None:  # the previous ranks' part of this block's gradient
                dkv += from_host(travelling.wait())
            travelling = _send(dkv, group)  # after C sends it reaches the block's owner
            if pending is not None:
                kv = from_host(pending.wait())
        dKV = from_host(travelling.wait())
        dQ *= scale
        return to_dtype(dQ, q.dtype), to_dtype(dKV[0], k.dtype), to_dtype(dKV[1], v.dtype)

    return make_tensor(to_dtype(O, out_dtype), (q, k, v), backward)


def ring_self_attention(qkv: Tensor, n_head: int, group, zigzag: bool = True, block=None, work=None) -> Tensor:
    """Ring attention on the fused projection (B, T/C, 3C) -> (B, T/C, C)."""
    q, k, v = bw.split_heads(qkv, n_head)
    return bw.merge_heads(ring_attention(q, k, v, group, zigzag=zigzag, block=block, work=work))


def ring_work(cp: int, seq_len: int, zigzag: bool, block=None) -> list[int]:
    """Attention scores (per sequence and head) each rank computes in forward, as ``work``
    counts them, without running anything (:func:`minidist.layout.grid.ring_tiles`)."""
    return [scores for _, scores in ring_tiles(cp, seq_len, zigzag, block)]
