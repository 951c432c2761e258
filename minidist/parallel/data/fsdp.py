"""FSDP: ZeRO stage 3, the parameters sharded too; HSDP, sharding inside groups, replicas across.

Zhao et al. 2023, "PyTorch FSDP: Experiences on Scaling Fully Sharded Data Parallel"; ZeRO
stage 3 of Rajbhandari et al. 2020 (zero.py has the memory table: 4bΨ_r bytes per rank).
Parameters live only as shards of flat units (flat.py): one unit per transformer block,
and the root unit (the embedding, final LayerNorm and head).

* A block's parameters are all-gathered just before its forward and freed after it,
  gathered again before its backward, and its gradients reduce-scattered right after; the
  next block's gather is **prefetched** (async) while the current one computes, so at most
  two blocks are whole at once.  The root unit is gathered for the whole forward and
  backward.
* Because minidist's ops keep their input arrays in the graph, a block whose weights are
  freed cannot keep its graph: each block's forward runs without recording it and is
  recomputed in backward (per-block activation checkpointing, Chen et al. 2016), so
  ``--checkpoint-activations`` changes nothing here.
* With gradient accumulation every micro-step reduce-scatters into the gradient shard,
  which is what keeps the gradient memory at Ψ_r.
* **HSDP** (hybrid sharding, ``replicate_group``): FSDP inside shard groups of K ranks, the
  gradient shards then all-reduced over the replica group of the N/K ranks holding the
  same shard (:func:`hsdp_groups` makes both groups).

* **Experts** (``experts``: expert parallelism's groups, parallel/expert/): a rank holds only
  its ep group's share of each mixture's experts, the same as the other ranks of its *edp*
  group.  Each block then has two units: the dense one sharded over ``shard_group`` and the
  experts' sharded over the edp group (torchtitan's FSDP of the experts over the ranks that
  hold the same ones), gathered, recomputed and reduce-scattered together.

FSDP reaches into the model through one seam, ``GPT.use_block_runner``: each block runs in
:meth:`FSDP._run_block`, which gathers the block's shards around it.  ``group`` is
the whole data-parallel group (the loss is summed over it); ``shard_group`` the ranks the
shards are split over (the same group, or HSDP's groups of K).
"""

from __future__ import annotations

import contextlib

from minidist import comm
from minidist.model.autograd import Tensor, enable_grad, is_grad_enabled, no_grad, run_backward
from minidist.model.backend import from_host, to_host
from minidist.model.ops import autocast, get_autocast_dtype
from minidist.parallel.data.allreduce import broadcast_parameters, check_identical
from minidist.parallel.data.flat import FlatUnit, Shard
from minidist.parallel.data.replica import OneReplica
from minidist.parallel.data.zero import (Sharded, ShardedOptimizer, accumulate, decay_of, load_shards, owned_shards,
                                         shard_segments)

_FREED = None  # what a parameter's .data is between uses


class FSDP(Sharded, OneReplica):
    """ZeRO stage 3 of ``model`` over ``shard_group`` (None: all of ``group``), updating with
    ``optimizer``'s rule; ``replicate_group`` makes it HSDP.

    The loop's calls (the protocol of replica.py): ``with fsdp.micro_step(last): ...backward()``
    (gather the root unit and prefetch the first block; afterwards reduce-scatter the root's
    gradients and wait for the blocks'), ``fsdp.step()`` (update the shards; nothing to
    gather: the next forward gathers), ``fsdp.zero_grad()``.  ``grad_holders`` are the shards
    (disjoint within the shard group; HSDP's replicas hold the same ones).  ``max_live_blocks``
    and ``max_live_bytes`` record the most block units and full-parameter bytes alive at once.
    """

    stage = 3
    reduces_every_micro_step = True  # each block's gradients are reduce-scattered in its backward

    def __init__(self, model, optimizer, group, shard_group=None, replicate_group=None, experts=None):
        super().__init__(model, optimizer, group)
        self.shard_group, self.replicate_group = shard_group or group, replicate_group
        decay = decay_of(optimizer, self.params)  # while the parameters are whole
        self.expert_ids = {id(p) for p in experts.params} if experts is not None else set()
        dense = [p for p in self.params if id(p) not in self.expert_ids]
        for g, same in ((self.shard_group, dense), (replicate_group, dense),
                        (experts and experts.edp_group, experts and experts.params)):
            if g is not None:  # the ranks of each group hold the same parameters
                broadcast_parameters(same, g)
                check_identical(same, g)
        self._shard_units(model, experts.edp_group if experts is not None else None)
        self.shard_optimizer = ShardedOptimizer(optimizer, self.units, self.shards, decay)
        # The shards are disjoint within a shard group; HSDP's replicas hold the same ones.
        self.counts_in_norm = replicate_group is None or replicate_group.rank == 0
        self.name = (f"HSDP: ZeRO-3 over {self.shard_group.size} ranks x {replicate_group.size} replicas"
                     if replicate_group is not None else f"ZeRO-3 (FSDP) over {self.shard_group.size} ranks")

    def _shard_units(self, model, edp_group=None):
        """One unit per block and a root unit of the rest (and one per block's experts, over
        ``edp_group``); keep this rank's shard, free the rest."""
        blocks = [b for b in model.h if b is not None]  # a pipeline stage keeps only its blocks
        in_blocks = {id(p) for b in blocks for p in b.parameters()}
        root = [p for p in self.params if id(p) not in in_blocks]
        g, ex = self.shard_group, self.expert_ids
        self.root = FlatUnit(root, g.rank, g.size, "root")
        self.block_units = [FlatUnit([p for p in b.parameters() if p.requires_grad and id(p) not in ex],
                                     g.rank, g.size, f"h.{i}") for i, b in enumerate(blocks)]
        self.units = [self.root] + self.block_units
        self.groups = [g] * len(self.units)  # the ranks each unit is sharded over
        self.companion = {}  # block unit index -> its experts' unit index
        for i, b in enumerate(blocks):
            mine = [p for p in b.parameters() if id(p) in ex]
            if mine:
                self.companion[i + 1] = len(self.units)
                self.units.append(FlatUnit(mine, edp_group.rank, edp_group.size, f"h.{i}.experts"))
                self.groups.append(edp_group)
        self.shards = []
        for unit in self.units:
            full = unit.flatten([p.data for p in unit.params])
            self.shards.append(Shard(full[unit.lo:unit.hi].copy()))
            for p in unit.params:
                p.data = _FREED
        self.unit_index = {id(b): i + 1 for i, b in enumerate(blocks)}
        self._inflight = {}        # unit index -> handle of its prefetched all-gather
        self.live = set()          # unit indices whose full parameters exist now (gathered or in flight)
        self.max_live_blocks = 0   # the most block units alive at once (asserted by the tests)
        self.max_live_bytes = 0    # the most full-parameter bytes alive at once
        self._pending_rs = []      # (unit index, handle) of block reduce-scatters in flight
        model.use_block_runner(lambda plain: self._run_block)

    # -- gather, prefetch, free ----------------------------------------------------------------
    def _launch_gather(self, i):
        if i in self.live:
            return
        self.live.add(i)
        self._count_live()
        self._inflight[i] = comm.all_gather(to_host(self.shards[i].data), self.groups[i], async_op=True)

    def _prefetch(self, i):
        """Start gathering block unit i (1..L) and its experts while the current block computes."""
        if 1 <= i <= len(self.block_units):
            for k in self._block(i):
                self._launch_gather(k)

    def _block(self, i):
        """The units of block unit i: itself, and its experts' unit if it has one."""
        return [i] + ([self.companion[i]] if i in self.companion else [])

    def _gathered(self, i):
        """Make unit i's parameters full (waiting for its prefetch if one is in flight)."""
        self._launch_gather(i)
        handle = self._inflight.pop(i, None)
        if handle is not None:
            unit = self.units[i]
            for p, view in zip(unit.params, unit.views(from_host(handle.wait()))):
                p.data = view

    def _free(self, i):
        for p in self.units[i].params:
            p.data = _FREED
        self.live.discard(i)

    def _count_live(self):
        blocks = len(self.live - {0})
        self.max_live_blocks = max(self.max_live_blocks, blocks)
        nbytes = sum(self.units[i].numel * self.units[i].dtype.itemsize for i in self.live)
        self.max_live_bytes = max(self.max_live_bytes, nbytes)

    # -- a block: gathered around its forward, recomputed and reduce-scattered in backward ------
    def _run_block(self, block, x):
        """A block under FSDP (the model's block runner): gather, prefetch the next block, run, free."""
        i = self.unit_index[id(block)]
        mine = self._block(i)
        for k in mine:
            self._gathered(k)
        self._prefetch(i + 1)
        low = get_autocast_dtype()
        with no_grad():
            y = block(x)
        for k in mine:
            self._free(k)
        if not (is_grad_enabled() and x.requires_grad):
            return y

        def backward_fn(g):
            for k in mine:
                self._gathered(k)
            self._prefetch(i - 1)  # the block before, in backward order
            inp = Tensor(x.data, requires_grad=True)
            with enable_grad(), autocast(low):
                out = block(inp)
            grads = run_backward([out], [g], capture=[inp] + [p for k in mine for p in self.units[k].params])
            for k in mine:
                self._free(k)
                unit = self.units[k]
                flat = to_host(unit.flatten([grads.get(id(p)) for p in unit.params]))
                self._pending_rs.append((k, comm.reduce_scatter(flat, self.groups[k], async_op=True)))
            return (grads.get(id(inp)),)

        out = Tensor(y.data)
        out.requires_grad = True
        out._ctx = ((x,), backward_fn)
        return out

    # -- the loop's protocol (replica.py) --------------------------------------------------------
    @contextlib.contextmanager
    def evaluating(self):
        """The root unit's parameters gathered for a forward pass without backward."""
        self._gather_root()
        try:
            yield
        finally:
            self._free(0)

    @contextlib.contextmanager
    def micro_step(self, last: bool, pipelined: bool = False):
        """One micro-batch's forward and backward (or a pipeline pass); every micro-step
        reduce-scatters into the gradient shards.  ``before_reduce`` runs on the root unit's
        full gradients first (a pipeline's tied-embedding sum).  HSDP: on the last, the shards'
        gradients are summed over the replicas."""
        self._gather_root()
        self._prefetch(1)
        yield
        if self.before_reduce is not None:
            self.before_reduce()
        self._finish_backward()
        if last and self.replicate_group is not None:  # the experts' units are not replicated
            for shard, g in zip(self.shards, self.groups):
                if g is self.shard_group:
                    shard.grad = from_host(comm.all_reduce(to_host(shard.grad), self.replicate_group))

    def _gather_root(self):
        """The root unit (embedding, final LayerNorm, head) gathered for a whole pass; a
        pipeline's middle stage has none of them."""
        if self.root.params:
            self._gathered(0)

    def _finish_backward(self):
        """Reduce-scatter the root unit's gradients, then land every reduce-scatter in flight."""
        root = self.root
        if root.params:
            flat = to_host(root.flatten([p.grad for p in root.params]))
            for p in root.params:
                p.grad = None
            self._pending_rs.append((0, comm.reduce_scatter(flat, self.shard_group, async_op=True)))
        for i, handle in self._pending_rs:
            accumulate(self.shards[i], handle.wait())
        self._pending_rs = []
        self._free(0)
        for i in list(self._inflight):  # a prefetch nobody used (a 1-block model): drain it
            self._inflight.pop(i).wait()
            self._free(i)

    @property
    def grad_holders(self):
        return self.shards

    def grad_segments(self):
        return shard_segments(self.units, self.shards)

    def norm_segments(self):
        """HSDP's first replica counts the dense shards; every rank its experts' shards (disjoint)."""
        counted = [k for k, g in enumerate(self.groups) if self.counts_in_norm or g is not self.shard_group]
        return shard_segments([self.units[k] for k in counted], [self.shards[k] for k in counted])

    def step(self):
        """Update this rank's shards; the parameters stay sharded until the next gather."""
        self.shard_optimizer.step()

    def memory_bytes(self) -> dict:
        """Bytes of parameters, gradients and optimizer state this rank holds now, from the arrays."""
        params = sum(s.data.nbytes for s in self.shards) + sum(
            p.data.nbytes for p in self.params if p.data is not _FREED)
        full_grads = sum(p.grad.nbytes for p in self.params if p.grad is not None)
        shard_grads = sum(s.grad.nbytes for s in self.shards if s.grad is not None)
        return {"params": params, "grads": full_grads + shard_grads, "optimizer": self.shard_optimizer.nbytes()}

    def parameters(self) -> dict:
        """Every parameter's full array by name, all-gathered from the shards (every rank calls it)."""
        out = {}
        for unit, shard, g in zip(self.units, self.shards, self.groups):
            if not unit.params:
                continue
            full = from_host(comm.all_gather(to_host(shard.data), g))
            out.update({p.name: v.copy() for p, v in zip(unit.params, unit.views(full))})
        return out


    def owned_state(self):
        # An HSDP replica other than the first saves only its experts' shards (not replicated).
        mine = [k for k, g in enumerate(self.groups) if self.counts_in_norm or g is not self.shard_group]
        units = [self.units[k] for k in mine]
        for unit, k in zip(units, mine):
            for p, s, flat in unit.segments():
                yield p, "param", flat, self.shards[k].data[s]
        yield from owned_shards(units, [self.shard_optimizer.state[k] for k in mine])

    def load_state(self, reader):
        for unit, piece in zip(self.units, self.shards):
            for p, s, flat in unit.segments():
                piece.data[s] = from_host(reader.read(p, "param", flat))
        load_shards(reader, self.units, self.shard_optimizer)


def hsdp_groups(dp_group, shard_size: int):
    """Split the data-parallel group into shard groups of ``shard_size`` consecutive ranks and
    replica groups of the ranks at the same position in each: (shard group, replicate group)."""
    from minidist.comm.group import Group

    n, r = dp_group.size, dp_group.rank
    if shard_size < 1 or n % shard_size:
        raise ValueError(f"HSDP shard size {shard_size} does not divide the data-parallel size {n}")
    # Split is collective over dp_group: every rank makes both calls, in the same order.
    shard = dp_group.comm.Split(r // shard_size, r % shard_size)
    replicate = dp_group.comm.Split(r % shard_size, r // shard_size)
    return Group(shard, name=f"{dp_group.name}.shard{shard_size}"), Group(replicate, name=f"{dp_group.name}.replicate{n // shard_size}")
