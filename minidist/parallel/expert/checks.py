"""The expert-parallel settings' checks: one line per reason they cannot run, before any message."""

from __future__ import annotations


def problems(given, cfg) -> list[str]:
    """Why ``--ep`` cannot run (one line each; [] if it can).

    ``given`` is the run configuration as the user gave it, ``cfg`` the same resolved.  The
    experts of every mixture split over ``ep`` ranks of the data-parallel group (the
    ``("dp", "cp")`` ranks, which hold the same dense parameters and see different tokens), so
    ``ep`` divides both the experts and that group."""
    p, m = cfg.parallel, cfg.model
    out = []
    if p.ep > 1 and not m.experts:
        return [f"--ep {p.ep} splits the experts of a mixture over ranks: it needs --experts E"]
    if m.experts and m.experts % p.ep:
        out.append(f"--ep {p.ep} does not divide --experts {m.experts}: every rank holds as many experts")
    replicas = p.dp * p.cp
    if replicas % p.ep:
        over = f"--dp {p.dp} x --cp {p.cp} = {replicas}" if p.cp > 1 else f"--dp {p.dp}"
        out.append(f"--ep {p.ep} does not divide the data-parallel ranks ({over}): the experts split over "
                   "ranks of the data-parallel group")
    return out
