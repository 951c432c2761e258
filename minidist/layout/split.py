"""How ``n`` rows are cut into ``parts`` pieces: the one split rule of minidist.

``np.array_split``'s sizes: the first ``n % parts`` pieces get one extra row (some may be
empty).  Batches over data-parallel ranks, micro-batches, ZeRO's flat shards, every
collective's blocks (comm/algorithms/) and the traffic formulas all cut this way.
"""

from __future__ import annotations

from numbers import Integral


def split_bounds(n: int, parts: int, unit: int = 1) -> list[tuple[int, int]]:
    """``(start, stop)`` of ``parts`` consecutive pieces of ``n`` rows sized like
    ``np.array_split``, in units of ``unit`` elements per row."""
    q, extra = divmod(n, parts)
    bounds, start = [], 0
    for i in range(parts):
        stop = start + q + (1 if i < extra else 0)
        bounds.append((start * unit, stop * unit))
        start = stop
    return bounds


def split_sizes(n: int, parts: int) -> list[int]:
    """The sizes of :func:`split_bounds`' pieces."""
    return [stop - start for start, stop in split_bounds(n, parts)]


def shard_bounds(rows: int, index: int, count: int) -> tuple[int, int]:
    """``(start, stop)`` of block ``index`` of ``count`` non-empty blocks of ``rows`` rows
    (:func:`split_bounds`)."""
    if not (isinstance(count, Integral) and count >= 1):
        raise ValueError(f"shard count must be a positive integer, got {count!r}")
    if not (isinstance(index, Integral) and 0 <= index < count):
        raise ValueError(f"shard index must be in 0..{count - 1}, got {index!r}")
    if count > rows:
        raise ValueError(f"cannot split {rows} rows into {count} non-empty shards")
    return split_bounds(rows, count)[index]


def shard(x, index: int, count: int):
    """Block ``index`` of ``count`` contiguous row blocks of ``x`` (as ``np.array_split``).

    Used for data-parallel ranks and for gradient-accumulation micro-batches; the blocks in
    order concatenate back to ``x``.  Uneven splits are allowed (sizes differ by at most one);
    a loss averaged per block must then be weighted by the block's rows.
    """
    start, stop = shard_bounds(len(x), index, count)
    return x[start:stop]
