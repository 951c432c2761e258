"""Data parallelism with expert parallelism: two parts, each reducing its parameters over its group.

With expert parallelism (parallel/expert/) the ranks of the data-parallel group no longer
hold the same parameters: the dense ones (attention, norms, routers, embeddings) are the same
on every rank of ``("dp", "cp")``, but each rank holds only its ep group's share of the
experts, and the ranks holding the same experts are the *edp* group (the ranks at the same
place in every ep group).  Megatron Core and torchtitan carve the experts out of data
parallelism this way: the dense gradients are reduced over the data-parallel group and the
experts' over the edp group, each by its own DDP (and distributed optimizer).

:class:`DenseAndExperts` does the same with two ordinary data-parallel parts of the run's
flavour -- DDP's buckets, or ZeRO-1/2 sharding the optimizer state (and gradients) of each
set over its own group -- given their parameter sets, and presents them to the Strategy as
one part (the protocol of replica.py).  Two parts rather than one part with two groups
inside: every flavour already knows how to reduce, shard, count in the norm and checkpoint
one parameter set over one group, so nothing in them changes but the set they are given.

* The two optimizers have the same rule and settings; the loop sets the learning rate on
  the dense one (``optimizer``) and :meth:`step` hands it to the experts' one.
* The norm: each part counts its gradients on the ranks its flavour says (DDP: the group's
  first rank; ZeRO-2: every rank's disjoint shards), so every expert's gradient is counted
  once, by the first rank of its edp group.
* Checkpoints: each part writes what it owns (an expert by the first rank of its edp group,
  or ZeRO's shards), under the expert's global name and shape, so any ep size reads it back.
"""

from __future__ import annotations

import contextlib
import itertools


class DenseAndExperts:
    """The data-parallel part ``dense`` (the dense parameters over the data-parallel group)
    beside ``experts`` (this rank's experts over the edp group), as one part."""

    def __init__(self, dense, experts):
        self.dense, self.experts = dense, experts
        self.parts = (dense, experts)
        self.model, self.optimizer, self.group = dense.model, dense.optimizer, dense.group
        self.params = dense.params + experts.params
        self.counts_in_norm = True  # each part decides for its own gradients: norm_segments
        self.reduces_every_micro_step = dense.reduces_every_micro_step or experts.reduces_every_micro_step
        self.name = f"{dense.name}; experts: {experts.name} (edp)"

    # -- the loop's protocol (replica.py) --------------------------------------------------------
    @property
    def before_reduce(self):
        return self.dense.before_reduce

    @before_reduce.setter
    def before_reduce(self, fn):  # a pipeline's tied embedding: a dense parameter
        self.dense.before_reduce = fn

    def hold(self, param):
        self.dense.hold(param)

    def hook_window(self):
        windows = [w for w in (part.hook_window() for part in self.parts) if w is not None]
        if not windows:
            return None

        @contextlib.contextmanager
        def window():
            with contextlib.ExitStack() as stack:
                for w in windows:
                    stack.enter_context(w())
                yield
        return window

    @contextlib.contextmanager
    def micro_step(self, last: bool, pipelined: bool = False):
        """Both parts' micro-steps around one forward and backward: on leaving, the experts'
        reductions finish first, then the dense ones (the same order on every rank)."""
        with self.dense.micro_step(last, pipelined), self.experts.micro_step(last, pipelined):
            yield

    @contextlib.contextmanager
    def evaluating(self):
        with self.dense.evaluating(), self.experts.evaluating():
            yield

    @property
    def grad_holders(self):
        return list(self.dense.grad_holders) + list(self.experts.grad_holders)

    def grad_segments(self):
        return itertools.chain(self.dense.grad_segments(), self.experts.grad_segments())

    def norm_segments(self):
        return itertools.chain(self.dense.norm_segments(), self.experts.norm_segments())

    def step(self):
        self.experts.optimizer.lr = self.optimizer.lr  # the loop set the schedule's value on the dense one
        self.dense.step()
        self.experts.step()

    def zero_grad(self):
        self.dense.zero_grad()
        self.experts.zero_grad()

    def parameters(self) -> dict:
        return {**self.dense.parameters(), **self.experts.parameters()}

    def memory_bytes(self) -> dict:
        a, b = self.dense.memory_bytes(), self.experts.memory_bytes()
        return {k: a[k] + b[k] for k in a}

    @property
    def comm_wait_s(self) -> float:
        return self.dense.comm_wait_s + self.experts.comm_wait_s

    # -- checkpoints -----------------------------------------------------------------------------
    def owned_state(self):
        yield from self.dense.owned_state()
        yield from self.experts.owned_state()

    def load_state(self, reader):
        self.dense.load_state(reader)
        self.experts.load_state(reader)

    def checkpoint_scalars(self) -> dict:
        """The dense part's scalars; the experts' per-parameter step counts (OneReplica's
        ``param_steps``) added to the dense ones'.  Both optimizers take the same steps."""
        out, theirs = dict(self.dense.checkpoint_scalars()), self.experts.checkpoint_scalars()
        if "param_steps" in theirs:
            out["param_steps"] = {**out.get("param_steps", {}), **theirs["param_steps"]}
        return out
