"""How many bytes does each rank send in a ring collective?  Measured vs the formulas.

Run:  mpiexec -n 4 python examples/02_ring_traffic.py

A ring (Patarasuk & Yuan 2009) cuts a message of X bytes into N blocks.  In a ring
reduce-scatter every rank passes N-1 blocks to its right neighbour, adding its own
contribution on the way: (N-1)/N * X bytes sent per rank.  A ring all-gather circulates the
N finished blocks the same way: (N-1)/N * X again.  An all-reduce is the two in a row.
The all-reduce and reduce-scatter below run the textbook ring, minidist/comm/algorithms/ring.py
(``algorithm="ring"``), which reads on one screen:

    all_reduce      2 (N-1)/N * X      (independent of N for large N: ~2X, the lower bound)
    reduce_scatter    (N-1)/N * X      (X = the full input on each rank)
    all_gather        (N-1)/N * X      (X = the full output on each rank); without out=
                      and N > 2, plus 8 (N-1) bytes: each block carries its row count

Every message minidist sends is counted per collective (``comm.stats()``), so the formulas
can be checked exactly (with N = 2, 4 or 8 ranks; other N do not divide the messages into
equal blocks, so ranks differ by a few bytes).  For comparison, the latency-optimal recursive doubling that
minidist uses for small all-reduces sends log2(N) * X: fewer rounds, more bytes.
"""

import math

from minidist import comm
from minidist.model.backend import to_host, xp

SIZES = [4096, 65536, 1 << 20]  # bytes; float32, so divisible by N for N = 1, 2, 4, 8


def measure(g, name, run):
    """Bytes every rank sent for one call of ``run``, as a list indexed by rank."""
    comm.reset_stats()
    run()
    sent = comm.stats().get(name, {}).get("bytes_sent", 0)
    counts = comm.gather(xp.asarray([sent], dtype=xp.int64), g, root=0)
    comm.reset_stats()  # the gather above is not part of the measurement
    return None if counts is None else [int(c) for c in to_host(counts)]


def row(name, nbytes, sent, formula_text, formula_bytes):
    low, high = min(sent), max(sent)
    measured = f"{low}" if low == high else f"{low}..{high}"
    if low == high == formula_bytes:
        verdict = "exact"
    else:
        verdict = f"differs by {high - formula_bytes:+d} B"
    return f"{name:<18} {nbytes:>9} {measured:>10}   {formula_text:<17} {formula_bytes:>10}   {verdict}"


def main():
    g = comm.world()
    n = g.size
    lines = []
    for nbytes in SIZES:
        x = xp.ones(nbytes // 4, dtype=xp.float32)
        ring = (n - 1) * nbytes // n
        cases = [
            ("all_reduce", lambda: comm.all_reduce(x, g, algorithm="ring"), "2(N-1)/N * X", 2 * ring),
            ("reduce_scatter", lambda: comm.reduce_scatter(x, g, algorithm="ring"), "(N-1)/N * X", ring),
            # all_gather's X is its output: each rank contributes X/N bytes.  Inputs may be
            # uneven, so with N > 2 every block travels with its row count (one int64) in
            # front: a Bruck all-gather in which each rank sends the N-1 other blocks once.
            # (With N = 2 the receiver reads the count off the message size instead.)
            ("all_gather", lambda: comm.all_gather(x[: x.size // n], g), "(N-1)/N*X+8(N-1)",
             ring + (8 * (n - 1) if n > 2 else 0)),
            # With out= (a host array; its first dim is the total) every block's size is
            # known in advance and the blocks go straight into out: no counts on the wire.
            ("all_gather out=", lambda: comm.all_gather(x[: x.size // n], g, out=to_host(x[: n * (x.size // n)]).copy()),
             "(N-1)/N * X", ring),
        ]
        for name, run, text, formula in cases:
            sent = measure(g, name.split()[0], run)
            if g.rank == 0:
                lines.append(row(name, nbytes, sent, text, formula))
    small = SIZES[0]
    sent = measure(g, "all_reduce", lambda: comm.all_reduce(xp.ones(small // 4, xp.float32), g,
                                                            algorithm="recursive_doubling"))
    if g.rank == 0:
        print(f"Bytes sent per rank on {n} ranks (X = message size in bytes, from comm.stats())\n")
        print(f"{'collective':<18} {'X':>9} {'sent':>10}   {'formula':<17} {'formula B':>10}   check")
        print("\n".join(lines))
        if n & (n - 1) == 0:  # recursive doubling sends a full copy in each of log2(N) rounds
            print("\nfor comparison, the small-message algorithm:")
            lg = int(math.log2(n))
            print(row("recursive_doubling", small, sent, "log2(N) * X", lg * small))
        print("\nRing traffic per rank stays below 2X however many ranks join: that is why")
        print("large gradients are all-reduced with rings (Patarasuk & Yuan 2009).")


if __name__ == "__main__":
    main()
