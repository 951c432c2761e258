"""All-gather of equal blocks straight into the caller's ``out``: no row counts, no staging.

The general all-gather (bruck.bruck_all_gather_rows) accepts row counts that differ by one
between ranks, so a rank cannot know where a block belongs in the result before that
block's count has arrived.  It therefore sends every block behind its count through a
staging buffer and copies the blocks out at the end: one extra pass over the whole result.

With ``out=`` every rank knows the total row count T, the same on all of them.  If N
divides T, the rows rule (counts differ by at most one) leaves a single possibility: every
rank has T/N rows.  Then every block's place in ``out`` is known in advance, and each
message can go from ``out`` straight into ``out``, as MPI_Allgather does with its equal
counts.  All ranks take this lane or not from ``out.shape`` alone, without a message, so
``out=`` must be given on every rank or on none, with the same shape (the check mode,
``MINIDIST_CHECK_COLLECTIVES=1``, checks that; otherwise the ranks run different
schedules, only those that receive a wrong size raise, and the abort hook that
``comm.world()`` installs ends the job with that error).

Schedules, all (N-1)/N * X bytes sent and received per rank: the one-shot round
(oneshot.py); recursive doubling for N a power of two (doubling.doubling_gather_steps:
log2 N rounds, the held group of blocks contiguous in ``out``); the ring for any N
(ring.ring_steps, N-1 steps).

Wrong input must still end with an error on every rank, not a hang and not a silently
wrong result.  A rank whose block has the wrong number of rows cannot send its share, so it
sends *empty* messages instead.  Every rank checks the size of every message it receives;
one that gets a wrong size sends empty messages from then on too (its forwarded blocks
would be incomplete).  Each rank receives every other rank's block along some chain of
forwards, so the bad block's emptiness reaches every rank, and all of them raise after the
last round (which none skips, so nobody waits for a rank that gave up).
"""

from __future__ import annotations

import math

import numpy as np

from minidist.comm import stats
from minidist.comm.algorithms.blocks import ROWS_RULE
from minidist.comm.algorithms.doubling import doubling_gather_steps
from minidist.comm.algorithms.oneshot import one_shot_all_gather
from minidist.comm.algorithms.ring import ring_steps
from minidist.comm.errors import CommError
from minidist.comm.p2p import TAG_COLLECTIVE as TAG, _exchange

_EMPTY = np.empty(0, np.uint8)


def applies(n: int, out) -> bool:
    """Is the total row count known and a multiple of N?  (The same answer on every rank
    when out's shape agrees, whatever x's row count: a rank with the wrong count still
    takes this lane, to make every rank raise.)  At least one row per block, so that an
    empty message can only mean a bad block."""
    return out is not None and n > 1 and out.shape[0] >= n and out.shape[0] % n == 0 and 0 not in out.shape[1:]


def block_rounds(n: int, r: int, algorithm: str) -> tuple:
    """Rank r's rounds as (dest, send blocks (lo, hi), source, receive blocks (lo, hi)),
    block b being rows [b*T/N, (b+1)*T/N) of ``out``: "doubling" (N a power of two) or "ring"."""
    if algorithm == "doubling":
        return tuple((peer, sent, peer, got) for peer, sent, got in doubling_gather_steps(n, r))
    if algorithm == "ring":
        return tuple(((r + 1) % n, (s, s + 1), (r - 1) % n, (b, b + 1)) for s, b in ring_steps(n, r, "all_gather"))
    raise ValueError(f"evengather: no rounds for algorithm {algorithm!r}")


def byte_rounds(n: int, r: int, algorithm: str, block: int) -> tuple:
    """:func:`block_rounds` in bytes of the flat result, ``block`` bytes a block:
    (dest, send start, send stop, source, receive start, receive stop) per round."""
    return tuple((dest, slo * block, shi * block, source, rlo * block, rhi * block)
                 for dest, (slo, shi), source, (rlo, rhi) in block_rounds(n, r, algorithm))


def even_all_gather(g, x: np.ndarray, out: np.ndarray, algorithm: str) -> np.ndarray:
    """Gather every rank's ``x`` (T/N rows each, T = out.shape[0]) into ``out`` in place, by
    ``algorithm`` = "direct" (one round), "doubling" or "ring".  Raises CommError on every
    rank if some rank's block does not have T/N rows or the ranks disagree on trailing
    shape or dtype."""
    n, r = g.size, g.rank
    if algorithm == "direct":
        bad = one_shot_all_gather(g, x, out)
    else:
        per = out.shape[0] // n
        bad = None
        if x.shape[0] == per:
            out[r * per:(r + 1) * per] = x
        else:
            bad = f"this rank's block has {x.shape[0]} rows"
        block = math.prod(out.shape[1:]) * out.itemsize * per
        bad = exchange(g, out.reshape(-1).view(np.uint8), byte_rounds(n, r, algorithm, block), bad)
    if bad is not None:
        raise error(g, out, bad)
    return out


def exchange(g, flat: np.ndarray, rounds, bad=None, status=None):
    """Run ``rounds`` (see :func:`byte_rounds`) on the flat bytes of the result, own block
    already in place.  A rank that is ``bad`` (its own block, or a message it received, had
    the wrong size) sends empty messages.  Returns ``bad`` (None if all was well)."""
    for dest, slo, shi, source, rlo, rhi in rounds:
        got = _exchange(g.comm, flat[slo:shi] if bad is None else _EMPTY, dest, flat[rlo:rhi], source, TAG, status)
        if got != rhi - rlo and bad is None:
            bad = f"rank {source} sent {got} bytes where {rhi - rlo} were expected"
    return bad


def error(g, out, bad: str) -> CommError:
    n = g.size
    return CommError(f"all_gather on group {g.name!r} into out.shape={out.shape}: each of the {n} ranks "
                     f"must hold {out.shape[0] // n} rows of shape {out.shape[1:]} {out.dtype}, but {bad} "
                     f"(an empty message means some rank's block had the wrong row count).  {ROWS_RULE}, "
                     f"and out= must have the same shape on every rank.\nRecent operations on this "
                     f"rank:\n{stats.format_recent()}")
