"""The data-parallel part of a run: who reduces the gradients over the ("dp", "cp") group, and how.

The ranks of a ("dp", "cp") group hold the same parameters (the same tensor-parallel slices of
the same pipeline stage) and see different tokens, so their gradients are summed.  Each way of
doing it is a *part* the loop's :class:`~minidist.parallel.strategy.Strategy` holds:

* :class:`OneReplica` - nothing to reduce (the interface, and one data-parallel rank);
* :class:`DataParallel` - DDP: bucketed all-reduces launched from the gradient hooks;
* :class:`Zero12` - ZeRO-1/2: the optimizer state (and the gradients) sharded (parallel/zero.py);
* :class:`FullyShardedDataParallel` - ZeRO-3 = FSDP, or HSDP (parallel/fsdp.py).

All follow one protocol (``micro_step``, ``hook_window``, ``hold``, ``before_reduce``,
``grad_segments``, ``owned_state`` / ``load_state`` for checkpoints), so the Strategy and the
pipeline never ask which one they have.  :func:`data_parallel` picks one from the flags.
"""

from __future__ import annotations

import contextlib

from ..backend import from_host
from .data import DistributedDataParallel


class OneReplica:
    """One data-parallel replica: the gradients are already the batch's; nothing to reduce.

    The interface every data-parallel part has (the Strategy calls only these):
    ``micro_step(last, pipelined)`` around a micro-batch's forward and backward,
    ``hook_window()`` (the pipeline opens gradient hooks inside it), ``hold(param)`` (reduce
    that gradient only at the end: the tied embedding), ``before_reduce`` (run on the full
    gradients just before they are reduced), ``grad_holders`` / ``grad_segments()`` (what to
    unscale, clip and count in the norm), ``step``, ``zero_grad``, ``evaluating``,
    ``memory_bytes``, ``comm_wait_s``.
    """

    reduces_every_micro_step = False  # ZeRO-2/3 reduce-scatter each micro-step (their gradient memory)

    def __init__(self, model, optimizer, group=None):
        self.model, self.optimizer, self.group = model, optimizer, group
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.before_reduce = None
        self.counts_in_norm = True  # this rank counts its gradients in the global norm
        self.name = "one data-parallel replica"

    def hold(self, param):
        pass

    def hook_window(self):
        return None

    @contextlib.contextmanager
    def micro_step(self, last: bool, pipelined: bool = False):
        yield
        if last and self.before_reduce is not None:
            self.before_reduce()

    @contextlib.contextmanager
    def evaluating(self):
        yield

    @property
    def grad_holders(self):
        """The objects whose ``.grad`` this rank unscales and clips."""
        return self.params

    def grad_segments(self):
        """``(parameter, gradient array)`` of every gradient this rank holds (for the norm)."""
        return ((p, p.grad) for p in self.grad_holders if p.grad is not None)

    def step(self):
        self.optimizer.step()

    def zero_grad(self):
        self.optimizer.zero_grad()

    def parameters(self) -> dict:
        return {p.name: p.data for p in self.params}

    @property
    def writes_replicas(self) -> bool:
        """Does this rank save what the data-parallel replicas share?  The first one does."""
        return self.group is None or self.group.rank == 0

    def owned_state(self):
        if not self.writes_replicas:
            return
        opt = self.optimizer
        for p in self.params:
            yield p, "param", None, p.data
            for key in opt.state_keys:
                if p.name in opt.state:
                    yield p, key, None, opt.state[p.name][key]

    def load_state(self, reader):
        opt = self.optimizer
        steps = reader.meta["scalars"].get("param_steps", {})
        count = reader.meta["scalars"]["optimizer_steps"]
        for p in self.params:
            p.data[...] = from_host(reader.read(p, "param"))
            if opt.state_keys and reader.has(p, opt.state_keys[0]):
                opt.state[p.name] = {"step": int(steps.get(p.name, count)),
                                     **{k: from_host(reader.read(p, k)).astype(p.dtype) for k in opt.state_keys}}
        opt.step_count = count

    def checkpoint_scalars(self) -> dict:
        opt = self.optimizer
        out = {"optimizer_steps": opt.step_count}
        if self.writes_replicas:
            out["param_steps"] = {n: st["step"] for n, st in opt.state.items()}
        return out

    def memory_bytes(self) -> dict:
        """Bytes of parameters, gradients and optimizer state held now, from the arrays."""
        return {"params": sum(p.data.nbytes for p in self.params),
                "grads": sum(p.grad.nbytes for p in self.params if p.grad is not None),
                "optimizer": self.optimizer.nbytes()}

    @property
    def comm_wait_s(self) -> float:
        return 0.0


class Bucketed(OneReplica):
    """A part whose gradient collectives are launched per bucket from the gradient hooks
    (``self.reducer``, parallel/data.py): DDP, ZeRO-1 and ZeRO-2 share this protocol."""

    reducer = None

    def hold(self, param):
        self.reducer.hold(param)

    def hook_window(self):
        reducer = self.reducer

        @contextlib.contextmanager
        def window():
            reducer.active = True
            try:
                yield
            finally:
                reducer.active = False
        return window

    @contextlib.contextmanager
    def micro_step(self, last: bool, pipelined: bool = False):
        """Without reduction (accumulation, ``no_sync``) unless this micro-step reduces; a
        pipelined pass keeps the hooks shut except inside :meth:`hook_window`."""
        r = self.reducer
        if not (last or self.reduces_every_micro_step):
            r.active = False
            try:
                yield
            finally:
                r.active = True
            return
        r.reset_timeline()
        r.active = not pipelined
        try:
            yield
        finally:
            r.active = True
        if self.before_reduce is not None:
            self.before_reduce()
        r.finish()  # launches what the hooks did not (and the held buckets), waits for all

    @property
    def comm_wait_s(self) -> float:
        return self.reducer.wait_s


class DataParallel(Bucketed):
    """DDP over ``group``: bucketed all-reduces launched from the gradient hooks."""

    def __init__(self, model, optimizer, group, bucket_mb: float = 25.0, overlap: bool = True,
                 algorithm: str = "auto"):
        super().__init__(model, optimizer, group)
        self.ddp = DistributedDataParallel(self.params, group, bucket_mb=bucket_mb, overlap=overlap,
                                           algorithm=algorithm)
        self.reducer = self.ddp.reducer
        self.counts_in_norm = group.rank == 0  # every replica holds the same reduced gradients
        self.name = f"DDP over {group.size} ranks"


class Zero12(Bucketed):
    """ZeRO-1 or ZeRO-2 over ``group`` (parallel/zero.py): the optimizer state (and, for
    stage 2, the gradients) sharded; the buckets' collectives launched from the hooks."""

    def __init__(self, model, optimizer, group, stage: int, bucket_mb: float = 25.0, overlap: bool = True):
        from .zero import ZeRO

        super().__init__(model, optimizer, group)
        self.zero = ZeRO(model, group, stage, optimizer, bucket_mb, overlap)
        self.reducer, self.stage = self.zero.reducer, stage
        self.reduces_every_micro_step = stage == 2  # a rank keeps only its gradient shard
        # Stage 1 clips the full, all-reduced gradients (the same on every rank: count them
        # once); stage 2 clips the disjoint gradient shards (count every rank's).
        self.counts_in_norm = stage == 2 or group.rank == 0
        self.name = f"ZeRO-{stage} over {group.size} ranks"

    @property
    def grad_holders(self):
        return self.zero.grad_holders

    def grad_segments(self):
        if self.stage == 1:
            return super().grad_segments()
        return _shard_segments(self.zero.units, self.zero.shards)

    @contextlib.contextmanager
    def evaluating(self):
        with self.zero.evaluating():
            yield

    def step(self):
        self.zero.step()

    def zero_grad(self):
        self.zero.zero_grad()

    def memory_bytes(self) -> dict:
        return self.zero.memory_bytes()

    def owned_state(self):
        if self.writes_replicas:  # the full parameters are the same on every rank after the step
            for p in self.params:
                yield p, "param", None, p.data
        yield from _owned_shards(self.zero.units, self.zero.optimizer.state)

    def load_state(self, reader):
        for p in self.params:
            p.data[...] = from_host(reader.read(p, "param"))  # views into the flat storage the shards slice
        _load_shards(reader, self.zero.units, self.zero.optimizer)

    def checkpoint_scalars(self) -> dict:
        return {"optimizer_steps": self.zero.optimizer.step_count}


class FullyShardedDataParallel(OneReplica):
    """ZeRO-3 = FSDP over ``shard_group`` (parallel/fsdp.py), or HSDP with ``replicate_group``:
    parameters, gradients and optimizer state sharded; the loss summed over ``group``."""

    reduces_every_micro_step = True  # each block's gradients are reduce-scattered in its backward

    def __init__(self, model, optimizer, group, shard_group, replicate_group=None):
        from .fsdp import FSDP

        super().__init__(model, optimizer, group)
        self.fsdp = FSDP(model, shard_group, optimizer, replicate_group)
        # The shards are disjoint within a shard group; HSDP's replicas hold the same ones.
        self.counts_in_norm = replicate_group is None or replicate_group.rank == 0
        self.name = (f"HSDP: ZeRO-3 over {shard_group.size} ranks x {replicate_group.size} replicas"
                     if replicate_group is not None else f"ZeRO-3 (FSDP) over {shard_group.size} ranks")

    @contextlib.contextmanager
    def micro_step(self, last: bool, pipelined: bool = False):
        with self.fsdp.micro_step(last, before_reduce=self.before_reduce):
            yield

    @contextlib.contextmanager
    def evaluating(self):
        with self.fsdp.evaluating():
            yield

    @property
    def grad_holders(self):
        return self.fsdp.grad_holders

    def grad_segments(self):
        return _shard_segments(self.fsdp.units, self.fsdp.shards)

    def step(self):
        self.fsdp.step()

    def parameters(self) -> dict:
        return self.fsdp.full_parameters()

    def owned_state(self):
        if not self.counts_in_norm:  # an HSDP replica other than the first
            return
        for unit, piece in zip(self.fsdp.units, self.fsdp.shards):
            for p, s, flat in unit.segments():
                yield p, "param", flat, piece.data[s]
        yield from _owned_shards(self.fsdp.units, self.fsdp.optimizer.state)

    def load_state(self, reader):
        for unit, piece in zip(self.fsdp.units, self.fsdp.shards):
            for p, s, flat in unit.segments():
                piece.data[s] = from_host(reader.read(p, "param", flat))
        _load_shards(reader, self.fsdp.units, self.fsdp.optimizer)

    def checkpoint_scalars(self) -> dict:
        return {"optimizer_steps": self.fsdp.optimizer.step_count}

    def zero_grad(self):
        self.fsdp.zero_grad()

    def memory_bytes(self) -> dict:
        return self.fsdp.memory_bytes()


def _owned_shards(units, state):
    """The optimizer state's pieces in a ZeRO rank's flat shards, per parameter stretch."""
    for unit, st in zip(units, state):
        for p, s, flat in unit.segments():
            for key, array in st.items():
                yield p, key, flat, array[s]


def _load_shards(reader, units, optimizer):
    for unit, st in zip(units, optimizer.state):
        for p, s, flat in unit.segments():
            for key, array in st.items():
                array[s] = from_host(reader.read(p, key, flat))
    optimizer.step_count = reader.meta["scalars"]["optimizer_steps"]


def _shard_segments(units, shards):
    """``(parameter, its stretch of the shard's gradient)`` for every shard (ZeRO-2/3)."""
    for unit, piece in zip(units, shards):
        if piece.grad is not None:
            for p, s, _ in unit.segments():
                yield p, piece.grad[s]


def data_parallel(model, optimizer, p, mesh):
    """The data-parallel part of a run (``p``: its ParallelConfig) over the ``("dp", "cp")``
    group -- the ranks that hold the same parameters and see different tokens -- : one
    replica, DDP, ZeRO-1/2, ZeRO-3 (FSDP) or HSDP (ZeRO-3 in groups of ``p.hsdp_shard``)."""
    if mesh is None or mesh.size(("dp", "cp")) == 1:
        return OneReplica(model, optimizer)
    group = mesh.group(("dp", "cp"))
    if p.zero == 3:
        shards, replicas = group, None
        if p.hsdp_shard and p.hsdp_shard != group.size:
            from .fsdp import hsdp_groups
            shards, replicas = hsdp_groups(group, p.hsdp_shard)
        return FullyShardedDataParallel(model, optimizer, group, shards, replicas)
    if p.zero:
        return Zero12(model, optimizer, group, p.zero, p.bucket_mb, p.overlap)
    return DataParallel(model, optimizer, group, p.bucket_mb, p.overlap)
