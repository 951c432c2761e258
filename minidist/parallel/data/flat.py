"""A list of parameters seen as one flat vector, cut into one contiguous shard per rank.

ZeRO and FSDP do not shard each weight matrix; they concatenate a group of parameters (a
*unit*: a bucket, or one transformer block) into a flat vector and give rank r the r-th
contiguous piece of it, sized like ``np.array_split`` (Ψ_r = ⌈Ψ/N⌉ or ⌊Ψ/N⌋ elements).  That
is exactly the piece rank r receives from a reduce-scatter of the flat gradient, and the
piece it contributes to the all-gather that rebuilds the parameters.

The update rules are elementwise, so updating each shard with ``optim.adamw_update`` gives
the same numbers as updating the whole parameters; only the per-parameter settings (weight
decay or not) need to know which parameter each stretch of the shard belongs to:
:meth:`FlatUnit.segments`.
"""

from __future__ import annotations

from minidist.model.backend import xp
from minidist.layout.split import split_bounds


class Shard:
    """This rank's piece of a unit: ``data`` (master weights) and ``grad``, like a Parameter,
    so gradient clipping and loss-scale checks work on shards unchanged."""

    def __init__(self, data):
        self.data = data
        self.grad = None
        self.dtype = data.dtype
        self.size = data.size
        self.shape = data.shape


class FlatUnit:
    """Parameters ``params`` laid end to end; rank ``rank`` of ``size`` owns ``[lo, hi)``."""

    def __init__(self, params, rank: int = 0, size: int = 1, name: str = ""):
        self.params = list(params)
        self.name = name
        self.offsets, n = [], 0
        for p in self.params:
            self.offsets.append(n)
            n += int(p.size)
        self.numel = n
        self.dtype = self.params[0].dtype if self.params else None  # None: an empty unit (float64)
        self.bounds = split_bounds(n, size)
        self.lo, self.hi = self.bounds[rank]
        self.shapes = [tuple(p.shape) for p in self.params]

    @property
    def shard_numel(self) -> int:
        return self.hi - self.lo

    def flatten(self, arrays):
        """Concatenate ``arrays`` (one per parameter; None counts as zeros) into a new flat array."""
        flat = xp.empty(self.numel, self.dtype)
        for a, o, shape in zip(arrays, self.offsets, self.shapes):
            n = _numel(shape)
            flat[o:o + n] = 0 if a is None else a.reshape(-1)
        return flat

    def views(self, flat):
        """Each parameter's array as a view into ``flat`` (no copy)."""
        return [flat[o:o + _numel(s)].reshape(s) for o, s in zip(self.offsets, self.shapes)]

    def segments(self):
        """``(param, shard slice, flat-parameter slice)`` for each parameter overlapping this
        rank's shard: the stretches to update with that parameter's own settings."""
        for p, o, shape in zip(self.params, self.offsets, self.shapes):
            start, stop = max(o, self.lo), min(o + _numel(shape), self.hi)
            if start < stop:
                yield p, slice(start - self.lo, stop - self.lo), slice(start - o, stop - o)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
