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

Here: :class:`ShardedOptimizer` (the update rule on the shards), :class:`ShardedDataParallel`
(what every stage shares), :class:`ZeRO` (stages 1-2) and :func:`memory_formula` (the table);
parallel/strategy.py's ``Zero12`` and ``FullyShardedDataParallel`` put them in a run.
"""

from __future__ import annotations

import contextlib

from .. import comm
from ..backend import from_host, to_host, xp
from ..optim.functional import adamw_update, sgd_update
from ..optim.optimizers import SGD, AdamW
from .data import BucketedReducer, broadcast_parameters, check_identical
from .flat import FlatUnit, Shard


class ShardedOptimizer:
    """``template``'s update rule (AdamW or SGD, its lr and settings read at each step) applied
    to every unit's shard, stretch by stretch (:meth:`FlatUnit.segments`): elementwise rules
    give bit-identical numbers to the unsharded update."""

    def __init__(self, template, units, shards, decay):
        if not isinstance(template, (AdamW, SGD)):
            raise TypeError(f"ZeRO shards AdamW or SGD state, got {type(template).__name__}")
        self.template, self.units, self.shards = template, units, shards
        self.decay = decay  # id(param) -> its weight decay, read while the parameters were whole
        if isinstance(template, AdamW):
            keys = ("exp_avg", "exp_avg_sq")
        else:
            keys = ("momentum_buffer",) if template.momentum else ()
        self.state = [{k: xp.zeros_like(s.data) for k in keys} for s in shards]
        self.step_count = 0

    def step(self):
        t, self.step_count = self.template, self.step_count + 1
        for unit, shard, st in zip(self.units, self.shards, self.state):
            for p, s, _ in unit.segments():
                wd = self.decay[id(p)]
                if isinstance(t, AdamW):
                    adamw_update(shard.data[s], shard.grad[s], st["exp_avg"][s], st["exp_avg_sq"][s],
                                 self.step_count, t.lr, t.betas[0], t.betas[1], t.eps, wd)
                else:
                    buf = st["momentum_buffer"][s] if st else None
                    sgd_update(shard.data[s], shard.grad[s], buf, t.lr, t.momentum, wd, t.nesterov)

    def nbytes(self) -> int:
        return sum(a.nbytes for st in self.state for a in st.values())


class ShardedDataParallel:
    """What every ZeRO stage shares: the trainable parameters made identical over ``group``
    (and ``replicate_group``, HSDP) before anything is sharded, the optimizer of the shards,
    ``zero_grad`` and the shard sizes.  A subclass sets ``units`` and ``shards``, then calls
    :meth:`_shard_optimizer`."""

    reducer = None  # the gradient hooks' BucketedReducer (stages 1-2; stage 3 has none)

    def __init__(self, model, group, optimizer, replicate_group=None):
        self.model, self.group, self.replicate_group = model, group, replicate_group
        self.params = [p for p in model.parameters() if p.requires_grad]
        # Each parameter's weight decay, read while the parameters are whole (stage 3 frees them).
        self._decay = {id(p): optimizer.decay_of(p) for p in self.params}
        for g in (group, replicate_group):
            if g is not None:
                broadcast_parameters(self.params, g)
                check_identical(self.params, g)

    def _shard_optimizer(self, template):
        self.optimizer = ShardedOptimizer(template, self.units, self.shards, self._decay)

    @staticmethod
    def _accumulate(shard, result):
        """Add a reduce-scatter's result into ``shard.grad`` (micro-steps accumulate there)."""
        result = from_host(result)  # a fresh array from the reduce-scatter: ours to keep
        if shard.grad is None:
            shard.grad = result
        else:
            shard.grad += result

    def zero_grad(self):
        for shard in self.shards:
            shard.grad = None
        for p in self.params:
            p.grad = None

    @property
    def shard_numel(self) -> int:
        return sum(u.shard_numel for u in self.units)


class ZeRO(ShardedDataParallel):
    """ZeRO stage 1 or 2 of ``model`` over ``group``, updating with ``optimizer``'s rule
    (stage 3 is fsdp.FSDP).

    The units are the gradient buckets (a bucket and its unit lay out the same parameters in
    the same order), and the full parameters are views of one flat array per unit, which
    the all-gather after the update fills.  ``zero.reducer`` launches each bucket's collective
    from the gradient hooks (parallel/strategy.py's Zero12 opens and closes them around each
    micro-step, as for DDP), then ``zero.step()`` (update the shards, all-gather the
    parameters), ``zero.zero_grad()``.  ``zero.grad_holders`` are the objects with ``.grad``
    to unscale and clip: the full gradients (stage 1) or the gradient shards (stage 2).
    """

    def __init__(self, model, group, stage: int, optimizer, bucket_mb: float = 25.0, overlap: bool = True):
        if stage not in (1, 2):
            raise ValueError(f"ZeRO here is stage 1 or 2, got {stage!r} (stage 3: fsdp.FSDP)")
        super().__init__(model, group, optimizer)
        self.stage = stage
        # Stage 1 all-reduces each bucket, as DDP does; stage 2 reduce-scatters it and frees
        # the full gradients, so a rank keeps only its gradient shard.
        launch, land = ((self._all_reduce, self._land_all_reduced) if stage == 1
                        else (self._reduce_scatter, self._land_reduce_scattered))
        self.reducer = BucketedReducer(self.params, bucket_mb, overlap, launch, land)
        buckets = self.reducer.buckets
        self.units = [FlatUnit(b.params, group.rank, group.size, f"bucket{i}") for i, b in enumerate(buckets)]
        self.unit_of_bucket = {id(b): i for i, b in enumerate(buckets)}
        self.full = [self._flatten_params(u) for u in self.units]  # the parameters' storage
        self.shards = [Shard(full[u.lo:u.hi]) for u, full in zip(self.units, self.full)]
        self._shard_optimizer(optimizer)
        # Stage 1's gradients are whole (and the same on every rank); stage 2's are shards.
        self.grad_holders = self.params if stage == 1 else self.shards

    def _flatten_params(self, unit):
        full = unit.flatten([p.data for p in unit.params])
        for p, view in zip(unit.params, unit.views(full)):
            p.data = view  # the all-gather writes the updated parameters straight here
        return full

    # -- from the gradient hooks ---------------------------------------------------------------
    def _all_reduce(self, bucket):
        return comm.all_reduce(bucket.pack_grads(), self.group, async_op=True)

    def _reduce_scatter(self, bucket):
        return comm.reduce_scatter(bucket.pack_grads(free=True), self.group, async_op=True)

    def _land_all_reduced(self, bucket, result):
        # A bucket and its unit lay out the same parameters in the same order, so the
        # shard's gradient is a slice of the all-reduced bucket: no copy.
        i = self.unit_of_bucket[id(bucket)]
        flat = from_host(result)
        bucket.unpack_grads(flat)
        self.shards[i].grad = flat[self.units[i].lo:self.units[i].hi]

    def _land_reduce_scattered(self, bucket, result):
        self._accumulate(self.shards[self.unit_of_bucket[id(bucket)]], result)

    def _all_gather_params(self):
        for full, shard in zip(self.full, self.shards):
            mine = to_host(shard.data).copy()  # the all-gather writes into full, which holds shard.data
            gathered = comm.all_gather(mine, self.group)
            full[...] = from_host(gathered)

    # -- the loop's interface (parallel/strategy.py's Zero12 drives the hooks: micro_step) --------
    @contextlib.contextmanager
    def evaluating(self):
        """Nothing to gather: stages 1-2 keep the full parameters."""
        yield

    def step(self):
        """Update this rank's shards, then all-gather them into the full parameters."""
        self.optimizer.step()
        self._all_gather_params()

    def memory_bytes(self) -> dict:
        """Bytes of parameters, gradients and optimizer state this rank holds now, from the arrays."""
        full_grads = sum(p.grad.nbytes for p in self.params if p.grad is not None)
        # Stage 1's shard gradients are slices of the all-reduced buckets, counted above.
        shard_grads = sum(s.grad.nbytes for s in self.shards if s.grad is not None) if self.stage == 2 else 0
        return {"params": sum(f.nbytes for f in self.full), "grads": full_grads + shard_grads,
                "optimizer": self.optimizer.nbytes()}


def memory_formula(stage: int, numel: int, shard_numel: int, itemsize: int, state_arrays: int) -> dict:
    """Per-rank bytes of parameters, gradients and optimizer state at ``stage`` (the table above),
    for Ψ = ``numel`` parameters of which this rank's shards hold Ψ_r = ``shard_numel``."""
    b, full, mine = itemsize, numel, shard_numel
    params = b * (mine if stage == 3 else full)
    grads = b * (mine if stage >= 2 else full)
    state = b * state_arrays * (mine if stage >= 1 else full)
    return {"params": params, "grads": grads, "optimizer": state}
