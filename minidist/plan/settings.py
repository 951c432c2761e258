"""A plan in the run's words: the mesh (tp innermost, then cp, pp, dp; ep inside dp) and the
step's settings, and the precision the step holds and moves its numbers in."""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zbv")
CHUNKED = ("interleaved", "zbv")  # several model chunks per rank (Plan.virtual_stages)


@dataclass(frozen=True)
class Plan:
    """A mesh (tp innermost, then cp, pp, dp) and the step's settings, in the run's words: the
    fields, names and defaults of a resolved ``layout.settings.ParallelConfig`` (the training
    command's ``--zero``, ``--virtual-stages``, ``--ep``, ...) and ``checkpoint_activations``
    (the run's ``--checkpoint-activations``), so that a plan reads as the flags that run it.
    ``ep``: each mixture's experts split over ``ep`` consecutive ranks of the data-parallel
    group (GShard's expert parallelism; it adds no devices).  ``cp_impl``: how cp ranks share
    the attention (the run's ``--cp-impl``): "ring" (Ring Attention: keys and values travel
    round the ring) or "ulysses" (DeepSpeed-Ulysses: all-to-alls to whole sequences of
    heads / cp heads and back)."""

    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = 1
    zero: int = 0
    microbatches: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1             # interleaved, zbv: model chunks per rank
    checkpoint_activations: bool = False  # full activation checkpointing (recompute each block)
    sequence_parallel: bool = False
    ep: int = 1                         # expert parallelism, inside the data-parallel group
    cp_impl: str = "ring"               # with cp > 1: "ring" or "ulysses"

    @property
    def ulysses(self) -> bool:
        return self.cp > 1 and self.cp_impl == "ulysses"

    @property
    def devices(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    def mesh(self) -> str:
        return f"tp={self.tp},cp={self.cp},pp={self.pp},dp={self.dp}" + (f",ep={self.ep}" if self.ep > 1 else "")

    def label(self) -> str:
        s = f"TP{self.tp} CP{self.cp}" + (" (Ulysses)" if self.ulysses else "")
        s += f" PP{self.pp} DP{self.dp}" + (f" EP{self.ep}" if self.ep > 1 else "")
        s += f" ZeRO-{self.zero} M={self.microbatches}"
        if self.pp > 1:
            s += f" {self.schedule}" + (f" V={self.virtual_stages}" if self.schedule in CHUNKED else "")
        return s + (" ckpt" if self.checkpoint_activations else "")


@dataclass(frozen=True)
class Precision:
    """Bytes of what a step holds and moves: the activations and parameters as computed, the
    gradients as reduced, the optimizer state per parameter (mixed precision AdamW: fp32
    master weights, m and v: 12 bytes)."""

    name: str
    act: int
    param: int
    grad: int
    optim: int
    compute: str            # the Machine.peak key of the matmuls


MIXED_BF16 = Precision("bf16", act=2, param=2, grad=2, optim=12, compute="bf16")
FLOAT32 = Precision("float32", act=4, param=4, grad=4, optim=8, compute="float32")
FLOAT64 = Precision("float64", act=8, param=8, grad=8, optim=16, compute="float64")
PRECISIONS = {p.name: p for p in (MIXED_BF16, FLOAT32, FLOAT64)}
