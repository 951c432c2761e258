"""Modules and the GPT model.

The model is GPT-2 shaped (Radford et al. 2019): token + learned position embeddings, a stack
of pre-LayerNorm blocks (causal multi-head self-attention, then a 4x GELU MLP, each wrapped in
a residual connection), a final LayerNorm and a language-model head tied to the token
embedding.

``GPT(ModelConfig(arch="llama"))`` builds the Llama family's variant of the same stack (Touvron
et al. 2023; Dubey et al. 2024): RMSNorm instead of LayerNorm, no learned positions but rotary
ones applied to the queries and keys, grouped-query attention (``kv_heads`` key/value heads
shared by groups of query heads), a SwiGLU feed-forward, no biases and an untied head.  The
pieces, the seams and the names of the blocks' parts are otherwise the same, so every axis
splits both without knowing which it holds.

Three choices here serve the parallel strategies built on top:

* **The model runs in pieces.**  ``embed``, each block, and ``head``/``loss`` are separate
  calls, so a pipeline stage can run "these blocks on a received activation" and backward
  from a received gradient.  ``GPT.forward`` just chains the pieces.
* **Initialisation is keyed by name and global shape.**  Every parameter is drawn from
  ``(seed, parameter name)`` in its unsharded shape (``backend.seeded_normal``); nothing
  depends on creation order, so sharded and serial models start bit-identical.
* **The layers come from a layer set.**  ``GPT(cfg, layers)`` builds every linear layer,
  LayerNorm, embedding and the loss through ``layers`` (:class:`Layers`: the plain ones);
  ``parallel.tensor.TensorParallelLayers`` splits them over a tensor-parallel group, so one
  GPT class serves every mode.

**The seams.**  Every parallel axis (and the tracer) changes the model only through these,
each a constructor argument or one method of :class:`GPT`; nothing else of the model is
replaced or deleted from outside:

=====================  ===========================================  ==========================
seam                   what it sets                                 who uses it
=====================  ===========================================  ==========================
``layers``             how every layer is built (split or not)      tensor parallelism
``use_attention``      every block's attention function             context parallelism
``use_positions``      the positions of the tokens a rank embeds    context parallelism
``use_block_runner``   how one block runs (given the plain runner)  ZeRO-3, offload, tracer
``keep_stage``         the blocks and the ends a stage keeps        the pipeline
=====================  ===========================================  ==========================

Linear weights are stored ``(in_features, out_features)`` so the forward pass is ``x @ W``.
"""

from __future__ import annotations

import functools
import math

from minidist.layout.model import ATTENTIONS, ModelConfig
from minidist.model import ops
from minidist.model.autograd import Tensor, checkpoint
from minidist.model.backend import dtype as _dtype
from minidist.model.backend import host
from minidist.model.module import Module, _param, init_parameters  # noqa: F401 (nn.Module, nn._param)
from minidist.model import moe


# --------------------------------------------------------------------------------------------
# Layers
# --------------------------------------------------------------------------------------------
class Linear(Module):
    def __init__(self, d_in, d_out, dtype, bias=True, std=0.02):
        self.weight = _param((d_in, d_out), dtype, ("normal", std))
        self.bias = _param((d_out,), dtype, ("zeros",)) if bias else None

    def forward(self, x):
        return ops.linear(x, self.weight, self.bias)


class Embedding(Module):
    def __init__(self, num, dim, dtype, std=0.02):
        self.weight = _param((num, dim), dtype, ("normal", std))

    def forward(self, ids):
        return ops.embedding(self.weight, ids)

    def logits(self, x):
        """``x @ weight^T``: the language-model head tied to this embedding."""
        return ops.linear(x, ops.transpose(self.weight, (1, 0)))


class LayerNorm(Module):
    def __init__(self, dim, dtype, eps=1e-5):
        self.weight = _param((dim,), dtype, ("ones",))
        self.bias = _param((dim,), dtype, ("zeros",))
        self.eps = eps

    def forward(self, x):
        return ops.layer_norm(x, self.weight, self.bias, self.eps)


class RMSNorm(Module):
    def __init__(self, dim, dtype, eps=1e-5):
        self.weight = _param((dim,), dtype, ("ones",))
        self.eps = eps

    def forward(self, x):
        return ops.rms_norm(x, self.weight, self.eps)


class Layers:
    """How the model builds its layers: here the plain ones.

    ``parallel.tensor.TensorParallelLayers`` has the same methods and returns layers split
    over a tensor-parallel group, so one GPT class serves every mode.  ``parts`` is how many
    ranks share each layer (attention keeps ``n_head // parts`` heads per rank).
    """

    parts = 1
    sequence_parallel = False  # True: activations outside the matmuls hold 1/parts of the tokens

    def local_tokens(self, tokens: int) -> int:
        """How many of a sequence's ``tokens`` this rank's activations between blocks hold."""
        return tokens // self.parts if self.sequence_parallel else tokens

    def column(self, d_in, d_out, dtype, bias=True, std=0.02, fused=1, heads=None):
        """A linear layer whose *output* features a tensor-parallel set splits (``fused``:
        the output is that many equal parts, e.g. 2 for SwiGLU's gate | up).  ``heads``: the
        output is that many heads, and where they are fewer than the ranks each head is held
        by several (grouped-query attention's key/value heads)."""
        return Linear(d_in, d_out, dtype, bias, std)

    def heads_here(self, heads: int) -> int:
        """How many of ``heads`` (split by :meth:`column`'s ``heads``) one rank holds."""
        return max(heads // self.parts, 1)

    def fused_column(self, x, linears):
        """The outputs of several bias-free column layers side by side, as one matmul (one
        all-gather too under sequence parallelism): Llama's q, k and v projections."""
        return ops.linear(x, ops.concat([lin.weight for lin in linears], axis=1))

    def row(self, d_in, d_out, dtype, bias=True, std=0.02):
        """A linear layer whose *input* features a tensor-parallel set splits."""
        return Linear(d_in, d_out, dtype, bias, std)

    def layer_norm(self, dim, dtype):
        return LayerNorm(dim, dtype)

    def rms_norm(self, dim, dtype, eps=1e-5):
        return RMSNorm(dim, dtype, eps)

    def token_embedding(self, num, dim, dtype):
        return Embedding(num, dim, dtype)

    def position_embedding(self, num, dim, dtype):
        return Embedding(num, dim, dtype)

    def cross_entropy(self, logits, targets):
        return ops.cross_entropy(logits, targets)


class CausalSelfAttention(Module):
    """Multi-head attention with a causal mask (Vaswani et al. 2017), fused QKV projection."""

    def __init__(self, cfg: ModelConfig, dtype, layers: Layers | None = None):
        layers = layers or Layers()
        if cfg.heads % layers.parts:
            raise ValueError(f"heads={cfg.heads} is not divisible by the {layers.parts} ranks that split the heads")
        self.n_head = cfg.heads // layers.parts  # this rank's heads (all of them unless split)
        self.c_attn = layers.column(cfg.d_model, 3 * cfg.d_model, dtype, cfg.has_bias, fused=3)
        self.c_proj = layers.row(cfg.d_model, cfg.d_model, dtype, cfg.has_bias, std=residual_std(cfg))
        # The attention function (qkv, n_head, n_kv_head) -> y; context parallelism swaps in
        # ring or Ulysses attention here (minidist.parallel.context).
        self.attention = attention_function(cfg.attention, cfg.attention_block)

    def forward(self, x):
        qkv = self.c_attn(x)                                       # (B, T, 3C)
        # The plain op reads each head's q, k, v as strided views of qkv and writes its
        # output into the head's columns of y: no (B, H, T, D) transpose copies.
        y = self.attention(qkv, self.n_head)                      # (B, T, C), causal
        return self.c_proj(y)


class GroupedQueryAttention(Module):
    """Llama's attention: ``kv_heads`` key/value heads, each shared by ``heads / kv_heads``
    consecutive query heads (Ainslie et al. 2023; K = H is multi-head, K = 1 multi-query),
    rotary positions on the queries and keys, no biases.

    Split over tensor-parallel ranks, a rank keeps H/tp query heads and the key/value heads
    they read: K/tp of them, or, where tp > K, the one head it shares with tp/K ranks."""

    def __init__(self, cfg: ModelConfig, dtype, layers: Layers, positions):
        H, K, D, d = cfg.heads, cfg.kv, cfg.head_dim, cfg.d_model
        if H % layers.parts:
            raise ValueError(f"heads={H} is not divisible by the {layers.parts} ranks that split the heads")
        self.n_head, self.n_kv_head = H // layers.parts, layers.heads_here(K)
        self.head_dim, self.theta = D, cfg.rope_theta
        self.q_proj = layers.column(d, H * D, dtype, bias=False)
        self.k_proj = layers.column(d, K * D, dtype, bias=False, heads=K)
        self.v_proj = layers.column(d, K * D, dtype, bias=False, heads=K)
        self.o_proj = layers.row(H * D, d, dtype, bias=False, std=residual_std(cfg))
        self.layers, self.positions = layers, positions  # positions: GPT.token_positions
        self.attention = attention_function(cfg.attention, cfg.attention_block)

    def forward(self, x):
        qkv = self.layers.fused_column(x, (self.q_proj, self.k_proj, self.v_proj))  # (B, T, (H + 2K) D)
        # The queries and keys turn by their tokens' places in the sequence: under context
        # parallelism these are the rank's (zig-zag) slices of it, given by the positions seam.
        positions, _ = self.positions(qkv.shape[1])
        qkv = ops.rotary(qkv, self.n_head + self.n_kv_head, self.head_dim, positions, self.theta)
        return self.o_proj(self.attention(qkv, self.n_head, self.n_kv_head))


# Attention on one rank (layout.model.ATTENTIONS): ``plain`` keeps the T x T probabilities,
# ``blockwise`` (FlashAttention's online softmax) never holds more than a block x block tile of them.


def attention_function(name: str = "plain", block: int = 128):
    """The causal self-attention ``(qkv, n_head, n_kv_head=n_head) -> y`` called ``name``; with
    fewer key/value heads than query heads they are repeated for the multi-head kernels."""
    if name == "plain":
        inner = ops.self_attention
    elif name == "blockwise":
        inner = functools.partial(ops.blockwise_self_attention, block=block)
    else:
        raise ValueError(f"unknown attention {name!r}; choose from {ATTENTIONS}")

    def attend(qkv, n_head, n_kv_head=None):
        return inner(ops.repeat_kv(qkv, n_head, n_kv_head or n_head), n_head)

    return attend


class MLP(Module):
    def __init__(self, cfg: ModelConfig, dtype, layers: Layers | None = None):
        layers = layers or Layers()
        self.c_fc = layers.column(cfg.d_model, cfg.ffn, dtype, cfg.has_bias)
        self.c_proj = layers.row(cfg.ffn, cfg.d_model, dtype, cfg.has_bias, std=residual_std(cfg))

    def forward(self, x):
        return self.c_proj(ops.gelu(self.c_fc(x)))


class SwiGLU(Module):
    """Llama's feed-forward: ``down(silu(x W_gate) * (x W_up))`` (Shazeer 2020), the gate and
    up projections one fused column layer whose halves a tensor-parallel rank splits alike."""

    def __init__(self, cfg: ModelConfig, dtype, layers: Layers):
        self.gate_up_proj = layers.column(cfg.d_model, 2 * cfg.ffn, dtype, bias=False, fused=2)
        self.down_proj = layers.row(cfg.ffn, cfg.d_model, dtype, bias=False, std=residual_std(cfg))

    def forward(self, x):
        return self.down_proj(ops.swiglu(self.gate_up_proj(x)))


class Block(Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x)).  ``positions``:
    the model's token positions (Llama's rotary attention reads them); ``index``: the block's
    place in the stack (which blocks hold a mixture of experts: ModelConfig.is_moe)."""

    def __init__(self, cfg: ModelConfig, dtype, layers: Layers | None = None, positions=None, index: int = 0):
        layers = layers or Layers()
        llama = cfg.arch == "llama"
        norm = functools.partial(layers.rms_norm, eps=cfg.norm_eps) if llama else layers.layer_norm
        self.ln_1 = norm(cfg.d_model, dtype)
        self.attn = GroupedQueryAttention(cfg, dtype, layers, positions) if llama else CausalSelfAttention(cfg, dtype, layers)
        self.ln_2 = norm(cfg.d_model, dtype)
        ffn = functools.partial(SwiGLU if llama else MLP, cfg, dtype)
        # A mixture of experts (moe.py) in every moe_every-th block: each expert this feed-forward, whole on a tp rank.
        self.mlp = moe.MoE(cfg, dtype, functools.partial(ffn, Layers())) if cfg.is_moe(index) else ffn(layers)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


# --------------------------------------------------------------------------------------------
# GPT
# --------------------------------------------------------------------------------------------
def residual_std(cfg: ModelConfig) -> float:
    """GPT-2's init of the projections into the residual stream: 0.02 / sqrt(2 * layers), so the
    stream's variance does not grow with depth."""
    return 0.02 / math.sqrt(2 * cfg.layers)


class GPT(Module):
    """The model.  ``layers`` builds its layers (default: plain); pass
    ``parallel.tensor.TensorParallelLayers(group)`` to split them over a tensor-parallel group."""

    def __init__(self, cfg: ModelConfig, layers: Layers | None = None):
        cfg.check()
        attention_function(cfg.attention)
        ops.check_block(cfg.attention_block)
        self.config = cfg
        self.layers = layers = Layers() if layers is None else layers
        dt = _dtype(cfg.dtype)
        llama = cfg.arch == "llama"
        self.wte = layers.token_embedding(cfg.vocab_size, cfg.d_model, dt)
        self.wpe = None if llama else layers.position_embedding(cfg.block_size, cfg.d_model, dt)
        self.h = [Block(cfg, dt, layers, self.token_positions, i) for i in range(cfg.layers)]
        self.ln_f = layers.rms_norm(cfg.d_model, dt, cfg.norm_eps) if llama else layers.layer_norm(cfg.d_model, dt)
        self.lm_head = layers.column(cfg.d_model, cfg.vocab_size, dt, bias=False) if cfg.untied else None
        self.checkpoint_activations = False
        self._positions = None  # use_positions: None is 0..T-1 of sequences of length T
        init_parameters(self, cfg.seed)

    # -- the seams (module docstring) ----------------------------------------------------------
    def use_attention(self, fn) -> None:
        """Every block's attention becomes ``fn(qkv, n_head, n_kv_head) -> y`` (ring or Ulysses)."""
        for block in self.h:
            if block is not None:
                block.attn.attention = fn

    def use_positions(self, fn) -> None:
        """``fn(T) -> (positions, length)``: the places in their sequences of the T tokens of each
        row this rank embeds, and the whole sequences' length (context parallelism: this rank's
        slice of sequences cp times longer)."""
        self._positions = fn

    def use_block_runner(self, make) -> None:
        """One block now runs as ``make(runner)(block, x)``, ``runner`` the way it ran so far (ZeRO-3
        gathers the block's shards around it; the tracer times it)."""
        self.block_runner = make(self.block_runner)

    def keep_stage(self, blocks, embedding: bool, token_embedding: bool, head: bool) -> None:
        """Keep only the blocks whose indices are in ``blocks`` (the others become None, so
        block i keeps its index and name), the position embedding if ``embedding``, the token
        embedding if ``token_embedding`` (the first stage, and the last one when the head is
        tied to it), the final LayerNorm and the head if ``head``: a pipeline stage."""
        self.h = [b if i in blocks else None for i, b in enumerate(self.h)]
        if not embedding:
            self.wpe = None
        if not token_embedding:
            self.wte = None
        if not head:
            self.ln_f = self.lm_head = None

    # -- the pieces a pipeline stage runs ----------------------------------------------------
    def embed(self, ids) -> Tensor:
        """Token + position embeddings of an int array ``ids`` (B, T), at ``token_positions``
        (Llama: the token embeddings; its positions turn the queries and keys instead)."""
        positions, length = self.token_positions(ids.shape[-1])
        if length > self.config.block_size:  # checked on the host: no device-to-host sync per forward
            table = "position table" if self.config.arch != "llama" else "model's longest sequence"
            raise ValueError(f"sequence length {length} exceeds the {table} ({self.config.block_size})")
        x = self.wte(ids) if self.config.arch == "llama" else self.wte(ids) + self.wpe(positions)
        low = ops.get_autocast_dtype()
        return ops.cast(x, low) if low is not None else x  # mixed precision: low-precision activations

    def run_blocks(self, x: Tensor, blocks=None) -> Tensor:
        for block in self.h if blocks is None else blocks:
            x = self.block_runner(block, x)
        return x

    def block_runner(self, block, x: Tensor) -> Tensor:
        """Run one block (the seam ``use_block_runner`` wraps it)."""
        if not self.checkpoint_activations:
            return block(x)
        low = ops.get_autocast_dtype()

        def rerun(h):  # backward runs outside autocast: the recomputation enters the forward's precision again
            with ops.autocast(low):
                return block(h)
        return checkpoint(rerun, x, params=block.parameters())

    def head(self, x: Tensor) -> Tensor:
        """Final LayerNorm and the LM head: logits (B, T, vocab), or this rank's slice of the
        vocabulary when the layers are tensor-parallel (the full logits are never formed)."""
        x = self.ln_f(x)
        if self.lm_head is not None:
            return self.lm_head(x)
        return self.wte.logits(x)  # tied: x @ wte^T

    def loss(self, logits: Tensor, targets, blocks=None) -> Tensor:
        """The mean cross-entropy, plus the auxiliary losses of the mixtures of ``blocks`` (moe.py; default all)."""
        loss = self.layers.cross_entropy(logits, targets)
        return moe.add_aux_losses(self, loss, blocks) if self.config.experts else loss

    def token_positions(self, T: int):
        """The places in their sequences of the T tokens of each row this rank embeds, 0..T-1,
        and the length of the whole sequences (or what ``use_positions`` set).  Made on the
        host, where the embedding checks them for free (``ops.basic.check_index``)."""
        if self._positions is not None:
            return self._positions(T)
        return host.arange(T), T

    def forward(self, ids, targets=None):
        """Logits for ``ids``, or the mean cross-entropy if ``targets`` are given."""
        logits = self.head(self.run_blocks(self.embed(ids)))
        return logits if targets is None else self.loss(logits, targets)
