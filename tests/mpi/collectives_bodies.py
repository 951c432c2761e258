"""Rank bodies for tests/test_collectives.py: minidist's collectives against oracles.

Every rank builds every rank's input from a seed (so NumPy can compute the exact expected
result locally) and also runs MPI's built-in counterpart (allowed in tests) as a second
oracle.  Inputs are small integers, so sums are exact in every dtype, including float16 and
bfloat16, and results can be compared bit for bit.
"""
import contextlib
import gc
import weakref

import numpy as np
from mpi4py import MPI

from minidist import comm
from minidist.model.backend import bfloat16
from minidist.comm import collectives as C
from minidist.comm import reducing as R
from minidist.comm.algorithms import pairwise, pipelined
from minidist.comm.stats import scope as stats_scope
from minidist.comm.fast import exchange

DTYPES = ["float16", "bfloat16", "float32", "float64", "int32", "int64"]
OPS = ["sum", "avg", "max", "min"]
MPI_OPS = {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}
MPI_NATIVE = {"float32", "float64", "int32", "int64"}


def _dt(name):
    return bfloat16 if name == "bfloat16" else np.dtype(name)


def make(shape, dtype, rank, salt):
    rng = np.random.default_rng([rank, salt, 12345])
    return rng.integers(-3, 4, size=shape).astype(_dt(dtype))


def expected_reduce(inputs, op, dtype):
    """NumPy oracle: exact float64/int64 reduction, then avg and rounding like minidist."""
    stack = np.stack([a.astype(np.float64) if a.dtype.kind == "f" or a.dtype == bfloat16 else a.astype(np.int64)
                      for a in inputs])
    n = len(inputs)
    if op in ("sum", "avg"):
        res = stack.sum(axis=0)
    else:
        res = stack.max(axis=0) if op == "max" else stack.min(axis=0)
    acc = np.float32 if dtype in ("float16", "bfloat16") else _dt(dtype)
    res = res.astype(acc)
    if op == "avg" and n > 1:
        res = res // n if np.issubdtype(res.dtype, np.integer) else res / res.dtype.type(n)
    return res.astype(_dt(dtype))


def same(a, b, what):
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} != {b.dtype}"
    assert a.shape == b.shape, f"{what}: shape {a.shape} != {b.shape}"
    assert np.array_equal(a.astype(np.float64), b.astype(np.float64)), f"{what}: values differ\n{a}\n{b}"


def shapes(n):
    return [(0,), (1,), (max(n - 1, 0),), (n + 1,), (3001,), (n + 2, 3)]


def _counts(rows, n, unit):
    return [len(p) * unit for p in np.array_split(np.arange(rows), n)]


def no_plans_when_off(g):
    """True with the fast path on (then the caller checks the plans it expects); with it off
    (MINIDIST_FAST_PATH=0), checks that the textbook path never cached a plan."""
    if comm.fast_path_enabled():
        return True
    assert not g._plans, f"the fast path is off, yet plans were cached: {list(g._plans)}"
    return False


def check_reductions():
    g, world = comm.world(), MPI.COMM_WORLD
    n, r = g.size, g.rank
    salt = 0
    for shape in shapes(n):
        for dtype in DTYPES:
            for op in OPS:
                salt += 1
                inputs = [make(shape, dtype, k, salt) for k in range(n)]
                x = inputs[r]
                before = x.copy()
                want = expected_reduce(inputs, op, dtype)
                for algo in ("recursive_doubling", "ring", "pairwise") + (("rabenseifner",) if n & (n - 1) == 0 else ()):
                    got = comm.all_reduce(x, g, op=op, algorithm=algo)
                    same(got, want, f"all_reduce {algo} {op} {dtype} {shape}")
                h = comm.all_reduce(x, g, op=op, async_op=True)
                same(h.wait(), want, f"async all_reduce {op} {dtype} {shape}")
                rows = np.array_split(np.arange(shape[0]), n)[r]
                got = comm.reduce_scatter(x, g, op=op)
                same(got, want[rows[0]:rows[-1] + 1] if len(rows) else want[:0], f"reduce_scatter {op} {dtype} {shape}")
                got = comm.reduce_scatter(x, g, op=op, async_op=True).wait()
                same(got, want[rows[0]:rows[-1] + 1] if len(rows) else want[:0], f"async reduce_scatter {op} {dtype}")
                for algo in ("direct", "ring", "pairwise") + (("halving",) if n & (n - 1) == 0 else ()):
                    got = comm.reduce_scatter(x, g, op=op, algorithm=algo)
                    same(got, want[rows[0]:rows[-1] + 1] if len(rows) else want[:0],
                         f"reduce_scatter {algo} {op} {dtype} {shape}")
                    out = np.zeros_like(got)
                    assert comm.reduce_scatter(x, g, op=op, algorithm=algo, out=out) is out
                    same(out, got, f"reduce_scatter out= {algo} {op} {dtype} {shape}")
                root = salt % n
                for algo in ("binomial", "chain"):
                    got = comm.reduce(x, g, root=root, op=op, algorithm=algo)
                    if r == root:
                        same(got, want, f"reduce {algo} {op} {dtype} {shape} root {root}")
                    else:
                        assert got is None
                same(x, before, "input modified")
                if dtype in MPI_NATIVE:
                    mpi_oracles(world, x, op, shape, root)


def mpi_oracles(world, x, op, shape, root):
    """The same reductions by MPI's built-ins (Allreduce, Reduce_scatter, Reduce)."""
    g, n, r = comm.world(), world.size, world.rank
    ref = np.empty_like(x)
    world.Allreduce(x, ref, op=MPI_OPS[op])
    if op == "avg":
        ref = ref // n if ref.dtype.kind == "i" else ref / ref.dtype.type(n)
    same(comm.all_reduce(x, g, op=op), ref.astype(x.dtype), f"all_reduce vs MPI Allreduce {op} {x.dtype}")
    if op != "avg":
        unit = int(np.prod(shape[1:]))
        counts = _counts(shape[0], n, unit)
        part = np.empty(counts[r], x.dtype)
        world.Reduce_scatter(x, part, recvcounts=counts, op=MPI_OPS[op])
        same(comm.reduce_scatter(x, g, op=op).reshape(-1), part, f"reduce_scatter vs MPI {op} {x.dtype}")
        red = np.empty_like(x) if r == root else None
        world.Reduce(x, red, op=MPI_OPS[op], root=root)
        got = comm.reduce(x, g, root=root, op=op)
        if r == root:
            same(got, red, f"reduce vs MPI {op} {x.dtype}")


def check_movement():
    g, world = comm.world(), MPI.COMM_WORLD
    n, r = g.size, g.rank
    salt = 1000
    for shape in shapes(n):
        for dtype in DTYPES:
            salt += 1
            inputs = [make(shape, dtype, k, salt) for k in range(n)]
            x, unit = inputs[r], int(np.prod(shape[1:]))
            root = salt % n
            # all_gather with uneven first dims: rank k contributes its first rows - k % 2.
            mine = [a[:max(0, a.shape[0] - k % 2)] for k, a in enumerate(inputs)]
            want = np.concatenate(mine)
            same(comm.all_gather(mine[r], g), want, f"all_gather {dtype} {shape}")
            same(comm.all_gather(mine[r], g, async_op=True).wait(), want, f"async all_gather {dtype}")
            for algo in ("ring", "bruck"):
                same(comm.all_gather(mine[r], g, algorithm=algo), want, f"all_gather {algo} {dtype} {shape}")
            # out=: equal blocks go straight into out (recursive doubling or ring), uneven ones
            # (whose total N never divides) and "bruck" through the row-count records.
            algos = ("auto", "direct", "ring", "bruck") + (("doubling",) if n > 1 and n & (n - 1) == 0 else ())
            for blocks in (inputs, mine):
                for algo in algos if blocks is inputs else ("auto", "ring", "bruck"):
                    full = np.concatenate(blocks)
                    if algo in ("direct", "doubling") and (full.shape[0] < n or full.size == 0):
                        continue  # needs at least one row per block (of nonzero size)
                    out = np.zeros_like(full)
                    assert comm.all_gather(blocks[r], g, out=out, algorithm=algo) is out
                    same(out, full, f"all_gather out= {algo} {dtype} {shape} equal={blocks is inputs}")
                    if algo == "auto":  # on the progress thread's communicator
                        out = np.zeros_like(full)
                        assert comm.all_gather(blocks[r], g, out=out, async_op=True).wait() is out
                        same(out, full, f"async all_gather out= {dtype} {shape} equal={blocks is inputs}")
            for algo in ("binomial", "chain"):
                other = np.zeros_like(x)
                same(comm.broadcast(x if r == root else other, g, root=root, algorithm=algo),
                     inputs[root], f"broadcast {algo} {dtype} {shape}")
            got = comm.broadcast(x, g, root=root, async_op=True).wait()
            same(got, inputs[root], f"async broadcast {dtype}")
            parts = np.array_split(inputs[root], n)
            same(comm.scatter(x if r == root else None, g, root=root), parts[r], f"scatter {dtype} {shape}")
            got = comm.gather(mine[r], g, root=root)
            if r == root:
                same(got, want, f"gather {dtype} {shape}")
            else:
                assert got is None
            want_a2a = np.concatenate([np.array_split(a, n)[r] for a in inputs])
            same(comm.all_to_all(x, g), want_a2a, f"all_to_all {dtype} {shape}")
            same(comm.all_to_all(x, g, async_op=True).wait(), want_a2a, f"async all_to_all {dtype}")
            for shift in (1, n - 1):
                perm = [(i, (i + shift) % n) for i in range(n)]
                same(comm.ppermute(x, g, perm), inputs[(r - shift) % n], f"ppermute shift {shift} {dtype}")
            # A partial permutation: only rank 0 -> last rank; everyone else gets zeros.
            got = comm.ppermute(x, g, [(0, n - 1)], async_op=True).wait()
            same(got, inputs[0] if r == n - 1 else (inputs[0] if n == 1 else np.zeros_like(x)), "partial ppermute")
            if dtype in MPI_NATIVE:
                movement_vs_mpi(world, x, mine[r], unit, root)
    comm.barrier(g)
    comm.barrier(g, async_op=True).wait()


def movement_vs_mpi(world, x, mine, unit, root):
    """Allgatherv, Bcast, Scatterv, Gatherv, Alltoallv as oracles for the same inputs."""
    g, n, r = comm.world(), world.size, world.rank
    counts = world.allgather(mine.size)
    ref = np.empty(sum(counts), x.dtype)
    world.Allgatherv(mine.reshape(-1), [ref, counts])
    same(comm.all_gather(mine, g).reshape(-1), ref, "all_gather vs Allgatherv")
    b = x.copy()
    world.Bcast(b, root=root)
    same(comm.broadcast(x, g, root=root), b, "broadcast vs Bcast")
    rows = x.shape[0]
    sc = _counts(rows, n, unit)
    part = np.empty(sc[r], x.dtype)
    world.Scatterv([x.reshape(-1), sc] if r == root else None, part, root=root)
    same(comm.scatter(x, g, root=root).reshape(-1), part, "scatter vs Scatterv")
    ga = np.empty(sum(counts), x.dtype) if r == root else None
    world.Gatherv(mine.reshape(-1), [ga, counts] if r == root else None, root=root)
    got = comm.gather(mine, g, root=root)
    if r == root:
        same(got.reshape(-1), ga, "gather vs Gatherv")
    recv_counts = [sc[r]] * n
    a2a = np.empty(sum(recv_counts), x.dtype)
    world.Alltoallv([x.reshape(-1), sc], [a2a, recv_counts])
    same(comm.all_to_all(x, g).reshape(-1), a2a, "all_to_all vs Alltoallv")


def check_traffic():
    """Byte counters equal the textbook formulas (float32, lengths divisible by N)."""
    g = comm.world()
    n = g.size
    X = 4 * 240 * n  # bytes of a float32 vector of 240*N elements
    x = np.ones(240 * n, np.float32)
    log2 = (n - 1).bit_length() if n > 1 else 0

    def measure(fn):
        comm.reset_stats()
        fn()
        return comm.stats()

    for algo in ("ring", "pairwise"):
        s = measure(lambda: comm.all_reduce(x, g, algorithm=algo))["all_reduce"]
        assert s["bytes_sent"] == s["bytes_recv"] == 2 * (n - 1) * X // n, (algo, s)
        assert s["calls"] == 1
    if n & (n - 1) == 0:
        s = measure(lambda: comm.all_reduce(x, g, algorithm="rabenseifner"))["all_reduce"]
        assert s["bytes_sent"] == s["bytes_recv"] == 2 * (n - 1) * X // n, s
    for algo in ("auto", "direct", "ring", "pairwise"):
        s = measure(lambda: comm.reduce_scatter(x, g, algorithm=algo))["reduce_scatter"]
        assert s["bytes_sent"] == s["bytes_recv"] == (n - 1) * X // n, (algo, s)
    # All-gather into out= of N equal blocks: (N-1) blocks of X each way, no row counts.
    full = np.empty(x.size * n, np.float32)
    for algo in ("auto", "direct", "ring") + (("doubling",) if n & (n - 1) == 0 else ()):
        s = measure(lambda: comm.all_gather(x, g, out=full, algorithm=algo))["all_gather"]
        assert s["bytes_sent"] == s["bytes_recv"] == (n - 1) * X, (algo, s)
    # The textbook ring all-gather: (N-1) blocks of X, after an exchange of 8-byte row counts.
    s = measure(lambda: comm.all_gather(x, g, algorithm="ring"))["all_gather"]
    assert s["bytes_sent"] == s["bytes_recv"] == (n - 1) * X + 8 * (n - 1), s
    s = measure(lambda: comm.all_gather(x, g))["all_gather"]
    # (N-1) blocks of X each; with 2 ranks the row counts travel as the message sizes, with
    # more a Bruck exchange of the 8-byte row counts comes first (N-1 records).
    assert s["bytes_sent"] == s["bytes_recv"] == (n - 1) * X + (8 * (n - 1) if n > 2 else 0), s
    if n & (n - 1) == 0:
        s = measure(lambda: comm.all_reduce(x, g, algorithm="recursive_doubling"))["all_reduce"]
        assert s["bytes_sent"] == log2 * X, s
    s = measure(lambda: comm.all_to_all(x, g))["all_to_all"]
    assert s["bytes_sent"] == (n - 1) * X // n, s
    s = measure(lambda: comm.broadcast(x, g, root=0, algorithm="chain"))["broadcast"]
    assert s["bytes_recv"] == (X if g.rank != 0 else 0) and s["bytes_sent"] == (X if g.rank != n - 1 else 0), s
    s = measure(lambda: comm.all_reduce(x, g, async_op=True).wait())["all_reduce"]
    assert s["calls"] == 1 and (n == 1 or s["bytes_sent"] > 0), s
    print(f"rank {g.rank}: traffic formulas hold")


def all_cases():
    check_reductions()
    check_movement()
    check_traffic()
    comm.barrier(comm.world())
    print(f"rank {comm.world().rank}/{comm.world().size}: all collective cases passed")


def large_paths():
    """Messages above the thresholds (auto-selected ring/chain, several pipeline chunks).

    The thresholds and the pipeline chunk are shrunk (module constants, read at call time)
    so ~800 KB messages take the large-message paths in 4+ chunks per ring step."""
    g, world = comm.world(), MPI.COMM_WORLD
    n, r = g.size, g.rank
    R.SMALL_ALL_REDUCE_BYTES = R.SMALL_ALL_REDUCE_BYTES_WIDE = R.SMALL_REDUCE_BYTES = C.SMALL_BROADCAST_BYTES = 256 << 10
    pipelined.PIPELINE_BYTES = 64 << 10
    x = np.ones(200_001, np.float32)
    comm.reset_stats()
    comm.all_reduce(x, g)
    sent = comm.stats()["all_reduce"]["bytes_sent"]
    assert abs(sent - 2 * (n - 1) / n * x.nbytes) <= 8 * n, f"auto did not pick the ring: {sent} bytes sent"
    for dtype in ("float32", "bfloat16", "int64"):
        inputs = [make((200_001,), dtype, k, 7) for k in range(n)]
        want = expected_reduce(inputs, "sum", dtype)
        same(comm.all_reduce(inputs[r], g), want, f"large all_reduce {dtype}")
        same(comm.all_reduce(inputs[r], g, async_op=True).wait(), want, f"large async all_reduce {dtype}")
        got = comm.reduce(inputs[r], g, root=n - 1)
        if r == n - 1:
            same(got, want, f"large reduce {dtype}")
        same(comm.broadcast(inputs[r], g, root=1 % n), inputs[1 % n], f"large broadcast {dtype}")
    # reduce_scatter above PAIRWISE_BYTES: pairwise exchange, 4+ chunks a step, blocks of
    # unequal length (200_002 rows over 3 ranks), into a fresh result and into out=.
    R.PAIRWISE_BYTES = 256 << 10
    calls = []  # count the pairwise exchanges: the byte formula is the ring's too
    plain = R._REDUCE_SCATTERS["pairwise"]
    R._REDUCE_SCATTERS["pairwise"] = lambda *a: calls.append(1) or plain(*a)
    for dtype in ("float32", "bfloat16", "int64"):
        inputs = [make((200_002,), dtype, k, 9) for k in range(n)]
        want = np.array_split(expected_reduce(inputs, "sum", dtype), n)[r]
        comm.reset_stats()
        same(comm.reduce_scatter(inputs[r], g), want, f"large reduce_scatter {dtype}")
        acc = 4 if dtype == "bfloat16" else inputs[r].itemsize  # bfloat16 travels as float32
        assert comm.stats()["reduce_scatter"]["bytes_sent"] == (200_002 - want.shape[0]) * acc, comm.stats()
        out = np.zeros_like(want)
        assert comm.reduce_scatter(inputs[r], g, out=out) is out
        same(out, want, f"large reduce_scatter out= {dtype}")
    assert len(calls) == 6, f"auto took pairwise exchange in {len(calls)} of 6 large reduce_scatters"
    R._REDUCE_SCATTERS["pairwise"] = plain
    # out=: the result lands in (and is) the caller's buffer, on every path and dtype.
    for dtype in ("float32", "bfloat16"):
        x = make((200_001,), dtype, r, 8)
        want = expected_reduce([make((200_001,), dtype, k, 8) for k in range(n)], "sum", dtype)
        for algo in ("ring", "recursive_doubling", "pairwise"):
            out = np.full_like(x, 99)
            assert comm.all_reduce(x, g, algorithm=algo, out=out) is out
            same(out, want, f"all_reduce out= {algo} {dtype}")
        out = np.empty((n * 200_001,), x.dtype)
        assert comm.all_gather(x, g, out=out) is out
        same(out, np.concatenate([make((200_001,), dtype, k, 8) for k in range(n)]), "all_gather out=")
    x = np.random.default_rng(r).standard_normal(300_000)
    ref = np.empty_like(x)
    world.Allreduce(x, ref)
    assert np.allclose(comm.all_reduce(x, g), ref, rtol=1e-12, atol=1e-12)
    print(f"rank {r}: large paths passed")


def fast_paths():
    """Repeated calls run cached plans (comm/fast/): same answers as the oracles, same
    traffic formulas, the same clear errors, and uneven all_gather still right."""
    g = comm.world()
    r = g.rank
    for direct in (True, False):  # small calls take the one-shot plans; then the ring/halving ones
        with _direct_lanes(g, direct):
            _reducing_plans(g, direct)
            _gather_plans(g, direct)
            _uneven_gathers(g)
    with _direct_lanes(g, False):  # tiny thresholds send small inputs the large-message ways
        _more_plans(g)
    comm.barrier(g)
    print(f"rank {r}: fast paths passed")


@contextlib.contextmanager
def _direct_lanes(g, on):
    """The one-shot (oneshot.py) lanes at their thresholds, or (on=False) never taken."""
    saved = R.REDUCE_SCATTER_ONE_SHOT_BYTES, C.ALL_GATHER_ONE_SHOT_BYTES, C.ONE_SHOT_MAX_RANKS
    if not on:
        R.REDUCE_SCATTER_ONE_SHOT_BYTES = C.ALL_GATHER_ONE_SHOT_BYTES = -1
        C.ONE_SHOT_MAX_RANKS = 0
    g._plans.clear()
    try:
        yield
    finally:
        R.REDUCE_SCATTER_ONE_SHOT_BYTES, C.ALL_GATHER_ONE_SHOT_BYTES, C.ONE_SHOT_MAX_RANKS = saved
        g._plans.clear()


def _reducing_plans(g, direct):
    n, r = g.size, g.rank
    for dtype in ("float32", "float64", "int32", "int64"):
        for op in OPS:
            for shape in ((1,), (n + 1,), (7, 3), (1000,)):
                inputs = [make(shape, dtype, k, 77) for k in range(n)]
                want = expected_reduce(inputs, op, dtype)
                rows = np.array_split(np.arange(shape[0]), n)[r]
                want_rs = want[rows[0]:rows[-1] + 1] if len(rows) else want[:0]
                out = np.empty(shape, _dt(dtype))
                for rep in range(3):  # the first call builds the plan, the others run it
                    x = inputs[r].copy()
                    comm.reset_stats()
                    same(comm.all_reduce(x, g, op=op), want, f"fast all_reduce {op} {dtype} {shape} #{rep}")
                    assert comm.all_reduce(x, g, op=op, out=out) is out
                    same(out, want, f"fast all_reduce out= {op} {dtype} {shape}")
                    same(comm.reduce_scatter(x, g, op=op), want_rs, f"fast reduce_scatter {op} {dtype} {shape}")
                    part = np.empty_like(want_rs)
                    assert comm.reduce_scatter(x, g, op=op, out=part) is part
                    same(part, want_rs, f"fast reduce_scatter out= {op} {dtype} {shape}")
                    same(x, inputs[r], "input modified")
                    s = comm.stats()
                    assert s["all_reduce"]["calls"] == 2 and s["reduce_scatter"]["calls"] == 2, s
                    if n & (n - 1) == 0:
                        assert s["all_reduce"]["bytes_sent"] == 2 * x.nbytes * (n.bit_length() - 1), s
                    if len(shape) == 1 and shape[0] % n == 0:  # ring and halving: (N-1)/N * X
                        assert s["reduce_scatter"]["bytes_sent"] == 2 * x.nbytes * (n - 1) // n, s
                same(comm.all_reduce(inputs[r][::-1], g, op=op), want[::-1],
                     "fast all_reduce of a non-contiguous view")
                if len(shape) == 1 and shape[0] >= 2 * n:  # strided x, out (every rank's part > 1 element)
                    flipped = np.array_split(want[::-1], n)[r]
                    same(comm.reduce_scatter(inputs[r][::-1], g, op=op), flipped,
                         "fast reduce_scatter of a non-contiguous view")
                    for _ in range(2):  # a strided out= is refused, with or without a cached plan
                        try:
                            comm.reduce_scatter(x, g, op=op, out=np.zeros(2 * len(want_rs), want_rs.dtype)[::2])
                        except ValueError as err:
                            assert "C-contiguous" in str(err), err
                        else:
                            raise AssertionError("reduce_scatter accepted a strided out=")
                if len(shape) == 2:  # Fortran order: MPI would send the bytes column-major
                    xf = np.asfortranarray(inputs[r])
                    same(comm.all_reduce(xf, g, op=op), want, "fast all_reduce of a Fortran-ordered x")
                    same(comm.reduce_scatter(xf, g, op=op), want_rs, "fast reduce_scatter of a Fortran-ordered x")
    if n > 1 and no_plans_when_off(g):
        key = (("all_reduce", "sum", "auto"), np.dtype(np.float32), (1000,))
        assert key in g._plans, "repeated small all_reduce did not cache a plan"
        plan = g._plans.get((("reduce_scatter", "sum"), np.dtype(np.float32), (1000,)))
        want_plan = "HalvingPlan" if n > 2 and n & (n - 1) == 0 else "ReduceScatterPlan"
        want_plan = "DirectScatterPlan" if direct else want_plan
        assert type(plan).__name__ == want_plan, f"reduce_scatter on {n} ranks cached {plan!r}"


def _more_plans(g):
    n, r = g.size, g.rank
    if n > 1:  # pairwise all-reduce plans: tiny thresholds send these inputs that way
        saved = R.SMALL_ALL_REDUCE_BYTES, R.SMALL_ALL_REDUCE_BYTES_WIDE
        R.SMALL_ALL_REDUCE_BYTES = R.SMALL_ALL_REDUCE_BYTES_WIDE = 64
        g._plans.clear()
        for dtype in ("float32", "int64"):
            for op in OPS:
                for shape in ((7, 3), (1001,)):
                    inputs = [make(shape, dtype, k, 79) for k in range(n)]
                    want = expected_reduce(inputs, op, dtype)
                    for rep in range(3):
                        same(comm.all_reduce(inputs[r], g, op=op), want, f"pairwise all_reduce plan {op} {dtype} {shape}")
                        res = np.empty_like(want)
                        assert comm.all_reduce(inputs[r], g, op=op, out=res) is res
                        same(res, want, f"pairwise all_reduce plan out= {op} {dtype} {shape}")
                    if len(shape) == 2:
                        same(comm.all_reduce(np.asfortranarray(inputs[r]), g, op=op), want, "pairwise plan, Fortran x")
                    else:
                        same(comm.all_reduce(inputs[r][::-1], g, op=op), want[::-1], "pairwise plan, strided x")
        plan = g._plans.get((("all_reduce", "sum", "auto"), np.dtype(np.float32), (1001,)))
        assert not no_plans_when_off(g) or type(plan).__name__ == "PairwiseAllReducePlan", f"all_reduce on {n} ranks cached {plan!r}"
        comm.reset_stats()
        comm.all_reduce(np.ones(1000 * n, np.float32), g)
        comm.all_reduce(np.ones(1000 * n, np.float32), g)  # the second call runs the plan
        assert comm.stats()["all_reduce"]["bytes_sent"] == 2 * 2 * (n - 1) * 4000, comm.stats()
        R.SMALL_ALL_REDUCE_BYTES, R.SMALL_ALL_REDUCE_BYTES_WIDE = saved
    if n > 2:  # pairwise-exchange plans: a tiny threshold sends these inputs that way
        saved, R.PAIRWISE_BYTES = R.PAIRWISE_BYTES, 64
        g._plans.clear()
        for dtype in ("float32", "int64"):
            for op in OPS:
                for shape in ((7, 3), (1001,)):
                    inputs = [make(shape, dtype, k, 78) for k in range(n)]
                    want = np.array_split(expected_reduce(inputs, op, dtype), n)[r]
                    for rep in range(3):
                        same(comm.reduce_scatter(inputs[r], g, op=op), want, f"pairwise plan {op} {dtype} {shape}")
                        part = np.empty_like(want)
                        assert comm.reduce_scatter(inputs[r], g, op=op, out=part) is part
                        same(part, want, f"pairwise plan out= {op} {dtype} {shape}")
                    if len(shape) == 2:
                        xf = np.asfortranarray(inputs[r])
                        same(comm.reduce_scatter(xf, g, op=op), want, f"pairwise plan, Fortran x {op} {dtype}")
                    else:
                        flipped = np.array_split(expected_reduce(inputs, op, dtype)[::-1], n)[r]
                        same(comm.reduce_scatter(inputs[r][::-1], g, op=op), flipped, f"pairwise plan, strided x {op}")
        plan = g._plans.get((("reduce_scatter", "sum"), np.dtype(np.float32), (1001,)))
        assert not no_plans_when_off(g) or type(plan).__name__ == "PairwisePlan", f"reduce_scatter on {n} ranks cached {plan!r}"
        comm.reset_stats()
        comm.reduce_scatter(np.ones(1001, np.float32), g)
        assert comm.stats()["reduce_scatter"]["bytes_sent"] == (1001 - len(np.array_split(np.arange(1001), n)[r])) * 4
        R.PAIRWISE_BYTES = saved
        x = np.ones(6, np.float32)
        comm.all_reduce(x, g)
        comm.all_reduce(x, g)
        try:
            comm.all_reduce(x, g, out=np.empty(7, np.float32))
            raise AssertionError("a wrong out= was accepted on the fast path")
        except ValueError as err:
            assert "out.shape=(7,)" in str(err)
    # The general path counts per thread, plans in per-name tallies (no lock on either):
    # stats() must add the progress thread's (async call) and the plan's (sync call).
    if n > 1:
        x = np.ones(8, np.float32)
        comm.all_reduce(x, g)
        comm.reset_stats()
        comm.all_reduce(x, g, async_op=True).wait()
        comm.all_reduce(x, g)
        s = comm.stats()["all_reduce"]
        assert s["calls"] == 2, s
        if n & (n - 1) == 0:
            assert s["bytes_sent"] == 2 * x.nbytes * (n.bit_length() - 1), s


def _gather_plans(g, direct):
    """all_gather of equal blocks, with and without out=: cached plans."""
    n, r = g.size, g.rank
    for rep in range(3):
        x = np.full((3, 2), r, np.int16)
        want = np.repeat(np.arange(n, dtype=np.int16), 3)[:, None].repeat(2, axis=1)
        comm.reset_stats()
        same(comm.all_gather(x, g), want, f"fast all_gather #{rep}")
        out = np.empty((3 * n, 2), np.int16)
        assert comm.all_gather(x, g, out=out) is out
        same(out, want, "fast all_gather out=")
        if n > 1:  # pair: X once; Bruck: N-1 records of an 8-byte count and X; out= of N blocks: N-1 blocks
            per_call = 2 * x.nbytes if n == 2 else (n - 1) * (8 + x.nbytes) + (n - 1) * x.nbytes
            assert comm.stats()["all_gather"] == {"calls": 2, "bytes_sent": per_call,
                                                  "bytes_recv": per_call,
                                                  "time_s": comm.stats()["all_gather"]["time_s"]}, comm.stats()
        same(comm.all_gather(np.full((3, 4), r, np.int16)[:, ::2], g), want, f"fast all_gather, strided x #{rep}")
        xf = np.asfortranarray(np.full((3, 2), r, np.int16) + np.arange(2, dtype=np.int16))  # column-major bytes
        same(comm.all_gather(xf, g), want + np.arange(2, dtype=np.int16), f"fast all_gather, Fortran x #{rep}")
        same(comm.all_gather(xf, g, out=out), want + np.arange(2, dtype=np.int16), f"Fortran x, out= #{rep}")
    if n > 1:
        for out_shape, want_plan in ((None, "PairGatherPlan" if n == 2 else "BruckGatherPlan"),
                                     ((3 * n, 2), "DirectGatherPlan" if direct else
                                      "PairGatherPlan" if n == 2 else "EvenGatherPlan")):
            plan = g._plans.get((("all_gather", out_shape), np.dtype(np.int16), (3, 2)))
            assert not no_plans_when_off(g) or type(plan).__name__ == want_plan, \
                f"all_gather on {n} ranks, out {out_shape}: cached {plan!r}"


def bound_plans():
    """The one-shot plans bind persistent requests to x and out once the same arrays come
    twice in a row: results stay right when the arrays' contents change in place, when
    other arrays come in between, for Fortran-ordered and strided inputs, and the stats
    still count every call."""
    g = comm.world()
    n, r = g.size, g.rank
    rng = np.random.default_rng(5)
    xs = [rng.integers(-50, 50, (n, 4, 3)).astype(np.float64) for _ in range(2)]  # every rank's rows, 2 sets
    gx = [a[r].copy() for a in xs]  # this rank's block of each set
    outs = [np.empty((4 * n, 3)), np.empty((4 * n, 3))]
    sx = [rng.integers(-50, 50, (n, 6 * n, 2)).astype(np.float32) for _ in range(2)]  # reduce_scatter inputs
    rx = [a[r].copy() for a in sx]
    comm.reset_stats()
    calls = 0
    for step in range(12):
        k = 0 if step < 6 or step % 2 else 1  # the same pair 6 times, then alternating
        if step in (3, 9):  # new contents, same arrays
            xs[k] += 1
            gx[k][...] = xs[k][r]
            sx[k] *= 2
            rx[k][...] = sx[k][r]
        got = comm.all_gather(gx[k], g, out=outs[k])
        assert got is outs[k]
        same(got, xs[k].reshape(4 * n, 3), f"bound all_gather step {step}")
        want_rs = np.array_split(sx[k].sum(axis=0), n)[r]
        same(comm.reduce_scatter(rx[k], g), want_rs, f"bound reduce_scatter step {step}")
        calls += 1
    for step in range(3):  # Fortran-ordered and strided inputs never bind, and stay right
        xf = np.asfortranarray(gx[0])
        same(comm.all_gather(xf, g, out=outs[0]), xs[0].reshape(4 * n, 3), "bound lane, Fortran x")
        big = np.zeros((6 * n, 4), np.float32)
        big[:, ::2] = rx[0]
        same(comm.reduce_scatter(big[:, ::2], g), np.array_split(sx[0].sum(axis=0), n)[r], "strided x")
        calls += 1
    if n > 1 and no_plans_when_off(g):
        plan = g._plans[(("all_gather", (4 * n, 3)), np.dtype(np.float64), (4, 3))]
        assert type(plan).__name__ == "DirectGatherPlan", plan
        assert plan.bound is not None and plan.bound.x is gx[0] and plan.bound.out is outs[0], "never bound"
        plan = g._plans[(("reduce_scatter", "sum"), np.dtype(np.float32), (6 * n, 2))]
        assert plan.bound is not None and plan.bound.x is rx[0], "reduce_scatter plan never bound"
    if n > 1:  # the same accounting with the fast path on and off
        s = comm.stats()
        assert s["all_gather"]["calls"] == s["reduce_scatter"]["calls"] == calls, s
        assert s["all_gather"]["bytes_sent"] == calls * (n - 1) * gx[0].nbytes, s
    # In place: out= is x's own block (as ZeRO does with a flat gradient buffer), on the
    # general path, the copying lane and with the same arrays again and again.
    flat = np.empty(4 * n, np.float64)
    mine_part = flat[4 * r:4 * r + 4]
    for step in range(5):
        flat[...] = np.arange(4 * n) + 100 * r + step
        want = (np.arange(4 * n) * n + 100 * sum(range(n)) + n * step)[4 * r:4 * r + 4]
        assert comm.reduce_scatter(flat, g, out=mine_part) is mine_part
        same(mine_part, want.astype(np.float64), f"in-place reduce_scatter step {step}")
        flat[...] = np.arange(4 * n) + 100 * r + step
        assert comm.reduce_scatter(flat, g, out=mine_part, algorithm="direct") is mine_part
        same(mine_part, want.astype(np.float64), f"in-place direct reduce_scatter step {step}")
    # The bound reduce-scatter remembers an out it checked; changed in place since (shape,
    # writeable), it is checked again and refused with the general path's errors.
    want_rs = np.array_split(sx[0].sum(axis=0), n)[r]
    mine_rs = np.empty_like(want_rs)
    for _ in range(3):
        assert comm.reduce_scatter(rx[0], g, out=mine_rs) is mine_rs
        same(mine_rs, want_rs, "bound reduce_scatter into out=")
    if want_rs.size > 1:
        mine_rs.shape = (want_rs.shape[1], want_rs.shape[0])
        try:
            comm.reduce_scatter(rx[0], g, out=mine_rs)
            raise AssertionError("an out reshaped in place was accepted")
        except ValueError as err:
            assert "out.shape" in str(err), err
        mine_rs.shape = want_rs.shape
    mine_rs.flags.writeable = False
    try:
        comm.reduce_scatter(rx[0], g, out=mine_rs)
        raise AssertionError("a read-only out was accepted")
    except ValueError as err:
        assert "out is read-only" in str(err), err
    # After the exit hook freed every persistent request, the plans still work (afresh).
    exchange.close_all()
    same(comm.all_gather(gx[0], g, out=outs[0]), xs[0].reshape(4 * n, 3), "all_gather after close_all")
    same(comm.reduce_scatter(rx[0], g), np.array_split(sx[0].sum(axis=0), n)[r], "reduce_scatter after close_all")
    # Results larger than fast.common.PLAN_MAX_BYTES: no staging; persistent requests on the
    # caller's arrays once they come twice in a row, held by weak reference only, so that
    # the plan never keeps a large out alive.
    mine, big_out = np.empty((40000, 2), np.float32), np.empty((40000 * n, 2), np.float32)
    saved, C.ALL_GATHER_ONE_SHOT_BYTES = C.ALL_GATHER_ONE_SHOT_BYTES, 1 << 30  # one-shot at this size on any N
    key = (("all_gather", (40000 * n, 2)), np.dtype(np.float32), (40000, 2))

    def gather_steps(x, out, steps, what):
        for step in steps:
            x[...] = r + 10 * step
            want = np.repeat(np.arange(n, dtype=np.float32) + 10 * step, 40000)[:, None].repeat(2, axis=1)
            assert comm.all_gather(x, g, out=out) is out
            same(out, want, f"large one-shot all_gather, {what}, step {step}")

    gather_steps(mine, big_out, range(4), "same arrays")
    plan = g._plans.get(key)
    if n > 1 and no_plans_when_off(g):
        assert type(plan).__name__ == "DirectGatherPlan" and plan.buf is None and plan.bound is None, plan
        assert plan.held is not None and plan.held.out() is big_out, "large lane never held"
        try:  # the weak reference pins the memory the requests point at
            big_out.resize(big_out.size + 1, refcheck=False)
            raise AssertionError("a held out could be resized")
        except ValueError:
            pass
    for frozen in (big_out, outs[0]):  # held (large) and bound (small) out, read-only on every rank
        before = frozen.copy()
        frozen.flags.writeable = False
        try:
            comm.all_gather(mine if frozen is big_out else gx[0], g, out=frozen)
            raise AssertionError("a read-only out was accepted")
        except ValueError as err:
            assert "out is read-only" in str(err), err
        assert np.array_equal(frozen, before), "a read-only out was written"
        frozen.flags.writeable = True
    gather_steps(mine, big_out, [4], "writeable again")  # no request was left in flight
    gone = weakref.ref(big_out)
    del big_out
    gc.collect()
    assert gone() is None, "the plan kept a large out alive"
    other = np.empty((40000 * n, 2), np.float32)
    gather_steps(mine, other, range(4, 8), "a new out after the old one died")
    for step in (8, 9):  # a new x each call: the held pair stays, and is not used
        gather_steps(mine.copy(), other, [step], "a new x each call")
    if n > 1 and no_plans_when_off(g):
        assert plan.held is not None and plan.held.x() is mine and plan.held.out() is other
    C.ALL_GATHER_ONE_SHOT_BYTES = saved
    comm.barrier(g)
    print(f"rank {r}: bound plans passed")


def _uneven_gathers(g):
    n, r = g.size, g.rank
    # Uneven rows (within one of each other, the all_gather rule), with and without out=,
    # including 0-row blocks and the rank with the extra row last or first.
    for rows in ([3, 2, 3, 2, 2, 3, 3, 2][:n], [0] * (n - 1) + [1], [1] + [0] * (n - 1), [2] * n):
        total = sum(rows)
        want = np.concatenate([np.full((k, 2), i, np.float32) for i, k in enumerate(rows)])
        for rep in range(3):
            x = np.full((rows[r], 2), r, np.float32)
            same(comm.all_gather(x, g), want, f"uneven all_gather {rows} #{rep}")
            out = np.full((total, 2), -1, np.float32)
            assert comm.all_gather(x, g, out=out) is out
            same(out, want, f"uneven all_gather out= {rows}")
            empty_rows = comm.all_gather(np.zeros((rows[r], 0), np.float32), g)  # rows of zero bytes
            assert empty_rows.shape == (total, 0), empty_rows.shape
            if n == 2:  # the pair exchange directly: result and byte counts
                comm.reset_stats()
                with stats_scope("pair"):
                    got = pairwise.pair_all_gather(g, x, np.full((total, 2), -1, np.float32))
                same(got, want, f"pair all_gather {rows}")
                s = comm.stats()["pair"]
                assert s["bytes_recv"] == (total - rows[r]) * 8 and s["bytes_sent"] == rows[r] * 8, s
                same(pairwise.pair_all_gather(g, x), want, f"pair all_gather, no out= {rows}")


def fast_path_switch():
    """comm.set_fast_path(False) drops every cached plan and runs the textbook algorithms
    alone from then on: the same results, the same accounting in comm.stats(), no plan cached."""
    g = comm.world()
    n, r = g.size, g.rank
    rng = np.random.default_rng([r, 11])
    x = rng.integers(-5, 5, 24 * n).astype(np.float32)
    rows = rng.integers(-5, 5, (3, 2)).astype(np.float64)
    full = np.empty((3 * n, 2))

    def calls():
        comm.reset_stats()
        got = []
        for _ in range(3):  # the first call builds each plan, the others run it
            got += [comm.all_reduce(x, g), comm.all_reduce(x, g, op="max"), comm.reduce_scatter(x, g),
                    comm.all_gather(rows, g), comm.all_gather(rows, g, out=full).copy()]
        return got, {k: (v["calls"], v["bytes_sent"], v["bytes_recv"]) for k, v in comm.stats().items()}

    assert comm.fast_path_enabled()
    fast_results, fast_stats = calls()
    if n > 1:
        assert g._plans, "repeated calls cached no plan"
    comm.set_fast_path(False)
    assert not g._plans, "set_fast_path(False) kept the cached plans"
    plain_results, plain_stats = calls()
    assert not g._plans, "the textbook path cached a plan"
    for a, b in zip(fast_results, plain_results):
        same(a, b, "fast path vs textbook path")
    assert fast_stats == plain_stats, (fast_stats, plain_stats)
    comm.set_fast_path(True)
    comm.barrier(g)
    print(f"rank {r}: fast path switch works")


# ------------------------------------------------------------------ all_to_all_v
def _v_counts(case, n, r, rows_each):
    """Rank r's row count for each destination: 'empty' (nothing anywhere), 'uneven' (some
    zero, rank r's own block included now and then), 'one' (everything to rank n-1),
    'large' (rows_each per destination)."""
    rng = np.random.default_rng([r, n, len(case)])
    if case == "empty":
        return [0] * n
    if case == "one":
        return [0] * (n - 1) + [rows_each]
    if case == "large":
        return [rows_each] * n
    return [int(c) for c in rng.integers(0, 4, n) * (np.arange(n) % 3 != r % 3 + 1)]


def _alltoallv_oracle(world, x, counts):
    """MPI's Alltoallv on the rows' raw bytes (any dtype, bfloat16 too)."""
    row = x[0:1].nbytes if x.shape[0] else int(np.prod(x.shape[1:], dtype=np.int64)) * x.itemsize
    recv = world.alltoall(list(counts))  # the counts themselves: a small exchange of ints
    send_b = np.ascontiguousarray(x).reshape(-1).view(np.uint8)
    out = np.empty(sum(recv) * row, np.uint8)
    world.Alltoallv([send_b, [c * row for c in counts]], [out, [c * row for c in recv]])
    return out.view(x.dtype).reshape((sum(recv),) + x.shape[1:]), recv


def _all_to_all_v_paths_pair_up(world, g):
    """Ranks on different paths in one call (the plan, the general path's pairwise steps or
    one-shot rounds; not async calls, which talk on a communicator of their own) still pair up: the same messages, in the same order, per pair.
    Counts that change every call (the plan's case), as lists, int32 / uint8 arrays or numpy
    ints; a strided x (the general path copies it)."""
    n, r = g.size, g.rank
    rng = np.random.default_rng([r, n, 7])
    for call in range(12):
        counts = [int(c) for c in rng.integers(0, 6, n)]
        x = make((sum(counts), 2), "float64", r, 1000 + call)
        want, want_counts = _alltoallv_oracle(world, x, counts)
        given = [counts, np.array(counts, np.int32), np.array(counts, np.uint8), [np.int64(c) for c in counts]][call % 4]
        y, got = comm.all_to_all_v(x, given, g, algorithm=("auto", "pairwise", "direct")[(r + call) % 3])
        same(y, want, f"all_to_all_v, ranks on different paths, call {call}")
        assert got.dtype == np.int64 and got.tolist() == list(want_counts), (call, got, want_counts)
    wide = make((4 * n, 3), "float32", r, 77)
    x = wide[:, :2]  # strided rows: not C-contiguous
    counts = [4] * n
    want, _ = _alltoallv_oracle(world, np.ascontiguousarray(x), counts)
    same(comm.all_to_all_v(x, counts, g)[0], want, "all_to_all_v of a strided x")


def all_to_all_v_cases():
    """comm.all_to_all_v against MPI's Alltoallv: empty, uneven, one destination and large
    sends; 1-D and 2-D rows; several dtypes; async; the traffic formula; bad counts."""
    world, g = MPI.COMM_WORLD, comm.world()
    n, r = g.size, g.rank
    salt = 0
    for case, rows_each in (("empty", 0), ("uneven", 0), ("one", 5), ("large", 40_000)):
        for dtype in ("float32", "bfloat16", "int64", "float64"):
            for tail in ((), (3,)):
                if case == "large" and (tail or dtype != "float32"):
                    continue
                salt += 1
                counts = _v_counts(case, n, r, rows_each)
                x = make((sum(counts),) + tail, dtype, r, salt)
                want, want_counts = _alltoallv_oracle(world, x, counts)
                y, got = comm.all_to_all_v(x, counts, g)
                assert got.dtype == np.int64 and got.tolist() == list(want_counts), (case, got, want_counts)
                same(y, want, f"all_to_all_v {case} {dtype} {tail}")
                y, got = comm.all_to_all_v(x, np.array(counts, np.int32), g, async_op=True).wait()
                same(y, want, f"async all_to_all_v {case} {dtype} {tail}")
                assert got.tolist() == list(want_counts)
                for algorithm in ("pairwise", "direct"):  # forced: the textbook steps and the one-shot rounds
                    y, got = comm.all_to_all_v(x, counts, g, algorithm=algorithm)
                    same(y, want, f"all_to_all_v {case} {dtype} {tail} by {algorithm}")
                    assert got.tolist() == list(want_counts), algorithm
    if no_plans_when_off(g) and n > 1:  # "auto" ran the group's plan (fast/alltoallv.py), one per dtype
        assert {("all_to_all_v", np.dtype(d)) for d in ("float32", "int64", "float64")} <= set(g._plans), g._plans
    _all_to_all_v_paths_pair_up(world, g)
    # Traffic: 8 bytes of count to each other rank, then exactly the rows sent elsewhere.
    counts = _v_counts("uneven", n, r, 0)
    x = make((sum(counts), 4), "float32", r, 99)
    comm.reset_stats()
    comm.all_to_all_v(x, counts, g)  # the plan with the fast path on
    comm.all_to_all_v(x, counts, g, algorithm="direct")  # the same messages, so the same bytes
    comm.all_to_all_v(x, counts, g, algorithm="pairwise")
    s = comm.stats()["all_to_all_v"]
    sent_rows, got_rows = sum(counts) - counts[r], sum(_v_counts("uneven", n, k, 0)[r] for k in range(n) if k != r)
    assert s["calls"] == 3 and s["bytes_sent"] == 3 * (8 * (n - 1) + 16 * sent_rows), (s, counts)
    assert s["bytes_recv"] == 3 * (8 * (n - 1) + 16 * got_rows), (s, counts)
    # Bad counts: one line naming the value, on every rank, before anything is sent.
    bad = [([1] * (n + 1), "must be"), ([-1] + [0] * (n - 1), "negative count -1"),
           ([sum(counts) + 1] + [0] * (n - 1), f"x has {sum(counts)} rows"), ([0.5] * n, "must be")]
    for c, words in bad:
        try:
            comm.all_to_all_v(x, c, g)
        except ValueError as e:
            assert words in str(e) and "\n" not in str(e), (c, str(e))
        else:
            raise AssertionError(f"counts={c}: no ValueError")
    comm.barrier(g)
    print(f"rank {r}/{n}: all_to_all_v matches Alltoallv", flush=True)
