"""PyTorch twins of minidist's GPT-2 and Llama, used as oracles by tests and as the yardsticks
of the benchmarks.  They take minidist's state_dict (same names, same ``(in, out)`` weight
layout), so both sides compute with identical weights.  PyTorch is imported only by this module.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class TorchGPT(torch.nn.Module):
    """The same architecture as :class:`minidist.model.nn.GPT`, written with PyTorch ops."""

    def __init__(self, state: dict, n_head: int, dtype=torch.float64, tie_embeddings: bool = True):
        super().__init__()
        self.n_head, self.tie = n_head, tie_embeddings
        self.params = torch.nn.ParameterDict(
            {name.replace(".", "__"): torch.nn.Parameter(torch.tensor(value, dtype=dtype))
             for name, value in state.items()})
        self.n_layer = 1 + max(int(k.split(".")[1]) for k in state if k.startswith("h."))

    def p(self, name):
        return self.params[name.replace(".", "__")]

    def named_minidist_parameters(self):
        return [(k.replace("__", "."), v) for k, v in self.params.items()]

    def _linear(self, x, prefix):
        w = self.p(prefix + ".weight")
        b = self.params.get((prefix + ".bias").replace(".", "__"))
        y = x @ w
        return y + b if b is not None else y

    def forward(self, ids, targets=None):
        B, T = ids.shape
        x = F.embedding(ids, self.p("wte.weight")) + self.p("wpe.weight")[:T]
        C = x.shape[-1]
        for i in range(self.n_layer):
            h = f"h.{i}."
            a = F.layer_norm(x, (C,), self.p(h + "ln_1.weight"), self.p(h + "ln_1.bias"), eps=1e-5)
            qkv = self._linear(a, h + "attn.c_attn").view(B, T, 3, self.n_head, C // self.n_head)
            q, k, v = qkv.permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self._linear(y.transpose(1, 2).reshape(B, T, C), h + "attn.c_proj")
            m = F.layer_norm(x, (C,), self.p(h + "ln_2.weight"), self.p(h + "ln_2.bias"), eps=1e-5)
            x = x + self._linear(F.gelu(self._linear(m, h + "mlp.c_fc"), approximate="tanh"), h + "mlp.c_proj")
        x = F.layer_norm(x, (C,), self.p("ln_f.weight"), self.p("ln_f.bias"), eps=1e-5)
        logits = x @ self.p("wte.weight").T if self.tie else self._linear(x, "lm_head")
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class TorchLlama(TorchGPT):
    """The Llama family of :class:`minidist.model.nn.GPT` (``arch="llama"``) with PyTorch's own
    ops: ``F.rms_norm``, Hugging Face's half-split rotary positions, ``F.scaled_dot_product_attention``
    with ``enable_gqa`` (no copies of the key/value heads), ``F.silu``; untied head."""

    def __init__(self, state: dict, n_head: int, n_kv_head: int, theta: float, dtype=torch.float64, eps=1e-5):
        super().__init__(state, n_head, dtype, tie_embeddings=False)
        self.n_kv_head, self.theta, self.eps = n_kv_head, theta, eps

    @staticmethod
    def rotate(x, cos, sin):
        """y1 = x1 cos - x2 sin, y2 = x2 cos + x1 sin on the two halves of each head."""
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def forward(self, ids, targets=None):
        B, T = ids.shape
        x = F.embedding(ids, self.p("wte.weight"))
        C, H, K = x.shape[-1], self.n_head, self.n_kv_head
        D = C // H
        angles = torch.arange(T, dtype=torch.float64)[:, None] * self.theta ** (
            -torch.arange(0, D, 2, dtype=torch.float64) / D)[None, :]  # in float64, as minidist's tables
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        for i in range(self.n_layer):
            h = f"h.{i}."
            a = F.rms_norm(x, (C,), self.p(h + "ln_1.weight"), eps=self.eps)
            q, k, v = (self._linear(a, h + f"attn.{n}_proj").view(B, T, heads, D).transpose(1, 2)
                       for n, heads in (("q", H), ("k", K), ("v", K)))
            y = F.scaled_dot_product_attention(self.rotate(q, cos, sin), self.rotate(k, cos, sin), v,
                                               is_causal=True, enable_gqa=True)
            x = x + self._linear(y.transpose(1, 2).reshape(B, T, C), h + "attn.o_proj")
            m = F.rms_norm(x, (C,), self.p(h + "ln_2.weight"), eps=self.eps)
            gate, up = self._linear(m, h + "mlp.gate_up_proj").chunk(2, dim=-1)
            x = x + self._linear(F.silu(gate) * up, h + "mlp.down_proj")
        logits = self._linear(F.rms_norm(x, (C,), self.p("ln_f.weight"), eps=self.eps), "lm_head")
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
