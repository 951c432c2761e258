"""What the training loop asks of a parallel strategy, and the strategies of the data axis.

The loop (minidist/train.py) is the same for every strategy::

    for xs, ys, share, last in strategy.micro_batches(x, y, grad_accum):
        with strategy.micro_step(last):          # DDP: no_sync unless last; ZeRO-3: gathers
            (model(xs, ys) * share).backward()   # hooks launch the gradient collectives
    loss = strategy.reduce_loss(local_loss)      # the global batch's mean loss
    if not strategy.found_inf(scaler):           # fp16: one rank overflows, every rank skips
        strategy.clip_grad_norm(max_norm)        # the global norm over all ranks
        strategy.step()
    strategy.zero_grad()

:class:`Strategy` is one process; :class:`DataParallel` wraps DDP (parallel/data.py) and
:class:`Zero` ZeRO-1/2/3 and HSDP (parallel/zero.py).  Each rank takes its rows of the global
batch (``data.shard``) and weights each micro-batch's mean loss by its share of the *global*
batch's rows, so the gradients summed over ranks are the single-process gradients.
"""

from __future__ import annotations

import contextlib
import math

from ..data import shard
from ..optim.clip import clip_coefficient, grad_norm_sq, scale_grads
from .data import DistributedDataParallel, any_rank, reduce_sum


class Strategy:
    """One process: the whole batch, the whole model, the plain optimizer."""

    name = "single process"

    def __init__(self, model, optimizer, group=None):
        self.model, self.optimizer, self.group = model, optimizer, group
        self.rank, self.size = (group.rank, group.size) if group is not None else (0, 1)
        self.params = [p for p in model.parameters() if p.requires_grad]

    # -- data ------------------------------------------------------------------------------------
    def micro_batches(self, x, y, grad_accum: int):
        """This rank's rows of the global batch in ``grad_accum`` micro-batches:
        ``(x, y, share of the global rows, last?)``."""
        total = x.shape[0]
        xr, yr = shard(x, self.rank, self.size), shard(y, self.rank, self.size)
        for i in range(grad_accum):
            xs, ys = shard(xr, i, grad_accum), shard(yr, i, grad_accum)
            yield xs, ys, xs.shape[0] / total, i == grad_accum - 1

    def reduce_loss(self, local: float) -> float:
        """The row-weighted shard losses summed into the global batch's mean loss."""
        return reduce_sum(local, self.group) if self.group is not None else local

    # -- backward --------------------------------------------------------------------------------
    @contextlib.contextmanager
    def micro_step(self, last: bool):
        yield

    @contextlib.contextmanager
    def evaluating(self):
        yield

    # -- the update ------------------------------------------------------------------------------
    @property
    def grad_holders(self):
        """The objects whose ``.grad`` this rank unscales and clips."""
        return self.params

    norm_group = None  # the group over which squared gradient norms are summed (None: none)

    def found_inf(self, scaler) -> bool:
        """Unscale this rank's gradients; True on every rank if any rank saw an inf/NaN."""
        found = scaler.unscale_(self.grad_holders)
        return any_rank(found, self.group) if self.group is not None else found

    def clip_grad_norm(self, max_norm: float) -> float:
        """Clip to ``max_norm`` by the global gradient norm (over every rank's shard)."""
        sq = grad_norm_sq(self.grad_holders)
        if self.norm_group is not None:
            sq = reduce_sum(sq, self.norm_group)
        total = math.sqrt(sq)
        if math.isfinite(total):
            scale_grads(self.grad_holders, clip_coefficient(total, max_norm))
        return total

    def step(self):
        self.optimizer.step()

    def zero_grad(self):
        self.optimizer.zero_grad()

    # -- reports ---------------------------------------------------------------------------------
    def memory_bytes(self) -> dict:
        """Bytes of parameters, gradients and optimizer state held now, from the arrays."""
        return {"params": sum(p.data.nbytes for p in self.params),
                "grads": sum(p.grad.nbytes for p in self.params if p.grad is not None),
                "optimizer": sum(a.nbytes for st in self.optimizer.state.values() for a in st.values()
                                 if hasattr(a, "nbytes"))}

    @property
    def comm_wait_s(self) -> float:
        """Time the last step spent waiting for gradient communication (not hidden by backward)."""
        return 0.0


class DataParallel(Strategy):
    """DDP over ``group``: bucketed all-reduces launched from the gradient hooks."""

    def __init__(self, model, optimizer, group, bucket_mb: float = 25.0, overlap: bool = True,
                 algorithm: str = "auto"):
        super().__init__(model, optimizer, group)
        self.ddp = DistributedDataParallel(self.params, group, bucket_mb=bucket_mb, overlap=overlap,
                                           algorithm=algorithm)
        self.name = f"DDP over {group.size} ranks"

    @contextlib.contextmanager
    def micro_step(self, last: bool):
        if not last:
            with self.ddp.no_sync():
                yield
            return
        self.ddp.reducer.reset_timeline()
        yield
        self.ddp.finish()

    @property
    def comm_wait_s(self) -> float:
        return self.ddp.wait_s


class Zero(Strategy):
    """ZeRO stage 1, 2 or 3 over ``group``; with ``replicate_group``, HSDP."""

    def __init__(self, model, optimizer, group, stage: int, bucket_mb: float = 25.0, overlap: bool = True,
                 replicate_group=None, dp_group=None):
        from .zero import make_zero

        super().__init__(model, optimizer, dp_group if dp_group is not None else group)
        self.zero = make_zero(model, group, stage, optimizer, bucket_mb, overlap, replicate_group)
        self.stage = stage
        self.name = (f"HSDP: ZeRO-3 over {group.size} ranks x {replicate_group.size} replicas"
                     if replicate_group is not None else f"ZeRO-{stage} over {group.size} ranks")

    micro_step = property(lambda self: self.zero.micro_step)
    evaluating = property(lambda self: self.zero.evaluating)
    grad_holders = property(lambda self: self.zero.grad_holders)
    norm_group = property(lambda self: self.zero.norm_group)

    def step(self):
        self.zero.step()

    def zero_grad(self):
        self.zero.zero_grad()

    def memory_bytes(self) -> dict:
        return self.zero.memory_bytes()

    @property
    def comm_wait_s(self) -> float:
        return self.zero.reducer.wait_s if self.zero.reducer is not None else 0.0


def make_strategy(model, optimizer, dp: int = 1, zero: int = 0, bucket_mb: float = 25.0, overlap: bool = True,
                  hsdp_shard: int | None = None, mesh=None):
    """The strategy for these settings; ``mesh`` (a comm.Mesh) is built when dp > 1 and none is given."""
    if dp == 1 and mesh is None:
        return Strategy(model, optimizer)
    if mesh is None:
        from ..comm import Mesh
        mesh = Mesh(dp=dp)
    group = mesh.group("dp")
    if hsdp_shard is not None and hsdp_shard != group.size:
        from .zero import hsdp_groups
        shard_group, replicate = hsdp_groups(group, hsdp_shard)
        return Zero(model, optimizer, shard_group, 3, bucket_mb, overlap, replicate, dp_group=group)
    if zero:
        return Zero(model, optimizer, group, zero, bucket_mb, overlap)
    return DataParallel(model, optimizer, group, bucket_mb, overlap)
