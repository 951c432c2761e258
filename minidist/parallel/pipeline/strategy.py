"""The pipeline as a training-loop strategy, composed with data parallelism.

Ranks form a ``dp x pp`` mesh.  Each rank runs one pipeline stage (:class:`PipelineRuntime`
over ``mesh.group("pp")``) and wraps that stage's parameters in the data-parallel strategy
of ``mesh.group("dp")`` (one process, DDP or ZeRO-1; parallel/strategy.py): the ranks holding
the same stage in different replicas reduce that stage's gradients among themselves.

One step, in order:

1. each data-parallel rank takes its rows of the global batch, in ``--grad-accum`` parts;
   each part runs through the pipeline schedule, every microbatch's loss weighted by its
   share of the GLOBAL batch's rows;
2. the data-parallel gradient reduction runs once per step: a pipeline pass is several
   backward passes (one per microbatch) and a gradient hook fires at the end of each, so the
   hooks are shut except around each chunk's LAST backward of the step's last pass, where
   every gradient of the chunk becomes final exactly once; those buckets' reductions then
   overlap the rest of the schedule, the others start at its end;
3. the tied embedding's two partial gradients (each already summed over the replicas) are
   summed between the first and last stage, in place;
4. overflow checks and the gradient norm are combined over both axes (the tied embedding
   counted once), then every rank updates its own stage.
"""

from __future__ import annotations

import contextlib
import math

from minidist.optim.clip import clip_coefficient, scale_grads


class PipelineParallel:
    """The training loop's interface for ``runtime`` (this rank's stage) over ``inner``, the
    data-parallel strategy of this stage's parameters."""

    def __init__(self, runtime, inner):
        self.runtime, self.inner = runtime, inner
        r = runtime
        self.name = (f"pipeline {r.schedule.name} over {r.P} stages (M={r.M}"
                     + (f", V={r.V}" if r.V > 1 else "") + ")"
                     + ("" if getattr(inner, "size", 1) == 1 else f" x {inner.name}"))
        self.optimizer, self.model, self.params = inner.optimizer, inner.model, inner.params
        self._totals = {}

    # -- forward and backward -------------------------------------------------------------------
    def _reducer(self):
        """The data-parallel strategy's bucketed gradient reducer (None for one replica)."""
        for holder in ("ddp", "zero"):
            obj = getattr(self.inner, holder, None)
            if obj is not None and getattr(obj, "reducer", None) is not None:
                return obj.reducer
        return None

    def forward_backward(self, x, y, grad_accum: int = 1, low_dtype=None, loss_scale: float = 1.0) -> float:
        """Accumulate the global batch's gradient on this stage; return the global mean loss."""
        reducer = self._reducer()
        if reducer is not None:
            reducer.active = False  # the hooks stay shut but inside the last backward windows
            reducer.reset_timeline()
        totals = {"busy_s": 0.0, "span_s": 0.0, "peak_activation_bytes": 0.0}
        local = 0.0
        try:
            for xs, ys, share, last in self.inner.micro_batches(x, y, grad_accum):
                window = self._hooks_open(reducer) if last and reducer is not None else None
                local += self.runtime.forward_backward(xs, ys, weight=share, low_dtype=low_dtype,
                                                       loss_scale=loss_scale, around_last_backward=window)
                st = self.runtime.stats
                totals["busy_s"] += st["busy_s"]
                totals["span_s"] += st["span_s"]
                totals["peak_activation_bytes"] = max(totals["peak_activation_bytes"], st["peak_activation_bytes"])
        finally:
            if reducer is not None:
                reducer.active = True
        if reducer is not None:
            reducer.finish()  # launches what the windows did not, waits for every bucket
        self.runtime.reduce_tied_gradients()
        self._totals = totals
        return self.inner.reduce_loss(local)

    @staticmethod
    def _hooks_open(reducer):
        """A context-manager factory opening ``reducer``'s hooks: around each chunk's last
        backward, where every gradient of the chunk becomes final exactly once, so its buckets'
        reductions start while the rest of the schedule runs (DDP's overlap, per chunk)."""
        @contextlib.contextmanager
        def window():
            reducer.active = True
            try:
                yield
            finally:
                reducer.active = False
        return window

    def evaluate(self, batches, low_dtype=None) -> float:
        """Mean loss over ``batches``: each replica its rows, through the stages without grads."""
        total = 0.0
        with self.inner.evaluating():
            for x, y in batches:
                for xs, ys, share, _ in self.inner.micro_batches(x, y, 1):
                    total += share * self.runtime.evaluate(xs, ys, low_dtype)
        return self.inner.reduce_loss(total) / len(batches)

    # -- the update -----------------------------------------------------------------------------
    def found_inf(self, scaler) -> bool:
        """Unscale; True on every rank if any rank of either axis overflowed."""
        return self.runtime.any_true(self.inner.found_inf(scaler))

    def clip_grad_norm(self, max_norm: float) -> float:
        """Clip by the norm of the whole model's gradient: every stage's, the tied embedding
        counted once.  (The data-parallel strategies composed here, DDP and ZeRO-1, hold
        full, already reduced gradients: no sum over the replicas is needed.)"""
        holders = self.inner.grad_holders
        total = math.sqrt(self.runtime.grad_norm_sq(holders))
        if math.isfinite(total):
            scale_grads(holders, clip_coefficient(total, max_norm))
        return total

    def step(self):
        self.inner.step()

    def zero_grad(self):
        self.inner.zero_grad()

    # -- reports --------------------------------------------------------------------------------
    def micro_batches(self, x, y, grad_accum: int):
        return self.inner.micro_batches(x, y, grad_accum)

    def reduce_loss(self, local: float) -> float:
        return self.inner.reduce_loss(local)

    @contextlib.contextmanager
    def evaluating(self):
        with self.inner.evaluating():
            yield

    @property
    def grad_holders(self):
        return self.inner.grad_holders

    norm_group = None

    def memory_bytes(self) -> dict:
        return self.inner.memory_bytes()

    @property
    def comm_wait_s(self) -> float:
        return self.inner.comm_wait_s

    def metrics(self) -> dict:
        """The last step's pipeline figures, on the first stage (empty elsewhere): measured
        bubble (idle share of the pipeline passes, mean over stages) beside the formula, and
        the largest peak of activation memory held by a stage.  A gather over the pp group."""
        t = self._totals
        busy, span, peak = t.get("busy_s", 0.0), t.get("span_s", 0.0), t.get("peak_activation_bytes", 0.0)
        rows = self.runtime.gather_rows([busy, span, peak])
        if rows is None:
            return {}
        bubbles = [1.0 - b / s if s > 0 else 0.0 for b, s, _ in rows]
        r = self.runtime
        return {"bubble": sum(bubbles) / len(bubbles), "bubble_theory": r.stats["bubble_theory"],
                "stage_bubble": bubbles, "peak_activation_mb": [p / 2**20 for _, _, p in rows]}
