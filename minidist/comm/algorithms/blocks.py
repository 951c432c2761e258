"""How a vector is cut into one block per rank (shared by every algorithm)."""

from __future__ import annotations

from minidist.data import split_bounds as rows_split

ROWS_RULE = ("all_gather accepts row counts (axis 0) that differ by at most one between ranks, "
             "as np.array_split produces")


def split_bounds(n: int, parts: int, unit: int = 1) -> list[tuple[int, int]]:
    """(start, stop) of ``parts`` pieces of ``n`` rows, sized like ``np.array_split``
    (minidist.data.split_bounds, the one split rule), in units of ``unit`` elements per row."""
    return [(start * unit, stop * unit) for start, stop in rows_split(n, parts)]
