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
"""

from __future__ import annotations

from minidist.comm import functional as F
from minidist.model.moe import MoE


def route_whole_sequences(model, cfg, mesh) -> None:
    """Set every mixture's ``sequence`` seam for the axes of ``mesh`` that split the sequence:
    tensor parallelism with sequence parallelism (axis 1 of the activations between blocks)."""
    tp = mesh.group("tp") if mesh.size("tp") > 1 and model.layers.sequence_parallel else None
    if tp is None:
        return
    for block in model.h:
        layer = getattr(block, "mlp", None)
        if isinstance(layer, MoE):
            layer.sequence = (lambda x: F.gather_from_group(x, tp, 1), lambda y: F.scatter_to_group(y, tp, 1))
