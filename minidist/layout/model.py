"""The model: one description of a decoder-only transformer, and the tensors it holds.

:class:`ModelConfig` is what every part of minidist means by "the model": ``nn.GPT`` is built
from it, the training flags fill it (``--layers``, ``--heads``, ``--kv-heads``, ...), a
checkpoint records it, export maps it to Hugging Face's names, and the planner prices it (its
presets are ModelConfigs: ``plan/model.py``).  Two families share the fields:

* **GPT-2** (Radford et al. 2019): LayerNorm, learned positions (a table of ``block_size``
  rows), a 4 d GELU MLP, biases, the LM head tied to the token embedding;
* **Llama** (Touvron et al. 2023; Dubey et al. 2024): RMSNorm, rotary positions, grouped-query
  attention with ``kv_heads`` key/value heads (Ainslie et al. 2023), a SwiGLU MLP (Shazeer
  2020) of Llama's width, no biases, an untied head.

A field left None takes its architecture's default, read through a property (``kv``,
``ffn``, ``untied``, ``has_bias``), so that a copy with another ``arch`` or width never keeps
a default of the old one.  The training flags also leave None what was not given;
``RunConfig.resolved`` fills those (``block_size``: the run's ``--seq-len``).

:func:`parameter_shapes` lists the model's parameters by the names ``GPT.named_parameters``
gives them, in their global shapes: what a checkpoint must hold, and what the planner counts.
No MPI, no arrays.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace

ARCHS = ("gpt2", "llama")                  # the model families nn.GPT builds
ATTENTIONS = ("plain", "blockwise")        # one rank's attention (nn.attention_function)
FFN_MULTIPLE = 32                          # Llama's feed-forward width: 8/3 d rounded up to a multiple of this
ROPE_THETA = 500000.0                      # Llama 3's rotary base
_FLOAT_MAX = 1.7976931348623157e308        # an int beyond it has no float (10**400 would overflow later)


def llama_ffn_hidden(d_model: int, multiple: int = FFN_MULTIPLE) -> int:
    """Llama's rule for the SwiGLU width: 2/3 of GPT's 4 d (three matrices cost what two did),
    rounded up to a multiple of ``multiple`` (Llama uses 256 at its sizes; minidist's tiny
    models use 32)."""
    return -(-(8 * d_model) // (3 * multiple)) * multiple


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer (the module docstring); frozen: a copy changes it
    (``dataclasses.replace``), so the planner can cache what it computes of one."""

    arch: str = "gpt2"                # gpt2 | llama
    layers: int = 4
    d_model: int = 128
    heads: int = 4
    kv_heads: int | None = None       # Llama's key/value heads; None: heads (GPT-2: always)
    ffn_hidden: int | None = None     # the MLP's width; None: 4 d (GPT-2) or llama_ffn_hidden(d) (Llama)
    vocab_size: int = 256             # the tokenizer's (256: bytes)
    block_size: int | None = None     # the longest sequence (GPT-2: its position table's rows)
    tied: bool | None = None          # the LM head is the token embedding; None: GPT-2 yes, Llama no
    bias: bool | None = None          # biases in the linear layers; None: GPT-2 yes, Llama no
    rope_theta: float = ROPE_THETA    # Llama's rotary base (Llama 3's)
    norm_eps: float = 1e-5            # Llama's RMSNorm epsilon
    # Mixture of experts (model/moe.py): 0 experts is the dense model.
    experts: int = 0
    top_k: int = 2                    # experts per token (Mixtral: 2 of 8)
    moe_every: int = 1                # every moe_every-th block's feed-forward is a mixture
    capacity_factor: float = 0.0      # tokens an expert takes: c * T * top_k / E per sequence; 0: all (dropless)
    aux_loss_coef: float = 0.01       # the load-balancing loss's weight (Switch)
    z_loss_coef: float = 0.001        # the router z-loss's weight (ST-MoE)
    # How one rank computes it (no array's shape depends on these).
    dtype: str = "float32"            # parameter (master weight) dtype
    seed: int = 0                     # the weights are drawn from (seed, name, global shape)
    attention: str = "plain"          # plain | blockwise (nn.attention_function)
    attention_block: int = 128        # query/key tile of blockwise and ring attention

    @property
    def kv(self) -> int:
        """The key/value heads (GPT-2: one per query head)."""
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def ffn(self) -> int:
        """The MLP's hidden width: 4 d (GPT-2) or Llama's SwiGLU width."""
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        return llama_ffn_hidden(self.d_model) if self.gated else 4 * self.d_model

    @property
    def gated(self) -> bool:
        """A SwiGLU MLP (three matrices), RMSNorm and rotary positions: the Llama family."""
        return self.arch == "llama"

    @property
    def untied(self) -> bool:
        """The LM head is a matrix of its own, not the token embedding."""
        return not self.tied if self.tied is not None else self.gated

    @property
    def has_bias(self) -> bool:
        return self.bias if self.bias is not None else not self.gated

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads

    @property
    def d_kv(self) -> int:
        """The width of the keys (and of the values): kv heads of head_dim features."""
        return self.kv * self.head_dim

    def is_moe(self, i: int) -> bool:
        """Block ``i`` (from 0) holds a mixture: every ``moe_every``-th block, counting from 1."""
        return self.experts > 0 and (i + 1) % self.moe_every == 0

    def record(self) -> dict:
        """Its fields, the architecture's defaults written out: what a checkpoint records."""
        return asdict(replace(self, kv_heads=self.kv, ffn_hidden=self.ffn, tied=not self.untied, bias=self.has_bias))

    @classmethod
    def from_record(cls, record: dict) -> "ModelConfig":
        """The model of a (checked) checkpoint's record; keys that name no field are ignored."""
        return cls(**{f.name: record[f.name] for f in fields(cls) if f.name in record})

    def check(self, name=lambda field: field, built: bool = True) -> None:
        """Raise ValueError (one line naming the field) unless this is a model, and with
        ``built`` one that nn.GPT can build (GPT-2's one key/value head per query head and 4 d
        MLP, rotary's even heads): the planner prices models minidist does not build.
        ``name`` spells a field as the reader gave it: ``--d-model`` on the command line
        (train/flags.py, plan/__main__.py), ``model.d_model`` in a checkpoint
        (state/checkpoint_meta.py)."""
        if self.arch not in ARCHS:
            raise ValueError(f"unknown {name('arch')} {self.arch!r}; choose from {ARCHS}")
        for field in ("vocab_size", "block_size", "layers", "heads", "d_model", "kv_heads", "ffn_hidden"):
            value = getattr(self, field)
            optional = value is None and field in ("kv_heads", "ffn_hidden")  # the architecture's
            if not optional and not _counts(value, 1):
                raise ValueError(f"{name(field)} must be a positive integer, got {value!r}")
        d, H, K = self.d_model, self.heads, self.kv
        if d % H:
            raise ValueError(f"{name('d_model')} {d} is not divisible by {name('heads')} {H}")
        if H % K:
            raise ValueError(f"{name('kv_heads')} {K} does not divide {name('heads')} {H}")
        if built and not self.gated and (K != H or self.ffn != 4 * d):
            what = "kv_heads" if K != H else "ffn_hidden"
            raise ValueError(f"{name(what)} is {getattr(self, what)}: GPT-2 has {name('kv_heads')} = "
                             f"{name('heads')} ({H}) and {name('ffn_hidden')} = 4 {name('d_model')} ({4 * d})")
        if built and self.gated and self.head_dim % 2:
            raise ValueError(f"{name('d_model')} {d} / {name('heads')} {H} = {self.head_dim}: "
                             "rotary positions need an even head dimension")
        for field in ("rope_theta", "norm_eps"):
            if not _finite(getattr(self, field)) or getattr(self, field) == 0:
                raise ValueError(f"{name(field)} must be a positive finite number, got {getattr(self, field)!r}")
        for field in ("experts", "top_k", "moe_every"):
            if not _counts(getattr(self, field), 0 if field == "experts" else 1):
                raise ValueError(f"{name(field)} must be a {'non-negative' if field == 'experts' else 'positive'} "
                                 f"integer, got {getattr(self, field)!r}")
        for field in ("capacity_factor", "aux_loss_coef", "z_loss_coef"):
            if not _finite(getattr(self, field)):
                raise ValueError(f"{name(field)} must be a non-negative finite number, got {getattr(self, field)!r}")
        if self.experts and self.top_k > self.experts:
            raise ValueError(f"{name('top_k')} {self.top_k} is more than the {name('experts')} {self.experts}")


def _counts(value, lo: int) -> bool:
    """An int (not a bool) of at least ``lo``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= lo


def _finite(value) -> bool:
    """A non-negative finite number (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= _FLOAT_MAX


# --------------------------------------------------------------------------------------------
# The tensors: {name: global shape}, as GPT.named_parameters names them (a test keeps them equal)
# --------------------------------------------------------------------------------------------
def block_shapes(m: ModelConfig) -> dict:
    """One dense block's parameters, the feed-forward's under ``mlp.``.  GPT-2: two LayerNorms
    (weight, bias), the fused q|k|v ``c_attn`` and ``c_proj``, the MLP's ``c_fc`` and
    ``c_proj`` (weights, and biases unless ``bias`` is false); Llama: two RMSNorm gains, q, k,
    v (kv heads) and o, the fused SwiGLU gate|up (F each) and down, no biases."""
    d, F, kv = m.d_model, m.ffn, m.d_kv
    if m.gated:
        return {"ln_1.weight": (d,), "attn.q_proj.weight": (d, d), "attn.k_proj.weight": (d, kv),
                "attn.v_proj.weight": (d, kv), "attn.o_proj.weight": (d, d), "ln_2.weight": (d,),
                "mlp.gate_up_proj.weight": (d, 2 * F), "mlp.down_proj.weight": (F, d)}
    block = {"ln_1.weight": (d,), "ln_1.bias": (d,), "attn.c_attn.weight": (d, d + 2 * kv),
             "attn.c_attn.bias": (d + 2 * kv,), "attn.c_proj.weight": (d, d), "attn.c_proj.bias": (d,),
             "ln_2.weight": (d,), "ln_2.bias": (d,), "mlp.c_fc.weight": (d, F), "mlp.c_fc.bias": (F,),
             "mlp.c_proj.weight": (F, d), "mlp.c_proj.bias": (d,)}
    if not m.has_bias:  # LayerNorm keeps its bias
        block = {k: s for k, s in block.items() if not k.endswith(".bias") or k.startswith("ln_")}
    return block


def mixture_shapes(m: ModelConfig, block: dict) -> dict:
    """A block with a mixture of experts: the feed-forward's parameters become the router's
    (d x E, no bias) and each expert's copy of them."""
    out = {k: s for k, s in block.items() if not k.startswith("mlp.")}
    out["mlp.router.weight"] = (m.d_model, m.experts)
    for e in range(m.experts):
        out.update({f"mlp.experts.{e}.{k[4:]}": s for k, s in block.items() if k.startswith("mlp.")})
    return out


def end_shapes(m: ModelConfig) -> dict:
    """The parameters outside the blocks: the token table, GPT-2's position table, the final
    norm (LayerNorm or RMSNorm), an untied head."""
    d, V = m.d_model, m.vocab_size
    out = {"wte.weight": (V, d)} if m.gated else {"wte.weight": (V, d), "wpe.weight": (m.block_size, d)}
    out.update({"ln_f.weight": (d,)} if m.gated else {"ln_f.weight": (d,), "ln_f.bias": (d,)})
    if m.untied:
        out["lm_head.weight"] = (d, V)
    return out


def parameter_shapes(m: ModelConfig) -> dict:
    """``{name: global shape}`` of every parameter of ``nn.GPT(m)``, in its order."""
    block, ends = block_shapes(m), end_shapes(m)
    mixture = mixture_shapes(m, block) if m.experts else block
    out = {k: s for k, s in ends.items() if not k.startswith(("ln_f.", "lm_head."))}
    for i in range(m.layers):
        out.update({f"h.{i}.{k}": s for k, s in (mixture if m.is_moe(i) else block).items()})
    out.update({k: s for k, s in ends.items() if k.startswith(("ln_f.", "lm_head."))})
    return out


def parameter_count(m: ModelConfig) -> int:
    """How many parameters (tensors) :func:`parameter_shapes` lists, in closed form: a
    checkpoint's checker counts before it lists, so a config claiming 10**12 layers is refused
    without enumerating them."""
    block = block_shapes(m)
    mlp = sum(k.startswith("mlp.") for k in block)
    mixtures = m.layers // m.moe_every if m.experts else 0  # each: a router and E MLPs instead of one
    return len(end_shapes(m)) + m.layers * len(block) + mixtures * (1 + (m.experts - 1) * mlp)


def numel(shape) -> int:
    return math.prod(shape)
