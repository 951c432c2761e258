"""One data-parallel replica, and the protocol every data-parallel class follows.

The loop's :class:`~minidist.parallel.strategy.Strategy` holds one *data-parallel part*; the
ranks of its ``("dp", "cp")`` group hold the same parameters (the same tensor-parallel slices
of the same pipeline stage) and see different tokens, so their gradients are summed.  Every
way of doing that is a subclass of :class:`OneReplica` (the case with nothing to sum) that
overrides what it does differently, so the Strategy and the pipeline never ask which one
they have:

* :class:`OneReplica` (here): one replica, nothing to reduce;
* ``DistributedDataParallel`` (ddp.py): buckets all-reduced from the gradient hooks;
* ``ZeRO`` (zero.py): stages 1 and 2, the optimizer state and then the gradients sharded;
* ``FSDP`` (fsdp.py): stage 3, the parameters sharded too; HSDP.
"""

from __future__ import annotations

import contextlib

from minidist.model.backend import from_host


class OneReplica:
    """One data-parallel replica: the gradients are already the batch's; nothing to reduce.

    The protocol (the Strategy calls only these): ``micro_step(last, pipelined)`` around a
    micro-batch's forward and backward, ``hook_window()`` (the pipeline opens gradient hooks
    inside it), ``hold(param)`` (reduce that gradient only at the end: the tied embedding),
    ``before_reduce`` (run on the full gradients just before they are reduced),
    ``grad_holders`` / ``grad_segments()`` / ``norm_segments()`` (what to unscale, clip and
    count in the norm),
    ``step``, ``zero_grad``, ``evaluating``, ``parameters``, ``memory_bytes``,
    ``comm_wait_s``, and for checkpoints ``owned_state``, ``load_state``,
    ``checkpoint_scalars``.  ``optimizer`` may be None for forward and backward only.
    """

    reduces_every_micro_step = False  # ZeRO-2/3 reduce-scatter each micro-step (their gradient memory)

    def __init__(self, model, optimizer, group=None, params=None):
        self.model, self.optimizer, self.group = model, optimizer, group
        # ``params``: the ones this part reduces and updates (default: all of the model's);
        # expert parallelism gives the dense ones to one part, the experts to another (experts.py).
        self.params = [p for p in (model.parameters() if params is None else params) if p.requires_grad]
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

    def norm_segments(self):
        """The ``grad_segments()`` this rank counts in the global norm: all of them, or none
        where another rank of the group holds the same gradients (``counts_in_norm``)."""
        return self.grad_segments() if self.counts_in_norm else iter(())

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
