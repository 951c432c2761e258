"""Rank bodies for tests/test_comm_mismatch.py: collectives whose ranks disagree on the root,
the algorithm or the collective itself raise CollectiveMismatchError (identity.py), with
the fast path on or off (the test sets MINIDIST_FAST_PATH), without the check mode."""
import time

import numpy as np

from minidist import comm
from minidist.comm.algorithms.pipelined import PIPELINE_BYTES

SIZES = {"4": 4, "1M": 1 << 20}


def _rooted(name, g, x, root):
    if name == "broadcast":
        return comm.broadcast(x, g, root=root)
    if name == "reduce":
        return comm.reduce(x, g, root=root)
    if name == "scatter":
        return comm.scatter(x, g, root=root)
    return comm.gather(x, g, root=root)


def _expect_mismatch(fn, *needles):
    """Run ``fn``: it must raise CollectiveMismatchError (and no other error first) within
    seconds; returns its message."""
    t0 = time.monotonic()
    try:
        fn()
    except comm.CollectiveMismatchError as err:
        elapsed = time.monotonic() - t0
        assert elapsed < 15, f"the mismatch took {elapsed:.1f} s"
        assert err.__context__ is None or err.__suppress_context__, f"chained behind {err.__context__!r}"
        msg = str(err)
        for needle in needles:
            assert needle in msg, f"{needle!r} not in error message: {msg}"
        return msg
    raise AssertionError(f"expected a CollectiveMismatchError mentioning {needles}")


def per_rank_roots(name):
    """Every rank passes its own rank as the root: each one alone would act as the root, so
    without the handshake no message is received (small: wrong answers; large: a hang).
    Every rank raises, at 4 and 1M elements; then the group still works (nothing of the
    failed call is left in flight) and the matched call gives the right answer."""
    g = comm.world()
    n, r = g.size, g.rank
    for label, size in SIZES.items():
        x = np.arange(size, dtype=np.float64) + 1000 * r
        msg = _expect_mismatch(lambda: _rooted(name, g, x, r), f"root={r}", f"root={(r - 1) % n}", name)
        assert f"rank {(r - 1) % n} sent {name}(" in msg, msg
        for _ in range(2):  # the matched call, twice (and an all-reduce): nothing stale arrives
            got = _rooted(name, g, x, 1 % n)
            if name == "broadcast":
                assert np.array_equal(got, np.arange(size) + 1000 * (1 % n))
            elif name == "reduce":
                assert got is None if r != 1 % n else np.array_equal(got, n * np.arange(size) + 1000 * sum(range(n)))
            elif name == "scatter":
                lo, hi = np.array_split(np.arange(size), n)[r][[0, -1]]
                assert np.array_equal(got, np.arange(lo, hi + 1) + 1000 * (1 % n))
            else:
                assert got is None if r != 1 % n else got.shape == (n * size,)
            assert np.array_equal(comm.all_reduce(np.ones(3), g), np.full(3, float(n)))
        print(f"rank {r}: {name} with per-rank roots raised at {label} elements", flush=True)
    print(f"rank {r}: {name} per-rank roots done", flush=True)


def one_rank_other_root(name, size):
    """The last rank passes root 1, the others root 0 (left uncaught): the ranks next to the
    disagreement raise at the handshake, and their errors end the job (the abort hook).  A
    rank between them may finish its part of the call (a reduce's leaf sends and returns)."""
    g = comm.world()
    x = np.arange(SIZES[size], dtype=np.float64)
    _rooted(name, g, x, 1 if g.rank == g.size - 1 else 0)
    print(f"rank {g.rank}: returned", flush=True)
    assert 0 < g.rank < g.size - 1, "a rank next to the disagreement went on"


def different_algorithms():
    """Two ranks that force different algorithms (all_reduce, reduce_scatter, broadcast,
    reduce) both raise, naming both algorithms, on the general path and once plans are
    cached; nothing is left in flight, so the matched calls after them work."""
    g = comm.world()
    r = g.rank
    assert g.size == 2
    x = np.arange(8, dtype=np.float64)
    for _ in range(3):  # later rounds: the matched calls below have cached their plans
        _expect_mismatch(lambda: comm.all_reduce(x, g, algorithm="ring" if r else "recursive_doubling"),
                         "by ring", "by recursive_doubling")
        _expect_mismatch(lambda: comm.reduce_scatter(x, g, algorithm="ring" if r else "direct"),
                         "by ring", "by direct")
        _expect_mismatch(lambda: comm.broadcast(x, g, root=0, algorithm="chain" if r else "binomial"),
                         "by chain", "by binomial", "root=0")
        _expect_mismatch(lambda: comm.reduce(x, g, root=1, algorithm="chain" if r else "binomial"),
                         "reduce(op=sum, float64, [64 B, 128 B), root=1) by chain", "by binomial")
        assert np.array_equal(comm.all_reduce(x, g), 2 * x)
        assert np.array_equal(comm.reduce_scatter(x, g), (2 * x)[4 * r:4 * r + 4])
    print(f"rank {r}: different algorithms raised")


def all_reduce_against_all_gather(size, catch="1"):
    """Rank 0 all-reduces, the others all-gather the same array: CollectiveMismatchError is the
    first error (not a CommError about the all-gather's room, with the mismatch behind it);
    with ``catch``, every rank raises it and the group is still usable afterwards."""
    g = comm.world()
    x = np.arange(int(size), dtype=np.float32)

    def call():
        return comm.all_reduce(x, g) if g.rank == 0 else comm.all_gather(x, g)

    if catch != "1":
        call()
        raise AssertionError("a collective mismatch went unnoticed")
    # Above one pipeline chunk the all-reduce has its next chunk in flight when it raises, so
    # the group is not used again then.
    small = x.nbytes <= PIPELINE_BYTES
    for _ in range(2 if small else 1):  # the second time with the plans of the matched calls below cached
        _expect_mismatch(call, "all_gather(float32)", "all_reduce(op=sum, float32")
        if small:
            assert np.array_equal(comm.all_reduce(x, g), g.size * x)
            assert np.array_equal(comm.all_gather(x, g), np.tile(x, g.size))
    print(f"rank {g.rank}: all_reduce against all_gather raised CollectiveMismatchError first")


def mixed_paths():
    """Rank 0 runs every call on the general path, the others from cached plans: each plan's
    identity tag (algorithm included) is the general path's for the same call, so they still
    pair up (no spurious CollectiveMismatchError) and give the right answers.  The sizes
    reach every plan kind a group of this size has (fast/__init__.py's _make)."""
    g = comm.world()
    n, r = g.size, g.rank
    if r == 0:
        comm.set_fast_path(False)
    for size in (64, 30_000, 200_000):  # float32 elements per rank: every plan kind on 2 to 5 ranks
        x = (np.arange(n * size, dtype=np.float32) % 97) * (r + 1)
        total = (np.arange(n * size, dtype=np.float32) % 97) * (n * (n + 1) // 2)
        own = x[r * size:(r + 1) * size]
        full = np.empty(n * size, np.float32)
        for _ in range(3):  # the first call makes the plan; the others run it (not on rank 0)
            assert np.array_equal(comm.all_reduce(x, g), total)
            assert np.array_equal(comm.reduce_scatter(x, g), total[r * size:(r + 1) * size])
            blocks = [(np.arange(n * size, dtype=np.float32) % 97)[j * size:(j + 1) * size] * (j + 1) for j in range(n)]
            assert np.array_equal(comm.all_gather(own, g), np.concatenate(blocks))
            assert np.array_equal(comm.all_gather(own, g, out=full), np.concatenate(blocks))
    kinds = sorted({type(p).__name__ for p in g._plans.values()})
    print(f"rank {r}: mixed paths agree; plans {kinds}", flush=True)


def different_pairs():
    """ppermute with different pairs on the ranks: a hash of the pairs rides in the tag, so
    the rank that gets a message sent under the other pairs raises instead of taking it
    (last: the other rank's unreceived message is left behind).  The same pairs in another
    order agree."""
    g = comm.world()
    r = g.rank
    assert g.size == 2
    x = np.arange(4, dtype=np.float64) + r
    swap = [(0, 1), (1, 0)]
    got = comm.ppermute(x, g, swap if r == 0 else swap[::-1])  # the same pairs, in another order
    assert np.array_equal(got, np.arange(4) + 1 - r)
    if r == 0:
        _expect_mismatch(lambda: comm.ppermute(x, g, swap), "ppermute(float64, [32 B, 64 B), pairs #")
    else:  # sends to rank 0, receives nothing
        assert not comm.ppermute(x, g, [(1, 0)]).any()
    print(f"rank {r}: ppermute pairs checked")
