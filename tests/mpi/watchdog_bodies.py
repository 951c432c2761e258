"""Rank bodies for tests/test_watchdog.py: lost ranks (the watchdog) and mismatched calls
(identity tags), without the check mode."""
import time

import numpy as np

from minidist import comm


def _expect_mismatch(fn, *needles):
    try:
        fn()
    except comm.CollectiveMismatchError as err:
        msg = str(err)
        for needle in needles:
            assert needle in msg, f"{needle!r} not in error message: {msg}"
        return msg
    raise AssertionError(f"expected a CollectiveMismatchError mentioning {needles}")


def skip_collective(warm="0"):
    """Rank 1 skips an all-reduce (after ``warm`` matched ones, which build the cached plan),
    then waits for a message rank 0 never sends: both ranks wait forever, until the watchdog."""
    g = comm.world()
    x = np.ones(4, np.float32)
    for _ in range(int(warm)):
        comm.all_reduce(x, g)
    print(f"rank {g.rank}: started at {time.time():.3f}", flush=True)
    if g.rank == 0:
        comm.all_reduce(x, g)
    else:
        comm.recv((4,), np.float32, 0, g, tag=5)
    raise AssertionError("a lost collective went unnoticed")


def middle_rank_exits():
    """The middle one of three ranks leaves the program; the others all-reduce without it."""
    g = comm.world()
    comm.all_reduce(np.ones(4, np.float32), g)
    if g.rank == 1:
        print("rank 1: leaving", flush=True)
        return
    comm.all_reduce(np.ones(4, np.float32), g)
    raise AssertionError("a rank that left went unnoticed")


def mismatches():
    """Dtype-only, op-only and collective mismatches raise CollectiveMismatchError on every
    rank, naming both calls; on the general path (first calls) and once plans are cached.
    Every rank receives from the odd one (two ranks; reduce-scatter's one-shot round on
    more), so all of them raise, and nothing stays in flight: the group is still usable."""
    g = comm.world()
    n, r = g.size, g.rank
    odd = r == n - 1
    for attempt in range(3):  # 0: general path everywhere; later: plans for the agreeing calls
        x = np.arange(4 * n, dtype=np.float32)
        if n == 2:
            # dtype only: float32 and int32 of the same size
            y = x.view(np.int32) if odd else x
            _expect_mismatch(lambda: comm.all_reduce(y, g), "all_reduce(op=sum, float32", "all_reduce(op=sum, int32")
            # op only
            _expect_mismatch(lambda: comm.all_reduce(x, g, op="max" if odd else "sum"),
                             "all_reduce(op=sum, float32", "all_reduce(op=max, float32")
            # different collectives, same bytes
            call = (lambda: comm.all_reduce(x, g)) if odd else (lambda: comm.all_gather(x, g))
            _expect_mismatch(call, "all_gather(float32)", "all_reduce(op=sum, float32")
        # reduce-scatter (one-shot round: every rank hears from every other)
        y = x.view(np.int32) if odd else x
        _expect_mismatch(lambda: comm.reduce_scatter(y, g), "reduce_scatter(op=sum, float32",
                         "reduce_scatter(op=sum, int32")
        _expect_mismatch(lambda: comm.reduce_scatter(x, g, op="min" if odd else "sum"),
                         "reduce_scatter(op=sum, float32", "reduce_scatter(op=min, float32")
        # the matched calls work, and cache their plans for the next attempt
        assert np.array_equal(comm.all_reduce(x, g), x * n)
        assert np.array_equal(comm.reduce_scatter(x, g), (x * n)[4 * r:4 * r + 4])
        assert np.array_equal(comm.all_gather(x, g), np.tile(x, n))
    # User messages have a communicator of their own: one in flight meets no collective.
    if n == 2:
        if r == 0:
            comm.send(np.full(3, 7.0), 1, g, tag=3)
        assert np.array_equal(comm.all_reduce(x, g), x * n)
        if r == 1:
            assert comm.recv((3,), np.float64, 0, g, tag=3).tolist() == [7.0] * 3
    print(f"rank {r}: every mismatch raised")


def switches():
    """MINIDIST_TIMEOUT_S=0 and MINIDIST_COLLECTIVE_TAGS=0: no watchdog, plain tags (a dtype
    mismatch of equal sizes then goes unseen, as before), and everything still works."""
    from minidist.comm import identity, watchdog

    g = comm.world()
    assert comm.timeout() == 0 and watchdog._thread is None and not identity.tags_enabled
    x = np.arange(8, dtype=np.float32)
    for _ in range(3):
        assert np.array_equal(comm.all_reduce(x, g), x * g.size)
        assert np.array_equal(comm.reduce_scatter(x, g), (x * g.size)[4 * g.rank:4 * g.rank + 4])
    comm.all_reduce(x.view(np.int32) if g.rank else x, g)  # unseen without tags (and without check mode)
    comm.set_timeout(100)
    assert comm.timeout() == 100 and watchdog._thread is not None and watchdog._thread.is_alive()
    print(f"rank {g.rank}: switches work")
