"""The textbook data-parallel step: after backward, sum every gradient over the replicas.

Every rank holds the whole model and a shard of each global batch.  If each rank's loss is
its shard's mean loss weighted by the shard's share of the global batch's rows (and tokens,
with context parallelism), the sum of the ranks' gradients is exactly the gradient of the
global batch's mean loss, so N ranks take the same step as one process with the whole batch
(the seeds' "synchronous SGD").  :func:`allreduce_gradients` is that step in three lines;
ddp.py arranges the same sums for speed.

Cost per step: one all-reduce of all Ψ gradient elements, 2(N-1)/N·Ψ elements sent per rank
by a bandwidth-optimal algorithm (comm/algorithms/ring.py).

Here too: the other sums every data-parallel run needs -- the start-up broadcast of the
parameters and its check, the loss summed over the replicas, and an overflow flag agreed by
all of them.
"""

from __future__ import annotations

import zlib

from minidist import comm
from minidist.model.backend import from_host, host, to_host, xp


def allreduce_gradients(params, group) -> None:
    """Sum every parameter's gradient over ``group``: one all-reduce per gradient, after backward.

    A missing gradient counts as zeros, so every rank issues the same calls.
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
