"""What a transformer costs, counted from its shape: parameters, FLOPs and activation bytes.

Everything here is arithmetic on the model's dimensions (no arrays, no MPI), so the planner
can price a 405-billion-parameter model as easily as minidist's own byte-level GPT.

* **Parameters**: per block, attention's Q and output projections (d x d each), K and V
  (d x d_kv each, d_kv = kv_heads x head_dim: grouped-query attention, Ainslie et al. 2023),
  the MLP (2 d x f, or 3 d x f for a gated SwiGLU MLP, Shazeer 2020), the norms' scales and,
  for GPT-2-style models, the biases and the learned position table: the tensors
  ``layout.model.parameter_shapes`` lists, the model's description shared with the training
  run.  minidist.observe.profile counts a run's FLOPs with these formulas, so the planner, the
  trainer's MFU and the built model share them.  A model here is a ``ModelConfig`` (a run's),
  or a :class:`Preset`; it trains on sequences of its whole length, ``block_size``.
* **FLOPs** (PaLM, Chowdhery et al. 2022, appendix B): a multiply-add is 2 FLOPs, backward
  costs twice the forward, so a step costs 6 x (matmul parameters) per token plus attention's
  two T x T products, 12 x L x T x d per token over the full scores; a causal kernel that
  skips the masked half (FlashAttention) needs half of that and is counted so, minidist's
  plain attention computes all of it.
  *Model* FLOPs count what the model needs; *hardware* FLOPs add the recomputed forward of
  activation checkpointing (MFU vs HFU).
* **Mixture of experts** (GShard, Lepikhin et al. 2020; Switch, Fedus et al. 2021; Mixtral,
  Jiang et al. 2024): every ``moe_every``-th block's MLP becomes E experts, each the same
  MLP, and a router (d x E, no bias); a token runs its ``top_k`` experts, so the *active*
  parameters and the FLOPs count k experts where the parameters count E.
* **Activations** (Korthikanti et al. 2022, "Reducing Activation Recomputation"): the bytes
  one block keeps per token for its backward, summed tensor by tensor; tensor parallelism with
  sequence parallelism divides all of them by t, context parallelism divides the tokens.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from minidist.layout.model import ModelConfig, block_shapes, end_shapes, numel


@dataclass(frozen=True)
class Preset(ModelConfig):
    """A model the planner prices by name (:data:`PRESETS`, or one given by its shape on the
    command line): its description, the name the output gives it, and ``causal_skip``: its
    attention kernel skips the masked half of the scores (FlashAttention's does; minidist's
    computes every score, so a run's ModelConfig counts them all)."""

    name: str = "custom"
    causal_skip: bool = False


def _llama(name: str, layers: int, d: int, heads: int, kv: int, ffn: int, vocab: int, seq: int, **moe) -> Preset:
    """A published model of the Llama family, trained with a FlashAttention-like kernel."""
    return Preset(name=name, arch="llama", layers=layers, d_model=d, heads=heads, kv_heads=kv, ffn_hidden=ffn,
                  vocab_size=vocab, block_size=seq, causal_skip=True, **moe)


PRESETS = {
    # Llama 3 (Dubey et al. 2024, table 3): 126 layers, d 16,384, FFN 53,248, 128 heads, 8 KV heads.
    "llama3-405b": _llama("llama3-405b", 126, 16384, 128, 8, 53248, 128256, 8192),
    # Llama 3 8B (the same table): 32 layers, d 4,096, FFN 14,336, 32 heads, 8 KV heads.
    "llama3-8b": _llama("llama3-8b", 32, 4096, 32, 8, 14336, 128256, 8192),
    # Mixtral 8x7B (Jiang et al. 2024, table 1): Mistral 7B's shape (32 layers, d 4,096, 32
    # heads, 8 KV heads, vocab 32,000) with every block's SwiGLU (14,336 wide) made 8 experts,
    # top-2; 32,768 tokens of context.
    "mixtral-8x7b": _llama("mixtral-8x7b", 32, 4096, 32, 8, 14336, 32000, 32768, experts=8, top_k=2),
    "llama3-70b": _llama("llama3-70b", 80, 8192, 64, 8, 28672, 128256, 8192),
    # GPT-3 (Brown et al. 2020, table 2.1): 96 layers, d 12,288, 96 heads, 2,048 tokens.
    "gpt3-175b": Preset(name="gpt3-175b", layers=96, d_model=12288, heads=96, vocab_size=50257, block_size=2048,
                        causal_skip=True),
    # minidist's own: the GPT-2-small-sized byte model, and benchmarks/bench_model.py's shape.
    "minidist-gpt": Preset(name="minidist-gpt", layers=12, d_model=768, heads=12, block_size=1024),
    "minidist-bench": Preset(name="minidist-bench", layers=4, d_model=256, heads=4, block_size=128),
}


def as_dict(m: Preset) -> dict:
    """The model as the planner's ``--json`` output names it."""
    return {"name": m.name, "layers": m.layers, "d_model": m.d_model, "heads": m.heads, "vocab": m.vocab_size,
            "seq_len": m.block_size, "ffn": m.ffn_hidden, "kv_heads": m.kv_heads, "gated": m.gated,
            "gpt2": not m.gated, "tied": not m.untied, "causal_skip": m.causal_skip,
            "positions": None,  # the position table's rows: seq_len's
            "experts": m.experts, "top_k": m.top_k, "moe_every": m.moe_every, "capacity_factor": m.capacity_factor}


def skips_masked_half(m: ModelConfig) -> bool:
    """Whether ``m``'s attention kernel skips the masked half of the scores (:class:`Preset`)."""
    return isinstance(m, Preset) and m.causal_skip


def moe_blocks(m: ModelConfig, first: int = 0, stop: int | None = None) -> int:
    """Mixtures among blocks ``first .. stop - 1`` (default: all)."""
    return sum(m.is_moe(i) for i in range(first, m.layers if stop is None else stop))


@functools.lru_cache(maxsize=256)
def mlp_params(m: ModelConfig) -> int:
    """Parameters of one MLP: the dense block's, or one expert (the same feed-forward)."""
    return sum(numel(s) for k, s in block_shapes(m).items() if k.startswith("mlp."))


def router_params(m: ModelConfig) -> int:
    return m.d_model * m.experts


@functools.lru_cache(maxsize=256)
def block_params(m: ModelConfig, moe: bool = False, experts: int | None = None) -> int:
    """Parameters of one transformer block: attention, norms and the MLP, or with ``moe`` the
    router and ``experts`` experts (default: all E; k for the active ones)."""
    attention_and_norms = sum(numel(s) for k, s in block_shapes(m).items() if not k.startswith("mlp."))
    mlp = (m.experts if experts is None else experts) * mlp_params(m) + router_params(m) if moe else mlp_params(m)
    return attention_and_norms + mlp


def embedding_params(m: ModelConfig) -> int:
    """The token table, the learned positions (GPT-2), the final norm, an untied head."""
    return sum(numel(s) for s in end_shapes(m).values())


def num_params(m: ModelConfig) -> int:
    """Every parameter (all E experts of each mixture)."""
    n_moe = moe_blocks(m)
    return (m.layers - n_moe) * block_params(m) + n_moe * block_params(m, True) + embedding_params(m)


def active_params(m: ModelConfig) -> int:
    """The parameters one token uses: each mixture's router and ``top_k`` of its experts
    (Mixtral 8x7B: 12.9 of 46.7 billion)."""
    n_moe = moe_blocks(m)
    return (m.layers - n_moe) * block_params(m) + n_moe * block_params(m, True, m.top_k) + embedding_params(m)


def block_matmul_flops(m: ModelConfig, moe: bool = False) -> int:
    """Forward FLOPs of one block's weight matmuls per token (2 x the matrices' sizes); a
    mixture's: the router's d x E and the ``top_k`` experts the token runs (Switch, GShard:
    the FLOPs of k MLPs whatever E is)."""
    d, f = m.d_model, m.ffn
    mlp = (3 if m.gated else 2) * d * f
    return 2 * (2 * d * d + 2 * d * m.d_kv + (m.top_k * mlp + d * m.experts if moe else mlp))


def attention_flops(m: ModelConfig, seq_len: int | None = None, executed: bool = False) -> float:
    """Forward FLOPs of one block's QKᵀ and AV per token: 2 x 2 x T x d over the full T x T
    scores (PaLM's count); ``executed``: what the kernel computes (half with ``causal_skip``)."""
    t = seq_len or m.block_size
    full = 4 * t * m.d_model
    return full / 2 if executed and skips_masked_half(m) else full


def head_flops(m: ModelConfig) -> int:
    """Forward FLOPs of the LM head per token."""
    return 2 * m.d_model * m.vocab_size


def model_flops_per_token(m: ModelConfig, seq_len: int | None = None) -> float:
    """Forward + backward model FLOPs per token (PaLM): 3 x forward.  Attention counts the
    scores the model needs: the causal half where the kernel skips the masked half (the
    presets of published models), the full T x T for minidist's plain attention (as
    minidist.observe.profile.model_flops_per_token does), so MFU never credits work nobody does."""
    return 3 * (recompute_flops_per_token(m, seq_len) + head_flops(m))


def recompute_flops_per_token(m: ModelConfig, seq_len: int | None = None) -> float:
    """FLOPs per token that activation checkpointing adds (PaLM appendix B: hardware FLOPs
    count them, model FLOPs do not): one more forward of every block, not of the head."""
    n_moe = moe_blocks(m)
    matmuls = (m.layers - n_moe) * block_matmul_flops(m) + n_moe * block_matmul_flops(m, True)
    return matmuls + m.layers * attention_flops(m, seq_len, executed=True)


def activation_bytes_per_token(m: ModelConfig, itemsize: int = 2, moe: bool = False) -> float:
    """Bytes one block keeps for its backward per token (FlashAttention: no T x T scores).

    Attention half: the norm's input and output, Q, K and V, the attention output (the
    output projection's input), the softmax statistics: 2 d + d + 2 d_kv + d (+4 bytes).
    MLP half: the norm's input and output, the first matmul's output(s) and the activation's
    output (the second matmul's input): 2 d + (3 f gated | 2 f).  GPT-2 adds the GELU
    input's copy and the dropout-free residual adds nothing.  Korthikanti et al. count 34 d
    bytes for GPT in 16 bits with dropout; this count is the same idea without dropout.
    A mixture (``moe``) keeps, beside the norm's 2 d, the router's E probabilities (fp32) and
    for each of the k rows a token sends: the row dispatched (d), the expert's (3 f | 2 f)
    and its output before the gate (d).
    """
    d, f = m.d_model, m.ffn
    mlp = (3 if m.gated else 2) * f
    values = (2 * d + d + 2 * m.d_kv + d) + 2 * d + (m.top_k * (d + mlp + d) if moe else mlp)
    return values * itemsize + 4 + (4 * m.experts if moe else 0)  # + the softmax's log-sum-exp (+ router)
