"""The vocabulary of a run's model and mesh: what the training command, the axes and the
planner all call the same settings.

A run's full configuration (``minidist.train.config.RunConfig``) holds these two sections
beside the data, optimizer, device, report and checkpoint ones; they live here, below
everything that reads them, so that the pure arithmetic of this folder, the axes and the
planner speak of a mesh with the same names and defaults.  A field left ``None`` means
"not given": ``RunConfig.resolved`` fills the defaults that depend on other settings.
"""

from __future__ import annotations

from dataclasses import dataclass


ATTENTIONS = ("plain", "blockwise")       # one rank's attention (nn.attention_function)
CP_IMPLEMENTATIONS = ("ring", "ulysses")  # context parallelism (parallel/context/)
TP_OVERLAPS = ("ring", "bidirectional")   # collective matmuls (parallel/tensor/collective_matmul.py)
VIRTUAL = ("interleaved", "looping", "zbv")  # pipeline schedules with several model chunks per rank
ARCHS = ("gpt2", "llama")                  # the model families nn.GPT builds
FFN_MULTIPLE = 32                          # Llama's feed-forward width: 8/3 d rounded up to a multiple of this
ROPE_THETA = 500000.0                      # Llama 3's rotary base


def llama_ffn_hidden(d_model: int, multiple: int = FFN_MULTIPLE) -> int:
    """Llama's rule for the SwiGLU width: 2/3 of GPT's 4 d (three matrices cost what two did),
    rounded up to a multiple of ``multiple`` (Llama uses 256 at its sizes; minidist's tiny
    models use 32)."""
    return -(-(8 * d_model) // (3 * multiple)) * multiple


@dataclass
class ModelConfig:
    layers: int = 4
    d_model: int = 128
    heads: int = 4
    block_size: int | None = None     # the position table; None: the sequence length
    untied: bool = False              # a separate LM head instead of the tied embedding
    attention: str = "plain"          # one rank's attention: plain | blockwise
    attention_block: int | None = None  # tile of blockwise / ring attention (default 128)
    dtype: str = "float32"            # parameter (master weight) dtype
    seed: int = 0
    arch: str = "gpt2"                # gpt2 | llama
    kv_heads: int | None = None       # Llama's key/value heads; None: --heads
    ffn_hidden: int | None = None     # Llama's SwiGLU width; None: llama_ffn_hidden(d_model)
    rope_theta: float | None = None   # Llama's rotary base; None: ROPE_THETA
    # mixture of experts (model/moe.py); None: not given (the GPTConfig's default)
    experts: int = 0                  # 0: dense
    top_k: int | None = None          # None: 2, or 1 with one expert
    moe_every: int | None = None      # None: 1 (every block)
    capacity_factor: float | None = None  # None: 0 (dropless)
    aux_loss_coef: float | None = None    # None: 0.01
    z_loss_coef: float | None = None      # None: 0.001
    vocab_size: int = 256             # the tokenizer's vocabulary (256: bytes; --data DIR: its shards')

    @property
    def kv(self) -> int:
        """The key/value heads (GPT-2: one per query head)."""
        return self.kv_heads or self.heads

    @property
    def ffn(self) -> int:
        """The MLP's hidden width: 4 d (GPT-2) or Llama's SwiGLU width."""
        if self.arch != "llama":
            return 4 * self.d_model
        return self.ffn_hidden or llama_ffn_hidden(self.d_model)


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
