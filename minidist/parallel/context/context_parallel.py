"""The context-parallel axis on a model: who holds which tokens, the model's attention and
positions set through its seams, and this rank's share of the loss."""

from __future__ import annotations

from minidist.layout.grid import chunk_starts
from minidist.layout.settings import CP_IMPLEMENTATIONS as IMPLEMENTATIONS
from minidist.model.backend import host
from minidist.parallel.context.ring import ring_self_attention
from minidist.parallel.context.ulysses import ulysses_self_attention


def positions(rank: int, cp: int, seq_len: int, zigzag: bool = True):
    """The global positions of the tokens ``rank`` holds, in its local order."""
    starts, c = chunk_starts(rank, cp, seq_len, zigzag)
    return host.concatenate([host.arange(s, s + c) for s in starts])  # host: index bookkeeping


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
        """The ``(qkv, n_head, n_kv_head) -> y`` every block calls.  Ring attention passes
        the multi-head layout around the ring (grouped-query key/value heads repeated first)."""
        from minidist.model import ops
        from minidist.model.nn import attention_function

        g = self.group
        if self.impl == "ring":
            return lambda qkv, n_head, n_kv_head=None: ring_self_attention(
                ops.repeat_kv(qkv, n_head, n_kv_head or n_head), n_head, g, self.zigzag, self.block, self.work)
        inner = attention_function(self.inner, self.block or 128)
        return lambda qkv, n_head, n_kv_head=None: ulysses_self_attention(qkv, n_head, g, inner, n_kv_head)

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
