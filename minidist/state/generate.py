"""Sample bytes from a checkpoint, with a KV cache.

    python -m minidist.state.generate DIR --prompt "def " --tokens 200 [--temperature T] [--top-k K] [--seed S]

``DIR`` is a checkpoint saved on any mesh (a ``step-NNNNNN`` directory, or a ``--save``
directory: its ``latest``).  Its parameters are gathered whole on this one process
(:func:`minidist.state.checkpoint.load_full`) into a plain ``nn.GPT``; the prompt's UTF-8 bytes are
continued by ``--tokens`` sampled bytes and the whole text is printed, decoded with
``errors="replace"`` (a byte model may stop in the middle of a character).

The KV cache (:class:`KVCache`) is plain array code, no autograd: each layer keeps the keys and
values of the tokens seen so far, ``(n_head, t, d_head)``; a step computes q, k, v of the new
tokens only and attends to the cache.  The prompt goes through in one step (prefill), then one
byte per step.  ``tests/test_generate.py`` checks the cached logits against ``nn.GPT``'s full
forward at every position.

Sampling (:func:`sample`): logits / temperature, the ``top_k`` largest kept, softmax, one draw
from a ``numpy.random.Generator`` seeded by ``--seed`` (the same seed and checkpoint give the
same text; without ``--seed`` each run differs).  ``--temperature 0`` is greedy (argmax).

Longer than the position table (``seq_len`` of the model): positions are learned, so the cache
cannot slide.  The model sees the last ``seq_len`` bytes: a longer prompt is cut to its last
``seq_len`` bytes (all of it is still printed), and once the cache is full every further byte
recomputes the window of the last ``seq_len`` bytes from scratch (a sliding window without
cache, as nanoGPT's ``generate`` does for every byte) -- slower, but each byte still sees as
much context as the model can take.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys

from minidist.host.cli_checks import OneLineParser
from minidist.model.backend import to_host, xp


def load_model(path: str):
    """A plain, one-process ``nn.GPT`` holding checkpoint ``path``'s parameters."""
    from minidist.state.checkpoint import load_full
    from minidist.model.nn import GPT, GPTConfig

    model_config, params = load_full(path)
    names = {f.name for f in dataclasses.fields(GPTConfig)}
    model = GPT(GPTConfig(**{k: v for k, v in model_config.items() if k in names}))
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


def _linear(x, layer):
    y = x @ layer.weight.data
    return y if layer.bias is None else y + layer.bias.data


def _gelu(x):  # the tanh approximation, as ops.gelu
    return 0.5 * x * (1.0 + xp.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))


class KVCache:
    """Keys and values of every layer for the tokens seen so far, and the forward of new tokens.

    ``step(ids)`` runs the tokens ``ids`` (a 1-D int array) at positions ``t .. t+len(ids)-1``
    after the ``t`` tokens already cached and returns their logits ``(len(ids), vocab)``."""

    def __init__(self, model):
        cfg = model.config
        self.model, self.cfg = model, cfg
        self.n_head, self.d_head = cfg.n_head, cfg.d_model // cfg.n_head
        dt = model.wte.weight.data.dtype
        shape = (cfg.n_layer, self.n_head, cfg.seq_len, self.d_head)
        self.k, self.v = xp.empty(shape, dtype=dt), xp.empty(shape, dtype=dt)
        self.t = 0

    @property
    def free(self) -> int:
        """How many more tokens fit in the position table."""
        return self.cfg.seq_len - self.t

    def reset(self):
        self.t = 0

    def step(self, ids):
        ids = xp.asarray(ids).reshape(-1)
        n, t0, m = ids.shape[0], self.t, self.model
        if n == 0:
            raise ValueError("KVCache.step needs at least one token")
        if n > self.free:
            raise ValueError(f"{n} tokens after {t0} exceed the position table ({self.cfg.seq_len})")
        t1, H, D = t0 + n, self.n_head, self.d_head
        x = m.wte.weight.data[ids] + m.wpe.weight.data[t0:t1]                    # (n, C)
        # query i (position t0 + i) sees keys 0 .. t0 + i
        future = xp.arange(t1)[None, :] > (t0 + xp.arange(n))[:, None]           # (n, t1)
        scale = 1.0 / math.sqrt(D)
        for layer, block in enumerate(m.h):
            h = _layer_norm(x, block.ln_1, block.ln_1.eps)
            qkv = _linear(h, block.attn.c_attn)                                   # (n, 3C): q | k | v
            q, k, v = (qkv[:, j * H * D:(j + 1) * H * D].reshape(n, H, D).transpose(1, 0, 2) for j in range(3))
            self.k[layer, :, t0:t1] = k
            self.v[layer, :, t0:t1] = v
            K, V = self.k[layer, :, :t1], self.v[layer, :, :t1]                   # (H, t1, D)
            s = (q * scale) @ K.transpose(0, 2, 1)                                 # (H, n, t1)
            s = xp.where(future[None], -xp.inf, s)
            s = xp.exp(s - s.max(axis=-1, keepdims=True))
            p = s / s.sum(axis=-1, keepdims=True)
            y = (p @ V).transpose(1, 0, 2).reshape(n, H * D)
            x = x + _linear(y, block.attn.c_proj)
            h = _layer_norm(x, block.ln_2, block.ln_2.eps)
            x = x + _linear(_gelu(_linear(h, block.mlp.c_fc)), block.mlp.c_proj)
        self.t = t1
        x = _layer_norm(x, m.ln_f, m.ln_f.eps)
        if m.lm_head is not None:
            return _linear(x, m.lm_head)
        return x @ m.wte.weight.data.T


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
             seed: int | None = None) -> bytes:
    """``prompt`` followed by ``tokens`` sampled bytes (see the module's docstring for the
    window when the text outgrows the position table)."""
    from minidist.model.backend import host

    if not prompt:
        raise ValueError("the prompt is empty: the model needs at least one byte to continue")
    rng = host.random.default_rng(seed)
    seq_len = model.config.seq_len
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
    return bytes(out)


# ------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    from minidist.host.cli_checks import float_in, int_in

    p = OneLineParser(prog="python -m minidist.state.generate",
                description="Sample bytes from a minidist checkpoint (saved on any mesh) on one process, "
                            "with a KV cache, and print the prompt and its continuation.")
    p.add_argument("checkpoint", metavar="DIR", help="a step-NNNNNN checkpoint, or a --save directory (its latest)")
    p.add_argument("--prompt", default="\n", help="text to continue (UTF-8; default: a newline)")
    p.add_argument("--tokens", type=int_in(lo=0), default=200, metavar="N", help="bytes to sample (default: 200)")
    p.add_argument("--temperature", type=float_in(lo=0), default=1.0, metavar="T",
                   help="divide the logits by T; 0 = greedy argmax (default: 1)")
    p.add_argument("--top-k", type=int_in(lo=1), default=None, metavar="K",
                   help="sample among the K most likely bytes only (default: all)")
    p.add_argument("--seed", type=int_in(lo=0), default=None, metavar="S",
                   help="seed of the sampler: the same seed gives the same text (default: a fresh one)")
    return p


def main(argv=None) -> int:
    from minidist.state.checkpoint import CheckpointError

    parser = build_parser()
    args = parser.parse_args(argv)
    prompt = args.prompt.encode("utf-8", errors="surrogateescape")
    if not prompt:
        parser.error("--prompt is empty: the model needs at least one byte to continue")
    if not os.path.isdir(args.checkpoint):
        parser.error(f"{args.checkpoint}: no such checkpoint directory")
    try:
        model = load_model(args.checkpoint)
    except CheckpointError as exc:
        message = str(exc)
        parser.error(message[len("--resume "):] if message.startswith("--resume ") else message)
    text = generate(model, prompt, args.tokens, args.temperature, args.top_k, args.seed)
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="replace")
    print(text.decode("utf-8", errors="replace"), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
