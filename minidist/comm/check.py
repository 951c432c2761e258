"""Catching wrong calls: local argument checks, the rooted calls' handshake, and the
optional cross-rank agreement.

Two kinds of mistakes break a collective:

* arguments that are wrong on their own (a root outside the group, an unknown op, a
  permutation with two pairs sending to the same rank).  Every rank sees the same arguments,
  so every rank can raise at once, before any message is sent.  These checks are always on.
* ranks that disagree (rank 0 all-reduces a (4,) array, rank 1 a (5,) one; or rank 1 calls
  all_gather while the others call all_reduce).  No rank can see that alone.  In debug mode
  (``MINIDIST_CHECK_COLLECTIVES=1`` or :func:`set_check`), each collective first all-gathers
  a fixed 128-byte *signature* (op name, dtype, shape, root, ...) with a hand-written Bruck
  all-gather (ceil(log2 N) tiny messages) and every rank raises
  :class:`~minidist.comm.errors.CollectiveMismatchError` listing what each rank called.
  Without debug mode, every message carries its call's identity in its MPI tag
  (identity.py: checked on arrival by p2p.py), and the p2p layer rejects messages of the
  wrong size.  A rooted call (broadcast, reduce, scatter, gather) starts with
  :func:`handshake`: one empty message to the next rank, so that ranks that disagree on the
  root raise even where the algorithm itself would not receive a message (identity.py says
  why).
"""

from __future__ import annotations

import zlib

import numpy as np

from minidist.host import env
from minidist.model.backend import dtype_name
from minidist.comm import stats
from minidist.comm.errors import CollectiveMismatchError
from minidist.comm.p2p import TAG_CHECK, TAG_COLLECTIVE, _sendrecv
from minidist.comm.algorithms.bruck import bruck_all_gather

_enabled = env.get("MINIDIST_CHECK_COLLECTIVES")

MAX_DIMS = 8
SIGNATURE = np.dtype([("name", "S24"), ("dtype", "S16"), ("op", "S8"), ("root", "<i8"),
                      ("ndim", "<i8"), ("shape", "<i8", (MAX_DIMS,)), ("extra", "<i8"),
                      ("rule", "S8")])


def set_check(enabled: bool = True) -> None:
    """Turn the cross-rank signature check on or off (must be the same on every rank)."""
    global _enabled
    _enabled = bool(enabled)


def check_enabled() -> bool:
    return _enabled


# ------------------------------------------------------------------- local checks
def check_root(root, g, where: str) -> int:
    if isinstance(root, bool) or not isinstance(root, (int, np.integer)) or not 0 <= root < g.size:
        raise ValueError(f"{where}: root={root!r} is not a rank of group {g.name!r} (size {g.size})")
    return int(root)


def check_perm(perm, g, where: str = "ppermute") -> list[tuple[int, int]]:
    """Validate a list of (src, dst) pairs: ranks in the group, no repeated src or dst."""
    try:
        pairs = [(int(s), int(d)) for s, d in perm]
    except (TypeError, ValueError):
        raise ValueError(f"{where}: perm={perm!r} must be a list of (src, dst) rank pairs") from None
    for s, d in pairs:
        if not (0 <= s < g.size and 0 <= d < g.size):
            raise ValueError(f"{where}: pair ({s}, {d}) in perm={pairs} has a rank outside "
                             f"group {g.name!r} (size {g.size})")
    for i, what in ((0, "source"), (1, "destination")):
        seen = [p[i] for p in pairs]
        dup = sorted({v for v in seen if seen.count(v) > 1})
        if dup:
            raise ValueError(f"{where}: perm={pairs} repeats {what} rank(s) {dup}; each rank may "
                             f"send at most one message and receive at most one")
    return pairs


def check_counts(counts, g, rows: int, where: str) -> np.ndarray:
    """A row count per rank of ``g`` (non-negative ints summing to ``rows``), as int64."""
    try:
        c = np.asarray(counts)
    except (TypeError, ValueError):
        c = None
    if c is None or c.ndim != 1 or c.size != g.size or not (c.size == 0 or np.issubdtype(c.dtype, np.integer)):
        raise ValueError(f"{where}: counts={counts!r} must be {g.size} integers, one per rank of group {g.name!r}")
    if c.size and c.min() < 0:
        raise ValueError(f"{where}: counts={c.tolist()} has a negative count {int(c.min())}")
    if int(c.sum()) != rows:
        raise ValueError(f"{where}: counts={c.tolist()} sum to {int(c.sum())}, but x has {rows} rows")
    return np.ascontiguousarray(c, np.int64)


def need_axis0(x, where: str) -> None:
    if x.ndim == 0:
        raise ValueError(f"{where}: needs an array with at least 1 dimension (split/concat along "
                         f"axis 0), got a 0-d array")


# --------------------------------------------------------- cross-rank agreement
_EMPTY, _NOTHING = np.empty(0, np.uint8), np.empty(0, np.uint8)  # what the handshake sends, and receives


def handshake(g) -> None:
    """A rooted call's first message: rank r sends an empty message to r+1 and receives one
    from r-1, each carrying the call's identity tag (its root included), so a rank whose
    left neighbour called with another root (or another call) raises CollectiveMismatchError
    before any data moves.  The pattern does not depend on the root, so it cannot hang where
    the ranks disagree on it; it costs one message latency and no bytes."""
    n, r = g.size, g.rank
    _sendrecv(g.comm, _EMPTY, (r + 1) % n, _NOTHING, (r - 1) % n, TAG_COLLECTIVE)


def signature(name: str, x=None, op: str = "", root: int = -1, extra=None, rule: str = "full"):
    """The record every rank contributes: ``rule`` says which part of the shape must agree
    ("full", "trailing" = all but axis 0, "none")."""
    sig = np.zeros((), SIGNATURE)
    sig["name"], sig["op"], sig["root"], sig["rule"] = name.encode(), op.encode(), root, rule.encode()
    sig["ndim"] = -1
    if x is not None:
        sig["dtype"] = dtype_name(x.dtype).encode()[:16]
        sig["ndim"] = x.ndim
        sig["shape"][:min(x.ndim, MAX_DIMS)] = x.shape[:MAX_DIMS]
    if extra is not None:
        sig["extra"] = zlib.crc32(repr(extra).encode())
    return sig


def _describe(sig) -> str:
    name, op = sig["name"].decode(), sig["op"].decode()
    parts = []
    if sig["ndim"] >= 0:
        shape = tuple(int(v) for v in sig["shape"][:min(int(sig["ndim"]), MAX_DIMS)])
        parts += [f"shape={shape}", f"dtype={sig['dtype'].decode()}"]
    if op:
        parts.append(f"op={op}")
    if sig["root"] >= 0:
        parts.append(f"root={int(sig['root'])}")
    if sig["extra"]:
        parts.append(f"args#{int(sig['extra']):08x}")
    return f"{name}({', '.join(parts)})"


def _key(sig):
    rule = sig["rule"].decode()
    key = [sig["name"], sig["op"], int(sig["root"]), int(sig["extra"])]
    if rule != "none":
        dims = [int(v) for v in sig["shape"][:max(0, min(int(sig["ndim"]), MAX_DIMS))]]
        key += [sig["dtype"], int(sig["ndim"]), tuple(dims[1:] if rule == "trailing" else dims)]
    return tuple(key)


def agree(g, sig) -> None:
    """All-gather the signatures; raise on every rank if they differ."""
    raw = np.frombuffer(sig.tobytes(), np.uint8)
    everyone = bruck_all_gather(g, raw, TAG_CHECK).view(SIGNATURE).reshape(-1)
    keys = [_key(s) for s in everyone]
    if all(k == keys[0] for k in keys):
        return
    lines = "\n".join(f"  rank {i}: {_describe(s)}" for i, s in enumerate(everyone))
    raise CollectiveMismatchError(
        f"ranks of group {g.name!r} (size {g.size}) called different collectives "
        f"(this is rank {g.rank}):\n{lines}\nRecent operations on this rank:\n{stats.format_recent()}")
