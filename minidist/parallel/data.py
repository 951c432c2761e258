"""Data parallelism: every rank holds the whole model and a shard of each global batch.

The textbook algorithm (:func:`allreduce_gradients`) is three lines: after backward, sum every
gradient over the data-parallel group.  If each rank's loss is its shard's mean loss weighted
by the shard's share of the global batch's rows, the sum is exactly the gradient of the global
batch's mean loss, so N ranks take the same step as one process with the whole batch.

:class:`DistributedDataParallel` is the same computation arranged as PyTorch DDP does it
(Li et al. 2020, "PyTorch Distributed: Experiences on Accelerating Data Parallel Training"):

* gradients are packed into **buckets** of about ``bucket_mb`` MB, in reverse order of use
  in the forward pass (the order backward finishes them), so a few large all-reduces replace
  many small ones (each collective pays a latency of several messages);
* each bucket's all-reduce is **launched asynchronously from the gradient hooks** the moment
  its last gradient is final, so communication overlaps the rest of the backward pass;
* :meth:`no_sync` skips the communication on gradient-accumulation micro-steps: gradients
  accumulate locally and are reduced once, on the last micro-step.

Cost per step: one all-reduce of all Ψ gradient elements, 2(N-1)/N·Ψ elements sent per rank
by a bandwidth-optimal algorithm, whatever the bucket size.
"""

from __future__ import annotations

import contextlib
import time
import zlib

from .. import comm
from ..backend import from_host, host, to_host, xp
from .flat import FlatUnit


# --------------------------------------------------------------------------------------------
# The textbook pieces
# --------------------------------------------------------------------------------------------
def allreduce_gradients(params, group) -> None:
    """Sum every parameter's gradient over ``group``: one all-reduce per gradient, after backward.

    The plain data-parallel step (the seeds' "synchronous SGD"); a missing gradient counts as
    zeros, so every rank issues the same calls.
    """
    for p in params:
        g = p.grad if p.grad is not None else xp.zeros(p.shape, p.dtype)
        p.grad = from_host(comm.all_reduce(to_host(g), group))


def broadcast_parameters(params, group, root: int = 0) -> None:
    """Overwrite every rank's parameters with ``root``'s (DDP does this once, at start)."""
    for p in params:
        p.data = from_host(comm.broadcast(to_host(p.data), group, root=root)).reshape(p.shape)


def check_identical(params, group) -> None:
    """Raise on every rank unless all ranks hold bit-identical parameters.

    Each rank hashes its arrays (CRC-32 of the bytes, exact in float64); the group's minimum
    and maximum of every hash agree only if every rank has the same bytes.
    """
    crc = host.asarray([float(zlib.crc32(to_host(p.data).tobytes())) for p in params], dtype=host.float64)
    hi, lo = comm.all_reduce(crc, group, op="max"), comm.all_reduce(crc, group, op="min")
    differ = [getattr(p, "name", None) or f"param{i}" for i, p in enumerate(params) if hi[i] != lo[i]]
    if differ:
        raise RuntimeError(f"parameters differ between the ranks of group {group.name!r}: {differ[:5]}"
                           f"{' ...' if len(differ) > 5 else ''}")


def reduce_sum(value: float, group) -> float:
    """The sum of a Python float over ``group`` (e.g. the row-weighted shard losses)."""
    if group.size == 1:
        return float(value)
    return float(comm.all_reduce(host.asarray([value], dtype=host.float64), group)[0])  # host in, host out


def any_rank(flag: bool, group) -> bool:
    """True on every rank if ``flag`` is true on any rank (e.g. an fp16 overflow: one skips, all skip)."""
    if group.size == 1:
        return bool(flag)
    return bool(comm.all_reduce(host.asarray([1.0 if flag else 0.0]), group, op="max")[0])


# --------------------------------------------------------------------------------------------
# Buckets
# --------------------------------------------------------------------------------------------
class Bucket(FlatUnit):
    """Consecutive parameters whose gradients travel in one flat message."""

    def __init__(self, params):
        super().__init__(params)
        self.ready: set[int] = set()  # ids of the parameters whose gradient is final this pass
        self.handle = None

    def pack_grads(self, free: bool = False):
        """The bucket's gradients as one flat host array (zeros where a gradient is missing).

        ``free=True`` drops each parameter's own gradient once packed (ZeRO-2/3 keep only
        their reduced shard)."""
        flat = self.flatten([p.grad for p in self.params])
        if free:
            for p in self.params:
                p.grad = None
        return to_host(flat)

    def unpack_grads(self, flat):
        """Each parameter's ``.grad`` becomes its (reshaped) slice of ``flat``."""
        for p, g in zip(self.params, self.views(from_host(flat))):
            p.grad = g


def make_buckets(params, bucket_mb: float) -> list[Bucket]:
    """Cut ``params`` into buckets of at most ``bucket_mb`` MB, in reverse order of ``params``.

    ``params`` come in forward order (a model's ``parameters()``), so the reversed order is the
    order in which backward finishes their gradients.  A parameter larger than the cap gets a
    bucket of its own; ``bucket_mb=0`` gives every parameter its own bucket (no bucketing).
    A bucket never mixes dtypes.
    """
    cap = bucket_mb * 2**20
    buckets, current, size = [], [], 0
    for p in reversed(list(params)):
        nbytes = int(p.size) * p.dtype.itemsize
        if current and (size + nbytes > cap or p.dtype != current[0].dtype):
            buckets.append(Bucket(current))
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        buckets.append(Bucket(current))
    return buckets


class BucketedReducer:
    """Launch a collective per bucket from the gradient hooks; wait for them all in ``finish``.

    The machinery DDP and ZeRO-2 share: ``launch(bucket)`` starts the bucket's collective
    (an all-reduce for DDP, a reduce-scatter for ZeRO-2) and returns its handle;
    ``finish()`` launches the buckets whose hooks did not fire (a parameter without a
    gradient this pass), then waits for every handle in launch order and hands each
    bucket and its result to ``land(bucket, result)``.  With ``overlap=False`` nothing is
    launched before ``finish`` (the comparison run: communication after backward).
    """

    def __init__(self, params, bucket_mb: float, overlap: bool, launch, land):
        self.params = [p for p in params if p.requires_grad]
        self.buckets = make_buckets(self.params, bucket_mb)
        self.overlap = overlap
        self._launch, self._land = launch, land
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self.active = True          # False inside no_sync(): hooks do nothing
        self.held: set[int] = set()  # ids of buckets launched only by finish() (see hold)
        self.launch_times: list[float] = []  # perf_counter() of each launch this pass
        self.backward_end = None    # perf_counter() when finish() was called
        self.wait_s = 0.0           # time finish() spent waiting: the exposed communication
        self._launched: list[Bucket] = []
        for p in self.params:
            p.register_grad_hook(self._grad_ready)

    def _grad_ready(self, p):
        if not (self.active and self.overlap):
            return
        bucket = self._bucket_of[id(p)]
        bucket.ready.add(id(p))
        if len(bucket.ready) == len(bucket.params) and bucket.handle is None and id(bucket) not in self.held:
            self._start(bucket)

    def hold(self, param):
        """Launch the bucket of ``param`` only in :meth:`finish`, never from a hook: its gradient
        still changes after its hook fires (a pipeline's tied embedding, whose two stages add
        their parts once the schedule is over)."""
        self.held.add(id(self._bucket_of[id(param)]))

    def _start(self, bucket):
        self.launch_times.append(time.perf_counter())
        bucket.handle = self._launch(bucket)
        self._launched.append(bucket)

    def finish(self):
        self.backward_end = time.perf_counter()
        for bucket in self.buckets:
            if bucket.handle is None:
                self._start(bucket)
        t0 = time.perf_counter()
        launched, self._launched = self._launched, []
        for bucket in launched:
            result = bucket.handle.wait()
            bucket.handle, bucket.ready = None, set()
            self._land(bucket, result)
        self.wait_s = time.perf_counter() - t0

    def reset_timeline(self):
        self.launch_times, self.backward_end = [], None


# --------------------------------------------------------------------------------------------
# DDP
# --------------------------------------------------------------------------------------------
class DistributedDataParallel:
    """Gradients summed over ``group`` by bucketed all-reduces overlapped with backward.

    Usage (the loss of each rank already weighted by its share of the global batch)::

        ddp = DistributedDataParallel(model.parameters(), group)   # broadcast + check
        with ddp.no_sync():            # micro-steps 1..K-1: accumulate, no communication
            loss_1.backward()
        loss_K.backward()              # hooks launch each bucket's all-reduce as it fills
        ddp.finish()                   # wait; every .grad now holds the global gradient

    ``bucket_mb`` (default 25, as PyTorch) caps a bucket; ``overlap=False`` launches every
    bucket after backward instead (for comparison).  ``algorithm`` is passed to
    ``comm.all_reduce``.
    """

    def __init__(self, params, group, bucket_mb: float = 25.0, overlap: bool = True,
                 algorithm: str = "auto", broadcast: bool = True):
        params = list(params)
        if broadcast:
            broadcast_parameters(params, group)
        check_identical(params, group)
        self.group, self.algorithm = group, algorithm
        self.reducer = BucketedReducer(params, bucket_mb, overlap, self._launch, self._land)
        self.buckets = self.reducer.buckets

    def _launch(self, bucket):
        return comm.all_reduce(bucket.pack_grads(), self.group, async_op=True, algorithm=self.algorithm)

    @staticmethod
    def _land(bucket, result):
        bucket.unpack_grads(result)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside accumulate gradients locally: no hook launches anything."""
        self.reducer.active = False
        try:
            yield
        finally:
            self.reducer.active = True

    def finish(self):
        """Wait for every bucket (launching any not yet launched); gradients are then global."""
        self.reducer.finish()

    @property
    def wait_s(self) -> float:
        return self.reducer.wait_s


# --------------------------------------------------------------------------------------------
# The data axis's settings
# --------------------------------------------------------------------------------------------
def problems(given, cfg) -> list[str]:
    """Why the data-parallel settings cannot run (one line each; [] if they can).

    ``given`` is the run configuration as the user gave it, ``cfg`` the same resolved.  The
    gradients are reduced over the ("dp", "cp") group: ZeRO and HSDP shard over it."""
    p, g = cfg.parallel, given.parallel
    rows, accum = cfg.data.batch_size, cfg.device.grad_accum
    out = []
    if rows < p.dp * accum:
        out.append(f"--batch-size {rows} has fewer rows than --dp {p.dp} x --grad-accum {accum} = "
                   f"{p.dp * accum}: a rank would get an empty micro-batch")
    replicas = p.dp * p.cp
    if g.hsdp_shard is not None:
        if g.zero not in (None, 3):
            out.append(f"--hsdp-shard shards with ZeRO-3, but --zero {g.zero} was given")
        elif replicas % g.hsdp_shard:
            over = f"--dp {p.dp} x --cp {p.cp} = {replicas}" if p.cp > 1 else f"--dp {p.dp}"
            out.append(f"--hsdp-shard {g.hsdp_shard} does not divide {over}")
    buckets = [f for f, given_ in (("--bucket-mb", g.bucket_mb is not None), ("--no-overlap", not g.overlap)) if given_]
    if buckets and (replicas == 1 or p.zero == 3):
        why = ("one data-parallel rank reduces no gradients" if replicas == 1 else
               "ZeRO-3 reduce-scatters each block's gradients from its backward, without buckets")
        out.append(f"{' and '.join(buckets)} {'sets' if len(buckets) == 1 else 'set'} the gradient buckets of DDP "
                   f"and ZeRO-1/2, but {why}: leave {'it' if len(buckets) == 1 else 'them'} out")
    if p.zero and replicas == 1:
        flag = f"--hsdp-shard {g.hsdp_shard}" if g.hsdp_shard else f"--zero {p.zero}"
        out.append(f"{flag} shards over the data-parallel ranks, but there is one (--dp 1): "
                   "run under mpiexec with more ranks, or leave it out")
    return out
