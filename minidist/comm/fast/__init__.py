"""The fast path: a repeated collective as a cached *plan*, run with as few Python steps as possible.

The textbook algorithms (:mod:`minidist.comm.algorithms`) are what a reader should study;
this wing only makes them cheaper to call again and again, and can be switched off:
``MINIDIST_FAST_PATH=0`` in the environment, or ``comm.set_fast_path(False)``, and every
call runs the plain algorithms (the way to study or debug them).

Why it exists: for a 4 KB all-reduce the bytes cross shared memory in about a microsecond;
what the caller waits for is Python.  The general path validates every argument, chooses an
algorithm, computes partners and block bounds, looks up scratch buffers and charges every
message to a label: some 50 Python function calls, several times the cost of MPI's own
built-in.  MPI libraries meet the same problem by caching schedules (persistent collectives
in MPI-4, NCCL's plans); minidist does the same:

* the public collective asks :func:`run` first, once per call: a plan cached on the group
  under (collective, its arguments, dtype, shape) runs the call, or None is returned and
  the general path runs;
* after a general-path call, :func:`remember` builds the plan for the algorithm that call
  chose (the table in :func:`_make`), when there is one: the partner of every round from the
  algorithm's own schedule, scratch buffers with their MPI descriptors already built, the
  exact byte counts for ``comm.stats()``, an ``MPI.Status`` to reuse;
* a plan sends exactly the general path's messages and makes the same additions in the
  same order, so results are bit-identical and ranks on either path still pair up.  It
  hands a call back (returns None) when something differs: an ``out=`` that does not fit,
  a non-contiguous input.

Plans run only synchronous calls on NumPy arrays with the check mode and the simulated link
off, in a dtype that is its own accumulator for reductions (not float16/bfloat16).

Modules: common.py (shared helpers), exchange.py (a round on MPI persistent requests),
allreduce.py, scatter.py, gather.py and directgather.py (the plans), and alltoallv.py: the
one collective whose calls rarely repeat a shape (its counts change every call), so its plan
is cached per dtype, made on the first call, and looked up by :func:`all_to_all_v`.  Measured gains:
docs/perf-notes.md.
"""

from __future__ import annotations

import weakref

import numpy as np

from minidist.host import env
from minidist.comm import check, links, reduction, watchdog
from minidist.comm.algorithms import evengather, pipelined
from minidist.comm.fast.allreduce import AllReducePlan, PairwiseAllReducePlan
from minidist.comm.fast.alltoallv import AllToAllVPlan
from minidist.comm.fast.common import PLAN_MAX_BYTES
from minidist.comm.fast.directgather import DirectGatherPlan
from minidist.comm.fast.gather import BruckGatherPlan, EvenGatherPlan, PairGatherPlan
from minidist.comm.fast.scatter import DirectScatterPlan, HalvingPlan, PairwisePlan, ReduceScatterPlan
from minidist.comm.group import Group
from minidist.comm.identity import TAG_COLLECTIVE, describe_tag

_enabled = env.get("MINIDIST_FAST_PATH")
_MAX_PLANS = 256  # per group; a training loop uses a handful of shapes, so this rarely fills
_groups: weakref.WeakSet = weakref.WeakSet()  # groups holding plans (set_fast_path(False) drops them)


def set_fast_path(enabled: bool = True) -> None:
    """Turn the cached plans on or off (on every rank alike: plans and the general path send
    the same messages, so a mismatch would still work, but the switch is meant to be global).
    Turning them off drops every plan (and frees its MPI requests)."""
    global _enabled
    _enabled = bool(enabled)
    if not _enabled:
        for g in list(_groups):
            drop(g)


def fast_path_enabled() -> bool:
    return _enabled


def run(g, x, out, async_op, call):
    """The result of this call from a cached plan, or None (then the general path runs it).
    ``call``: the collective's name and the arguments that pick its plan, e.g.
    ``("all_reduce", op, algorithm)``."""
    if not _enabled or type(x) is not np.ndarray or async_op or check._enabled or links.enabled or type(g) is not Group:
        return None
    try:
        plan = g._plans.get((call, x.dtype, x.shape))
    except TypeError:  # an unhashable argument (the general path will reject it)
        return None
    if plan is None:
        return None
    # The watchdog's note of this call (a new tuple each call: comm/watchdog.py).
    g.busy = (plan, x)
    try:
        return plan.run(g, x, out)
    finally:
        g.busy = None


def all_to_all_v(g, x, counts, async_op):
    """The result of ``comm.all_to_all_v(x, counts, g)`` from the group's plan for x's dtype
    (made here on the first call: its counts change every call, so :func:`run`'s key, the
    shape, would never repeat), or None (then the general path runs it)."""
    if not _enabled or type(x) is not np.ndarray or async_op or check._enabled or links.enabled or type(g) is not Group:
        return None
    plan = g._plans.get(("all_to_all_v", x.dtype))
    if plan is None:
        if g.size < 2 or x.dtype.hasobject:
            return None
        plan = AllToAllVPlan(g, x.dtype)
        store(g, ("all_to_all_v", x.dtype), plan)
    g.busy = (plan, x)  # the watchdog's note of this call
    try:
        return plan.run(g, x, counts)
    finally:
        g.busy = None


def describe(plan, g) -> str:
    """What a cached plan waits for, in words (the watchdog's report): the call, its
    identity tag, the ranks it receives from and the bytes of each message."""
    name, _, shape, dtype, _ = plan.call.op
    peers = sorted(set(_sources(plan)))
    size = next((getattr(plan, a) for a in ("nbytes", "expect") if isinstance(getattr(plan, a, None), int)), None)
    text = f"{name}(shape={shape}, dtype={dtype}) by {type(plan).__name__}"
    if peers:
        text += f", receiving from ranks {peers} (world ranks {[g.world_ranks[p] for p in peers]})"
    if size is not None:
        text += f", {size} bytes per message"
    tag = getattr(plan, "tag", None)
    if tag is not None and tag != TAG_COLLECTIVE:
        text += f"; its messages carry {describe_tag(tag, g.size)}"
    return text


def _sources(plan):
    """The ranks a plan receives from (best effort, from its precomputed steps)."""
    for attr in ("peers", "peer", "left"):
        value = getattr(plan, attr, None)
        if isinstance(value, int):
            return [value]
        if isinstance(value, tuple):
            return list(value)
    if isinstance(plan, AllReducePlan):
        return [p for _, p in plan.steps]
    if isinstance(plan, PairwiseAllReducePlan):
        return _sources(plan.scatter) + [r[3] for r in plan.rounds]
    if isinstance(plan, PairwisePlan):
        return [src for *_, src in plan.steps]
    if isinstance(plan, HalvingPlan):
        return [plan.first[0]] + [r[0] for r in plan.rounds]
    if isinstance(plan, DirectScatterPlan):
        return plan.exchange.sources
    if isinstance(plan, (BruckGatherPlan, EvenGatherPlan)):
        return [r[2] if isinstance(plan, BruckGatherPlan) else r[3] for r in plan.rounds]
    if isinstance(plan, DirectGatherPlan):
        return [p for p in range(plan.n) if p != plan.rank]
    return []


watchdog.describe_plan = describe


def remember(g, x, out, async_op, call, chosen) -> None:
    """After a general-path call of ``call`` that ran algorithm ``chosen``: cache the plan
    for that algorithm, if it has one and this call is of the kind plans run."""
    if not _enabled or type(x) is not np.ndarray or async_op or check._enabled or links.enabled or type(g) is not Group:
        return
    # out: None, or a NumPy array (not a subclass) with the very dtype object of x: plans
    # test identity, which costs less than equality.  A plan that refused every call would
    # be rebuilt at every call.
    if g.size < 2 or not (out is None or (type(out) is np.ndarray and out.dtype is x.dtype)):
        return
    plan = _make(g, call, chosen, x, out)
    if plan is not None:
        store(g, (call, x.dtype, x.shape), plan)


def _make(g, call, chosen, x, out):
    """The plan for ``chosen`` (the algorithm the general path ran), or None."""
    n, shape, dtype, name = g.size, x.shape, x.dtype, call[0]
    if name == "all_gather":
        if 0 in shape[1:]:  # rows of zero bytes: nothing to gain, and no row size to divide by
            return None
        even = evengather.applies(n, out) and out.shape[0] == n * shape[0]  # an out of N equal blocks of x's size
        if chosen in ("direct", "pair_even"):  # one-shot round, large 2-rank results swapped from x
            return DirectGatherPlan(g, shape, dtype, out) if even else None
        if chosen in ("doubling", "even_ring"):
            return EvenGatherPlan(g, shape, dtype, out, chosen.replace("even_", "")) if even else None
        if chosen == "pair":
            return PairGatherPlan(g, shape, dtype, out)
        return BruckGatherPlan(g, shape, dtype, out) if chosen == "bruck" else None
    if reduction.accumulator_dtype(dtype) != dtype:  # reduced in a float32 copy: no plan
        return None
    op = call[1]
    biggest_block = -(-shape[0] // n) * (x.nbytes // max(shape[0], 1))
    if name == "all_reduce":
        if chosen == "recursive_doubling" and x.nbytes <= PLAN_MAX_BYTES:
            return AllReducePlan(g, shape, dtype, op)
        if chosen == "pairwise" and -(-x.size // n) * x.itemsize <= pipelined.PIPELINE_BYTES:  # one chunk a step
            return PairwiseAllReducePlan(g, shape, dtype, op)
    elif name == "reduce_scatter":
        if chosen == "direct" and x.nbytes <= PLAN_MAX_BYTES:  # the plan owns 2X bytes of buffers
            return DirectScatterPlan(g, shape, dtype, op)
        if chosen == "halving" and x.nbytes <= PLAN_MAX_BYTES:  # X bytes of partial sums
            return HalvingPlan(g, shape, dtype, op)
        if chosen == "pipelined_ring" and x.nbytes <= pipelined.PIPELINE_BYTES:  # one chunk a step, like the plan
            return ReduceScatterPlan(g, shape, dtype, op)
        if chosen == "pairwise" and biggest_block <= pipelined.PIPELINE_BYTES:
            return PairwisePlan(g, shape, dtype, op)
    return None


def store(g, key, plan) -> None:
    """Cache ``plan`` on ``g`` under ``key`` (at most _MAX_PLANS; a full cache is emptied)."""
    if len(g._plans) >= _MAX_PLANS:
        drop(g)
    old = g._plans.get(key)
    if old is not None:
        _close(old)
    g._plans[key] = plan
    _groups.add(g)


def drop(g) -> None:
    """Forget every plan of ``g``, freeing the MPI requests of those that hold some."""
    for plan in g._plans.values():
        _close(plan)
    g._plans.clear()


def _close(plan) -> None:
    close = getattr(plan, "close", None)
    if close is not None:
        close()
