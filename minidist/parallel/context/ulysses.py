"""DeepSpeed-Ulysses (Jacobs et al. 2023): all-to-all from sequence-sharded to head-sharded
attention and back."""

from __future__ import annotations

from minidist.comm import functional as F
from minidist.model import ops
from minidist.model.autograd import Tensor


def ulysses_self_attention(qkv: Tensor, n_head: int, group, attention, n_kv_head: int | None = None) -> Tensor:
    """(B, T/C, (H + 2K) D) sequence-sharded -> all-to-all -> (B, T, (H + 2K) D / C)
    head-sharded -> ``attention`` on this rank's H/C query and K/C key/value heads over the
    whole sequence -> all-to-all back -> (B, T/C, H D).

    With fewer key/value heads than ranks (grouped-query attention, K < C, or K/C not whole)
    each is first repeated for the query heads that read it, so a rank receives copies of
    the heads its queries need.  ``attention`` is a single-rank self-attention
    ``(qkv, n_head, n_kv_head) -> y`` (plain or blockwise).  The all-to-alls are
    differentiable (their backward is the inverse all-to-all).
    """
    n, H = group.size, n_head
    K = n_kv_head or n_head
    if K % n:
        qkv, K = ops.repeat_kv(qkv, H, K), H
    B, t, width = qkv.shape
    D = width // (H + 2 * K)
    q = qkv[..., :H * D].reshape(B, t, n, H // n * D)
    kv = qkv[..., H * D:].reshape(B, t, 2, n, K // n * D).transpose(0, 1, 3, 2, 4).reshape(B, t, n, 2 * K // n * D)
    x = ops.concat([q, kv], axis=3)                                    # rank j's q | k | v heads together
    x = F.all_to_all(x, group, split_axis=2, concat_axis=1)            # (B, T, 1, (H + 2K) D / C)
    y = attention(x.reshape(B, n * t, (H + 2 * K) // n * D), H // n, K // n)  # (B, T, H D / C)
    y = F.all_to_all(y.reshape(B, n * t, H // n, D), group, split_axis=1, concat_axis=2)  # (B, T/C, H, D)
    return y.reshape(B, t, H * D)
