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
from dataclasses import asdict, dataclass, replace

from minidist.layout.settings import ModelConfig, llama_ffn_hidden


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer's shape.  ``ffn``: the MLP's hidden width (default 4 d, or
    Llama's 8/3 d rule when ``gated``, as ``ModelConfig.ffn``); ``kv_heads``: grouped-query
    attention's key/value heads (default: ``heads``); ``gated``: SwiGLU MLP (three matrices);
    ``gpt2``: biases, LayerNorm with a bias, learned positions; ``causal_skip``: the attention
    kernel skips the masked half of the scores; ``positions``: the rows of GPT-2's position
    table (default ``seq_len``; minidist's ``--block-size``); ``experts``: E experts in the
    MLP of every ``moe_every``-th block (0: dense), each token routed to ``top_k`` of them;
    ``capacity_factor``: an expert takes at most c x T x k / E tokens of a sequence (0:
    dropless; priced where an implementation pads to it, see plan/moe_cost.py)."""

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
    experts: int = 0
    top_k: int = 2
    moe_every: int = 1
    capacity_factor: float = 0.0

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
    # Mixtral 8x7B (Jiang et al. 2024, table 1): Mistral 7B's shape (32 layers, d 4,096, 32
    # heads, 8 KV heads, vocab 32,000) with every block's SwiGLU (14,336 wide) made 8 experts,
    # top-2; 32,768 tokens of context.
    "mixtral-8x7b": ModelSpec("mixtral-8x7b", 32, 4096, 32, 32000, 32768, ffn=14336, kv_heads=8, gated=True,
                              gpt2=False, tied=False, causal_skip=True, experts=8, top_k=2),
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
    E = model.experts  # the defaults parallel.compose.model_config gives the layer
    return ModelSpec(name, model.layers, model.d_model, model.heads, vocab, seq_len, ffn=model.ffn,
                     kv_heads=model.kv, gated=llama, gpt2=not llama, tied=not (llama or model.untied),
                     positions=None if llama else model.block_size, experts=E,
                     top_k=(model.top_k or min(2, E)) if E else 2, moe_every=model.moe_every or 1,
                     capacity_factor=model.capacity_factor or 0.0)


def is_moe(m: ModelSpec, i: int) -> bool:
    """Block ``i`` (from 0) is a mixture: every ``moe_every``-th block, counting from 1 (as
    minidist.model.moe.is_moe_block)."""
    return m.experts > 0 and (i + 1) % m.moe_every == 0


def moe_blocks(m: ModelSpec, first: int = 0, stop: int | None = None) -> int:
    """Mixtures among blocks ``first .. stop - 1`` (default: all)."""
    return sum(is_moe(m, i) for i in range(first, m.layers if stop is None else stop))


def mlp_params(m: ModelSpec) -> int:
    """Parameters of one MLP: the dense block's, or one expert (the same feed-forward)."""
    d, f = m.d_model, m.f
    return (3 * d * f) if m.gated else (2 * d * f + f + d)


def router_params(m: ModelSpec) -> int:
    return m.d_model * m.experts


@functools.lru_cache(maxsize=256)
def block_params(m: ModelSpec, moe: bool = False, experts: int | None = None) -> int:
    """Parameters of one transformer block: attention, norms and the MLP, or with ``moe`` the
    router and ``experts`` experts (default: all E; k for the active ones)."""
    d = m.d_model
    attn = 2 * d * d + 2 * d * m.d_kv
    norms = 4 * d if m.gpt2 else 2 * d  # two LayerNorms (scale + bias) or two RMSNorm scales
    biases = (d + 2 * m.d_kv) + d if m.gpt2 else 0
    mlp = (m.experts if experts is None else experts) * mlp_params(m) + router_params(m) if moe else mlp_params(m)
    return attn + norms + biases + mlp


def embedding_params(m: ModelSpec) -> int:
    """The token table, the learned positions (GPT-2), the final norm, an untied head."""
    d = m.d_model
    positions = (m.positions or m.seq_len) * d if m.gpt2 else 0
    return m.vocab * d + positions + (2 * d if m.gpt2 else d) + (0 if m.tied else m.vocab * d)


def num_params(m: ModelSpec) -> int:
    """Every parameter (all E experts of each mixture)."""
    n_moe = moe_blocks(m)
    return (m.layers - n_moe) * block_params(m) + n_moe * block_params(m, True) + embedding_params(m)


def active_params(m: ModelSpec) -> int:
    """The parameters one token uses: each mixture's router and ``top_k`` of its experts
    (Mixtral 8x7B: 12.9 of 46.7 billion)."""
    n_moe = moe_blocks(m)
    return (m.layers - n_moe) * block_params(m) + n_moe * block_params(m, True, m.top_k) + embedding_params(m)


def block_matmul_flops(m: ModelSpec, moe: bool = False) -> int:
    """Forward FLOPs of one block's weight matmuls per token (2 x the matrices' sizes); a
    mixture's: the router's d x E and the ``top_k`` experts the token runs (Switch, GShard:
    the FLOPs of k MLPs whatever E is)."""
    d, f = m.d_model, m.f
    mlp = (3 if m.gated else 2) * d * f
    return 2 * (2 * d * d + 2 * d * m.d_kv + (m.top_k * mlp + d * m.experts if moe else mlp))


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
    return 3 * (recompute_flops_per_token(m, seq_len) + head_flops(m))


def recompute_flops_per_token(m: ModelSpec, seq_len: int | None = None) -> float:
    """FLOPs per token that activation checkpointing adds (PaLM appendix B: hardware FLOPs
    count them, model FLOPs do not): one more forward of every block, not of the head."""
    n_moe = moe_blocks(m)
    matmuls = (m.layers - n_moe) * block_matmul_flops(m) + n_moe * block_matmul_flops(m, True)
    return matmuls + m.layers * attention_flops(m, seq_len, executed=True)


def activation_bytes_per_token(m: ModelSpec, itemsize: int = 2, moe: bool = False) -> float:
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
    d, f = m.d_model, m.f
    mlp = (3 if m.gated else 2) * f
    values = (2 * d + d + 2 * m.d_kv + d) + 2 * d + (m.top_k * (d + mlp + d) if moe else mlp)
    return values * itemsize + 4 + (4 * m.experts if moe else 0)  # + the softmax's log-sum-exp (+ router)
