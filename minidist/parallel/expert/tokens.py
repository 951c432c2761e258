"""Which tokens a mixture of experts routes where a rank holds only part of each sequence.

Capacity and the load-balancing loss are per sequence (moe.py: GShard's groups), and an
expert takes the *earlier* tokens of a sequence first, so a mixture must see whole
sequences, in order.  Where an axis gives a rank part of each sequence, the mixture's
``sequence`` seam gathers the sequences before routing and gives back this rank's part of
the output.

**Tensor parallelism.**  The router and the experts are *replicated* over the tp ranks, not
split (the simplest correct design; Megatron Core can split experts over tp, at the price of
collectives inside every expert on uneven row buffers): every tp rank computes the same
mixture of the whole sequences, as it computes the same LayerNorm, and their gradients need
no reduction over tp (the norm counts them on tp rank 0, as every replicated parameter).
Without sequence parallelism the mixture's input is whole already.  With it (Korthikanti et
al. 2022) a rank holds T / tp tokens of each sequence: ``gather_from_group`` all-gathers them
(its backward keeps this rank's slice of the gradient) and ``scatter_to_group`` keeps this
rank's slice of the output (its backward all-gathers the gradient), so the mixture between
runs replicated on whole gradients, exactly as without sequence parallelism.

**Context parallelism** (after tp's gather, which gives the cp rank's tokens in its local
order): the cp ranks' tokens are all-gathered and put in sequence order by their positions
(zig-zag for ring attention, contiguous for Ulysses: ``context.positions``); the output keeps
this rank's tokens.  Here the pairing is the other one: the all-gather's backward
*reduce-scatters* and the slice's backward fills zeros, so each cp rank's gradients are the
part its own tokens' outputs give, and data parallelism sums them over ``("dp", "cp")`` as
it sums every gradient of a cp run.  Every cp rank computes the same auxiliary losses of the
whole sequences; the strategy weights a rank's loss by its share of the tokens (1 / cp), so
their values and gradients, summed over the cp ranks, count once.  (Each cp rank runs the
experts on the whole sequences: cp times the experts' work, for exact routing per sequence.)
"""

from __future__ import annotations

from minidist.comm import functional as F
from minidist.model import ops
from minidist.model.backend import host, xp  # host: the positions' index bookkeeping
from minidist.model.moe import MoE
from minidist.parallel.context import positions


def route_whole_sequences(model, cfg, mesh) -> None:
    """Set every mixture's ``sequence`` seam for the axes of ``mesh`` that split the sequence:
    tensor parallelism with sequence parallelism, then context parallelism (axis 1 of the
    activations between blocks)."""
    tp = mesh.group("tp") if mesh.size("tp") > 1 and model.layers.sequence_parallel else None
    cp = mesh.group("cp") if mesh.size("cp") > 1 else None
    if tp is None and cp is None:
        return
    zigzag = cfg.parallel.cp_impl == "ring"  # as ContextParallel lays the tokens out

    def gather(x):
        if tp is not None:
            x = F.gather_from_group(x, tp, 1)
        if cp is not None:
            T = x.shape[1] * cp.size
            order = host.concatenate([positions(r, cp.size, T, zigzag) for r in range(cp.size)])
            x = ops.getitem(F.all_gather(x, cp, axis=1), (slice(None), xp.asarray(host.argsort(order))))
        return x

    def scatter(y):
        if cp is not None:
            y = ops.getitem(y, (slice(None), xp.asarray(positions(cp.rank, cp.size, y.shape[1], zigzag))))
        if tp is not None:
            y = F.scatter_to_group(y, tp, 1)
        return y

    for block in model.h:
        layer = getattr(block, "mlp", None)
        if isinstance(layer, MoE):
            layer.sequence = (gather, scatter)
