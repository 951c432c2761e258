"""What the training loop asks of a parallel run: one :class:`Strategy` for every mesh.

The loop (minidist/train/loop.py) is the same whatever the mesh::

    for step in range(steps):
        x, y = sampler.batch(step)                          # the global batch, same on every rank
        loss = strategy.forward_backward(x, y, grad_accum)  # this rank's part; gradients reduced
        if not (scaler and strategy.found_inf(scaler)):     # fp16: one rank overflows, all skip
            strategy.clip_grad_norm(max_norm)               # the norm of the whole model
            strategy.step()
        strategy.zero_grad()

Inside, one step of a ``dp x pp x tp x cp`` run goes:

* **rows** of the global batch over ``dp`` (``layout.split.shard``), in ``grad_accum`` micro-batches;
* **tokens** of every row over ``cp`` (parallel/context/); each micro-batch's mean loss is
  weighted by its share of the global batch's rows *and* tokens, so summed over every rank it
  is exactly the single-process loss, and so are the gradients;
* the micro-batch runs through the model (tensor-parallel layers communicate inside it), or
  through the **pipeline** schedule of this rank's stage (parallel/pipeline/runtime.py);
* the **data-parallel part** (parallel/data/, :func:`~minidist.parallel.data.apply`: one replica, DDP,
  ZeRO-1/2 or ZeRO-3 / HSDP) reduces the gradients over the ``("dp", "cp")`` group, the ranks holding the same
  parameters; with a pipeline and a tied embedding the first and last stage first add their
  two partial embedding gradients.

The update then needs three numbers agreed by every rank: the loss (summed over
``("dp", "cp")``), the overflow flag and the gradient norm (over the whole world, each
gradient counted once: see :meth:`Strategy.clip_grad_norm`).
"""

from __future__ import annotations

import math

from minidist.model import ops
from minidist.model.autograd import no_grad
from minidist.model.backend import host_read, xp
from minidist.layout.split import shard
from minidist.model.optim.clip import clip_coefficient, scale_grads, total_sum_of_squares
from minidist.parallel.data.allreduce import any_rank, reduce_sum


class Strategy:
    """The loop's interface for ``model`` (this rank's part of it) on ``mesh`` (None: one
    process): ``data`` reduces the gradients, ``context`` splits the sequences, ``pipeline``
    runs this rank's stage.  Build it with :func:`minidist.parallel.compose.build`."""

    def __init__(self, model, data, mesh=None, context=None, pipeline=None):
        self.model, self.data, self.mesh = model, data, mesh
        self.optimizer = data.optimizer
        self.context, self.pipeline = context, pipeline
        coord = mesh.coords if mesh is not None else {"dp": 0, "pp": 0, "tp": 0, "cp": 0}
        self.dp_rank, self.dp_size = coord["dp"], mesh.size("dp") if mesh is not None else 1
        self.world = mesh.world if mesh is not None else None
        # A gradient the tp ranks all hold whole (LayerNorm, biases of row-parallel layers,
        # ...) enters the global norm from tp rank 0 only; its split slices from every rank.
        self.first_tp = coord["tp"] == 0
        self.tied = pipeline.tied_weight() if pipeline is not None else None
        if self.tied is not None:  # the two stages add their parts before the reduction
            data.before_reduce = pipeline.reduce_tied_gradients
        for p in pipeline.held_weights() if pipeline is not None else ():
            data.hold(p)  # reduced after the pass, not from a chunk's hook window
        self.name = describe(mesh, data, context, pipeline)
        self._pipeline_totals = {}

    # -- one step ---------------------------------------------------------------------------------
    def micro_batches(self, x, y, grad_accum: int):
        """This rank's part of the global batch ``(x, y)`` in ``grad_accum`` micro-batches:
        ``(x, y, share of the global batch, last?)``; the share counts rows and tokens."""
        rows, tokens = x.shape
        xr, yr = shard(x, self.dp_rank, self.dp_size), shard(y, self.dp_rank, self.dp_size)
        for i in range(grad_accum):
            xs, ys = shard(xr, i, grad_accum), shard(yr, i, grad_accum)
            if self.context is not None:
                xs, ys = self.context.shard(xs, ys)
            yield xs, ys, xs.shape[0] / rows * xs.shape[1] / tokens, i == grad_accum - 1

    def forward_backward(self, x, y, grad_accum: int = 1, low_dtype=None, loss_scale: float = 1.0) -> float:
        """Accumulate into the gradients the gradient of the global batch's mean loss (times
        ``loss_scale``), reduced over the data-parallel group; return that loss."""
        if self.pipeline is not None:  # each pass returns its loss as a number (read once per pass)
            local = 0.0
            for xs, ys, share, last in self.micro_batches(x, y, grad_accum):
                local += self._pipeline_pass(xs, ys, share, last, low_dtype, loss_scale)
            return self.reduce_loss(local)
        # The weighted losses add up on the device and come to the host once, after the last
        # microbatch: a read (a synchronisation on a GPU) per step, not per microbatch.  The
        # batch stays on the host: the ops check its indices there and move it themselves.
        local = xp.zeros((), dtype=xp.float64)
        for m, (xs, ys, share, last) in enumerate(self.micro_batches(x, y, grad_accum)):
            with self.data.micro_step(last):
                loss = self.micro_forward(m, xs, ys, low_dtype)
                self.micro_backward(m, loss, share * loss_scale)
            local = local + loss.data.astype(xp.float64) * share
        return self.reduce_loss(float(host_read(local, "loss")))

    def micro_forward(self, m: int, xs, ys, low_dtype=None):
        """Micro-batch ``m``'s forward: its mean loss.  (A seam: a tracer times it, trace.py.)"""
        with ops.autocast(low_dtype):
            return self.model(xs, ys)

    def micro_backward(self, m: int, loss, weight: float):
        """Micro-batch ``m``'s backward of ``weight`` x its loss, into the gradients.  (A seam.)"""
        (loss * weight).backward()

    def _pipeline_pass(self, xs, ys, share, last, low_dtype, loss_scale) -> float:
        """One pass of the schedule.  Gradient hooks open only around each chunk's last
        backward of a pass that reduces, where every gradient of the chunk is final once."""
        reduces = last or self.data.reduces_every_micro_step
        with self.data.micro_step(last, pipelined=True):
            loss = self.pipeline.forward_backward(xs, ys, weight=share, low_dtype=low_dtype, loss_scale=loss_scale,
                                                  around_last_backward=self.data.hook_window() if reduces else None)
        st, t = self.pipeline.stats, self._pipeline_totals
        for key in ("busy_s", "span_s"):
            t[key] = t.get(key, 0.0) + st[key]
        t["peak_activation_bytes"] = max(t.get("peak_activation_bytes", 0.0), st["peak_activation_bytes"])
        return loss

    def reduce_loss(self, local: float) -> float:
        """The weighted micro-batch losses summed over the ranks that see different data."""
        return reduce_sum(local, self.data.group) if self.data.group is not None else local

    def evaluate(self, batches, low_dtype=None) -> float:
        """Mean loss over ``batches`` (each split over the mesh like a training batch)."""
        total = 0.0
        with no_grad(), ops.autocast(low_dtype), self.data.evaluating():
            for x, y in batches:
                for xs, ys, share, _ in self.micro_batches(x, y, 1):
                    if self.pipeline is not None:
                        loss = self.pipeline.evaluate(xs, ys, low_dtype)
                    else:
                        loss = float(host_read(self.model(xs, ys).data, "validation loss"))
                    total += share * loss
        return self.reduce_loss(total) / len(batches)

    # -- the update -------------------------------------------------------------------------------
    def found_inf(self, scaler) -> bool:
        """Unscale this rank's gradients; True on every rank if any rank saw an inf/NaN."""
        found = scaler.unscale_(self.data.grad_holders)
        return any_rank(found, self.world) if self.world is not None else found

    def clip_grad_norm(self, max_norm: float) -> float:
        """Clip every gradient by the norm of the whole model's gradient; return that norm.

        Each rank adds the squares of the gradients it is the one to count -- its tp slices,
        a tp-replicated gradient on tp rank 0 only, a data-parallel replica's gradients on
        one replica only (ZeRO's shards on every rank: they are disjoint), an expert's on
        one rank of the edp group that holds it, the tied embedding on the first stage
        only -- and one sum over the world gives the norm."""
        sq = total_sum_of_squares(g for p, g in self.data.norm_segments() if self._counted(p))  # one sync
        if self.world is not None:
            sq = reduce_sum(sq, self.world)
        total = math.sqrt(sq)
        if math.isfinite(total):
            scale_grads(self.data.grad_holders, clip_coefficient(total, max_norm))
        return total

    def _counted(self, p) -> bool:
        if (not self.first_tp) if p.sharding is None else p.sharding.copy:
            return False  # a tp-replicated parameter, or a key/value head another rank also holds
        return not (p is self.tied and not self.pipeline.is_first)

    def step(self):
        self.data.step()

    def zero_grad(self):
        self.data.zero_grad()

    def parameters(self) -> dict:
        """``{name: array}`` of every parameter this rank holds (its tensor-parallel slices of
        its pipeline stage), whole even under ZeRO-3 (gathered from the shards)."""
        self._updated()
        return self.data.parameters()

    def _updated(self):
        """Wait for the last update: an offloaded one may still be writing (optim/offload.py)."""
        if self.optimizer is not None:
            self.optimizer.wait()

    # -- checkpoints (minidist/state/checkpoint.py) ----------------------------------------------------
    def owned_state(self):
        """``(parameter, "param" or an optimizer state name, flat slice or None, array)`` of
        everything this rank is the one to save: its data-parallel part's (one replica writes
        what replicas share; ZeRO ranks their shards), a tp-replicated parameter by tp rank 0,
        the tied embedding by the first stage."""
        self._updated()
        for item in self.data.owned_state():
            if self._counted(item[0]):  # as for the norm: tp-replicated ones from tp rank 0 only
                yield item

    def load_state(self, reader):
        """This rank's parameters and optimizer state from a checkpoint ``reader`` (any mesh)."""
        self.data.load_state(reader)
        if self.optimizer is not None:
            self.optimizer.reloaded()  # an offloaded optimizer moves the loaded state to the host

    def checkpoint_scalars(self) -> dict:
        return self.data.checkpoint_scalars()

    def mesh_sizes(self) -> dict:
        return self.mesh.shape if self.mesh is not None else {"dp": 1, "pp": 1, "cp": 1, "tp": 1}

    # -- reports ----------------------------------------------------------------------------------
    def memory_bytes(self) -> dict:
        return self.data.memory_bytes()

    @property
    def comm_wait_s(self) -> float:
        """Time the last step waited for gradient communication not hidden by backward."""
        return self.data.comm_wait_s

    def metrics(self) -> dict:
        """The last step's pipeline figures ({} without a pipeline): measured bubble (idle share
        of the passes, mean over stages) beside the formula, and each stage's peak activation
        memory.  A gather over the pp group, so every rank calls it."""
        if self.pipeline is None:
            return {}
        t, self._pipeline_totals = self._pipeline_totals, {}
        rows = self.pipeline.gather_rows([t.get("busy_s", 0.0), t.get("span_s", 0.0),
                                          t.get("peak_activation_bytes", 0.0)])
        if rows is None:
            return {}
        bubbles = [1.0 - b / s if s > 0 else 0.0 for b, s, _ in rows]
        return {"bubble": sum(bubbles) / len(bubbles), "bubble_theory": self.pipeline.stats["bubble_theory"],
                "stage_bubble": bubbles, "peak_activation_mb": [p / 2**20 for _, _, p in rows]}


def describe(mesh, data, context, pipeline) -> str:
    """The run in words, e.g. ``dp=2 x pp=2 x tp=2: ZeRO-1 over 2 ranks, pipeline 1f1b (M=4)``."""
    if mesh is None:
        return "single process"
    parts = [data.name]
    if context is not None:
        parts.append(f"{context.impl} context parallelism over {context.group.size} ranks")
    if pipeline is not None:
        parts.append(f"pipeline {pipeline.schedule.name} over {pipeline.P} stages (M={pipeline.M}"
                     + (f", V={pipeline.V})" if pipeline.V > 1 else ")"))
    if mesh.size("tp") > 1:
        parts.append(f"tensor parallel over {mesh.size('tp')} ranks")
    shape = " x ".join(f"{a}={n}" for a, n in mesh.shape.items() if n > 1) or "one rank"
    return f"{shape}: " + ", ".join(parts)
