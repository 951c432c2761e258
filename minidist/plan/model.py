"""What a transformer costs, counted from its shape: parameters, FLOPs and activation bytes.

Everything here is arithmetic on the model's dimensions (no arrays, no MPI), so the planner
can price a 405-billion-parameter model as easily as minidist's own byte-level GPT.

* **Parameters**: per block, attention's Q and output projections (d x d each), K and V
  (d x d_kv each, d_kv = kv_heads x head_dim: grouped-query attention, Ainslie et al. 2023),
  the MLP (2 d x f, or 3 d x f for a gated SwiGLU MLP, Shazeer 2020), the norms' scales and,
  for GPT-2-style models, the biases and the learned position table.  A training run's model
  (``layout.settings.ModelConfig``, GPT-2 or Llama) becomes a spec in one place,
  :func:`spec_of`; minidist.observe.profile counts a run's FLOPs with it, so the planner, the
  trainer's MFU and the built model (``nn.GPT.num_parameters``) share these formulas.
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

from minidist.layout.settings import ModelConfig, llama_ffn_hidden


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer's shape.  ``ffn``: the MLP's hidden width (default 4 d, or
    Llama's 8/3 d rule when ``gated``, as ``ModelConfig.ffn``); ``kv_heads``: grouped-query
    attention's key/value heads (default: ``heads``); ``gated``: SwiGLU MLP (three matrices);
    ``gpt2``: biases, LayerNorm with a bias, learned positions; ``causal_skip``: the attention
    kernel skips the masked half of the scores; ``positions``: the rows of GPT-2's position
    table (default ``seq_len``; minidist's ``--block-size``)."""

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
    positions: int | None = None

    @property
    def f(self) -> int:
        if self.ffn:
            return self.ffn
        return llama_ffn_hidden(self.d_model) if self.gated else 4 * self.d_model

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
    # Llama 3 8B (the same table): 32 layers, d 4,096, FFN 14,336, 32 heads, 8 KV heads.
    "llama3-8b": ModelSpec("llama3-8b", 32, 4096, 32, 128256, 8192, ffn=14336, kv_heads=8, gated=True,
                           gpt2=False, tied=False, causal_skip=True),
    "llama3-70b": ModelSpec("llama3-70b", 80, 8192, 64, 128256, 8192, ffn=28672, kv_heads=8, gated=True,
                            gpt2=False, tied=False, causal_skip=True),
    # GPT-3 (Brown et al. 2020, table 2.1): 96 layers, d 12,288, 96 heads, 2,048 tokens.
    "gpt3-175b": ModelSpec("gpt3-175b", 96, 12288, 96, 50257, 2048, causal_skip=True),
    # minidist's own: the GPT-2-small-sized byte model, and benchmarks/bench_model.py's shape.
    "minidist-gpt": ModelSpec("minidist-gpt", 12, 768, 12, 256, 1024),
    "minidist-bench": ModelSpec("minidist-bench", 4, 256, 4, 256, 128),
}


def spec_of(model: ModelConfig, seq_len: int, vocab: int | None = None, name: str = "minidist") -> ModelSpec:
    """The spec of a training run's model (``--arch``, ``--kv-heads``, ``--ffn-hidden``,
    ``--untied``, ``--block-size``), as ``parallel.compose.model_config`` builds it: GPT-2 has
    biases, LayerNorms, a position table and a tied head unless ``untied``; Llama RMSNorms,
    SwiGLU, grouped-query attention and an untied head.  minidist's attention computes the
    full T x T scores, so ``causal_skip`` stays False.  ``vocab``: the model's own (256 bytes,
    or its tokenizer's) unless given."""
    llama = model.arch == "llama"
    vocab = model.vocab_size if vocab is None else vocab
    return ModelSpec(name, model.layers, model.d_model, model.heads, vocab, seq_len, ffn=model.ffn,
                     kv_heads=model.kv, gated=llama, gpt2=not llama, tied=not (llama or model.untied),
                     positions=None if llama else model.block_size)


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
    positions = (m.positions or m.seq_len) * d if m.gpt2 else 0
    return m.vocab * d + positions + (2 * d if m.gpt2 else d) + (0 if m.tied else m.vocab * d)


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


def recompute_flops_per_token(m: ModelSpec, seq_len: int | None = None) -> float:
    """FLOPs per token that activation checkpointing adds (PaLM appendix B: hardware FLOPs
    count them, model FLOPs do not): one more forward of every block, not of the head."""
    return m.layers * (block_matmul_flops(m) + attention_flops(m, seq_len, executed=True))


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
