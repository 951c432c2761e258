"""What a transformer costs, counted from its shape: parameters, FLOPs and activation bytes.

Everything here is arithmetic on the model's dimensions (no arrays, no MPI), so the planner
can price a 405-billion-parameter model as easily as minidist's own byte-level GPT.

* **Parameters**: per block, attention's Q and output projections (d x d each), K and V
  (d x d_kv each, d_kv = kv_heads x head_dim: grouped-query attention, Ainslie et al. 2023),
  the MLP (2 d x f, or 3 d x f for a gated SwiGLU MLP, Shazeer 2020), the norms' scales and,
  for GPT-2-style models, the biases and the learned position table.
* **FLOPs** (PaLM, Chowdhery et al. 2022, appendix B): a multiply-add is 2 FLOPs, backward
  costs twice the forward, so a step costs 6 x (matmul parameters) per token plus attention's
  two T x T products, 12 x L x T x d per token over the full scores; a causal kernel that
  skips the masked half (FlashAttention) needs half of that and is counted so, minidist's
  plain attention computes all of it.
  *Model* FLOPs count what the model needs; *hardware* FLOPs add the recomputed forward of
  activation checkpointing (MFU vs HFU).
* **Activations** (Korthikanti et al. 2022, "Reducing Activation Recomputation"): the bytes
  one block keeps per token for its backward, summed tensor by tensor; tensor parallelism with
  sequence parallelism divides all of them by t, context parallelism divides the tokens.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, replace


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer's shape.  ``ffn``: the MLP's hidden width (default 4 d);
    ``kv_heads``: grouped-query attention's key/value heads (default: ``heads``); ``gated``:
    SwiGLU MLP (three matrices); ``gpt2``: biases, LayerNorm with a bias, learned positions;
    ``causal_skip``: the attention kernel skips the masked half of the scores."""

    name: str
    layers: int
    d_model: int
    heads: int
    vocab: int
    seq_len: int
    ffn: int | None = None
    kv_heads: int | None = None
    gated: bool = False
    gpt2: bool = True
    tied: bool = True
    causal_skip: bool = False

    @property
    def f(self) -> int:
        return self.ffn or 4 * self.d_model

    @property
    def kv(self) -> int:
        return self.kv_heads or self.heads

    @property
    def d_kv(self) -> int:
        return self.kv * (self.d_model // self.heads)

    def with_(self, **changes) -> "ModelSpec":
        return replace(self, **{k: v for k, v in changes.items() if v is not None})

    def as_dict(self) -> dict:
        return asdict(self)


PRESETS = {
    # Llama 3 (Dubey et al. 2024, table 3): 126 layers, d 16,384, FFN 53,248, 128 heads, 8 KV heads.
    "llama3-405b": ModelSpec("llama3-405b", 126, 16384, 128, 128256, 8192, ffn=53248, kv_heads=8, gated=True,
                             gpt2=False, tied=False, causal_skip=True),
    "llama3-70b": ModelSpec("llama3-70b", 80, 8192, 64, 128256, 8192, ffn=28672, kv_heads=8, gated=True,
                            gpt2=False, tied=False, causal_skip=True),
    # GPT-3 (Brown et al. 2020, table 2.1): 96 layers, d 12,288, 96 heads, 2,048 tokens.
    "gpt3-175b": ModelSpec("gpt3-175b", 96, 12288, 96, 50257, 2048, causal_skip=True),
    # minidist's own: the GPT-2-small-sized byte model, and benchmarks/bench_model.py's shape.
    "minidist-gpt": ModelSpec("minidist-gpt", 12, 768, 12, 256, 1024),
    "minidist-bench": ModelSpec("minidist-bench", 4, 256, 4, 256, 128),
}


@functools.lru_cache(maxsize=256)
def block_params(m: ModelSpec) -> int:
    """Parameters of one transformer block."""
    d, f = m.d_model, m.f
    attn = 2 * d * d + 2 * d * m.d_kv
    mlp = (3 if m.gated else 2) * d * f
    norms = 4 * d if m.gpt2 else 2 * d  # two LayerNorms (scale + bias) or two RMSNorm scales
    biases = (d + 2 * m.d_kv) + d + f + d if m.gpt2 else 0
    return attn + mlp + norms + biases


def embedding_params(m: ModelSpec) -> int:
    """The token table, the learned positions (GPT-2), the final norm, an untied head."""
    d = m.d_model
    return m.vocab * d + (m.seq_len * d if m.gpt2 else 0) + (2 * d if m.gpt2 else d) + (0 if m.tied else m.vocab * d)


def num_params(m: ModelSpec) -> int:
    return m.layers * block_params(m) + embedding_params(m)


def block_matmul_flops(m: ModelSpec) -> int:
    """Forward FLOPs of one block's weight matmuls per token (2 x the matrices' sizes)."""
    d, f = m.d_model, m.f
    return 2 * (2 * d * d + 2 * d * m.d_kv + (3 if m.gated else 2) * d * f)


def attention_flops(m: ModelSpec, seq_len: int | None = None, executed: bool = False) -> float:
    """Forward FLOPs of one block's QKᵀ and AV per token: 2 x 2 x T x d over the full T x T
    scores (PaLM's count); ``executed``: what the kernel computes (half with ``causal_skip``)."""
    t = seq_len or m.seq_len
    full = 4 * t * m.d_model
    return full / 2 if executed and m.causal_skip else full


def head_flops(m: ModelSpec) -> int:
    """Forward FLOPs of the LM head per token."""
    return 2 * m.d_model * m.vocab


def model_flops_per_token(m: ModelSpec, seq_len: int | None = None) -> float:
    """Forward + backward model FLOPs per token (PaLM): 3 x forward.  Attention counts the
    scores the model needs: the causal half where the kernel skips the masked half (the
    presets of published models), the full T x T for minidist's plain attention (as
    minidist.observe.profile.model_flops_per_token does), so MFU never credits work nobody does."""
    return 3 * (m.layers * (block_matmul_flops(m) + attention_flops(m, seq_len, executed=True)) + head_flops(m))


def activation_bytes_per_token(m: ModelSpec, itemsize: int = 2) -> float:
    """Bytes one block keeps for its backward per token (FlashAttention: no T x T scores).

    Attention half: the norm's input and output, Q, K and V, the attention output (the
    output projection's input), the softmax statistics: 2 d + d + 2 d_kv + d (+4 bytes).
    MLP half: the norm's input and output, the first matmul's output(s) and the activation's
    output (the second matmul's input): 2 d + (3 f gated | 2 f).  GPT-2 adds the GELU
    input's copy and the dropout-free residual adds nothing.  Korthikanti et al. count 34 d
    bytes for GPT in 16 bits with dropout; this count is the same idea without dropout.
    """
    d, f = m.d_model, m.f
    values = (2 * d + d + 2 * m.d_kv + d) + (2 * d + (3 if m.gated else 2) * f)
    return values * itemsize + 4  # + the softmax's log-sum-exp
