"""Bruck's all-gather: ceil(log2 N) rounds for any N, and the variant that carries row counts.

Bruck et al. 1997 (also Thakur, Rabenseifner & Gropp 2005, sec. 4.2).  Rank r keeps records
in the order r, r+1, ...; in the round with distance d it sends the first min(d, N-d)
records it has to r - d and appends those it receives from r + d.  A final rotation puts
them in rank order.  Each rank receives every other record once: (N-1) records per rank.
"""

from __future__ import annotations

import math
import struct

import numpy as np

from minidist.comm.algorithms.blocks import rows_error
from minidist.comm.errors import CommError
from minidist.comm.p2p import TAG_COLLECTIVE as TAG, _exchange, _sendrecv


def bruck_steps(n: int, r: int) -> list[tuple[int, int, int, int]]:
    """Rank r's rounds: (records held before, records to send, send to, receive from)."""
    steps, have = [], 1
    while have < n:
        cnt = min(have, n - have)
        steps.append((have, cnt, (r - have) % n, (r + have) % n))
        have += cnt
    return steps


def bruck_all_gather(g, record: np.ndarray, tag: int = TAG) -> np.ndarray:
    """All-gather one fixed-size byte record per rank; returns shape (N, len(record)).
    Used for the call signatures of the check mode, where records are tiny."""
    n, r = g.size, g.rank
    buf = np.empty((n, record.size), np.uint8)
    buf[0] = record
    for have, cnt, dest, source in bruck_steps(n, r):
        _sendrecv(g.comm, buf[:cnt], dest, buf[have:have + cnt], source, tag)
    return np.roll(buf, r, axis=0)


def bruck_all_gather_rows(g, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """All-gather of ``x`` (rows along axis 0), row counts included: every record is this
    rank's row count (8 bytes) followed by its rows, so the counts travel with the data and
    no separate size exchange (log2 N more rounds) is needed.  (N-1) * (X + 8) bytes per rank.

    Records are packed back to back in one byte buffer; a rank reads each received record's
    count to find where it ends.  Room for N records of (rows + 1) rows is enough, because
    row counts differ by at most one (ROWS_RULE, checked on every record, so every rank that
    sees a bad count raises).  Finally each record's rows are copied to their place in the
    result: the price of the packing, one extra pass over the output.
    """
    n, r = g.size, g.rank
    rows, tail = x.shape[0], x.shape[1:]
    row_bytes = math.prod(tail) * x.itemsize
    buf = g.scratch("bruck_rows", n * (8 + (rows + 1) * row_bytes), np.uint8)
    buf[:8].view(np.int64)[0] = rows
    buf[8:8 + x.nbytes] = x.reshape(-1).view(np.uint8)
    starts, counts = [0], [rows]  # byte offset and row count of each record, by position
    end = 8 + x.nbytes
    bad = None
    for have, cnt, dest, source in bruck_steps(n, r):
        outgoing = buf[:starts[cnt] if cnt < have else end]
        nbytes = _exchange(g.comm, outgoing, dest, buf[end:], source, TAG)
        if type(nbytes) is str:
            raise rows_error(g, rows, f"more than {buf.nbytes - end} bytes of records")
        end, c = read_records(buf, end, end + nbytes, cnt, rows, row_bytes, starts, counts)
        if end is None:
            raise records_error(g.name, nbytes, source, cnt, tail, x.dtype)
        bad = c if c is not None else bad  # keep going, so the other ranks get their records
    if bad is not None:
        raise rows_error(g, rows, f"a block of {bad} rows")
    return unpack_records(buf, starts, counts, r, row_bytes, tail, x.dtype, out)


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
    """Copy each record's rows to its place in the result (allocated if ``out`` is None):
    record position j holds rank (r + j) % N's block, after its 8-byte row count."""
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
