"""What a mixture of experts adds to a step's price on a mesh: expert parallelism's
all-to-all and the experts' own gradient reduction (GShard, Lepikhin et al. 2020; Switch
Transformers, Fedus et al. 2021; Mixtral, Jiang et al. 2024; the expert/data split of
Megatron Core).

* **Where an ep group lies.**  ep consecutive ranks of the data-parallel group (the
  ``("dp", "cp")`` ranks, cp inner), as ``parallel/expert`` cuts it; in minidist's rank order
  (tp innermost, then cp, pp, dp) consecutive dp ranks are ``tp x cp x pp`` ranks apart, so
  an ep group with pp or tp > 1 reaches across nodes sooner.  Its messages use the innermost
  link whose domain holds the aligned block of ranks it spans (:func:`ep_span`).
* **The all-to-all** (GShard's dispatch and combine): per mixture and microbatch, forward
  one all-to-all sends each rank's routed rows to the ranks holding their experts and one
  brings the outputs back; backward the gradients travel the same two ways again; activation
  checkpointing repeats the forward's two.  Each moves, per rank, ``n x r x d x b`` bytes of
  which ``(ep - 1) / ep`` leave the rank (balanced routing), in ``ep - 1`` pairwise steps:
  n the rank's tokens of the microbatch (over tp with sequence parallelism), r the rows a
  token sends (``top_k``; ``capacity_factor x top_k`` where a fused implementation pads every
  expert's buffer to its capacity, GShard/Switch), d the width, b the activations' bytes.
  Not overlapped: an expert waits for its rows, and the block's output for the experts'.
* **The experts' gradients** are reduced over the ranks holding the same experts (the edp
  group, ``dp x cp / ep`` ranks), with the run's ZeRO stage over that group; the dense
  parameters (attention, norms, routers, embeddings) over all ``dp x cp``.

The experts' compute is :mod:`.model`'s (k experts per token, active FLOPs only), their
memory :mod:`.stages`' (E / ep experts per rank).  Routing is balanced unless the estimate is
given an ``expert_load``: the busiest ep rank's rows over the mean (a learned router is rarely
balanced, and with ep > 1 a mixture waits for its busiest rank; dropless routing lets it reach
ep, a capacity factor c bounds it near c).
"""

from __future__ import annotations

from minidist.plan.collectives import all_to_all
from minidist.plan.stages import stage_mix


def ep_span(p) -> int:
    """The aligned block of consecutive ranks that holds an ep group: its last rank is group
    index ep - 1 of the (dp, cp) group, i.e. cp coordinate (ep - 1) mod cp and dp coordinate
    (ep - 1) div cp, at mesh rank tp x (c + cp x pp x d)."""
    d, c = divmod(p.ep - 1, p.cp)
    return p.tp * (c + p.cp * p.pp * d + 1)


def routed_rows(m, minidist: bool = False) -> float:
    """Rows one token sends to experts (and experts compute): ``top_k``, dropless; with a
    capacity factor c a fused implementation pads each expert to its capacity, c x T x k / E
    rows per sequence, so c x k per token; minidist computes the kept rows only (at most k)."""
    c = m.capacity_factor
    if not c:
        return float(m.top_k)
    return m.top_k * (min(1.0, c) if minidist else c)


def expert_flops(m, minidist: bool = False) -> float:
    """Forward FLOPs per token of the experts' rows: the MLP's, once per routed row."""
    return 2 * (3 if m.gated else 2) * m.d_model * m.ffn * routed_rows(m, minidist)


def expert_values(m) -> float:
    """Values per token minidist's experts keep for their ``top_k`` rows (each row's MLP
    arrays, and its gathered input, output and weighted output: minidist_moe_values)."""
    return m.top_k * ((3 * m.ffn if m.gated else 8 * m.d_model) + 3 * m.d_model)


def expert_extra_flops(m, minidist: bool = False) -> float:
    """Forward FLOPs per token a mixture executes beyond the k experts of the model count:
    the padding rows of a capacity factor above 1 (or fewer, below it)."""
    mlp = 2 * (3 if m.gated else 2) * m.d_model * m.ffn
    return mlp * (routed_rows(m, minidist) - m.top_k)


def all_to_all_bytes(s) -> float:
    """The buffer one rank hands one all-to-all of a mixture: its tokens' routed rows."""
    tokens = s.n / (s.p.tp if s.sp else 1)
    return tokens * routed_rows(s.m, s.minidist) * s.m.d_model * s.pr.act


def sent_bytes(s) -> float:
    """Bytes one rank sends per all-to-all: the share of its rows bound for other ranks."""
    ep = s.p.ep
    return all_to_all_bytes(s) * (ep - 1) / ep if ep > 1 else 0.0


def a2a_per_mixture(s) -> int:
    """All-to-alls per mixture and microbatch: dispatch and combine forward and backward,
    and the forward's two again when checkpointing recomputes it."""
    return 4 + (2 if s.ckpt else 0)


def most_mixtures(s) -> int:
    """Mixtures on the stage that has the most."""
    return max(moe for _, moe in stage_mix(s.m, s.p.pp))


def ep_time(s) -> float:
    """Seconds of one microbatch's all-to-alls on the stage with the most mixtures (minidist
    sends the row counts first: two calls per all-to-all)."""
    if s.p.ep == 1 or not s.m.experts:
        return 0.0
    link = s.mc.link_for(ep_span(s.p))
    calls = 2 if s.minidist else 1
    one = all_to_all(all_to_all_bytes(s), s.p.ep, link, s.mc.link_eff) + calls * s.mc.coll_overhead_s / s.share
    return most_mixtures(s) * a2a_per_mixture(s) * one


def ep_syncs(s) -> int:
    """Sync points of the all-to-alls per step (ranks sharing cores wait at each)."""
    if s.p.ep == 1 or not s.m.experts:
        return 0
    return s.p.microbatches * most_mixtures(s) * a2a_per_mixture(s) * (2 if s.minidist else 1)


def minidist_moe_values(m, dense_values: float) -> float:
    """Values minidist's NumPy mixture keeps live per token, from its dense block's: the MLP's
    arrays (GELU's 8 d, SwiGLU's 3 f) k times, each of the k rows also gathered, output and
    weighted (3 d), the combined output (d) and the router's logits, probabilities and their
    float copies (3 E)."""
    mlp = 3 * m.ffn if m.gated else 8 * m.d_model
    return dense_values - mlp + expert_values(m) + m.d_model + 3 * m.experts


def minidist_ep_values(m, ep: int) -> float:
    """Values per token minidist's expert-parallel dispatch (parallel/expert) keeps beyond the
    local one: the k rows received, put back in received order and returned, each a new
    array the graph holds for the backward (3 k d; balanced routing)."""
    return 3 * m.top_k * m.d_model if ep > 1 else 0.0
