"""Which tokens a mixture of experts routes where a rank holds only part of each sequence.

Capacity and the load-balancing loss are per sequence (moe.py: GShard's groups), and an
expert takes the *earlier* tokens of a sequence first, so a mixture's decisions need whole
sequences, in order.  Where an axis gives a rank part of each sequence, either the mixture's
``sequence`` seam gathers the sequences before routing and gives back this rank's part of
the output (tensor parallelism), or its ``whole_choices`` seam gathers only every rank's
routing choices and the mixture runs on this rank's tokens (context parallelism).

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

**Context parallelism**: a rank holds part of each sequence (zig-zag chunks for ring
attention, a contiguous slice for Ulysses: ``context.positions``).  The
router, the experts and the gates act on each token alone, so every cp rank runs the mixture
on its own tokens; only two decisions need the whole sequence: which choices capacity keeps
(an expert's places go to the sequence's earlier tokens first) and the load-balancing loss's
shares ``f_e``.  Both are functions of the choices alone, so the cp ranks all-gather their
tokens' top-k choices (B·T·k integers, no gradient: ``whole_choices``), put them in sequence
order, and each decides for the whole sequences exactly as one process does, keeping its own
tokens' part.  The losses' other factors are means over tokens: a rank's means over its
tokens, weighted by the strategy's 1/cp share, sum over the cp ranks to the whole sequences'
(f a constant), and each rank's gradients are its own tokens' part, summed over
``("dp", "cp")`` by data parallelism like every gradient of a cp run.  So each cp rank does
1/cp of the experts' work and the routing stays exactly per sequence.  (Under sequence
parallelism the tp gather comes first and gives the cp rank's tokens.)
"""

from __future__ import annotations

from minidist import comm
from minidist.comm import functional as F
from minidist.model.backend import host  # host: the choices' and positions' index bookkeeping
from minidist.model.moe import mixtures
from minidist.parallel.context import positions


def route_whole_sequences(model, cfg, mesh) -> None:
    """Set every mixture's seams for the axes of ``mesh`` that split the sequence: tensor
    parallelism with sequence parallelism gathers the tokens (``sequence``), context
    parallelism the choices (``whole_choices``)."""
    tp = mesh.group("tp") if mesh.size("tp") > 1 and model.layers.sequence_parallel else None
    cp = mesh.group("cp") if mesh.size("cp") > 1 else None
    zigzag = cfg.parallel.cp_impl == "ring"  # as ContextParallel lays the tokens out
    sequence = (lambda x: F.gather_from_group(x, tp, 1), lambda y: F.scatter_to_group(y, tp, 1)) if tp else None

    def whole_choices(choice, B):
        """Every cp rank's choices (B·t, k) in sequence order (B·T, k), and this rank's positions."""
        t, k = choice.shape[0] // B, choice.shape[1]
        T = t * cp.size
        order = host.concatenate([positions(r, cp.size, T, zigzag) for r in range(cp.size)])
        mine = host.ascontiguousarray(choice.reshape(B, t, k).transpose(1, 0, 2))  # by token: all_gather's rows
        every = host.asarray(comm.all_gather(mine, cp))[host.argsort(order)]      # (T, B, k), in sequence order
        return every.transpose(1, 0, 2).reshape(B * T, k), positions(cp.rank, cp.size, T, zigzag)

    for layer in mixtures(model.h):
        layer.sequence = sequence
        layer.whole_choices = whole_choices if cp is not None else None
