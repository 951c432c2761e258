"""The context-parallel settings' checks: pure arithmetic on the run configuration, made on every
rank before any message (``parallel.compose.problems`` gathers every axis's)."""

from __future__ import annotations

from minidist.layout.settings import CP_IMPLEMENTATIONS as IMPLEMENTATIONS, cp_unsplit


def problems(given, cfg) -> list[str]:
    """Why the long-sequence settings cannot run (one line each; [] if they can).

    ``given``: the run configuration as the user gave it (None = not given), ``cfg`` resolved.
    With tensor parallelism each rank attends with its ``heads / tp`` heads, so Ulysses splits
    those; sequence parallelism then splits this rank's ``seq_len / cp`` tokens over tp."""
    p, m, g = cfg.parallel, cfg.model, given
    cp, T = p.cp, cfg.data.seq_len
    out = []
    tiled = m.attention == "blockwise" or (cp > 1 and p.cp_impl == "ring")
    if g.model.attention_block is not None and not tiled:
        out.append(f"--attention-block {g.model.attention_block} needs --attention blockwise or ring attention "
                   "(--cp > 1 with --cp-impl ring): plain attention has no blocks")
    if g.parallel.cp_impl is not None and cp == 1:
        out.append(f"--cp-impl {g.parallel.cp_impl} needs --cp greater than 1 (got --cp {cp})")
    if cp == 1:
        return out
    if p.cp_impl not in IMPLEMENTATIONS:
        out.append(f"unknown context-parallel implementation {p.cp_impl!r}; choose from {IMPLEMENTATIONS}")
        return out
    heads = m.heads // p.tp
    unsplit = cp_unsplit(cp, p.cp_impl, T, heads)
    if p.cp_impl == "ring" and unsplit:
        out.append(f"--seq-len {T} is not divisible by 2 x --cp = {2 * cp}: zig-zag ring attention "
                   "gives each rank two equal chunks of every sequence")
    if "heads" in unsplit and p.cp_impl == "ulysses":
        per = f" / --tp {p.tp} = {heads} heads per tensor-parallel rank" if p.tp > 1 else ""
        out.append(f"--heads {m.heads}{per} is not divisible by --cp {cp}: Ulysses gives each rank "
                   "heads / cp of the attention heads")
    if "seq_len" in unsplit and p.cp_impl == "ulysses":
        out.append(f"--seq-len {T} is not divisible by --cp {cp}")
    return out
