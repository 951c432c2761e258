"""Fault injection for the equivalence tests: bugs a parallel run could have, switched on by name.

A test that compares a parallel run with one process is only worth its tolerance if a broken
run fails it.  Each fault below breaks the parallel run the way a real bug would; the tests
run the equivalence bodies once with a fault (``--fault NAME``) and expect them to fail,
with the message of the check that must catch it.  Only tests use this: the library has no
switch for it, the fault patches the library's own functions for the length of the run.

* ``no-dp-reduce``: the gradients are never summed over the data-parallel group (each
  all-reduce or reduce-scatter of a gradient returns this rank's own contribution);
* ``negate-grads``: the optimizer steps along the negated gradient;
* ``grad-scale-2x``: the reduced gradients twice what they should be (a sum where a mean
  belongs), before clipping;
* ``skip-update``: the optimizer's step does nothing;
* ``no-loss-scale``: fp16's loss scale is never applied to the loss, but still divided out;
* ``alone``: every rank trains the whole model by itself (the body runs one process's
  configuration on each rank) -- the results are right, only the split is missing.
"""
from __future__ import annotations

import contextlib
import types

import numpy as np

NAMES = ("no-dp-reduce", "negate-grads", "grad-scale-2x", "skip-update", "no-loss-scale", "alone")

# The modules whose ``comm`` carries the data-parallel gradient reductions (DDP, ZeRO-1/2, FSDP).
_DATA_MODULES = ("minidist.parallel.data.ddp", "minidist.parallel.data.zero", "minidist.parallel.data.fsdp")


class _Done:
    """A finished async handle: ``wait()`` returns the value."""

    def __init__(self, value):
        self.value = value

    def wait(self):
        return self.value


def _unreduced_comm(real):
    """``comm`` whose all-reduce and reduce-scatter of arrays (not the one-number loss and
    flag reductions) return this rank's own contribution, as if nothing were summed."""
    def all_reduce(x, group, *args, async_op=False, **kwargs):
        if np.size(x) <= 1:
            return real.all_reduce(x, group, *args, async_op=async_op, **kwargs)
        out = x.copy()
        return _Done(out) if async_op else out

    def reduce_scatter(x, group, *args, async_op=False, **kwargs):
        lo, hi = split_bounds(len(x), group.size)[group.rank]  # comm.reduce_scatter's split
        out = x[lo:hi].copy()
        return _Done(out) if async_op else out

    from minidist.layout.split import split_bounds

    proxy = types.SimpleNamespace(**{k: getattr(real, k) for k in dir(real) if not k.startswith("__")})
    proxy.all_reduce, proxy.reduce_scatter = all_reduce, reduce_scatter
    return proxy


@contextlib.contextmanager
def inject(name: str | None):
    """Run the body of the ``with`` with fault ``name`` (None or "": none, "alone": none here,
    the body changes its configuration)."""
    if not name or name == "alone":
        yield
        return
    if name not in NAMES:
        raise ValueError(f"unknown fault {name!r}; known: {', '.join(NAMES)}")
    import importlib

    from minidist.model.optim import scale_grads
    from minidist.parallel.strategy import Strategy

    saved = []

    def patch(owner, attr, value):
        saved.append((owner, attr, getattr(owner, attr)))  # AttributeError: the seam moved, update this file
        setattr(owner, attr, value)

    forward_backward = Strategy.forward_backward
    if name == "no-dp-reduce":
        for module in map(importlib.import_module, _DATA_MODULES):
            patch(module, "comm", _unreduced_comm(module.comm))
    elif name in ("negate-grads", "grad-scale-2x"):
        factor = -1.0 if name == "negate-grads" else 2.0

        def scaled(self, *args, **kwargs):  # the reduced gradients, before clipping sees them
            loss = forward_backward(self, *args, **kwargs)
            scale_grads(self.data.grad_holders, factor)
            return loss
        patch(Strategy, "forward_backward", scaled)
    elif name == "skip-update":
        patch(Strategy, "step", lambda self: None)
    elif name == "no-loss-scale":
        def unscaled(self, x, y, grad_accum=1, low_dtype=None, loss_scale=1.0):
            return forward_backward(self, x, y, grad_accum, low_dtype, 1.0)
        patch(Strategy, "forward_backward", unscaled)
    try:
        yield
    finally:
        for owner, attr, value in reversed(saved):
            setattr(owner, attr, value)
