"""Context parallelism: the sequence split over the ``cp`` ranks, attention made whole again.

Everything in a transformer block except attention works token by token, so when each of the
``C`` ranks of the cp group holds ``T / C`` tokens of every sequence, only attention needs the
other ranks (its queries must meet every earlier key).  Two ways to give it them:

* **Ring attention** (Liu et al. 2023, "Ring Attention with Blockwise Transformers for
  Near-Infinite Context"): the key/value blocks travel around the ring of cp ranks (``C - 1``
  ppermute steps, the next block in flight while the current one is folded into the online
  softmax of :mod:`minidist.model.ops.blockwise`).  Backward sends the key/value blocks round again,
  with their gradients travelling alongside and arriving home after ``C`` steps.  No rank
  ever holds the whole sequence.  Per rank and step: ``2 * B * T/C * C_model`` values sent.

  Causal attention makes the work uneven: with contiguous slices rank ``r`` meets ``r + 1``
  blocks of keys, so the last rank works ``C`` times as much as the first.  **Zig-zag**
  (load-balanced) layout: cut the sequence into ``2C`` chunks and give rank ``r`` the chunks
  ``r`` and ``2C - 1 - r``, one from each end: every rank then computes the same number of
  scores (:func:`ring_work` counts them).

* **DeepSpeed-Ulysses** (Jacobs et al. 2023): an all-to-all turns the sequence-sharded Q, K, V
  (``T/C`` tokens, all ``H`` heads) into head-sharded ones (all ``T`` tokens, ``H/C`` heads),
  each rank runs ordinary attention on its heads, and a second all-to-all turns the output
  back.  Needs ``H`` divisible by ``C``; sends ``3/C`` of the activations per rank forward.

The rest follows the split: each rank embeds its tokens at their true positions and computes
the loss of its tokens weighted by their share of the batch's tokens, so the sum over the cp
group of the ranks' losses (and of their parameter gradients) is exactly the loss (gradient)
of one process holding the whole sequence.
"""

from __future__ import annotations

import math

from minidist import comm
from minidist.model.autograd import Tensor, make_tensor
from minidist.model.backend import from_host, host, to_host, xp
from minidist.comm import functional as F
from minidist.model.ops import blockwise as bw
from minidist.model.ops.precision import compute_dtype, gemm_operands, to_dtype
from minidist.layout.settings import CP_IMPLEMENTATIONS as IMPLEMENTATIONS
from minidist.layout.grid import chunk_starts


# ------------------------------------------------------------------ who holds which tokens


def positions(rank: int, cp: int, seq_len: int, zigzag: bool = True):
    """The global positions of the tokens ``rank`` holds, in its local order."""
    starts, c = chunk_starts(rank, cp, seq_len, zigzag)
    return host.concatenate([host.arange(s, s + c) for s in starts])  # host: index bookkeeping


def problems(given, cfg) -> list[str]:
    """Why the long-sequence settings cannot run (one line each; [] if they can).

    ``given``: the run configuration as the user gave it (None = not given), ``cfg`` resolved.
    With tensor parallelism each rank attends with its ``heads / tp`` heads, so Ulysses splits
    those; sequence parallelism then splits this rank's ``seq_len / cp`` tokens over tp."""
    p, m, g = cfg.parallel, cfg.model, given
    cp, T = p.cp, cfg.data.seq_len
    out = []
    tiled = m.attention == "blockwise" or (cp > 1 and p.cp_impl == "ring")
    if g.model.attention_block is not None and not tiled:
        out.append(f"--attention-block {g.model.attention_block} needs --attention blockwise or ring attention "
                   "(--cp > 1 with --cp-impl ring): plain attention has no blocks")
    if g.parallel.cp_impl is not None and cp == 1:
        out.append(f"--cp-impl {g.parallel.cp_impl} needs --cp greater than 1 (got --cp {cp})")
    if cp == 1:
        return out
    if p.cp_impl not in IMPLEMENTATIONS:
        out.append(f"unknown context-parallel implementation {p.cp_impl!r}; choose from {IMPLEMENTATIONS}")
    elif p.cp_impl == "ring" and T % (2 * cp):
        out.append(f"--seq-len {T} is not divisible by 2 x --cp = {2 * cp}: zig-zag ring attention "
                   "gives each rank two equal chunks of every sequence")
    elif p.cp_impl == "ulysses":
        heads = m.heads // p.tp
        if heads % cp:
            per = f" / --tp {p.tp} = {heads} heads per tensor-parallel rank" if p.tp > 1 else ""
            out.append(f"--heads {m.heads}{per} is not divisible by --cp {cp}: Ulysses gives each rank "
                       "heads / cp of the attention heads")
        if T % cp:
            out.append(f"--seq-len {T} is not divisible by --cp {cp}")
    return out


# ------------------------------------------------------------------ ring attention


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
    counts them, without running anything."""
    out = []
    for r in range(cp):
        mine, c = chunk_starts(r, cp, seq_len, zigzag)
        total = 0
        for src in range(cp):
            for _, _, qa, kb in _pairs(mine, chunk_starts(src, cp, seq_len, zigzag)[0], c):
                total += sum((rows.stop - rows.start) * (cols.stop - cols.start)
                             for rows, cols, _ in bw.tiles(c, c, qa, kb, block or c, True, xp.float64))
        out.append(total)
    return out


# ------------------------------------------------------------------ DeepSpeed-Ulysses


def ulysses_self_attention(qkv: Tensor, n_head: int, group, attention) -> Tensor:
    """(B, T/C, 3C) sequence-sharded -> all-to-all -> (B, T, 3C/C) head-sharded -> ``attention``
    on this rank's H/C heads over the whole sequence -> all-to-all back -> (B, T/C, C).

    ``attention`` is a single-rank self-attention ``(qkv, n_head) -> y`` (plain or blockwise).
    The all-to-alls are differentiable (their backward is the inverse all-to-all).
    """
    B, t, C3 = qkv.shape
    n, H = group.size, n_head
    D = C3 // 3 // H
    x = qkv.reshape(B, t, 3, H, D)
    x = F.all_to_all(x, group, split_axis=3, concat_axis=1)           # (B, T, 3, H/C, D)
    y = attention(x.reshape(B, n * t, 3 * (H // n) * D), H // n)      # (B, T, C/C)
    y = F.all_to_all(y.reshape(B, n * t, H // n, D), group, split_axis=1, concat_axis=2)  # (B, T/C, H, D)
    return y.reshape(B, t, H * D)


# ------------------------------------------------------------------ the strategy


class ContextParallel:
    """The model's sequences split over ``group`` (the mesh's cp group).

        cp = ContextParallel(mesh.group("cp"), impl="ring")
        cp.install(model)                       # attention -> ring attention; positions -> this rank's
        loss = cp.loss(model, x, y)             # this rank's tokens, weighted by their share
        loss.backward()
        data.allreduce_gradients(params, mesh.group(("dp", "cp")))  # or DDP over that group

    ``attention`` / ``block``: the single-rank attention Ulysses runs on its heads
    (``"plain"`` or ``"blockwise"``), and the tile of ring attention's online softmax.
    """

    def __init__(self, group, impl: str = "ring", attention: str = "plain", block=None, zigzag: bool = True):
        if impl not in IMPLEMENTATIONS:
            raise ValueError(f"unknown context-parallel implementation {impl!r}; choose from {IMPLEMENTATIONS}")
        self.group, self.impl, self.block = group, impl, block
        self.zigzag = zigzag and impl == "ring"  # Ulysses gathers the sequence in rank order
        self.inner = attention
        self.work = {}  # ring attention's score count on this rank (forward)

    def positions(self, seq_len: int):
        return positions(self.group.rank, self.group.size, seq_len, self.zigzag)

    def attention_function(self):
        """The ``(qkv, n_head) -> y`` every block calls."""
        from minidist.model.nn import attention_function

        g = self.group
        if self.impl == "ring":
            return lambda qkv, n_head: ring_self_attention(qkv, n_head, g, self.zigzag, self.block, self.work)
        inner = attention_function(self.inner, self.block or 128)
        return lambda qkv, n_head: ulysses_self_attention(qkv, n_head, g, inner)

    def install(self, model) -> None:
        """Every block's attention -> this implementation; the embedding's positions -> this
        rank's slice of the sequence (the model then takes this rank's tokens, see :meth:`shard`)."""
        model.use_attention(self.attention_function())
        model.use_positions(lambda t: (self.positions(t * self.group.size), t * self.group.size))

    def shard(self, x, y):
        """This rank's tokens of a (B, T) batch of inputs and targets.

        The batch comes from the sampler in host memory and :meth:`positions` are made there
        too (NumPy cannot index with a CuPy array: that would be an implicit device-to-host
        conversion, which CuPy refuses), so the batch stays on the host, where the embedding
        checks its ids for free."""
        pos = self.positions(x.shape[-1])
        return x[..., pos], y[..., pos]

    def loss(self, model, x, y):
        """This rank's mean token loss times its share of the tokens (1 / C): summed over the
        cp group, the loss of the whole sequences.  ``model`` must be installed."""
        xs, ys = self.shard(x, y)
        return model(xs, ys) * (xs.shape[-1] / x.shape[-1])
