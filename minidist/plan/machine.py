"""The machines the planner prices a step on: presets, and this machine measured.

A :class:`Machine` is a handful of rates, each with the stated share of it a real program
reaches (the planner's only efficiency assumptions; docs/planner.md says where they come
from):

* compute: the peak dense matmul rate per dtype, the share of it large GEMMs reach
  (``gemm_eff``) and the share attention kernels reach (``attn_eff``); the memory bandwidth
  that element-wise work (norms, activations, the optimizer) is bound by; fixed costs per
  block and microbatch, per block and step, and per step (on a CPU: the Python and NumPy
  calls of minidist's operations; on a GPU the launches, hidden behind running kernels);
* links, innermost first: each level's size (ranks that share it, e.g. 8 GPUs on NVLink),
  bandwidth per rank and direction, latency per message, and the share of the bandwidth a
  collective reaches (``link_eff``); ``overlap``: the share of the communication that the
  schedule allows to overlap that the machine does hide (1 on GPUs with their streams; 0
  for minidist on a CPU, where a single thread makes progress only while it waits);
* memory per device and the share of it a run may plan to fill (``mem_usable``).

``this-machine`` is measured by :func:`calibrate` (GEMM rates per dtype on one core, the
element-wise bandwidth, minidist's per-operation overhead from two tiny real steps, and the
point-to-point bandwidth and latency between two local ranks) and stored as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class Link:
    """One level of the network: ``size`` ranks share it (inf: everything), ``bw`` bytes/s per
    rank and direction, ``latency`` seconds per message."""

    name: str
    size: float
    bw: float
    latency: float


@dataclass(frozen=True)
class Machine:
    name: str
    peak: dict                    # dtype -> peak dense matmul FLOP/s of one device
    mem_bytes: float              # memory of one device
    mem_bw: float                 # bytes/s of element-wise work
    links: tuple                  # Link, innermost first
    gemm_eff: float = 1.0         # share of ``peak`` large matmuls reach
    attn_eff: float = 1.0         # share of ``peak`` attention kernels reach
    link_eff: float = 1.0         # share of a link's bandwidth a collective reaches
    mem_usable: float = 1.0       # share of ``mem_bytes`` a plan may fill
    overlap: float = 1.0          # share of the overlappable communication hidden behind compute
    block_mb_s: float = 0.0       # fixed seconds per block and microbatch (launches; Python + NumPy calls)
    block_step_s: float = 0.0     # fixed seconds per block and step (the optimizer's per-tensor calls)
    step_overhead: float = 0.0    # fixed seconds per step outside the blocks (loss, bookkeeping)
    cores: int = 0                # CPU: the cores ranks share (0: a device per rank)
    notes: dict = field(default_factory=dict)

    def link_for(self, span: int) -> Link:
        """The innermost level whose domain holds ``span`` consecutive ranks."""
        for link in self.links:
            if span <= link.size:
                return link
        return self.links[-1]

    def to_json(self) -> dict:
        d = asdict(self)
        d["links"] = [asdict(link) for link in self.links]
        return d

    @staticmethod
    def from_json(d: dict) -> "Machine":
        d = dict(d)
        d["links"] = tuple(Link(**{**link, "size": float(link["size"])}) for link in d["links"])
        return Machine(**d)


INF = float("inf")

# One H100 SXM (NVIDIA's datasheet: 989 TFLOP/s dense bf16, 80 GiB HBM3 at 3.35 TB/s, NVLink 4
# at 450 GB/s per direction among 8 GPUs through NVSwitch) and one 400 Gb/s InfiniBand NIC
# per GPU across nodes.  The efficiencies are the planner's stated assumptions (see
# docs/planner.md): 60 % of peak for the bf16 GEMMs of a training step (cuBLAS reaches 70-80 %
# on one large GEMM; sustained clocks under a full node's power cap and the tp-split shapes
# give less), 35 % for attention (FlashAttention-2 on H100, Shah et al. 2024, figure 5), 75 %
# of a link's bandwidth for NCCL's rings,
# 92 % of the memory for the plan (the CUDA context, NCCL's buffers and the caching
# allocator's fragmentation take the rest).
H100_NVLINK_IB = Machine(
    name="h100-nvlink-ib",
    peak={"bf16": 989e12, "fp16": 989e12, "fp8": 1979e12, "tf32": 494e12, "fp32": 67e12, "fp64": 67e12},
    mem_bytes=80 * 2**30, mem_bw=3.35e12,
    links=(Link("nvlink", 8, 450e9, 3e-6), Link("infiniband", INF, 50e9, 8e-6)),
    gemm_eff=0.6, attn_eff=0.35, link_eff=0.75, mem_usable=0.92,
    overlap=1.0,  # separate CUDA streams: communication runs beside compute where the schedule allows
    block_mb_s=60 * 5e-6,  # a block's ~60 kernels forward and backward, ~5 us each of launch and tail
)

PRESETS = {"h100-nvlink-ib": H100_NVLINK_IB}
DEFAULT_CALIBRATION = os.path.join(os.path.expanduser("~"), ".cache", "minidist", "this-machine.json")


def calibration_path(path: str | None = None) -> str:
    return path or os.environ.get("MINIDIST_PLAN_MACHINE") or DEFAULT_CALIBRATION


def load(name_or_path: str, calibration: str | None = None) -> Machine:
    """A preset by name, ``this-machine`` from its calibration file, or a JSON file's machine.
    Raises ValueError (one line) when there is none."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    path = calibration_path(calibration) if name_or_path == "this-machine" else name_or_path
    if not os.path.isfile(path):
        if name_or_path == "this-machine":
            raise ValueError(f"no calibration of this machine at {path}: run python -m minidist.plan --calibrate")
        raise ValueError(f"--machine {name_or_path}: not a preset ({', '.join(PRESETS)}, this-machine) nor a file")
    try:
        with open(path) as f:
            return Machine.from_json(json.load(f))
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"--machine {name_or_path}: cannot read {path} ({exc})") from None


# ------------------------------------------------------------------ measuring this machine


def _best(fn, seconds: float = 0.3, reps_min: int = 3) -> float:
    fn()
    best, n, end = INF, 0, time.perf_counter() + seconds
    while n < reps_min or time.perf_counter() < end:
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        n += 1
    return best


def measure_compute() -> dict:
    """GEMM rates (float32, float64) and element-wise bandwidth of one core.  Run in a process
    with one BLAS thread (as every rank of minidist's runs here has)."""
    import numpy as np

    rng = np.random.default_rng(0)
    peak = {}
    for dtype in ("float32", "float64"):
        rates = []
        for m, k, n in ((2048, 128, 512), (1024, 256, 1024), (512, 512, 512)):  # model-shaped products
            a = rng.standard_normal((m, k)).astype(dtype)
            b = rng.standard_normal((k, n)).astype(dtype)
            out = np.empty((m, n), dtype)
            rates.append(2 * m * k * n / _best(lambda: np.matmul(a, b, out=out)))
        peak[dtype] = sorted(rates)[1]
    x = rng.standard_normal(1 << 19).astype("float32")  # 2 MiB: the size of a small model's activations
    y, out = np.empty_like(x), np.empty_like(x)
    mem_bw = 3 * x.nbytes / _best(lambda: np.add(x, y, out=out))  # two reads and a write
    tiny = np.ones(4, "float32")
    op = _best(lambda: np.add(tiny, tiny), seconds=0.1)
    return {"peak": peak, "mem_bw": mem_bw, "numpy_op_s": op}


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
    if comm.rank == 0:
        with open(out_path, "w") as f:
            json.dump({"latency": latency, "bw": bw}, f)


def _step_probe(layers: int, steps: int = 8, grad_accum: int = 1) -> float:
    """Median seconds of an untraced training step of a tiny model (one process, one BLAS
    thread): what minidist's operations cost when the arithmetic is nothing."""
    fd, path = tempfile.mkstemp(suffix=".jsonl")
    os.close(fd)
    from ..blas_env import blas_threads

    env = dict(os.environ, **blas_threads(1))
    cmd = [sys.executable, "-m", "minidist.train", "--layers", str(layers), "--d-model", "8", "--heads", "2",
           "--seq-len", "8", "--batch-size", "2", "--grad-accum", str(grad_accum), "--steps", str(steps), "--eval-every", "0", "--log-every",
           "1000", "--quiet", "--warmup", "1", "--metrics-jsonl", path]
    subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=300)
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    os.unlink(path)
    times = sorted(r["step_time_s"] for r in rows[1:-1])  # untraced steps
    return times[len(times) // 2]


def calibrate(path: str | None = None, log=print) -> Machine:
    """Measure this machine (about 20 s) and write it to ``path`` (default: the calibration
    file); returns it."""
    from ..blas_env import blas_threads
    from ..testing import mpiexec_command

    env = dict(os.environ, **blas_threads(1))
    code = "import json, minidist.plan.machine as m; print(json.dumps(m.measure_compute()))"
    compute = json.loads(subprocess.run([sys.executable, "-c", code], check=True, env=env, capture_output=True,
                                        text=True, timeout=300).stdout)
    log(f"  GEMM on one core: {compute['peak']['float32'] / 1e9:.1f} GFLOP/s float32, "
        f"{compute['peak']['float64'] / 1e9:.1f} float64; element-wise {compute['mem_bw'] / 1e9:.1f} GB/s")
    fd, out = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    code = f"import minidist.plan.machine as m; m._p2p_probe({out!r})"
    subprocess.run(mpiexec_command(2) + [sys.executable, "-c", code], check=True, env=env, capture_output=True,
                   timeout=300)
    with open(out) as f:
        p2p = json.load(f)
    os.unlink(out)
    log(f"  point-to-point between two local ranks: {p2p['latency'] * 1e6:.1f} us, {p2p['bw'] / 1e9:.2f} GB/s")
    one, three, accum = _step_probe(1), _step_probe(3), _step_probe(3, grad_accum=2)
    block_mb = max(0.0, (accum - three) / 3)          # one more microbatch through 3 blocks
    block_step = max(0.0, (three - one) / 2 - block_mb)
    base = max(0.0, one - block_mb - block_step)
    log(f"  minidist's fixed cost of a tiny step: {block_mb * 1e3:.2f} ms per block and microbatch, "
        f"{block_step * 1e3:.2f} ms per block and step, {base * 1e3:.2f} ms outside the blocks")
    cores = os.cpu_count() or 1
    from .. import cli_checks

    machine = Machine(
        name="this-machine", peak=compute["peak"], mem_bytes=float(cli_checks.available_memory_bytes() or 8e9),
        mem_bw=compute["mem_bw"], links=(Link("shared memory", INF, p2p["bw"], p2p["latency"]),),
        gemm_eff=1.0, attn_eff=1.0, link_eff=1.0, mem_usable=0.8,
        overlap=0.0, block_mb_s=block_mb, block_step_s=block_step, step_overhead=base, cores=cores,
        notes={"measured": time.strftime("%Y-%m-%d %H:%M:%S"), "python": sys.version.split()[0],
               "numpy_op_s": compute["numpy_op_s"]})
    path = calibration_path(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(machine.to_json(), f, indent=1)
    log(f"  written to {path}")
    return machine
