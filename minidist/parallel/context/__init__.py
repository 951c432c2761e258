"""Context parallelism: the sequence split over the ``cp`` ranks, attention made whole again.

Everything in a transformer block except attention works token by token, so when each of the
``C`` ranks of the cp group holds ``T / C`` tokens of every sequence, only attention needs the
other ranks (its queries must meet every earlier key).  Two ways to give it them:

* **Ring attention** (Liu et al. 2023): the key/value blocks travel around the ring of cp
  ranks and fold into an online softmax, so no rank ever holds the whole sequence; the
  zig-zag layout evens out the causal work (ring.py says how).  Sends ``2 / C`` of the
  activations per rank and step, ``C - 1`` steps.

* **DeepSpeed-Ulysses** (Jacobs et al. 2023): an all-to-all turns the sequence-sharded Q, K, V
  (``T/C`` tokens, all ``H`` heads) into head-sharded ones (all ``T`` tokens, ``H/C`` heads),
  each rank runs ordinary attention on its heads, and a second all-to-all turns the output
  back.  Needs ``H`` divisible by ``C``; sends ``3/C`` of the activations per rank forward.

The rest follows the split: each rank embeds its tokens at their true positions and computes
the loss of its tokens weighted by their share of the batch's tokens, so the sum over the cp
group of the ranks' losses (and of their parameter gradients) is exactly the loss (gradient)
of one process holding the whole sequence.

Read in this order:

  context_parallel.py  ContextParallel: who holds which tokens (zig-zag), the model's attention
                       and positions set through its seams (``use_attention``,
                       ``use_positions``), this rank's share of the loss
  ring.py              ring attention and its work count
  ulysses.py           DeepSpeed-Ulysses
  checks.py            the settings' checks

:func:`apply` is the composer's step for this axis.  Imports host, layout, model and comm;
nothing above ``parallel``.
"""

from __future__ import annotations

from minidist.parallel.context.checks import problems  # noqa: F401
from minidist.parallel.context.context_parallel import ContextParallel, positions  # noqa: F401
from minidist.parallel.context.ring import ring_attention, ring_self_attention, ring_work  # noqa: F401
from minidist.parallel.context.ulysses import ulysses_self_attention  # noqa: F401


def apply(model, cfg, mesh):
    """The context-parallel part of a run: with ``--cp`` > 1, every block's attention and the
    token positions become those of this rank's part of each sequence; the ContextParallel
    (the strategy shards the batch and weights the loss with it), or None."""
    p = cfg.parallel
    if p.cp == 1:
        return None
    context = ContextParallel(mesh.group("cp"), p.cp_impl, cfg.model.attention, cfg.model.attention_block)
    context.install(model)
    return context
