"""The vocabulary split over the tensor-parallel ranks, padded when they do not divide it.

Megatron-LM (Shoeybi et al. 2019) splits the token embedding by rows: each of the tp ranks
holds V/tp tokens' rows, and the tied LM head, the same matrix, gives that rank's V/tp logits
of every token.  Its vocabulary-parallel cross-entropy then combines the shards with two
small all-reduces per token, never forming the full logits.

**Any vocabulary.**  Where tp does not divide V, the vocabulary is padded at its end to
``Vp = tp * ceil(V / tp)`` rows, as Megatron-LM pads its vocabulary
(``--make-vocab-size-divisible-by``; here to the smallest multiple of tp, since nothing else
needs a rounder size).  Rank r holds rows ``[r Vp/tp, (r+1) Vp/tp)``; the rows from V on are
padding (``Shard.indices`` numbers them V, V+1, ...), and they never act:

* initialisation draws every weight from the seed in its *unpadded* shape and ``Shard.take``
  pads the draw with zeros, so every real row equals one process's;
* no token id reaches a padding row (ids are checked to lie below V), so the lookup's
  gradient there is zero;
* the cross-entropy masks the padding's logits out of the softmax (set to -inf before the
  max and the sum), so the loss, the probabilities and every gradient are those of the
  V-way softmax, and the padding's logit gradient is exactly zero;
* so the padding rows of the tied head (and of an untied head's padded columns) get zero
  gradients, AdamW's moments and its weight decay leave their zeros at zero, and the
  gradient norm does not see them.

A checkpoint records the unpadded global shape (V, d): reading it gathers only the real rows
(``checkpoint.Reader._global`` drops the indices from V on), so it resumes on any tp, or on one
process, and export and generation never see the padding.  With tp dividing V nothing changes.
"""

from __future__ import annotations

from minidist import comm
from minidist.model import nn, ops
from minidist.model.autograd import make_tensor
from minidist.model.backend import from_host, xp
from minidist.model.ops.basic import check_range
from minidist.model.ops.nn_ops import checked_targets
from minidist.model.ops.precision import compute_dtype, to_dtype


def real_columns(vocab_size: int, local: int, rank: int) -> int:
    """How many of rank ``rank``'s ``local`` vocabulary rows (or logit columns) are real
    tokens, the rest being padding: ``V - rank * local`` clipped to [0, local]."""
    return max(0, min(local, vocab_size - rank * local))


class VocabParallelEmbedding(nn.Embedding):
    """Token embedding with the vocabulary split: rank r holds rows [r Vp/tp, (r+1) Vp/tp) of the
    padded vocabulary (module docstring; Vp = V when tp divides it).

    Forward looks up the ids in this rank's range (zeros elsewhere) and sums the ranks'
    partial embeddings (all-reduce, or reduce-scatter along the sequence under sequence
    parallelism).  ``logits`` is the tied LM head: this rank's Vp/tp logits of every token,
    the padding's among them (zero: the loss masks them).
    """

    def __init__(self, num, dim, dtype, tp, std=0.02):
        self.tp = tp
        self.vocab_size = num
        self.weight = nn._param((num, dim), dtype, ("normal", std), tp.shard(0))

    def forward(self, ids):
        tp = self.tp
        if tp.parts == 1:
            return ops.embedding(self.weight, ids)
        ids = check_range(ids, self.vocab_size, "embedding id")  # never a padding row
        rows = self.weight.shape[0]
        # Operators only, so a host batch stays on the host, where its indices are checked for free.
        local = ids - tp.rank * rows
        mine = (local >= 0) & (local < rows)
        partial = ops.embedding(self.weight, local * mine) * from_host(mine)[..., None].astype(self.weight.dtype)
        return tp.leave(partial)

    def logits(self, x):
        return self.tp.column_linear(x, ops.transpose(self.weight, (1, 0)))


def vocab_parallel_cross_entropy(logits, targets, group, vocab_size: int | None = None):
    """Mean cross-entropy of vocabulary-sharded logits (Megatron-LM's vocab-parallel loss).

    ``logits`` (..., Vl) are this rank's columns [r Vl, (r+1) Vl) of the full (padded) logits;
    ``targets`` (...) are global token ids below ``vocab_size`` (default: all tp Vl columns
    are real), the same on every rank.  The columns from ``vocab_size`` on are padding, set
    to -inf here so they take no part in the softmax.  Per token::

        m = max over ranks of the local maxima                      (all-reduce max)
        S = sum over ranks of sum_j exp(z_j - m)                      (all-reduce sum)
        z_t - m from the one rank that holds column t, 0 elsewhere   (same all-reduce)
        loss = log S - (z_t - m)

    Communication: 3 numbers per token, never the Vl logits.  The loss is replicated;
    its gradient with respect to this rank's logits is (softmax - onehot) / n on this
    rank's columns (zero on the padding), which needs no communication.
    """
    Vl = logits.shape[-1]
    lo = group.rank * Vl
    V = Vl * group.size if vocab_size is None else vocab_size
    t, _ = checked_targets(targets, logits.shape, V)
    cdt = compute_dtype(logits.dtype)
    z = logits.data.reshape(-1, Vl).astype(cdt, copy=True)
    real = real_columns(V, Vl, group.rank)
    if real < Vl:  # the padding: exp(-inf) = 0 in the sum and the probabilities
        z[:, real:] = -xp.inf
    n, rows = z.shape[0], xp.arange(z.shape[0])
    z -= comm.all_reduce(z.max(axis=1), group, op="max")[:, None]
    local = t - lo
    mine = (local >= 0) & (local < Vl)
    local = xp.where(mine, local, 0)
    picked = xp.where(mine, z[rows, local], 0.0)
    xp.exp(z, out=z)
    total, picked = comm.all_reduce(xp.stack([z.sum(axis=1), picked]), group, op="sum")
    nll = xp.log(total) - picked
    z /= total[:, None]  # this rank's columns of softmax(z), saved for backward
    loss = xp.asarray(nll.sum() / n, dtype=cdt)

    def backward(g):
        scale = xp.asarray(g, dtype=z.dtype) / n  # stays on the device: no host sync
        dz = z * scale
        dz[rows, local] -= xp.where(mine, scale, 0)  # no boolean mask: its size would be a host read
        return (to_dtype(dz.reshape(logits.shape), logits.dtype),)

    return make_tensor(loss, (logits,), backward)
