"""DeepSpeed-Ulysses (Jacobs et al. 2023): all-to-all from sequence-sharded to head-sharded
attention and back."""

from __future__ import annotations

from minidist.comm import functional as F
from minidist.model.autograd import Tensor


def ulysses_self_attention(qkv: Tensor, n_head: int, group, attention) -> Tensor:
    """(B, T/C, 3C) sequence-sharded -> all-to-all -> (B, T, 3C/C) head-sharded -> ``attention``
    on this rank's H/C heads over the whole sequence -> all-to-all back -> (B, T/C, C).

    ``attention`` is a single-rank self-attention ``(qkv, n_head) -> y`` (plain or blockwise).
    The all-to-alls are differentiable (their backward is the inverse all-to-all).
    """
    B, t, C3 = qkv.shape
    n, H = group.size, n_head
    D = C3 // 3 // H
    x = qkv.reshape(B, t, 3, H, D)
    x = F.all_to_all(x, group, split_axis=3, concat_axis=1)           # (B, T, 3, H/C, D)
    y = attention(x.reshape(B, n * t, 3 * (H // n) * D), H // n)      # (B, T, C/C)
    y = F.all_to_all(y.reshape(B, n * t, H // n, D), group, split_axis=1, concat_axis=2)  # (B, T/C, H, D)
    return y.reshape(B, t, H * D)
