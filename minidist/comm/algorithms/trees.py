"""Binomial trees and the dissemination barrier: ceil(log2 N) rounds for rooted and empty messages.

MPICH's short-message broadcast and reduce (Thakur, Rabenseifner & Gropp 2005).  Ranks are
numbered relative to the root (vr = r - root), which becomes 0.
"""

from __future__ import annotations

import numpy as np

from minidist.comm.p2p import TAG_COLLECTIVE as TAG, _recv, _send, _sendrecv


def binomial_broadcast(g, buf: np.ndarray, root: int) -> None:
    """Broadcast ``buf`` from ``root``: in round k every rank that has the data sends it to
    the rank 2^k further on, so the holders double.  Each rank receives X once; the root
    sends the most, log2(N) * X."""
    n = g.size
    vr = (g.rank - root) % n
    mask = 1
    while mask < n:
        if vr & mask:
            _recv(g.comm, buf, (vr - mask + root) % n, TAG)
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:
        if vr + mask < n:
            _send(g.comm, buf, (vr + mask + root) % n, TAG)
        mask >>= 1


def binomial_reduce(g, acc: np.ndarray, root: int, ufunc) -> None:
    """Reduce ``acc`` in place onto ``root`` (a broadcast run backwards): in round k ranks
    whose relative rank has bit k set send their partial result 2^k down and drop out.
    Each rank sends X at most once; the root receives log2(N) * X."""
    n = g.size
    vr = (g.rank - root) % n
    tmp = g.scratch("tree_tmp", acc.size, acc.dtype)
    mask = 1
    while mask < n:
        if vr & mask:
            _send(g.comm, acc, (vr - mask + root) % n, TAG)
            return
        if vr + mask < n:
            _recv(g.comm, tmp, (vr + mask + root) % n, TAG)
            ufunc(acc, tmp, out=acc)
        mask <<= 1


def dissemination_barrier(g) -> None:
    """Barrier by dissemination (Hensgen, Finkel & Manber 1988): in round k rank r signals
    r + 2^k and waits for r - 2^k.  After ceil(log2 N) rounds every rank has (transitively)
    heard from every other, so none can leave before all have arrived."""
    n, r = g.size, g.rank
    empty = np.empty(0, np.uint8)
    dist = 1
    while dist < n:
        _sendrecv(g.comm, empty, (r + dist) % n, empty, (r - dist) % n, TAG)
        dist <<= 1
