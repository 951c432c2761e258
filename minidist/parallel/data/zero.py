"""ZeRO: shard the optimizer state, then the gradients, then the parameters over data parallelism.

Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models".  DDP keeps on every rank a full copy of what training needs per parameter: in
minidist's layout (weights, gradients and AdamW's m and v all in the parameter dtype, b
bytes each) that is 4bΨ bytes for Ψ parameters.  Each stage keeps only rank r's piece
(Ψ_r ≈ Ψ/N elements, see flat.py) of one more of them:

========  ==========================  ===================================  ============
stage     what is sharded              per-rank bytes (b = 4: float32)      paper (2+2+12)
========  ==========================  ===================================  ============
0 (DDP)   nothing                      4bΨ            = 16Ψ                 16Ψ
1         optimizer state              2bΨ + 2bΨ_r    = 8Ψ + 8Ψ/N           4Ψ + 12Ψ/N
2         + gradients                  bΨ + 3bΨ_r     = 4Ψ + 12Ψ/N          2Ψ + 14Ψ/N
3 (FSDP)  + parameters                 4bΨ_r          = 16Ψ/N               16Ψ/N
========  ==========================  ===================================  ============

(The paper's column is its mixed-precision layout: fp16 weights and gradients, fp32 master
weights and Adam state.  SGD with momentum keeps one state array instead of two.)

How each stage moves the data (units are flat groups of parameters, see flat.py):

* stage 1: gradients all-reduced as in DDP (bucketed, from the hooks, overlapped); each rank
  updates its shard of each unit with its shard of the optimizer state; the updated shards
  are all-gathered back into the full parameters.
* stage 2: each bucket's gradients are *reduce-scattered* (from the hooks, overlapped) and
  the full gradients freed: a rank keeps only its gradient shard.  Same update and gather.
* stage 3 (FSDP) and HSDP: parameters live only as shards, gathered around each block's
  forward and backward: fsdp.py.

With gradient accumulation, stages 0-1 accumulate full gradients locally and reduce on the
last micro-step (``no_sync``); stages 2-3 reduce-scatter every micro-step into the gradient
shard, which is what keeps their gradient memory at Ψ_r.

Here: :class:`ShardedOptimizer` (the update rule on the shards), :class:`ZeRO` (stages 1-2:
DDP's buckets and hooks with other collectives), what the sharded stages share with fsdp.py
(the shards' gradients, checkpoint pieces); the table's formula is layout/memory.py's
``memory_formula``.
"""

from __future__ import annotations

from minidist import comm
from minidist.model.backend import from_host, to_host, xp
from minidist.model.optim.optimizers import SGD, AdamW
from minidist.parallel.data.ddp import DistributedDataParallel
from minidist.parallel.data.flat import FlatUnit, Shard


class ShardedOptimizer:
    """``template``'s update rule (AdamW or SGD, its lr and settings read at each step) applied
    to every unit's shard, stretch by stretch (:meth:`FlatUnit.segments`): elementwise rules
    give bit-identical numbers to the unsharded update."""

    def __init__(self, template, units, shards, decay):
        if not isinstance(template, (AdamW, SGD)):
            raise TypeError(f"ZeRO shards AdamW or SGD state, got {type(template).__name__}")
        self.template, self.units, self.shards = template, units, shards
        self.decay = decay  # id(param) -> its weight decay, read while the parameters were whole
        self.state = [{k: xp.zeros_like(s.data) for k in template.state_keys} for s in shards]
        self.step_count = 0

    def step(self):
        self.step_count += 1
        for unit, shard, st in zip(self.units, self.shards, self.state):
            for p, s, _ in unit.segments():
                self.template.update(shard.data[s], shard.grad[s], {k: a[s] for k, a in st.items()},
                                     self.step_count, self.decay[id(p)])

    def nbytes(self) -> int:
        return sum(a.nbytes for st in self.state for a in st.values())


class Sharded:
    """What ZeRO's stages share (here and fsdp.py): ``units`` and this rank's ``shards`` of them,
    updated by ``shard_optimizer``."""

    def zero_grad(self):
        for shard in self.shards:
            shard.grad = None
        for p in self.params:
            p.grad = None

    @property
    def shard_numel(self) -> int:
        return sum(u.shard_numel for u in self.units)

    def checkpoint_scalars(self) -> dict:
        return {"optimizer_steps": self.shard_optimizer.step_count}


class ZeRO(Sharded, DistributedDataParallel):
    """ZeRO stage 1 or 2 of ``model`` over ``group``, updating with ``optimizer``'s rule
    (stage 3 is fsdp.FSDP).

    DDP's buckets and gradient hooks, with other collectives: stage 1 all-reduces each bucket
    as DDP does, stage 2 reduce-scatters it and frees the full gradients, so a rank keeps only
    its gradient shard.  The units are the buckets (a bucket and its unit lay out the same
    parameters in the same order), and the full parameters are views of one flat array per
    unit, which the all-gather after the update fills.  ``optimizer`` stays the loop's (its
    learning rate is read at each step); ``shard_optimizer`` updates the shards.
    """

    def __init__(self, model, optimizer, group, stage: int, bucket_mb: float = 25.0, overlap: bool = True,
                 params=None):
        if stage not in (1, 2):
            raise ValueError(f"ZeRO here is stage 1 or 2, got {stage!r} (stage 3: fsdp.FSDP)")
        self.stage = stage
        super().__init__(model, optimizer, group, bucket_mb, overlap, params=params)
        self.reduces_every_micro_step = stage == 2  # a rank keeps only its gradient shard
        # Stage 1 clips the full, all-reduced gradients (the same on every rank: count them
        # once); stage 2 clips the disjoint gradient shards (count every rank's).
        self.counts_in_norm = stage == 2 or group.rank == 0
        self.name = f"ZeRO-{stage} over {group.size} ranks"
        self.units = [FlatUnit(b.params, group.rank, group.size, f"bucket{i}") for i, b in enumerate(self.buckets)]
        self.unit_of_bucket = {id(b): i for i, b in enumerate(self.buckets)}
        self.full = [self._flatten_params(u) for u in self.units]  # the parameters' storage
        self.shards = [Shard(full[u.lo:u.hi]) for u, full in zip(self.units, self.full)]
        self.shard_optimizer = ShardedOptimizer(optimizer, self.units, self.shards, decay_of(optimizer, self.params))

    def _flatten_params(self, unit):
        full = unit.flatten([p.data for p in unit.params])
        for p, view in zip(unit.params, unit.views(full)):
            p.data = view  # the all-gather writes the updated parameters straight here
        return full

    # -- from the gradient hooks ---------------------------------------------------------------
    def _launch(self, bucket):
        if self.stage == 1:
            return comm.all_reduce(bucket.pack_grads(), self.group, async_op=True)
        return comm.reduce_scatter(bucket.pack_grads(free=True), self.group, async_op=True)

    def _land(self, bucket, result):
        i = self.unit_of_bucket[id(bucket)]
        if self.stage == 2:
            accumulate(self.shards[i], result)
            return
        # A bucket and its unit lay out the same parameters in the same order, so the
        # shard's gradient is a slice of the all-reduced bucket: no copy.
        flat = from_host(result)
        bucket.unpack_grads(flat)
        self.shards[i].grad = flat[self.units[i].lo:self.units[i].hi]

    def _all_gather_params(self):
        for full, shard in zip(self.full, self.shards):
            mine = to_host(shard.data).copy()  # the all-gather writes into full, which holds shard.data
            gathered = comm.all_gather(mine, self.group)
            full[...] = from_host(gathered)

    # -- the loop's protocol (replica.py) --------------------------------------------------------
    @property
    def grad_holders(self):
        """Stage 1's gradients are whole (and the same on every rank); stage 2's are shards."""
        return self.params if self.stage == 1 else self.shards

    def grad_segments(self):
        if self.stage == 1:
            return super().grad_segments()
        return shard_segments(self.units, self.shards)

    def step(self):
        """Update this rank's shards, then all-gather them into the full parameters."""
        self.shard_optimizer.step()
        self._all_gather_params()

    def memory_bytes(self) -> dict:
        """Bytes of parameters, gradients and optimizer state this rank holds now, from the arrays."""
        full_grads = sum(p.grad.nbytes for p in self.params if p.grad is not None)
        # Stage 1's shard gradients are slices of the all-reduced buckets, counted above.
        shard_grads = sum(s.grad.nbytes for s in self.shards if s.grad is not None) if self.stage == 2 else 0
        return {"params": sum(f.nbytes for f in self.full), "grads": full_grads + shard_grads,
                "optimizer": self.shard_optimizer.nbytes()}

    def owned_state(self):
        if self.writes_replicas:  # the full parameters are the same on every rank after the step
            for p in self.params:
                yield p, "param", None, p.data
        yield from owned_shards(self.units, self.shard_optimizer.state)

    def load_state(self, reader):
        for p in self.params:
            p.data[...] = from_host(reader.read(p, "param"))  # views into the flat storage the shards slice
        load_shards(reader, self.units, self.shard_optimizer)


# --------------------------------------------------------------------------------------------
# The sharded stages' helpers (here and fsdp.py)
# --------------------------------------------------------------------------------------------
def decay_of(optimizer, params) -> dict:
    """Each parameter's weight decay by id, read while the parameters are whole (stage 3 frees them)."""
    return {id(p): optimizer.decay_of(p) for p in params}


def accumulate(shard, result):
    """Add a reduce-scatter's result into ``shard.grad`` (micro-steps accumulate there)."""
    result = from_host(result)  # a fresh array from the reduce-scatter: ours to keep
    if shard.grad is None:
        shard.grad = result
    else:
        shard.grad += result


def shard_segments(units, shards):
    """``(parameter, its stretch of the shard's gradient)`` for every shard (ZeRO-2/3)."""
    for unit, piece in zip(units, shards):
        if piece.grad is not None:
            for p, s, _ in unit.segments():
                yield p, piece.grad[s]


def owned_shards(units, state):
    """The optimizer state's pieces in a ZeRO rank's flat shards, per parameter stretch."""
    for unit, st in zip(units, state):
        for p, s, flat in unit.segments():
            for key, array in st.items():
                yield p, key, flat, array[s]


def load_shards(reader, units, optimizer):
    for unit, st in zip(units, optimizer.state):
        for p, s, flat in unit.segments():
            for key, array in st.items():
                array[s] = from_host(reader.read(p, key, flat))
    optimizer.step_count = reader.meta["scalars"]["optimizer_steps"]
