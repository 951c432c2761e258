"""What one collective costs on one link: bytes per rank over the bandwidth a collective
reaches, plus a latency per step of its algorithm (the alpha-beta model)."""

from __future__ import annotations


def ring_all_reduce(nbytes: float, n: int, link, eff: float) -> float:
    """Ring all-reduce (Patarasuk & Yuan 2009): 2(N-1)/N x bytes per rank in 2(N-1) steps."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / (link.bw * eff) + 2 * (n - 1) * link.latency


def ring_gather(nbytes: float, n: int, link, eff: float) -> float:
    """Ring all-gather or reduce-scatter of a ``nbytes`` whole: (N-1)/N x bytes in N-1 steps."""
    if n <= 1:
        return 0.0
    return (n - 1) / n * nbytes / (link.bw * eff) + (n - 1) * link.latency


def all_to_all(nbytes: float, n: int, link, eff: float) -> float:
    """Pairwise all-to-all of a rank's ``nbytes`` buffer cut in N parts: it keeps its own part
    and sends the other (N-1)/N, one peer per step, in N-1 steps (GShard's dispatch and combine)."""
    if n <= 1:
        return 0.0
    return (n - 1) / n * nbytes / (link.bw * eff) + (n - 1) * link.latency


def message(nbytes: float, link, eff: float) -> float:
    return nbytes / (link.bw * eff) + link.latency
