"""Neural-network ops with fused, hand-written backward passes.

Each op here is one node in the graph (not a chain of small ops): its forward computes the
result with as few temporaries as possible (in-place updates on arrays it owns), and its
backward applies the closed-form derivative.  That is both faster and more memory-frugal
than differentiating through the elementary steps.

Low precision: softmax, layer_norm and cross_entropy compute in float32 when given
float16/bfloat16 input (exp, sums and variances lose too much otherwise); softmax and
layer_norm return the input's dtype, cross_entropy returns a float32 loss.
"""

from __future__ import annotations

import math

from minidist.model.autograd import Tensor, make_tensor, weight_grad
from minidist.model.backend import from_host, host, xp
from minidist.model.ops import cuda, tuning
from minidist.model.ops.basic import check_index, scatter_add_rows
from minidist.model.ops.blas_threads import parallel_for, row_chunks
from minidist.model.ops.fused import elementwise
from minidist.model.ops.linalg import column_sums
from minidist.model.ops.precision import compute_dtype, to_dtype

_GELU_C = math.sqrt(2.0 / math.pi)  # python float: keeps float32 arrays float32 (NEP 50)
_GELU_A = 0.044715


@elementwise
def _gelu_forward(x):
    """(gelu(x), tanh(u)) elementwise; one fused kernel under CuPy."""
    t = xp.tanh(_GELU_C * x * (1.0 + _GELU_A * x * x))
    return 0.5 * x * (1.0 + t), t


@elementwise
def _gelu_backward(x, t, g):
    """g * gelu'(x), from x and the saved t = tanh(u)."""
    du = _GELU_C * (1.0 + 3.0 * _GELU_A * x * x)
    return g * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du)


def gelu(x: Tensor) -> Tensor:
    """GELU, tanh approximation (Hendrycks & Gimpel 2016; used by GPT-2):

        gelu(x) = 0.5 x (1 + tanh(u)),   u = sqrt(2/pi) (x + 0.044715 x^3)

    Same as ``torch.nn.functional.gelu(x, approximate="tanh")``.  Forward saves tanh(u)
    so that backward need not recompute it:

        gelu'(x) = 0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2)

    Whole-array: one fused kernel each way under CuPy; with minidist's CUDA kernels
    (``cuda/gelu.py``) one kernel each way that reads and writes x's own dtype, bfloat16
    included, and recomputes t in backward.  On a CPU (``tuning.tuned()``) the same arithmetic
    runs in cache-sized blocks over the BLAS threads: :func:`_gelu_blocked`.
    """
    if tuning.tuned():
        return _gelu_blocked(x)
    if cuda.gelu.why_not(x.data) is None:
        X = x.data
        return make_tensor(cuda.gelu.forward(X, _GELU_C, _GELU_A), (x,),
                           lambda g: (cuda.gelu.backward(X, g, _GELU_C, _GELU_A),))
    cdt = compute_dtype(x.dtype)
    X = to_dtype(x.data, cdt)
    y, t = _gelu_forward(X)

    def backward(g):
        return (to_dtype(_gelu_backward(X, t, to_dtype(g, cdt)), x.dtype),)

    return make_tensor(to_dtype(y, x.dtype), (x,), backward)


# ------------------------------------------------------------------ CPU tuning of gelu
_BLOCK = 1 << 16  # elements per block: a few blocks' temporaries stay in the L2 cache


def _blocks(n: int):
    """Slices that cut a flat array of ``n`` elements into cache-sized blocks.

    A chain of elementwise NumPy operations makes one pass over memory per operation;
    running the whole chain block by block keeps the intermediates in cache, which for
    activations of several MB is about twice as fast as whole-array passes.
    """
    return [slice(start, min(start + _BLOCK, n)) for start in range(0, n, _BLOCK)]


def _gelu_blocked(x: Tensor) -> Tensor:
    """:func:`gelu` for a CPU: in-place passes block by block, blocks spread over threads."""
    cdt = compute_dtype(x.dtype)
    X = xp.ascontiguousarray(to_dtype(x.data, cdt)).reshape(-1)
    t = xp.empty_like(X)  # tanh(u), saved for backward
    y = xp.empty_like(X)

    def forward_block(b):
        xb, tb, yb = X[b], t[b], y[b]
        xp.multiply(xb, xb, out=tb)
        tb *= _GELU_A * _GELU_C
        tb += _GELU_C
        tb *= xb  # u = c x (1 + a x^2)
        xp.tanh(tb, out=tb)
        xp.add(tb, 1.0, out=yb)
        yb *= xb
        yb *= 0.5

    parallel_for(_blocks(X.size), forward_block)  # blocks are independent: spread over threads

    def backward(g):
        G = xp.ascontiguousarray(to_dtype(g, cdt)).reshape(-1)
        d = xp.empty_like(X)

        def backward_block(b, s):  # s: a block-sized scratch, one per thread
            xb, tb, db = X[b], t[b], d[b]
            sb = s[: db.size]
            xp.multiply(xb, xb, out=db)
            db *= 3.0 * _GELU_A * _GELU_C
            db += _GELU_C  # du/dx
            xp.multiply(tb, tb, out=sb)
            xp.subtract(1.0, sb, out=sb)  # 1 - t^2
            db *= sb
            db *= xb
            db += tb
            db += 1.0
            db *= 0.5
            db *= G[b]

        parallel_for(_blocks(X.size), backward_block, scratch=[((min(_BLOCK, X.size),), cdt)])
        return (to_dtype(d.reshape(x.shape), x.dtype),)

    return make_tensor(to_dtype(y.reshape(x.shape), x.dtype), (x,), backward)


def _softmax_inplace(s, axis):
    """Numerically stable softmax written into ``s`` (subtract the max before exp)."""
    s -= s.max(axis=axis, keepdims=True)
    xp.exp(s, out=s)
    s /= s.sum(axis=axis, keepdims=True)
    return s


def softmax(x: Tensor, axis=-1) -> Tensor:
    """softmax along ``axis``; backward: dx = y * (g - sum(g * y)) (Jacobian-vector product)."""
    cdt = compute_dtype(x.dtype)
    y = _softmax_inplace(x.data.astype(cdt, copy=True), axis)

    def backward(g):
        g = to_dtype(g, cdt)
        dx = g * y
        dot = dx.sum(axis=axis, keepdims=True)
        dx -= dot * y  # y*g - y*sum(g*y)
        return (to_dtype(dx, x.dtype),)

    return make_tensor(to_dtype(y, x.dtype), (x,), backward)


@elementwise
def _ln_affine(xc, rstd, w, b):
    """(xhat, y) = (xc * rstd, xhat * w + b)."""
    xhat = xc * rstd
    return xhat, xhat * w + b


@elementwise
def _ln_input_grad(gh, xhat, rstd, mean_gh, mean_ghx):
    """dx = rstd * (gh - mean(gh) - xhat * mean(gh * xhat)), the means given per row."""
    return rstd * (gh - mean_gh - xhat * mean_ghx)


def _ln_forward(X, W, Bias, eps):
    """(xhat, y, rstd) of the rows of X, one array expression per formula line."""
    xc = X - X.mean(axis=-1, keepdims=True)
    rstd = 1.0 / xp.sqrt((xc * xc).mean(axis=-1, keepdims=True) + eps)
    if W is not None and Bias is not None:
        return (*_ln_affine(xc, rstd, W, Bias), rstd)  # one fused kernel under CuPy
    xhat = xc * rstd  # saved for backward
    y = xhat if W is None else xhat * W
    return xhat, y if Bias is None else y + Bias, rstd


def _ln_param_grads(g2d, xhat, weight, bias, weight_sums):
    """LayerNorm's parameter gradients (weight, bias) in their own dtypes, each computed now
    or deferred to W (``autograd.weight_grad``); ``weight_sums(g2d, xhat)`` is dweight."""
    gw = gb = None
    if weight is not None and weight.requires_grad:
        w_dtype = weight.dtype
        gw = weight_grad(lambda: to_dtype(weight_sums(g2d, xhat), w_dtype))
    if bias is not None and bias.requires_grad:
        b_dtype = bias.dtype
        gb = weight_grad(lambda: to_dtype(column_sums(g2d), b_dtype))
    return gw, gb


def layer_norm(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float = 1e-5) -> Tensor:
    """Layer normalisation over the last axis (Ba et al. 2016), one fused node.

    y = xhat * weight + bias,  xhat = (x - mean) * rstd,  rstd = 1/sqrt(var + eps).
    Backward (per row, C = features, gh = g * weight):
        dx = rstd * gh - rstd * mean(gh) - xhat * (rstd * mean(gh * xhat))
        dweight = sum over rows of g * xhat,   dbias = sum over rows of g

    dweight and dbias wait for W under ``autograd.deferred_weight_grads``.

    Whole-array: each line of the formulas is one array expression (a reduction over the
    last axis, or an elementwise step: one kernel each under CuPy).  On a CPU
    (``tuning.tuned()``) :func:`_layer_norm_tuned` computes the same in few passes per chunk
    of rows, on the BLAS threads.
    """
    C = x.shape[-1]
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and tuple(p.shape) != (C,):
            raise ValueError(f"layer_norm {name} shape {tuple(p.shape)} != ({C},)")
    if tuning.tuned():
        return _layer_norm_tuned(x, weight, bias, eps)
    cdt = compute_dtype(x.dtype)
    W = None if weight is None else to_dtype(weight.data, cdt)
    Bias = None if bias is None else to_dtype(bias.data, cdt)
    x2d = x.data.reshape(-1, C)
    # CuPy: one kernel each way (``cuda/layernorm.py``), reading and writing bfloat16 rows as they are
    fused = cuda.layernorm.why_not(x2d, W, Bias) is None
    if fused:
        xhat, y, rstd = cuda.layernorm.forward(x2d, W, Bias, eps)  # rstd of shape (rows,) here
    else:
        xhat, y, rstd = _ln_forward(to_dtype(x2d, cdt), W, Bias, eps)

    def backward(g):
        g2d = to_dtype(g, cdt).reshape(-1, C)
        gw, gb = _ln_param_grads(g2d, xhat, weight, bias, lambda g2d, xhat: column_sums(g2d * xhat))
        gx = None
        if x.requires_grad and fused:
            gx = cuda.layernorm.backward(g2d, W, xhat, rstd, x.dtype).reshape(x.shape)  # in x's dtype
        elif x.requires_grad:
            gh = g2d if W is None else g2d * W
            gx = _ln_input_grad(gh, xhat, rstd, gh.mean(axis=-1, keepdims=True),
                                (gh * xhat).mean(axis=-1, keepdims=True))
            gx = to_dtype(gx.reshape(x.shape), x.dtype)
        return gx, gw, gb

    return make_tensor(to_dtype(y.reshape(x.shape), x.dtype), (x, weight, bias), backward)


# ------------------------------------------------------------------ CPU tuning of layer_norm
def _row_means(a, C):
    """Mean of each row of a (rows, C) array, shape (rows, 1), as a matrix-vector product.

    BLAS's GEMV reads the array once at full speed: about twice as fast here as NumPy's
    ``mean(axis=-1)``, which reduces each short row separately."""
    return (a @ xp.full(C, 1.0 / C, dtype=a.dtype))[:, None]


def _row_dots(a, b):
    """Per-row dot products of two (rows, C) arrays, shape (rows, 1), in one fused pass."""
    return xp.einsum("ni,ni->n", a, b)[:, None]


def _layer_norm_tuned(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float) -> Tensor:
    """:func:`layer_norm` for a CPU.  Each NumPy call is one pass over the activation, so the code keeps the passes over
    (rows, C) arrays few and does the per-row arithmetic on (rows, 1) vectors instead.
    Rows are independent: with several BLAS threads, each thread normalises a chunk of rows.
    """
    C = x.shape[-1]
    cdt = compute_dtype(x.dtype)
    X = to_dtype(x.data, cdt).reshape(-1, C)
    W = None if weight is None else to_dtype(weight.data, cdt)
    Bias = None if bias is None else to_dtype(bias.data, cdt)
    xhat, y = xp.empty_like(X), xp.empty_like(X)  # xhat is saved for backward
    rstd = xp.empty((X.shape[0], 1), dtype=cdt)

    def normalize(r):  # rows r; row chunks are independent: one per thread
        xh, rs, yr = xhat[r], rstd[r], y[r]
        xp.subtract(X[r], _row_means(X[r], C), out=xh)
        xp.multiply(_row_dots(xh, xh), 1.0 / C, out=rs)  # variance
        rs += eps
        xp.sqrt(rs, out=rs)
        xp.divide(1.0, rs, out=rs)
        xh *= rs
        if W is not None:
            xp.multiply(xh, W, out=yr)
        else:
            yr[...] = xh
        if Bias is not None:
            yr += Bias

    parallel_for(row_chunks(X.shape[0]), normalize)

    def backward(g):
        g2d = to_dtype(g, cdt).reshape(-1, C)
        gw, gb = _ln_param_grads(g2d, xhat, weight, bias, lambda g2d, xhat: xp.einsum("ni,ni->i", g2d, xhat))
        gx = None
        if x.requires_grad:
            gx = xp.empty_like(X)

            def input_grad(r):
                gh, xh, rs = gx[r], xhat[r], rstd[r]
                if W is not None:
                    xp.multiply(g2d[r], W, out=gh)
                else:
                    gh[...] = g2d[r]
                a = _row_dots(gh, xh)  # becomes rstd * mean(gh * xhat)
                a *= rs / C
                c = _row_means(gh, C)  # becomes rstd * mean(gh)
                c *= rs
                gh *= rs
                gh -= c
                gh -= xh * a

            parallel_for(row_chunks(X.shape[0]), input_grad)
            gx = to_dtype(gx.reshape(x.shape), x.dtype)
        return gx, gw, gb

    return make_tensor(to_dtype(y.reshape(x.shape), x.dtype), (x, weight, bias), backward)


def embedding(weight: Tensor, ids) -> Tensor:
    """Rows of ``weight`` (V, C) picked by the integer array ``ids`` (any shape) -> (..., C).

    Backward scatter-adds each output row's gradient into the row it came from; a token
    that occurs several times collects the sum of its gradients (in W under
    ``autograd.deferred_weight_grads``).
    """
    if weight.ndim != 2:
        raise ValueError(f"embedding weight must be (V, C), got shape {tuple(weight.shape)}")
    ids = check_index(ids, weight.shape[0], "embedding id")
    rows, dtype = weight.shape[0], weight.dtype
    return make_tensor(weight.data[ids], (weight,), lambda g: (weight_grad(lambda: scatter_add_rows(ids, g, rows, dtype)),))


def checked_targets(targets, logits_shape, n_classes, ignore_index=None):
    """The targets flattened, on the device and range-checked against ``n_classes`` (on the
    host when they come from there: see ``check_index``), and the mask of the tokens that
    count (None without ``ignore_index``).  Ignored tokens are set to class 0 before the
    check, so an ``ignore_index`` outside [0, n_classes) such as -100 passes it; the mask
    then takes them out of the loss."""
    targets = targets.data if isinstance(targets, Tensor) else targets
    if not hasattr(targets, "shape"):  # a list
        targets = host.asarray(targets)
    if tuple(targets.shape) != tuple(logits_shape[:-1]):
        raise ValueError(f"cross_entropy: targets shape {tuple(targets.shape)} != logits shape "
                         f"{tuple(logits_shape[:-1])} (logits without the class axis)")
    t = targets.reshape(-1)
    keep = None if ignore_index is None else t != ignore_index
    if keep is not None:
        t = t * keep  # operators only: the targets stay where they are (host or device)
        keep = from_host(keep)
    return check_index(t, n_classes, "cross_entropy target"), keep


def cross_entropy(logits: Tensor, targets, ignore_index=None) -> Tensor:
    """Mean negative log-likelihood of ``targets`` under softmax(``logits``), fused.

    logits (..., V), targets int array (...).  Tokens whose target equals ``ignore_index``
    are left out of the mean (a batch where every token is ignored has loss 0 and zero
    gradient, rather than NaN).  The loss is float32 (float64 for float64 logits).

    loss_i = logsumexp(z_i) - z_i[t_i];   d loss / d z_i = (softmax(z_i) - onehot(t_i)) / n
    Forward keeps softmax(z), so backward is a single scaled copy of it.  Already whole-array
    (a few passes over the (rows, V) logits), so both ops paths share it.
    """
    V = logits.shape[-1]
    t, keep = checked_targets(targets, logits.shape, V, ignore_index)
    cdt = compute_dtype(logits.dtype)
    z = logits.data.reshape(-1, V).astype(cdt, copy=True)
    rows = xp.arange(z.shape[0])
    z -= z.max(axis=1, keepdims=True)
    picked = z[rows, t]  # z_i[t_i] after the shift
    xp.exp(z, out=z)
    total = z.sum(axis=1)
    nll = xp.log(total)
    nll -= picked
    z /= total[:, None]  # z now holds softmax probabilities, saved for backward
    if keep is not None:
        nll *= keep
    # The count stays an array on the device (no host synchronisation in the step); with
    # every token ignored the sum is 0 and the count is taken as 1: loss 0, not NaN.
    count = max(z.shape[0], 1) if keep is None else xp.maximum(keep.sum(), 1)
    loss = xp.asarray(nll.sum() / (count if keep is None else count.astype(cdt)), dtype=cdt)

    def backward(g):
        scale = (xp.asarray(g, dtype=xp.float64) / count).astype(cdt)  # an array: no float(g)
        dz = z * scale  # a fresh array: the saved probabilities stay intact (retain_graph)
        dz[rows, t] -= scale
        if keep is not None:
            dz *= keep[:, None]
        return (to_dtype(dz.reshape(logits.shape), logits.dtype),)

    return make_tensor(loss, (logits,), backward)
