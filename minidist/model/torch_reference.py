"""A PyTorch twin of minidist's GPT, used as an oracle by tests and as the yardstick of the
benchmarks.  It takes minidist's state_dict (same names, same ``(in, out)`` weight layout), so
both models compute with identical weights.  PyTorch is imported only by this module.
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
