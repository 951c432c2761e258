"""Overlapping communication with computation: an async all-reduce next to a matmul.

    mpiexec -n 2 python examples/03_async_overlap.py [--mb 32] [--quick]

Data-parallel training all-reduces the gradients of layer k while the backward pass is still
computing layer k-1.  That only pays if the all-reduce really makes progress while the
caller computes.  ``async_op=True`` hands the collective to the group's progress thread
(see minidist/comm/progress.py); NumPy releases the GIL inside the matmul, so both run at
the same time and the wall time approaches max(t_comm, t_compute) instead of their sum.

The script times (1) the all-reduce alone, (2) the matmul alone, (3) both in sequence, and
(4) both overlapped, and checks that the overlapped result equals the sequential one.  On a
machine with fewer cores than ranks x 2 threads the two compete for a core and the gain
shrinks: the overlap needs somewhere to run.
"""
import argparse
import os
import time

# One BLAS thread per rank: the ranks already share the cores, and the progress thread needs one.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402  (after the thread settings)

from minidist import comm  # noqa: E402


def timed(fn, reps):
    """Best of ``reps`` wall times, the slowest rank's (so every rank sees the same number
    and takes the same decisions below: a rank-dependent branch around collectives hangs)."""
    best, out = float("inf"), None
    for _ in range(reps):
        comm.barrier(g)
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return float(comm.all_reduce(np.array([best]), g, op="max")[0]), out


parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--mb", type=float, default=32.0, help="all-reduce size in MB (float32)")
parser.add_argument("--n", type=int, default=0, help="matmul size (default: chosen to match the all-reduce time)")
parser.add_argument("--reps", type=int, default=3)
parser.add_argument("--quick", action="store_true", help="small sizes, for tests")
args = parser.parse_args()
if args.quick:
    args.mb, args.reps = 2.0, 2

g = comm.world()
rng = np.random.default_rng(g.rank)
grad = rng.integers(-8, 8, size=int(args.mb * 2**20) // 4).astype(np.float32)

t_comm, reference = timed(lambda: comm.all_reduce(grad, g), args.reps)
n = args.n or 256
if not args.n:  # grow the matmul until it takes about as long as the all-reduce
    while n < 4096:
        a = rng.standard_normal((n, n)).astype(np.float32)
        if timed(lambda: a @ a, 1)[0] >= t_comm:
            break
        n = int(n * 1.25)
a = rng.standard_normal((n, n)).astype(np.float32)
t_compute, _ = timed(lambda: a @ a, args.reps)


def sequential():
    y = comm.all_reduce(grad, g)
    a @ a
    return y


def overlapped():
    handle = comm.all_reduce(grad, g, async_op=True)  # starts now, on the progress thread
    a @ a                                             # meanwhile: compute
    return handle.wait()


t_seq, y_seq = timed(sequential, args.reps)
t_ovl, y_ovl = timed(overlapped, args.reps)
assert np.array_equal(y_seq, reference) and np.array_equal(y_ovl, reference)
if g.rank == 0:
    print(f"{g.size} ranks, all-reduce of {args.mb:g} MB float32, matmul {n}x{n} (best of {args.reps})")
    print(f"  all-reduce alone      {t_comm * 1e3:8.2f} ms")
    print(f"  matmul alone          {t_compute * 1e3:8.2f} ms")
    print(f"  sequential            {t_seq * 1e3:8.2f} ms")
    print(f"  overlapped (async)    {t_ovl * 1e3:8.2f} ms   ({t_seq / t_ovl:.2f}x faster)")
    print("overlapped result == sequential result")
