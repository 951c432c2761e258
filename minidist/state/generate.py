"""Sample text from a checkpoint, with a KV cache.

    python -m minidist.state.generate DIR --prompt "def " --tokens 200 [--temperature T] [--top-k K] [--seed S]
        [--tokenizer FILE]

``DIR`` is a checkpoint saved on any mesh (a ``step-NNNNNN`` directory, or a ``--save``
directory: its ``latest``).  Its parameters are gathered whole on this one process
(:func:`minidist.state.checkpoint.load_full`) into a plain ``nn.GPT``; the prompt's tokens are
continued by ``--tokens`` sampled tokens and the whole text is printed, decoded with
``errors="replace"`` (a model may stop in the middle of a character).

The tokens are the checkpoint's: bytes for a model trained on bytes, or the trained BPE's
(minidist/state/tokenizer.py) for one trained on token shards -- the checkpoint records its
tokenizer's hash, and ``--tokenizer`` (the tokenizer file, or the shard directory holding it)
must be that one.  The prompt is encoded by it and the tokens decoded to their bytes.

The KV cache (:class:`KVCache`) is plain array code, no autograd: each layer keeps the keys and
values of the tokens seen so far, ``(n_kv_head, t, d_head)``; a step computes q, k, v of the new
tokens only and attends to the cache.  The prompt goes through in one step (prefill), then one
byte per step.  Both families: GPT-2 (LayerNorm, learned positions, GELU MLP) and Llama
(RMSNorm, rotary positions turning each new query and key by its absolute position, K
key/value heads each read by ``heads / K`` query heads -- the cache holds K heads -- and the
SwiGLU feed-forward).  ``tests/test_generate.py`` checks the cached logits against ``nn.GPT``'s
full forward at every position, for both.

Sampling (:func:`sample`): logits / temperature, the ``top_k`` largest kept, softmax, one draw
from a ``numpy.random.Generator`` seeded by ``--seed`` (the same seed and checkpoint give the
same text; without ``--seed`` each run differs).  ``--temperature 0`` is greedy (argmax).

Longer than the position table (``block_size`` of the model): GPT-2's positions are learned,
so the cache cannot slide (and Llama's ``block_size`` is the longest sequence it takes).  The
model sees the last ``block_size`` bytes: a longer prompt is cut to its last ``block_size``
bytes (all of it is still printed), and once the cache is full every further byte
recomputes the window of the last ``block_size`` bytes from scratch (a sliding window without
cache, as nanoGPT's ``generate`` does for every byte) -- slower, but each byte still sees as
much context as the model can take.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

from minidist.host.cli_checks import OneLineParser
from minidist.model.backend import to_host, xp


def load_model(path: str):
    """A plain, one-process ``nn.GPT`` holding checkpoint ``path``'s parameters."""
    from minidist.layout.model import ModelConfig
    from minidist.state.checkpoint import load_full
    from minidist.model.nn import GPT

    record, params = load_full(path)
    model = GPT(ModelConfig.from_record(record))
    model.load_state_dict(params)
    return model


# ------------------------------------------------------------------------------------------------
# The cached forward: plain array code on the model's parameter arrays
# ------------------------------------------------------------------------------------------------
def _layer_norm(x, ln, eps):
    mean = x.mean(axis=-1, keepdims=True)
    xc = x - mean
    var = (xc * xc).mean(axis=-1, keepdims=True)
    return xc / xp.sqrt(var + eps) * ln.weight.data + ln.bias.data


def _rms_norm(x, ln, eps):  # Llama's RMSNorm: no mean, no bias
    return x / xp.sqrt((x * x).mean(axis=-1, keepdims=True) + eps) * ln.weight.data


def _norm(x, ln):
    from minidist.model.nn import RMSNorm

    return _rms_norm(x, ln, ln.eps) if isinstance(ln, RMSNorm) else _layer_norm(x, ln, ln.eps)


def _linear(x, layer):
    y = x @ layer.weight.data
    return y if layer.bias is None else y + layer.bias.data


def _gelu(x):  # the tanh approximation, as ops.gelu
    return 0.5 * x * (1.0 + xp.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))


def _silu(x):
    return x / (1.0 + xp.exp(-x))


def _rotate(x, positions, theta):
    """Rotary positions (Su et al. 2021) on heads ``x`` (heads, n, D) of tokens at absolute
    ``positions`` (n,): each head's halves (x1, x2) turned by ``p * theta^(-2i / D)`` -- the
    half-split layout of Hugging Face's Llama, as ``ops.rotary``."""
    D = x.shape[-1]
    angles = positions[:, None].astype(xp.float64) * theta ** (-xp.arange(0, D, 2, dtype=xp.float64) / D)
    cos, sin = xp.cos(angles).astype(x.dtype), xp.sin(angles).astype(x.dtype)  # (n, D/2)
    x1, x2 = x[..., :D // 2], x[..., D // 2:]
    return xp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _dense(mlp, h):
    """One feed-forward on rows ``h``: Llama's SwiGLU, or GPT-2's GELU MLP."""
    if hasattr(mlp, "gate_up_proj"):
        gate_up = _linear(h, mlp.gate_up_proj)                                     # (n, 2F): gate | up
        F = gate_up.shape[-1] // 2
        return _linear(_silu(gate_up[:, :F]) * gate_up[:, F:], mlp.down_proj)
    return _linear(_gelu(_linear(h, mlp.c_fc)), mlp.c_proj)


def _feed_forward(mlp, h):
    """The block's feed-forward on rows ``h`` (n, C); a mixture of experts (model/moe.py) routes
    each row to its top-k experts by the router's softmax, weighted as moe.py weighs them (the
    k probabilities renormalised for k >= 2, the probability itself for k = 1).  A row's route
    does not depend on the other rows only without a capacity: KVCache refuses one."""
    experts = getattr(mlp, "experts", None)
    if experts is None:
        return _dense(mlp, h)
    z = h @ mlp.router.weight.data                                                  # (n, E)
    p = xp.exp(z - z.max(axis=-1, keepdims=True))
    p = p / p.sum(axis=-1, keepdims=True)
    k = mlp.cfg.top_k
    choice = xp.argsort(-p, axis=1, kind="stable")[:, :k]                          # ties: the lower expert
    gates = xp.take_along_axis(p, choice, axis=1)
    if k > 1:
        gates = gates / gates.sum(axis=1, keepdims=True)
    out = xp.zeros_like(h)
    for e, expert in enumerate(experts):
        rows, slot = xp.nonzero(choice == e)
        if rows.shape[0]:
            out[rows] += _dense(expert, h[rows]) * gates[rows, slot][:, None]
    return out


class KVCache:
    """Keys and values of every layer for the tokens seen so far, and the forward of new tokens.

    ``step(ids)`` runs the tokens ``ids`` (a 1-D int array) at positions ``t .. t+len(ids)-1``
    after the ``t`` tokens already cached and returns their logits ``(len(ids), vocab)``.

    GPT-2 and Llama both: the cache holds ``kv_heads`` heads (grouped-query attention: Llama's
    K, each read by ``heads / K`` consecutive query heads; GPT-2's one per query head), and a
    Llama key enters it already turned by its absolute position, so it never changes again."""

    def __init__(self, model):
        cfg = model.config
        self.model, self.cfg, self.llama = model, cfg, cfg.arch == "llama"
        self.n_head, self.n_kv_head, self.d_head = cfg.heads, cfg.kv, cfg.head_dim
        dt = model.wte.weight.data.dtype
        if cfg.experts and cfg.capacity_factor:
            raise ValueError(f"a mixture with capacity factor {cfg.capacity_factor} routes each token by the whole "
                             "sequence's choices: generation with a KV cache needs a dropless one (0)")
        shape = (cfg.layers, self.n_kv_head, cfg.block_size, self.d_head)
        self.k, self.v = xp.empty(shape, dtype=dt), xp.empty(shape, dtype=dt)
        self.t = 0

    @property
    def free(self) -> int:
        """How many more tokens fit in the position table (Llama: the model's longest sequence)."""
        return self.cfg.block_size - self.t

    def reset(self):
        self.t = 0

    def step(self, ids):
        ids = xp.asarray(ids).reshape(-1)
        n, t0, m = ids.shape[0], self.t, self.model
        if n == 0:
            raise ValueError("KVCache.step needs at least one token")
        if n > self.free:
            table = "model's longest sequence" if self.llama else "position table"
            raise ValueError(f"{n} tokens after {t0} exceed the {table} ({self.cfg.block_size})")
        t1 = t0 + n
        x = m.wte.weight.data[ids]                                                  # (n, C)
        if not self.llama:
            x = x + m.wpe.weight.data[t0:t1]
        block_step = self._llama_block if self.llama else self._gpt2_block
        for layer, block in enumerate(m.h):
            x = block_step(layer, block, x, t0)
        self.t = t1
        x = _norm(x, m.ln_f)
        if m.lm_head is not None:
            return _linear(x, m.lm_head)
        return x @ m.wte.weight.data.T

    def _gpt2_block(self, layer, block, x, t0):
        n, H, D = x.shape[0], self.n_head, self.d_head
        qkv = _linear(_norm(x, block.ln_1), block.attn.c_attn)                      # (n, 3C): q | k | v
        q, k, v = (qkv[:, j * H * D:(j + 1) * H * D].reshape(n, H, D).transpose(1, 0, 2) for j in range(3))
        x = x + _linear(self._attend(layer, q, k, v, t0), block.attn.c_proj)
        return x + _feed_forward(block.mlp, _norm(x, block.ln_2))

    def _llama_block(self, layer, block, x, t0):
        n, D, a = x.shape[0], self.d_head, block.attn
        h = _norm(x, block.ln_1)
        q, k, v = (_linear(h, proj).reshape(n, -1, D).transpose(1, 0, 2) for proj in (a.q_proj, a.k_proj, a.v_proj))
        positions = xp.arange(t0, t0 + n)
        q, k = _rotate(q, positions, a.theta), _rotate(k, positions, a.theta)
        x = x + _linear(self._attend(layer, q, k, v, t0), a.o_proj)
        return x + _feed_forward(block.mlp, _norm(x, block.ln_2))

    def _attend(self, layer, q, k, v, t0):
        """Causal attention of queries ``q`` (H, n, D) at positions t0.. over the cache, after
        the new keys and values ``k``, ``v`` (K, n, D) enter it; the heads' outputs side by side
        (n, H D).  Query head h reads key/value head h // (H / K)."""
        (H, n, D), K = q.shape, k.shape[0]
        t1 = t0 + n
        self.k[layer, :, t0:t1] = k
        self.v[layer, :, t0:t1] = v
        keys, values = self.k[layer, :, None, :t1], self.v[layer, :, None, :t1]     # (K, 1, t1, D)
        s = (q.reshape(K, H // K, n, D) / math.sqrt(D)) @ keys.transpose(0, 1, 3, 2)  # (K, H/K, n, t1)
        future = xp.arange(t1)[None, :] > (t0 + xp.arange(n))[:, None]             # query i sees keys <= t0 + i
        s = xp.where(future, -xp.inf, s)
        s = xp.exp(s - s.max(axis=-1, keepdims=True))
        p = s / s.sum(axis=-1, keepdims=True)
        return (p @ values).reshape(H, n, D).transpose(1, 0, 2).reshape(n, H * D)


# ------------------------------------------------------------------------------------------------
# Sampling
# ------------------------------------------------------------------------------------------------
def sample(logits, rng, temperature: float = 1.0, top_k: int | None = None) -> int:
    """One token from the logits of one position: argmax when ``temperature`` is 0, else a draw
    from softmax(logits / temperature) over the ``top_k`` largest.  The 256 logits come to the
    host (``to_host``: a no-op with NumPy) and are drawn with a seeded NumPy generator, so a
    seed gives the same text on the CPU and under CuPy; the model's math stays on ``xp``."""
    from minidist.model.backend import host

    z = host.asarray(to_host(logits), dtype=host.float64)
    if temperature == 0:
        return int(host.argmax(z))
    z = z / temperature
    if top_k is not None and top_k < z.size:
        kth = host.partition(z, z.size - top_k)[z.size - top_k]
        z = host.where(z < kth, -host.inf, z)
    p = host.exp(z - z.max())
    cdf = host.cumsum(p)
    return int(min(host.searchsorted(cdf, rng.random() * cdf[-1], side="right"), z.size - 1))


def generate(model, prompt: bytes, tokens: int, temperature: float = 1.0, top_k: int | None = None,
             seed: int | None = None, tokenizer=None) -> bytes:
    """``prompt`` followed by ``tokens`` sampled tokens, as bytes: the prompt's bytes are the
    tokens, or ``tokenizer`` (a BPETokenizer) encodes them and decodes the result."""
    if not prompt:
        raise ValueError("the prompt is empty: the model needs at least one byte to continue")
    if tokenizer is None:
        return bytes(generate_ids(model, list(prompt), tokens, temperature, top_k, seed))
    ids = generate_ids(model, tokenizer.encode_bytes(prompt).tolist(), tokens, temperature, top_k, seed)
    return tokenizer.decode_bytes(ids)


def generate_ids(model, prompt: list, tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 seed: int | None = None) -> list:
    """The token ids ``prompt`` followed by ``tokens`` sampled ones (see the module's docstring
    for the window when the text outgrows the position table)."""
    from minidist.model.backend import host

    if not prompt:
        raise ValueError("the prompt is empty: the model needs at least one token to continue")
    rng = host.random.default_rng(seed)
    seq_len = model.config.block_size
    out = list(prompt)
    cache = KVCache(model)
    logits = cache.step(xp.asarray(out[-seq_len:]))[-1]                             # prefill
    for i in range(tokens):
        out.append(sample(to_host(logits), rng, temperature, top_k))
        if i == tokens - 1:
            break
        if cache.free:
            logits = cache.step(xp.asarray(out[-1:]))[-1]
        else:  # the table is full: the window of the last seq_len bytes, without the cache
            cache.reset()
            logits = cache.step(xp.asarray(out[-seq_len:]))[-1]
    return out


# ------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    from minidist.host.cli_checks import float_in, int_in

    p = OneLineParser(prog="python -m minidist.state.generate",
                description="Sample text from a minidist checkpoint (saved on any mesh) on one process, "
                            "with a KV cache, and print the prompt and its continuation.")
    p.add_argument("checkpoint", metavar="DIR", help="a step-NNNNNN checkpoint, or a --save directory (its latest)")
    p.add_argument("--prompt", default="\n", help="text to continue (UTF-8; default: a newline)")
    p.add_argument("--tokens", type=int_in(lo=0), default=200, metavar="N",
                   help="tokens to sample (bytes for a byte model; default: 200)")
    p.add_argument("--tokenizer", default=None, metavar="FILE",
                   help="the trained tokenizer the checkpoint records (its file, or the shard directory "
                        "holding it); not needed for a model of bytes")
    p.add_argument("--temperature", type=float_in(lo=0), default=1.0, metavar="T",
                   help="divide the logits by T; 0 = greedy argmax (default: 1)")
    p.add_argument("--top-k", type=int_in(lo=1), default=None, metavar="K",
                   help="sample among the K most likely bytes only (default: all)")
    p.add_argument("--seed", type=int_in(lo=0), default=None, metavar="S",
                   help="seed of the sampler: the same seed gives the same text (default: a fresh one)")
    return p


def checkpoint_tokenizer(path: str, given: str | None):
    """The tokenizer checkpoint ``path`` was trained with: None for bytes, else the BPETokenizer
    of ``given`` (a tokenizer file, or a shard directory: its tokenizer file), which must be the
    one the checkpoint records (its ``data_tokenizer``: the file's hash, or ``"bytes"``).
    TokenizerError, one line, otherwise."""
    from minidist.state.checkpoint import metadata, resolve
    from minidist.state.shards import TOKENIZER
    from minidist.state.tokenizer import BPETokenizer, TokenizerError

    saved = metadata(resolve(path))["scalars"].get("data_tokenizer", "bytes")
    if given is None:
        if saved == "bytes":
            return None
        raise TokenizerError(f"the checkpoint was trained with tokenizer {saved}: give its file with --tokenizer "
                             "(the tokenizer file, or the shard directory holding it)")
    tok = BPETokenizer(os.path.join(given, TOKENIZER) if os.path.isdir(given) else given)
    if tok.hash != saved:
        what = "on bytes" if saved == "bytes" else f"with tokenizer {saved}"
        raise TokenizerError(f"--tokenizer {given}: tokenizer {tok.hash}, but the checkpoint was trained {what}")
    return tok


def main(argv=None) -> int:
    from minidist.state.checkpoint import CheckpointError
    from minidist.state.tokenizer import TokenizerError

    parser = build_parser()
    args = parser.parse_args(argv)
    prompt = args.prompt.encode("utf-8", errors="surrogateescape")
    if not prompt:
        parser.error("--prompt is empty: the model needs at least one byte to continue")
    if not os.path.isdir(args.checkpoint):
        parser.error(f"{args.checkpoint}: no such checkpoint directory")
    try:
        tokenizer = checkpoint_tokenizer(args.checkpoint, args.tokenizer)
        model = load_model(args.checkpoint)
    except (CheckpointError, TokenizerError) as exc:
        message = str(exc)
        parser.error(message[len("--resume "):] if message.startswith("--resume ") else message)
    text = generate(model, prompt, args.tokens, args.temperature, args.top_k, args.seed, tokenizer)
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="replace")
    print(text.decode("utf-8", errors="replace"), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
