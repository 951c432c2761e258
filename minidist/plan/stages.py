"""What each pipeline stage holds: its blocks (cut at whole blocks), how many of them are
mixtures of experts, and the parameters one of its ranks keeps -- the dense ones (split by
tp) and the experts' (split by tp and by ep, GShard's expert parallelism)."""

from __future__ import annotations

import functools

from minidist.layout.model import ModelConfig
from minidist.plan.model import block_params, embedding_params, mlp_params, moe_blocks


@functools.lru_cache(maxsize=4096)
def stage_blocks(layers: int, pp: int) -> tuple:
    """Blocks of each stage, cut at whole blocks: when they do not divide evenly the first and
    the last stage take one block fewer first (they also hold the embedding and the head;
    Llama 3 cut its 126 blocks over 16 stages this way)."""
    base, extra = divmod(layers, pp)
    if not extra:
        return (base,) * pp
    short = pp - extra                     # stages with ``base`` blocks; the others ``base + 1``
    order = [0, pp - 1] + list(range(1, pp - 1)) if pp > 1 else [0]
    fewer = set(order[:short])
    return tuple(base if r in fewer else base + 1 for r in range(pp))


@functools.lru_cache(maxsize=4096)
def stage_mix(m: ModelConfig, pp: int) -> tuple:
    """(dense blocks, mixtures) of each stage, in order."""
    out, first = [], 0
    for b in stage_blocks(m.layers, pp):
        moe = moe_blocks(m, first, first + b)
        out.append((b - moe, moe))
        first += b
    return tuple(out)


def candidate_stages(m: ModelConfig, pp: int) -> list:
    """The stages that can hold the most: the first (the embedding, the most microbatches in
    flight), the first with the most blocks, the last (the head, the logits)."""
    blocks = stage_blocks(m.layers, pp)
    return sorted({0, blocks.index(max(blocks)), pp - 1})


def stage_params(m: ModelConfig, p, stage: int | None = None) -> tuple:
    """(dense, expert) parameters one rank of ``stage`` holds (default: the stage holding the
    most): its blocks split by tp -- a mixture's router with the dense part, its E experts
    over ep ranks -- and the embedding on the first stage, the head (or the tied table again)
    and the final norm on the last."""
    table = m.vocab_size * m.d_model
    rest = embedding_params(m) - table - (table if m.untied else 0)   # positions, final norm
    out = []
    for r in (candidate_stages(m, p.pp) if stage is None else [stage]):
        dense, moe = stage_mix(m, p.pp)[r]
        emb = 0.0
        if r == 0:
            emb += table + rest
        if r == p.pp - 1 and (p.pp > 1 or m.untied):  # the head (untied), or the tied table's copy
            emb += table
        experts = moe * m.experts * mlp_params(m)
        shared = dense * block_params(m) + moe * block_params(m, True) - experts + emb
        out.append((shared / p.tp, experts / p.ep / p.tp))
    return max(out, key=sum)
