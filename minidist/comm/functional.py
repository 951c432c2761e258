"""Differentiable collectives: each communication op paired with its gradient's communication.

Model-parallel layers move activations between ranks inside the forward pass, so backward
must move their gradients too.  The rule is the chain rule on the *global* function of all
ranks' tensors; for a linear map ``y = A x`` the gradient is ``A^T grad_y``.  Every
collective here is linear, and its transpose is again a collective::

    op                   forward                    backward (its transpose)   used by
    -------------------  -------------------------  -------------------------  -----------------------
    copy_to_group        identity                   all-reduce                 Megatron f (TP input)
    reduce_from_group    all-reduce                 identity                   Megatron g (TP output)
    all_gather           all-gather                 reduce-scatter             sequence parallelism
    reduce_scatter       reduce-scatter             all-gather                 sequence parallelism
    scatter_to_group     keep my slice              all-gather                 split a replicated x
    gather_from_group    all-gather (replicated)    keep my slice              gather a TP output
    ppermute             permutation                inverse permutation        ring attention, pipes
    all_to_all           all-to-all                 inverse all-to-all         Ulysses
    all_to_all_v         rows to ranks, by counts   the same, counts swapped   expert parallelism

Two conventions decide which gradient is "right", as in Megatron-LM (Shoeybi et al. 2019):

* A **replicated** tensor (identical on every rank of the group, e.g. the input of a
  tensor-parallel block) is *one* tensor: its gradient is the sum of the contributions of
  all ranks, and every rank must hold that sum.  Hence ``copy_to_group``'s all-reduce.
* A **replicated output** feeds a computation that every rank repeats identically (the loss
  is computed once, redundantly), so its gradient is already complete on each rank and must
  not be summed again.  Hence ``reduce_from_group``'s identity backward.

Sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models") replaces f/g by all-gather/reduce-scatter along the sequence axis, and
Ulysses (Jacobs et al. 2023) re-shards attention from sequence to heads with an all-to-all.

Every function takes a :class:`~minidist.model.autograd.Tensor` (or a plain array) and a Group and
returns a Tensor recorded in the autograd graph.  Megatron's names are aliases at the end.
"""

from __future__ import annotations

from minidist.model.autograd import Tensor, make_tensor
from minidist.model.backend import xp
from minidist.comm import collectives
from minidist.layout.split import split_bounds


def _data(x):
    return x.data if isinstance(x, Tensor) else x


def _check_axis(axis, ndim, what="axis"):
    if isinstance(axis, bool) or not isinstance(axis, int) or not -ndim <= axis < ndim:
        raise ValueError(f"{what}={axis!r} is out of range for an array with {ndim} dims")
    return axis % ndim


def _to_front(a, axis):
    """``axis`` moved to position 0 as a contiguous array: collectives split axis 0."""
    return xp.ascontiguousarray(xp.moveaxis(a, axis, 0))


def _gather_along(a, g, axis):
    """All-gather ``a`` along ``axis`` (any axis, via axis 0)."""
    return xp.moveaxis(collectives.all_gather(_to_front(a, axis), g), 0, axis)


def _reduce_scatter_along(a, g, axis):
    """Sum ``a`` over the group, keep part ``g.rank`` of ``axis`` (array_split parts)."""
    return xp.moveaxis(collectives.reduce_scatter(_to_front(a, axis), g, op="sum"), 0, axis)


def _my_slice(a, g, axis):
    start, stop = split_bounds(a.shape[axis], g.size)[g.rank]
    index = [slice(None)] * a.ndim
    index[axis] = slice(start, stop)
    return a[tuple(index)]


# ------------------------------------------------------------------ Megatron's f and g


def copy_to_group(x, g):
    """Megatron's **f**: identity forward, all-reduce (sum) of the gradient backward.

    Put it where a replicated activation enters a tensor-parallel region: every rank uses
    the same ``x`` with its own weight shard, so ``x``'s gradient is the sum of all ranks'.
    """
    return make_tensor(_data(x), (x,), lambda grad: (collectives.all_reduce(grad, g, op="sum"),))


def reduce_from_group(x, g):
    """Megatron's **g**: all-reduce (sum) forward, identity backward.

    Put it where a tensor-parallel region ends with partial sums (row-parallel matmul): the
    sum is replicated, and so is the computation after it, so the gradient is complete.
    """
    return make_tensor(collectives.all_reduce(_data(x), g, op="sum"), (x,), lambda grad: (grad,))


# ---------------------------------------------- all-gather <-> reduce-scatter (sequence parallel)


def all_gather(x, g, axis: int = 0):
    """Concatenate every rank's ``x`` along ``axis``; backward reduce-scatters the gradient.

    Each rank's output feeds its own computation, so the gradient of rank r's shard is the
    sum over ranks of the matching slice of their output gradients: a reduce-scatter.
    Shards may be uneven only as ``np.array_split`` cuts them (rank i gets the bigger parts
    first), because the backward reduce-scatter cuts the gradient that way.
    """
    a = _data(x)
    axis = _check_axis(axis, a.ndim)
    out = _gather_along(a, g, axis)
    start, stop = split_bounds(out.shape[axis], g.size)[g.rank]
    if stop - start != a.shape[axis]:
        raise ValueError(f"all_gather: rank {g.rank} holds {a.shape[axis]} rows of axis {axis}, but "
                         f"np.array_split of the gathered {out.shape[axis]} rows gives it {stop - start}")
    return make_tensor(out, (x,), lambda grad: (_reduce_scatter_along(grad, g, axis),))


def reduce_scatter(x, g, axis: int = 0):
    """Sum ``x`` over the group and keep this rank's part of ``axis``; backward all-gathers.

    Every rank's ``x`` (full length) contributed to every part, and part r's gradient lives
    on rank r, so ``x``'s gradient is the concatenation of all ranks' gradients.
    """
    a = _data(x)
    axis = _check_axis(axis, a.ndim)
    return make_tensor(_reduce_scatter_along(a, g, axis), (x,), lambda grad: (_gather_along(grad, g, axis),))


def scatter_to_group(x, g, axis: int):
    """Keep this rank's part of a replicated ``x`` along ``axis`` (no communication).

    Backward all-gathers: the replicated ``x`` is one tensor, each rank knows the gradient
    of its own part only, and every rank needs the whole gradient.
    """
    a = _data(x)
    axis = _check_axis(axis, a.ndim)
    out = xp.ascontiguousarray(_my_slice(a, g, axis))
    return make_tensor(out, (x,), lambda grad: (_gather_along(grad, g, axis),))


def gather_from_group(x, g, axis: int):
    """All-gather along ``axis`` into a replicated tensor; backward keeps this rank's slice.

    The output is replicated and so is everything computed from it, so each rank's output
    gradient is already the full gradient: ``x``'s part of it needs no communication.
    """
    a = _data(x)
    axis = _check_axis(axis, a.ndim)
    out = _gather_along(a, g, axis)
    return make_tensor(out, (x,), lambda grad: (xp.ascontiguousarray(_my_slice(grad, g, axis)),))


# ------------------------------------------------------------ permutations and all-to-all


def _inverse(perm):
    return [(dst, src) for src, dst in perm]


def ppermute(x, g, perm):
    """Send ``x`` from ``src`` to ``dst`` for each pair of ``perm``; non-receivers get zeros.

    Backward sends each gradient back along the reversed pairs (the transpose of a
    permutation is its inverse); a rank that sent nothing gets a zero gradient.
    """
    perm = [tuple(p) for p in perm]
    out = collectives.ppermute(_data(x), g, perm=perm)
    return make_tensor(out, (x,), lambda grad: (collectives.ppermute(grad, g, perm=_inverse(perm)),))


def _all_to_all(a, g, split_axis, concat_axis):
    n = a.shape[split_axis]
    if n % g.size:
        raise ValueError(f"all_to_all: split axis {split_axis} has length {n}, "
                         f"not divisible by the group size {g.size}")
    received = collectives.all_to_all(_to_front(a, split_axis), g)  # parts of rank 0, 1, ... stacked
    parts = received.reshape(g.size, n // g.size, *received.shape[1:])
    return xp.concatenate([xp.moveaxis(p, 0, split_axis) for p in parts], axis=concat_axis)


def all_to_all(x, g, split_axis: int, concat_axis: int):
    """Cut ``x`` into ``g.size`` parts along ``split_axis``, send part j to rank j, and
    concatenate the received parts (in rank order) along ``concat_axis``.

    Ulysses uses it to turn a sequence-sharded ``(seq/N, heads, d)`` activation into a
    head-sharded ``(seq, heads/N, d)`` one.  Backward is the inverse all-to-all (swap the
    axes).  Every rank must pass the same shape; ``split_axis`` must divide evenly.
    """
    a = _data(x)
    split_axis = _check_axis(split_axis, a.ndim, "split_axis")
    concat_axis = _check_axis(concat_axis, a.ndim, "concat_axis")
    out = _all_to_all(a, g, split_axis, concat_axis)
    return make_tensor(out, (x,), lambda grad: (_all_to_all(grad, g, concat_axis, split_axis),))


def all_to_all_v(x, counts, g):
    """Send ``counts[j]`` rows of ``x`` (axis 0, in order) to rank j; returns ``(y,
    recv_counts)``: the rows received in source-rank order (a Tensor) and how many came from
    each rank.  Expert parallelism dispatches tokens to the ranks holding their experts
    with it, and combines the experts' outputs with it.

    Backward is the same exchange with the counts swapped: the gradient of the rows received
    from rank j (``recv_counts[j]`` of them) goes back to j, where they land in the order
    they were sent (the transpose of a permutation of rows is its inverse)."""
    y, recv_counts = collectives.all_to_all_v(_data(x), counts, g)
    return make_tensor(y, (x,), lambda grad: (collectives.all_to_all_v(grad, recv_counts, g)[0],)), recv_counts


# ------------------------------------------------------------------ Megatron-LM's names
# Megatron calls these "..._tensor_model_parallel_region" and "..._sequence_parallel_region".

copy_to_tp = copy_to_group            # f: identity fwd, all-reduce bwd
reduce_from_tp = reduce_from_group    # g: all-reduce fwd, identity bwd
gather_from_sp = all_gather           # sequence parallel: all-gather fwd, reduce-scatter bwd
reduce_scatter_to_sp = reduce_scatter  # sequence parallel: reduce-scatter fwd, all-gather bwd


def scatter_to_sp(x, g, axis: int = 0):
    """Split a replicated tensor along the sequence axis: :func:`scatter_to_group`."""
    return scatter_to_group(x, g, axis)
