"""One pipeline runtime: execute any schedule (``schedules.py``) for this rank's stage(s).

Each rank of the pipeline group holds ``V`` chunks of consecutive blocks (model stage
``c*P + rank`` for chunk ``c``, or ZB-V's V shape, where chunk 1 holds stage ``2P-1-rank``:
``schedules.model_stage``; ``V = 1`` except for the looped schedules and ZB-V); the first
model stage also runs the embedding, the last one the final LayerNorm, the head and the
loss.  The runtime walks this rank's list of actions:

* ``F m c``: run chunk ``c`` on microbatch ``m`` (from the token ids on the first stage,
  else from the activation received) and keep its graph for the backward;
* ``B m c``: backpropagate from the loss (last stage) or from the received gradient of the
  chunk's output (``Tensor.backward(grad)``), leaving the gradient of the chunk's input;
  in the zero-bubble schedules only that (``autograd.deferred_weight_grads``), keeping the
  weights' gradients for
* ``W m c``: compute the weights' gradients that B m c deferred (into ``.grad``; their hooks
  fire here);
* ``send_*``: a nonblocking send (``comm.isend``) of that output / input gradient, posted as
  soon as the tensor exists; completed at the end of the step;
* ``recv_*``: receives are posted (``comm.irecv``) one compute action ahead, so the message
  can arrive while this rank still computes, and waited for only when the data is needed.

A mixture of experts on any stage adds its auxiliary losses to the microbatch's loss (GShard,
Switch): the last stage's loss adds those of its own chunk (``GPT.loss``), every other
chunk keeps their values for the reported loss (summed over the pipeline group) and, before
its B, gives its mixtures the loss's weight as their gradient (``moe.feed_aux_grad``): each
stage backpropagates its own auxiliary losses through the outputs that carry them.

The loss of microbatch ``m`` is weighted by its share of the batch's rows before backward,
so the accumulated gradient is the gradient of the batch's mean loss, exactly as in the
single-process run (gradient accumulation: GPipe, Huang et al. 2019).  With tied embeddings
the token embedding ``wte`` is used by the first stage (embedding) and the last (head): both
ranks hold a copy, and :meth:`PipelineRuntime.reduce_tied_gradients` sums the two partial
gradients between them (Megatron-LM's embedding group), so both copies take the same update.
ZB-V puts the first and the last stage on rank 0: one copy, whose gradient adds both uses
as in the serial model, and nothing to exchange.

Every rank builds the whole GPT from the seed (weights are drawn per name in their global
shape, so they equal the serial model's) and then drops what it does not run: its memory
holds only its own stage's parameters.

Accounting per step: ``busy_s`` (time in F and B), ``span_s`` (the step's schedule, between
two barriers of the pipeline group so that every rank measures the same interval), the
measured bubble ``1 - busy_s / span_s`` beside :func:`schedules.theoretical_bubble`, the
peak of activation bytes held for pending backwards (the arrays of the tensors each pending
microbatch's graph keeps) and the measured ``timeline`` of F and B (``simulate.measured_chart``).
"""

from __future__ import annotations

import contextlib
import time

from minidist import comm
from minidist.model import moe, ops
from minidist.model.autograd import Parameter, Tensor, deferred_weight_grads, no_grad
from minidist.model.backend import dtype as backend_dtype, host, host_read, xp
from minidist.layout.split import shard
from minidist.layout.schedules import (BACKWARD, FORWARD, WEIGHT, Action, RECV_ACT, RECV_GRAD, SEND_ACT, SEND_GRAD,
                                       layer_range, make_schedule, message_tag, rank_stages,
                                       schedule_problem, splits_backward, stage_location, theoretical_bubble)


def graph_activation_bytes(out: Tensor) -> int:
    """Bytes of the arrays that ``out``'s autograd graph keeps alive: every tensor reachable
    through the recorded ops, parameters excluded (what a pending backward holds)."""
    seen, stack, total = set(), [out], 0
    while stack:
        t = stack.pop()
        if id(t) in seen:
            continue
        seen.add(id(t))
        if not isinstance(t, Parameter):
            total += int(t.data.nbytes)
        if t._ctx is not None:
            stack.extend(p for p in t._ctx[0] if isinstance(p, Tensor))
    return total


class PipelineRuntime:
    """This rank's part of a pipeline-parallel GPT over ``group`` (the mesh's pp group).

    ``model`` is a full :class:`~minidist.model.nn.GPT` built from the seed; the runtime keeps
    only this rank's pieces (``model.parameters()`` is then this rank's parameter list).
    """

    def __init__(self, model, group, schedule: str = "1f1b", num_microbatches: int = 1,
                 virtual_stages: int = 1):
        P, L = group.size, model.config.layers
        problem = schedule_problem(schedule, P, num_microbatches, virtual_stages, L)
        if problem:
            raise ValueError(problem)
        self.model, self.group = model, group
        self.rank, self.P, self.V, self.M = group.rank, P, virtual_stages, num_microbatches
        self.S = P * virtual_stages
        self.schedule = make_schedule(schedule, P, num_microbatches, virtual_stages)
        self.actions = self.schedule.actions[self.rank]
        self.placement = self.schedule.placement
        self.stages = rank_stages(self.rank, P, self.V, self.placement)
        self.blocks = [[model.h[i] for i in layer_range(s, L, self.S)] for s in self.stages]
        self.is_first, self.is_last = 0 in self.stages, self.S - 1 in self.stages
        self.last_rank = self._holder(self.S - 1)  # the loss's rank: P-1, or 0 with the V shape
        self.tied = model.lm_head is None
        self.split = splits_backward(schedule)
        # each chunk's last B and last W (the last one wins): its gradients are final there
        self._last = {(a.op, a.chunk): a.microbatch for a in self.actions if a.op in (BACKWARD, WEIGHT)}
        self._keep_only_this_stage()
        self.stats = {}

    def _keep_only_this_stage(self):
        mine = {i for s in self.stages for i in layer_range(s, self.model.config.layers, self.S)}
        self.model.keep_stage(mine, embedding=self.is_first, token_embedding=self.is_first or (self.is_last and self.tied),
                              head=self.is_last)

    # ------------------------------------------------------------------------ one step
    def forward_backward(self, x, y, weight: float = 1.0, low_dtype=None, loss_scale: float = 1.0,
                         around_last_backward=None) -> float:
        """Run the schedule on the batch ``(x, y)`` (host int arrays (B, T), the same on every
        rank), accumulating into ``.grad`` the gradient of ``weight`` x the batch's mean loss
        (times ``loss_scale``).  Returns the batch's mean loss (on every rank of the group).

        ``around_last_backward``: a context-manager factory; each chunk's LAST backward (after
        which its parameters' gradients are complete) runs inside it (zero-bubble schedules:
        the last B, for the gradients it does not defer, and the last W).  Data parallelism opens
        its gradient hooks there, so the reduction of a chunk's gradients overlaps the rest of
        the schedule instead of waiting for its end."""
        self._begin_step(x, y, weight, low_dtype, loss_scale, around_last_backward)
        if self.P > 1:
            comm.barrier(self.group)  # every rank starts the clock together
        t0 = time.perf_counter()
        busy, wait = self._run_actions(t0)
        for request in self._sends:
            request.wait()
        if self.P > 1:
            comm.barrier(self.group)  # ... and stops it when the last rank is done
        span = time.perf_counter() - t0
        self.stats = {"busy_s": busy, "recv_wait_s": wait, "span_s": span,
                      "bubble": 1.0 - busy / span if span > 0 else 0.0,
                      "bubble_theory": theoretical_bubble(self.schedule.name, self.P, self.M, self.V),
                      "peak_activation_bytes": self._peak, "peak_in_flight": self._peak_in_flight}
        return self._mean_loss()

    def _begin_step(self, x, y, weight, low_dtype, loss_scale, around_last_backward):
        """Cut the batch into microbatches and reset the step's mailboxes and counters."""
        rows = len(x)
        if rows < self.M:
            raise ValueError(f"a batch of {rows} sequences cannot be split into {self.M} microbatches")
        self._x = [shard(x, m, self.M) for m in range(self.M)]
        self._y = [shard(y, m, self.M) for m in range(self.M)]
        self._share = [len(xm) / rows * weight for xm in self._x]
        self._low, self._scale, self._around_last = low_dtype, loss_scale, around_last_backward
        self._inbox, self._outbox, self._saved, self._posted = {}, {}, {}, {}
        self._losses, self._sends, self._weight_work, self._aux = {}, [], {}, []
        self._live = self._peak = self._in_flight = self._peak_in_flight = 0

    def _run_actions(self, t0: float):
        """Execute this rank's actions in order; return (seconds computing, seconds waiting
        in receives) and keep the measured ``timeline`` [(start_s, end_s, Action)] of F, B, W."""
        busy = wait = 0.0
        self.timeline = []
        for i, a in enumerate(self.actions):
            if a.op in (FORWARD, BACKWARD, WEIGHT):
                self._post_receives(i)
                start = time.perf_counter()
                {FORWARD: self._forward, BACKWARD: self._backward, WEIGHT: self._weights}[a.op](a.microbatch, a.chunk)
                end = time.perf_counter()
                busy += end - start
                self.timeline.append((start - t0, end - t0, a))
            elif a.op in (SEND_ACT, SEND_GRAD):
                self._send(a)
            else:
                start = time.perf_counter()
                self._receive(a)
                end = time.perf_counter()
                wait += end - start
        return busy, wait

    STAT_KEYS = ("busy_s", "recv_wait_s", "span_s", "bubble", "peak_activation_bytes", "peak_in_flight")

    def gather_stats(self, root: int = 0):
        """Every pipeline rank's :attr:`stats` of the last step, as a list on ``root`` (None
        elsewhere): one small gather over the pipeline group."""
        rows = self.gather_rows([float(self.stats[k]) for k in self.STAT_KEYS], root)
        return None if rows is None else [dict(zip(self.STAT_KEYS, r)) for r in rows]

    def gather_timelines(self, root: int = 0):
        """Every pipeline rank's measured :attr:`timeline` of the last step on ``root`` (None
        elsewhere); every rank runs the same number of compute actions (2*M*V, 3*M with W's)."""
        kinds = (FORWARD, BACKWARD, WEIGHT)
        rows = [[start, end, kinds.index(a.op), a.microbatch, a.chunk] for start, end, a in self.timeline]
        rows_h = host.asarray(rows, dtype=host.float64)  # host numbers: no device round trip
        gathered = comm.gather(rows_h, self.group, root=root) if self.P > 1 else rows_h
        if gathered is None:
            return None
        n = len(rows)
        return [[(float(s), float(e), Action(kinds[int(k)], int(m), int(c)))
                 for s, e, k, m, c in gathered[r * n:(r + 1) * n]] for r in range(self.P)]

    def gather_rows(self, values, root: int = 0):
        """Every pipeline rank's list of floats ``values`` (same length), as a list of lists on
        ``root``, None elsewhere."""
        row = host.asarray([values], dtype=host.float64)  # host numbers: no device round trip
        rows = comm.gather(row, self.group, root=root) if self.P > 1 else row
        return None if rows is None else [[float(v) for v in r] for r in rows]

    def _mean_loss(self) -> float:
        """The batch's mean loss (sum of the weighted microbatch losses), from the last stage."""
        total = host.zeros(1)  # the stages before the last have no loss: 0, for the broadcast
        if self._losses:  # added on the device in microbatch order, read once per pass
            on_device = xp.zeros(1, dtype=xp.float64)
            for loss in self._losses.values():
                on_device += loss
            total = host_read(on_device, "loss")
        return self._gather_loss(total, self._aux)

    def _gather_loss(self, total, aux):
        """The loss on every rank of the group: the last stage's ``total`` (a host array (1,)),
        plus the other chunks' auxiliary losses ``aux`` (device scalars) where the model has
        mixtures (a sum over the group; else a broadcast from the last stage)."""
        if self.model.config.experts:
            if aux:
                total = total + host_read(sum(aux[1:], aux[0]).reshape(1), "loss")
            return float(comm.all_reduce(total, self.group)[0]) if self.P > 1 else float(total[0])
        if self.P > 1:
            total = comm.broadcast(total, self.group, root=self.last_rank)
        return float(total[0])

    # ---------------------------------------------------------------- the compute actions
    def _forward(self, m: int, c: int):
        s = self.stages[c]
        with ops.autocast(self._low):
            if s == 0:
                x_in, h = None, self.model.embed(self._x[m])
            else:
                x_in = h = Tensor(self._inbox.pop(("act", m, s)), requires_grad=True)
            out = self.model.run_blocks(h, self.blocks[c])
            if s == self.S - 1:  # the loss adds this chunk's auxiliary losses
                loss = self.model.loss(self.model.head(out), self._y[m], self.blocks[c])
                self._losses[m] = loss.data.astype(xp.float64) * self._share[m]  # stays on the device
                out = loss * (self._share[m] * self._scale)
            elif (aux := moe.aux_loss_value(self.blocks[c])) is not None:
                self._aux.append(aux * self._share[m])
        held = graph_activation_bytes(out)
        self._saved[(m, c)] = (x_in, out, held)
        self._live += held
        self._in_flight += 1
        self._peak, self._peak_in_flight = max(self._peak, self._live), max(self._peak_in_flight, self._in_flight)
        if s < self.S - 1:
            self._hand_over(("act", m, s + 1), out.data)

    def _backward(self, m: int, c: int):
        s = self.stages[c]
        x_in, out, held = self._saved.pop((m, c))
        grad = None if s == self.S - 1 else self._inbox.pop(("grad", m, s))
        if grad is not None:  # the loss is not here: its weight is the auxiliary losses' gradient
            moe.feed_aux_grad(self.blocks[c], self._share[m] * self._scale)
        with self._window(BACKWARD, m, c):
            if self.split:  # B only: the weights' gradients wait for W m c
                with deferred_weight_grads() as work:
                    out.backward(grad)
                self._weight_work[(m, c)] = (work, held)
            else:
                out.backward(grad)
        if not self.split:
            self._release(held)
        if s > 0:
            self._hand_over(("grad", m, s - 1), x_in.grad)

    def _weights(self, m: int, c: int):
        """W m c: the weights' gradients that B m c deferred, into ``.grad`` (hooks fire here)."""
        work, held = self._weight_work.pop((m, c))
        with self._window(WEIGHT, m, c):
            work.run()
        self._release(held)  # W held the saved inputs until now

    def _release(self, held: int):
        self._live -= held
        self._in_flight -= 1

    def _window(self, op: str, m: int, c: int):
        """The data-parallel hook window around chunk c's last B / W of the pass, else nothing."""
        if self._around_last is not None and self._last.get((op, c)) == m:
            return self._around_last()
        return contextlib.nullcontext()

    def _hand_over(self, key, array):
        """Give a tensor to stage ``key[2]``: directly if it lives on this rank, else leave it
        for the send action that follows in the schedule."""
        if self._holder(key[2]) == self.rank:
            self._inbox[key] = array
        else:
            self._outbox[key] = array

    def _holder(self, stage: int) -> int:
        """The pipeline rank that holds model ``stage`` (this schedule's placement)."""
        return stage_location(stage, self.P, self.placement)[0]

    # ------------------------------------------------------------------- the messages
    def _key(self, a):
        s = self.stages[a.chunk]
        return {SEND_ACT: ("act", a.microbatch, s + 1), RECV_ACT: ("act", a.microbatch, s),
                SEND_GRAD: ("grad", a.microbatch, s - 1), RECV_GRAD: ("grad", a.microbatch, s)}[a.op]

    def _tag(self, key) -> int:
        return message_tag(key[0], key[1], key[2], self.S, self.M)

    def _send(self, a):
        key = self._key(a)
        self._sends = [r for r in self._sends if not r.is_completed()]  # release sent buffers
        self._sends.append(comm.isend(self._outbox.pop(key), a.peer, self.group, tag=self._tag(key)))

    def _post(self, a):
        key = self._key(a)
        if key not in self._posted:
            shape = self._activation_shape(self._x[a.microbatch])
            dtype = self._low if self._low is not None else self._param_dtype()
            self._posted[key] = comm.irecv(xp.empty(shape, dtype), a.peer, self.group, tag=self._tag(key))

    def _post_receives(self, i: int):
        """Post the receives the NEXT compute action after action ``i`` needs."""
        for a in self.actions[i + 1:]:
            if a.op in (RECV_ACT, RECV_GRAD):
                self._post(a)
            elif a.op in (FORWARD, BACKWARD, WEIGHT):
                return

    def _receive(self, a):
        self._post(a)
        key = self._key(a)
        self._inbox[key] = self._posted.pop(key).wait()

    def _activation_shape(self, x):
        """The shape of the activation between two stages for token ids ``x`` (rows, tokens):
        sequence parallelism gives each tensor-parallel rank its part of the tokens."""
        return (len(x), self.model.layers.local_tokens(x.shape[1]), self.model.config.d_model)

    def _param_dtype(self):
        return backend_dtype(self.model.config.dtype)  # from the config: ZeRO-3 frees the parameters' arrays

    # ----------------------------------------------------------------- after the step
    def reduce_tied_gradients(self):
        """Sum the tied embedding's two partial gradients between the first and last stage.

        The first stage's ``wte.grad`` comes from the embedding lookup, the last stage's from
        the head; their sum is the serial model's gradient, and both ranks end with it (a + b
        equals b + a exactly, so the two copies stay bit-identical).  The strategy runs this
        before the data-parallel reduction, on the full local gradients (parallel/strategy.py).
        Nothing to do where one rank holds both ends (one rank; ZB-V's rank 0)."""
        w = self.tied_weight()
        if w is None:
            return
        if w.grad is None:
            w.grad = xp.zeros_like(w.data)
        peer = self.last_rank if self.is_first else 0
        w.grad += comm.sendrecv(w.grad, peer, peer, self.group, tag=TIED_TAG)

    def tied_weight(self):
        """The tied embedding weight when this rank holds one of its two copies (the first
        stage's lookup table, the last stage's head), else None (also where one rank holds
        both ends, so there is a single copy)."""
        if not self.tied or self.is_first == self.is_last:
            return None
        return self.model.wte.weight

    def held_weights(self) -> list:
        """Parameters whose gradient is not final inside any chunk's last-backward window, so
        data parallelism must reduce them only after the pass: the tied embedding wherever a
        pipeline rank holds it (a copy whose two parts are added after the pass, or ZB-V's
        rank 0, where the head's chunk finishes before the embedding's chunk adds its part)."""
        if not self.tied or self.P == 1 or not (self.is_first or self.is_last):
            return []
        return [self.model.wte.weight]

    # ------------------------------------------------------------------- evaluation
    def evaluate(self, x, y, low_dtype=None) -> float:
        """The mean loss of ``(x, y)`` without gradients: the whole batch goes through the
        stages in order (no microbatches), with blocking messages."""
        h, loss, aux = None, 0.0, []
        with no_grad(), ops.autocast(low_dtype):
            for c, s in enumerate(self.stages):
                if s == 0:
                    h = self.model.embed(x)
                else:
                    prev = self._holder(s - 1)
                    if prev != self.rank:
                        dtype = low_dtype if low_dtype is not None else self._param_dtype()
                        h = Tensor(comm.recv(self._activation_shape(x), dtype, prev, self.group, tag=EVAL_TAG))
                h = self.model.run_blocks(h, self.blocks[c])
                if s == self.S - 1:
                    loss = float(host_read(self.model.loss(self.model.head(h), y, self.blocks[c]).data,
                                           "validation loss"))
                else:
                    if (value := moe.aux_loss_value(self.blocks[c])) is not None:
                        aux.append(value)
                    if self._holder(s + 1) != self.rank:
                        comm.send(h.data, self._holder(s + 1), self.group, tag=EVAL_TAG)
        return self._gather_loss(host.asarray([loss if self.is_last else 0.0], dtype=host.float64), aux)


TIED_TAG = 29998  # above every schedule's message tags (schedules.TAG_LIMIT), below comm's reserved range
EVAL_TAG = 29999
