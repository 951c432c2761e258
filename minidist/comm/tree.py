"""Latency-optimal collectives: O(log N) rounds, for small messages.

With tiny messages the cost is the number of rounds times the per-message latency (alpha in
the alpha-beta model), so these algorithms halve or double the set of ranks that hold data
each round (Thakur, Rabenseifner & Gropp 2005, "Optimization of Collective Communication
Operations in MPICH").  They move more bytes per rank than the rings of
:mod:`minidist.comm.ring`, which is why large messages use the rings instead.

All functions work in place on flat, contiguous host arrays and use the group's synchronous
communicator (or, on the progress thread, its duplicate).
"""

from __future__ import annotations

import math
import struct

import numpy as np
from mpi4py import MPI

from minidist.comm import links
from minidist.comm.errors import CommError
from minidist.comm.p2p import TAG_COLLECTIVE as TAG, _recv, _send, _sendrecv
from minidist.comm.ring import ROWS_RULE, split_bounds as split_bounds_flat

BYTE = MPI.BYTE


# Actions of a recursive-doubling schedule (see recursive_doubling_schedule).
EXCHANGE, GIVE, TAKE, RESULT_OUT, RESULT_IN = "exchange", "give", "take", "result_out", "result_in"


def recursive_doubling_schedule(n: int, r: int) -> tuple:
    """Rank r's rounds of a recursive-doubling all-reduce over n ranks, as (action, peer) pairs.

    For a power of two n: log2(n) EXCHANGE rounds (swap vectors with the rank whose number
    differs in bit k, then reduce).  Otherwise (rem = n - largest power of two) the first
    2*rem ranks pair up first: each even one GIVEs its vector to its odd neighbour (which
    TAKEs and reduces it), sits out the doubling, and at the end gets the result back
    (RESULT_OUT on the odd rank, RESULT_IN on the even one).  The schedule depends only on
    (n, r), so the small-message fast path computes it once per group.
    """
    pof2 = 1 << (n.bit_length() - 1)
    rem = n - pof2
    steps = []
    if r < 2 * rem and r % 2 == 0:
        return ((GIVE, r + 1), (RESULT_IN, r + 1))
    if r < 2 * rem:
        steps.append((TAKE, r - 1))
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
    """All-reduce into ``acc`` by recursive doubling (Thakur et al. 2005, sec. 4.1).

    Rounds: log2(N) for a power of two N; otherwise 2 more, because the first 2*rem ranks
    (rem = N - largest power of two) pair up: even ranks hand their data to the odd
    neighbour, sit out the doubling, and get the result back at the end.  Each round every
    active rank swaps its whole vector with the partner whose rank differs in one bit and
    reduces, so bytes sent per rank = log2(N) * X (more than a ring's 2(N-1)/N * X, but in
    far fewer messages).  Both partners compute a+b == b+a, so all ranks end bitwise equal.

    The input is ``acc`` itself, or ``x`` (same length and dtype, only read) when given:
    then the first round sends x and reduces ``ufunc(x, theirs, out=acc)``, which saves
    copying x into acc first (a full pass over X: for large X as costly as the message).
    """
    comm = g.comm
    tmp = g.scratch("rd_tmp", acc.size, acc.dtype)
    mine = acc if x is None else x  # what this rank holds so far; acc once it has reduced
    for action, peer in recursive_doubling_schedule(g.size, g.rank):
        if action == EXCHANGE:
            _sendrecv(comm, mine, peer, tmp, peer, TAG)
        elif action == TAKE:
            _recv(comm, tmp, peer, TAG)
        elif action == RESULT_IN:
            _recv(comm, acc, peer, TAG)
            mine = acc
        else:  # GIVE, RESULT_OUT
            _send(comm, mine, peer, TAG)
        if action in (EXCHANGE, TAKE):
            ufunc(mine, tmp, out=acc)
            mine = acc
    if mine is not acc:  # only with no rounds at all (one rank)
        acc[...] = mine


def binomial_broadcast(g, buf: np.ndarray, root: int) -> None:
    """Broadcast ``buf`` from ``root`` along a binomial tree (MPICH's short-message bcast).

    ceil(log2 N) rounds; in round k every rank that already has the data sends it to the
    rank 2^k further on, so the number of holders doubles.  Each rank receives X once and
    sends at most log2(N) * X (the root sends the most).
    """
    n, comm = g.size, g.comm
    vr = (g.rank - root) % n  # rank relative to the root, which becomes 0
    mask = 1
    while mask < n:
        if vr & mask:
            _recv(comm, buf, (vr - mask + root) % n, TAG)
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:
        if vr + mask < n:
            _send(comm, buf, (vr + mask + root) % n, TAG)
        mask >>= 1


def binomial_reduce(g, acc: np.ndarray, root: int, ufunc) -> None:
    """Reduce ``acc`` in place onto ``root`` along a binomial tree (a broadcast run backwards).

    ceil(log2 N) rounds; in round k ranks whose relative rank has bit k set send their
    partial result to the rank 2^k below and drop out.  Only the root's ``acc`` holds the
    full result.  Each rank sends X at most once; the root receives log2(N) * X.
    """
    n, comm = g.size, g.comm
    vr = (g.rank - root) % n
    tmp = g.scratch("tree_tmp", acc.size, acc.dtype)
    mask = 1
    while mask < n:
        if vr & mask:
            _send(comm, acc, (vr - mask + root) % n, TAG)
            return
        if vr + mask < n:
            _recv(comm, tmp, (vr + mask + root) % n, TAG)
            ufunc(acc, tmp, out=acc)
        mask <<= 1


def dissemination_barrier(g) -> None:
    """Barrier by dissemination (Hensgen, Finkel & Manber 1988).

    ceil(log2 N) rounds of empty messages: in round k rank r signals r + 2^k and waits for
    r - 2^k.  After the last round every rank has (transitively) heard from every other, so
    none can leave before all have arrived.
    """
    n, r = g.size, g.rank
    empty = np.empty(0, np.uint8)
    dist = 1
    while dist < n:
        _sendrecv(g.comm, empty, (r + dist) % n, empty, (r - dist) % n, TAG)
        dist <<= 1


def bruck_all_gather(g, record: np.ndarray, tag: int = TAG) -> np.ndarray:
    """All-gather one fixed-size byte record per rank; returns shape (N, len(record)).

    Bruck et al. 1997 (also Thakur et al. 2005, sec. 4.2): ceil(log2 N) rounds for any N.
    Rank r keeps records in the order r, r+1, ...; in the round with distance d it sends the
    first d records it has to r - d and appends the d it receives from r + d.  A final
    rotation puts them in rank order.  Used for the call signatures of the debug check,
    where latency matters and records are tiny.
    """
    n, r = g.size, g.rank
    buf = np.empty((n, record.size), np.uint8)
    buf[0] = record
    have = 1
    while have < n:
        cnt = min(have, n - have)
        _sendrecv(g.comm, buf[:cnt], (r - have) % n, buf[have:have + cnt], (r + have) % n, tag)
        have += cnt
    return np.roll(buf, r, axis=0)


def bruck_all_gather_rows(g, x: np.ndarray, out: np.ndarray | None = None):
    """All-gather of ``x`` (rows along axis 0) in ceil(log2 N) rounds, row counts included.
    Returns ``(result, bytes_sent, bytes_received)``; the caller does the accounting.

    Bruck et al. 1997, as in :func:`bruck_all_gather`, but every record is this rank's
    row count (8 bytes) followed by its rows, so the counts travel with the data and no
    separate size exchange (log2 N more rounds) is needed.  Rank r keeps records in the
    order r, r+1, ... packed back to back in one byte buffer; in the round with distance d
    it sends its first min(d, N-d) records (a prefix of the buffer) to r - d and appends
    the records received from r + d, reading their counts to find where each ends.  Room
    for the receive: N records of (rows + 1) rows, enough because row counts differ by at
    most one between ranks (ring.ROWS_RULE; checked on every record, so every rank that
    sees a bad count raises).  Finally each record's rows are copied to their place in the
    result (the price of the packing: one extra pass over the output).
    Per rank: sends and receives N-1 records, (N-1) * (X + 8) bytes for equal blocks.
    """
    n, r, comm = g.size, g.rank, g.comm
    rows, tail = x.shape[0], x.shape[1:]
    row_bytes = math.prod(tail) * x.itemsize
    buf = g.scratch("bruck_rows", n * (8 + (rows + 1) * row_bytes), np.uint8)
    buf[:8].view(np.int64)[0] = rows
    buf[8:8 + x.nbytes] = x.reshape(-1).view(np.uint8)
    starts, counts = [0], [rows]  # byte offset and row count of each record, by position
    end = 8 + x.nbytes
    status = MPI.Status()
    sent = received = 0
    bad = None
    while len(counts) < n:
        have = len(counts)
        cnt = min(have, n - have)
        outgoing = buf[:starts[cnt] if cnt < have else end]
        if links.enabled:
            links.delay(outgoing.nbytes)
        try:
            comm.Sendrecv([outgoing, BYTE], (r - have) % n, TAG, [buf[end:], BYTE], (r + have) % n, TAG, status)
        except MPI.Exception as err:
            raise _rows_error(g, rows, f"more than {buf.nbytes - end} bytes of records", err) from None
        nbytes = status.Get_count(BYTE)
        sent, received = sent + outgoing.nbytes, received + nbytes
        end, c = read_records(buf, end, end + nbytes, cnt, rows, row_bytes, starts, counts)
        if end is None:
            raise records_error(g.name, nbytes, (r + have) % n, cnt, tail, x.dtype)
        bad = c if c is not None else bad  # keep going, so the other ranks get their records
    if bad is not None:
        raise _rows_error(g, rows, f"a block of {bad} rows")
    return unpack_records(buf, starts, counts, r, row_bytes, tail, x.dtype, out), sent, received


_COUNT = struct.Struct("=q")  # a record's row count: native int64


def read_records(buf, end, stop, cnt, rows, row_bytes, starts, counts):
    """Walk ``cnt`` records just received into ``buf[end:stop]`` (each: an 8-byte row count,
    then the rows), appending each one's start and row count.  Returns ``(new_end, bad)``:
    ``new_end`` is None when the bytes do not hold ``cnt`` whole records (the ranks passed
    different trailing shapes or dtypes); ``bad`` is a row count that breaks ROWS_RULE, or None."""
    bad = None
    for _ in range(cnt):
        c = _COUNT.unpack_from(buf, end)[0] if end + 8 <= stop else -1
        if c < 0 or end + 8 + c * row_bytes > stop:
            return None, bad
        if abs(c - rows) > 1:
            bad = c
        starts.append(end)
        counts.append(c)
        end += 8 + c * row_bytes
    return end, bad


def records_error(group_name, nbytes, source, cnt, tail, dtype) -> CommError:
    return CommError(f"all_gather on group {group_name!r}: a {nbytes}-byte message from rank {source} does "
                     f"not hold {cnt} records of rows {tail} {dtype}: the ranks passed different trailing "
                     f"shapes or dtypes, or out= on some ranks only or with different shapes (out= picks "
                     f"the algorithm, so it must agree)")


def unpack_records(buf, starts, counts, r, row_bytes, tail, dtype, out=None):
    """Copy each Bruck record's rows to its place in the result (allocated if ``out`` is
    None): record position j holds rank (r + j) % N's block, after its 8-byte row count."""
    n = len(counts)
    by_rank = [counts[(b - r) % n] for b in range(n)]
    shape = (sum(by_rank),) + tail
    if out is None:
        out = np.empty(shape, dtype)
    elif out.shape != shape:
        raise ValueError(f"all_gather: out.shape={out.shape} but the result has shape {shape}")
    flat = out.reshape(-1).view(np.uint8)
    at = 0
    for b in range(n):
        j = (b - r) % n
        size = by_rank[b] * row_bytes
        flat[at:at + size] = buf[starts[j] + 8:starts[j] + 8 + size]
        at += size
    return out


def _rows_error(g, rows, what, err=None) -> Exception:
    if err is not None and err.Get_error_class() != MPI.ERR_TRUNCATE:
        return CommError(f"all_gather: MPI error while receiving on group {g.name!r}: {err}")
    return CommError(f"all_gather on group {g.name!r}: this rank has {rows} rows but received {what}; "
                     f"{ROWS_RULE}.  Rerun with MINIDIST_CHECK_COLLECTIVES=1 to see what each rank called.")


def halving_steps(n: int, r: int, bounds) -> list:
    """Rank r's rounds of a recursive-halving reduce-scatter over n ranks (a power of two),
    as (peer, send_lo, send_hi, keep_lo, keep_hi) element ranges of the flat vector.

    Round k (mask = N/2, N/4, ..., 1) halves the range of blocks this rank is responsible
    for: it keeps the half that holds its own block and sends the other half to r ^ mask,
    the partner responsible for that half.  The schedule depends only on (n, r, bounds), so
    the small-message fast path computes it once.
    """
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
    """Reduce-scatter of flat ``x`` (block b = x[bounds[b]]) by recursive halving (Thakur,
    Rabenseifner & Gropp 2005, sec. 4.3), for N a power of two; block r lands in ``result``.

    log2(N) rounds (see halving_steps).  In each, the rank sends its partial sums of the
    half it gives up and receives the partner's partial sums of the half it keeps, and adds
    them: first round from ``x`` itself, later rounds in place in a scratch buffer, the last
    one into ``result``.  Per rank: X/2 + X/4 + ... = (N-1)/N * X bytes, like the ring, but
    in log2(N) messages instead of N-1 (which matters when each one waits for a scheduler).
    """
    comm = g.comm
    steps = halving_steps(g.size, g.rank, bounds)
    first_keep = steps[0][4] - steps[0][3]
    acc = g.scratch("rh_acc", first_keep, x.dtype)
    tmp = g.scratch("rh_tmp", first_keep, x.dtype)
    cur, base = x, 0  # the partial sums so far, and the element index of cur[0]
    last = len(steps) - 1
    for i, (peer, s_lo, s_hi, k_lo, k_hi) in enumerate(steps):
        got = tmp[:k_hi - k_lo]
        _sendrecv(comm, cur[s_lo - base:s_hi - base], peer, got, peer, TAG)
        mine = cur[k_lo - base:k_hi - base]
        if i == last:
            ufunc(mine, got, out=result)
        elif cur is x:  # first round: the partial sums start in scratch (x is only read)
            ufunc(mine, got, out=acc[:k_hi - k_lo])
            cur, base = acc, k_lo
        else:  # later rounds: in place, the kept half is a prefix or suffix of cur
            ufunc(mine, got, out=mine)


def rabenseifner_all_reduce(g, x: np.ndarray, out: np.ndarray, ufunc) -> None:
    """All-reduce of flat ``x`` into flat ``out`` for N a power of two (Rabenseifner 2004;
    Thakur et al. 2005, sec. 4.1): recursive-halving reduce-scatter, then the mirror image,
    a recursive-doubling all-gather in place in ``out``.

    2 log2(N) rounds; per rank 2(N-1)/N * X bytes, the bandwidth lower bound like the
    ring's, in log2 N instead of N-1 messages per phase.
    """
    bounds = split_bounds_flat(x.size, g.size)
    recursive_halving_reduce_scatter(g, x, bounds, ufunc, out[bounds[g.rank][0]:bounds[g.rank][1]])
    recursive_doubling_all_gather(g, out, bounds)


def recursive_doubling_all_gather(g, out: np.ndarray, bounds) -> None:
    """All-gather in place in flat ``out`` for N a power of two, block b = out[bounds[b]],
    this rank's block already there (Thakur et al. 2005, sec. 4.2).

    Round k (mask = 1, 2, ..., N/2): this rank holds the blocks of its aligned group of
    ``mask`` ranks and swaps them with the partner r ^ mask, whose blocks sit right beside
    them in ``out``; log2 N rounds, (N-1)/N * X bytes per rank.
    """
    n, r, comm = g.size, g.rank, g.comm
    mask = 1
    while mask < n:
        mine, theirs = r & ~(mask - 1), (r ^ mask) & ~(mask - 1)  # first rank of each group
        _sendrecv(comm, out[bounds[mine][0]:bounds[mine + mask - 1][1]], r ^ mask,
                  out[bounds[theirs][0]:bounds[theirs + mask - 1][1]], r ^ mask, TAG)
        mask <<= 1
