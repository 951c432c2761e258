"""All-gather of equal blocks straight into the caller's ``out``: no row counts, no staging.

The general all-gather (tree.bruck_all_gather_rows) accepts row counts that differ by one
between ranks, so a rank cannot know where a block belongs in the result before that
block's count has arrived.  It therefore sends every block behind its count through a
staging buffer and copies the blocks out at the end: one extra pass over the whole result,
which for large messages costs about as much as the messages themselves (measured on 4
ranks at 16-64 MB: 0.5x MPI's Allgather, against 0.9-1.0x for a ring that writes in place).

With ``out=`` every rank knows the total row count T, the same on all of them.  If N
divides T, the rows rule (counts differ by at most one) leaves a single possibility: every
rank has T/N rows.  Then every block's place in ``out`` is known in advance, and each
message can go from ``out`` straight into ``out``, as MPI_Allgather does with its equal
counts.  All ranks take this lane or not from ``out.shape`` alone, without a message, so
``out=`` must be given on every rank or on none, with the same shape (debug mode,
``MINIDIST_CHECK_COLLECTIVES=1``, checks that; otherwise the ranks run different
schedules, only those that receive a wrong size raise, and the abort hook that
``comm.world()`` installs ends the job with that error: tested on 4 ranks).

Schedules, all (N-1)/N * X bytes sent and received per rank:

* small results, and every size on up to 4 ranks (DIRECT_BYTES, DIRECT_MAX_RANKS): the one-shot exchange
  of direct.py, every block sent to every rank in a single round;
* N a power of two: recursive doubling (Thakur, Rabenseifner & Gropp 2005, sec. 4.2).  In
  round k the rank holds its aligned group of 2^k blocks, contiguous in ``out``, and swaps
  it with rank r ^ 2^k, whose group lies right beside it; log2 N rounds.
* any N: the ring (Patarasuk & Yuan 2009), N-1 steps: forward block (r-s) to the right,
  receive block (r-s-1) from the left.

Wrong input must still end with an error on every rank, not a hang and not a silently
wrong result.  A rank whose block has the wrong number of rows cannot send its share,
so it sends *empty* messages instead.  Every rank checks the size of every message it
receives; one that gets a wrong size sends empty messages from then on too (its forwarded
blocks would be incomplete).  Each rank receives every other rank's block along some
chain of forwards, so the bad block's emptiness reaches every rank, and all of them raise
after the last round (which none skips, so nobody waits for a rank that gave up).
"""

from __future__ import annotations

import math

import numpy as np
from mpi4py import MPI

from minidist.comm import direct, links, stats
from minidist.comm.errors import CommError
from minidist.comm.p2p import TAG_COLLECTIVE as TAG
from minidist.comm.ring import ROWS_RULE

BYTE = MPI.BYTE
_EMPTY = np.empty(0, np.uint8)

# When the one-shot exchange (direct.py) is chosen: up to DIRECT_BYTES of result on any
# number of ranks, and at every size on up to DIRECT_MAX_RANKS ranks.  From
# benchmarks/bench_collectives.py's crossover table (float32, cached plans, each side with
# its own result buffer and the order alternated; median us of two launches at load 2.5-3),
# one-shot / rounds (2 ranks: one Sendrecv; 4 ranks: recursive doubling):
#   2 ranks: 16 KB 10.5-11 / 15.7, 256 KB 33-36 / 47-49
#   4 ranks: 16 KB 43-47 / 72-79, 256 KB 172-174 / 209, 4 MB 2428-2532 / 2804-2885
# and against MPI's Allgather on 4 ranks, 16 MB 1.04-1.15x and 64 MB 1.11-1.31x with the
# one-shot exchange, 0.85-0.93x with recursive doubling.  Between those, at 1 MB on 4
# ranks, it depends on the caller: with the same out every call (persistent requests,
# directgather.DirectGatherPlan) the one-shot round measured ~12% faster than doubling, with
# a different out every call ~14% slower.  (Two ranks above DIRECT_BYTES send one message
# each way either way: collectives._pair_lane.)  Large
# messages on more ranks keep the rounds: there every rank would have N-1 large messages in
# flight at once, which networks punish (incast) and rings avoid, and this machine cannot
# measure it.
DIRECT_BYTES = 256 << 10
DIRECT_MAX_RANKS = 4


def applies(n: int, x: np.ndarray, out) -> bool:
    """Is the total row count known and a multiple of N?  (The same answer on every rank
    when out's shape agrees, whatever x's row count: a rank with the wrong count still
    takes this lane, to make every rank raise.)  At least one row per block, so that an
    empty message can only mean a bad block."""
    return out is not None and n > 1 and out.shape[0] >= n and out.shape[0] % n == 0 and 0 not in out.shape[1:]


def schedule(n: int, r: int, algorithm: str) -> tuple:
    """Rank r's rounds as (dest, send blocks (lo, hi), source, receive blocks (lo, hi)),
    block b being rows [b*T/N, (b+1)*T/N) of ``out``.  ``algorithm``: "doubling" (N a
    power of two) or "ring"."""
    if algorithm not in ("doubling", "ring"):
        raise ValueError(f"evengather.schedule: no rounds for algorithm {algorithm!r}")
    rounds = []
    if algorithm == "doubling":
        mask = 1
        while mask < n:
            mine, theirs = r & ~(mask - 1), (r ^ mask) & ~(mask - 1)  # first block of each group
            rounds.append((r ^ mask, (mine, mine + mask), r ^ mask, (theirs, theirs + mask)))
            mask <<= 1
    else:
        for s in range(n - 1):
            b_send, b_recv = (r - s) % n, (r - s - 1) % n
            rounds.append(((r + 1) % n, (b_send, b_send + 1), (r - 1) % n, (b_recv, b_recv + 1)))
    return tuple(rounds)


def pick(n: int, algorithm: str, nbytes: int) -> str:
    """The schedule for ``algorithm`` = "auto" | "direct" | "doubling" | "ring" and a result
    of ``nbytes`` (the same on every rank, as out's shape is)."""
    if algorithm == "auto":
        if nbytes <= DIRECT_BYTES or n <= DIRECT_MAX_RANKS:
            return "direct"
        return "doubling" if n & (n - 1) == 0 else "ring"
    return algorithm


def byte_rounds(n: int, r: int, algorithm: str, block: int) -> tuple:
    """:func:`schedule` ("doubling" or "ring") in bytes of the flat result, ``block`` bytes
    a block: (dest, send start, send stop, source, receive start, receive stop) per round."""
    return tuple((dest, slo * block, shi * block, source, rlo * block, rhi * block)
                 for dest, (slo, shi), source, (rlo, rhi) in schedule(n, r, algorithm))


def even_all_gather(g, x: np.ndarray, out: np.ndarray, algorithm: str = "auto"):
    """Gather every rank's ``x`` (T/N rows each, T = out.shape[0]) into ``out`` in place.
    Returns ``(out, bytes_sent, bytes_received)``; raises CommError on every rank if some
    rank's block does not have T/N rows or the ranks disagree on trailing shape or dtype."""
    n, r = g.size, g.rank
    algorithm = pick(n, algorithm, out.nbytes)
    if algorithm == "direct":
        out, sent, received, bad = direct.all_gather(g, x, out)
        if bad is not None:
            raise error(g, out, bad)
        return out, sent, received
    per = out.shape[0] // n
    block = math.prod(out.shape[1:]) * out.itemsize * per
    bad = None
    if x.shape[0] == per:
        out[r * per:(r + 1) * per] = x
    else:
        bad = f"this rank's block has {x.shape[0]} rows"
    rounds = byte_rounds(n, r, algorithm, block)
    sent, received, bad = exchange(g, out.reshape(-1).view(np.uint8), rounds, MPI.Status(), bad)
    if bad is not None:
        raise error(g, out, bad)
    return out, sent, received


def exchange(g, flat: np.ndarray, rounds, status, bad=None):
    """Run ``rounds`` (see :func:`byte_rounds`) on the flat bytes of the result, own block
    already in place.  A rank that is ``bad`` (its own block, or a message it received,
    had the wrong size) sends empty messages.  Returns (bytes sent, bytes received, bad)."""
    comm = g.comm
    sent = received = 0
    for dest, slo, shi, source, rlo, rhi in rounds:
        outgoing = flat[slo:shi] if bad is None else _EMPTY
        if links.enabled:
            links.delay(outgoing.nbytes)
        try:
            comm.Sendrecv([outgoing, BYTE], dest, TAG, [flat[rlo:rhi], BYTE], source, TAG, status)
            got = status.Get_count(BYTE)
        except MPI.Exception as err:
            if err.Get_error_class() != MPI.ERR_TRUNCATE:
                raise CommError(f"all_gather: MPI error while receiving on group {g.name!r}: {err}") from None
            got = f"more than {rhi - rlo}"
        sent += outgoing.nbytes
        if got == rhi - rlo:
            received += got
        elif bad is None:
            bad = f"rank {source} sent {got} bytes where {rhi - rlo} were expected"
    return sent, received, bad


def error(g, out, bad: str) -> CommError:
    n = g.size
    return CommError(f"all_gather on group {g.name!r} into out.shape={out.shape}: each of the {n} ranks "
                     f"must hold {out.shape[0] // n} rows of shape {out.shape[1:]} {out.dtype}, but {bad} "
                     f"(an empty message means some rank's block had the wrong row count).  {ROWS_RULE}, "
                     f"and out= must have the same shape on every rank.\nRecent operations on this "
                     f"rank:\n{stats.format_recent()}")
