"""One-shot ("direct") all-gather and reduce-scatter: every message of the collective posted at once.

Recursive doubling, halving and the ring move a small message in log2 N or N-1 rounds, and
at every round a rank waits for one partner before it may go on.  For a few kilobytes the
bytes cost nothing and those waits are the whole price (on ranks that share cores each
wait may also cost a scheduler switch).  The one-shot schedule has a single round: a rank
posts a receive from every other rank and a send to every other rank, then waits once for
all of them, as MPICH's medium-size all-to-all does ("post all the Irecvs and Isends, then
Waitall"; Thakur, Rabenseifner & Gropp 2005).

* all-gather: rank r sends its block to each other rank and receives each other block
  straight into its place in ``out``;
* reduce-scatter: rank r sends block j of its input to rank j and receives the N-1 copies of
  its own block, then adds the N of them in rank order (block of rank 0 + rank 1 + ...);
* all-to-all-v: two rounds, the row counts (8 bytes to each rank) and then the rows, where
  the pairwise exchange takes 2(N-1) steps, each waiting for one partner.

Both send and receive (N-1)/N * X bytes per rank (X = gathered or pre-scatter size), like the
ring, in N-1 messages each way, all in flight together: good for small messages, while large
ones on many ranks keep the pipelined rounds (N-1 large messages at once compete for memory
bandwidth, and on a network for the same links).

Wrong input never hangs: there is only one round, so no rank can wait for another that gave
up.  Every received size is checked, and a rank whose own all-gather block has the wrong
size sends empty messages, so that every other rank sees the mismatch too.  Some mismatches
still pass unseen on ranks whose own messages happen to fit (a reduce-scatter input one
element longer on one rank changes only some blocks' sizes): the check mode,
``MINIDIST_CHECK_COLLECTIVES=1``, compares every rank's call before any message.
"""

from __future__ import annotations

import numpy as np

from minidist.comm.p2p import TAG_COLLECTIVE as TAG, _size_error
from minidist.comm.p2p.rounds import post_round, wait_round

_EMPTY = np.empty(0, np.uint8)


def peers(n: int, r: int):
    """Rank r's partners in posting order: sends go to r+1, r+2, ..., receives come from
    r-1, r-2, ..., so that the N ranks do not all start with the same rank."""
    return [(r + k) % n for k in range(1, n)], [(r - k) % n for k in range(1, n)]


def first_wrong(counts, expected, sources):
    """(source, count) of the first receive whose count is not ``expected`` bytes, or None."""
    for got, src in zip(counts, sources):
        if got != expected:
            return src, got
    return None


def describe(wrong, expected: int) -> str:
    """:func:`first_wrong`'s answer in words."""
    return f"rank {wrong[0]} sent {wrong[1]} bytes where {expected} were expected"


def one_shot_all_gather(g, x: np.ndarray, out: np.ndarray):
    """Every rank's ``x`` (T/N rows each, T = out.shape[0]) into ``out``, in one round.
    Returns None if all was well, else a description of the first wrong size seen (this
    rank's block, or a message)."""
    n, r = g.size, g.rank
    per = out.shape[0] // n
    if x.shape[0] == per:
        out[r * per:(r + 1) * per] = x
        bad = None
    else:  # empty messages tell everybody else that something is wrong
        bad = f"this rank's block has {x.shape[0]} rows"
    wrong = gather_round(g.comm, out.reshape(-1).view(np.uint8), n, r, bad is not None)
    return bad or (wrong and describe(wrong, out.nbytes // n))


def gather_round(comm, flat: np.ndarray, n: int, r: int, empty: bool = False):
    """The one round of the all-gather on the flat bytes of the result (N blocks, this
    rank's already in place; ``empty``: send empty messages instead).  Returns None, or the
    (source, count) of the first wrong size received."""
    block = flat.nbytes // n
    mine = _EMPTY if empty else flat[r * block:(r + 1) * block]
    to, frm = peers(n, r)
    reqs = post_round(comm, [(flat[s * block:(s + 1) * block], s) for s in frm], [(mine, d) for d in to], TAG)
    return first_wrong(wait_round(reqs, n - 1), block, frm)


def one_shot_reduce_scatter(g, x: np.ndarray, bounds, ufunc, result: np.ndarray) -> None:
    """Flat ``x`` in N blocks (``bounds``, element ranges); this rank's block, summed over
    the ranks in rank order, into flat ``result``.  Raises CommError (naming the rank and
    sizes) on a message of the wrong size."""
    n, r = g.size, g.rank
    lo, hi = bounds[r]
    stage = g.scratch("direct_rs", (n - 1) * (hi - lo), x.dtype).reshape(n - 1, hi - lo)
    to, frm = peers(n, r)
    reqs = post_round(g.comm, [(stage[k], s) for k, s in enumerate(frm)],
                       [(x[bounds[d][0]:bounds[d][1]], d) for d in to], TAG)
    wrong = first_wrong(wait_round(reqs, n - 1), stage[0].nbytes, frm)
    if wrong is not None:
        raise _size_error(g.comm, wrong[0], TAG, stage[0].nbytes, wrong[1], "reduce_scatter")
    own = x[lo:hi]
    if np.may_share_memory(own, result):  # in place (out= is x's own block): the first add would overwrite it
        own = own.copy()
    add_in_rank_order(ufunc, operands(stage, frm, own, r), result)


def operands(stage, frm, own, r):
    """The N blocks in rank order: row k of ``stage`` came from rank frm[k]; r's is ``own``."""
    rows = [None] * (len(frm) + 1)
    rows[r] = own
    for k, s in enumerate(frm):
        rows[s] = stage[k]
    return rows


def add_in_rank_order(ufunc, operands, result) -> None:
    """result = ((op0 + op1) + op2) + ...: the same order on every path, so the general
    path and the cached plan give bit-identical sums."""
    ufunc(operands[0], operands[1], result)  # out= positionally: cheaper than a keyword
    for operand in operands[2:]:
        ufunc(result, operand, result)


def one_shot_all_to_all_v(g, x: np.ndarray, counts: np.ndarray):
    """MPI_Alltoallv in two one-shot rounds: rows ``x[sum(counts[:j]) : sum(counts[:j+1])]``
    go to rank j.  Returns the rows received, in source-rank order, and how many came from
    each rank -- pairwise.pairwise_all_to_all_v's result, from the same messages (8(N-1)
    bytes of counts, then the rows sent to the other ranks), posted all at once per round.
    Raises CommError (naming the rank and sizes) on a message of the wrong size."""
    n, r = g.size, g.rank
    to, frm = peers(n, r)
    sent = np.ascontiguousarray(counts, np.int64)
    recv_counts = np.empty(n, np.int64)
    recv_counts[r] = sent[r]
    reqs = post_round(g.comm, [(recv_counts[s:s + 1].view(np.uint8), s) for s in frm],
                      [(sent[d:d + 1].view(np.uint8), d) for d in to], TAG)
    wrong = first_wrong(wait_round(reqs, n - 1), 8, frm)
    if wrong is not None:
        raise _size_error(g.comm, wrong[0], TAG, 8, wrong[1], "all_to_all_v counts")
    send_at = np.concatenate([[0], np.cumsum(sent)])
    recv_at = np.concatenate([[0], np.cumsum(recv_counts)])
    x = np.ascontiguousarray(x)
    out = np.empty((int(recv_at[-1]),) + x.shape[1:], x.dtype)
    out[recv_at[r]:recv_at[r + 1]] = x[send_at[r]:send_at[r + 1]]
    row = x.dtype.itemsize * int(np.prod(x.shape[1:], dtype=np.int64))
    xb, ob = x.reshape(-1).view(np.uint8), out.reshape(-1).view(np.uint8)
    reqs = post_round(g.comm, [(ob[recv_at[s] * row:recv_at[s + 1] * row], s) for s in frm],
                      [(xb[send_at[d] * row:send_at[d + 1] * row], d) for d in to], TAG)
    for got, s in zip(wait_round(reqs, n - 1), frm):
        want = int(recv_counts[s]) * row
        if got != want:
            raise _size_error(g.comm, s, TAG, want, got, "all_to_all_v rows")
    return out, recv_counts
