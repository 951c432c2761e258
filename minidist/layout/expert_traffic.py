"""Bytes one rank sends in expert parallelism's dispatch and combine, in closed form (no MPI).

Expert parallelism (GShard, Lepikhin et al. 2020; parallel/expert/) moves each mixture's
kept (token, choice) rows to the rank holding their expert and the experts' outputs back,
each time with ``all_to_all_v`` (pairwise exchange: ``8(N-1)`` bytes of row counts, then the
rows sent to the other ranks; comm/algorithms/pairwise.py).  Unlike the other axes the
traffic depends on the routing, so the formula takes it as input: ``rows[s][e]``, how many
rows rank ``s`` of the ep group of N sends to expert ``e`` in one mixture's forward (its kept
choices; expert e lives on rank ``e // (E/N)``).  For rank r, with ``d`` the model width
and ``b`` the bytes of an activation element::

    M_out = sum over experts e not on r of rows[r][e]        (rows r sends to the others)
    M_in  = sum over ranks s != r, experts e on r of rows[s][e]  (rows the others send to r)

    forward   counts   8(N-1) + 8(N-1)·E/N   (each peer's E/N per-expert counts: an all_to_all_v)
              dispatch 8(N-1) + M_out·d·b
              combine  8(N-1) + M_in·d·b
    backward  combine's gradient  8(N-1) + M_out·d·b   (counts swapped: the same direction as dispatch)
              dispatch's gradient 8(N-1) + M_in·d·b

so one mixture's forward and backward send ``8(N-1)(E/N + 5) + 2(M_out + M_in)·d·b`` bytes,
and a step sends the sum over its mixtures and micro-batches.  With balanced routing of n
local tokens, k choices each and nothing dropped, ``M_out = M_in = n·k·(N-1)/N``.
tests/test_router_stats.py checks it against ``comm.stats``' counted bytes on the ep group.
"""

from __future__ import annotations

COUNT = 8  # an int64 row count


def mixture_bytes(rows: list[list[int]], rank: int, d_model: int, itemsize: int,
                  backward: bool = True) -> dict[str, int]:
    """Bytes ``rank`` sends for one mixture's forward (and backward) on an ep group of
    ``len(rows)`` ranks: ``{"counts", "dispatch", "combine"}`` (module docstring; the
    backward's gradients are counted with the exchange whose direction they share:
    combine's gradient under dispatch, dispatch's under combine)."""
    n, experts = len(rows), len(rows[0])
    per = experts // n
    mine = range(rank * per, (rank + 1) * per)
    m_out = sum(c for e, c in enumerate(rows[rank]) if e not in mine)
    m_in = sum(rows[s][e] for s in range(n) if s != rank for e in mine)
    passes = 2 if backward else 1
    sizes = COUNT * (n - 1)  # all_to_all_v's exchange of row counts
    return {"counts": sizes + COUNT * per * (n - 1),
            "dispatch": passes * (sizes + m_out * d_model * itemsize),
            "combine": passes * (sizes + m_in * d_model * itemsize)}


def ep_step_bytes(forwards: list[list[list[int]]], rank: int, d_model: int, itemsize: int,
                  backward: bool = True) -> int:
    """Bytes ``rank`` sends on its ep group in a step whose mixtures' forwards (every
    mixture of every micro-batch, in any order) routed ``forwards[i][s][e]`` rows from rank
    s to expert e: the sum of :func:`mixture_bytes`."""
    return sum(sum(mixture_bytes(rows, rank, d_model, itemsize, backward).values()) for rows in forwards)


def balanced_ep_step_bytes(tokens: int, top_k: int, experts: int, ep: int, d_model: int, itemsize: int,
                           mixtures: int, micro_steps: int = 1) -> float:
    """:func:`ep_step_bytes` when every rank's ``tokens`` per micro-step spread evenly over the
    experts and nothing is dropped: ``M_out = M_in = tokens·k·(N-1)/N`` (a planning figure)."""
    m = tokens * top_k * (ep - 1) / ep
    per_mixture = COUNT * (ep - 1) * (experts / ep + 5) + 4 * m * d_model * itemsize
    return mixtures * micro_steps * per_mixture
