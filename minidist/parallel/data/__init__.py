"""Data parallelism: replicas of the model, each on its own slice of the batch, gradients summed.

Read it in the order of the ideas, each file one step from the last:

1. ``allreduce.py`` -- the textbook: after backward, all-reduce every gradient (plus the
   start-up broadcast, the loss summed over the replicas, an overflow flag all agree on);
2. ``replica.py`` -- ``OneReplica``: the protocol the training loop calls, for one replica;
3. ``ddp.py`` -- DDP: the same sums in buckets, launched from the gradient hooks so they
   overlap backward (Li et al. 2020);
4. ``flat.py`` -- parameters seen as one flat vector, cut into a shard per rank;
5. ``zero.py`` -- ZeRO-1/2: DDP's buckets, the optimizer state and then the gradients
   sharded (Rajbhandari et al. 2020), and the memory table;
6. ``fsdp.py`` -- ZeRO-3 = FSDP, the parameters sharded too, and HSDP (Zhao et al. 2023).

``checks.py`` holds the settings' checks, and :func:`apply` is the composer's step for this
axis.  Imports: the comm layer, the backend, autograd, ops and optim; nothing above
``parallel``.
"""

from __future__ import annotations

from minidist.parallel.data.allreduce import allreduce_gradients, any_rank, reduce_sum  # noqa: F401  (the textbook's API)
from minidist.parallel.data.checks import problems  # noqa: F401
from minidist.parallel.data.ddp import DistributedDataParallel
from minidist.parallel.data.fsdp import FSDP, hsdp_groups
from minidist.parallel.data.replica import OneReplica
from minidist.parallel.data.zero import ZeRO


def apply(model, optimizer, p, mesh):
    """The data-parallel part of a run (``p``: its ParallelConfig) over the ``("dp", "cp")``
    group -- the ranks that hold the same parameters and see different tokens -- : one
    replica, DDP, ZeRO-1/2, ZeRO-3 (FSDP) or HSDP (ZeRO-3 in groups of ``p.hsdp_shard``)."""
    if mesh is None or mesh.size(("dp", "cp")) == 1:
        return OneReplica(model, optimizer)
    group = mesh.group(("dp", "cp"))
    if p.zero == 3:
        shards, replicas = group, None
        if p.hsdp_shard and p.hsdp_shard != group.size:
            shards, replicas = hsdp_groups(group, p.hsdp_shard)
        return FSDP(model, optimizer, group, shards, replicas)
    if p.zero:
        return ZeRO(model, optimizer, group, p.zero, p.bucket_mb, p.overlap)
    return DistributedDataParallel(model, optimizer, group, p.bucket_mb, p.overlap)
