"""Sequence parallelism and collective matmuls: the tensor-parallel linear layers as ops.

**Sequence parallelism** (Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models"): outside the tensor-parallel matmuls (LayerNorm, residual
additions) the activations are split along the sequence instead of being replicated, so
those regions store 1/tp of their activations.  Each all-reduce of Megatron-LM's layers
(tensor_parallel.py) becomes an all-gather of the sequence before a column-parallel layer and a
reduce-scatter after a row-parallel one: the same bytes (an all-reduce *is* a
reduce-scatter plus an all-gather).  A replicated parameter used on a sequence shard
(LayerNorm, the row-parallel bias, the position table) enters through **f**, so its
gradient is summed over the shards (``TensorParallelLayers.shared``).

**Collective matmul** (``overlap="ring"`` or ``"bidirectional"``; Wang et al. 2022, "Overlap
Communication with Dependent Computation via Decomposition in Large Deep Learning Models",
used by ViT-22B): the all-gather before a column-parallel matmul and the reduce-scatter
after a row-parallel one cut into tp-1 ring steps, each hidden behind the matmul of a chunk
already present (collective_matmul.py).  Backward uses the same two loops: the gradient of
an all-gather-then-matmul is a matmul-then-reduce-scatter and vice versa.  The collective
matmul works on the sequence-parallel layout, so it turns sequence parallelism on.

The two ops here, :func:`all_gather_linear` (column-parallel) and
:func:`linear_reduce_scatter` (row-parallel), take the layer set ``tp``
(``tensor_parallel.TensorParallelLayers``) as an argument: its ``gather_sequence`` and
``matmul_scatter_sequence`` choose one collective or a collective matmul.  This module never
imports tensor_parallel.py, which builds its layers from these ops.
"""

from __future__ import annotations

from minidist.model.autograd import deferring, make_tensor, weight_grad
from minidist.model.backend import xp
from minidist.model.ops.linalg import column_sums
from minidist.model.ops.precision import compute_dtype, gemm_operands, get_autocast_dtype, to_dtype
from minidist.parallel.tensor import collective_matmul as cm


def _check_layout(x, N, what):
    if x.ndim != 3:
        raise ValueError(f"{what}: sequence parallelism needs (batch, sequence, features) input, "
                         f"got shape {tuple(x.shape)}")
    if what == "linear_reduce_scatter" and x.shape[1] % N:
        raise ValueError(f"{what}: sequence length {x.shape[1]} is not divisible by tp={N}")


def _out_dtype(*arrays):
    """The dtype ops.linear would give these inputs (the autocast dtype inside autocast)."""
    low = get_autocast_dtype()
    return low if low is not None else xp.result_type(*[a.dtype for a in arrays])


def all_gather_linear(x, w, b, tp: "TensorParallelLayers"):  # noqa: F821  (tensor_parallel.py; not imported: no cycle)
    """Column-parallel ``all_gather(x, axis=1) @ w + b`` for this rank's sequence part x.

    Only x is kept for backward, which gathers it again (Korthikanti et al. 2022, sec. 4.2.2:
    no rank stores the whole sequence's input).  Backward: dx = reduce_scatter(dy @ w^T),
    dw = the sum over the gathered chunks c of x_c^T dy_c, db = the column sums of dy.  Under
    ``autograd.deferred_weight_grads`` dw (its all-gather of x included) and db wait for W.
    """
    _check_layout(x, tp.parts, "all_gather_linear")
    (W, Bias), _ = gemm_operands(w.data, None if b is None else b.data)
    B, n, _ = x.shape
    y = xp.empty((B, n * tp.parts, W.shape[1]), dtype=xp.result_type(compute_dtype(x.dtype), W.dtype))

    def product(rows, chunk):
        y[:, rows] = cm.mm(chunk, W)

    tp.gather_sequence(x.data, product)
    if Bias is not None:
        y += Bias
    X, w_dtype, b_dtype = x.data, w.dtype, None if b is None else b.dtype

    def backward(g):
        G = g if g.dtype == y.dtype else g.astype(y.dtype)
        gx = to_dtype(tp.matmul_scatter_sequence(G, W.T), x.dtype) if x.requires_grad else None

        def dw():
            gw = xp.zeros(W.shape, dtype=y.dtype)

            def add_chunk(rows, chunk):
                gw[...] += cm.mm_t(chunk, G[:, rows])

            tp.gather_sequence(X, add_chunk)
            return to_dtype(gw, w_dtype)

        gw = weight_grad(dw) if w.requires_grad else None
        gb = None
        if b is not None and b.requires_grad:
            gb = weight_grad(lambda: to_dtype(column_sums(G.reshape(-1, G.shape[-1])), b_dtype))
        return gx, gw, gb

    return make_tensor(to_dtype(y, _out_dtype(x.data, w.data)), (x, w, b), backward)


def linear_reduce_scatter(h, w, tp: "TensorParallelLayers"):  # noqa: F821  (tensor_parallel.py; not imported: no cycle)
    """Row-parallel ``reduce_scatter(h @ w, axis=1)`` (no bias): this rank's sequence part.

    Backward gathers dy chunk by chunk: dh[:, rows] = dy_c @ w^T and dw += h[:, rows]^T dy_c.
    Under ``autograd.deferred_weight_grads`` B keeps the gathered dy (this layer's one
    full-sequence array until W) and dw waits for W, summed over the same chunks in the same
    order, so without a second all-gather.
    """
    _check_layout(h, tp.parts, "linear_reduce_scatter")
    (H, W), out_dtype = gemm_operands(h.data, w.data)
    y = tp.matmul_scatter_sequence(H, W)

    w_dtype = w.dtype

    def backward(g):
        gh = xp.empty(H.shape, dtype=H.dtype) if h.requires_grad else None
        gw = xp.zeros(W.shape, dtype=compute_dtype(H.dtype)) if w.requires_grad else None  # float32: a sum over tokens
        later = gw is not None and deferring()
        kept = []  # (rows, gathered chunk of dy) for a deferred dw

        def grads(rows, chunk):
            if gh is not None:
                gh[:, rows] = cm.mm(chunk, W.T)
            if later:
                kept.append((rows, chunk.copy()))  # the chunk's buffer belongs to the gather
            elif gw is not None:
                gw[...] += cm.mm_t(H[:, rows], chunk)

        tp.gather_sequence(g, grads)

        def dw():
            for rows, chunk in kept:
                gw[...] += cm.mm_t(H[:, rows], chunk)
            return to_dtype(gw, w_dtype)

        return to_dtype(gh, h.dtype), (weight_grad(dw) if later else to_dtype(gw, w_dtype))

    return make_tensor(to_dtype(y, out_dtype), (h, w), backward)
