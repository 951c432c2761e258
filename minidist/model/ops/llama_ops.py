"""The ops of the Llama family, each one node with a hand-written backward.

* :func:`rms_norm`: RMSNorm (Zhang & Sennrich 2019), LayerNorm without the mean and the bias;
* :func:`rotary`: rotary position embeddings (Su et al. 2021, "RoFormer"), applied to the
  query and key heads of a fused projection;
* :func:`swiglu`: the gated feed-forward's activation (Shazeer 2020, "GLU Variants Improve
  Transformer"), ``silu(gate) * up`` on a fused ``gate | up`` projection;
* :func:`repeat_kv`: grouped-query attention's sharing of a key/value head by several query
  heads (Ainslie et al. 2023, "GQA"), as copies the plain attention reads.

Low precision: like layer_norm, rms_norm and rotary compute in float32 for float16/bfloat16
input and return the input's dtype.
"""

from __future__ import annotations

from minidist.model.autograd import Tensor, make_tensor, weight_grad
from minidist.model.backend import from_host, host, xp
from minidist.model.ops.basic import sum_in_float32
from minidist.model.ops.fused import elementwise
from minidist.model.ops.linalg import column_sums
from minidist.model.ops.precision import compute_dtype, to_dtype


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-5) -> Tensor:
    """RMSNorm over the last axis: ``y = xhat * weight``, ``xhat = x * rstd``,
    ``rstd = 1 / sqrt(mean(x^2) + eps)``.  Backward (per row, C features, gh = g * weight)::

        dx = rstd * (gh - xhat * mean(gh * xhat)),   dweight = sum over rows of g * xhat

    dweight waits for W under ``autograd.deferred_weight_grads``.
    """
    C = x.shape[-1]
    if tuple(weight.shape) != (C,):
        raise ValueError(f"rms_norm weight shape {tuple(weight.shape)} != ({C},)")
    cdt = compute_dtype(x.dtype)
    X = to_dtype(x.data, cdt).reshape(-1, C)
    W = to_dtype(weight.data, cdt)
    rstd = 1.0 / xp.sqrt(xp.einsum("ij,ij->i", X, X)[:, None] / C + eps)
    xhat = X * rstd
    w_dtype = weight.dtype

    def backward(g):
        g2d = to_dtype(g, cdt).reshape(-1, C)
        gw = weight_grad(lambda: to_dtype(column_sums(g2d * xhat), w_dtype)) if weight.requires_grad else None
        gx = None
        if x.requires_grad:
            gh = g2d * W
            gx = rstd * (gh - xhat * (xp.einsum("ij,ij->i", gh, xhat)[:, None] / C))
            gx = to_dtype(gx.reshape(x.shape), x.dtype)
        return gx, gw

    return make_tensor(to_dtype((xhat * W).reshape(x.shape), x.dtype), (x, weight), backward)


# ------------------------------------------------------------------ rotary positions
_TABLES = {}  # (positions, head_dim, theta, dtype) -> (cos, sin), each (T, head_dim / 2)


def rotary_tables(positions, head_dim: int, theta: float, dtype):
    """cos and sin of every position's angles ``p * theta^(-2i / head_dim)``, i < head_dim / 2,
    computed in float64 on the host (so every mesh rotates a token by the same numbers), cached."""
    positions = host.asarray(positions)
    key = (positions.tobytes(), head_dim, float(theta), xp.dtype(dtype).str)
    if key not in _TABLES:
        if len(_TABLES) > 64:
            _TABLES.clear()
        inv_freq = float(theta) ** (-host.arange(0, head_dim, 2, dtype=host.float64) / head_dim)
        angles = positions.astype(host.float64)[:, None] * inv_freq[None, :]
        _TABLES[key] = tuple(from_host(f(angles).astype(dtype)) for f in (host.cos, host.sin))
    return _TABLES[key]


def rotary(x: Tensor, heads: int, head_dim: int, positions, theta: float) -> Tensor:
    """Rotary position embeddings on the first ``heads`` heads of ``x`` (B, T, N * head_dim):
    the queries and the keys of a fused projection; the rest (the values) pass unchanged.

    Each head's features are two halves (x1, x2) rotated by the position's angles (the
    half-split layout of Hugging Face's Llama, so its weights need no permutation)::

        y1 = x1 cos - x2 sin,   y2 = x2 cos + x1 sin

    ``positions`` (T,) are the tokens' places in their sequences: a context-parallel rank
    passes its true (zig-zag) positions.  Backward is the inverse rotation (angle -p)."""
    B, T, width = x.shape
    half = head_dim // 2
    if head_dim % 2 or heads * head_dim > width:
        raise ValueError(f"rotary: {heads} heads of {head_dim} features do not fit {width} columns "
                         "(the head dimension must be even)")
    cdt = compute_dtype(x.dtype)
    cos, sin = (t[:, None, :] for t in rotary_tables(positions, head_dim, theta, cdt))  # (T, 1, half)

    def turn(a, sign):
        out = a.astype(cdt)  # a copy: the values' columns pass through it unchanged
        qk = a[..., :heads * head_dim].reshape(B, T, heads, head_dim)
        a1, a2 = to_dtype(qk[..., :half], cdt), to_dtype(qk[..., half:], cdt)
        o = out[..., :heads * head_dim].reshape(B, T, heads, head_dim)
        o[..., :half] = a1 * cos - sign * (a2 * sin)
        o[..., half:] = a2 * cos + sign * (a1 * sin)
        return out

    def backward(g):
        return (to_dtype(turn(g, -1.0), x.dtype),)

    return make_tensor(to_dtype(turn(x.data, 1.0), x.dtype), (x,), backward)


# ------------------------------------------------------------------ SwiGLU
@elementwise
def _swiglu_forward(a, b):
    return a / (1.0 + xp.exp(-a)) * b


@elementwise
def _swiglu_backward(a, b, g):
    """(d gate, d up) of silu(a) * b: silu'(a) = s (1 + a (1 - s)), s = sigmoid(a)."""
    s = 1.0 / (1.0 + xp.exp(-a))
    return g * b * (s * (1.0 + a * (1.0 - s))), g * a * s


def swiglu(h: Tensor) -> Tensor:
    """``silu(gate) * up`` of a fused projection ``h`` (..., 2F) = [gate | up] -> (..., F).

    The gate and the up projection are one matmul (one column-parallel linear whose two
    halves a tensor-parallel rank splits alike); backward saves nothing but ``h``."""
    F = h.shape[-1] // 2
    if h.shape[-1] % 2:
        raise ValueError(f"swiglu needs an even last axis (gate | up), got {h.shape[-1]}")
    # In float32 for low-precision activations, as gelu: in float16 exp(-a) overflows below
    # a = -11.1, and bfloat16's 1.0 + x is float32 anyway.  Widened in each pass, not kept.
    cdt = compute_dtype(h.dtype)

    def halves():
        return to_dtype(h.data[..., :F], cdt), to_dtype(h.data[..., F:], cdt)

    def backward(g):
        dh = xp.empty_like(h.data)
        dh[..., :F], dh[..., F:] = _swiglu_backward(*halves(), to_dtype(g, cdt))
        return (dh,)

    return make_tensor(to_dtype(_swiglu_forward(*halves()), h.dtype), (h,), backward)


# ------------------------------------------------------------------ grouped-query attention
def repeat_kv(qkv: Tensor, n_head: int, n_kv_head: int) -> Tensor:
    """A fused projection (B, T, (H + 2K) D) with K key/value heads -> (B, T, 3 H D) with H.

    Query head h reads key/value head ``h // (H / K)`` (GQA's groups of consecutive query
    heads); the copies make the multi-head layout the attention kernels take.  Backward sums
    each group's key and value gradients into their head.  K = H returns ``qkv`` itself."""
    if n_kv_head == n_head:
        return qkv
    B, T, width = qkv.shape
    H, K = n_head, n_kv_head
    D = width // (H + 2 * K)
    if H % K or D * (H + 2 * K) != width:
        raise ValueError(f"repeat_kv: {width} columns are not {H} query and 2 x {K} key/value heads")
    r = H // K
    X = qkv.data
    out = xp.empty((B, T, 3, H, D), dtype=X.dtype)
    out[:, :, 0] = X[..., :H * D].reshape(B, T, H, D)
    kv = X[..., H * D:].reshape(B, T, 2, K, 1, D)
    out.reshape(B, T, 3, K, r, D)[:, :, 1:] = kv  # a view of out: K x r = H heads

    def backward(g):
        g = g.reshape(B, T, 3, H, D)
        dx = xp.empty_like(X)
        dx[..., :H * D] = g[:, :, 0].reshape(B, T, H * D)
        dx[..., H * D:] = sum_in_float32(g[:, :, 1:].reshape(B, T, 2, K, r, D), 4).reshape(B, T, 2 * K * D)
        return (dx,)

    return make_tensor(out.reshape(B, T, 3 * H * D), (qkv,), backward)
