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
* stage 3 (FSDP, Zhao et al. 2023): parameters live only as shards.  A transformer block's
  parameters are all-gathered just before its forward and freed after it, gathered again
  before its backward, and its gradients reduce-scattered right after; the next block's
  gather is **prefetched** (async) while the current one computes.  The embedding, final
  LayerNorm and head form the root unit, gathered for the whole forward and backward.
  Because minidist's ops keep their input arrays in the graph, a block whose weights are
  freed cannot keep its graph: stage 3 runs each block's forward without recording it and
  recomputes it in backward (per-block activation checkpointing, Chen et al. 2016), so
  ``--checkpoint-activations`` changes nothing under stage 3.
* HSDP (hybrid sharding): stage 3 inside shard groups of K ranks, the gradient shards then
  all-reduced over the replica group of the N/K ranks holding the same shard.

With gradient accumulation, stages 0-1 accumulate full gradients locally and reduce on the
last micro-step (``no_sync``); stages 2-3 reduce-scatter every micro-step into the gradient
shard, which is what keeps their gradient memory at Ψ_r.
"""

from __future__ import annotations

import contextlib

from .. import comm
from ..autograd import Tensor, enable_grad, is_grad_enabled, no_grad, run_backward
from ..backend import from_host, to_host, xp
from ..ops import autocast, get_autocast_dtype
from ..optim.functional import adamw_update, sgd_update
from ..optim.optimizers import SGD, AdamW
from .data import BucketedReducer, broadcast_parameters, check_identical
from .flat import FlatUnit, Shard

_FREED = None  # what a stage-3 parameter's .data is between uses


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


class ZeRO:
    """ZeRO stage 1, 2 or 3 of ``model`` over ``group`` (the shard group), updating with
    ``optimizer``'s rule.  ``replicate_group`` (stage 3 only) makes it HSDP.

    The training loop's calls: ``with zero.micro_step(last): loss.backward()`` for each
    micro-batch, then ``zero.step()`` (update the shards, re-gather the parameters for stages
    1-2), ``zero.zero_grad()``.  ``zero.grad_holders`` are the objects with ``.grad`` to
    unscale and clip (the full parameters for stage 1, the shards for stages 2-3), and
    ``zero.norm_group`` the group to sum their squared norms over.
    """

    def __init__(self, model, group, stage: int, optimizer, bucket_mb: float = 25.0, overlap: bool = True,
                 replicate_group=None):
        if stage not in (1, 2, 3):
            raise ValueError(f"ZeRO stage must be 1, 2 or 3, got {stage!r}")
        if replicate_group is not None and stage != 3:
            raise ValueError(f"HSDP shards with ZeRO stage 3, got stage {stage}")
        self.model, self.group, self.stage = model, group, stage
        self.replicate_group = replicate_group
        params = [p for p in model.parameters() if p.requires_grad]
        decay = {id(p): optimizer.decay_of(p) for p in params}
        for g in (group, replicate_group):
            if g is not None:
                broadcast_parameters(params, g)
                check_identical(params, g)
        self.params = params
        self.reducer = None
        if stage < 3:
            op = self._all_reduce if stage == 1 else self._reduce_scatter
            self.reducer = BucketedReducer(params, bucket_mb, overlap, op, self._land)
            self.units = [FlatUnit(b.params, group.rank, group.size, f"bucket{i}")
                          for i, b in enumerate(self.reducer.buckets)]
            self.unit_of_bucket = {id(b): i for i, b in enumerate(self.reducer.buckets)}
            self.full = [self._flatten_params(u) for u in self.units]  # the parameters' storage
            self.shards = [Shard(full[u.lo:u.hi]) for u, full in zip(self.units, self.full)]
        else:
            self._setup_stage3(model, params)
        self.optimizer = ShardedOptimizer(optimizer, self.units, self.shards, decay)
        self.grad_holders = params if stage == 1 else self.shards
        self.norm_group = None if stage == 1 else group

    # -- stages 1 and 2 -----------------------------------------------------------------------
    def _flatten_params(self, unit):
        full = unit.flatten([p.data for p in unit.params])
        for p, view in zip(unit.params, unit.views(full)):
            p.data = view  # the all-gather writes the updated parameters straight here
        return full

    def _all_reduce(self, bucket):
        return comm.all_reduce(bucket.pack_grads(), self.group, async_op=True)

    def _reduce_scatter(self, bucket):
        return comm.reduce_scatter(bucket.pack_grads(free=True), self.group, async_op=True)

    def _land(self, bucket, result):
        i = self.unit_of_bucket[id(bucket)]
        if self.stage == 1:
            # A bucket and its unit lay out the same parameters in the same order, so the
            # shard's gradient is a slice of the all-reduced bucket: no copy.
            flat = from_host(result)
            bucket.unpack_grads(flat)
            self.shards[i].grad = flat[self.units[i].lo:self.units[i].hi]
        else:
            self._accumulate(self.shards[i], result)

    @staticmethod
    def _accumulate(shard, result):
        result = from_host(result)  # a fresh array from the reduce-scatter: ours to keep
        if shard.grad is None:
            shard.grad = result
        else:
            shard.grad += result

    def _gather_params(self):
        for unit, full, shard in zip(self.units, self.full, self.shards):
            mine = to_host(shard.data).copy()  # the all-gather writes into full, which holds shard.data
            gathered = comm.all_gather(mine, self.group)
            full[...] = from_host(gathered)

    # -- stage 3 --------------------------------------------------------------------------------
    def _setup_stage3(self, model, params):
        blocks = list(model.h)
        in_blocks = {id(p) for b in blocks for p in b.parameters()}
        root = [p for p in params if id(p) not in in_blocks]
        g = self.group
        self.root = FlatUnit(root, g.rank, g.size, "root")
        self.block_units = [FlatUnit([p for p in b.parameters() if p.requires_grad], g.rank, g.size, f"h.{i}")
                            for i, b in enumerate(blocks)]
        self.units = [self.root] + self.block_units
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
        model.block_runner = self._run_block

    def _launch_gather(self, i):
        if i in self.live:
            return
        self.live.add(i)
        self._count_live()
        self._inflight[i] = comm.all_gather(to_host(self.shards[i].data), self.group, async_op=True)

    def _prefetch(self, i):
        """Start gathering block unit i (1..L) while the current block computes."""
        if 1 <= i < len(self.units):
            self._launch_gather(i)

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

    def _run_block(self, block, x):
        """GPT.block_runner under stage 3: gather, prefetch the next block, run, free."""
        i = self.unit_index[id(block)]
        self._gathered(i)
        self._prefetch(i + 1)
        low = get_autocast_dtype()
        with no_grad():
            y = block(x)
        self._free(i)
        if not (is_grad_enabled() and x.requires_grad):
            return y

        def backward_fn(g):
            self._gathered(i)
            self._prefetch(i - 1)  # the block before, in backward order
            inp = Tensor(x.data, requires_grad=True)
            with enable_grad(), autocast(low):
                out = block(inp)
            unit = self.units[i]
            grads = run_backward([out], [g], capture=[inp] + unit.params)
            self._free(i)
            flat = to_host(unit.flatten([grads.get(id(p)) for p in unit.params]))
            self._pending_rs.append((i, comm.reduce_scatter(flat, self.group, async_op=True)))
            return (grads.get(id(inp)),)

        out = Tensor(y.data)
        out.requires_grad = True
        out._ctx = ((x,), backward_fn)
        return out

    @contextlib.contextmanager
    def evaluating(self):
        """Stage 3: the root unit's parameters gathered for a forward pass without backward."""
        if self.stage == 3:
            self._gathered(0)
        try:
            yield
        finally:
            if self.stage == 3:
                self._free(0)

    # -- the loop's interface --------------------------------------------------------------------
    @contextlib.contextmanager
    def micro_step(self, last: bool):
        """One micro-batch's forward and backward.  Stage 1 reduces only on the last micro-step;
        stages 2-3 reduce-scatter every micro-step into the gradient shards."""
        if self.stage == 3:
            self._gathered(0)
            self._prefetch(1)
        elif self.stage == 1:
            self.reducer.active = last
        if self.reducer is not None and self.reducer.active:
            self.reducer.reset_timeline()
        yield
        if self.stage == 3:
            self._finish_stage3()
        elif self.reducer.active:
            self.reducer.finish()
        if last and self.replicate_group is not None:
            for shard in self.shards:  # HSDP: the shard's gradient summed over the replicas
                shard.grad = from_host(comm.all_reduce(to_host(shard.grad), self.replicate_group))

    def _finish_stage3(self):
        root = self.root
        flat = to_host(root.flatten([p.grad for p in root.params]))
        for p in root.params:
            p.grad = None
        self._pending_rs.append((0, comm.reduce_scatter(flat, self.group, async_op=True)))
        for i, handle in self._pending_rs:
            self._accumulate(self.shards[i], handle.wait())
        self._pending_rs = []
        self._free(0)
        for i in list(self._inflight):  # a prefetch nobody used (a 1-block model): drain it
            self._inflight.pop(i).wait()
            self._free(i)

    def step(self):
        """Update this rank's shards; stages 1-2 then all-gather the parameters."""
        self.optimizer.step()
        if self.stage < 3:
            self._gather_params()

    def zero_grad(self):
        for shard in self.shards:
            shard.grad = None
        for p in self.params:
            p.grad = None

    def memory_bytes(self) -> dict:
        """Bytes of parameters, gradients and optimizer state this rank holds now, from the arrays."""
        if self.stage < 3:
            params = sum(f.nbytes for f in self.full)
        else:
            params = sum(s.data.nbytes for s in self.shards) + sum(
                p.data.nbytes for p in self.params if p.data is not _FREED)
        full_grads = sum(p.grad.nbytes for p in self.params if p.grad is not None)
        shard_grads = sum(s.grad.nbytes for s in self.shards if s.grad is not None) if self.stage > 1 else 0
        return {"params": params, "grads": full_grads + shard_grads, "optimizer": self.optimizer.nbytes()}

    def full_parameters(self) -> dict:
        """Every parameter's full array by name (stage 3 all-gathers the shards: every rank calls it)."""
        if self.stage < 3:
            return {p.name: p.data for p in self.params}
        out = {}
        for unit, shard in zip(self.units, self.shards):
            full = from_host(comm.all_gather(to_host(shard.data), self.group))
            out.update({p.name: v.copy() for p, v in zip(unit.params, unit.views(full))})
        return out

    @property
    def shard_numel(self) -> int:
        return sum(u.shard_numel for u in self.units)


def memory_formula(stage: int, numel: int, shard_numel: int, itemsize: int, state_arrays: int) -> dict:
    """Per-rank bytes of parameters, gradients and optimizer state at ``stage`` (the table above),
    for Ψ = ``numel`` parameters of which this rank's shards hold Ψ_r = ``shard_numel``."""
    b, full, mine = itemsize, numel, shard_numel
    params = b * (mine if stage == 3 else full)
    grads = b * (mine if stage >= 2 else full)
    state = b * state_arrays * (mine if stage >= 1 else full)
    return {"params": params, "grads": grads, "optimizer": state}


def hsdp_groups(dp_group, shard_size: int):
    """Split the data-parallel group into shard groups of ``shard_size`` consecutive ranks and
    replica groups of the ranks at the same position in each: (shard group, replicate group)."""
    from ..comm.group import Group

    n, r = dp_group.size, dp_group.rank
    if shard_size < 1 or n % shard_size:
        raise ValueError(f"HSDP shard size {shard_size} does not divide the data-parallel size {n}")
    # Split is collective over dp_group: every rank makes both calls, in the same order.
    shard = dp_group.comm.Split(r // shard_size, r % shard_size)
    replicate = dp_group.comm.Split(r % shard_size, r // shard_size)
    return Group(shard, name=f"dp.shard{shard_size}"), Group(replicate, name=f"dp.replicate{n // shard_size}")
