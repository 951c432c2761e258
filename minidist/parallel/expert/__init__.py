"""Expert parallelism (GShard, Lepikhin et al. 2020): the experts of every mixture split over
the ranks of an ``ep`` group, the tokens sent to the rank holding their expert and back.

The ``ep`` ranks are consecutive ranks of the data-parallel group (each sees its own
tokens); rank r of an ep group of N holds experts ``r E/N .. (r+1) E/N - 1`` of every mixture
(the others become None in ``MoE.experts``, so names and initialisation stay global).  One
mixture's forward on a rank (:class:`ExpertParallelDispatch`, the MoE's ``dispatch`` seam):

1. the rows sorted by expert (moe.py) are rank-major already: expert e lives on rank
   e // (E/N), so rank j's rows are one contiguous slice;
2. the row counts per expert travel first (a small ``all_to_all_v`` of ints), then the
   rows (``comm.functional.all_to_all_v``: its backward returns the gradients);
3. the rows received, source-major, are regrouped expert-major (``moe.permute_rows``), each
   local expert runs on its rows, and the outputs are put back in the received order;
4. a second ``all_to_all_v`` (the counts swapped) returns each token's output to its rank.

Gradients: an expert's gradient on a rank sums the contributions of every token of its ep
group routed to it; the ranks holding the same experts (the same place in their ep groups:
the ``edp`` group) sum theirs (:func:`reduce_expert_gradients`, the textbook step), as the
data-parallel gradients of the dense parameters are summed over the whole data-parallel group.

In training (:func:`apply`, the composer's step between the pipeline and data parallelism)
the expert parameters are carved out of data parallelism, as Megatron Core and torchtitan
do: the data-parallel part (parallel/data/experts.py) reduces the dense parameters over
``("dp", "cp")`` and the experts' over the edp group, each with the run's flavour (DDP's
buckets, ZeRO-1/2's shards over its own group; ZeRO-3 gives each block's experts a unit of
their own, sharded over edp: data/fsdp.py).  Every local expert runs on every pass, on
zero rows if no token chose it, so its gradient exists (zeros) on every rank and the gradient
hooks fire in the same order everywhere.  ``checks.py`` holds ``--ep``'s checks; ``tokens.py``
routes by whole sequences where an axis splits them: sequence parallelism gathers them (the
router and experts replicated over tp), context parallelism gathers only the routing choices.
"""

from __future__ import annotations

from minidist import comm
from minidist.model import ops
from minidist.model.backend import host, xp  # host: the dispatch's index bookkeeping
from minidist.model.moe import mixtures, permute_rows
from minidist.parallel.expert.checks import problems  # noqa: F401  (compose.problems gathers it)
from minidist.parallel.expert.tokens import route_whole_sequences

__all__ = ["ExpertGroups", "ExpertParallelDispatch", "apply", "expert_groups", "expert_parameters", "problems",
           "reduce_expert_gradients", "split_experts"]


def expert_groups(dp_group, ep: int):
    """``(ep_group, edp_group)`` of this rank: ``ep`` consecutive ranks of ``dp_group`` split
    the experts; the ranks at the same place in every ep group hold the same experts."""
    d = dp_group.rank
    # Split is collective over dp_group: every rank makes both calls, in the same order.
    ep_group = comm.Group(dp_group.user_comm.Split(d // ep, d), name=f"{dp_group.name}.ep{ep}")
    edp_group = comm.Group(dp_group.user_comm.Split(d % ep, d), name=f"{dp_group.name}.edp{dp_group.size // ep}")
    return ep_group, edp_group


class ExpertParallelDispatch:
    """The MoE's ``dispatch`` over ``group``: (experts, rows sorted by expert, counts per
    expert) -> the experts' outputs in the same order, the experts run where they live."""

    def __init__(self, group, n_experts: int):
        self.group, self.per = group, n_experts // group.size
        self.first = group.rank * self.per

    def __call__(self, experts, xs, counts):
        received, theirs, got = self.send(xs, counts)
        n, per = self.group.size, self.per
        # Source-major -> expert-major: the rows for local expert i from source j start at
        # start[j, i] of the received buffer.
        start = (host.cumsum(theirs.reshape(-1)) - theirs.reshape(-1)).reshape(n, per)
        order = host.concatenate([host.arange(start[j, i], start[j, i] + theirs[j, i])
                                for i in range(per) for j in range(n)] or [host.zeros(0, host.int64)]).astype(host.int64)
        by_expert = permute_rows(received, order)
        sizes = theirs.sum(axis=0)
        parts = ops.split(by_expert, [int(s) for s in sizes], axis=0)
        ys = ops.concat([experts[self.first + i](p) for i, p in enumerate(parts)], axis=0)  # zero rows too
        back = permute_rows(ys, host.argsort(order))     # the received order again
        return self.send_back(back, got)

    def send(self, xs, counts):
        """The dispatch (a seam: the tracer times it): the counts per expert, then the rows, to
        the ranks holding their experts.  Returns the rows received (source-major), ``theirs``
        (n, E/N): how many each source sent for each local expert, and the rows per source."""
        g, n, per = self.group, self.group.size, self.per
        counts = host.asarray(counts, host.int64)
        # Counts first: row j of (n, per) tells rank j how many rows come for each of its experts.
        theirs, _ = comm.all_to_all_v(counts.reshape(n, per), [1] * n, g)           # (n, per): from each source
        theirs = host.asarray(theirs).reshape(n, per)
        received, got = comm.functional.all_to_all_v(xs, counts.reshape(n, per).sum(axis=1), g)
        return received, theirs, got

    def send_back(self, back, got):
        """The combine (a seam: the tracer times it): each output back to its token's rank."""
        out, _ = comm.functional.all_to_all_v(back, got, self.group)
        return out


class ExpertGroups:
    """What expert parallelism hands the data-parallel part: this rank's expert ``params``,
    the ``ep`` group they are split over and the ``edp`` group that holds the same ones."""

    def __init__(self, params, ep_group, edp_group):
        self.params, self.ep_group, self.edp_group = params, ep_group, edp_group


def apply(model, cfg, mesh) -> ExpertGroups | None:
    """The composer's step for this axis: the mixtures route by whole sequences (tokens.py); with
    ``cfg.parallel.ep`` > 1, make the ep and edp
    groups from the mesh's ``("dp", "cp")`` group (collective: every rank calls it once, in
    the same order), keep this rank's experts of every mixture and dispatch over ep; None
    without expert parallelism (the experts stay ordinary data-parallel parameters)."""
    ep = cfg.parallel.ep
    if mesh is None:
        return None
    route_whole_sequences(model, cfg, mesh)  # tokens.py: capacity and shares per whole sequence
    if ep == 1:
        return None
    ep_group, edp_group = expert_groups(mesh.group(("dp", "cp")), ep)
    split_experts(model, ep_group)
    return ExpertGroups(expert_parameters(model), ep_group, edp_group)


def split_experts(model, ep_group) -> None:
    """Keep this rank's experts of every mixture and dispatch their tokens over ``ep_group``."""
    for layer in mixtures(model.h):
        d = ExpertParallelDispatch(ep_group, layer.cfg.experts)
        layer.experts = [e if d.first <= i < d.first + d.per else None for i, e in enumerate(layer.experts)]
        layer.dispatch = d


def expert_parameters(model) -> list:
    """The parameters of the experts this rank holds (the ones reduced over the edp group)."""
    return [p for layer in mixtures(model.h) for e in layer.experts if e is not None for p in e.parameters()]


def reduce_expert_gradients(model, edp_group) -> None:
    """Sum every local expert's gradient over the ranks holding the same experts (textbook:
    one all-reduce per parameter, after backward)."""
    if edp_group.size == 1:
        return
    for p in expert_parameters(model):
        if p.grad is None:
            p.grad = xp.zeros_like(p.data)
        p.grad = comm.all_reduce(p.grad, edp_group, op="sum")
