"""The ring all-reduce: a reduce-scatter, then an all-gather, each N-1 steps around a ring.

Patarasuk & Yuan 2009, "Bandwidth optimal all-reduce algorithms for clusters of workstations".

Cut the vector of X bytes into N blocks of X/N.  Every rank talks only to its neighbours:
it sends to right = r+1 and receives from left = r-1 (mod N), so every link is busy at
every step.
* reduce-scatter: at step s rank r sends its partial sum of block r-s-1 and receives the
  partial sum of block r-s-2, to which it adds its own part.  Each block travels once
  around the ring collecting every rank's part: after N-1 steps rank r holds block r,
  summed over all ranks.
* all-gather: at step s rank r forwards block r-s and receives block r-s-1; after N-1
  steps every finished block has reached every rank.

Cost: 2(N-1) steps of X/N bytes, so each rank sends (and receives) 2(N-1)/N * X bytes: the
lower bound, as each rank must send the X - X/N bytes that others reduce and receive the
X - X/N bytes of result that others reduced.  Below 2X however large N is, so the ring wins
for large X; for small X its 2(N-1) latencies lose to doubling's log2 N (doubling.py).
"""

import numpy as np

from minidist.layout.split import split_bounds
from minidist.comm.p2p import TAG_COLLECTIVE as TAG, _sendrecv


def ring_steps(n: int, r: int, phase: str) -> list[tuple[int, int]]:
    """Rank r's (send block, receive block) at each of the N-1 steps (send right, receive
    from left): "reduce_scatter" sends r-s-1 and receives r-s-2, "all_gather" r-s and r-s-1."""
    lag = 1 if phase == "reduce_scatter" else 0
    return [((r - s - lag) % n, (r - s - lag - 1) % n) for s in range(n - 1)]


def ring_reduce_scatter(g, x: np.ndarray, bounds, ufunc, out: np.ndarray) -> None:
    """Block b of flat ``x`` is x[bounds[b]]; block r, reduced over the ranks, lands in ``out``."""
    n, r = g.size, g.rank
    right, left = (r + 1) % n, (r - 1) % n
    partial = x[bounds[(r - 1) % n][0]:bounds[(r - 1) % n][1]]  # step 0 sends x's own part
    for _, b in ring_steps(n, r, "reduce_scatter"):
        mine = x[bounds[b][0]:bounds[b][1]]
        got = _sendrecv(g.comm, partial, right, np.empty_like(mine), left, TAG)
        partial = ufunc(mine, got)  # this rank's part + the sum so far: sent on next step
    out[...] = partial


def ring_all_gather(g, out: np.ndarray, bounds) -> None:
    """In place in flat ``out``: rank r's block out[bounds[r]] is there; afterwards all are."""
    n, r = g.size, g.rank
    for send_b, recv_b in ring_steps(n, r, "all_gather"):
        (a, b), (c, d) = bounds[send_b], bounds[recv_b]
        _sendrecv(g.comm, out[a:b], (r + 1) % n, out[c:d], (r - 1) % n, TAG)


def ring_all_reduce(g, x: np.ndarray, out: np.ndarray, ufunc) -> None:
    """All-reduce of flat ``x`` into flat ``out``: ring reduce-scatter, then ring all-gather."""
    bounds = split_bounds(x.size, g.size)
    lo, hi = bounds[g.rank]
    ring_reduce_scatter(g, x, bounds, ufunc, out[lo:hi])
    ring_all_gather(g, out, bounds)
