"""DDP: the all-reduce of the gradients in buckets, launched from the gradient hooks.

The same sums as allreduce.py's textbook step, arranged as PyTorch DDP does it (Li et al.
2020, "PyTorch Distributed: Experiences on Accelerating Data Parallel Training"):

* gradients are packed into **buckets** of about ``bucket_mb`` MB, in reverse order of use
  in the forward pass (the order backward finishes them), so a few large all-reduces replace
  many small ones (each collective pays a latency of several messages);
* each bucket's all-reduce is **launched asynchronously from the gradient hooks** the moment
  its last gradient is final, so communication overlaps the rest of the backward pass;
* on gradient-accumulation micro-steps the hooks stay shut (PyTorch's ``no_sync``):
  gradients accumulate locally and are reduced once, on the last micro-step.

Cost per step: one all-reduce of all Ψ gradient elements, 2(N-1)/N·Ψ elements sent per rank
by a bandwidth-optimal algorithm, whatever the bucket size.  ZeRO-1/2 (zero.py) reuse the
buckets and their hooks, with other collectives.
"""

from __future__ import annotations

import contextlib
import time

from minidist import comm
from minidist.model.backend import from_host, to_host
from minidist.parallel.data.allreduce import broadcast_parameters, check_identical
from minidist.parallel.data.flat import FlatUnit
from minidist.parallel.data.replica import OneReplica


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
class DistributedDataParallel(OneReplica):
    """Gradients summed over ``group`` by bucketed all-reduces overlapped with backward.

    In the training loop (the Strategy) each micro-batch runs inside :meth:`micro_step`; on
    its own, with each rank's loss already weighted by its share of the global batch::

        ddp = DistributedDataParallel(model, optimizer, group)   # broadcast + check
        loss.backward()              # hooks launch each bucket's all-reduce as it fills
        ddp.finish()                 # wait; every .grad now holds the global gradient

    ``bucket_mb`` (default 25, as PyTorch) caps a bucket; ``overlap=False`` launches every
    bucket after backward instead (for comparison).  ``algorithm`` is passed to
    ``comm.all_reduce``; ``params`` (default: all the model's) are the ones reduced.
    """

    def __init__(self, model, optimizer, group, bucket_mb: float = 25.0, overlap: bool = True,
                 algorithm: str = "auto", params=None):
        super().__init__(model, optimizer, group, params)
        broadcast_parameters(self.params, group)
        check_identical(self.params, group)
        self.algorithm = algorithm
        self.reducer = BucketedReducer(self.params, bucket_mb, overlap, self._launch, self._land)
        self.buckets = self.reducer.buckets
        self.counts_in_norm = group.rank == 0  # every replica holds the same reduced gradients
        self.name = f"DDP over {group.size} ranks"

    # -- the collective of a bucket, and where its result lands (ZeRO-1/2 change both) ---------
    def _launch(self, bucket):
        return comm.all_reduce(bucket.pack_grads(), self.group, async_op=True, algorithm=self.algorithm)

    def _land(self, bucket, result):
        bucket.unpack_grads(result)

    def finish(self):
        """Wait for every bucket (launching any not yet launched); gradients are then global."""
        self.reducer.finish()

    # -- the loop's protocol (replica.py) --------------------------------------------------------
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
        self.finish()  # launches what the hooks did not (and the held buckets), waits for all

    @property
    def comm_wait_s(self) -> float:
        return self.reducer.wait_s
