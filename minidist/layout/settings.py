"""The vocabulary of a run's mesh: what the training command, the axes and the planner all
call the same settings (the model's: ``model.py``).

A run's full configuration (``minidist.train.config.RunConfig``) holds this section beside
the model, data, optimizer, device, report and checkpoint ones; it lives here, below
everything that reads it, so that the pure arithmetic of this folder, the axes and the
planner speak of a mesh with the same names and defaults.  A field left ``None`` means
"not given": ``RunConfig.resolved`` fills the defaults that depend on other settings.
"""

from __future__ import annotations

from dataclasses import dataclass


CP_IMPLEMENTATIONS = ("ring", "ulysses")  # context parallelism (parallel/context/)
TP_OVERLAPS = ("ring", "bidirectional")   # collective matmuls (parallel/tensor/collective_matmul.py)
VIRTUAL = ("interleaved", "looping", "zbv")  # pipeline schedules with several model chunks per rank


def cp_unsplit(cp: int, impl: str, seq_len: int, heads: int) -> list[str]:
    """The sizes ``cp`` ranks cannot split evenly when they share the attention the way
    ``impl`` does ([] when they can; always with cp = 1): ring attention's zig-zag layout
    (Liu et al. 2023; parallel/context/ring.py) gives each rank two chunks of every
    sequence, so ``"seq_len"`` unless 2 x cp divides it; DeepSpeed-Ulysses (Jacobs et al.
    2023) gives each rank a slice of the sequence, then whole sequences of heads / cp of a
    tensor-parallel rank's ``heads``, so ``"heads"`` and ``"seq_len"`` unless cp divides them.
    The one rule the training flags, the grid and the planner word in their own terms."""
    if cp == 1:
        return []
    if impl == "ring":
        return ["seq_len"] if seq_len % (2 * cp) else []
    return [name for name, size in (("heads", heads), ("seq_len", seq_len)) if size % cp]


@dataclass
class ParallelConfig:
    """The mesh and each axis's settings (None: not given, see RunConfig.resolved)."""
    dp: int | None = None             # None: the world size over the other axes
    pp: int = 1
    tp: int = 1
    cp: int = 1
    # data parallelism
    zero: int | None = None           # None: 0, or 3 with hsdp_shard
    hsdp_shard: int | None = None
    bucket_mb: float | None = None    # None: 25 (PyTorch DDP's default)
    overlap: bool = True              # False: --no-overlap
    # expert parallelism (parallel/expert/): each mixture's experts split over ep ranks of ("dp", "cp")
    ep: int = 1
    # tensor parallelism
    sequence_parallel: bool = False
    tp_async: str | None = None       # None | ring | bidirectional
    # context parallelism
    cp_impl: str | None = None        # None: ring (when cp > 1)
    # pipeline parallelism
    schedule: str | None = None       # None: 1f1b (when pp > 1)
    microbatches: int | None = None   # None: 2 * pp
    virtual_stages: int | None = None  # None: 2 for interleaved / looping / zbv, else 1

    @property
    def world_size(self) -> int:
        return (self.dp or 1) * self.pp * self.tp * self.cp

    def mesh_sizes(self) -> dict:
        return {"dp": self.dp or 1, "pp": self.pp, "tp": self.tp, "cp": self.cp}
