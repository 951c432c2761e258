"""How a vector is cut into one block per rank (shared by every algorithm)."""

from __future__ import annotations

ROWS_RULE = ("all_gather accepts row counts (axis 0) that differ by at most one between ranks, "
             "as np.array_split produces")


def split_bounds(n: int, parts: int, unit: int = 1) -> list[tuple[int, int]]:
    """(start, stop) of ``parts`` pieces of ``n`` rows, sized like ``np.array_split``,
    in units of ``unit`` elements per row."""
    q, extra = divmod(n, parts)
    bounds, start = [], 0
    for i in range(parts):
        stop = start + q + (1 if i < extra else 0)
        bounds.append((start * unit, stop * unit))
        start = stop
    return bounds
