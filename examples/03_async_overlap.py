"""Overlapping communication with computation: an async all-reduce next to a matmul.

    mpiexec -n 2 python examples/03_async_overlap.py [--mb 32] [--gbps 1] [--quick]

Data-parallel training all-reduces the gradients of layer k while the backward pass is still
computing layer k-1.  That only pays if the all-reduce really makes progress while the
caller computes.  ``async_op=True`` hands the collective to the group's progress thread
(see minidist/comm/progress.py); NumPy releases the GIL inside the matmul and mpi4py inside
MPI calls, so both threads run at the same time and the wall time approaches
max(t_comm, t_compute) instead of their sum.

The script times (1) the all-reduce alone, (2) a matmul sized to take about as long, (3) both
in sequence and (4) both overlapped, and checks that the overlapped result equals the
sequential one.  It does this twice:

* **real link**: MPI over shared memory.  Here "communication" is the CPU copying bytes
  (and adding them, for a reduction), and an MPI rank waiting for its neighbour spins on a
  core.  With 2 ranks on a 2-core machine both cores are already busy with the matmuls, so
  the progress threads can only run when the scheduler takes a core away from a matmul:
  the two share the cores instead of running side by side, and the gain is small (it grows
  with spare cores: one per rank for the matmul plus one for its progress thread).
* **simulated link** (``comm.set_link_model(gbps=...)``, like ``MINIDIST_LINK_GBPS``): every
  message first waits as long as it would take on a link of that speed, in a sleep that
  frees the core, as a real NIC moves data without the CPU.  This is the situation of a
  cluster, and there the overlap hides almost all of the smaller of the two times.

BLAS runs with one thread per rank: the ranks already share the cores.
"""
import argparse
import os
import time

# One BLAS thread per rank (set before NumPy loads BLAS): the ranks already share the cores.
from minidist.host.blas_env import pin_blas_threads  # noqa: E402  (imports neither NumPy nor MPI)

pin_blas_threads(1)  # one BLAS thread per rank, before NumPy loads: the ranks already share the cores

import numpy as np  # noqa: E402  (after the thread settings)

from minidist import comm  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--mb", type=float, default=32.0, help="all-reduce size on the real link, MB (float32)")
parser.add_argument("--sim-mb", type=float, default=8.0, help="all-reduce size on the simulated link, MB")
parser.add_argument("--gbps", type=float, default=1.0, help="simulated link bandwidth, Gbit/s")
parser.add_argument("--reps", type=int, default=3)
parser.add_argument("--quick", action="store_true", help="small sizes, for tests")
args = parser.parse_args()
if args.quick:
    args.mb, args.sim_mb, args.reps = 2.0, 1.0, 2

g = comm.world()
rng = np.random.default_rng(g.rank)


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


def matmul_as_long_as(seconds):
    """A square float32 matrix whose product with itself takes about ``seconds``."""
    n = 128
    while n < 4096:
        a = rng.standard_normal((n, n)).astype(np.float32)
        if timed(lambda: a @ a, 1)[0] >= seconds:
            return a
        n = int(n * 1.25)
    return rng.standard_normal((n, n)).astype(np.float32)


def experiment(label, mb):
    grad = rng.integers(-8, 8, size=int(mb * 2**20) // 4).astype(np.float32)
    t_comm, reference = timed(lambda: comm.all_reduce(grad, g), args.reps)
    a = matmul_as_long_as(t_comm)
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
        hidden = (t_seq - t_ovl) / min(t_comm, t_compute)  # 1.0 = the smaller one fully hidden
        print(f"{label}: all-reduce of {mb:g} MB float32, matmul {a.shape[0]}x{a.shape[0]} (best of {args.reps})")
        print(f"  all-reduce alone      {t_comm * 1e3:8.2f} ms")
        print(f"  matmul alone          {t_compute * 1e3:8.2f} ms")
        print(f"  sequential            {t_seq * 1e3:8.2f} ms")
        print(f"  overlapped (async)    {t_ovl * 1e3:8.2f} ms   ({t_seq / t_ovl:.2f}x faster, "
              f"{100 * hidden:.0f}% of the shorter part hidden)")
    return t_seq, t_ovl


if g.rank == 0:
    print(f"{g.size} ranks, {os.cpu_count()} cores, 1 BLAS thread per rank")
experiment("real link (shared memory)", args.mb)
comm.set_link_model(gbps=args.gbps)
t_seq, t_ovl = experiment(f"simulated {args.gbps:g} Gbit/s link", args.sim_mb)
comm.set_link_model()
if g.rank == 0:
    print("overlapped result == sequential result")
