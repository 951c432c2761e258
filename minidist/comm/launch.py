"""Plumbing shared by every public collective: argument coercion, and running a collective's
body here or on the group's progress thread, inside its stats scope and (in debug mode)
after the cross-rank signature check.
"""

from __future__ import annotations

import zlib

import numpy as np

from minidist.model.backend import from_host, to_host
from minidist.comm import check, identity, stats
from minidist.comm.group import Group


def host_array(x, where: str) -> np.ndarray:
    h = to_host(x)
    if isinstance(h, np.generic):  # a NumPy scalar, e.g. a loss value
        h = np.asarray(h)
    if not isinstance(h, np.ndarray):
        raise TypeError(f"{where}: expected an array, got {type(x).__name__}")
    if h.dtype.hasobject:
        raise TypeError(f"{where}: arrays of Python objects (dtype {h.dtype}) cannot be sent")
    return h if h.flags.c_contiguous else np.ascontiguousarray(h)


def check_group(g, where: str) -> None:
    if not isinstance(g, Group):
        raise TypeError(f"{where}: expected a comm.Group as the group, got {type(g).__name__}")


def launch(name: str, body, g, x, sig, async_op: bool, *args, algorithm: str | None = None, device: bool):
    """Run ``body(g, x, *args)`` here or on the group's progress thread.

    ``x`` is the host copy of the caller's array; ``device`` says whether the caller's array
    was on the device, and the result goes where it was (a host array's collective -- a loss,
    a flag -- stays on the host: no round trip through the device and back).

    ``sig`` = (name, x, keyword arguments of check.signature); the signature is only built
    (and agreed on) in debug mode, keeping the default path cheap for small messages.  Its
    identity (:func:`call_identity`, with the ``algorithm`` that runs) tags every message
    of the call; a rooted call (a ``root`` in ``sig``) first checks it with its ring
    neighbours (check.handshake), unless the debug mode agreed on everything already.
    """
    stats.note_op(name, g.name, None if x is None else x.shape, None if x is None else x.dtype,
                  "async" if async_op else "")
    ident = call_identity(*sig, algorithm=algorithm)
    rooted = "root" in sig[2]
    sig = check.signature(sig[0], sig[1], **sig[2]) if check.check_enabled() else None
    if async_op:  # the progress thread runs on this thread's GPU (comm/progress.py)
        return g.submit(name, _run, name, body, x, sig, ident, rooted, args, device)
    return _run(g, name, body, x, sig, ident, rooted, args, device)


def call_identity(name, x, kw, algorithm=None) -> int | None:
    """The identity tag (identity.identity) of a call with check.signature's arguments: its
    name, op and root (ppermute: a hash of its pairs), the dtype unless the shape ``rule``
    is "none" (scatter: only the root has an array), the size only where it must agree
    ("full": not all_gather's or gather's rows, which may differ), and the ``algorithm``
    that runs."""
    rule = kw.get("rule", "full")
    dtype = x.dtype if x is not None and rule != "none" else None
    root = kw.get("root")
    if name == "ppermute":  # the permutation must agree too: a hash of it rides in the root's bits
        root = zlib.crc32(repr(sorted(kw["extra"])).encode())
    return identity.identity(name, kw.get("op", ""), dtype, x.nbytes if x is not None and rule == "full" else None,
                             algorithm, root)


def _run(g, name, body, x, sig, ident, rooted, args, device):
    """``device``: bring the result to this thread's current GPU (True) or leave it on the host
    (a result that is a tuple, all_to_all_v's (rows, counts): its first array only)."""
    with stats.scope(name, ident, g.name):
        if sig is not None:
            check.agree(g, sig)
        elif rooted and ident is not None and g.size > 1:
            check.handshake(g)
        result = body(g, x, *args)
    if not device or result is None:
        return result
    return (from_host(result[0]),) + tuple(result[1:]) if isinstance(result, tuple) else from_host(result)


def check_out(out, x, where: str, shape=None):
    """``out=``: a preallocated result array (C-contiguous NumPy, x's dtype), so repeated
    large collectives (gradient buckets, benchmarks) reuse memory instead of page-faulting
    a fresh result each call, just like MPI's caller-provided receive buffers."""
    if out is None:
        return None
    if not isinstance(out, np.ndarray) or not out.flags.c_contiguous or out.dtype != x.dtype:
        raise ValueError(f"{where}: out must be a C-contiguous host array of dtype {x.dtype}, got "
                         f"{type(out).__name__} {getattr(out, 'dtype', '')}")
    if not out.flags.writeable:
        raise ValueError(f"{where}: out is read-only (out.flags.writeable is False)")
    if shape is not None and out.shape != tuple(shape):
        raise ValueError(f"{where}: out.shape={out.shape} but the result has shape {tuple(shape)}")
    return out


def check_algorithm(algorithm, choices, where: str):
    if algorithm not in choices:
        raise ValueError(f"{where}: algorithm={algorithm!r}; choose one of {list(choices)}")
    return algorithm
