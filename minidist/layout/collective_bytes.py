"""What one collective call sends from one rank, in bytes, in closed form (no MPI).

One function per collective, for the algorithm minidist's comm layer picks for that size
(comm/reducing.py, comm/collectives.py): a small all-reduce is recursive doubling (log2(N)
messages of X, plus the fold-in of a non-power-of-two count), a large one the ring's
2(N-1)/N X; uneven blocks split as np.array_split does; float16/bfloat16 are reduced in
float32, 4 bytes per element on the wire.  traffic.py sums them into a step's
bytes per mesh axis.
"""

from __future__ import annotations

from minidist.layout.split import split_sizes
from minidist.layout.thresholds import SMALL_ALL_REDUCE_BYTES, SMALL_ALL_REDUCE_BYTES_WIDE, SMALL_BROADCAST_BYTES

def acc_itemsize(itemsize: int) -> int:
    """Bytes per element a reduction sends: float16/bfloat16 are reduced in float32
    (comm/reduction.py accumulator_dtype)."""
    return 4 if itemsize == 2 else itemsize


def doubling_messages(n: int, r: int) -> int:
    """Whole-vector messages rank r sends in a recursive-doubling all-reduce over n ranks
    (Thakur, Rabenseifner & Gropp 2005; doubling.recursive_doubling_schedule): log2(N) on
    2^k ranks; otherwise the first 2*rem ranks pair up, the even one sends once (GIVE) and
    its odd partner sends the result back (RESULT_OUT) after its log2(pof2) exchanges."""
    if n == 1:
        return 0
    pof2 = 1 << (n.bit_length() - 1)
    rem, rounds = n - pof2, pof2.bit_length() - 1
    if r < 2 * rem:
        return 1 if r % 2 == 0 else rounds + 1
    return rounds


def all_reduce_bytes(numel: int, itemsize: int, n: int, r: int, algorithm: str = "auto") -> int:
    """Bytes rank r sends in ``comm.all_reduce`` of ``numel`` elements over n ranks, with
    the algorithm reducing.all_reduce_algorithm picks: recursive doubling up to 512 KiB,
    log2(N) X (doubling.py); above, pairwise reduce-scatter then all-gather (reducing.
    pairwise_all_reduce), 2(N-1)/N X for even blocks; ``"ring"``: Patarasuk & Yuan 2009,
    2(N-1)/N X (ring.py).  Blocks are np.array_split pieces of the flat vector."""
    if n == 1:
        return 0
    b = acc_itemsize(itemsize)
    if algorithm == "auto":
        limit = SMALL_ALL_REDUCE_BYTES if n <= 2 else SMALL_ALL_REDUCE_BYTES_WIDE
        algorithm = "recursive_doubling" if numel * b <= limit or numel < n else "pairwise"
    if algorithm == "recursive_doubling":
        return doubling_messages(n, r) * numel * b
    blocks = split_sizes(numel, n)
    if algorithm == "ring":  # ring reduce-scatter sends every block but r, the all-gather every block but r+1
        return (2 * numel - blocks[r] - blocks[(r + 1) % n]) * b
    if algorithm == "pairwise":
        scatter = numel - blocks[r]  # pairwise.pairwise_reduce_scatter: every block but r, once
        if n & (n - 1) == 0:  # doubling all-gather: round k sends the 2^k blocks held so far
            gather = sum(sum(blocks[(r & ~(m - 1)) + i] for i in range(m)) for m in _powers(n))
        else:
            gather = numel - blocks[(r + 1) % n]
        return (scatter + gather) * b
    raise ValueError(f"all_reduce_bytes: no formula for algorithm {algorithm!r}")


def _powers(n):
    m = 1
    while m < n:
        yield m
        m <<= 1


def reduce_scatter_bytes(rows: int, row_numel: int, itemsize: int, n: int, r: int) -> int:
    """Bytes rank r sends in ``comm.reduce_scatter`` of ``rows`` rows: whatever the algorithm
    (one-shot, halving, ring, pairwise), every block but its own leaves it once, summed
    into another rank's block: (N-1)/N X for even blocks (Thakur et al. 2005)."""
    if n == 1:
        return 0
    return (rows - split_sizes(rows, n)[r]) * row_numel * acc_itemsize(itemsize)


def all_gather_bytes(rows_of: list[int], row_bytes: int, r: int) -> int:
    """Bytes rank r sends in ``comm.all_gather`` (no ``out=``) when rank j holds
    ``rows_of[j]`` rows: two ranks swap their blocks (pairwise.pair_all_gather); more
    run Bruck (Bruck et al. 1997; bruck.bruck_all_gather_rows), each record an 8-byte row
    count and its rows, round k sending the first min(2^k, N - 2^k) records held."""
    n = len(rows_of)
    if n == 1:
        return 0
    if n == 2 and row_bytes:
        return rows_of[r] * row_bytes
    sent, have = 0, 1
    while have < n:
        cnt = min(have, n - have)
        sent += sum(8 + rows_of[(r + j) % n] * row_bytes for j in range(cnt))
        have += cnt
    return sent


def broadcast_bytes(nbytes: int, n: int, r: int, root: int) -> int:
    """Bytes rank r sends in ``comm.broadcast`` of ``nbytes`` (up to 256 KiB: the binomial
    tree, trees.binomial_broadcast; each rank forwards to vr + 2^k for every 2^k below the
    bit it received on; above: the pipelined chain, every rank but the last sends X once)."""
    if n == 1:
        return 0
    vr = (r - root) % n
    if nbytes > SMALL_BROADCAST_BYTES:
        return nbytes if vr < n - 1 else 0
    low = vr & -vr if vr else 1 << (n - 1).bit_length()
    return sum(nbytes for m in _powers(low) if vr + m < n)


def all_to_all_bytes(rows: int, row_bytes: int, n: int, r: int) -> int:
    """Bytes rank r sends in ``comm.all_to_all`` of ``rows`` rows: every part but its own
    (pairwise.pairwise_all_to_all), (N-1)/N X for even parts."""
    return (rows - split_sizes(rows, n)[r]) * row_bytes if n > 1 else 0
