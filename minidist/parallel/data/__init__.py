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
6. ``fsdp.py`` -- ZeRO-3 = FSDP, the parameters sharded too, and HSDP (Zhao et al. 2023);
7. ``experts.py`` -- with expert parallelism, two parts: the dense parameters over the
   data-parallel group, the experts over the ranks holding the same ones.

``checks.py`` holds the settings' checks, and :func:`apply` is the composer's step for this
axis.  Imports: the comm layer, the backend, autograd, ops and optim; nothing above
``parallel``.
"""

from __future__ import annotations

from minidist.parallel.data.allreduce import allreduce_gradients, any_rank, reduce_sum  # noqa: F401  (the textbook's API)
from minidist.parallel.data.checks import problems  # noqa: F401
from minidist.parallel.data.ddp import DistributedDataParallel
from minidist.parallel.data.experts import DenseAndExperts
from minidist.parallel.data.fsdp import FSDP, hsdp_groups
from minidist.parallel.data.replica import OneReplica
from minidist.parallel.data.zero import ZeRO


def apply(model, optimizer, p, mesh, experts=None, expert_optimizer=None):
    """The data-parallel part of a run (``p``: its ParallelConfig) over the ``("dp", "cp")``
    group -- the ranks that hold the same parameters and see different tokens -- : one
    replica, DDP, ZeRO-1/2, ZeRO-3 (FSDP) or HSDP (ZeRO-3 in groups of ``p.hsdp_shard``).

    With expert parallelism (``experts``: parallel.expert.ExpertGroups) the dense parameters
    get that part and this rank's experts a second one of the same flavour over the edp group,
    updated by ``expert_optimizer`` (experts.py); with ZeRO-3 one FSDP holds both, each block's
    experts a unit of their own sharded over the edp group (fsdp.py)."""
    group = mesh.group(("dp", "cp")) if mesh is not None else None
    if experts is None:
        return _part(model, optimizer, p, group, None)
    if p.zero == 3 and group.size > 1:  # one FSDP: each block's dense unit and its experts' unit (fsdp.py)
        shards, replicas = _shard_groups(p, group)
        return FSDP(model, optimizer, group, shards, replicas, experts=experts)
    mine = {id(q) for q in experts.params}
    dense = [q for q in model.parameters() if id(q) not in mine]
    return DenseAndExperts(_part(model, optimizer, p, group, dense),
                           _part(model, expert_optimizer, p, experts.edp_group, experts.params))


def _part(model, optimizer, p, group, params):
    """The data-parallel part of ``params`` (None: the model's) over ``group``."""
    if group is None or group.size == 1:
        return OneReplica(model, optimizer, None, params)
    if p.zero == 3:  # with experts: apply() makes one FSDP of both
        return FSDP(model, optimizer, group, *_shard_groups(p, group))
    if p.zero:
        return ZeRO(model, optimizer, group, p.zero, p.bucket_mb, p.overlap, params=params)
    return DistributedDataParallel(model, optimizer, group, p.bucket_mb, p.overlap, params=params)


def _shard_groups(p, group):
    """ZeRO-3's (shard group, replicate group): the whole group, or HSDP's groups of ``p.hsdp_shard``."""
    if p.hsdp_shard and p.hsdp_shard != group.size:
        return hsdp_groups(group, p.hsdp_shard)
    return group, None
