"""Tensor parallelism: every weight matrix split over the ``tp`` ranks (Megatron-LM).

Tensor parallelism splits every weight matrix over the ``tp`` ranks of a group (Shoeybi et
al. 2019, "Megatron-LM: Training Multi-Billion Parameter Language Models Using Model
Parallelism").  Linear weights are stored ``(in, out)`` (``y = x @ W``):

* **ColumnParallelLinear** keeps ``out / tp`` columns of W: every rank needs the whole
  input and produces its slice of the output features;
* **RowParallelLinear** keeps ``in / tp`` rows of W: every rank takes its slice of the input
  features and produces a *partial sum* of the whole output.

Column then row needs no communication in between, so the MLP (``c_fc`` column, ``c_proj``
row) and attention (q, k, v column-split by heads, output projection row) each communicate
once forward and once backward: Megatron's **f** (identity, all-reduce of the gradient)
where the block starts and **g** (all-reduce, identity backward) where it ends
(comm/functional.py).  Cost per block and direction: one all-reduce of the activation,
2 (tp-1)/tp * B*T*C elements sent per rank.

The vocabulary is split too: each rank holds ``V / tp`` rows of the token embedding (a
lookup outside them gives zeros; the ranks' partial embeddings are summed), the tied LM
head produces ``V / tp`` logits per token, and the cross-entropy combines the shards with
two small all-reduces (a max and a sum per token) without ever forming the full logits.
A vocabulary tp does not divide is padded to a multiple of tp, as Megatron-LM pads it; the
padding is masked out of the loss, so it changes no number (vocab_parallel.py).

Sequence parallelism (``sequence_parallel=True``) and collective matmuls (``overlap="ring"``
or ``"bidirectional"``) keep these layers and replace each all-reduce by an all-gather and a
reduce-scatter along the sequence: the linear ops live in sequence_parallel.py
(Korthikanti et al. 2022; Wang et al. 2022).

Read in this order:

  tensor_parallel.py    the split layers (column, row; Megatron's f and g) and the layer set
                        ``nn.GPT`` builds from
  vocab_parallel.py     the vocabulary split (the embedding, its tied head, the loss), padded
  sequence_parallel.py  the linear ops of sequence parallelism (all-gather / reduce-scatter)
  collective_matmul.py  those collectives cut into steps that overlap the matmuls
  checks.py             the settings' checks

:func:`apply` is the composer's step for this axis.  Imports host, layout, model and comm;
nothing above ``parallel``.
"""

from __future__ import annotations

from minidist.parallel.tensor.checks import problems  # noqa: F401
from minidist.parallel.tensor.tensor_parallel import (ColumnParallelLinear, LayerNorm, PositionEmbedding,  # noqa: F401
                                                      RowParallelLinear, Shard, TensorParallelLayers,
                                                      VocabParallelEmbedding, vocab_parallel_cross_entropy)
from minidist.parallel.tensor.vocab_parallel import real_columns  # noqa: F401


def apply(cfg, mesh):
    """The tensor-parallel part of a run, the composer's first step: the layer set ``nn.GPT``
    builds from, split over the mesh's tp group when ``--tp`` > 1, else None (the plain layers).
    It comes first because the model is *built* split: each rank draws its slices of the
    global weights from the seed."""
    p = cfg.parallel
    if p.tp == 1:
        return None
    return TensorParallelLayers(mesh.group("tp"), p.sequence_parallel, p.tp_async or "none")
