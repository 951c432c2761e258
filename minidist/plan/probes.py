"""The probes that measure this machine for the planner (``python -m minidist.plan
--calibrate``; :func:`minidist.plan.validate.calibrate` runs them and stores the
:class:`~minidist.plan.machine.Machine`):

* the GEMM rate of one core per dtype on the products a small GPT makes, and the copy
  bandwidth (:func:`measure_compute`);
* the point-to-point latency and bandwidth between two local ranks, and the own cost of a
  minidist collective call (:func:`_p2p_probe`);
* minidist's fixed costs per block and microbatch, block and step, microbatch and step, from
  four tiny real steps (:func:`fixed_costs`);
* minidist's ring attention on two ranks, per tile and per score (:func:`measure_ring`);
* how long a sync point waits for a descheduled partner on ranks that share cores
  (:func:`measure_sync`);
* the CPU seconds the machine's other processes use (:func:`busy_seconds`,
  :func:`others_load`), read during every measured run.

Each multi-rank probe runs in its own ``mpiexec`` launch (the planner itself never starts
MPI) and writes its figures to a file the caller reads (:func:`run_probe`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from minidist.host.blas_env import blas_threads
from minidist.plan.machine import INF

def mpiexec(ranks: int) -> list:
    """``mpiexec -n N`` for this Python's MPI (minidist/host/launcher.py); ValueError if there is none."""
    from minidist.host.launcher import mpiexec_command

    try:
        return mpiexec_command(ranks)
    except RuntimeError as exc:
        raise ValueError(str(exc)) from None


def one_blas_thread() -> dict:
    """This process's environment with one BLAS thread, whatever the user set: every rank of
    minidist's runs here has one, and so has every process a probe starts."""
    return dict(os.environ, **blas_threads(1))


def run_probe(name: str, ranks: int):
    """Launch the probe ``name`` (a function of this module that rank 0 makes write its figures
    to the path it is given) on ``ranks`` ranks under ``mpiexec``; what it wrote (JSON)."""
    launcher = mpiexec(ranks)
    fd, out = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        code = f"import minidist.plan.probes as m; m.{name}({out!r})"
        subprocess.run(launcher + [sys.executable, "-c", code], check=True, env=one_blas_thread(),
                       capture_output=True, timeout=300)
        with open(out) as f:
            return json.load(f)
    finally:
        os.unlink(out)


def train_rows(args: list, steps: int, ranks: int = 1, timeout: float = 300) -> list:
    """Train ``steps`` steps for real, ``python -m minidist.train ARGS`` (under ``mpiexec`` on
    more than one rank), with one warm-up step, no evaluation, no log lines and
    ``--peak-gflops 1``; the rows of its ``--metrics-jsonl``.  RuntimeError with the last line
    of its stderr if it fails."""
    launcher = mpiexec(ranks) if ranks > 1 else []
    fd, path = tempfile.mkstemp(suffix=".jsonl")
    os.close(fd)
    args = [*args, "--steps", str(steps), "--warmup", "1", "--eval-every", "0", "--log-every", str(steps + 1),
            "--quiet", "--metrics-jsonl", path, "--peak-gflops", "1"]
    try:
        proc = subprocess.run(launcher + [sys.executable, "-m", "minidist.train", *args], capture_output=True,
                              text=True, env=one_blas_thread(), timeout=timeout)
        if proc.returncode:
            raise RuntimeError(f"minidist.train {' '.join(args)} failed: {proc.stderr.strip().splitlines()[-1:]}")
        with open(path) as f:
            return [json.loads(line) for line in f]
    finally:
        os.unlink(path)


def _best(fn, seconds: float = 0.3, reps_min: int = 3) -> float:
    fn()
    best, n, end = INF, 0, time.perf_counter() + seconds
    while n < reps_min or time.perf_counter() < end:
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        n += 1
    return best


def gemm_rate(dtype: str = "float32", seconds: float = 0.3) -> float:
    """FLOP/s of the products a small GPT's step makes (activations times a weight, forward
    and both backward forms, each allocating its result as minidist's ops do); the best
    time: what one core does when nothing else runs (a shared machine's load is measured
    separately, while the runs it slows run)."""
    import numpy as np

    rng = np.random.default_rng(0)
    rates = []
    for n, d in ((1024, 128), (512, 256)):
        a = rng.standard_normal((n, d)).astype(dtype)
        w = rng.standard_normal((d, 4 * d)).astype(dtype)
        g = rng.standard_normal((n, 4 * d)).astype(dtype)
        flops = 2 * n * d * 4 * d
        for fn in (lambda: a @ w, lambda: g @ w.T, lambda: a.T @ g):
            rates.append(flops / _best(fn, seconds / 6))
    return sorted(rates)[len(rates) // 2]


def measure_compute() -> dict:
    """GEMM rates (float32, float64) and element-wise bandwidth of one core.  Run in a process
    with one BLAS thread (as every rank of minidist's runs here has)."""
    import numpy as np

    peak = {dtype: gemm_rate(dtype) for dtype in ("float32", "float64")}
    x = np.random.default_rng(0).standard_normal(1 << 19).astype("float32")  # 2 MiB, a small model's activations
    y = x.copy()
    mem_bw = 3 * x.nbytes / _best(lambda: x + y, 0.2)  # two reads and a write, result allocated
    tiny = np.ones(4, "float32")
    op = _best(lambda: np.add(tiny, tiny), 0.1)
    return {"peak": peak, "mem_bw": mem_bw, "numpy_op_s": op}


def busy_seconds() -> float:
    """CPU seconds all processes of this machine have run so far (/proc/stat; 0 elsewhere)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0.0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def others_load(busy: float, ours: float, wall: float, ranks: int, cores: int) -> float:
    """Other runnable processes while ours ran, from the CPU seconds everyone used (``busy``)
    and ours used (``ours``) over ``wall`` seconds: if L others and our W ranks share C cores
    fairly, the others take b = C L / (L + W) cores, so L = W b / (C - b)."""
    b = min(max(0.0, (busy - ours) / max(wall, 1e-9)), cores * 0.95)
    return ranks * b / (cores - b)


def with_others_load(launch, ranks: int, cores: int):
    """``launch()``'s result and :func:`others_load` while it ran, ``ours`` being the CPU
    seconds of this process's children (the ``ranks`` ranks it started)."""
    import resource

    before, kids, t0 = busy_seconds(), resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    result = launch()
    wall, after = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
    ours = (after.ru_utime + after.ru_stime) - (kids.ru_utime + kids.ru_stime)
    return result, others_load(busy_seconds() - before, ours, wall, ranks, cores)


def _p2p_probe(out_path: str) -> None:
    """Under mpiexec -n 2: ping-pong between the two ranks (MPI's point-to-point, as minidist's
    collectives use it); rank 0 writes latency and bandwidth."""
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    other = 1 - comm.rank

    def pingpong(nbytes, reps):
        buf = np.zeros(max(1, nbytes), np.uint8)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            if comm.rank == 0:
                comm.Send(buf, other, 7)
                comm.Recv(buf, other, 7)
            else:
                comm.Recv(buf, other, 7)
                comm.Send(buf, other, 7)
            times.append((time.perf_counter() - t0) / 2)
        return sorted(times)[len(times) // 2]

    latency = pingpong(8, 200)
    big = 8 << 20
    bw = big / max(1e-9, pingpong(big, 20) - latency)
    from minidist import comm as mcomm  # minidist's own all-reduce of one scalar: the fixed cost of a collective call

    g, x = mcomm.world(), np.ones(1)
    times = []
    for _ in range(200):
        t0 = time.perf_counter()
        mcomm.all_reduce(x, g)
        times.append(time.perf_counter() - t0)
    coll = max(0.0, sorted(times)[len(times) // 2] - 2 * latency)
    if comm.rank == 0:
        with open(out_path, "w") as f:
            json.dump({"latency": latency, "bw": bw, "coll_overhead_s": coll}, f)


def _step_probe(layers: int, grad_accum: int = 1, steps: int = 12) -> float:
    """The fastest untraced training step of a tiny model (one process, one BLAS thread): what
    minidist's operations cost when the arithmetic is nothing (the fastest: a shared
    machine's load only ever adds)."""
    rows = train_rows(["--layers", str(layers), "--d-model", "8", "--heads", "2", "--seq-len", "8",
                       "--batch-size", "2", "--grad-accum", str(grad_accum)], steps)
    return min(r["step_time_s"] for r in rows[1:] if "peak_mem_mb" not in r)  # untraced steps


def fixed_costs(repeats: int = 3) -> dict:
    """minidist's fixed costs from four tiny runs, t(L blocks, A microbatches) =
    L (A a + b) + A c + d: a per block and microbatch, b per block and step, c per
    microbatch outside the blocks, d per step (each probe the best of ``repeats``: a shared
    machine's load only ever adds)."""
    t = {(L, A): min(_step_probe(L, A) for _ in range(repeats)) for L in (1, 3) for A in (1, 2)}
    a = max(0.0, ((t[3, 2] - t[1, 2]) - (t[3, 1] - t[1, 1])) / 2)
    b = max(0.0, (t[3, 1] - t[1, 1]) / 2 - a)
    c = max(0.0, (t[1, 2] - t[1, 1]) - a)
    d = max(0.0, t[1, 1] - a - b - c)
    return {"block_mb_s": a, "block_step_s": b, "mb_overhead_s": c, "step_overhead": d}


# (batch x heads, chunk, tile) of the ring probe: the tile count and the scores vary apart
RING_PROBES = ((64, 16, 16), (64, 16, 8), (16, 16, 16))
RING_HEAD_DIM = 32  # the head width the probe's per-score cost is measured at


def _ring_probe(out_path: str, reps: int = 15) -> None:
    """Under mpiexec -n 2 (cp = 2, zig-zag): the median seconds of minidist's ring attention,
    forward and backward, of each :data:`RING_PROBES` shape; rank 0 writes them with the tiles
    and the scores (of all heads) each ran."""
    import statistics

    import numpy as np

    from minidist import comm
    from minidist.layout.grid import ring_tiles
    from minidist.model.autograd import Tensor
    from minidist.parallel.context.ring import ring_attention

    g = comm.world()
    rng = np.random.default_rng(g.rank)
    rows = []
    for bh, c, block in RING_PROBES:
        shape = (bh // 4, 4, 2 * c, RING_HEAD_DIM)  # this rank's two zig-zag chunks of 4c tokens
        q, k, v = (Tensor(rng.standard_normal(shape).astype(np.float32), requires_grad=True) for _ in range(3))
        grad = rng.standard_normal(shape).astype(np.float32)
        times = []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            ring_attention(q, k, v, g, block=block).backward(grad)
            times.append(time.perf_counter() - t0)
        tiles, scores = max(ring_tiles(g.size, 4 * c, True, block))
        rows.append({"s": statistics.median(times[1:]), "tiles": tiles, "scores": bh * scores})
    if g.rank == 0:
        with open(out_path, "w") as f:
            json.dump(rows, f)


def fit_ring(rows: list) -> dict:
    """Seconds per tile and per score, t = tiles a + scores b, fitted to the probe's rows by
    least squares; where one comes out negative it is 0 and the other is fitted alone.  A
    tile's fixed part holds its NumPy calls and its share of the ring's messages (every ring
    step brings new tiles)."""
    import numpy as np

    A = np.array([[r["tiles"], r["scores"]] for r in rows], float)
    t = np.array([r["s"] for r in rows])
    a, b = np.linalg.lstsq(A, t, rcond=None)[0]
    if a < 0 or b < 0:
        col = 1 if a < 0 else 0
        only = max(0.0, float(A[:, col] @ t / (A[:, col] @ A[:, col])))
        a, b = (0.0, only) if a < 0 else (only, 0.0)
    return {"ring_tile_s": float(a), "ring_score_s": float(b)}


def measure_ring(log=print) -> dict:
    """minidist's ring attention on two ranks (:func:`_ring_probe`), fitted by :func:`fit_ring`."""
    ring = fit_ring(run_probe("_ring_probe", 2))
    share = min(1.0, (os.cpu_count() or 1) / 2)  # a rank's share of a core in the probe: the planner divides by its own
    ring = {k: v * share for k, v in ring.items()}
    log(f"  minidist's ring attention on 2 ranks, forward + backward: {ring['ring_tile_s'] * 1e6:.0f} us per tile, "
        f"{ring['ring_score_s'] * 1e9:.1f} ns per score")
    return ring


def _sync_probe(out_path: str, reps: int = 60, rounds: int = 8) -> None:
    """Under mpiexec on fewer cores than ranks: the extra seconds per synchronisation (a scalar
    all-reduce) between stretches of ~2 ms of arithmetic, over the same loop without it.

    The two loops alternate, ``rounds`` times each, and each round's difference counts: the
    median of those.  A difference of two loops' times is small beside either, and the
    machine's speed drifts between loops; pairing neighbours and taking the median keeps one
    slow loop from deciding it (the best time of each kind, compared, moved several-fold
    from one launch to the next: docs/planner.md)."""
    import numpy as np

    from minidist import comm

    g = comm.world()
    a = np.ones((256, 256), np.float32)
    work = max(1, int(2e-3 * 100e9 / (2 * 256**3)))

    def loop(sync: bool) -> float:
        comm.all_reduce(np.ones(1), g)  # untimed: every loop starts with the ranks together
        t0 = time.perf_counter()
        for _ in range(reps):
            for _ in range(work):
                a @ a
            if sync:
                comm.all_reduce(np.ones(1), g)
        return time.perf_counter() - t0

    def pair(first_synced: bool) -> float:  # the order alternates, so a drift cancels
        if first_synced:
            synced = loop(True)
            return synced - loop(False)
        alone = loop(False)
        return loop(True) - alone

    loop(True)
    extra = [pair(i % 2 == 0) / reps for i in range(rounds)]
    mine = comm.all_gather(np.array([max(0.0, float(np.median(extra)))]), g)
    if g.rank == 0:
        with open(out_path, "w") as f:
            json.dump({"extra_s": float(np.mean(mine))}, f)


def measure_sync(cores: int, log=print, launches: int = 3) -> float:
    """The scheduler's slice as a synchronisation sees it: with W ranks and L other processes
    on C cores a rank runs C / (W + L) of the time, and waits at each sync point for a
    descheduled partner with probability 1 - C / (W + L), for one slice on average.

    Measured on 2C ranks, two per core: the oversubscription the tests, the examples and
    ``--validate`` run.  The picture's one constant depends on W: on C + 1 ranks the slice
    comes out several times longer (ranks whose waits yield hand their core to a partner
    sooner when every core has two of them).  The median of ``launches`` probes, since one
    probe lands on one of the machine's two speed levels (figures: docs/planner.md)."""
    ranks = 2 * cores
    slices = sorted(_sync_slice(ranks, cores) for _ in range(launches))
    slice_s = slices[len(slices) // 2]
    log(f"  a sync point on {ranks} ranks over {cores} cores: a descheduled partner's slice {slice_s * 1e3:.2f} ms"
        + (f" (median of {', '.join(f'{x * 1e3:.2f}' for x in slices)})" if len(slices) > 1 else ""))
    return slice_s


def _sync_slice(ranks: int, cores: int) -> float:
    """One launch of the sync probe: the slice its extra seconds per sync point imply."""
    probe, load = with_others_load(lambda: run_probe("_sync_probe", ranks), ranks, cores)
    extra = probe["extra_s"]
    idle = 1 - min(1.0, cores / (ranks + load))
    return extra / idle if idle > 0 else 0.0
