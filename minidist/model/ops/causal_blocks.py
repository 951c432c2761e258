"""Causal attention's T x T products on the blocks at and below the diagonal only.

Under a causal mask query i sees keys j <= i, so the upper triangle of the scores S, of the
probabilities P and of their gradients dP and dS is masked: half of every T x T product is
work whose result is thrown away.  FlashAttention skips the masked tiles; the whole-array
attention (``attention._attend``) can do the same at a coarser grain.  Cut the queries into n
blocks: query block [i0, i1) multiplies only with keys [0, i1).  Each of attention's six
batched products becomes n batched products on views (``gemm.matmul`` writes into views of
the T x T arrays), which together do (n + 1) / 2n of the work, 5/8 with n = 4:

* ``lower_scores(a, b)``: a b^T (S = Qs K^T, dP = dO V^T), block [i0, i1) of rows against
  rows [0, i1) of b.  What lies right of that is left unwritten.
* ``lower_times(m, b)``: m b for a lower-triangular m (O = P V, dQ = dS K): rows [i0, i1)
  of m, columns [0, i1), times rows [0, i1) of b.
* ``lower_t_times(m, b)``: m^T b (dV = P^T dO, dK = dS^T Qs): rows [j0, j1) of the result
  are columns [j0, j1) of m, rows [j0, T), times rows [j0, T) of b.

The unwritten parts of S and dP are never read: the softmax kernels (``cuda.softmax``) read
a row only up to its diagonal and write P and dS with zeros beyond it, the zeros the last
two products rely on.  So the blocks are used only together with those kernels (on CuPy);
on NumPy a test checks each product against the full one.  ``MINIDIST_CAUSAL_BLOCKS`` sets n;
a block has at least ``MIN_ROWS`` rows, so short sequences stay whole.

The price is n times the cuBLAS calls, smaller ones, and (in self-attention, whose heads are
strided views costing a call per batch element in ``cuda/gemm.py``) a contiguous copy of Q, K and V
and of their gradients, so that a block is one call over every (batch, head) pair
(``attention._self_attention_copied``).  On an H200 the skipped work pays for both (docs/gpu.md),
so the default is n = 4; n = 1 gives whole products on the heads' views, no copies.  Under
mixed precision the tensor-core FlashAttention kernels (``cuda/flash_mma.py``) skip the masked
tiles themselves, and these blocks serve float32 and float64.
"""

from __future__ import annotations

from minidist.host import env
from minidist.model.backend import xp
from minidist.model.ops.cuda import gemm

MIN_ROWS = 128  # rows of a query block at least: smaller products use the GPU poorly


def blocks(t: int) -> list[tuple[int, int]]:
    """The query blocks [(i0, i1), ...] of a causal T x T product: ``MINIDIST_CAUSAL_BLOCKS``
    of them (fewer where a block would have fewer than MIN_ROWS rows), nearly equal."""
    n = max(1, min(env.get("MINIDIST_CAUSAL_BLOCKS"), t // MIN_ROWS))
    edges = [t * i // n for i in range(n + 1)]
    return list(zip(edges[:-1], edges[1:]))


def _lead(*arrays):
    return tuple(xp.broadcast_shapes(*(a.shape[:-2] for a in arrays)))


def lower_scores(a, b, parts):
    """a @ b^T for a, b of shape (..., T, D), on the blocks ``parts`` at and below the
    diagonal: a new (..., T, T) array whose entries right of each block's last row are unset."""
    t = a.shape[-2]
    s = xp.empty(_lead(a, b) + (t, t), dtype=a.dtype)
    for i0, i1 in parts:
        gemm.matmul(a[..., i0:i1, :], b[..., :i1, :].swapaxes(-1, -2), out=s[..., i0:i1, :i1])
    return s


def lower_times(m, b, parts, out=None):
    """m @ b for m (..., T, T), zero above the diagonal, and b (..., T, D); into ``out`` (any
    strides) when given."""
    out = xp.empty(_lead(m, b) + b.shape[-2:], dtype=m.dtype) if out is None else out
    for i0, i1 in parts:
        gemm.matmul(m[..., i0:i1, :i1], b[..., :i1, :], out=out[..., i0:i1, :])
    return out


def lower_t_times(m, b, parts, out=None):
    """m^T @ b for m (..., T, T), zero above the diagonal, and b (..., T, D); into ``out``
    (any strides) when given."""
    out = xp.empty(_lead(m, b) + b.shape[-2:], dtype=m.dtype) if out is None else out
    for j0, j1 in parts:
        gemm.matmul(m[..., j0:, j0:j1].swapaxes(-1, -2), b[..., j0:, :], out=out[..., j0:j1, :])
    return out
