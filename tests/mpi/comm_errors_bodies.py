"""Rank bodies for the bad-input tests in tests/test_collectives.py."""
import numpy as np

from minidist import comm
from minidist.comm import reducing


def _expect(exc_type, fn, *needles):
    try:
        fn()
    except exc_type as err:
        msg = str(err)
        for needle in needles:
            assert needle in msg, f"{needle!r} not in error message: {msg}"
        return msg
    raise AssertionError(f"expected {exc_type.__name__} mentioning {needles}")


def bad_input():
    """Locally wrong arguments raise on every rank, naming the value, before any message."""
    g = comm.world()
    n, r = g.size, g.rank
    x = np.ones(6, np.float32)
    for fn in (comm.broadcast, comm.reduce, comm.gather):
        _expect(ValueError, lambda: fn(x, g, root=n), f"root={n}")
        _expect(ValueError, lambda: fn(x, g, root=-1), "root=-1")
    _expect(ValueError, lambda: comm.scatter(x, g, root=n + 3), f"root={n + 3}")
    _expect(ValueError, lambda: comm.ppermute(x, g, [(0, 1), (2, 1)]), "destination", "[1]")
    _expect(ValueError, lambda: comm.ppermute(x, g, [(0, 1), (0, 2)]), "source", "[0]")
    _expect(ValueError, lambda: comm.ppermute(x, g, [(0, n)]), f"(0, {n})")
    _expect(ValueError, lambda: comm.all_reduce(x, g, op="prod"), "op='prod'")
    _expect(TypeError, lambda: comm.all_reduce(x.astype(np.uint8), g), "uint8")
    _expect(TypeError, lambda: comm.all_reduce([1.0, 2.0], g), "list")
    _expect(ValueError, lambda: comm.reduce_scatter(np.zeros((), np.float32), g), "0-d")
    _expect(ValueError, lambda: comm.all_reduce(x, g, algorithm="magic"), "algorithm='magic'")
    if n & (n - 1):
        _expect(ValueError, lambda: comm.all_reduce(x, g, algorithm="rabenseifner"), "power-of-two", f"{n} ranks")
    _expect(ValueError, lambda: comm.send(x, n, g), f"dst={n}")
    _expect(ValueError, lambda: comm.send(x, 0, g, tag=40000), "tag=40000")
    _expect(ValueError, lambda: comm.set_link_model(latency_us=-5), "latency_us=-5")
    _expect(ValueError, lambda: comm.set_link_model(gbps=0), "gbps=0")
    _expect(TypeError, lambda: comm.all_reduce(x, "world"), "Group")
    _expect(ValueError, lambda: comm.all_reduce(x, g, out=np.empty(7, np.float32)), "out.shape=(7,)")
    _expect(ValueError, lambda: comm.all_reduce(x, g, out=np.empty(6, np.float64)), "float32")
    frozen = np.empty(6, np.float32)
    frozen.flags.writeable = False
    _expect(ValueError, lambda: comm.all_reduce(x, g, out=frozen), "out is read-only")
    # ... also once a plan is cached: recursive doubling, and pairwise exchange (a tiny
    # threshold sends 3000 floats that way).  The plans hand the call to the general path,
    # which refuses it before any message, instead of numpy failing between two messages.
    saved, reducing.SMALL_ALL_REDUCE_BYTES_WIDE = reducing.SMALL_ALL_REDUCE_BYTES_WIDE, 64
    for size in (6, 3000):
        y = np.ones(size, np.float32)
        for _ in range(2):
            comm.all_reduce(y, g, out=np.empty_like(y))
        ro = np.empty_like(y)
        ro.flags.writeable = False
        _expect(ValueError, lambda: comm.all_reduce(y, g, out=ro), "out is read-only")
    reducing.SMALL_ALL_REDUCE_BYTES_WIDE = saved
    # Nobody sent anything, so the group is still usable.
    assert np.array_equal(comm.all_reduce(x, g), x * n)
    print(f"rank {r}: bad input rejected")


def check_mode_mismatch():
    """MINIDIST_CHECK_COLLECTIVES=1: every rank raises, showing what each rank called."""
    g = comm.world()
    n, r = g.size, g.rank
    assert comm.check_enabled(), "the test launches this body with MINIDIST_CHECK_COLLECTIVES=1"
    x = np.ones(4 + (r == 1), np.float32)  # rank 1 has a (5,) array, the others (4,)
    msg = _expect(comm.CollectiveMismatchError, lambda: comm.all_reduce(x, g), "rank 0: all_reduce(shape=(4,)",
                  "rank 1: all_reduce(shape=(5,)")
    print(f"rank {r} caught: {msg.splitlines()[0]}")
    # Async: the mismatch is found on the progress thread and re-raised by wait().
    h = comm.all_reduce(x, g, async_op=True)
    _expect(comm.CollectiveMismatchError, h.wait, "rank 1: all_reduce(shape=(5,)")
    # Different collectives on different ranks.
    y = np.ones(4, np.float32)
    call = (lambda: comm.all_gather(y, g)) if r == 0 else (lambda: comm.all_reduce(y, g, op="max"))
    msg = _expect(comm.CollectiveMismatchError, call, "rank 0: all_gather(", "rank 1: all_reduce(", "op=max")
    # Same collective, different roots / dtypes.
    _expect(comm.CollectiveMismatchError, lambda: comm.broadcast(y, g, root=r % 2), "root=0", "root=1")
    _expect(comm.CollectiveMismatchError, lambda: comm.all_reduce(y.astype(np.float64 if r else np.float32), g),
            "dtype=float32", "dtype=float64")
    # all_gather may have different first dims: no error, and the check still costs nothing wrong.
    got = comm.all_gather(np.full((r % 2 + 1, 2), r, np.int32), g)
    assert got.shape == (sum(k % 2 + 1 for k in range(n)), 2)
    assert np.array_equal(comm.all_reduce(y, g), y * n)
    # ... but out= picks the algorithm, so its shape must agree (here rank 0 passes none).
    out = None if r == 0 else np.empty((4 * n,), np.float32)
    _expect(comm.CollectiveMismatchError, lambda: comm.all_gather(y, g, out=out), "rank 0: all_gather(shape=(4,)")
    print(f"rank {r}: check mode caught every mismatch")


def unchecked_size_mismatch():
    """Without the check, a size mismatch still fails loudly instead of giving wrong numbers."""
    g = comm.world()
    x = np.ones(4 + (g.rank == 1), np.float32)
    comm.all_reduce(x, g)
    raise AssertionError("a size mismatch went unnoticed")


def unchecked_size_mismatch_after_plan():
    """The same, once every rank has cached a plan for the (4,) all-reduce (fast/allreduce.py)."""
    g = comm.world()
    for _ in range(3):
        comm.all_reduce(np.ones(4, np.float32), g)
    comm.all_reduce(np.ones(4 + (g.rank == 1), np.float32), g)
    raise AssertionError("a size mismatch went unnoticed")


def all_gather_rows_rule():
    """Row counts differing by more than one raise a clear error on every rank (2 ranks:
    one side sees a truncated message, the other a short one; more: after the size
    exchange), on the general and the cached path, and the group stays usable."""
    g = comm.world()
    n, r = g.size, g.rank
    rule = "differ by at most one"
    for rep in range(3):  # after the first round the other ranks run their cached 2-rank plan for (1, 3)
        comm.all_gather(np.full((1 + (r == n - 1), 3), r, np.float32), g)  # 1 and 2 rows: fine
        x = np.full((1 + 2 * (r == n - 1), 3), r, np.float32)  # the last rank has 3 rows, the others 1
        _expect(comm.CommError, lambda: comm.all_gather(x, g), rule, "rows")
        total = 3 + (n - 1)
        _expect(comm.CommError, lambda: comm.all_gather(x, g, out=np.empty((total, 3), np.float32)), rule)
        # out= whose first dim N divides: every block must have out.shape[0]/N rows, so a
        # block of 1 row and one of 3 (the rest 2) make every rank raise, also on a plan.
        x = np.full((2 - (r == 0) + (r == n - 1), 3), r, np.float32)
        for algo in ("auto", "direct", "ring"):
            _expect(comm.CommError, lambda: comm.all_gather(x, g, out=np.empty((2 * n, 3), np.float32),
                                                            algorithm=algo), "rows")
        # the same once the ranks with 2 rows have cached a plan for (2, 3) into (2N, 3)
        for _ in range(2):
            comm.all_gather(np.full((2, 3), r, np.float32), g, out=np.empty((2 * n, 3), np.float32))
        _expect(comm.CommError, lambda: comm.all_gather(x, g, out=np.empty((2 * n, 3), np.float32)), "rows")
        if n > 2:  # (two ranks exchange one message: a 48-byte block may be 2 rows of 24 bytes)
            dt = np.float64 if r == 0 else np.float32
            _expect(comm.CommError, lambda: comm.all_gather(np.full((2, 3), r, dt), g, out=np.empty((2 * n, 3), dt)),
                    "bytes")
        # and so does a rank whose rows have another dtype (its messages have the wrong size)
        x = np.full((2, 3), r, np.float64 if r == 0 else np.float32)
        _expect(comm.CommError, lambda: comm.all_gather(x, g, out=np.empty((2 * n, 3), x.dtype), algorithm="ring"),
                "bytes")
    got = comm.all_gather(np.full((r % 2 + 1,), r, np.int64), g)  # still usable
    assert got.tolist() == sum(([k] * (k % 2 + 1) for k in range(n)), []), got
    print(f"rank {r}: all_gather rows rule enforced")


def reduce_scatter_size_mismatch_after_plan():
    """A one-shot reduce-scatter plan (persistent requests, fast/exchange.py) that gets messages of
    the wrong size, longer (truncated) and shorter, fails loudly on the ranks that see them."""
    g = comm.world()
    for _ in range(3):
        comm.reduce_scatter(np.ones(2 * g.size, np.float32), g)
    comm.reduce_scatter(np.ones(3 * g.size if g.rank == 1 else 2 * g.size, np.float32), g)
    raise AssertionError("a size mismatch went unnoticed")


def one_shot_two_oversized_senders():
    """Two ranks send longer messages than rank 0 expects in the same one-shot round: every
    rank raises a CommError (not a raw MPI error), no request stays in flight, and the
    same calls work afterwards, on the general path and on a cached plan."""
    g = comm.world()
    n, r = g.size, g.rank
    for attempt in range(3):  # the first builds rank 0's plan for (2n,), later ones run it
        x = np.ones(2 * n if r == 0 or attempt == 0 else 3 * n, np.float32)
        if attempt == 0:  # everybody agrees: builds the (2n,) plans
            comm.reduce_scatter(x, g)
            comm.reduce_scatter(x, g)
            continue
        _expect(comm.CommError, lambda: comm.reduce_scatter(x, g), "reduce_scatter", "bytes")
        x = np.ones(2 * n, np.float32)
        got = comm.reduce_scatter(x, g)  # the group and rank 0's plan are still usable
        assert got.tolist() == [float(n)] * 2, got
        out = np.empty((2 * n, 3), np.float32)
        block = np.full((2 + (r > 0), 3), r, np.float32)  # two ranks' blocks too long for out
        _expect(comm.CommError, lambda: comm.all_gather(block, g, out=out), "rows")
        comm.all_gather(np.full((2, 3), r, np.float32), g, out=out)
        assert out[::2, 0].tolist() == list(range(n)), out
    print(f"rank {r}: one-shot errors recovered")


def all_reduce_sizes_across_the_algorithm_threshold():
    """Sizes so different that the ranks pick different algorithms (recursive doubling
    below reducing's threshold, pairwise exchange above): their messages no longer pair up,
    so only the ranks that receive a wrong size can raise.  The abort hook that
    ``comm.world()`` installs must then end the job with that error, not leave it hanging."""
    g = comm.world()
    large = 4 * reducing.SMALL_ALL_REDUCE_BYTES_WIDE // 8  # float64 elements, four times the threshold
    comm.all_reduce(np.ones(100 if g.rank == 0 else large), g)
    raise AssertionError("a size mismatch went unnoticed")


def all_gather_out_on_one_rank_only():
    """``out=`` picks the all-gather's algorithm, so a rank that passes it while the others
    do not runs another schedule: the same loud end as above."""
    g = comm.world()
    comm.all_gather(np.ones((3, 2)), g, out=np.empty((3 * g.size, 2)) if g.rank == 0 else None)
    raise AssertionError("a size mismatch went unnoticed")


def all_to_all_v_rows_of_another_shape():
    """Rank 0's rows have another trailing shape: the ranks that receive a wrong size raise
    (the plan: every rank, once its round is complete), and the abort hook ends the job."""
    g = comm.world()
    comm.all_to_all_v(np.ones((g.size, 3 if g.rank == 0 else 4), np.float32), [1] * g.size, g)
    raise AssertionError("a size mismatch went unnoticed")


def all_to_all_v_rows_of_another_dtype():
    """Rank 0's rows are float64, the others' float32: the identity tags differ."""
    g = comm.world()
    comm.all_to_all_v(np.ones((g.size, 2), np.float64 if g.rank == 0 else np.float32), [1] * g.size, g)
    raise AssertionError("a dtype mismatch went unnoticed")


def all_to_all_v_against_another_collective():
    """Rank 0 calls all_to_all_v while the others call all_reduce."""
    g = comm.world()
    if g.rank == 0:
        comm.all_to_all_v(np.ones(g.size), [1] * g.size, g)
    else:
        comm.all_reduce(np.ones(1), g)
    raise AssertionError("a mismatch went unnoticed")


def all_to_all_v_errors_recover():
    """With the fast path's plan, rows of another trailing shape or dtype on one rank raise
    on every rank (nothing left in flight), and the group works afterwards, on the plan and
    on the general path; counts that break the rules raise before any message."""
    g = comm.world()
    n, r = g.size, g.rank
    assert comm.fast_path_enabled()
    good = np.arange(2 * n, dtype=np.float32).reshape(n, 2) + 100 * r
    want = np.array([[2 * r + 100 * k, 2 * r + 1 + 100 * k] for k in range(n)], np.float32)
    for attempt in range(3):
        if attempt:  # the first call builds the plan for float32 with every rank agreeing
            tail = np.ones((n, 3 if r == 0 else 2), np.float32)
            _expect(comm.CommError, lambda: comm.all_to_all_v(tail, [1] * n, g), "all_to_all_v", "bytes")
            other = np.ones((n, 2), np.float64 if r == 0 else np.float32)
            _expect(comm.CollectiveMismatchError, lambda: comm.all_to_all_v(other, [1] * n, g),
                    "all_to_all_v(float64)", "all_to_all_v(float32)")
            _expect(ValueError, lambda: comm.all_to_all_v(good, [n + 1] + [0] * (n - 1) if r == 1 else [2] * n, g),
                    f"x has {n} rows")
        for algorithm in ("auto", "pairwise", "direct"):
            y, got = comm.all_to_all_v(good, [1] * n, g, algorithm=algorithm)
            assert np.array_equal(y, want) and got.tolist() == [1] * n, (algorithm, y, got)
    print(f"rank {r}: all_to_all_v errors recovered")
