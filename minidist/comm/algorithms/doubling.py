"""Recursive doubling and halving: log2 N rounds, partners whose ranks differ in one bit.

Thakur, Rabenseifner & Gropp 2005, "Optimization of Collective Communication Operations in
MPICH".  With small messages a collective costs its number of rounds times the per-message
latency (alpha in the alpha-beta model), so these algorithms double (or halve) the set of
ranks whose data a rank holds at every round: log2 N rounds instead of the ring's N-1.

* recursive doubling all-reduce: every round swaps the *whole* vector with the partner
  r ^ 2^k and reduces: log2(N) * X bytes per rank, more than the ring, in far fewer rounds;
* recursive halving reduce-scatter: every round sends the half of the range this rank gives
  up and keeps the half holding its own block: X/2 + X/4 + ... = (N-1)/N * X bytes;
* recursive doubling all-gather: the mirror image, the held range doubling each round;
* Rabenseifner's all-reduce (2004) = halving reduce-scatter + doubling all-gather:
  2(N-1)/N * X bytes like the ring, in 2 log2 N rounds.
"""

from __future__ import annotations

import numpy as np

from minidist.layout.split import split_bounds
from minidist.comm.p2p import TAG_COLLECTIVE as TAG, _recv, _send, _sendrecv

# Actions of a recursive-doubling schedule (see recursive_doubling_schedule).
EXCHANGE, GIVE, TAKE, RESULT_OUT, RESULT_IN = "exchange", "give", "take", "result_out", "result_in"


def recursive_doubling_schedule(n: int, r: int) -> tuple:
    """Rank r's rounds of a recursive-doubling all-reduce over n ranks, as (action, peer) pairs.

    For a power of two n every round is an EXCHANGE with r ^ 2^k.  Otherwise the first
    2*rem ranks (rem = n - largest power of two) pair up: the even one GIVEs its vector to
    its odd neighbour (which TAKEs and reduces it), sits out the doubling, and at the end
    gets the result back (RESULT_OUT on the odd rank, RESULT_IN on the even one): 2 more rounds.
    """
    pof2 = 1 << (n.bit_length() - 1)
    rem = n - pof2
    if r < 2 * rem and r % 2 == 0:
        return ((GIVE, r + 1), (RESULT_IN, r + 1))
    steps = [(TAKE, r - 1)] if r < 2 * rem else []
    newrank = r // 2 if r < 2 * rem else r - rem
    mask = 1
    while mask < pof2:
        peer_new = newrank ^ mask
        steps.append((EXCHANGE, peer_new * 2 + 1 if peer_new < rem else peer_new + rem))
        mask <<= 1
    if r < 2 * rem:
        steps.append((RESULT_OUT, r - 1))
    return tuple(steps)


def recursive_doubling_all_reduce(g, acc: np.ndarray, ufunc, x: np.ndarray | None = None) -> None:
    """All-reduce into ``acc`` by recursive doubling.  Both partners compute a+b == b+a, so
    all ranks end bitwise equal.  The input is ``acc`` itself, or ``x`` (only read) when
    given: the first round then sends x and reduces into acc, saving a copy of x."""
    tmp = g.scratch("rd_tmp", acc.size, acc.dtype)
    mine = acc if x is None else x  # what this rank holds so far; acc once it has reduced
    for action, peer in recursive_doubling_schedule(g.size, g.rank):
        if action == EXCHANGE:
            _sendrecv(g.comm, mine, peer, tmp, peer, TAG)
        elif action == TAKE:
            _recv(g.comm, tmp, peer, TAG)
        elif action == RESULT_IN:
            _recv(g.comm, acc, peer, TAG)
            mine = acc
        else:  # GIVE, RESULT_OUT
            _send(g.comm, mine, peer, TAG)
        if action in (EXCHANGE, TAKE):
            ufunc(mine, tmp, out=acc)
            mine = acc
    if mine is not acc:  # only with no rounds at all (one rank)
        acc[...] = mine


def doubling_gather_steps(n: int, r: int) -> list[tuple[int, tuple[int, int], tuple[int, int]]]:
    """Rank r's rounds of a recursive-doubling all-gather (n a power of two): (partner,
    blocks sent [lo, hi), blocks received [lo, hi)).  At round k (mask = 2^k) rank r holds
    the blocks of its aligned group of ``mask`` ranks and swaps them with r ^ mask's group,
    which lies right beside it."""
    steps, mask = [], 1
    while mask < n:
        mine, theirs = r & ~(mask - 1), (r ^ mask) & ~(mask - 1)  # first block of each group
        steps.append((r ^ mask, (mine, mine + mask), (theirs, theirs + mask)))
        mask <<= 1
    return steps


def recursive_doubling_all_gather(g, out: np.ndarray, bounds) -> None:
    """All-gather in place in flat ``out`` (block b = out[bounds[b]], this rank's already
    there), n a power of two: log2 N rounds, (N-1)/N * X bytes per rank."""
    for peer, (s0, s1), (r0, r1) in doubling_gather_steps(g.size, g.rank):
        _sendrecv(g.comm, out[bounds[s0][0]:bounds[s1 - 1][1]], peer, out[bounds[r0][0]:bounds[r1 - 1][1]], peer, TAG)


def halving_steps(n: int, r: int, bounds) -> list:
    """Rank r's rounds of a recursive-halving reduce-scatter over n ranks (a power of two),
    as (peer, send_lo, send_hi, keep_lo, keep_hi) element ranges of the flat vector: round
    k (mask = N/2, N/4, ..., 1) keeps the half of this rank's range that holds its own block
    and sends the other half to r ^ mask, the partner responsible for it."""
    steps, lo, hi, mask = [], 0, n, n // 2
    while mask:
        mid = lo + mask
        if r & mask:
            send, lo = (lo, mid), mid
        else:
            send, hi = (mid, hi), mid
        steps.append((r ^ mask, bounds[send[0]][0], bounds[send[1] - 1][1], bounds[lo][0], bounds[hi - 1][1]))
        mask //= 2
    return steps


def recursive_halving_reduce_scatter(g, x: np.ndarray, bounds, ufunc, result: np.ndarray) -> None:
    """Reduce-scatter of flat ``x`` (block b = x[bounds[b]]) for n a power of two; block r
    lands in ``result``.  Each round adds the partner's partial sums of the kept half: the
    first from ``x`` itself, later rounds in place in a scratch buffer, the last into ``result``."""
    steps = halving_steps(g.size, g.rank, bounds)
    first_keep = steps[0][4] - steps[0][3]
    acc = g.scratch("rh_acc", first_keep, x.dtype)
    tmp = g.scratch("rh_tmp", first_keep, x.dtype)
    cur, base = x, 0  # the partial sums so far, and the element index of cur[0]
    for i, (peer, s_lo, s_hi, k_lo, k_hi) in enumerate(steps):
        got = tmp[:k_hi - k_lo]
        _sendrecv(g.comm, cur[s_lo - base:s_hi - base], peer, got, peer, TAG)
        mine = cur[k_lo - base:k_hi - base]
        if i == len(steps) - 1:
            ufunc(mine, got, out=result)
        elif cur is x:  # first round: the partial sums start in scratch (x is only read)
            ufunc(mine, got, out=acc[:k_hi - k_lo])
            cur, base = acc, k_lo
        else:  # later rounds: in place, the kept half is a prefix or suffix of cur
            ufunc(mine, got, out=mine)


def rabenseifner_all_reduce(g, x: np.ndarray, out: np.ndarray, ufunc) -> None:
    """All-reduce of flat ``x`` into flat ``out`` for n a power of two (Rabenseifner 2004):
    recursive-halving reduce-scatter, then recursive-doubling all-gather in place."""
    bounds = split_bounds(x.size, g.size)
    recursive_halving_reduce_scatter(g, x, bounds, ufunc, out[bounds[g.rank][0]:bounds[g.rank][1]])
    recursive_doubling_all_gather(g, out, bounds)
