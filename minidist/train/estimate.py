"""The memory a training step needs on this machine, estimated before anything is allocated.

``validate`` (``flags.py``) refuses a run whose estimate exceeds the memory available, on every
rank before any message; the formulas for one rank's share are
:func:`minidist.host.cli_checks.training_memory_bytes`, the sharding divisors
:func:`minidist.layout.memory.zero_divisors`.
"""

from __future__ import annotations

import os

from minidist.host.cli_checks import training_memory_bytes
from minidist.host.oversubscribed import local_ranks
from minidist.layout.memory import zero_divisors
from minidist.train.config import RunConfig


def memory_estimate(cfg: RunConfig) -> dict:
    """The estimated peak bytes of a training step on the ranks that share this machine's
    memory, by part (cli_checks.training_memory_bytes for one rank's share; ``ranks``: how
    many ranks it counts, ``per_rank``: one rank's total).

    One rank holds its pipeline stage's layers (embeddings counted on every stage: small,
    and an over-estimate is the safe side), 1/tp of their weights, and of those ZeRO's 1/dp
    (1: optimizer state; 2: and gradients; 3: and weights; HSDP: 1/K); it computes its dp
    rows of the batch and its seq/cp tokens, and a pipeline keeps the activations of its
    microbatches in flight (GPipe: all of them; 1F1B: at most pp, interleaved a few more).
    ZeRO-3 gathers each block's weights again for backward and recomputes the block, so it
    keeps activations as activation checkpointing does."""
    from minidist.state.data import DEFAULT_MAX_BYTES

    m, d, dev, p = cfg.model, cfg.data, cfg.device, cfg.parallel
    # token shards are memory-mapped: the pages the batches touch, not the corpus, are in memory
    data_bytes = (0 if os.path.isdir(d.data) else os.path.getsize(d.data)) if d.data else DEFAULT_MAX_BYTES
    rows = max(1, d.batch_size // p.dp)
    accum = dev.grad_accum
    if p.pp > 1:  # microbatches split the rows; only those in flight keep their activations
        # ZB-H2's longer warm-up; ZB-V's 2P half-stage chunks are P microbatches' worth
        held = {"zb-h2": 2 * p.pp - 1, "zbv": p.pp}.get(p.schedule, p.pp * p.virtual_stages)
        in_flight = p.microbatches if p.schedule == "gpipe" else min(p.microbatches, held)
        accum = max(1, accum * p.microbatches // in_flight)
    est = training_memory_bytes(-(-m.layers // p.pp), m.d_model, m.heads, d.seq_len // p.cp, m.block_size, rows,
                                accum, m.dtype, dev.mixed_precision, dev.checkpoint_activations or p.zero == 3,
                                cfg.optim.optimizer, not m.untied, data_bytes=data_bytes,
                                eval_batches=cfg.report.eval_batches if cfg.report.eval_every else 0,
                                score_values=score_values(cfg), tp=p.tp, sequence_parallel=p.sequence_parallel,
                                vocab_size=m.vocab_size)
    states = 2 if cfg.optim.optimizer == "adamw" else 1
    shard = p.hsdp_shard or p.dp * p.cp  # ZeRO's partition: the data-parallel (dp x cp) group, or HSDP's
    div = zero_divisors(p.zero, shard)
    weights, grads, state = (1 / p.tp / div[part] for part in ("params", "grads", "optimizer"))
    key = "weights, gradients and optimizer state"
    est[key] = int(est[key] * (weights + grads + states * state) / (2 + states))
    ranks = min(p.world_size, local_ranks() or p.world_size)  # the launcher says; else all of them
    per_rank = sum(n for name, n in est.items() if name != "total")
    out = {name: n * ranks for name, n in est.items() if name != "total"}
    out["total"] = per_rank * ranks
    return {**out, "ranks": ranks, "per_rank": per_rank}


def score_values(cfg: RunConfig) -> int:
    """Attention scores one block keeps per sequence on one rank (its heads/tp), for the memory estimate:
    plain attention keeps H x T x T, blockwise one tile per head; ring attention one tile of
    its chunks; Ulysses its H / C heads over the whole sequence."""
    T, p = cfg.data.seq_len, cfg.parallel
    H = cfg.model.heads // p.tp  # tensor parallelism splits the heads
    block = cfg.model.attention_block or 128
    if p.cp > 1 and p.cp_impl == "ring":
        return H * min(block, max(1, T // (2 * p.cp))) ** 2
    heads = H // p.cp if p.cp > 1 else H
    return heads * (min(block, T) ** 2 if cfg.model.attention == "blockwise" else T * T)
