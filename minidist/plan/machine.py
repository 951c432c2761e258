"""The machines the planner prices a step on: presets, and this machine as calibrated.

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
* memory per device and the share of it a run may plan to fill (``mem_usable``);
* minidist's ring attention on a CPU, whose online softmax runs in many small NumPy calls
  per tile and whose messages pass through a progress thread: seconds per tile and per score
  (0 on a GPU: attention is priced by its FLOPs there).

The probes that measure ``this-machine`` are in :mod:`.probes`;
:func:`minidist.plan.validate.calibrate` runs them, with one real step that prices
minidist's element-wise work through the cost model, and stores the machine as JSON, which
:func:`load` reads back.
"""

from __future__ import annotations

import json
import os
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
    mb_overhead_s: float = 0.0    # fixed seconds per microbatch outside the blocks (embedding, head, loss)
    step_overhead: float = 0.0    # fixed seconds per step outside the blocks (loss, bookkeeping)
    cores: int = 0                # CPU: the cores ranks share (0: a device per rank)
    load: float = 0.0             # CPU: other runnable processes sharing the cores (a shared machine's load)
    coll_overhead_s: float = 0.0  # fixed seconds per collective call (minidist's Python around its messages)
    sync_slice_s: float = 0.0     # CPU: mean off-CPU stretch of a descheduled partner, paid at a sync point
    ring_tile_s: float = 0.0      # minidist's ring attention (CPU), forward + backward: seconds per tile of the
    ring_score_s: float = 0.0     # online softmax and per score of one head (0: attention priced by its FLOPs)
    notes: dict = field(default_factory=dict)

    def peak_for(self, dtype: str) -> float:
        """The peak matmul rate for ``dtype`` (``float32`` and ``fp32`` name the same; presets
        use NVIDIA's names, this machine's calibration NumPy's).  ValueError (one line) if none."""
        alias = {"float32": "fp32", "fp32": "float32", "float64": "fp64", "fp64": "float64"}
        for name in (dtype, alias.get(dtype)):
            if name in self.peak:
                return self.peak[name]
        raise ValueError(f"machine {self.name} has no peak rate for {dtype} (it has {', '.join(self.peak)})")

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
    return path or DEFAULT_CALIBRATION


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
