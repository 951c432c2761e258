"""Rooted data movement: scatter and gather, linear at the root.

With one root every message starts or ends at the same rank, so a tree would not move fewer
bytes through the root (it must send or receive (N-1)/N of the data either way); linear
keeps it simple: N-1 messages, posted all at once.
"""

from __future__ import annotations

import numpy as np

from minidist.model.backend import bfloat16, on_device
from minidist.comm import check
from minidist.comm.launch import check_group as _check_group, host_array as _host, launch as _launch
from minidist.layout.split import split_bounds
from minidist.comm.p2p import TAG_COLLECTIVE as TAG, TAG_META, _isend, _recv, _send, _waitall


def _meta(x) -> np.ndarray:
    """A fixed-size record of shape and dtype (reusing the check signature layout)."""
    return np.frombuffer(check.signature("meta", x).tobytes(), np.uint8).copy()


def _from_meta(raw: np.ndarray):
    sig = raw.view(check.SIGNATURE)[0]
    name = sig["dtype"].decode()
    dtype = bfloat16 if name == "bfloat16" else np.dtype(name)
    return tuple(int(v) for v in sig["shape"][:int(sig["ndim"])]), dtype


def scatter(x, g, root: int = 0):
    """Root's ``x`` split along axis 0 like ``np.array_split``; rank i gets part i.
    Non-root ranks may pass None.  Linear: the root sends N-1 messages (each preceded by a
    128-byte shape/dtype header, so receivers need not know the shape in advance)."""
    _check_group(g, "scatter")
    root = check.check_root(root, g, "scatter")
    # Where each part lands: the root's where its array was; the others hold no array to tell,
    # and theirs go to the backend's device (a no-op with NumPy).
    device = on_device(x) if g.rank == root else True
    if g.rank == root:
        x = _host(x, "scatter")
        check.need_axis0(x, "scatter")
        if x.ndim > check.MAX_DIMS:
            raise ValueError(f"scatter: at most {check.MAX_DIMS} dimensions, got shape {x.shape}")
    else:
        x = None
    sig = ("scatter", x, dict(root=root, rule="none"))
    return _launch("scatter", _scatter, g, x, sig, False, root, device=device)


def _scatter(g, x, root):
    if g.rank != root:
        shape, dtype = _from_meta(_recv(g.comm, np.empty(check.SIGNATURE.itemsize, np.uint8), root, TAG_META))
        return _recv(g.comm, np.empty(shape, dtype), root, TAG)
    parts = split_bounds(x.shape[0], g.size)
    requests = []
    for i, (lo, hi) in enumerate(parts):
        if i != root:
            requests += [_isend(g.comm, _meta(x[lo:hi]), i, TAG_META), _isend(g.comm, x[lo:hi], i, TAG)]
    _waitall(requests)
    lo, hi = parts[root]
    return x[lo:hi].copy()


def gather(x, g, root: int = 0):
    """Root gets every rank's ``x`` concatenated along axis 0 (first dims may differ);
    others get None.  Linear: N-1 messages into the root, each after an 8-byte row count."""
    _check_group(g, "gather")
    root = check.check_root(root, g, "gather")
    device, x = on_device(x), _host(x, "gather")
    check.need_axis0(x, "gather")
    sig = ("gather", x, dict(root=root, rule="trailing"))
    return _launch("gather", _gather, g, x, sig, False, root, device=device)


def _gather(g, x, root):
    if g.rank != root:
        _send(g.comm, np.array([x.shape[0]], np.int64), root, TAG_META)
        _send(g.comm, x, root, TAG)
        return None
    rows = np.empty(g.size, np.int64)
    for i in range(g.size):
        rows[i] = x.shape[0] if i == root else _recv(g.comm, np.empty(1, np.int64), i, TAG_META)[0]
    out = np.empty((int(rows.sum()),) + x.shape[1:], x.dtype)
    start = 0
    for i in range(g.size):
        block = out[start:start + rows[i]]
        if i == root:
            block[...] = x
        else:
            _recv(g.comm, block, i, TAG)
        start += rows[i]
    return out
