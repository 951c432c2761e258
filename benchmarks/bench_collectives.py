"""Bus bandwidth of minidist's hand-written collectives next to MPI's built-ins.

    python benchmarks/bench_collectives.py [--out DIR] [--quick] [--ranks 2,4] [--launches 3]
                                           [--collectives all_to_all_v,...]

Launches itself under mpiexec for each rank count and collective (``--launches`` times,
interleaved: 2, 4, 2, 4, ...), times all_reduce, all_gather and reduce_scatter at 4 KB .. 64 MB, interleaving
minidist and MPI rep by rep (the bandwidth of a shared machine drifts over minutes, so
back-to-back pairs compare like with like), takes medians per launch and reports the median
over launches with the lowest and highest per-launch ratio (a ratio that flips between
launches is noise, not a result).  Writes DIR/collectives.json plus a short table with the
machine's load average during each launch.  Also measured: the memcpy bandwidth (the ceiling
for shared-memory transfers) and the all-reduce crossover between recursive doubling and
the large-message algorithm (pairwise reduce-scatter + all-gather), which sets
reducing.SMALL_ALL_REDUCE_BYTES(_WIDE) (docs/perf-notes.md).

Each collective gets its own launch because MPICH's built-in collectives change the process
they run in: after one MPI Allreduce or Reduce_scatter_block of 16 MB, a plain 8 MB Sendrecv
in the same process took 2.2 ms instead of 1.8 ms (2 ranks), and minidist's all_gather, built
on Sendrecv, measured 0.84x MPI's instead of 0.96-1.0x.  A minidist program calls no MPI
collective, so it never pays that; within one launch the two sides still alternate rep by rep.

Which call a sample follows matters as much as the drift.  A call right after the other
side's is slower than one right after its own (1 MB all_gather on 4 ranks: 10-36 us slower,
on both sides alike: each side has its own result buffer, and the other side's has just
pushed it out of cache), and small messages are timed as up to 64 back-to-back calls of one
side anyway.  So every rep times each side twice in a row and the table's ratio compares the
second samples, each side right after itself, as a loop of one library's calls runs; the
first samples (each side right after the other's) are reported too, as "after other".
Drivers that run several minidist variants between two MPI calls put MPI after minidist far
more often than the reverse, and so flatter minidist (by 5-25 % at 1 MB in such a run).

Repeated calls with the same shape run minidist's cached plans (comm/fast/), as in a
training loop; the first two (warm-up) calls build them.

Bus bandwidth (the nccl-tests convention, comparable across N): for a message of S bytes
taking t seconds, all_reduce busbw = S/t * 2(N-1)/N; all_gather and reduce_scatter busbw =
S/t * (N-1)/N, S being the full (gathered / pre-scatter) size.  all_to_all_v: S is what each
rank sends in all (S/N to each rank, its own block included; MPI's Alltoallv is told the
receive counts, minidist's exchanges them first), busbw = S/t * (N-1)/N.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]
QUICK_SIZES = [4 << 10, 64 << 10, 1 << 20]
CROSSOVER_SIZES = {"all_reduce": [64 << 10, 256 << 10, 512 << 10, 1 << 20, 4 << 20, 8 << 20],
                   "all_gather": [16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20],
                   "reduce_scatter": [16 << 10, 64 << 10, 256 << 10, 1 << 20],
                   "all_to_all_v": [4 << 10, 64 << 10, 1 << 20, 16 << 20]}
COLLECTIVES = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all_v"]


def _reps(size: int, quick: bool) -> int:
    reps = 300 if size <= 4 << 10 else 100 if size <= 64 << 10 else 30 if size <= 1 << 20 else 10 if size <= 16 << 20 else 7
    return max(3, reps // 4) if quick else reps


def _bus_factor(name: str, n: int) -> float:
    return 2 * (n - 1) / n if name == "all_reduce" else (n - 1) / n


# ----------------------------------------------------------------- inside mpiexec
def worker(out_path: str, quick: bool, collective: str) -> None:
    import numpy as np
    from mpi4py import MPI

    from minidist import comm

    world, g = MPI.COMM_WORLD, comm.world()
    n, r = world.size, world.rank

    def timeit(fn, inner=1):
        """Seconds per call: ``inner`` back-to-back calls after a barrier, as the OSU
        micro-benchmarks do, so that the few microseconds by which ranks leave the barrier
        apart are spread over many calls instead of landing on one small message."""
        world.Barrier()  # the benchmark may use MPI built-ins; the library may not
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        dt = (time.perf_counter() - t0) / inner
        return world.allreduce(dt, op=MPI.MAX)  # the slowest rank defines the collective's time

    def pair(name, size):
        count = size // 4
        x = np.random.default_rng(r).standard_normal(count).astype(np.float32)
        part = x[: count // n]
        full, piece = np.empty_like(x), np.empty(count // n, np.float32)
        res = np.empty_like(x)  # like MPI's receive buffer: the result memory is reused
        even = x[: n * (count // n)]  # reduce_scatter: N equal blocks, as Reduce_scatter_block needs
        # The same input and result arrays every call, on both sides, as in a training loop
        # (minidist's one-shot plans then send and receive in place: comm/fast/).
        gathered, gathered_mpi, mine = res[: n * (count // n)], full[: n * (count // n)], res[: len(piece)]
        ours = {"all_reduce": lambda: comm.all_reduce(x, g, out=res),
                "all_gather": lambda: comm.all_gather(part, g, out=gathered),
                "reduce_scatter": lambda: comm.reduce_scatter(even, g, out=mine)}.get(name)
        mpi = {"all_reduce": lambda: world.Allreduce(x, full),
               "all_gather": lambda: world.Allgather(part, gathered_mpi),
               "reduce_scatter": lambda: world.Reduce_scatter_block(even, piece)}.get(name)
        if name == "all_to_all_v":  # count // n elements to each rank
            per = [count // n] * n
            at = [k * (count // n) for k in range(n)]
            ours = lambda: comm.all_to_all_v(even, per, g)  # noqa: E731
            mpi = lambda: world.Alltoallv([even, per, at, MPI.FLOAT], [gathered_mpi, per, at, MPI.FLOAT])  # noqa: E731
        return ours, mpi

    results = []
    for size in QUICK_SIZES if quick else SIZES:
        for name in [collective]:  # one per launch (see the module docstring)
            ours, mpi = pair(name, size)
            inner = max(1, (256 << 10) // size)  # 64 calls a sample at 4 KB, 1 from 256 KB up
            for _ in range(2):  # warm-up: page faults, scratch buffers, MPI connections
                timeit(ours, inner), timeit(mpi, inner)
            t_ours, t_mpi, cold_ours, cold_mpi = [], [], [], []
            for _ in range(_reps(size, quick)):
                # Each side twice in a row: the first sample runs right after the other
                # side's calls, the second right after its own (see the module docstring).
                cold_ours.append(timeit(ours, inner))
                t_ours.append(timeit(ours, inner))
                cold_mpi.append(timeit(mpi, inner))
                t_mpi.append(timeit(mpi, inner))
            mo, mm = float(np.median(t_ours)), float(np.median(t_mpi))
            f = _bus_factor(name, n)
            results.append(dict(collective=name, ranks=n, bytes=size, minidist_s=mo, mpi_s=mm,
                                minidist_busbw_GBps=size / mo * f / 1e9, mpi_busbw_GBps=size / mm * f / 1e9,
                                ratio=mm / mo, ratio_after_other=float(np.median(cold_mpi) / np.median(cold_ours))))
    crossover = []
    sizes = CROSSOVER_SIZES[collective]
    for size in sizes[:2] if quick else sizes:
        variants = crossover_variants(collective, size, g)
        times = {a: [] for a in variants}
        for fn in variants.values():  # warm-up: plans, scratch buffers
            fn(), fn()
        for rep in range(_reps(size, quick)):
            # Alternate the order: the second of two calls finds more of the input in cache.
            for a, fn in (variants.items() if rep % 2 else reversed(variants.items())):
                times[a].append(timeit(fn, max(1, (256 << 10) // size)))
        crossover.append(dict(collective=collective, ranks=n, bytes=size,
                              times_s={a: float(np.median(t)) for a, t in times.items()}))
    if r == 0:
        src = np.ones(16 << 20, np.float32)  # 64 MB
        dst = np.empty_like(src)
        np.copyto(dst, src)
        best = min(_timed_copy(dst, src) for _ in range(5))
        with open(out_path, "w") as f:
            json.dump(dict(results=results, crossover=crossover, memcpy_GBps=src.nbytes / best / 1e9,
                           load=os.getloadavg()[0]), f)


def crossover_variants(collective, size, g):
    """The algorithms on either side of a size threshold, as callables.  all_reduce names
    them with ``algorithm=`` (plans are cached per algorithm); all_gather and
    reduce_scatter cache plans for "auto" only, so each side sets the one-shot threshold
    (collectives.ALL_GATHER_ONE_SHOT_BYTES, reducing.REDUCE_SCATTER_ONE_SHOT_BYTES) before every call and runs on a
    group of its own, whose plans it keeps."""
    import numpy as np
    from mpi4py import MPI

    from minidist import comm
    from minidist.comm import collectives as C
    from minidist.comm import reducing as R

    n = g.size
    if collective == "all_reduce":
        x = np.ones(size // 4, np.float32)
        return {a: (lambda a=a: comm.all_reduce(x, g, algorithm=a)) for a in ("recursive_doubling", "pairwise")}
    if collective == "all_to_all_v":  # the cached plan ("auto"), the one-shot rounds, the textbook's steps
        x, per = np.ones((size // 4 // n) * n, np.float32), [size // 4 // n] * n
        return {a: (lambda a=a: comm.all_to_all_v(x, per, g, algorithm=a)) for a in ("auto", "direct", "pairwise")}
    x = np.ones((size // 4 // n) * (n if collective == "reduce_scatter" else 1), np.float32)
    variants = {}
    for name, limit in (("direct", 1 << 62), ("rounds", -1)):
        grp = comm.Group(MPI.COMM_WORLD.Dup(), f"bench_{name}")
        res = np.empty(x.size * n if collective == "all_gather" else x.size // n, np.float32)  # one each (cache)
        if collective == "all_gather":
            def fn(grp=grp, limit=limit, res=res):
                C.ALL_GATHER_ONE_SHOT_BYTES = C.ONE_SHOT_MAX_RANKS = limit
                return comm.all_gather(x, grp, out=res)
        else:
            def fn(grp=grp, limit=limit, res=res):
                R.REDUCE_SCATTER_ONE_SHOT_BYTES = limit
                return comm.reduce_scatter(x, grp, out=res)
        variants[name] = fn
    return variants


def _timed_copy(dst, src):
    import numpy as np

    t0 = time.perf_counter()
    np.copyto(dst, src)
    return time.perf_counter() - t0


# ------------------------------------------------------------------- the launcher
def launch(nprocs: int, quick: bool, collective: str) -> dict:
    from minidist.host.launcher import mpiexec_command

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "part.json")
        from minidist.host.blas_env import blas_threads
        env = dict(os.environ, **blas_threads(1))
        cmd = mpiexec_command(nprocs) + [sys.executable, os.path.abspath(__file__), "--worker", path,
                                         "--collective", collective]
        subprocess.run(cmd + (["--quick"] if quick else []), check=True, env=env, timeout=1800)
        with open(path) as f:
            return json.load(f)


def combine(parts: list) -> list:
    """Per (collective, ranks, size): median times over launches, ratio spread."""
    import statistics

    rows = {}
    for part in parts:
        for row in part["results"]:
            rows.setdefault((row["collective"], row["ranks"], row["bytes"]), []).append(row)
    out = []
    for (name, n, size), runs in rows.items():
        mo = statistics.median(r["minidist_s"] for r in runs)
        mm = statistics.median(r["mpi_s"] for r in runs)
        f = _bus_factor(name, n)
        out.append(dict(collective=name, ranks=n, bytes=size, minidist_s=mo, mpi_s=mm,
                        minidist_busbw_GBps=size / mo * f / 1e9, mpi_busbw_GBps=size / mm * f / 1e9,
                        ratio=statistics.median(r["ratio"] for r in runs),
                        ratio_min=min(r["ratio"] for r in runs), ratio_max=max(r["ratio"] for r in runs),
                        ratio_after_other=statistics.median(r["ratio_after_other"] for r in runs),
                        launches=len(runs)))
    return sorted(out, key=lambda r: (r["ranks"], COLLECTIVES.index(r["collective"]), r["bytes"]))


def table(report: dict) -> str:
    lines = [f"memcpy bandwidth (ceiling): {report['memcpy_GBps']:.1f} GB/s; load average during the "
             f"launches: {', '.join(f'{v:.1f}' for v in report['load'])}",
             "ratio = MPI time / minidist time (>1: minidist faster), each side's call right after its own, "
             "median over launches [min..max]; after other: the same for calls right after the other side's",
             f"{'collective':<15}{'N':>3}{'size':>7}{'minidist':>12}{'MPI':>12}{'busbw ours':>12}"
             f"{'busbw MPI':>11}{'ratio':>7}  {'range':<12}{'after other':>12}"]
    for row in report["results"]:
        lines.append(f"{row['collective']:<15}{row['ranks']:>3}{_size(row['bytes']):>7}"
                     f"{row['minidist_s'] * 1e6:>10.1f}us{row['mpi_s'] * 1e6:>10.1f}us"
                     f"{row['minidist_busbw_GBps']:>8.2f}GB/s{row['mpi_busbw_GBps']:>7.2f}GB/s{row['ratio']:>7.2f}"
                     f"  [{row['ratio_min']:.2f}..{row['ratio_max']:.2f}]{row['ratio_after_other']:>11.2f}")
    lines.append("crossovers (median us per launch; \"rounds\" = what auto takes without the one-shot lane)")
    for row in sorted(report["crossover"], key=lambda r: (r["collective"], r["ranks"], r["bytes"])):
        lines.append(f"  {row['collective']:<15} N={row['ranks']} {_size(row['bytes']):>7}  " +
                     "  ".join(f"{a} {t * 1e6:.1f}" for a, t in row["times_s"].items()))
    return "\n".join(lines)


def _size(b: int) -> str:
    return f"{b >> 20} MB" if b >= 1 << 20 else f"{b >> 10} KB"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench-results", help="directory for collectives.json")
    p.add_argument("--quick", action="store_true", help="small sizes and few reps (smoke run)")
    p.add_argument("--ranks", default="2,4", help="comma-separated rank counts")
    p.add_argument("--launches", type=int, default=3,
                   help="mpiexec launches per rank count (odd, so that the median is one launch's)")
    p.add_argument("--collectives", default=",".join(COLLECTIVES),
                   help=f"comma-separated, of {','.join(COLLECTIVES)} (default: all)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--collective", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.worker, args.quick, args.collective)
        return
    names = args.collectives.split(",")
    if not set(names) <= set(COLLECTIVES):
        p.error(f"--collectives {args.collectives!r}: choose from {','.join(COLLECTIVES)}")
    report = {"results": [], "crossover": [], "memcpy_GBps": None, "quick": args.quick, "load": []}
    parts = []
    for _ in range(args.launches):
        for nprocs in (int(v) for v in args.ranks.split(",")):
            for name in names:
                part = launch(nprocs, args.quick, name)
                parts.append(part)
                report["crossover"] += part["crossover"]
                report["memcpy_GBps"] = max(report["memcpy_GBps"] or 0.0, part["memcpy_GBps"])
                report["load"].append(part["load"])
    report["results"] = combine(parts)
    report["launches"] = parts
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "collectives.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(table(report))


if __name__ == "__main__":
    main()
