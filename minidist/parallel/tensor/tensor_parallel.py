"""Megatron-LM's layers (Shoeybi et al. 2019): the split set ``nn.GPT`` builds from.

With a group of one rank (or none) every layer here is the plain layer: one GPT class
(``nn.GPT(cfg, layers=TensorParallelLayers(group))``) serves every mode.
"""

from __future__ import annotations

from dataclasses import dataclass

from minidist.model import nn, ops
from minidist.model.backend import from_host, host, on_host, xp
from minidist.comm import functional as F
from minidist.comm.group import Group
from minidist.layout.settings import TP_OVERLAPS
from minidist.parallel.tensor import collective_matmul as cm
from minidist.parallel.tensor.sequence_parallel import all_gather_linear, linear_reduce_scatter
from minidist.parallel.tensor.vocab_parallel import VocabParallelEmbedding, vocab_parallel_cross_entropy

OVERLAPS = ("none", *TP_OVERLAPS)  # "none": the plain all-reduce of Megatron-LM


# --------------------------------------------------------------------------------------------
# Which slice of a global parameter a rank keeps
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Shard:
    """Part ``index`` of ``parts`` equal parts of dimension ``dim``, taken from each of
    ``blocks`` equal blocks of that dimension.  The fused QKV weight (d, 3d) has blocks=3:
    rank r keeps its heads' columns of q, of k and of v, in that order.

    ``copy``: where fewer parts than ranks exist (Llama's K key/value heads on tp > K ranks),
    several ranks hold the same part; ``copy`` numbers them, and only copy 0 counts it in
    the gradient's norm and writes it to a checkpoint."""

    dim: int
    index: int
    parts: int
    blocks: int = 1
    axis: str = "tp"
    copy: int = 0

    def part(self, length: int) -> int:
        """The length along ``dim`` of this rank's part of one block: a block that the parts do
        not divide (a vocabulary, one block) is padded at its end to ``parts`` x this."""
        return -(-(length // self.blocks) // self.parts)

    def local_shape(self, shape):
        shape = list(shape)
        shape[self.dim] = self.part(shape[self.dim]) * self.blocks
        return tuple(shape)

    def indices(self, length: int):
        """The global indices along ``dim`` this rank keeps, in its local order; those from
        ``length`` on are padding (vocab_parallel.py), which holds zeros."""
        block, part = length // self.blocks, self.part(length)
        if self.blocks > 1 and block % self.parts:
            raise ValueError(f"{self.blocks} fused blocks of {block} do not split into {self.parts} equal parts")
        return host.concatenate([host.arange(b * block + self.index * part, b * block + (self.index + 1) * part)
                                 for b in range(self.blocks)])  # host: index bookkeeping

    def take(self, full):
        """This rank's slice of the global array ``full``, where ``full`` lies (host or device:
        a checkpoint rebuilds global tensors on the host); its padding rows are zeros."""
        length = full.shape[self.dim]
        indices = self.indices(length)
        lib = host if on_host(full) else xp
        pad = self.part(length) * self.parts * self.blocks - length
        if pad:  # the padded vocabulary: zero rows after the last real one
            shape = list(full.shape)
            shape[self.dim] = pad
            full = lib.concatenate([full, lib.zeros(shape, dtype=full.dtype)], axis=self.dim)
        return lib.take(full, indices if lib is host else from_host(indices), axis=self.dim)


# --------------------------------------------------------------------------------------------
# The layer set GPT builds from
# --------------------------------------------------------------------------------------------
class TensorParallelLayers(nn.Layers):
    """nn.Layers split over ``group``: ``nn.GPT(cfg, layers=TensorParallelLayers(tp_group))``.

    ``sequence_parallel``: activations outside the matmuls are split along the sequence.
    ``overlap``: "none" (all-gather / reduce-scatter as one collective), "ring" or
    "bidirectional" (collective matmuls; they imply sequence parallelism).
    Creating it is collective over ``group`` when overlap is "bidirectional" (the second
    direction gets its own communicator and progress thread).
    """

    def __init__(self, group: Group | None = None, sequence_parallel: bool = False, overlap: str = "none"):
        if overlap not in OVERLAPS:
            raise ValueError(f"overlap={overlap!r}; choose one of {OVERLAPS}")
        self.group = group
        self.parts = 1 if group is None else group.size
        self.rank = 0 if group is None else group.rank
        split = self.parts > 1
        self.overlap = overlap if split else "none"
        self.sequence_parallel = split and (sequence_parallel or overlap != "none")
        # The counter-clockwise stream of the bidirectional ring runs on its own group, so
        # its messages travel at the same time as the clockwise ones (full-duplex links).
        self.reverse = (Group(group.user_comm.Dup(), name=f"{group.name}-ccw")
                        if self.overlap == "bidirectional" else None)
        self._copies = {}  # copies per head -> the group of ranks holding this rank's head
        # The vocabulary, once the token embedding is built (GPT builds it first): the untied
        # head's columns and the loss's classes beyond it are the padding (vocab_parallel.py).
        self.vocab_size = None

    def __repr__(self):
        return (f"TensorParallelLayers(parts={self.parts}, sequence_parallel={self.sequence_parallel}, "
                f"overlap={self.overlap!r})")

    def shard(self, dim: int, blocks: int = 1, heads: int | None = None):
        """This rank's slice of a weight whose dimension ``dim`` the group splits; with
        ``heads`` fewer than the ranks, the head this rank shares with parts/heads others."""
        if self.parts == 1:
            return None
        if heads is not None and heads < self.parts:
            copies = self.parts // heads
            return Shard(dim, self.rank // copies, heads, blocks, copy=self.rank % copies)
        return Shard(dim, self.rank, self.parts, blocks)

    def copies_group(self, heads: int):
        """The ranks that hold the same one of ``heads`` heads as this one (``heads`` < the
        ranks), made when first asked: every rank builds the same layers in the same order,
        so every rank of the group asks at the same point (Split is collective)."""
        copies = self.parts // heads
        if copies not in self._copies:
            sub = self.group.user_comm.Split(self.rank // copies, self.rank)
            self._copies[copies] = Group(sub, name=f"{self.group.name}-kv{self.rank // copies}")
        return self._copies[copies]

    def heads_here(self, heads: int) -> int:
        if heads % self.parts and self.parts % heads:
            raise ValueError(f"{heads} key/value heads can be neither split over nor shared by "
                             f"the {self.parts} tensor-parallel ranks (one must divide the other)")
        return max(heads // self.parts, 1)

    def shared(self, *params):
        """Replicated parameters as used on this rank's sequence shard: under sequence
        parallelism their gradients are partial sums, which f (copy_to_tp) completes.
        Several 1-d parameters go through one f (one all-reduce), joined end to end."""
        if not self.sequence_parallel:
            return params[0] if len(params) == 1 else params
        if len(params) == 1:
            return F.copy_to_tp(params[0], self.group)
        joined = F.copy_to_tp(ops.concat(params, axis=0), self.group)
        return tuple(ops.split(joined, [p.shape[0] for p in params], axis=0))

    def enter(self, x):
        """Megatron's f where a replicated x enters a tensor-parallel region."""
        return F.copy_to_tp(x, self.group)

    def leave(self, y):
        """A region's output of partial sums: all-reduced (Megatron's g), or reduce-scattered
        along the sequence (sequence parallelism)."""
        if self.sequence_parallel:
            return F.reduce_scatter_to_sp(y, self.group, axis=1)
        return F.reduce_from_tp(y, self.group)

    def gather_sequence(self, x, visit):
        """All-gather the sequence (axis 1) of x, calling ``visit(rows, chunk)`` on the parts:
        one collective, or the ring steps of a collective matmul (collective_matmul.py)."""
        if self.overlap == "ring":
            return cm.ring_all_gather(x, self.group, visit)
        if self.overlap == "bidirectional":
            return cm.bidirectional_all_gather(x, self.group, self.reverse, visit)
        return cm.gather_once(x, self.group, visit)

    def matmul_scatter_sequence(self, h, w):
        """``reduce_scatter(h @ w, axis=1)``: one collective, or a collective matmul."""
        if self.overlap == "ring":
            return cm.matmul_reduce_scatter(h, w, self.group)
        if self.overlap == "bidirectional":
            return cm.bidirectional_matmul_reduce_scatter(h, w, self.group, self.reverse)
        return cm.matmul_then_reduce_scatter(h, w, self.group)

    # -- nn.Layers -----------------------------------------------------------------------------
    def column(self, d_in, d_out, dtype, bias=True, std=0.02, fused=1, heads=None):
        # The untied LM head (d, V): its vocabulary padded as the embedding's.
        pad = fused == 1 and heads is None and d_out == self.vocab_size
        return ColumnParallelLinear(d_in, d_out, dtype, self, bias, std, fused, heads, pad)

    def fused_column(self, x, linears):
        return self.column_linear(x, ops.concat([lin.used_weight() for lin in linears], axis=1))

    def column_linear(self, x, weight, bias=None):
        """``x @ weight + bias`` for this rank's columns: x replicated enters through f, or is
        all-gathered along the sequence under sequence parallelism."""
        if self.parts == 1:
            return ops.linear(x, weight, bias)
        if self.sequence_parallel:
            return all_gather_linear(x, weight, bias, self)
        return ops.linear(self.enter(x), weight, bias)

    def row(self, d_in, d_out, dtype, bias=True, std=0.02):
        return RowParallelLinear(d_in, d_out, dtype, self, bias, std)

    def layer_norm(self, dim, dtype):
        return LayerNorm(dim, dtype, self)

    def rms_norm(self, dim, dtype, eps=1e-5):
        return RMSNorm(dim, dtype, self, eps)

    def token_embedding(self, num, dim, dtype):
        self.vocab_size = num
        return VocabParallelEmbedding(num, dim, dtype, self)

    def position_embedding(self, num, dim, dtype):
        return PositionEmbedding(num, dim, dtype, self)

    def cross_entropy(self, logits, targets):
        if self.parts == 1:
            return ops.cross_entropy(logits, targets)
        return vocab_parallel_cross_entropy(logits, targets, self.group, self.vocab_size)


def _check_split(name, n, parts):
    if n % parts:
        raise ValueError(f"{name}={n} is not divisible by the {parts} tensor-parallel ranks")


class ColumnParallelLinear(nn.Module):
    """``y = x @ W + b`` with W's columns (and b) split: this rank's output features only.

    ``heads`` fewer than the ranks (grouped-query attention's key/value heads, tp > K): each
    head's columns are held by tp/K ranks, which use them for different query heads, so the
    weight's gradient is the sum of theirs (Megatron's f on the weight, over those ranks).

    ``pad``: the output features are a vocabulary (the untied LM head), padded to a multiple of
    the ranks as the embedding's rows (vocab_parallel.py); the padding's columns stay zero."""

    def __init__(self, d_in, d_out, dtype, tp: TensorParallelLayers, bias=True, std=0.02, fused=1, heads=None,
                 pad=False):
        if heads is not None and heads < tp.parts:
            tp.heads_here(heads)
        elif not pad:
            _check_split("output features" if fused == 1 else f"output features of each of its {fused} fused parts",
                         (d_out // fused) if heads is None else heads, tp.parts)
        self.tp = tp
        self.copies = tp.copies_group(heads) if heads is not None and heads < tp.parts else None
        self.weight = nn._param((d_in, d_out), dtype, ("normal", std), tp.shard(1, fused, heads))
        self.bias = nn._param((d_out,), dtype, ("zeros",), tp.shard(0, fused, heads)) if bias else None

    def used_weight(self):
        """The weight as the matmul uses it: through f over the ranks holding the same head."""
        return self.weight if self.copies is None else F.copy_to_group(self.weight, self.copies)

    def forward(self, x):
        bias = self.bias if self.copies is None or self.bias is None else F.copy_to_group(self.bias, self.copies)
        return self.tp.column_linear(x, self.used_weight(), bias)


class RowParallelLinear(nn.Module):
    """``y = x @ W + b`` with W's rows split: x holds this rank's input features, the
    partial products are summed over the group (or reduce-scattered), then b is added."""

    def __init__(self, d_in, d_out, dtype, tp: TensorParallelLayers, bias=True, std=0.02):
        _check_split("input features", d_in, tp.parts)
        self.tp = tp
        self.weight = nn._param((d_in, d_out), dtype, ("normal", std), tp.shard(0))
        self.bias = nn._param((d_out,), dtype, ("zeros",)) if bias else None

    def forward(self, x):
        tp = self.tp
        if tp.parts == 1:
            return ops.linear(x, self.weight, self.bias)
        if tp.sequence_parallel:
            y = linear_reduce_scatter(x, self.weight, tp)
        else:
            y = tp.leave(ops.linear(x, self.weight))
        if self.bias is None:
            return y
        # In y's dtype: under mixed precision a float32 bias would widen the residual stream
        # (and the activations a pipeline stage sends) to float32.
        return ops.add_bias(y, tp.shared(self.bias))


class LayerNorm(nn.LayerNorm):
    """LayerNorm whose gain and bias are replicated; under sequence parallelism each rank
    normalises its own tokens, and f sums the parameters' gradients over the shards."""

    def __init__(self, dim, dtype, tp: TensorParallelLayers, eps=1e-5):
        super().__init__(dim, dtype, eps)
        self.tp = tp

    def forward(self, x):
        return ops.layer_norm(x, *self.tp.shared(self.weight, self.bias), self.eps)


class RMSNorm(nn.RMSNorm):
    """RMSNorm with a replicated gain, normalising each rank's tokens under sequence
    parallelism (its gradient summed over the shards by f, as LayerNorm's)."""

    def __init__(self, dim, dtype, tp: TensorParallelLayers, eps=1e-5):
        super().__init__(dim, dtype, eps)
        self.tp = tp

    def forward(self, x):
        return ops.rms_norm(x, self.tp.shared(self.weight), self.eps)


class PositionEmbedding(nn.Embedding):
    """The learned position table (replicated); under sequence parallelism a rank looks up
    only the positions of its part of the sequence."""

    def __init__(self, num, dim, dtype, tp: TensorParallelLayers):
        super().__init__(num, dim, dtype)
        self.tp = tp

    def forward(self, positions):
        if not self.tp.sequence_parallel:
            return ops.embedding(self.weight, positions)
        n = positions.shape[0] // self.tp.parts
        mine = positions[self.tp.rank * n:(self.tp.rank + 1) * n]
        return ops.embedding(self.tp.shared(self.weight), mine)
